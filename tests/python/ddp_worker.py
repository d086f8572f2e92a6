"""One rank of the DDP test (test_distributed.py): trains the same model without tidal, with
activation offloading and in plan mode, each with its own Session and store directory, and
writes the losses. Launched with the env:// variables torchrun sets (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK)."""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import batches, make_mlp  # noqa: E402

STEPS = 6
REPEATS = 20


def train(mode, store_root, wrap):
    model = wrap(make_mlp(seed=5, width=512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = None
    if mode != "none":
        # {rank}: every rank has its own directory, store and plan.
        plan = {"budget": "50%"} if mode == "plan" else {}  # a plan-mode option
        session = tidal.Session(mode=mode, dirs=[os.path.join(store_root, mode + "-{rank}")],
                                capacity="256MiB", min_bytes="64KiB", model=model, optimizer=opt,
                                **plan)
    losses, written = [], 0
    for x, y in batches(seed=100 + dist.get_rank(), steps=STEPS):
        if session:
            session.begin_step()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if session:
            session.end_step()
            written += session.stats().bytes_written
        losses.append(loss.item())
    out = {"losses": losses, "bytes_written": written}
    if session:
        out["state"] = session.stats().state
        out["dir"] = os.path.join(store_root, mode + "-" + str(dist.get_rank()))
        out["dir_exists"] = os.path.isdir(out["dir"])
    return out


def main():
    kind, store_root, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    assert kind in ("ddp", "ddp-repeat"), kind
    wrap = DDP
    result = {"rank": dist.get_rank(), "world": dist.get_world_size()}
    if kind == "ddp":
        for mode in ("none", "activations", "plan"):
            result[mode] = train(mode, store_root, wrap)
    else:
        # Plan mode again and again, each run a new model, session and store: the all-reduce
        # overlaps backward (tidal's hook holds the bucket, it does not wait), so a race between
        # the executor and the backend's thread would show as a loss that differs in some run.
        result["none"] = train("none", store_root, wrap)
        result["runs"] = [train("plan", store_root, wrap) for _ in range(REPEATS)]
    dist.barrier()
    dist.destroy_process_group()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
