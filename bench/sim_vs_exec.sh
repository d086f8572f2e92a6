#!/usr/bin/env bash
# Simulated against executed: the same plan on the same trace, run by the plan executor in
# `tidal train` and replayed by the simulator (`tidal simulate --plan`, the reference engine of
# the same schedule), on several configurations. Prints, per configuration, the executed step
# time and bytes moved per step, and the simulated ones as ratios (simulated / executed).
#
#   bench/sim_vs_exec.sh [BUILD] [DIR]
#
# Each configuration runs TIDAL_SIMEXEC_RUNS times (default 3; this machine's step times move
# 20-40% from one run to the next) and the table gives medians.
#
# BUILD: the build directory (default build); DIR: the store directory (default
# /var/tmp/tidal-simexec; O_DIRECT). TIDAL_SIMEXEC_CONFIGS overrides the configurations, one per
# line: "<model flags> | <train flags>". The simulator gets the SSD figures the session measured
# (its plan summary), the plan's capacity, no margin, and the run's --host-mem. The simulator
# replays the saved trace's op times: the profile's (5 steps, TIDAL_SIMEXEC_PROFILE_STEPS, medians
# per op, not train's default 2: on a small CPU one slow step moves a 2-step median a lot), or,
# where executed steps contradicted them by more than a tenth, the medians of 4 executed steps
# (the session then planned again on them: SessionStats::retimings). The executed figures are
# those of the saved plan's steps. Runs under the strict meter (the budget a wall, as a GPU's).
# Each run starts after a sync and a pause (TIDAL_SIMEXEC_SETTLE seconds, default 5).
set -euo pipefail
build=${1:-build}
dir=${2:-/var/tmp/tidal-simexec}
bin=$build/tidal
steps=${TIDAL_SIMEXEC_STEPS:-24}
profile_steps=${TIDAL_SIMEXEC_PROFILE_STEPS:-5}
out=${TIDAL_SIMEXEC_OUT:-$build/simexec}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
mkdir -p "$dir" "$out"
configs=${TIDAL_SIMEXEC_CONFIGS:-"--model gpt-tiny --layers 2 --batch 8 --seq 128 | --mem-budget 50%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 50%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 25%
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 50% --host-mem 64MiB
--model gpt-tiny --layers 8 --batch 8 --seq 128 | --mem-budget 25% --host-mem 64MiB
--model gpt-tiny --hidden 256 --layers 4 --heads 8 --batch 8 --seq 256 | --mem-budget 50%"}

# TIDAL_SIMEXEC_BOTH=1: each configuration also with --retime-steps 0 (the profile's op times
# throughout), right after it, so that the two are measured side by side.
if [ "${TIDAL_SIMEXEC_BOTH:-0}" = 1 ]; then
  configs=$(while IFS= read -r l; do [ -n "$l" ] && printf '%s\n%s --retime-steps 0\n' "$l" "$l"; done <<<"$configs")
fi

py=/usr/bin/python3
[ -x "$py" ] || py=python3
repeats=${TIDAL_SIMEXEC_RUNS:-3}
rows=()
for ((rep = 1; rep <= repeats; ++rep)); do
  i=0
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
    f="$out/$i-$rep"
    # Let the previous run's aftermath settle first (its store file's blocks are freed after
    # it exits): runs after a heavy-I/O one profiled 8-12% slow here (docs/results.md).
    sync
    sleep "${TIDAL_SIMEXEC_SETTLE:-5}"
    echo "== run $rep, $i: $bin train ${model_a[*]} --offload plan ${flags_a[*]} --steps $steps --profile-steps $profile_steps" >&2
    "$bin" train "${model_a[@]}" --steps "$steps" --profile-steps "$profile_steps" \
      --offload plan --strict-meter --min-offload 16KiB "${flags_a[@]}" --dir "$dir" \
      --save-trace "$f.trace.json" --save-plan "$f.plan.json" --json 2>"$f.train.log" | tail -n 1 >"$f.train.json"
    read -r cap ssd iocost < <("$py" - "$f.plan.json" "$f.train.json" <<'PY'
import json, re, sys
plan = json.load(open(sys.argv[1]))
train = json.load(open(sys.argv[2]))
m = re.search(r"SSD (\d+)x([\d.]+)/([\d.]+)MB/s", train["plan_summary"])
c = re.search(r"I/O compute ([\d.]+/[\d.]+/[\d.]+) ns/B", train["plan_summary"])
print(plan["summary"]["capacity_bytes"], f"{m.group(1)}x{m.group(2)}/{m.group(3)}MB/s",
      c.group(1) if c else "0/0/0")
PY
)
    "$bin" simulate --trace "$f.trace.json" --plan "$f.plan.json" --hardware cpu-here \
      --gpu-mem "$cap" --ssd "$ssd" --host-mem "$host" --margin 0 \
      --io-compute-cost "${TIDAL_SIMEXEC_IO_COMPUTE:-$iocost}" --json 2>"$f.sim.log" |
      tail -n 1 >"$f.sim.json"
    ((rep == 1)) && rows+=("$i|$model|$flags")
  done <<<"$configs"
done

"$py" - "$out" "$repeats" "${rows[@]}" <<'PY'
import json, statistics, sys
out, repeats = sys.argv[1], int(sys.argv[2])
print(f"{repeats} runs of each configuration, one after the other; medians over the runs "
      f"(time ratio: min-max in brackets)")
print(f"{'#':>2} {'configuration':<72} {'exec s/step':>11} {'sim/exec time':>22} "
      f"{'exec MB/step':>12} {'sim/exec bytes':>14} {'max exec peak/budget':>20} {'sim fits':>8}")
for row in sys.argv[3:]:
    i, model, flags = row.split("|")
    ex, tr, eb, br, pk, fits = [], [], [], [], [], True
    for rep in range(1, repeats + 1):
        t = json.load(open(f"{out}/{i}-{rep}.train.json"))
        s = json.load(open(f"{out}/{i}-{rep}.sim.json"))
        n = max(1, t["steps_offloaded"])
        # The steps of the plan saved (the last one: a session plans again on executed steps'
        # op times, or for less memory), where there are enough of them; every offloaded step
        # otherwise. Bytes: the time report's, a mean over the last steps (the same plan).
        m = t["steps_measured"]
        exec_s = (statistics.median(t["step_seconds"][-m:]) if m >= 3
                  else t["offload_step_seconds_median"])
        tb = t["time_report"]["bytes"]
        exec_b = tb["ssd-write"] + tb["host-write"]
        sim_b = s["ssd_bytes_written"] + s["host_bytes_written"]
        ex.append(exec_s)
        tr.append(s["iteration_seconds"] / exec_s)
        eb.append(exec_b)
        br.append(sim_b / exec_b if exec_b else float("nan"))
        pk.append(max(t["step_peak_bytes"][-n:]) / t["memory_budget"])  # every executed step
        fits = fits and s["fits"]
    med = statistics.median
    name = (model.replace("--model ", "").strip() + " " + flags.strip()).replace("--", "")
    time_text = f"{med(tr):.2f} [{min(tr):.2f}-{max(tr):.2f}]"
    print(f"{i:>2} {name:<72} {med(ex):>11.3f} {time_text:>22} {med(eb) / 1e6:>12.1f} "
          f"{med(br):>14.3f} {max(pk):>20.3f} {str(fits):>8}")
PY
