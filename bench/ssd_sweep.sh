#!/usr/bin/env bash
# TERAIO's Figure 9 in the simulator (model results, not measurements): tidal's fraction of ideal
# as the SSDs per GPU (1-4) and the host memory per GPU (0-1 TB) vary, for one cell of the
# paper's grid per model, with the lower bound of any plan beside each figure.
#
#   bench/ssd_sweep.sh [OUT.jsonl]
#
# The setup is bench/paper_grid.sh's: two H100 NVL GPUs in tensor parallel (each row is one
# GPU's array and share of host memory), micro-batches of 8 sequences, fp32, the optimizer step
# after backward. Environment: TIDAL_BIN (default ./build/tidal), TIDAL_SWEEP_CASES
# ("model:batch:seq ..."), TIDAL_SWEEP_SSDS ("1 2 3 4"), TIDAL_SWEEP_HOST ("0 64GB ... 1TB"),
# TIDAL_SWEEP_PRECISION (fp32), TIDAL_SWEEP_ORDER (the micro-batch order: sequential, the
# default; layer-major; auto: tidal plans both, keeps the faster, and its bound is the lower of
# the two orders'); TIDAL_SWEEP_LP=1: where tidal is under 0.95 of the bound, the LP relaxation
# of bench/lp_bound.py too (TIDAL_LP_SEGMENTS, 48; needs scipy, installed into the venv by
# bench/lp_env.sh), and the cell is read against the tighter of the two bounds (both in the JSON).
set -euo pipefail
bin=${TIDAL_BIN:-./build/tidal}
out=${1:-build/ssd_sweep.jsonl}
cases=${TIDAL_SWEEP_CASES:-"llama3-8b:32:2048 llama3-70b:16:2048"}
ssds=${TIDAL_SWEEP_SSDS:-"1 2 3 4"}
hosts=${TIDAL_SWEEP_HOST:-"0 64GB 128GB 256GB 512GB 1TB"}
precision=${TIDAL_SWEEP_PRECISION:-fp32}
order=${TIDAL_SWEEP_ORDER:-sequential}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
lp_py=""
if [ "${TIDAL_SWEEP_LP:-0}" = 1 ]; then
  # shellcheck source=bench/lp_env.sh
  source "$(dirname "$0")/lp_env.sh"
fi
mkdir -p "$(dirname "$out")"
: >"$out"

for c in $cases; do
  IFS=: read -r model batch seq <<<"$c"
  mb=$((batch / 8))
  [ "$mb" -ge 1 ] || mb=1
  order_flags=()
  [ "$mb" -gt 1 ] && order_flags=(--micro-batch-order "$order")
  for n in $ssds; do
    for host in $hosts; do
      echo "== $model b$batch s$seq: ${n} SSDs, host memory $host" >&2
      args=(simulate --model "$model" --batch "$batch" --seq "$seq" --tensor-parallel 2
        --micro-batches "$mb" --precision "$precision" --hardware h100-4ssd
        --ssd "${n}x6.5/6.7GB/s" --host-mem "$host" "${order_flags[@]}" --policy ideal,tidal
        --profile-steps 0 --json)
      j=$("$bin" "${args[@]}" | tail -n 1)
      lp="{}"
      if [ -n "$lp_py" ] && python3 -c 'import json, sys; r = json.loads(sys.argv[1])
b = r["lower_bound"]["fraction_of_ideal"]
sys.exit(0 if b is not None and r["policies"]["tidal"]["fraction_of_ideal"] < 0.95 * b else 1)' "$j"; then
        lp=$("$lp_py" "$(dirname "$0")/lp_bound.py" --segments "${TIDAL_LP_SEGMENTS:-48}" \
          --simulate "$bin" "${args[@]}")
      fi
      python3 - "$model" "$batch" "$seq" "$n" "$host" "$j" "$lp" >>"$out" <<'EOF'
import json, sys
model, batch, seq, n, host, j, lp = sys.argv[1:8]
r = json.loads(j)
lp = json.loads(lp)
t = r["policies"]["tidal"]
row = {"model": model, "batch": int(batch), "seq": int(seq), "ssds": int(n), "host": host,
       "tidal": t["fraction_of_ideal"], "fits": t["fits"],
       "bound": r["lower_bound"]["fraction_of_ideal"],
       "order": r.get("micro_batch_order", "sequential")}
if lp:
    row.update(window_bound=row["bound"], lp_bound=lp["lp_fraction_of_ideal"],
               bound=min(row["bound"], lp["lp_fraction_of_ideal"]))
    if lp["tidal_beats_lp"]:
        sys.exit(f"a plan beats the LP bound: {json.dumps(lp)}")
print(json.dumps(row))
EOF
    done
  done
done

python3 - "$out" "$precision" "$order" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
auto = sys.argv[3] == "auto"
print(f"precision {sys.argv[2]}, micro-batch order {sys.argv[3]}; tidal's fraction of ideal (lower "
      "bound of any plan in brackets)" + ("; LM: tidal kept layer-major" if auto else ""))
for key in dict.fromkeys((r["model"], r["batch"], r["seq"]) for r in rows):
    mine = [r for r in rows if (r["model"], r["batch"], r["seq"]) == key]
    hosts = list(dict.fromkeys(r["host"] for r in mine))
    print(f"\n{key[0]}, batch {key[1]}, seq {key[2]}\n")
    print("| SSDs per GPU | " + " | ".join(f"host {h}" for h in hosts) + " |")
    print("|---|" + "---|" * len(hosts))
    for n in sorted({r["ssds"] for r in mine}):
        cells = []
        for h in hosts:
            r = next(x for x in mine if x["ssds"] == n and x["host"] == h)
            fit = "" if r["fits"] else " no fit"
            lm = " LM" if auto and r["order"] == "layer-major" else ""
            if r["bound"] is None:  # an op needs more than device memory by itself
                cells.append("no plan fits")
                continue
            cells.append(f"{100 * r['tidal']:.1f}% ({100 * r['bound']:.1f}%){lm}{fit}")
        print(f"| {n} | " + " | ".join(cells) + " |")
bounded = [r for r in rows if r["bound"] is not None]
worst = min((r["tidal"] / r["bound"] for r in bounded), default=float("nan"))
at95 = sum(r["tidal"] / r["bound"] >= 0.95 for r in bounded)
tight = [r for r in rows if "lp_bound" in r]
if tight:
    print(f"\nthe LP bound ran on the {len(tight)} cells under 0.95 of the window bound "
          f"({sum(r['lp_bound'] < r['window_bound'] for r in tight)} of them tighter); the "
          "bracketed bound is the tighter of the two")
print(f"\nlowest tidal / lower bound: {worst:.3f}; {at95} of {len(rows)} cells at or above 0.95"
      + (f" ({len(rows) - len(bounded)} that no plan fits)" if len(bounded) < len(rows) else "")
      + f"; JSON lines in {sys.argv[1]}")
EOF
