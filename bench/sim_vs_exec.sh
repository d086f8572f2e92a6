#!/usr/bin/env bash
# Simulated against executed: the same plan on the same trace, run by the plan executor in
# `tidal train` and replayed by the simulator (`tidal simulate --plan`, the reference engine of
# the same schedule), on several configurations. Prints, per configuration, the executed step
# time and bytes moved per step, and the simulated ones as ratios (simulated / executed).
#
#   bench/sim_vs_exec.sh [BUILD] [DIR]
#
# BUILD: the build directory (default build); DIR: the store directory (default
# /var/tmp/tidal-simexec; O_DIRECT). TIDAL_SIMEXEC_CONFIGS overrides the configurations, one per
# line: "<model flags> | <train flags>". The simulator gets the SSD figures the session measured
# (its plan summary), the plan's capacity, no margin, and the run's --host-mem.
set -euo pipefail
build=${1:-build}
dir=${2:-/var/tmp/tidal-simexec}
bin=$build/tidal
steps=${TIDAL_SIMEXEC_STEPS:-20}
out=${TIDAL_SIMEXEC_OUT:-$build/simexec}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
mkdir -p "$dir" "$out"
configs=${TIDAL_SIMEXEC_CONFIGS:-"--model gpt-tiny --layers 2 --batch 8 --seq 128 | --mem-budget 50%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 50%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 25%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 50% --host-mem 64MiB
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 25% --host-mem 64MiB
--model gpt-tiny --hidden 256 --layers 4 --heads 8 --batch 8 --seq 256 | --mem-budget 50%"}

py=/usr/bin/python3
[ -x "$py" ] || py=python3
i=0
rows=()
while IFS= read -r line; do
  [ -z "$line" ] && continue
  i=$((i + 1))
  model=${line%%|*}
  flags=${line#*|}
  read -r -a model_a <<<"$model"
  read -r -a flags_a <<<"$flags"
  host=0
  for ((k = 0; k < ${#flags_a[@]}; ++k)); do
    [ "${flags_a[k]}" = "--host-mem" ] && host=${flags_a[k + 1]}
  done
  echo "== $i: $bin train ${model_a[*]} --offload plan ${flags_a[*]} --steps $steps" >&2
  "$bin" train "${model_a[@]}" --steps "$steps" --offload plan --min-offload 16KiB \
    "${flags_a[@]}" --dir "$dir" --save-trace "$out/trace$i.json" --save-plan "$out/plan$i.json" \
    --json 2>"$out/train$i.log" | tail -n 1 >"$out/train$i.json"
  read -r cap ssd < <("$py" - "$out/plan$i.json" "$out/train$i.json" <<'PY'
import json, re, sys
plan = json.load(open(sys.argv[1]))
train = json.load(open(sys.argv[2]))
m = re.search(r"SSD (\d+)x([\d.]+)/([\d.]+)MB/s", train["plan_summary"])
print(plan["summary"]["capacity_bytes"], f"{m.group(1)}x{m.group(2)}/{m.group(3)}MB/s")
PY
)
  "$bin" simulate --trace "$out/trace$i.json" --plan "$out/plan$i.json" --hardware cpu-here \
    --gpu-mem "$cap" --ssd "$ssd" --host-mem "$host" --margin 0 --json 2>"$out/sim$i.log" |
    tail -n 1 >"$out/sim$i.json"
  rows+=("$i|$model|$flags")
done <<<"$configs"

"$py" - "$out" "${rows[@]}" <<'PY'
import json, sys
out = sys.argv[1]
print(f"{'#':>2} {'configuration':<62} {'exec s/step':>11} {'sim/exec time':>13} "
      f"{'exec MB/step':>12} {'sim/exec bytes':>14} {'exec peak/budget':>16} {'sim fits':>8}")
for row in sys.argv[2:]:
    i, model, flags = row.split("|")
    t = json.load(open(f"{out}/train{i}.json"))
    s = json.load(open(f"{out}/sim{i}.json"))
    n = max(1, t["steps_offloaded"])
    exec_s = t["offload_step_seconds_median"]
    exec_b = (t["bytes_written"] + t["bytes_to_host"]) / n
    sim_b = s["ssd_bytes_written"] + s["host_bytes_written"]
    peak = max(t["step_peak_bytes"][-n:]) / t["memory_budget"]  # every executed step
    name = (model.replace("--model ", "").strip() + " " + flags.strip()).replace("--", "")
    print(f"{i:>2} {name:<62} {exec_s:>11.3f} {s['iteration_seconds'] / exec_s:>13.2f} "
          f"{exec_b / 1e6:>12.1f} {sim_b / exec_b if exec_b else float('nan'):>14.3f} "
          f"{peak:>16.3f} {str(s['fits']):>8}")
PY
