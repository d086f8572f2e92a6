"""Hugging Face models with tidal, side by side in one run: Llama, GPT-2 and Qwen2-MoE built
from configs (random weights, no download), trained on this repository's text as bytes, in
modes none, activations and plan. Prints a markdown table: peak and median step time against
none, bytes written per step, plan mode's shapes, and whether the losses are identical.

    PYTHONPATH=build/python .venv/bin/python bench/hf_models.py [--steps 12] [--dir D]
"""

import argparse
import os
import statistics
import sys
import time

import torch

import tidal

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "python"))
import test_hf as hf  # noqa: E402  (the models and text of the tests, larger here)


def run(family, data, mode, store):
    model = hf.make(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opts = {"mode": mode}
    if mode != "none":
        opts.update(dirs=[store], capacity="2GiB", min_bytes="64KiB")
    if mode == "activations":
        opts["adaptive"] = False
    if mode == "plan":
        opts["budget"] = "50%"
    session = tidal.Session(model=model, optimizer=opt, **opts)
    losses, times, stats = [], [], []
    for x in data:
        t0 = time.perf_counter()
        with session.step():
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        stats.append(session.stats())
    session.close()
    late = stats[4:]  # after warm-up, profiling (plan) and the reference step (activations)
    return {"losses": losses, "peak": max(s.step_peak for s in late),
            "time": statistics.median(times[4:]),
            "written": statistics.mean(s.bytes_written for s in late),
            "shapes": stats[-1].shapes, "within": stats[-1].within_budget}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dir", default="/var/tmp/tidal-hf-bench")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    hf.SEQ, hf.BATCH, hf.HIDDEN, hf.LAYERS = 128, 8, a.hidden, a.layers
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; hidden {a.hidden}, "
          f"{a.layers} layers, batch {hf.BATCH}, seq {hf.SEQ}, {a.steps} steps (figures over "
          f"steps 5-{a.steps})\n")
    print("| model | mode | peak MiB | x none | step s | x none | MiB written/step | shapes "
          "| same losses |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family in ("llama", "gpt2", "qwen2_moe"):
        data = hf.batches(a.steps, seed=2)
        ref = run(family, data, "none", a.dir)
        for mode in ("none", "activations", "plan"):
            r = ref if mode == "none" else run(family, data, mode, a.dir)
            extra = f" ({'met' if r['within'] else 'missed'})" if mode == "plan" else ""
            print(f"| {family} | {mode}{extra} | {r['peak'] / 2**20:.1f} | "
                  f"{r['peak'] / ref['peak']:.2f} | {r['time']:.3f} | "
                  f"{r['time'] / ref['time']:.2f} | {r['written'] / 2**20:.1f} | "
                  f"{r['shapes'] if mode == 'plan' else '-'} | "
                  f"{'yes' if r['losses'] == ref['losses'] else 'NO'} |", flush=True)


if __name__ == "__main__":
    main()
