#!/usr/bin/env bash
# The torch-free commands (plan, simulate, bench-io) on bad or absurd input: a clear error that
# names the flag and what to do (exit status 1 or 2, never a signal or a wrapped number), early.
#
#   tests/cli/core.sh PATH_TO_TIDAL
set -uo pipefail
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh" cli-core "$@"

fail() {  # fail WHAT OUTPUT
  echo "FAIL: $1"
  tail -n 3 <<<"$2" | sed 's/^/    /'
  failures=$((failures + 1))
}

expect() {  # expect FRAGMENT ARGS...: `tidal ARGS...` fails cleanly, soon, and prints FRAGMENT
  local want=$1
  shift
  local out rc
  out=$(timeout 60 "$tidal" "$@" 2>&1)
  rc=$?
  if ((rc == 0 || rc > 2)); then
    fail "(exit status $rc, expected 1 or 2): tidal $*" "$out"
  elif ! grep -qF -- "$want" <<<"$out"; then
    fail "(no '$want' in the message): tidal $*" "$out"
  elif grep -q "18446744073709" <<<"$out"; then
    fail "(a wrapped size in the message): tidal $*" "$out"
  else
    echo "ok   tidal $*"
  fi
}

mkdir -p "$tmp/ssd0" "$tmp/ssd1"
ln -s "$tmp/ssd0" "$tmp/link0"
bench=(bench-io --size 1MiB --block 64KiB)

# Store directories: an empty --dir is an error, not TIDAL_DIRS or a default without a word;
# the same directory twice, however spelt, is one SSD, not two.
TIDAL_DIRS="$tmp/ssd1" expect "--dir '' names no directory" "${bench[@]}" --dir ""
expect "has an empty name between commas" "${bench[@]}" --dir "$tmp/ssd0,,$tmp/ssd1"
expect "are the same directory" "${bench[@]}" --dir "$tmp/ssd0,$tmp/ssd0/"
expect "are the same directory" "${bench[@]}" --dir "$tmp/ssd0,$tmp/link0"
expect "--measure-dir '' names no directory" plan --model gpt2-small --batch 1 --seq 64 \
  --measure-dir ""
# bench-io speaks of its own flags: it has no store capacity to lower.
expect "give a larger --block" bench-io --dir "$tmp/ssd0" --size 512GiB --block 4KiB
# A block the store cannot move whole with O_DIRECT (under 4 KiB, or not a multiple of it) is
# refused at once, saying what to give: --block 3 moved 4 KiB per 3 bytes for minutes.
expect "give a multiple of 4KiB" bench-io --dir "$tmp/ssd0" --size 16MiB --block 3
expect "give a multiple of 4KiB" bench-io --dir "$tmp/ssd0" --block 3
expect "give a multiple of 4KiB" bench-io --dir "$tmp/ssd0" --size 16MiB --block 5000
expect "give a multiple of 4KiB" bench-io --dir "$tmp/ssd0" --size 16MiB --block 0
expect "give a smaller --size" bench-io --dir "$tmp/ssd0" --size 512TiB --block 1GiB
out=$("$tidal" bench-io --dir "$tmp/ssd0" --block 3 2>&1)
grep -q "store capacity" <<<"$out" && fail "bench-io --block 3 speaks of a store capacity" "$out"

# Sizes that would wrap: named, never printed wrapped.
expect "--batch 9223372036854775807" plan --model llama3-8b --batch 9223372036854775807 --seq 512
expect "batch (" plan --model llama3-8b --batch 4294967296 --seq 4096
expect "too large" plan --model gpt2-small --batch 1 --seq 64 --gpu-mem 1e19
# A device memory of 0 is a size given, and not a valid one: not "unknown".
expect "--gpu-mem 0 is not a valid size of device memory" simulate --model gpt2-small --batch 1 \
  --seq 64 --hardware h100-4ssd --gpu-mem 0
expect "--gpu-mem 0B is not a valid size of device memory" plan --model gpt2-small --batch 1 \
  --seq 64 --hardware cpu-here --gpu-mem 0B
expect "give a smaller hidden" simulate --model llama3-8b --batch 1 --seq 64 --hidden 1099511627776 \
  --heads 1 --kv-heads 1 --policy tidal
# --ssd names the figure that is wrong and the form.
expect "the read bandwidth of each SSD" plan --model gpt2-small --batch 1 --seq 64 --ssd 4x6/0GB/s
expect "<count>x<write>/<read>" plan --model gpt2-small --batch 1 --seq 64 --ssd 4x0/0GB/s

# The micro-batch order: auto chooses by tidal's plan, so it needs tidal among the policies; a
# given plan is of one order; layer-major needs micro-batches; a profiled trace has its order.
mb=(--model gpt2-small --layers 2 --batch 4 --seq 256 --micro-batches 2)
expect "give tidal in --policy" simulate "${mb[@]}" --micro-batch-order auto --policy ideal
echo '{}' >"$tmp/plan.json"
expect "not auto" simulate "${mb[@]}" --micro-batch-order auto --plan "$tmp/plan.json"
expect "give --micro-batches 2 or more" plan --model gpt2-small --batch 4 --seq 64 --layer-major
expect "build an analytic trace (--model)" plan --trace "$tmp/plan.json" --micro-batch-order auto
expect "give one of --layer-major and --micro-batch-order sequential" simulate "${mb[@]}" \
  --layer-major --micro-batch-order sequential
