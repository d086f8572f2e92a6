#!/usr/bin/env bash
# Micro-batch order in training, measured (issue 27): `tidal train --micro-batches N` in the
# sequential order (each micro-batch's forward and backward in turn) and in the layer-major
# order (every micro-batch through a block before the next, GreedySnake's), each in mode none and
# in plan mode under the strict meter at a byte budget below the model's weights plus Adam's
# state, in alternating rounds. Per run: the median executed step, the step peak, the bytes the
# store moved per step and the last loss (the orders agree to rounding; GPT-2 ties its head to
# the embedding).
#
#   bench/micro_batch_order.sh [DIR] [ROUNDS]
#
# DIR: the store directory (O_DIRECT; default the first of TIDAL_DIRS, else /var/tmp/tidal-mbo);
# ROUNDS (default 2). TIDAL_BIN (default ./build/tidal); TIDAL_MBO_MODEL (model, batch and
# budget flags; default a 51M-parameter GPT, hidden 1024 in 4 layers, batch 8 of 64 tokens in 4
# micro-batches, budget 200 MiB: under its 204 MB of weights, so that weights move every step).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=${TIDAL_BIN:-./build/tidal}
dir=${1:-${TIDAL_DIRS:-/var/tmp/tidal-mbo}}
dir=${dir%%,*}
rounds=${2:-2}
model=${TIDAL_MBO_MODEL:-"--model gpt-tiny --hidden 1024 --layers 4 --batch 8 --seq 64 --micro-batches 4 --mem-budget 200MiB"}
py=$root/.venv/bin/python
[ -x "$py" ] || py=python3
[ -x "$bin" ] || {
  echo "bench/micro_batch_order.sh: no $bin (build first)" >&2
  exit 1
}
mkdir -p "$dir"
# shellcheck source=bench/train_runs.sh
source "$root/bench/train_runs.sh"
for r in $(seq "$rounds"); do
  for order in sequential layer-major; do
    for mode in none plan; do
      echo "== round $r, $order, $mode" >&2
      # shellcheck disable=SC2086  # the model flags are words
      train_run "$r-$order-$mode" $model --micro-batch-order "$order" --offload "$mode" \
        --strict-meter --steps 8 --dir "$dir"
    done
  done
done
report <<'PY'
print(f"{'round':>5} {'order':<12} {'mode':<5} {'s/step':>7} {'peak MiB':>9} {'GB/step':>8} "
      f"{'last loss':>10}")
per = {}
for r in range(1, rounds + 1):
    for order in ("sequential", "layer-major"):
        for mode in ("none", "plan"):
            j = load(r, order, mode)
            steps = j["step_seconds"][3:]  # warm-up and profiling left out
            step = statistics.median(steps)
            n = max(1, j.get("steps_offloaded", 0))
            moved = (j["bytes_read"] + j["bytes_written"]) / n / 1e9 if mode == "plan" else 0.0
            per[(r, order, mode)] = (step, moved)
            print(f"{r:>5} {order:<12} {mode:<5} {step:>7.3f} "
                  f"{max(j['step_peak_bytes']) / 2**20:>9.1f} {moved:>8.2f} {j['losses'][-1]:>10.6f}")
        if order == "layer-major":
            ps, pl = per[(r, "sequential", "plan")], per[(r, "layer-major", "plan")]
            print(f"      round {r}, plan mode, layer-major / sequential: step {pl[0] / ps[0]:.3f}x, "
                  f"bytes moved {pl[1] / ps[1]:.3f}x")
PY
