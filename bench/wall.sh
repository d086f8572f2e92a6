#!/usr/bin/env bash
# A model larger than its memory budget, from step 0: trains it in mode none (no limit, the
# reference losses and peak), then in plan mode with --strict-meter and a budget in bytes below
# the model's state alone (parameters, gradients and Adam's two moments), and checks that every
# step, warm-up and profiling included, stayed within the budget with the same losses.
#
#   bench/wall.sh [DIR]
#
# On a GPU (TIDAL_WALL_DEVICE=cuda, the default where torch sees one) the budget is a wall in the
# CUDA caching allocator (its memory fraction): an allocation past it fails, and tidal writes
# tensors out and runs the op again. The step peaks are that allocator's. On the CPU the wall is
# tidal's CPU allocator cap. Either way a step over the budget is reported, not hidden.
#
# DIR: the store directory (O_DIRECT, so not tmpfs; default the first of TIDAL_DIRS, else
# /var/tmp/tidal-wall). Knobs: BUILD (default build), OUT (default out/wall), TIDAL_WALL_MODEL
# (model flags; default gpt2-small at seq 1024, batch 1 on a GPU, gpt-tiny on the CPU, whose
# tensors are small, with --min-offload 4KiB),
# TIDAL_WALL_SHARE (the budget as a share of the model state, default 0.75), TIDAL_WALL_STEPS
# (default 5), TIDAL_WALL_PLAN_FLAGS (more flags for the plan run, e.g. "--host-mem 16GiB"). Writes OUT/none.json, OUT/plan.json, OUT/plan.timeline.json, OUT/plan.svg and
# OUT/table.txt. Exit status 1 when a step went over the budget or a loss differs.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=${BUILD:-build}/tidal
out=${OUT:-out/wall}
py=${TIDAL_PY:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
device=${TIDAL_WALL_DEVICE:-}
if [ -z "$device" ]; then
  device=cpu
  "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null &&
    device=cuda
fi
if [ "$device" = cpu ]; then
  model=${TIDAL_WALL_MODEL:-"--model gpt-tiny --seq 32 --batch 1 --min-offload 4KiB"}
else
  model=${TIDAL_WALL_MODEL:-"--model gpt2-small --seq 1024 --batch 1"}
fi
share=${TIDAL_WALL_SHARE:-0.75}
steps=${TIDAL_WALL_STEPS:-5}
dir=${1:-${TIDAL_DIRS:-/var/tmp/tidal-wall}}
dir=${dir%%,*}
[ -x "$bin" ] || {
  echo "bench/wall.sh: no $bin (build first, or set BUILD)" >&2
  exit 1
}
mkdir -p "$out" "$dir"
# shellcheck disable=SC2086  # the model flags are words
"$bin" train $model --device "$device" --steps "$steps" --json >"$out/none.log" 2>&1 ||
  {
    tail -5 "$out/none.log" >&2
    exit 1
  }
tail -1 "$out/none.log" >"$out/none.json"
budget=$("$py" - "$out/none.json" "$share" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
state = 16 * j["parameters"]  # fp32 parameters, gradients and Adam's two moments
print(int(state * float(sys.argv[2])))
PY
)
echo "== budget $budget bytes: $share of the model state" >&2
# shellcheck disable=SC2086
"$bin" train $model --device "$device" --steps "$steps" --offload plan --strict-meter \
  --mem-budget "$budget" --dir "$dir" ${TIDAL_WALL_PLAN_FLAGS:-} --timeline "$out/plan.timeline.json" \
  --timeline "$out/plan.svg" --json >"$out/plan.log" 2>&1 || {
  tail -20 "$out/plan.log" >&2
  exit 1
}
tail -1 "$out/plan.log" >"$out/plan.json"
"$py" - "$out" "$budget" "$device" <<'PY' | tee "$out/table.txt"
import json, sys
out, budget, device = sys.argv[1], int(sys.argv[2]), sys.argv[3]
none = json.load(open(f"{out}/none.json"))
plan = json.load(open(f"{out}/plan.json"))
state = 16 * none["parameters"]
mib = 2**20
print(f"device {device}, {none['model']} seq {none['seq']} batch {none['batch']}: "
      f"model state {state / mib:.1f} MiB, budget {budget / mib:.1f} MiB")
print(f"{'mode':<6} {'max step peak MiB':>18} {'s/step':>8} {'SSD GB/step':>12} "
      f"{'host GB/step':>13}")
for name, j in (("none", none), ("plan", plan)):
    secs = sorted(j["step_seconds"][1:] or j["step_seconds"])
    n = max(1, len(j["step_seconds"]))
    ssd = (j["bytes_read"] + j["bytes_written"]) / n / 1e9
    host = (j.get("bytes_to_host", 0) + j.get("bytes_from_host", 0)) / n / 1e9
    print(f"{name:<6} {max(j['step_peak_bytes']) / mib:>18.1f} "
          f"{secs[len(secs) // 2]:>8.3f} {ssd:>12.2f} {host:>13.2f}")
over = [(i, b) for i, b in enumerate(plan["step_peak_bytes"]) if b > budget]
same = plan["losses"] == none["losses"]
print("per-step peaks (MiB):", " ".join(f"{b / mib:.1f}" for b in plan["step_peak_bytes"]))
print(f"steps over the budget: {over or 'none'}; same losses: {same}")
for k in ("out_of_memory_retries", "notice", "budget_reason", "steps_over_budget"):
    if plan.get(k):
        print(f"{k}: {plan[k]}")
sys.exit(0 if not over and same else 1)
PY