# auto: --json names the order kept and both orders' iterations and bounds; the bound reported
# is the lower of the two, and the order kept is the faster plan.
out=$("$tidal" simulate "${mb[@]}" --gpu-mem 800MB --ssd 1x0.5/0.5GB/s --micro-batch-order auto \
  --policy ideal,tidal --profile-steps 0 --json 2>&1 | tail -n 1)
if ! command -v python3 >/dev/null; then
  echo "skip auto's JSON: no python3 here"
elif python3 -c '
import json, sys
j = json.loads(sys.argv[1])
o = j["micro_batch_orders"]
s, l = o["sequential"], o["layer-major"]
fast = min((s, "sequential"), (l, "layer-major"), key=lambda x: x[0]["iteration_seconds"])[1]
assert j["micro_batch_order_requested"] == "auto" and j["micro_batch_order"] == fast
assert j["policies"]["tidal"]["iteration_seconds"] == o[fast]["iteration_seconds"]
lb = j["lower_bound"]["iteration_seconds"]
assert lb == min(s["lower_bound"]["iteration_seconds"], l["lower_bound"]["iteration_seconds"])
assert lb <= s["iteration_seconds"] and lb <= l["iteration_seconds"]
' "$out" 2>"$tmp/auto.err"; then
  echo "ok   simulate --micro-batch-order auto: the faster order kept, the lower bound of the two"
else
  fail "simulate --micro-batch-order auto's JSON" "$(cat "$tmp/auto.err") $out"
fi

# A trace no plan fits (gpt2-small's logits, 8x512x50257 fp32, need more than 200 MB by
# themselves): no bound is given, in the text and as nulls in --json.
nofit=(simulate --model gpt2-small --layers 2 --batch 8 --seq 512 --gpu-mem 200MB --policy ideal,tidal
  --profile-steps 0)
out=$("$tidal" "${nofit[@]}" 2>&1)
if grep -q "no lower bound: no plan fits this trace, as op" <<<"$out" &&
  ! grep -q "lower bound for any plan" <<<"$out"; then
  echo "ok   simulate where no plan fits: no lower bound"
else
  fail "simulate where no plan fits: the bound" "$out"
fi
out=$("$tidal" "${nofit[@]}" --json 2>&1 | tail -n 1)
if ! command -v python3 >/dev/null; then
  echo "skip the no-fit JSON: no python3 here"
elif python3 -c '
import json, sys
j = json.loads(sys.argv[1])
lb = j["lower_bound"]
assert lb["iteration_seconds"] is None and lb["fraction_of_ideal"] is None, lb
assert isinstance(lb["no_fit_op"], int) and lb["no_fit_op"] >= 0, lb
assert not j["policies"]["tidal"]["fits"]
' "$out" 2>"$tmp/nofit.err"; then
  echo "ok   simulate --json where no plan fits: the bound is null, with the op"
else
  fail "simulate --json where no plan fits" "$(cat "$tmp/nofit.err") $out"
fi

# --save-trace and --per-op: the saved trace replays to the same plan and iteration, and the
# per-op table has a row per op whose stalls add up to the iteration's and whose memory stays
# within the device memory; --per-op without tidal's plan says so.
sim=(--model gpt2-small --layers 2 --batch 4 --seq 256 --gpu-mem 800MB --ssd 1x0.5/0.5GB/s
  --profile-steps 0)
a=$("$tidal" simulate "${sim[@]}" --policy ideal,tidal --json --save-trace "$tmp/t.json" \
  --per-op "$tmp/ops.csv" 2>&1 | tail -n 1)
b=$("$tidal" simulate --trace "$tmp/t.json" --gpu-mem 800MB --ssd 1x0.5/0.5GB/s --profile-steps 0 \
  --policy ideal,tidal --json 2>&1 | tail -n 1)
if ! command -v python3 >/dev/null; then
  echo "skip --save-trace and --per-op: no python3 here"
elif python3 -c '
import csv, json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
ta, tb = a["policies"]["tidal"], b["policies"]["tidal"]
assert ta["fits"] and ta["stall_seconds"] > 0, ta
assert abs(ta["iteration_seconds"] - tb["iteration_seconds"]) <= 1e-9 * ta["iteration_seconds"], (ta, tb)
rows = list(csv.DictReader(open(sys.argv[3])))
assert len(rows) == a["ops"], (len(rows), a["ops"])
stall = sum(float(r["stall_s"]) for r in rows)
assert abs(stall - ta["stall_seconds"]) <= 1e-6 * ta["iteration_seconds"], (stall, ta)
assert max(int(r["memory_bytes"]) for r in rows) <= a["capacity_bytes"]
assert sum(int(r["parameter_bytes"]) > 0 for r in rows) > 0
moved = 0  # the busy seconds per op add up to the utilisation of each channel
for ch in ("ssd_write", "ssd_read", "host_write", "host_read"):
    busy = sum(float(r[ch + "_busy_s"]) for r in rows)
    want = ta[ch + "_utilisation"] * ta["iteration_seconds"]
    assert abs(busy - want) <= 1e-6 * ta["iteration_seconds"], (ch, busy, want)
    moved += busy
