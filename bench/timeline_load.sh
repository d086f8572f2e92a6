#!/usr/bin/env bash
# Where the time went, alone and under load: `tidal train --offload plan --strict-meter` with its
# timeline and report, on a quiet machine and beside a second process writing to the same disk
# (fio, 1 MiB sequential O_DIRECT writes at queue depth 16) with both cores kept busy. For each
# run it prints the report's step time against the trainer's own step time over the same steps,
# how much of it the parts account for, the stall share, and the limit sentence's first words;
# the last run of each load leaves its timeline (JSON and SVG) in OUT. All store I/O is O_DIRECT.
#
#   bench/timeline_load.sh [BUILD_DIR] [RUNS]        (defaults: build, 3)
#
# Environment: TIDAL_BENCH_DIR (store directory, default /var/tmp/tidal-timeline-load),
# TIDAL_BENCH_MODEL (default "gpt-tiny --layers 8 --batch 8 --seq 128"), TIDAL_BENCH_STEPS
# (default 16), TIDAL_BENCH_BUDGET (default 50%), OUT (default out/timeline-load).
set -euo pipefail

build=${1:-build}
runs=${2:-3}
dir=${TIDAL_BENCH_DIR:-/var/tmp/tidal-timeline-load}
model=${TIDAL_BENCH_MODEL:-gpt-tiny --layers 8 --batch 8 --seq 128}
steps=${TIDAL_BENCH_STEPS:-16}
budget=${TIDAL_BENCH_BUDGET:-50%}
out=${OUT:-out/timeline-load}
python=/usr/bin/python3
tidal="$build/tidal"

[[ -x $tidal ]] || { echo "timeline_load: $tidal not found; build first (scripts/build.sh)" >&2; exit 1; }
command -v fio >/dev/null || { echo "timeline_load: fio not found; run scripts/setup.sh" >&2; exit 1; }
mkdir -p "$dir" "$out"
pids=()
stop_load() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  pids=()
  rm -f "$dir/fio-writer"*
}
trap stop_load EXIT
start_load() {
  fio --name=fio-writer --directory="$dir" --rw=write --bs=1M --direct=1 --size=1G \
    --time_based --runtime=3600 --ioengine=libaio --iodepth=16 >/dev/null 2>&1 &
  pids+=($!)
  for _ in $(seq "$(nproc)"); do
    "$python" -c 'while True: pass' &
    pids+=($!)
  done
  sleep 1
}

read -r -a model_args <<<"$model"
echo "timeline_load: --model $model, $steps steps, --mem-budget $budget --strict-meter, $runs runs per load, store $dir (O_DIRECT)"
printf '%-7s %3s %10s %10s %8s %7s  %s\n' load run "report s" "trainer s" accounted stalls "limit"
for load in alone writer; do
  [[ $load == writer ]] && start_load
  for ((r = 0; r < runs; ++r)); do
    "$tidal" train --model "${model_args[@]}" --steps "$steps" --offload plan \
      --mem-budget "$budget" --strict-meter --dir "$dir" --timeline "$out/$load.json" \
      --timeline "$out/$load.svg" --timeline-steps 4 --json 2>"$out/$load.err" | tail -n 1 \
      >"$out/$load.$r.out"
    "$python" - "$out/$load.$r.out" "$load" "$r" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))
t = run["time_report"]
trainer = sum(run["step_seconds"][-t["steps"]:]) / t["steps"]
print(f"{sys.argv[2]:<7} {sys.argv[3]:>3} {t['step_seconds']:10.4f} {trainer:10.4f} "
      f"{t['accounted']:8.3f} {t['stall_seconds'] / t['step_seconds']:7.1%}  "
      f"{' '.join(t['limit'].split()[:12])} ...")
PY
  done
  [[ $load == writer ]] && stop_load
done
echo "timelines of the last run of each load: $out/{alone,writer}.{json,svg}"
