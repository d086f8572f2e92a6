#!/usr/bin/env bash
# The optimizer step on the host, executed (issue 49): an ordinary PyTorch loop (a Hugging Face
# GPT-2 of a small configuration, AdamW) on the CPU under the strict meter, without tidal, with
# Session(optimizer_step="host") and with optimizer_step="device", side by side in one run:
# step times, peaks against the budget, bit-identity with the plain loop, and the host Adam's
# parameters/s per thread beside torch's AdamW and DeepSpeed's CPU Adam (bench/host_step.py says
# what each figure is). About 3 minutes on 2 cores.
#
#   bash bench/host_step.sh [--fused] [--layers 4] [--width 512] [--steps 8] [--json FILE]
#
# Needs the build's Python module (build/python, or $TIDAL_PYTHONPATH) and transformers in the
# venv; DeepSpeed is optional (its row then says "not installed").
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${TIDAL_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || { echo "no Python at $venv/bin/python: run scripts/setup.sh or set TIDAL_VENV" >&2; exit 1; }
export DS_ACCELERATOR=cpu
export PYTHONPATH="${TIDAL_PYTHONPATH:-$root/build/python}${PYTHONPATH:+:$PYTHONPATH}"
exec "$venv/bin/python" "$root/bench/host_step.py" "$@"
