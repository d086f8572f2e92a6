#!/usr/bin/env bash
# Micro-batch order in the simulator (model results, not measurements): tidal's plan on the
# sequential order (each micro-batch's forward and backward in turn) against GreedySnake's
# layer-major order (every micro-batch through a layer before the next) and against auto (tidal
# plans both and keeps the faster: `--micro-batch-order auto`; its bound is the lower of the two
# orders'), each with the optimizer step after backward and in backward, beside ZeRO-Infinity on
# the sequential order (it runs micro-batches in turn), and the lower bound of any plan on each
# trace. About a minute on the 2-core VM.
#
#   bench/layer_major.sh [OUT.jsonl]
#
# Cases (TIDAL_LM_CASES, "model:batch:seq:micro-batches:tensor-parallel:hardware" ...) by
# default: Llama3-70B of the paper's grid (TP 2, h100-4ssd, 4 SSDs and 768 GB of host memory
# per GPU), the same on 1 SSD with 256 GB, and a GreedySnake-like single A100 (a100-2ssd) with
# Llama3-70B (about GPT-65B's size), batch 32 in 8 micro-batches. Precisions: TIDAL_LM_PRECISION
# (default "fp32 bf16-mixed"). TIDAL_BIN (default ./build/tidal).
set -euo pipefail
bin=${TIDAL_BIN:-./build/tidal}
out=${1:-build/layer_major.jsonl}
cases=${TIDAL_LM_CASES:-"llama3-70b:16:2048:4:2:h100-4ssd llama3-70b:16:2048:4:2:h100-4ssd/1x6.5/6.7GB/s/256GB llama3-70b:32:2048:8:1:a100-2ssd"}
precisions=${TIDAL_LM_PRECISION:-"fp32 bf16-mixed"}
[ -x "$bin" ] || { echo "no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
: >"$out"

for c in $cases; do
  IFS=: read -r model batch seq mb tp hw <<<"$c"
  # hardware: a preset, or preset/SSDs/host memory
  IFS=/ read -r preset ssd_n ssd_w ssd_r host <<<"$hw"
  extra=()
  [ -n "${ssd_n:-}" ] && extra+=(--ssd "$ssd_n/$ssd_w/$ssd_r" --host-mem "$host")
  for precision in $precisions; do
    for order in sequential layer-major auto; do
      for sched in after-backward in-backward; do
        flags=(--model "$model" --batch "$batch" --seq "$seq" --micro-batches "$mb"
          --tensor-parallel "$tp" --precision "$precision" --hardware "$preset" "${extra[@]}")
        flags+=(--micro-batch-order "$order")
        [ "$sched" = in-backward ] && flags+=(--optimizer-in-backward)
        policies=ideal,tidal
        [ "$order" = sequential ] && [ "$sched" = after-backward ] && policies+=,zero-infinity
        echo "== $c $precision $order $sched" >&2
        j=$("$bin" simulate "${flags[@]}" --policy "$policies" --json | tail -n 1)
        python3 - "$c" "$precision" "$order" "$sched" "$j" >>"$out" <<'PY'
import json, sys
case, precision, order, sched, j = sys.argv[1:6]
r = json.loads(j)
p = r["policies"]
row = {"case": case, "precision": precision, "order": order, "optimizer": sched,
       "tidal": p["tidal"]["fraction_of_ideal"], "tidal_s": p["tidal"]["iteration_seconds"],
       "fits": p["tidal"]["fits"], "ssd_bytes": p["tidal"]["ssd_bytes_read"] + p["tidal"]["ssd_bytes_written"],
       "bound": r["lower_bound"]["fraction_of_ideal"], "ideal_s": p["ideal"]["iteration_seconds"],
       "chosen": r.get("micro_batch_order", "sequential")}
if "zero-infinity" in p:
    z = p["zero-infinity"]
    row.update(zero=z["fraction_of_ideal"], zero_s=z["iteration_seconds"], zero_fits=z["fits"])
print(json.dumps(row))
PY
      done
    done
  done
done

python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("tidal's fraction of ideal (lower bound of any plan on that trace in brackets), SSD traffic "
      "per iteration; ZeRO-Infinity on the sequential order")
print()
print("| case | precision | optimizer | sequential | layer-major | auto (order kept) | SSD TB seq / layer-major "
      "| ZeRO-Infinity | best tidal / ZeRO-Infinity |")
print("|---|---|---|---|---|---|---|---|---|")
keys = dict.fromkeys((r["case"], r["precision"]) for r in rows)
for case, precision in keys:
    mine = [r for r in rows if r["case"] == case and r["precision"] == precision]
    zero = next((r for r in mine if "zero" in r), None)
    best = min(r["tidal_s"] for r in mine if r["order"] != "auto")
    for sched in ("after-backward", "in-backward"):
        s = next(r for r in mine if r["order"] == "sequential" and r["optimizer"] == sched)
        l = next(r for r in mine if r["order"] == "layer-major" and r["optimizer"] == sched)
        a = next(r for r in mine if r["order"] == "auto" and r["optimizer"] == sched)
        cell = lambda r: f"{100 * r['tidal']:.1f}% ({100 * r['bound']:.1f}%)" + ("" if r["fits"] else " no fit")
        z = ("" if zero is None else f"{100 * zero['zero']:.1f}%" + ("" if zero["zero_fits"] else " no fit"))
        ratio = "" if zero is None or sched != "after-backward" else f"{zero['zero_s'] / best:.2f}x"
        print(f"| {case} | {precision} | {sched} | {cell(s)} | {cell(l)} | {cell(a)} {a['chosen']} | "
              f"{s['ssd_bytes'] / 1e12:.2f} / {l['ssd_bytes'] / 1e12:.2f} | "
              f"{z if sched == 'after-backward' else ''} | {ratio} |")
# auto plans both orders itself: it must keep the faster one, and its bound (the lower of the
# two orders') must not be above the other two rows' bounds on time.
checked = bad = 0
for case, precision in keys:
    for sched in ("after-backward", "in-backward"):
        mine = {r["order"]: r for r in rows
                if r["case"] == case and r["precision"] == precision and r["optimizer"] == sched}
        checked += 1
        fast = min(mine["sequential"]["tidal_s"], mine["layer-major"]["tidal_s"])
        if (abs(mine["auto"]["tidal_s"] - fast) > 1e-9 * fast
                or mine["auto"]["bound"] < max(mine["sequential"]["bound"], mine["layer-major"]["bound"]) - 1e-12):
            bad += 1
            print(f"auto differs from the faster order or the lower bound: {case} {precision} {sched}")
print(f"\nauto kept the faster order with the lower bound in {checked - bad} of {checked} rows; "
      f"JSON lines in {sys.argv[1]}")
PY
