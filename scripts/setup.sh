#!/usr/bin/env bash
# Installs every Debian package tidal needs. Idempotent, non-interactive, safe to rerun:
# packages already present are not touched, and apt is only called when something is missing.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  libtorch-dev          # libtorch (CPU) for torch/ and models/
  libopenblas0-pthread  # an optimised BLAS: Debian points libblas.so.3 (libtorch's) at it
  liburing-dev          # io_uring backend
  libxxhash-dev         # per-stripe checksums
  nlohmann-json3-dev    # trace and plan files
  libcli11-dev          # the CLI
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-format          # CI's format check
  clang-tidy            # CI's clang-tidy floor (scripts/tidy.sh)
  fio                   # bench/io_vs_fio.sh
  python3-torch         # the Python front-end (python/): PyTorch on the same libtorch
  python3-dev pybind11-dev python3-pybind11  # builds the extension module tidal._C
  python3-pytest        # tests/python
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

echo "setup: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: run as root or install sudo" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
