"""Larger than memory from step 0, under the strict meter (issue 24's benchmark).

Two programs, each with its model state (parameters, gradients, Adam's two moments) at 2x and
at 4x the memory budget, trained in plan mode with its default options, the strict meter and a
budget in bytes, so that the budget is a wall from step 0 (warm-up and profiling included),
beside the same steps without tidal in the same run (the step boundary is the planner's choice,
which it prints):
  - tidal's GPT, through `tidal-torch train` (C++);
  - an ordinary PyTorch GPT (examples/python/gpt.py) with torch.optim.Adam, in Python.
For each it prints the highest step peak of the warm-up and profiled steps and of the executed
steps against the budget, whether any allocation was refused (a GPU with that much memory would
have failed there), whether the losses are bit-identical to the unconstrained run, and the
executed steps' median time against the unconstrained run's, with the plan's predicted step time
beside it. The store is O_DIRECT on --dir. Run by bench/larger_than_memory.sh.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import torch

import tidal

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples", "python"))
from gpt import GPT, CharCorpus  # noqa: E402

FIRST = 3  # warm-up and two profiled steps


def mib(b):
    return f"{b / 2**20:.1f}"


def row(program, ratio, budget, state, warm, executed, refused, same, step, none_step, planned):
    over = max(warm + executed) > budget
    print(f"{program:10} {ratio:>5} {mib(state):>9} {mib(budget):>9} {mib(max(warm)):>10} "
          f"{mib(max(executed)) if executed else 'not run':>10} {'YES' if over else 'no':>5} "
          f"{refused:>7} {'identical' if same else 'DIFFER':>9} "
          f"{f'{step / none_step:.2f}x' if step else 'not run':>9} "
          f"{f'{planned / none_step:.2f}x' if planned else 'not measured':>12}")
    return not over and same and refused == 0


def cli_runs(args, store):
    exe = args.tidal_torch
    model = ["--model", "gpt-tiny", "--hidden", str(args.cli_hidden), "--layers",
             str(args.cli_layers), "--batch", "2", "--seq", "64", "--steps", str(args.steps)]

    def run(extra):
        out = subprocess.run([exe, "train", *model, "--json", *extra], check=True,
                             capture_output=True, text=True).stdout.strip().splitlines()[-1]
        return json.loads(out)

    none = run(["--offload", "none"])
    state = 4 * 4 * none["parameters"]  # fp32 parameters, gradients, and AdamW's two moments
    none_step = statistics.median(none["step_seconds"][FIRST:])
    ok = True
    for ratio in (2, 4):
        budget = state // ratio
        r = run(["--offload", "plan", "--mem-budget", str(budget),
                 "--strict-meter", "--dir", store])
        peaks = r["step_peak_bytes"]
        print(f"  tidal GPT {ratio}x: step boundary {r.get('between_steps', 'not said')}")
        ok &= row("tidal GPT", f"{ratio}x", budget, state, peaks[:FIRST], peaks[FIRST:], 0,
                  r["losses"] == none["losses"], statistics.median(r["step_seconds"][FIRST:]),
                  none_step, r.get("planned_step_seconds", 0))
    return ok, none_step


def python_run(args, corpus, store=None, budget=0):
    torch.manual_seed(args.seed)
    model = GPT(corpus.vocab, args.py_layers, args.py_d, 4, 64)
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    session = None
    if budget:
        session = tidal.Session(mode="plan", dirs=[store], budget=budget, capacity="4GiB",
                                model=model, optimizer=opt, strict=True)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses, seconds, peaks, planned, boundary = [], [], [], 0.0, ""

    refused = tidal.memory_stats()["refusals"]
    import time
    for _ in range(args.steps):
        x, y = corpus.batch(g, 2, 64)
        tidal.reset_peak_memory()
        t0 = time.perf_counter()
        if session:
            session.begin_step()
        opt.zero_grad()
        try:
            loss = model(x, y)
            loss.backward()
            opt.step()
        except torch.OutOfMemoryError as e:
            print("  refused:", str(e).split(". ")[0])
            break
        if session:
            session.end_step()
            planned = session.stats().planned_step_seconds or planned
            boundary = session.stats().between_steps
        seconds.append(time.perf_counter() - t0)
        peaks.append(tidal.memory_stats()["peak_bytes"])
        losses.append(loss.item())
    params = sum(p.numel() for p in model.parameters())
    del session
    if budget:
        print(f"  PyTorch LM: step boundary {boundary or 'not said'}")
    return losses, seconds, peaks, planned, tidal.memory_stats()["refusals"] - refused, params


def python_runs(args, store):
    corpus = CharCorpus(args.text)
    losses, seconds, _, _, _, params = python_run(args, corpus)
    state = 4 * 4 * params
    none_step = statistics.median(seconds[FIRST:])
    ok = True
    for ratio in (2, 4):
        budget = state // ratio
        l, s, p, planned, refused, _ = python_run(args, corpus, store, budget)
        ok &= row("PyTorch LM", f"{ratio}x", budget, state, p[:FIRST], p[FIRST:], refused,
                  l == losses, statistics.median(s[FIRST:]) if len(s) > FIRST else 0,
                  none_step, planned)
    return ok, none_step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tidal-torch", default=os.path.join(HERE, "..", "build", "tidal-torch"))
    p.add_argument("--dir", default=os.environ.get("TIDAL_BENCH_DIR", "/var/tmp"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cli-hidden", type=int, default=512)
    p.add_argument("--cli-layers", type=int, default=6)
    p.add_argument("--py-d", type=int, default=512)
    p.add_argument("--py-layers", type=int, default=4)
    p.add_argument("--text", default=os.path.join(HERE, "..", "README.md"))
    args = p.parse_args()
    store = tempfile.mkdtemp(prefix="tidal-ltm-", dir=args.dir)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, store {args.dir} "
          f"(O_DIRECT), {args.steps} steps, the first {FIRST} warm-up and profiling")
    print(f"{'program':10} {'state':>5} {'state MiB':>9} {'budget':>9} {'warm peak':>10} "
          f"{'exec peak':>10} {'over':>5} {'refused':>7} {'losses':>9} {'step/none':>9} "
          f"{'planned/none':>12}")
    try:
        ok_cli, _ = cli_runs(args, store)
        ok_py, _ = python_runs(args, store)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    print("every step within its budget, bit-identical:", "yes" if ok_cli and ok_py else "NO")
    sys.exit(0 if ok_cli and ok_py else 1)


if __name__ == "__main__":
    main()
