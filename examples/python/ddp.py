"""The small GPT with DistributedDataParallel, one tidal Session per rank.

With the project's environment (scripts/setup.sh):
    PYTHONPATH=build/python .venv/bin/torchrun --nproc_per_node 2 examples/python/ddp.py \
        --mode plan --dir '/var/tmp/tidal/r{rank}'

Each rank trains on its own batches, has its own store directory ({rank} and {local_rank} in
--dir are replaced; a directory without a placeholder gets a rank<N> subdirectory) and plans its
own trace. gloo on CPU, NCCL when CUDA is there (CUDA tensors through the Python API are not
tested yet: see docs/python.md).
"""

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import tidal
from gpt import GPT, CharCorpus, add_model_args, train_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--mode", choices=["none", "activations", "plan"], default="plan")
    p.add_argument("--dir", action="append", help="store directory; {rank} is replaced")
    p.add_argument("--budget", default="50%")
    p.add_argument("--min-bytes", default="1MiB")
    p.add_argument("--capacity", default="4GiB")
    a = p.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method="env://")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))

    torch.manual_seed(a.seed)  # the same initial weights on every rank
    corpus = CharCorpus(a.text)
    model = DDP(GPT(corpus.vocab, a.layers, a.d, a.heads, a.block))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    g = torch.Generator().manual_seed(a.seed + 1000 * rank)  # each rank its own batches
    session = None
    if a.mode != "none":
        plan = {"budget": a.budget} if a.mode == "plan" else {}  # a plan-mode option
        session = tidal.Session(mode=a.mode, dirs=a.dir, capacity=a.capacity,
                                min_bytes=a.min_bytes, model=model, optimizer=opt, name="gpt",
                                **plan)
    # Steps before the mode runs as it will: plan mode warms up, profiles two steps, and its
    # first executed step still brings memory down; activation mode offloads from step 2.
    skip = 4 if a.mode == "plan" else 2
    times, peaks = [], []
    for step in range(a.steps):
        x, y = corpus.batch(g, a.batch, a.block)
        loss, seconds, peak = train_step(model, opt, x, y, session=session)
        times.append(seconds)
        peaks.append(peak)
        print(f"rank {rank} step {step:3d}  loss {loss.item():.6f}  {1e3 * times[-1]:8.1f} ms  "
              f"peak {tidal.format_bytes(peaks[-1])}  {session.stats() if session else ''}",
              flush=True)
    store = session.store_stats() if session else None
    print(f"summary: rank {rank} mode {a.mode}, median step "
          f"{1e3 * statistics.median(times[skip:] or times):.1f} ms, peak "
          f"{tidal.format_bytes(max(peaks[skip:] or peaks))}, store wrote "
          f"{tidal.format_bytes(store['bytes_written'] if store else 0)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
