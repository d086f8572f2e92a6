"""examples/python run in the three modes on a tiny GPT: same losses, bit for bit."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--layers", "2", "--d", "64", "--heads", "2", "--block", "64", "--batch", "8",
        "--steps", "5", "--min-bytes", "16KiB", "--capacity", "256MiB"]


def run_gpt(mode, store_dir, *extra):
    out = os.path.join(store_dir, f"gpt-{mode}{'-'.join(extra)}.json")
    cmd = [sys.executable, os.path.join(ROOT, "examples/python/gpt_activations.py"),
           "--text", os.path.join(ROOT, "README.md"), "--mode", mode, "--dir", store_dir,
           "--json", out] + TINY + list(extra)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout
    with open(out) as f:
        return json.load(f)


def test_gpt_example_in_three_modes(store_dir):
    runs = {m: run_gpt(m, store_dir) for m in ("none", "activations", "plan")}
    ref = [s["loss"] for s in runs["none"]["steps"]]
    assert len(ref) == 5 and ref[-1] < ref[0]  # it trains
    for mode in ("activations", "plan"):
        assert [s["loss"] for s in runs[mode]["steps"]] == ref, mode
        assert runs[mode]["summary"]["store_bytes_written"] > 0, mode
    host = run_gpt("plan", store_dir, "--optimizer-step", "host")
    assert [s["loss"] for s in host["steps"]] == ref, "the optimizer step on the host"


def run_losses(example, mode, store_dir, *args):
    out = os.path.join(store_dir, f"{example}-{mode}.json")
    cmd = [sys.executable, os.path.join(ROOT, "examples/python", example), "--mode", mode,
           "--dir", store_dir, "--json", out, *args]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:]
    with open(out) as f:
        return json.load(f)["losses"]


def test_hugging_face_examples_same_losses_with_tidal(store_dir):
    import pytest

    pytest.importorskip("accelerate")
    for example, args, steps in (
            ("hf_finetune.py", ["--steps", "8", "--layers", "2", "--hidden", "64", "--seq", "64",
                                "--output", os.path.join(store_dir, "hf-out")], 8),
            ("accelerate_train.py", ["--steps", "8"], 8)):
        ref = run_losses(example, "none", store_dir, *args)
        assert len(ref) == steps
        assert run_losses(example, "plan", store_dir, *args) == ref, example
