#!/usr/bin/env bash
# The measured ROK curve (recompute / offload / keep) on this machine, in one run:
#   keep (--offload none), recompute (checkpointing of each block), activations (SSDTrain-like)
#   and plan (TERAIO-like, --mem-budget 50%), on one model shape where activations dominate
#   memory. Prints peak tensor memory and median step time, each as a ratio to keep.
#
#   bench/rok.sh [DIR] [-- extra tidal train flags]
#
# DIR is the store directory (default /var/tmp/tidal); the store uses O_DIRECT. The model shape
# defaults to a 4-layer, 256-wide GPT-2 at batch 8, seq 256 (about 8 s a step on 2 cores);
# override with TIDAL_ROK_MODEL="--model gpt2-small --batch 8 --seq 512" and TIDAL_ROK_STEPS.
# Also writes the profiled trace and plan to $TIDAL_ROK_OUT (default build/rok) and runs
# `tidal simulate --trace` on them with the cpu-here preset, to compare predicted and measured.
set -euo pipefail
dir=${1:-/var/tmp/tidal}
shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
bin=${TIDAL_BIN:-./build/tidal}
out=${TIDAL_ROK_OUT:-build/rok}
steps=${TIDAL_ROK_STEPS:-5}
read -r -a model <<<"${TIDAL_ROK_MODEL:---model gpt-tiny --hidden 256 --layers 4 --heads 8 --batch 8 --seq 256}"
mkdir -p "$dir" "$out"
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }

run() {  # name, flags...
  local name=$1
  shift
  echo "== $name: $bin train ${model[*]} $* --dir $dir --json" >&2
  "$bin" train "${model[@]}" "$@" --dir "$dir" --json "${extra[@]}" 2>"$out/$name.log" | tail -n 1 >"$out/run-$name.json"
}
run keep --steps "$steps" --offload none
run recompute --steps "$steps" --offload none --recompute
run activations --steps "$steps" --offload activations
run plan --steps $((steps + 3)) --offload plan --mem-budget 50% \
  --save-trace "$out/trace.json" --save-plan "$out/plan.json"

budget=$(python3 -c "import json;print(json.load(open('$out/plan.json'))['summary']['capacity_bytes'])" 2>/dev/null || echo 0)
"$bin" simulate --trace "$out/trace.json" --hardware cpu-here --gpu-mem "$budget" --policy all \
  --json >"$out/simulate.json" 2>"$out/simulate.log" || echo "simulate failed: see $out/simulate.log" >&2

python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
rows = []
for name in ["keep", "recompute", "activations", "plan"]:
    j = json.load(open(f"{out}/run-{name}.json"))
    if name == "plan":
        t = j["offload_step_seconds_median"]
    else:
        t = statistics.median(j["step_seconds"][1:] or j["step_seconds"])
    rows.append((name, j["peak_bytes"], t, j.get("bytes_written", 0), j.get("stall_seconds", 0),
                 j.get("misses", 0), j["losses"]))
keep = rows[0]
print(f"{'policy':<12} {'peak MiB':>10} {'peak/keep':>10} {'step s':>8} {'time/keep':>10} "
      f"{'written MiB':>12} {'stall s':>8} {'misses':>7} same losses")
for name, peak, t, w, stall, misses, losses in rows:
    print(f"{name:<12} {peak/2**20:>10.1f} {peak/keep[1]:>10.3f} {t:>8.3f} {t/keep[2]:>10.3f} "
          f"{w/2**20:>12.1f} {stall:>8.3f} {misses:>7} {'yes' if losses[:min(len(losses), len(keep[6]))] == keep[6][:min(len(losses), len(keep[6]))] else 'NO'}")
# Predicted (simulator, cpu-here, the plan's own capacity) against measured, for plan mode.
try:
    sim = json.loads(open(f"{out}/simulate.json").read().strip().splitlines()[-1])["policies"]
    p = rows[3]
    for pol in ["keep-all", "tidal"]:
        if pol in sim:
            s = sim[pol]
            print(f"simulated {pol:<9}: iteration {s['iteration_seconds']:.3f} s, peak "
                  f"{s['peak_bytes']/2**20:.1f} MiB (trace tensors), fits {s['fits']}")
    print(f"measured  plan     : step {p[2]:.3f} s, peak {p[1]/2**20:.1f} MiB (all allocations)")
except Exception as e:  # noqa: BLE001
    print(f"(no simulation: {e})")
PY
