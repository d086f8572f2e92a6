"""tidal estimate's model state beside Hugging Face Accelerate's memory estimator, offline.

`accelerate estimate-memory` asks the Hub for the model; this runs the same computation on the
config.json files shipped in tests/plan/hf_configs: the model built on the meta device
(accelerate.init_empty_weights), its parameter bytes by accelerate.utils.calculate_maximum_sizes,
and accelerate's figure for training with Adam (4x the fp32 model: weights, gradients, two
moments), beside tidal's count of the parameters (`tidal estimate --json`: parameters) and its
state (16 bytes a parameter for fp32 AdamW).

    .venv/bin/python bench/estimate_vs_accelerate.py [--tidal build/tidal]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch
from accelerate import init_empty_weights
from accelerate.utils import calculate_maximum_sizes
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "tests" / "plan" / "hf_configs"


def accelerate_bytes(config_file: pathlib.Path) -> tuple[int, int]:
    """The fp32 model's bytes and its largest layer's, as accelerate's estimator counts them."""
    with tempfile.TemporaryDirectory() as d:
        shutil.copy(config_file, os.path.join(d, "config.json"))
        config = AutoConfig.from_pretrained(d)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    total, largest = calculate_maximum_sizes(model)
    return int(total), int(largest[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tidal", default=str(ROOT / "build" / "tidal"))
    a = ap.parse_args()
    print("| model | accelerate: fp32 model | accelerate: training with Adam | tidal: parameters "
          "x 4 B | tidal: AdamW state (16 B/param) | tidal / accelerate |")
    print("|---|---:|---:|---:|---:|---:|")
    for f in sorted(CONFIGS.glob("*.json")):
        total, _ = accelerate_bytes(f)
        out = subprocess.run([a.tidal, "estimate", "--hf-config", str(f), "--batch", "1", "--seq",
                              "1024", "--gpu-mem", "1TiB", "--host-mem", "4TiB",
                              "--optimizer-step", "device", "--json"],
                             check=True, capture_output=True, text=True).stdout
        params = json.loads(out.splitlines()[-1])["parameters"]
        gib = 2**30
        print(f"| {f.stem} | {total / gib:.2f} GiB | {4 * total / gib:.2f} GiB | "
              f"{4 * params / gib:.2f} GiB | {16 * params / gib:.2f} GiB | "
              f"{4 * params / total:.4f} |")


if __name__ == "__main__":
    main()
