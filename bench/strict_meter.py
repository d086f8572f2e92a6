"""Plan mode under the strict meter, on an ordinary PyTorch GPT (examples/python/gpt.py) with
Adam: the same steps without tidal, then with Session(strict=True) at a share of the profiled
peak, for each step-boundary choice. Prints, per run: losses bit-identical or not, the budget,
the highest executed step peak, refusals (torch.OutOfMemoryError: a GPU with that much memory
would have failed there), bytes the reclaimer wrote out, and the median executed step time
against the unconstrained run's, measured side by side in this process.

    PYTHONPATH=build/python .venv/bin/python bench/strict_meter.py --steps 10 --budget 50%

What it does not show: warm-up and profiling (the first three steps) still run without the
wall (issue 24's step-0 policy is not built yet); they are excluded from the peaks below and
their peak is printed apart.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile

import torch

import tidal

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "python"))
from gpt import GPT, CharCorpus, add_model_args, train_step  # noqa: E402


def run(args, corpus, session_args=None, store=None):
    torch.manual_seed(args.seed)
    model = GPT(corpus.vocab, args.layers, args.d, args.heads, args.block)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    session = None
    if session_args is not None:
        session = tidal.Session(mode="plan", dirs=[store], model=model, optimizer=opt,
                                capacity="4GiB", strict=True, **session_args)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses, seconds, peaks, stats = [], [], [], []
    refused_before = tidal.memory_stats()["refusals"]
    reclaimed_before = tidal.memory_stats()["reclaimed_bytes"]
    error = ""
    for _ in range(args.steps):
        x, y = corpus.batch(g, args.batch, args.block)
        try:
            loss, dt, peak = train_step(model, opt, x, y, session=session)
        except torch.OutOfMemoryError as e:
            error = str(e).split(".")[0]
            break
        losses.append(loss.item())
        seconds.append(dt)
        peaks.append(peak)
        if session is not None:
            stats.append(session.stats())
    refusals = tidal.memory_stats()["refusals"] - refused_before
    reclaimed = tidal.memory_stats()["reclaimed_bytes"] - reclaimed_before
    del session
    return losses, seconds, peaks, stats, refusals, reclaimed, error


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p)
    p.add_argument("--budget", default="50%")
    p.add_argument("--dir", default=os.environ.get("TIDAL_BENCH_DIR", "/var/tmp"))
    args = p.parse_args()
    corpus = CharCorpus(args.text)
    ref_losses, ref_seconds, ref_peaks, _, _, _, _ = run(args, corpus)
    first = 3  # warm-up and two profiled steps
    ref_step = statistics.median(ref_seconds[first:])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, GPT {args.layers}x"
          f"{args.d}, batch {args.batch}x{args.block}, {args.steps} steps; unconstrained peak "
          f"{tidal.format_bytes(max(ref_peaks))}, step {ref_step * 1e3:.0f} ms")
    print(f"{'between steps':14} {'losses':10} {'budget':>10} {'exec peak':>10} "
          f"{'warm/prof peak':>14} {'refused':>7} {'reclaimed':>10} {'step/none':>9}  note")
    for between in ("offloaded", "resident"):
        store = tempfile.mkdtemp(prefix="tidal-strict-", dir=args.dir)
        try:
            losses, seconds, peaks, stats, refusals, reclaimed, error = run(
                args, corpus, {"budget": args.budget, "between_steps": between}, store)
        finally:
            shutil.rmtree(store, ignore_errors=True)
        same = losses == ref_losses[:len(losses)] and len(losses) == len(ref_losses)
        last = stats[-1] if stats else None
        budget = last.memory_budget if last else 0
        executed = [s.step_peak for s in stats[first:]]
        ratio = (statistics.median(seconds[first:]) / ref_step) if len(seconds) > first else None
        note = error or (last.budget_reason if last and not last.within_budget else "")
        print(f"{between:14} {'identical' if same else 'DIFFER':10} "
              f"{tidal.format_bytes(budget):>10} "
              f"{tidal.format_bytes(max(executed)) if executed else 'not run':>10} "
              f"{tidal.format_bytes(max(peaks[:first])) if peaks else 'not run':>14} "
              f"{refusals:>7} "
              f"{tidal.format_bytes(reclaimed):>10} "
              f"{f'{ratio:.2f}x' if ratio else 'not run':>9}  {note[:90]}")


if __name__ == "__main__":
    main()
