#!/usr/bin/env bash
# Speed on a GPU, out of the box (issue 45): bench/gpu_speed.py's table of ratios, measured in
# one run with the link and disk rates and the simulator's prediction beside them.
#
#   bench/gpu_speed.sh [--device cpu] [--dir STORE] [--out FILE]
#
# Uses a build made already: BUILD (default build-gpu where bench/gpu.sh made one, else build),
# its Python module (BUILD/python) and CLI (BUILD/tidal), with TIDAL_PYTHON (default .venv's
# python, else python3). At most TIDAL_GPU_SPEED_SECONDS (default 480): about 8 minutes on an
# H100/H200. --device cpu checks the flow on tiny models (CI): its figures mean nothing.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-}
if [ -z "$build" ]; then
  build=$root/build
  [ -d "$root/build-gpu/python" ] && build=$root/build-gpu
fi
py=${TIDAL_PYTHON:-}
if [ -z "$py" ]; then
  py=python3
  [ -x "$root/.venv/bin/python" ] && py=$root/.venv/bin/python
fi
[ -d "$build/python/tidal" ] || { echo "bench/gpu_speed.sh: no tidal module in $build/python: build first" >&2; exit 1; }
PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} exec timeout "${TIDAL_GPU_SPEED_SECONDS:-480}" \
  "$py" "$root/bench/gpu_speed.py" --tidal "$build/tidal" "$@"
