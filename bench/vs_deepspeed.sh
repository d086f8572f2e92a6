#!/usr/bin/env bash
# Compares tidal's tensor store with DeepSpeed's DeepNVMe (the async I/O op under ZeRO-Infinity's
# NVMe offload) on the same directory, in the same run.
#
#   bench/vs_deepspeed.sh [--rounds N] [--pause S] [--block B] [--depth Q] [--no-checksum]
#                         [--sweep] [--sweep-size SIZE] [--sweep-rounds N] [--ds-threads N]
#                         [--memory populated|huge|pageable] [--json FILE]
#                         [--train] [--train-rounds N] DIR [SIZE]
#
# Both sides: O_DIRECT, requests of B bytes (default 1MiB) with Q (default 16) in flight on one
# file in DIR, SIZE bytes (default 2GiB) written then read back, every byte verified.
# - tidal: `tidal bench-io --dir DIR --size SIZE --block B --stripe B --depth Q --json`: SIZE/B
#   tensors of B bytes, each one request (stripe unit B), Q in flight, checksums on unless
#   --no-checksum; its store file is preallocated when the store opens. The tensors are one
#   arena of SIZE bytes made and filled before timing (`--arena whole`), as DeepNVMe's one
#   tensor is: --memory populated (default: 4 KiB pages made in one call, as DeepNVMe's
#   mlock'ed tensor is) or huge (2 MiB pages, which DeepNVMe's allocator does not ask for). On
#   a disk that pays per request or segment, how physically contiguous the pages are changes
#   the figures a lot (docs/io.md), so compare like with like.
# - DeepNVMe: bench/deepnvme_io.py: one page-locked tensor of SIZE bytes written with
#   async_pwrite to a preallocated file and read back with async_pread, through a handle with
#   block_size B, queue_depth Q, overlap_events on, intra_op_parallelism --ds-threads (default
#   1); every byte compared afterwards (DeepNVMe does not check its completions).
# --rounds N (default 4) alternates which side goes first (DeepNVMe in odd rounds), with
# --pause S (default 5) seconds of idle disk after a sync before each side's turn; the result per
# direction is the geometric mean of the median ratio of the rounds each side went first (as in
# bench/io_vs_fio.sh, whose notes on this disk apply).
# --sweep then measures block sizes 1MiB and 8MiB at queue depths 16, 32 and 128 (the block
# sizes and depths of DeepSpeed's ds_nvme_tune, plus tidal's default depth 16), each with
# --sweep-size bytes (default 1GiB) and --sweep-rounds rounds (default 2).
# --train then trains the Python example's GPT with DeepSpeed ZeRO-Infinity and with tidal's plan
# mode side by side (bench/vs_deepspeed_train.sh --dir DIR --rounds N --also-budget 50%, N from
# --train-rounds, default 2; about 8 minutes here) and prints its table.
#
# Set-up: DeepSpeed is installed into the project's venv ($TIDAL_VENV, default .venv) for this
# benchmark only (it is not a dependency of tidal), and only when pip's dry run shows that torch
# stays as it is; its async_io op is JIT-built (needs libaio-dev, installed with apt-get when
# missing and this runs as root). The tidal binary is $TIDAL_BIN (default ./build/tidal).
#
# Prints, per cell, GB/s (10^9 bytes/s) of both sides and the ratios tidal/DeepNVMe, and with
# --json writes every round to FILE. Exits non-zero when either side fails or does not verify.
set -euo pipefail

usage() {
  echo "usage: $0 [--rounds N] [--pause S] [--block B] [--depth Q] [--no-checksum] [--sweep]" >&2
  echo "          [--sweep-size SIZE] [--sweep-rounds N] [--ds-threads N] [--memory KIND]" >&2
  echo "          [--json FILE] [--train] [--train-rounds N] DIR [SIZE]" >&2
  exit 2
}

