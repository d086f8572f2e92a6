#!/usr/bin/env bash
# The main job of README.md: set-up, build, then run tidal on the default store directory.
# Until training with offloading lands (issue 5) the main job is the I/O benchmark.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
BUILD_DIR=build bash scripts/build.sh
dir=${TIDAL_DIRS:-/var/tmp/tidal}
mkdir -p "$dir"
echo "== tidal bench-io on $dir (O_DIRECT)"
./build/tidal bench-io --dir "$dir" --size "${TIDAL_BENCH_SIZE:-1GiB}" --block 4MiB --depth 16
