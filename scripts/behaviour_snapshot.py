#!/usr/bin/env python3
"""Snapshot what tidal's planner and simulator decide, for checking that a refactor changes nothing.

    scripts/behaviour_snapshot.py OUT_DIR [--bin ./build/tidal] [--shapes 20] [--losses]

Writes one file per case under OUT_DIR: `tidal simulate --json` and `tidal plan --out` (the whole
plan) on the paper grid's cases (bench/paper_grid.sh's command lines, SSD-only and with host
memory) and on the first shapes of the shape fuzz (bench/shape_fuzz.sh, seed 1), and on cases whose budget
binds hard (on a host-rich one-SSD machine, with and without host memory). Wall-clock fields
(planning and stage timings) and source locations in messages are dropped, so two snapshots of the same behaviour are byte-identical:

    scripts/behaviour_snapshot.py /tmp/before --bin /tmp/tidal-before
    scripts/behaviour_snapshot.py /tmp/after
    diff -r /tmp/before /tmp/after

With --losses it also trains (a few minutes on two cores): the main job's `tidal train` and variants
of it in each offload mode, and the C++ examples (tidal_example_* beside --bin) in each mode, and
keeps every loss, exact to the bit.
"""
import argparse
import json
import os
import re
import subprocess
import sys

GRID = ("llama3-8b:32:1024 llama3-8b:32:2048 llama3-8b:32:4096 llama3-8b:64:2048 llama3-8b:128:1024 "
        "granite-8b:32:1024 granite-8b:32:2048 granite-8b:64:2048 llama3-70b:16:1024 "
        "llama3-70b:16:2048 llama3-70b:32:2048").split()
# before_plan.extra_seconds and payback_steps count the planning time too.
WALL_CLOCK = {"planning_seconds", "stage_seconds", "wall_seconds", "extra_seconds", "payback_steps"}


