#!/usr/bin/env bash
# The host-rich GPU machine in the simulator (issue 49; model results, not measurements): one
# GPU with far more host RAM than fast SSDs, where users train in bf16 mixed precision. For each
# case, tidal with the optimizer step on the device (the plans before issue 49), tidal choosing
# the placement (--optimizer-step auto: the step on the device, or on the host with the fp32
# state in host memory and 16-bit weights and gradients crossing the link), the lower bound of
# the class it chose from, and the modelled ZeRO-Offload, all as fractions of the ideal
# iteration, with the ratio tidal / ZeRO-Offload; all from `tidal simulate` runs.
#
#   bench/host_rich.sh [OUT.jsonl]
#
# The machine (TIDAL_HOST_RICH_HW): the h100-4ssd preset's GPU at 700 TFLOP/s bf16 with 100 GiB
# of host memory for offloads, a 50 GB/s host link and one SSD of 2.0/1.7 GB/s (the H200 machine
# this project is measured on, docs/results.md), CPU Adam at 2e9 parameters/s and gradient
# accumulation at 6e9 elements/s (the preset's; bench/host_adam.sh measures a machine's).
# TIDAL_HOST_RICH_CASES: "name:model flags:budget" cases separated by ';' (default: the issue's
# gpt2-xl at 8 GiB and a 3B Llama-style decoder at 16 GiB, bf16-mixed and fp32, from 4
# micro-batches to 256k tokens per optimizer step; in bf16-mixed tidal also chooses the
# micro-batch order, --micro-batch-order auto, the ZeRO-Offload model runs the sequential one). TIDAL_BIN (default ./build/tidal).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bin=${TIDAL_BIN:-./build/tidal}
out=${1:-build/host_rich.jsonl}
hw=${TIDAL_HOST_RICH_HW:-"--host-mem 100GiB --host-link 50GB/s --ssd 1x2.0/1.7GB/s --gpu-flops-bf16 700T --cpu-adam 2G --cpu-accumulate 6G"}
xl="--model gpt2-xl --seq 1024"
l3="--model llama3.2-1b --layers 28 --hidden 3072 --heads 24 --kv-heads 8 --ffn 8192 --seq 2048"
default_cases="gpt2-xl fp32 mb4:$xl --batch 16 --micro-batches 4 --precision fp32:8GiB;\
gpt2-xl fp32 mb8:$xl --batch 32 --micro-batches 8 --precision fp32:8GiB;\
gpt2-xl bf16-mixed mb4:$xl --batch 16 --micro-batches 4 --precision bf16-mixed --micro-batch-order auto:8GiB;\
gpt2-xl bf16-mixed mb8:$xl --batch 32 --micro-batches 8 --precision bf16-mixed --micro-batch-order auto:8GiB;\
gpt2-xl bf16-mixed 256k tokens:$xl --batch 256 --micro-batches 64 --precision bf16-mixed --micro-batch-order auto:8GiB;\
3B bf16-mixed mb8:$l3 --batch 32 --micro-batches 8 --precision bf16-mixed --micro-batch-order auto:16GiB;\
3B bf16-mixed 256k tokens:$l3 --batch 128 --micro-batches 32 --precision bf16-mixed --micro-batch-order auto:16GiB"
cases=${TIDAL_HOST_RICH_CASES:-$default_cases}
[ -x "$bin" ] || { echo "bench/host_rich.sh: no tidal binary at $bin: build first (scripts/build.sh)" >&2; exit 1; }
mkdir -p "$(dirname "$out")"
: >"$out"
IFS=';' read -ra list <<<"$cases"
for c in "${list[@]}"; do
  name=${c%%:*}
  rest=${c#*:}
  flags=${rest%:*}
  budget=${rest##*:}
  echo "== $name: $bin simulate $flags --gpu-mem $budget $hw --optimizer-step device|auto" >&2
  # shellcheck disable=SC2086  # the flags are words
  device=$("$bin" simulate $flags --gpu-mem "$budget" $hw --policy ideal,zero-offload,tidal \
    --optimizer-step device --profile-steps 0 --json | tail -n 1)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086
  auto=$("$bin" simulate $flags --gpu-mem "$budget" $hw --policy ideal,zero-offload,tidal \
    --optimizer-step auto --profile-steps 0 --json | tail -n 1)
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  python3 - "$name" "$wall" "$device" "$auto" >>"$out" <<'EOF'
import json, sys
name, wall, device, auto = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
ideal = auto["policies"]["ideal"]["iteration_seconds"]
tidal = auto["policies"]["tidal"]
zero = auto["policies"]["zero-offload"]
bound = auto["lower_bound"]
row = {
    "case": name,
    "ideal_seconds": ideal,
    "tokens_per_step": auto["batch"] * auto["seq"],
    "tidal_device_of_ideal": device["policies"]["tidal"]["fraction_of_ideal"],
    "tidal_device_fits": device["policies"]["tidal"]["fits"],
    "tidal_of_ideal": tidal["fraction_of_ideal"],
    "tidal_fits": tidal["fits"],
    "optimizer_step": tidal.get("optimizer_step"),
    "tidal_note": tidal["note"],
    "bound_of_ideal": (ideal / bound["iteration_seconds"]) if bound.get("iteration_seconds") else None,
    "zero_offload_of_ideal": zero["fraction_of_ideal"],
    "zero_offload_fits": zero["fits"],
    "tidal_over_zero_offload": zero["iteration_seconds"] / tidal["iteration_seconds"],
    "auto_wall_seconds": wall,
}
print(json.dumps(row))
EOF
done
python3 - "$out" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def pct(x, fits=True):
    return "n/a" if x is None else f"{100 * x:.1f}%" + ("" if fits else " (no fit)")
print(f"| case | tokens/step | tidal, step on device | tidal, auto | chose | bound | ZeRO-Offload | tidal / ZeRO-Offload | auto wall s |")
print("|---|---:|---:|---:|---|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['case']} | {r['tokens_per_step']} | {pct(r['tidal_device_of_ideal'], r['tidal_device_fits'])} | "
          f"{pct(r['tidal_of_ideal'], r['tidal_fits'])} | {r['optimizer_step']} | {pct(r['bound_of_ideal'])} | "
          f"{pct(r['zero_offload_of_ideal'], r['zero_offload_fits'])} | {r['tidal_over_zero_offload']:.2f}x | "
          f"{r['auto_wall_seconds']:.1f} |")
EOF
