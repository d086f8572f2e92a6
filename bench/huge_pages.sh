#!/usr/bin/env bash
# Host tensors on 2 MiB pages or on 4 KiB pages (TIDAL_HUGE_PAGES=1 or 0): the same plan-mode
# training run, in alternating rounds, on the store's directory (O_DIRECT). Per run: the median
# executed step, the store's throughput while it was busy (bytes read and written / busy
# seconds), the stall, and the step of mode none under the same setting (the compute alone).
#
#   bench/huge_pages.sh [DIR] [ROUNDS]
#
# DIR: the store directory (default the first of TIDAL_DIRS, else /var/tmp/tidal-hp); ROUNDS
# (default 3). TIDAL_BIN (default ./build/tidal); TIDAL_HP_MODEL (the model and budget flags;
# default a 51M-parameter GPT, hidden 1024 in 4 layers, whose weights are 4-16 MiB, with a byte
# budget of about half its state under the strict meter).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=${TIDAL_BIN:-./build/tidal}
dir=${1:-${TIDAL_DIRS:-/var/tmp/tidal-hp}}
dir=${dir%%,*}
rounds=${2:-3}
model=${TIDAL_HP_MODEL:-"--model gpt-tiny --hidden 1024 --layers 4 --batch 2 --seq 64 --mem-budget 400MiB --strict-meter"}
steps=8
py=$root/.venv/bin/python
[ -x "$py" ] || py=python3
[ -x "$bin" ] || {
  echo "bench/huge_pages.sh: no $bin (build first)" >&2
  exit 1
}
mkdir -p "$dir"
# shellcheck source=bench/train_runs.sh
source "$root/bench/train_runs.sh"
echo "THP: $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown)" >&2
for r in $(seq "$rounds"); do
  for hp in 1 0; do
    for mode in plan none; do
      # shellcheck disable=SC2086  # the model flags are words
      TIDAL_HUGE_PAGES=$hp train_run "$r-$hp-$mode" $model --offload "$mode" --steps "$steps" \
        --dir "$dir"
      echo "== round $r, TIDAL_HUGE_PAGES=$hp, $mode" >&2
    done
  done
done
report <<'PY'
print(f"{'round':>5} {'pages':>6} {'plan s/step':>11} {'none s/step':>11} {'x none':>7} "
      f"{'store GB/s':>10} {'stall s':>8}")
ratios = {1: [], 0: []}
for r in range(1, rounds + 1):
    for hp in (1, 0):
        p, n = load(r, hp, "plan"), load(r, hp, "none")
        tr = p["time_report"]
        b = tr["bytes"]
        gbs = (b["ssd-read"] + b["ssd-write"]) / tr["store_busy_seconds"] / 1e9
        step = p["offload_step_seconds_median"]
        none = statistics.median(n["step_seconds"][1:])
        ratios[hp].append((step, gbs, step / none))
        print(f"{r:>5} {'2 MiB' if hp else '4 KiB':>6} {step:>11.3f} {none:>11.3f} "
              f"{step / none:>7.2f} {gbs:>10.2f} {tr['stall_seconds']:>8.3f}")
for i, name in ((0, "plan step"), (1, "store GB/s")):
    per = [a[i] / b[i] for a, b in zip(ratios[1], ratios[0])]
    print(f"{name}, 2 MiB / 4 KiB pages, per round: " + " ".join(f"{x:.3f}" for x in per) +
          f" (median {statistics.median(per):.3f})")
PY
