"""One rank of the DDP test (test_distributed.py): trains the same model without tidal, with
activation offloading and in plan mode, each with its own Session and store directory, and
writes the losses. Launched with the env:// variables torchrun sets (MASTER_ADDR, MASTER_PORT,
RANK, WORLD_SIZE, LOCAL_RANK)."""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import batches, loop_step, make_mlp  # noqa: E402
from rank_worker import finish, rank_session, rank_store_dir  # noqa: E402

STEPS = 6
REPEATS = 20


def train(mode, store_root, wrap):
    model = wrap(make_mlp(seed=5, width=512))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    session = rank_session(mode, store_root, model, opt)
    losses, written = [], 0
    for x, y in batches(seed=100 + dist.get_rank(), steps=STEPS):
        loss = loop_step(model, opt, x, y, session)
        if session:
            written += session.stats().bytes_written
        losses.append(loss.item())
    out = {"losses": losses, "bytes_written": written}
    if session:
        out["state"] = session.stats().state
        out.update(rank_store_dir(store_root, mode))
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
    finish(result, out_path)


if __name__ == "__main__":
    main()