root=$(cd "$(dirname "$0")/.." && pwd)
sweep=0
sweep_size_text=1GiB
sweep_rounds=2
ds_threads=1
memory=populated
train=0
train_rounds=2
# shellcheck source=bench/io_options.sh
source "$(dirname "$0")/io_options.sh"
own_option() {  # the options of this benchmark alone (the shared ones: bench/io_options.sh)
  taken=2
  case "$1" in
    --sweep) sweep=1; taken=1 ;;
    --sweep-size) [ $# -ge 2 ] || usage; sweep_size_text="$2" ;;
    --sweep-rounds) [ $# -ge 2 ] || usage; sweep_rounds="$2" ;;
    --ds-threads) [ $# -ge 2 ] || usage; ds_threads="$2" ;;
    --memory) [ $# -ge 2 ] || usage; memory="$2" ;;
    --train) train=1; taken=1 ;;
    --train-rounds) [ $# -ge 2 ] || usage; train_rounds="$2" ;;
    *) taken=0 ;;
  esac
}
read_options "$@"
if [ ${#args[@]} -lt 1 ] || [ ${#args[@]} -gt 2 ]; then usage; fi
for v in rounds sweep_rounds depth ds_threads train_rounds; do
  [[ "${!v}" =~ ^[1-9][0-9]*$ ]] || { echo "--${v//_/-} must be a positive integer" >&2; exit 2; }
done
[[ "$pause" =~ ^[0-9]+$ ]] || { echo "--pause must be whole seconds" >&2; exit 2; }
dir="${args[0]}"
size_text="${args[1]:-2GiB}"
tidal_bin="${TIDAL_BIN:-$root/build/tidal}"
venv="${TIDAL_VENV:-$root/.venv}"
py="$venv/bin/python"
# The DeepSpeed release this benchmark was written against (its async_io API: aio_handle,
# new_cpu_locked_tensor, async_pwrite/async_pread, wait).
ds_version="${TIDAL_DEEPSPEED_VERSION:-0.19.8}"

[ -x "$tidal_bin" ] || { echo "no tidal binary at $tidal_bin: build it or set TIDAL_BIN" >&2; exit 1; }
[ -x "$py" ] || { echo "no Python at $py: run scripts/setup.sh or set TIDAL_VENV" >&2; exit 1; }
[ -d "$dir" ] || { echo "$dir is not a directory" >&2; exit 1; }

# shellcheck source=bench/sizes.sh
source "$(dirname "$0")/sizes.sh"

# ---- DeepSpeed, for this benchmark only ----------------------------------------------------
torch_version() { "$py" -c 'import torch; print(torch.__version__)'; }
if ! "$py" -c 'import deepspeed' >/dev/null 2>&1; then
  torch_before=$(torch_version)
  echo "installing deepspeed==$ds_version into $venv for this benchmark (not a tidal dependency)" >&2
  # --no-build-isolation: DeepSpeed's setup imports torch; an isolated build would download a
  # second torch just to build it.
  report=$(mktemp)
  if ! "$venv/bin/pip" install --dry-run --no-build-isolation --quiet --report "$report" \
      "deepspeed==$ds_version" >/dev/null; then
    echo "pip cannot resolve deepspeed==$ds_version here; install it by hand or set TIDAL_DEEPSPEED_VERSION" >&2
    exit 1
  fi
  if ! "$py" - "$report" <<'EOF'
import json, sys
names = [i["metadata"]["name"].lower() for i in json.load(open(sys.argv[1]))["install"]]
bad = [n for n in names if n in ("torch", "torchvision", "torchaudio", "triton")]
if bad:
    sys.exit(f"installing deepspeed would change {', '.join(bad)} in the venv; not done. "
             f"It would install: {', '.join(names)}")
EOF
  then rm -f "$report"; exit 1; fi
  rm -f "$report"
  "$venv/bin/pip" install --no-build-isolation --quiet "deepspeed==$ds_version"
  torch_after=$(torch_version)
  if [ "$torch_before" != "$torch_after" ]; then
    echo "torch changed from $torch_before to $torch_after while installing deepspeed" >&2
    exit 1
  fi
fi
if ! dpkg -s libaio-dev >/dev/null 2>&1 && [ ! -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get install -y libaio-dev >/dev/null 2>&1 ||
      { apt-get update >/dev/null && apt-get install -y libaio-dev >/dev/null; }
  else
    echo "DeepNVMe's async_io op needs libaio-dev: sudo apt-get install -y libaio-dev" >&2
    exit 1
  fi
fi
echo "building DeepNVMe's async_io op (JIT, cached after the first time)" >&2
"$py" "$root/bench/deepnvme_io.py" --build-only >&2

# ---- the rounds ----------------------------------------------------------------------------
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Runs one cell: block bytes, depth, size bytes, rounds; each side's JSON per round in $tmp.
run_cell() {
  local block=$1 q=$2 size=$3 n=$4 cell=$5 r
  local tidal_cmd=("$tidal_bin" bench-io --dir "$dir" --size "$size" --block "$block"
                   --stripe "$block" --depth "$q" --memory "$memory" --arena whole --json
                   $checksum_flag)
  local ds_cmd=("$py" "$root/bench/deepnvme_io.py" --dir "$dir" --size "$size" --block "$block"
                --depth "$q" --threads "$ds_threads")
  echo "cell $cell: $block-byte requests, depth $q, $size bytes, $n round(s)" >&2
  for r in $(seq 1 "$n"); do
    local order=(ds tidal)
    [ $((r % 2)) -eq 0 ] && order=(tidal ds)
    local side
    for side in "${order[@]}"; do
      sync
      sleep "$pause"
      local out="$tmp/$cell.$r.$side"
      local rc=0
      if [ "$side" = tidal ]; then
        "${tidal_cmd[@]}" >"$out" 2>"$out.err" || rc=$?
      else
        "${ds_cmd[@]}" >"$out" 2>"$out.err" || rc=$?
      fi
      if [ "$rc" -ne 0 ]; then
        echo "$side failed (exit $rc) in cell $cell round $r:" >&2
        cat "$out.err" "$out" >&2
        exit 1
      fi
    done
  done
  echo "$cell $block $q $size $n" >>"$tmp/cells"
}

size=$(to_bytes "$size_text")
block=$(to_bytes "$block_text")
run_cell "$block" "$depth" $((size / block * block)) "$rounds" main
if [ "$sweep" -eq 1 ]; then
  sweep_size=$(to_bytes "$sweep_size_text")
  for b in $((1 << 20)) $((8 << 20)); do
    for q in 16 32 128; do
      run_cell "$b" "$q" $((sweep_size / b * b)) "$sweep_rounds" "sweep_${b}_$q"
    done
  done
fi

rc=0
"$py" - "$tmp" "$json_out" "${checksum_flag:-checksums on}" "$ds_threads" "$memory" <<'EOF' || rc=$?
import json, math, statistics, sys

tmp, json_out, checksum, ds_threads, memory = (sys.argv[1], sys.argv[2], sys.argv[3],
                                               int(sys.argv[4]), sys.argv[5])


def last_json(path):
    lines = [l for l in open(path).read().splitlines() if l.strip().startswith("{")]
    if not lines:
        sys.exit(f"{path}: no JSON line")
    return json.loads(lines[-1])


def size_text(n):
    return f"{n >> 20}MiB" if n % (1 << 30) else f"{n >> 30}GiB"


cells = []
verified = True
for line in open(f"{tmp}/cells"):
    cell, block, depth, size, n = line.split()
    block, depth, size, n = int(block), int(depth), int(size), int(n)
    rounds = []
    for r in range(1, n + 1):
        t = last_json(f"{tmp}/{cell}.{r}.tidal")
        d = last_json(f"{tmp}/{cell}.{r}.ds")
        verified = verified and t.get("verified") is True and d.get("verified") is True
        row = {"round": r, "first": "deepnvme" if r % 2 == 1 else "tidal"}
        for direction in ("write", "read"):
            row[f"tidal_{direction}_gbps"] = t[f"{direction}_gbps"]
            row[f"deepnvme_{direction}_gbps"] = d[f"{direction}_gbps"]
            row[f"{direction}_ratio"] = t[f"{direction}_gbps"] / d[f"{direction}_gbps"]
            row[f"tidal_{direction}_checksum_seconds"] = t.get(f"{direction}_checksum_seconds")
        rounds.append(row)

    def balanced(direction):
        groups = [[x[f"{direction}_ratio"] for x in rounds if x["first"] == first]
                  for first in ("deepnvme", "tidal")]
        medians = [statistics.median(g) for g in groups if g]
        return math.prod(medians) ** (1.0 / len(medians))

    def median(key):
        return statistics.median(x[key] for x in rounds)

    cells.append({"cell": cell, "block": block, "depth": depth, "size": size, "rounds": rounds,
                  "write_ratio": balanced("write"), "read_ratio": balanced("read"),
                  "tidal_write_gbps": median("tidal_write_gbps"),
                  "deepnvme_write_gbps": median("deepnvme_write_gbps"),
                  "tidal_read_gbps": median("tidal_read_gbps"),
                  "deepnvme_read_gbps": median("deepnvme_read_gbps")})

print(f"tidal store ({checksum}, {memory} memory) vs DeepNVMe (aio_handle, overlap_events, "
      f"intra_op_parallelism {ds_threads}, page-locked tensor); O_DIRECT both, one file, "
      f"bytes verified both sides")
print(f"{'':23}{'----------- write -----------':>30}   {'------------ read -----------':>30}")
print(f"{'block':>7} {'depth':>5} {'size':>7} {'rounds':>6}  {'DeepNVMe':>9} {'tidal':>8} "
      f"{'ratio':>8}   {'DeepNVMe':>9} {'tidal':>8} {'ratio':>8}")
for c in cells:
    print(f"{size_text(c['block']):>7} {c['depth']:>5} {size_text(c['size']):>7} "
          f"{len(c['rounds']):>6}  {c['deepnvme_write_gbps']:9.2f} {c['tidal_write_gbps']:8.2f} "
          f"{c['write_ratio']:7.3f}x   {c['deepnvme_read_gbps']:9.2f} {c['tidal_read_gbps']:8.2f} "
          f"{c['read_ratio']:7.3f}x")
print("# GB/s = 10^9 bytes/s, medians over the rounds; ratio tidal/DeepNVMe = geometric mean of "
      "the median ratios of the DeepNVMe-first and tidal-first rounds")
main = cells[0]
print("rounds of the first cell:")
for x in main["rounds"]:
    print(f"  round {x['round']} ({x['first']} first): write {x['deepnvme_write_gbps']:.2f} vs "
          f"{x['tidal_write_gbps']:.2f} ({x['write_ratio']:.2f}x), read "
          f"{x['deepnvme_read_gbps']:.2f} vs {x['tidal_read_gbps']:.2f} ({x['read_ratio']:.2f}x)")
print(f"verified: {'yes, every byte on both sides' if verified else 'NO'}")
print("Training against ZeRO-Infinity: bench/vs_deepspeed_train.sh (--train runs it here)")
if json_out:
    with open(json_out, "w") as out:
        json.dump({"checksum": checksum, "memory": memory, "deepnvme_threads": ds_threads,
                   "verified": verified,
                   "cells": cells}, out, indent=2)
        out.write("\n")
sys.exit(0 if verified else 3)
EOF
[ "$rc" -eq 0 ] || exit "$rc"
# ---- training against ZeRO-Infinity (--train) ----------------------------------------------
if [ "$train" = 1 ]; then
  echo "== training: bench/vs_deepspeed_train.sh --dir $dir --rounds $train_rounds --also-budget 50%" >&2
  bash "$root/bench/vs_deepspeed_train.sh" --dir "$dir" --rounds "$train_rounds" --also-budget 50%
fi
