#!/usr/bin/env bash
# The plan as a contract under load: `tidal train --offload plan` at two memory budgets, on a
# quiet disk and with a second process writing to the same disk (fio, 1 MiB sequential O_DIRECT
# writes at queue depth 16), SSD only and with a host memory pool. Every run's peak is checked
# against its budget over every executed step (after the warm-up and profiled steps, which run
# without a plan); step time is compared with `--offload none` under the same load, in the same
# run of this script. All store I/O is O_DIRECT.
#
#   bench/contention.sh [BUILD_DIR] [RUNS]        (defaults: build, 10)
#
# Environment: TIDAL_BENCH_DIR (store directory, default /var/tmp/tidal-contention),
# TIDAL_BENCH_MODEL (default "gpt-tiny --layers 8": enough blocks that a 25% budget can be
# met), TIDAL_BENCH_STEPS (default 30), TIDAL_BENCH_HOST_MEM
# (the host pool of the host runs, default 64MiB), TIDAL_BENCH_BUDGETS (default "50% 25%"),
# TIDAL_BENCH_LOADS (default "alone writer").
set -euo pipefail

build=${1:-build}
runs=${2:-10}
dir=${TIDAL_BENCH_DIR:-/var/tmp/tidal-contention}
model=${TIDAL_BENCH_MODEL:-gpt-tiny --layers 8}
steps=${TIDAL_BENCH_STEPS:-30}
host_mem=${TIDAL_BENCH_HOST_MEM:-64MiB}
budgets=${TIDAL_BENCH_BUDGETS:-50% 25%}
loads=${TIDAL_BENCH_LOADS:-alone writer}
python=/usr/bin/python3
tidal="$build/tidal"

[[ -x $tidal ]] || { echo "contention: $tidal not found; build first (scripts/build.sh)" >&2; exit 1; }
command -v fio >/dev/null || { echo "contention: fio not found; run scripts/setup.sh" >&2; exit 1; }
mkdir -p "$dir"
out=$(mktemp -d /var/tmp/tidal-contention-out.XXXXXX)
fio_pid=""
cleanup() {
  [[ -n $fio_pid ]] && kill "$fio_pid" 2>/dev/null && wait "$fio_pid" 2>/dev/null
  rm -rf "$out" "$dir/fio-writer"*
}
trap cleanup EXIT

start_writer() {
  fio --name=fio-writer --directory="$dir" --rw=write --bs=1M --direct=1 --size=1G \
    --time_based --runtime=3600 --ioengine=libaio --iodepth=16 >/dev/null 2>&1 &
  fio_pid=$!
  sleep 1
}
stop_writer() {
  kill "$fio_pid" 2>/dev/null || true
  wait "$fio_pid" 2>/dev/null || true
  fio_pid=""
  rm -f "$dir/fio-writer"*
}

read -r -a model_args <<<"$model"
common=(--model "${model_args[@]}" --batch 8 --seq 128 --steps "$steps" --min-offload 16KiB --dir "$dir"
  --json)
echo "contention: $model, $steps steps, $runs runs per configuration, store $dir (O_DIRECT)"
for load in $loads; do
  [[ $load == writer ]] && start_writer
  for ((r = 0; r < runs; ++r)); do
    "$tidal" train "${common[@]}" --offload none 2>/dev/null | tail -n 1 >"$out/none.$load.$r.json"
    for budget in $budgets; do
      for host in 0 "$host_mem"; do
        tag="plan.${budget%\%}.$host.$load.$r"
        "$tidal" train "${common[@]}" --offload plan --mem-budget "$budget" --host-mem "$host" \
          2>"$out/$tag.err" | tail -n 1 >"$out/$tag.json" ||
          { echo "contention: run $tag failed:" >&2; tail -n 5 "$out/$tag.err" >&2; exit 1; }
      done
    done
    printf '.'
  done
  [[ $load == writer ]] && stop_writer
done
echo

"$python" - "$out" "$runs" "$budgets" "$host_mem" "$loads" <<'EOF'
import json, statistics, sys, pathlib
out, runs, budgets, host_mem = pathlib.Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(), sys.argv[4]
loads = sys.argv[5].split()
def load(name):
    return json.loads((out / name).read_text())
first = None
blas = None
print(f"{'budget':>6} {'load':>6} {'host':>7} {'runs<=budget':>12} {'max peak/budget':>15} "
      f"{'time/none':>9} {'SSD MB/step':>11} {'host MB/step':>12} {'SSD stall ms':>12} "
      f"{'host stall ms':>13} {'write stall ms':>14}")
failures = 0
for budget in budgets:
    for load_ in loads:
        none_t = statistics.median(
            statistics.median(load(f"none.{load_}.{r}.json")["step_seconds"][3:]) for r in range(runs))
        for host in ("0", host_mem):
            ok = 0
            worst = 0.0
            ratios, ssd, hst, sst, hstl, wst = [], [], [], [], [], []
            for r in range(runs):
                j = load(f"plan.{budget.rstrip('%')}.{host}.{load_}.{r}.json")
                blas = j.get("blas")
                n_exec = len(j["step_peak_bytes"]) - 3  # 1 warm-up + 2 profiled steps
                peaks = j["step_peak_bytes"][3:]
                b = j["memory_budget"]
                worst = max(worst, max(peaks) / b)
                if max(peaks) <= b and j["steps_over_budget"] == 0 and j["within_budget"]:
                    ok += 1
                ratios.append(statistics.median(j["step_seconds"][3:]) / none_t)
                ssd.append(j["bytes_written"] / n_exec / 1e6)
                hst.append(j.get("bytes_to_host", 0) / n_exec / 1e6)
                sst.append(1e3 * j.get("ssd_stall_seconds", 0) / n_exec)
                hstl.append(1e3 * j.get("host_stall_seconds", 0) / n_exec)
                wst.append(1e3 * j.get("write_stall_seconds", 0) / n_exec)
            failures += runs - ok
            med = statistics.median
            print(f"{budget:>6} {load_:>6} {host:>7} {f'{ok}/{runs}':>12} {worst:>15.3f} "
                  f"{med(ratios):>9.2f} {med(ssd):>11.2f} {med(hst):>12.2f} {med(sst):>12.2f} "
                  f"{med(hstl):>13.2f} {med(wst):>14.2f}")
print(f"BLAS: {blas}. time/none: median step time of the executed steps over that of "
      "--offload none under the same load, medians over the runs; per-step figures are "
      "medians over the runs.")
if failures:
    print(f"{failures} run(s) went over their budget")
    sys.exit(1)
print("every run stayed within its budget on every executed step")
EOF
