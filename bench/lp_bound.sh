#!/usr/bin/env bash
# How loose is tidal's stall bound? For each cell, tidal's fraction of ideal, the window bound's
# (plan/bound.hpp) and that of a linear-programme relaxation of offloading the iteration
# (bench/lp_bound.py: segments of equal compute, memory checked at one op per segment, tensors
# partly away, channels per segment; a lower bound of every periodic plan). Model results, not
# measurements. Where the LP is close to the window bound, the gap to tidal is the planner's.
#
#   bench/lp_bound.sh [OUT.jsonl]
#
# Environment: TIDAL_BIN (./build/tidal), TIDAL_LP_CASES ("model:batch:seq:micro-batches:
# precision:SSDs:host-memory[:order] ..."; the order sequential (default) or layer-major; default: the worst cells of the Figure 9 sweep and the bf16
# grid), TIDAL_LP_SEGMENTS (48; more is tighter and slower: Llama3-70B takes minutes at 48),
# TIDAL_VENV (.venv). Installs scipy (HiGHS) into the venv for the benchmarks only (bench/lp_env.sh).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
bin=${TIDAL_BIN:-$root/build/tidal}
out=${1:-$root/build/lp_bound.jsonl}
segments=${TIDAL_LP_SEGMENTS:-48}
cases=${TIDAL_LP_CASES:-"llama3-8b:32:2048:4:fp32:1:0 llama3-8b:32:2048:4:fp32:2:0 llama3-70b:16:2048:2:fp32:1:256GB llama3-70b:16:2048:2:fp32:2:128GB"}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
# shellcheck source=bench/lp_env.sh
source "$root/bench/lp_env.sh"
mkdir -p "$(dirname "$out")"
: >"$out"
for c in $cases; do
  IFS=: read -r model batch seq mb precision ssds host order <<<"$c"
  order=${order:-sequential}
  echo "== $model b$batch s$seq, $mb micro-batches, $precision, $ssds SSDs, host memory $host" >&2
  "$lp_py" "$root/bench/lp_bound.py" --segments "$segments" --simulate "$bin" simulate \
    --model "$model" --batch "$batch" --seq "$seq" --tensor-parallel 2 \
    --micro-batches "$mb" --micro-batch-order "$order" --precision "$precision" \
    --hardware h100-4ssd --ssd "${ssds}x6.5/6.7GB/s" --host-mem "$host" --policy ideal,tidal \
    --profile-steps 0 |
    python3 -c 'import json, sys; r = json.loads(sys.stdin.read()); r.update(zip(
      ("precision", "ssds", "host", "micro_batches", "order"), sys.argv[1:6])); print(json.dumps(r))' \
      "$precision" "$ssds" "$host" "$mb" "$order" >>"$out"
done
python3 - "$out" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| cell | tidal | window bound | LP bound | tidal / LP | LP time |")
print("|---|---|---|---|---|---|")
for r in rows:
    cell = (f"{r['model']} b{r['batch']} s{r['seq']} {r['micro_batches']} mb {r['precision']}, "
            f"{r['ssds']} SSD, host {r['host']}" + (", LM" if r.get("order") == "layer-major" else ""))
    t, w, l = r["tidal_fraction_of_ideal"], r["window_bound_fraction_of_ideal"], r["lp_fraction_of_ideal"]
    print(f"| {cell} | {100 * t:.1f}% | {100 * w:.1f}% | {100 * l:.1f}% | {t / l:.3f} | "
          f"{r['lp_seconds']:.0f} s ({r['segments']} segments) |")
print(f"\nJSON lines in {sys.argv[1]}; fractions of ideal, higher is better; a bound is what no "
      "plan beats, so the tighter bound is the lower one")
EOF
