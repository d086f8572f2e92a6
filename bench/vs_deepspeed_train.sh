#!/usr/bin/env bash
# Training against DeepSpeed's ZeRO-Infinity, measured (issue 26): the Python example's GPT
# trained by DeepSpeed ZeRO-3 with parameters and optimizer state on NVMe (CPU accelerator,
# gloo, world size 1) and by tidal's plan mode under the strict meter at the same budget, in
# alternating rounds (bench/vs_deepspeed_train.py says what each figure is).
#
#   bash bench/vs_deepspeed_train.sh [--dir /var/tmp] [--rounds 3] [--steps 20] [--budget B]
#                                    [--ds-offload nvme|cpu] [--ds-cap] [--json FILE]
#                                    [model options of the .py]
#
# --ds-offload cpu: DeepSpeed's ZeRO-Offload instead (ZeRO-3 with parameters and optimizer state
# in CPU memory, the configuration the simulator's zero-offload policy models); it needs no
# async_io op.
#
# Needs the Python module (build/python, or $TIDAL_BUILD/python) and DeepSpeed in the venv
# ($TIDAL_VENV, default .venv): bench/vs_deepspeed.sh installs it (a benchmark-only install,
# not a tidal dependency); its CPU Adam and async_io ops are JIT-built on first use (libaio-dev,
# ninja, the Python headers).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${TIDAL_VENV:-$root/.venv}"
build="${TIDAL_BUILD:-$root/build}"
[ -x "$venv/bin/python" ] || { echo "no Python at $venv/bin/python: run scripts/setup.sh or set TIDAL_VENV" >&2; exit 1; }
[ -d "$build/python/tidal" ] || { echo "no Python module in $build/python: build it (scripts/build.sh) or set TIDAL_BUILD" >&2; exit 1; }
if ! "$venv/bin/python" -c 'import deepspeed' >/dev/null 2>&1; then
  echo "DeepSpeed is not in $venv: bench/vs_deepspeed.sh installs the release it was written against" >&2
  exit 1
fi
export DS_ACCELERATOR=cpu
PYTHONPATH="$build/python" exec "$venv/bin/python" "$root/bench/vs_deepspeed_train.py" "$@"