def grid_cases():
    for case in GRID:
        model, batch, seq = case.split(":")
        mb = max(1, int(batch) // 8)
        args = ["--model", model, "--batch", batch, "--seq", seq, "--tensor-parallel", "2",
                "--micro-batches", str(mb), "--precision", "fp32", "--hardware", "h100-4ssd"]
        if mb > 1:
            args += ["--micro-batch-order", "sequential"]
        yield f"grid-{model}-b{batch}-s{seq}-mixed", args
        yield f"grid-{model}-b{batch}-s{seq}-ssd", args + ["--host-mem", "0"]


def fuzz_cases(shapes):
    """The first shapes of bench/shape_fuzz.sh (seed 1, 48 layers at most, the sequential order)."""
    import random
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from fuzz_shapes import draw, simulate_args
    rng = random.Random(1)
    for i in range(shapes):
        yield f"fuzz-{i:02d}", simulate_args(draw(rng, 48), "sequential")


def tight_cases():
    """Cases where the budget binds hard: most of the grid fits a 94 GB H100 with little to move."""
    for model, batch, seq, mb, mem, prec, order in [
            ("gpt2-xl", 32, 1024, 8, "8GiB", "fp32", "sequential"),
            ("gpt2-xl", 32, 1024, 4, "8GiB", "bf16-mixed", "sequential"),
            ("llama3.2-1b", 32, 2048, 8, "12GiB", "bf16-mixed", "auto"),
            ("llama3-8b", 16, 2048, 4, "24GiB", "fp32", "layer-major"),
            ("gpt2-medium", 8, 1024, 1, "2GiB", "fp32", "sequential"),
            ("gpt2-medium", 2, 512, 1, "1GiB", "fp32", "sequential")]:
        args = ["--model", model, "--batch", str(batch), "--seq", str(seq), "--micro-batches", str(mb),
                "--precision", prec, "--gpu-mem", mem, "--host-link", "50GB/s", "--ssd", "1x2.0/1.7GB/s"]
        if mb > 1:
            args += ["--micro-batch-order", order]
        yield f"tight-{model}-{prec}-{mem}-mb{mb}", args + ["--host-mem", "100GiB"]
        yield f"tight-{model}-{prec}-{mem}-mb{mb}-ssd", args + ["--host-mem", "0"]
    yield "tight-cpu-here-gpt2-small", ["--model", "gpt2-small", "--batch", "2", "--seq", "256",
                                       "--hardware", "cpu-here", "--gpu-mem", "1GiB",
                                       "--io-compute-cost", "0.6/0.5/0.2"]


LOCATION = re.compile(r" \(at [\w./]+:\d+\)")  # an error's source location: a refactor moves lines


def strip(value):
    if isinstance(value, str):
        return LOCATION.sub("", value)
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in WALL_CLOCK}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def run(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return {"exit": p.returncode, "stderr": (p.stderr.strip().splitlines() or [""])[-1]}
    return json.loads(p.stdout.strip().splitlines()[-1])


TRAIN = [
    ["--model", "gpt-tiny", "--batch", "8", "--seq", "128", "--steps", "30", "--offload", "plan",
     "--mem-budget", "50%", "--min-offload", "16KiB"],
    ["--model", "gpt-tiny", "--steps", "12", "--offload", "plan", "--mem-budget", "30%",
     "--min-offload", "4KiB", "--strict-meter", "--micro-batches", "2"],
    ["--model", "gpt-tiny", "--steps", "12", "--offload", "plan", "--mem-budget", "30%",
     "--min-offload", "4KiB", "--optimizer-deferred", "--between-steps", "offloaded"],
    ["--model", "llama-tiny", "--steps", "10", "--offload", "plan", "--mem-budget", "40%",
     "--min-offload", "4KiB", "--micro-batches", "2", "--micro-batch-order", "layer-major"],
    ["--model", "gpt-tiny", "--steps", "12", "--offload", "activations", "--min-offload", "4KiB"],
    ["--model", "gpt-tiny", "--steps", "12", "--offload", "none", "--clip-grad-norm", "1.0"],
]


def losses(out, bin_, store):
    for i, args in enumerate(TRAIN):
        print(f"train {i}: {' '.join(args)}", file=sys.stderr, flush=True)
        j = run([bin_, "train", *args, "--dir", store, "--json"])
        with open(os.path.join(out, f"losses-train-{i}.json"), "w") as f:
            json.dump({"args": args, "losses": j.get("losses", j)}, f, indent=0)
            f.write("\n")
    here = os.path.dirname(bin_)
    for example in ("train_loop", "gan"):
        for mode in ("none", "activations", "plan"):
            print(f"example {example} {mode}", file=sys.stderr, flush=True)
            p = subprocess.run([os.path.join(here, "tidal_example_" + example), "--mode", mode,
                                "--steps", "20", "--dir", store], capture_output=True, text=True)
            with open(os.path.join(out, f"losses-{example}-{mode}.txt"), "w") as f:
                f.write(f"exit {p.returncode}\n")
                f.writelines(line + "\n" for line in p.stdout.splitlines() if "loss" in line)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--bin", default="./build/tidal")
    ap.add_argument("--shapes", type=int, default=20)
    ap.add_argument("--losses", action="store_true")
    ap.add_argument("--store", default=os.environ.get("TIDAL_DIRS", "/var/tmp/tidal"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases = list(grid_cases()) + list(tight_cases()) + list(fuzz_cases(a.shapes))
    for n, (name, args) in enumerate(cases):
        print(f"[{n + 1}/{len(cases)}] {name}", file=sys.stderr, flush=True)
        sim = run([a.bin, "simulate", *args, "--policy", "ideal,tidal,zero-offload,zero-infinity",
                   "--json"])
        plan_file = os.path.join(a.out, name + ".plan.tmp")
        summary = run([a.bin, "plan", *args, "--json", "--out", plan_file])
        plan = None
        if os.path.exists(plan_file):
            with open(plan_file) as f:
                plan = json.load(f)
            os.remove(plan_file)
        with open(os.path.join(a.out, name + ".json"), "w") as f:
            json.dump(strip({"args": args, "simulate": sim, "plan_summary": summary, "plan": plan}), f,
                      sort_keys=True, indent=0)
            f.write("\n")
    if a.losses:
        os.makedirs(a.store, exist_ok=True)
        losses(a.out, a.bin, a.store)


if __name__ == "__main__":
    main()
