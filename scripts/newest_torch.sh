#!/usr/bin/env bash
# Builds tidal against the NEWEST torch on PyPI and runs the quick suite (ctest -L 'unit|torch'),
# an early warning for the next torch port; the project itself stays on scripts/requirements.txt.
#
#   bash scripts/newest_torch.sh
#
# Environment:
#   TIDAL_NEWEST_VENV   the venv with the newest torch (default /var/tmp/tidal-newest-venv, outside
#                       the checkout: it is about 5 GB with torch's CUDA libraries)
#   TIDAL_NEWEST_BUILD  the build folder (default build-newest in the checkout, git-ignored)
#   TIDAL_NEWEST_TORCH  a torch version to use instead of the newest (e.g. 2.14.1)
#   TIDAL_JOBS          build parallelism (default nproc)
#
# Idempotent: the venv is reused as it is when it already has that torch (and numpy, pybind11,
# pytest); otherwise torch is installed or upgraded in it, with the newest numpy, pybind11 and
# pytest. The build folder is reconfigured from scratch when the torch or the venv changed.
# Ends with one line "newest torch X.Y.Z: N passed, M failed"; exits non-zero when the build or
# any test failed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${TIDAL_NEWEST_VENV:-/var/tmp/tidal-newest-venv}
build=${TIDAL_NEWEST_BUILD:-$root/build-newest}
jobs=${TIDAL_JOBS:-$(nproc)}
py=$venv/bin/python
start=$(date +%s)
stamp() { echo "== newest_torch [$(( $(date +%s) - start ))s] $*"; }
pip() { "$py" -m pip --disable-pip-version-check "$@"; }

# The venv: Debian's interpreter, as scripts/setup.sh (python3-dev has its headers).
if [ ! -x "$py" ]; then
  stamp "creating the venv $venv"
  /usr/bin/python3 -m venv "$venv"
fi

# The newest torch on PyPI for this interpreter.
want=${TIDAL_NEWEST_TORCH:-}
if [ -z "$want" ]; then
  want=$(pip index versions torch 2>/dev/null | sed -n 's/^torch (\(.*\))$/\1/p' | head -n1) || true
fi
if [ -z "$want" ]; then
  # `pip index` is experimental: a dry-run install resolves the same version (metadata only).
  want=$(pip install -q --dry-run --ignore-installed --report - torch 2>/dev/null |
         "$py" -c 'import json, sys
for i in json.load(sys.stdin)["install"]:
    if i["metadata"]["name"].lower() == "torch": print(i["metadata"]["version"])') || true
fi
[ -n "$want" ] || { echo "newest_torch: cannot find torch's newest version on PyPI" >&2; exit 1; }
stamp "newest torch on PyPI: $want"

have_all() {
  "$py" - "$want" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
try:
    ok = version("torch") == sys.argv[1]
    for name in ("numpy", "pybind11", "pytest"):
        version(name)
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PY
}
if have_all; then
  stamp "$venv already has torch $want; nothing to install"
else
  stamp "installing torch==$want numpy pybind11 pytest into $venv (about 5 GB)"
  pip install -q --upgrade pip
  pip install -q --upgrade "torch==$want" numpy pybind11 pytest
  have_all || { echo "newest_torch: $venv still lacks torch $want" >&2; exit 1; }
fi
got=$("$py" -c 'import torch; print(torch.__version__)')
echo "newest_torch: torch $got ($("$py" -c 'import torch; print("CUDA", torch.version.cuda)')," \
     "numpy $("$py" -c 'import numpy; print(numpy.__version__)')," \
     "pybind11 $("$py" -c 'import pybind11; print(pybind11.__version__)')," \
     "pytest $("$py" -c 'import pytest; print(pytest.__version__)'))"
version=${got%%+*}   # 2.15.0+cu130 -> 2.15.0

# Configure: from scratch when the venv or its torch changed (cached Torch_DIR, pybind11_DIR and
# libtorch_python would otherwise point at the old ones).
key="$py $got"
fresh=()
if [ -f "$build/CMakeCache.txt" ] && [ "$(cat "$build/.newest_torch" 2>/dev/null)" != "$key" ]; then
  fresh=(--fresh)
fi
stamp "configuring $build ${fresh[*]}"
cmake "${fresh[@]}" -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DTIDAL_PYTHON="$py" -DTIDAL_WITH_TORCH=ON -DTIDAL_BUILD_PYTHON=ON -DTIDAL_BUILD_BENCH=OFF
echo "$key" > "$build/.newest_torch"

stamp "building with $jobs jobs"
# -k 0: on past a failing file, so that one run reports every API break the new torch makes.
blog=$build/newest_torch_build.log
set +e
cmake --build "$build" -j "$jobs" -- -k 0 2>&1 | tee "$blog"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  stamp "build failed; its errors (all in $blog):"
  grep -E '^(FAILED: |[^ ]+:[0-9]+:[0-9]+: (fatal )?error: )' "$blog" | sort -u || true
  echo "newest torch $version: build failed"
  exit 1
fi

stamp "quick suite: ctest -L 'unit|torch'"
log=$build/newest_torch_ctest.log
set +e
ctest --test-dir "$build" -L 'unit|torch' --output-on-failure 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
summary=$(grep -E '[0-9]+% tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n1)
if [ -z "$summary" ]; then
  stamp "ctest gave no summary (exit $rc)"
  echo "newest torch $version: ctest gave no summary"
  exit 1
fi
failed=$(sed -E 's/.* ([0-9]+) tests? failed out of.*/\1/' <<<"$summary")
total=$(sed -E 's/.*failed out of ([0-9]+).*/\1/' <<<"$summary")
passed=$(( total - failed ))
stamp "done"
echo "newest torch $version: $passed passed, $failed failed"
[ "$failed" -eq 0 ] && [ "$rc" -eq 0 ]
