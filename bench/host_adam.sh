#!/usr/bin/env bash
# The host CPU's Adam step, measured (issue 49): torch's AdamW (for-loop, foreach, fused) and
# DeepSpeed's CPU Adam on the same parameters in the same run, in parameters/s and per thread,
# with the bf16-gradient accumulation and the bf16 copy a host step also needs, and whether each
# torch variant's arithmetic is bit-identical to the for-loop AdamW (bench/host_adam.py says
# what each figure is). About half a minute on 2 cores.
#
#   bash bench/host_adam.sh [--params 64M] [--threads 1,N] [--steps 5] [--warmup 2]
#                           [--check-params 1M] [--json FILE]
#
# Needs torch in the venv ($TIDAL_VENV, default .venv). DeepSpeed is optional: without it its
# rows say "not installed"; bench/vs_deepspeed.sh installs it (a benchmark-only install, not a
# tidal dependency). Its CPU Adam op is JIT-built on first use (ninja, the Python headers), outside
# the timing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${TIDAL_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || { echo "no Python at $venv/bin/python: run scripts/setup.sh or set TIDAL_VENV" >&2; exit 1; }
export DS_ACCELERATOR=cpu
exec "$venv/bin/python" "$root/bench/host_adam.py" "$@"
