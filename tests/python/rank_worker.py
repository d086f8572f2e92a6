"""What the ranks of the distributed tests (ddp_worker.py, fsdp_worker.py) share: each rank's
own session and store directory, and the result written once every rank is done."""

import json
import os

import torch.distributed as dist

import tidal


def rank_session(mode, store_root, model, opt):
    """None in mode "none", else a Session in `mode` whose store directory is the rank's own
    (STORE_ROOT/MODE-{rank}: every rank has its own directory, store and plan)."""
    if mode == "none":
        return None
    plan = {"budget": "50%"} if mode == "plan" else {}  # a plan-mode option
    return tidal.Session(mode=mode, dirs=[os.path.join(store_root, mode + "-{rank}")],
                         capacity="256MiB", min_bytes="64KiB", model=model, optimizer=opt,
                         **plan)


def rank_store_dir(store_root, mode) -> dict:
    """The directory this rank's session stored in ("dir"), and whether it is still there."""
    d = os.path.join(store_root, mode + "-" + str(dist.get_rank()))
    return {"dir": d, "dir_exists": os.path.isdir(d)}


def finish(result: dict, out_path: str) -> None:
    """Waits for the other ranks, leaves the process group and writes `result` as JSON."""
    dist.barrier()
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)
