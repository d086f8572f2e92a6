#!/usr/bin/env bash
# The main job of README.md: set-up, build, then train a small GPT with tidal's offloading to the
# default store directory (/var/tmp/tidal, or TIDAL_DIRS) and print the result.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup.sh
BUILD_DIR=build bash scripts/build.sh
dir=${TIDAL_DIRS:-/var/tmp/tidal}
mkdir -p "${dir%%,*}"
echo "== the store's bandwidth on $dir (O_DIRECT)"
./build/tidal bench-io --dir "$dir" --size "${TIDAL_BENCH_SIZE:-512MiB}" --block 1MiB --depth 16
echo "== training gpt-tiny for 30 steps with the plan (TERAIO path), memory budget 50% of its peak"
./build/tidal train --model gpt-tiny --batch 8 --seq 128 --steps 30 --offload plan \
  --mem-budget 50% --min-offload 16KiB --dir "$dir"