assert moved > 0, moved
' "$a" "$b" "$tmp/ops.csv" 2>"$tmp/perop.err"; then
  echo "ok   simulate --save-trace replays the same iteration; --per-op has every op, its stall and channel use"
else
  fail "simulate --save-trace / --per-op" "$(cat "$tmp/perop.err") $a"
fi
expect "give tidal in --policy" simulate "${sim[@]}" --policy ideal --per-op "$tmp/ops2.csv"

# A trace too large to hold is refused at once, with its size and what to do (it once ran for
# minutes and ended in std::bad_alloc).
start=$(date +%s%N)
expect "give fewer layers (--layers" plan --model llama3-8b --batch 1 --seq 512 --layers 1000000
ms=$((($(date +%s%N) - start) / 1000000))
((ms < 5000)) || fail "--layers 1000000 took $ms ms to be refused" ""

# A long plan shows its progress on a terminal (script(1) gives it one) ... (the lower bound it
# reports is the one the planner computed, within "planning", where it planned into the waits)
if command -v script >/dev/null; then
  out=$(script -qec "$tidal plan --model llama3-8b --batch 1 --seq 512 --layers 40" /dev/null 2>&1)
  if grep -q "planning .*%" <<<"$out"; then
    echo "ok   plan shows its progress on a terminal"
  else
    fail "plan shows no progress on a terminal" "$out"
  fi
else
  echo "skip progress on a terminal: no script(1) here"
fi
# ... and Ctrl-C stops it at once, saying so, with exit status 130. A background job of a script
# starts with SIGINT ignored: the command must install its own handler to be stopped by it.
"$tidal" plan --model llama3-8b --batch 1 --seq 512 --layers 4000 >"$tmp/int.out" 2>&1 &
pid=$!
sleep 1
kill -INT "$pid"
for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$pid" 2>/dev/null; then
  kill -KILL "$pid"
  wait "$pid" 2>/dev/null
  fail "plan still ran 5 s after SIGINT" "$(cat "$tmp/int.out")"
else
  wait "$pid"
  rc=$?
  if ((rc == 130)) && grep -q "interrupted" "$tmp/int.out"; then
    echo "ok   SIGINT stops plan (exit status 130, said)"
  else
    fail "SIGINT: exit status $rc (expected 130) or no message" "$(cat "$tmp/int.out")"
  fi
fi

# tidal estimate: a Hugging Face config.json's decoder, before it exists in memory.
configs="$(dirname "$0")/../plan/hf_configs"
for cfg in Meta-Llama-3-8B Qwen2.5-32B Mixtral-8x7B-v0.1; do
  out=$(timeout 120 "$tidal" estimate --hf-config "$configs/$cfg.json" --batch 8 --seq 4096 \
    --gpu-mem 80GiB --host-mem 256GiB --json 2>&1) || out+=$'\n'"(exit status $?; 124: timed out)"
  if python3 -c 'import json, sys
j = json.loads(sys.argv[1].splitlines()[-1])
assert j["fits"] and j["step_seconds"] >= j["lower_bound_seconds"] > 0, j
assert j["ideal_seconds"] <= j["step_seconds"] and j["precision"] == "bf16-mixed", j' "$out"; then
    echo "ok   tidal estimate --hf-config $cfg.json"
  else
    fail "tidal estimate --hf-config $cfg.json" "$out"
  fi
done
printf '{"model_type": "bert", "hidden_size": 768}' >"$tmp/bert.json"
expect "not a decoder-only" estimate --hf-config "$tmp/bert.json" --batch 1 --seq 128
printf '{"model_type": "falcon"}' >"$tmp/falcon.json"
expect "model_type 'falcon'" estimate --hf-config "$tmp/falcon.json" --batch 1 --seq 128
printf '{"model_type": "llama", "hidden_size": 64}' >"$tmp/short.json"
expect "has no 'num_hidden_layers'" estimate --hf-config "$tmp/short.json" --batch 1 --seq 128
expect "no plan fits" estimate --hf-config "$configs/Meta-Llama-3-8B.json" --batch 4096 \
  --seq 4096 --gpu-mem 8GiB --host-mem 0
expect "give either --model or --hf-config" estimate --model llama3-8b \
  --hf-config "$configs/Meta-Llama-3-8B.json" --batch 1 --seq 128

((failures == 0)) && echo "all torch-free CLI checks passed"
exit $((failures > 0))
