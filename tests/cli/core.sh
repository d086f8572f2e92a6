#!/usr/bin/env bash
# The torch-free commands (plan, simulate, bench-io) on bad or absurd input: a clear error that
# names the flag and what to do (exit status 1 or 2, never a signal or a wrapped number), early.
#
#   tests/cli/core.sh PATH_TO_TIDAL
set -uo pipefail
tidal=$1
tmp=$(mktemp -d /var/tmp/tidal-cli-core-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failures=0

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
expect "give a larger --block" bench-io --dir "$tmp/ssd0" --block 3
expect "give a smaller --size" bench-io --dir "$tmp/ssd0" --size 512TiB --block 1GiB
out=$("$tidal" bench-io --dir "$tmp/ssd0" --block 3 2>&1)
grep -q "store capacity" <<<"$out" && fail "bench-io --block 3 speaks of a store capacity" "$out"

# Sizes that would wrap: named, never printed wrapped.
expect "--batch 9223372036854775807" plan --model llama3-8b --batch 9223372036854775807 --seq 512
expect "batch (" plan --model llama3-8b --batch 4294967296 --seq 4096
expect "too large" plan --model gpt2-small --batch 1 --seq 64 --gpu-mem 1e19
expect "give a smaller hidden" simulate --model llama3-8b --batch 1 --seq 64 --hidden 1099511627776 \
  --heads 1 --kv-heads 1 --policy tidal
# --ssd names the figure that is wrong and the form.
expect "the read bandwidth of each SSD" plan --model gpt2-small --batch 1 --seq 64 --ssd 4x6/0GB/s
expect "<count>x<write>/<read>" plan --model gpt2-small --batch 1 --seq 64 --ssd 4x0/0GB/s

((failures == 0)) && echo "all torch-free CLI checks passed"
exit $((failures > 0))
