#!/usr/bin/env bash
# Installs what tidal needs. Idempotent, non-interactive, safe to rerun: Debian packages already
# present are not touched (apt is only called when something is missing), and the Python
# environment is only created or changed when it lacks a pinned package of scripts/requirements.txt.
#
# The Python environment: a venv at TIDAL_VENV (default .venv in the checkout, git-ignored) with
# torch 2.11.0 from PyPI. It is the one torch of the project: CMake builds the C++ layers against
# its libtorch, and the Python front-end and its tests run in it (scripts/env.sh finds it). It
# imports tidal from the build (BUILD_DIR/python) without PYTHONPATH.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)

packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev          # io_uring backend
  libxxhash-dev         # per-stripe checksums
  nlohmann-json3-dev    # trace and plan files
  libcli11-dev          # the CLI
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-format          # CI's format check
  clang-tidy            # CI's clang-tidy floor (scripts/tidy.sh)
  fio                   # bench/io_vs_fio.sh
  python3 python3-venv python3-dev  # the venv and the headers the extension module tidal._C needs
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} Debian packages present"
else
  echo "setup: installing ${missing[*]}"
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null || { echo "setup: run as root or install sudo" >&2; exit 1; }
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python: Debian's interpreter (not a pyenv or conda one that may come and go), in a venv.
venv=${TIDAL_VENV:-$root/.venv}
requirements=$root/scripts/requirements.txt
venv_ok() {
  [ -x "$venv/bin/python" ] || return 1
  # Every pin of requirements.txt installed at its version (pip would otherwise be called).
  "$venv/bin/python" - "$requirements" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if have != want:
        sys.exit(1)
PY
}
if venv_ok; then
  echo "setup: Python environment $venv present ($("$venv/bin/python" -c \
    'import torch; print("torch", torch.__version__)')); nothing to install"
else
  if [ ! -x "$venv/bin/python" ]; then
    echo "setup: creating the Python environment $venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  echo "setup: installing $(grep -v '^#' "$requirements" | xargs) into $venv (torch from PyPI," \
       "about 5 GB with its CUDA libraries; a minute on a fast link)"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements"
  venv_ok || { echo "setup: $venv still lacks a package of $requirements" >&2; exit 1; }
fi
# `import tidal` in the venv without PYTHONPATH: a .pth file puts the build's package directory
# (BUILD_DIR/python, as scripts/build.sh builds it; build/ by default) on its path. A package
# pip installed into the venv comes first on the path, and wins.
build=${BUILD_DIR:-$root/build}
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$(cat "$site/tidal-build.pth" 2>/dev/null)" != "$build/python" ]; then
  echo "$build/python" >"$site/tidal-build.pth"
  echo "setup: $venv imports tidal from $build/python (once built; $site/tidal-build.pth)"
fi
echo "setup: done"
