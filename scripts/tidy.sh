#!/usr/bin/env bash
# clang-tidy over the torch-free layers (src/common, io, trace, plan) with the checks of
# .clang-tidy, every warning an error: the floor CI holds (the checks all pass today). It
# configures its own torch-free build tree for the compile commands (no compilation).
#   scripts/tidy.sh [BUILD_DIR]   (default build-tidy)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-tidy}
mkdir -p "$dir"
cmake -S . -B "$dir" -G Ninja -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DTIDAL_WITH_TORCH=OFF \
  -DTIDAL_BUILD_TESTS=OFF -DTIDAL_BUILD_BENCH=OFF -DTIDAL_BUILD_CLI=OFF \
  -DTIDAL_BUILD_EXAMPLES=OFF -DTIDAL_BUILD_PYTHON=OFF -DTIDAL_INSTALL=OFF >"$dir/configure.log" 2>&1 ||
  { cat "$dir/configure.log"; exit 1; }
mapfile -t files < <(git ls-files 'src/common/*.cpp' 'src/io/*.cpp' 'src/io/uring/*.cpp' \
  'src/trace/*.cpp' 'src/plan/*.cpp')
tidy=$(command -v run-clang-tidy-14 || command -v run-clang-tidy)
"$tidy" -p "$dir" -quiet -j "$(nproc)" "${files[@]}" >"$dir/tidy.log" 2>&1 || true
if grep -qE "(warning|error):" "$dir/tidy.log" || ! grep -q "clang-tidy" "$dir/tidy.log"; then
  grep -E "(warning|error):" "$dir/tidy.log" | sort -u
  echo "tidy: clang-tidy found the problems above (the whole output: $dir/tidy.log)"
  exit 1
fi
echo "tidy: ${#files[@]} files clean"
