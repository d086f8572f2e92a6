#!/usr/bin/env bash
# tidal as a library of another project: installs the build into a temporary prefix, then builds
# and runs small consumers the ways another project would take tidal in:
#   find_package(tidal COMPONENTS core) and COMPONENTS torch (examples/train_loop.cpp, out of
#   tree), pkg-config tidal (the torch-free core), and add_subdirectory(tidal) (torch-free).
#
#   tests/package/run.sh SOURCE_DIR BUILD_DIR
set -euo pipefail

src=$(cd "${1:?usage: run.sh SOURCE_DIR BUILD_DIR}" && pwd)
build=$(cd "${2:?usage: run.sh SOURCE_DIR BUILD_DIR}" && pwd)
here="$src/tests/package"
jobs=${TIDAL_JOBS:-$(nproc)}
tmp=$(mktemp -d /var/tmp/tidal-package.XXXXXX)
mkdir -p "$tmp"/store-{installed,train,pc,subdirectory}
trap 'rm -rf "$tmp"' EXIT
prefix="$tmp/prefix"
start=$(date +%s)
step() { echo "== [$(($(date +%s) - start))s] $*"; }

step "install into $prefix"
cmake --install "$build" --prefix "$prefix" >"$tmp/install.log"
config=$(find "$prefix" -name tidalConfig.cmake)
pc=$(find "$prefix" -name tidal.pc)
for f in "$prefix/include/tidal/io/store.hpp" "$config" "${config%/*}/tidalConfigVersion.cmake" \
         "${config%/*}/tidalCoreTargets.cmake" "$pc" "$prefix/bin/tidal"; do
  [ -f "$f" ] || { echo "FAIL: the install has no ${f#"$prefix"/}"; exit 1; }
done
with_torch=OFF
[ -f "${config%/*}/tidalTorchTargets.cmake" ] && with_torch=ON
if [ $with_torch = ON ]; then
  # The installed `tidal` hands train and profile to the installed tidal-torch beside it.
  [ -x "$prefix/bin/tidal-torch" ] || { echo "FAIL: the install has no bin/tidal-torch"; exit 1; }
  # (Whole, then searched: `grep -q` leaving a pipe early would fail it with SIGPIPE.)
  train_help=$("$prefix/bin/tidal" train --help 2>&1) || true
  grep -q -- "--offload" <<<"$train_help" ||
    { echo "FAIL: the installed tidal does not hand train to tidal-torch"; exit 1; }
fi

step "find_package(tidal): core, torch=$with_torch"
cmake -S "$here/installed" -B "$tmp/installed" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DTIDAL_SOURCE_DIR="$src" -DWITH_TORCH=$with_torch >"$tmp/installed.log" ||
  { cat "$tmp/installed.log"; exit 1; }
cmake --build "$tmp/installed" -j "$jobs"
"$tmp/installed/core_consumer" "$tmp/store-installed"
if [ $with_torch = ON ]; then
  "$tmp/installed/train_loop" --mode activations --dir "$tmp/store-train" --steps 2
fi

step "pkg-config tidal"
flags=$(PKG_CONFIG_PATH="${pc%/*}" pkg-config --cflags --libs --static tidal)
echo "pkg-config --cflags --libs --static tidal: $flags"
# shellcheck disable=SC2086  # the flags are words
c++ -std=c++17 "$here/core_consumer.cpp" $flags -o "$tmp/core_consumer_pc"
"$tmp/core_consumer_pc" "$tmp/store-pc"

step "add_subdirectory(tidal), torch-free"
cmake -S "$here/subdirectory" -B "$tmp/subdirectory" -G Ninja -DTIDAL_SOURCE_DIR="$src" \
  >"$tmp/subdirectory.log" || { cat "$tmp/subdirectory.log"; exit 1; }
cmake --build "$tmp/subdirectory" -j "$jobs" >"$tmp/subdirectory-build.log" ||
  { cat "$tmp/subdirectory-build.log"; exit 1; }
"$tmp/subdirectory/core_consumer" "$tmp/store-subdirectory"
step "package test passed"
