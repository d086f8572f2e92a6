#!/usr/bin/env bash
# Bad input to the CLI gets a clear error that names what is wrong and what to do: an exit
# status of 1 or 2, never a signal, and the expected words in the message.
#
#   tests/cli/errors.sh PATH_TO_TIDAL
set -uo pipefail
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh" cli "$@"

expect() {  # expect FRAGMENT ARGS...: `tidal ARGS...` fails cleanly and prints FRAGMENT
  local want=$1
  shift
  local out rc
  out=$("$tidal" "$@" 2>&1)
  rc=$?
  if ((rc == 0 || rc > 2)); then
    echo "FAIL (exit status $rc, expected 1 or 2): tidal $*"
    tail -n 3 <<<"$out" | sed 's/^/    /'
    failures=$((failures + 1))
  elif ! grep -qF -- "$want" <<<"$out"; then
    echo "FAIL (no '$want' in the message): tidal $*"
    tail -n 3 <<<"$out" | sed 's/^/    /'
    failures=$((failures + 1))
  else
    echo "ok   tidal $*"
  fi
}

expect "--stripe 0 must be a power of two" bench-io --dir "$tmp" --size 1MiB --stripe 0
expect "does not exist; create it" bench-io --dir "$tmp/missing" --size 1MiB
touch "$tmp/a-file"
expect "is not a directory" bench-io --dir "$tmp/a-file" --size 1MiB
expect "pseudo file system" bench-io --dir /proc --size 1MiB

train=(train --model gpt-tiny --batch 2 --seq 16 --steps 6 --dir "$tmp")
expect "--mem-budget 0 must be more than 0" "${train[@]}" --offload plan --mem-budget 0
# Text around a number is not ignored: 50xyz% was read as 50%.
expect "is not a percentage: 'xyz' after the number" "${train[@]}" --offload plan \
  --mem-budget 50xyz%
expect "--mem-budget 150% must be a percentage in (0, 100]" "${train[@]}" --offload plan \
  --mem-budget 150%
expect "--timeline-steps -1 must be 0" "${train[@]}" --offload plan --timeline-steps -1
# Options of plan mode in another mode are refused, naming the flag (they did nothing).
expect "--strict-meter is for --offload plan" "${train[@]}" --offload activations --strict-meter
expect "--mem-budget is for --offload plan" "${train[@]}" --offload none --mem-budget 2MiB
expect "--strict-budget is for --offload plan" "${train[@]}" --offload none --strict-budget
expect "--host-mem is for --offload plan or activations" "${train[@]}" --offload none --host-mem 1MiB
expect "--between-steps is for --offload plan" "${train[@]}" --offload none --between-steps resident
# Pre-flight: a model whose state fits in neither the budget, host memory nor the store is
# refused before step 0, saying what to change.
expect "does not fit in the device budget" "${train[@]}" --offload plan --mem-budget 64KiB \
  --host-mem 0 --store-capacity 1MiB
expect "--lr nan is not a learning rate" "${train[@]}" --lr nan
expect "--lr -1 is not a learning rate" "${train[@]}" --lr -1
expect "--lr 0 is not a learning rate" "${train[@]}" --lr 0
# TIDAL_TIMELINE of blanks names no file (a file called " " was written).
TIDAL_TIMELINE=" " expect "TIDAL_TIMELINE=' ' names no file" "${train[@]}" --offload activations
# Usage errors CLI11 finds (flags that exclude each other, a value of the wrong kind) exit 2.
expect "excludes --optimizer-deferred" "${train[@]}" --optimizer-deferred --optimizer-in-backward
expect "Could not convert: --seq" train --model gpt-tiny --seq many --dir "$tmp"
expect "micro-batches must divide the batch" "${train[@]}" --micro-batches 3
expect "--warmup-steps must be 0 or more" "${train[@]}" --offload plan --warmup-steps -1
expect "--ssd gives the planner its SSD figures" "${train[@]}" --offload activations --ssd 1x2GB/s
expect "--save-plan writes plan mode's plan" "${train[@]}" --offload activations \
  --save-plan "$tmp/plan.json"
expect "(--save-trace): its directory '$tmp/no/such/dir' does not exist" "${train[@]}" \
  --offload plan --save-trace "$tmp/no/such/dir/trace.json"
# A file where a directory should be: the path and the flag, not "filesystem error".
expect "cannot write '$tmp/a-file/y.json' (--timeline): '$tmp/a-file' is not a directory" \
  "${train[@]}" --offload plan --timeline "$tmp/a-file/y.json"
expect "(--timeline): it is a directory" "${train[@]}" --offload plan --timeline "$tmp"
if "$tidal" "${train[@]}" --steps 1 --device cuda >/dev/null 2>&1; then
  echo "skip --device cuda: a GPU is here"
else
  expect "this libtorch has no CUDA or no GPU is visible" "${train[@]}" --device cuda
fi
expect "is not a device" "${train[@]}" --device tpu
expect "--dir '' names no directory" train --model gpt-tiny --batch 2 --seq 16 --steps 6 \
  --offload plan --dir ""
expect "--io-compute-cost '0.5/x/1': give three figures" simulate --model gpt2-small --batch 1 \
  --seq 64 --hardware cpu-here --gpu-mem 1GiB --io-compute-cost 0.5/x/1
# A budget no plan can meet is reported with the CLI's flag, not the library's option names.
out=$("$tidal" "${train[@]}" --offload plan --mem-budget 1B 2>&1)
if grep -q "a larger memory budget (--mem-budget" <<<"$out"; then
  echo "ok   an unmeetable --mem-budget names the flag"
else
  echo "FAIL: an unmeetable --mem-budget does not name the flag"
  tail -n 3 <<<"$out" | sed 's/^/    /'
  failures=$((failures + 1))
fi

# Checksums switched off by the environment are said, not silent.
out=$(TIDAL_CHECKSUM=0 "$tidal" "${train[@]}" --offload activations 2>&1)
if grep -q "checksums OFF" <<<"$out"; then
  echo "ok   TIDAL_CHECKSUM=0 is reported"
else
  echo "FAIL: TIDAL_CHECKSUM=0 is not reported"
  failures=$((failures + 1))
fi

# A store too small for the activations: training finishes (rc 0) and says the store filled up,
# in the summary and in --json.
out=$("$tidal" train --model gpt-tiny --batch 4 --seq 64 --steps 4 --dir "$tmp" --offload activations \
  --min-offload 4KiB --store-capacity 1MiB --json 2>&1)
rc=$?
full=$(tail -n 1 <<<"$out" | /usr/bin/python3 -c \
  'import json,sys; print(json.load(sys.stdin)["store_degraded"]["store_full"]["count"])' 2>/dev/null)
if ((rc == 0)) && grep -q "DEGRADED: .* for want of space" <<<"$out" && [[ ${full:-0} -gt 0 ]]; then
  echo "ok   a full store is reported ($full writes refused)"
else
  echo "FAIL: a full store is not reported (rc $rc, store_full ${full:-none})"
  tail -n 3 <<<"$out" | sed 's/^/    /'
  failures=$((failures + 1))
fi

((failures == 0)) && echo "all CLI error checks passed"
exit $((failures > 0))
