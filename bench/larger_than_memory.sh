#!/usr/bin/env bash
# Larger than memory from step 0 under the strict meter: tidal's GPT and an ordinary PyTorch
# GPT with their state at 2x and 4x the budget, beside unconstrained runs (bench/larger_than_memory.py
# says what it prints). Needs the build of scripts/test.sh (build/, .venv).
#   bash bench/larger_than_memory.sh [--dir /mnt/nvme0] [--steps 10]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${TIDAL_VENV:-$root/.venv}"
PYTHONPATH="$root/build/python" exec "$venv/bin/python" "$root/bench/larger_than_memory.py" "$@"
