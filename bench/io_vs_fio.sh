#!/usr/bin/env bash
# Compares tidal's tensor store with fio on the same directory, in the same run.
#
#   bench/io_vs_fio.sh [--two] [--rounds N] [--pause S] [--block B] [--depth Q] [--no-checksum]
#                      [--json FILE] DIR [SIZE]
#
# fio: O_DIRECT, B-byte blocks (default 1MiB), queue depth Q (default 16), io_uring (libaio
# where io_uring does not work), a sequential write then a sequential read of SIZE bytes
# (default 2GiB) in one file in DIR, written fresh (the file is removed first), as tidal's store
# file is.
# tidal: `tidal bench-io --dir DIR --size SIZE --block B --depth Q --json`, which writes then
# reads SIZE bytes of random data through the store, with checksums (unless --no-checksum), and
# verifies every byte.
#
# --rounds N  (default 4) measures both tools N times, alternating which goes first (fio first in
#             odd rounds, tidal first in even ones), so that a disk whose speed drifts (a cloud
#             or virtual disk, a busy host) favours neither. Each round gives a ratio; the
#             result, per direction, is the geometric mean of the median ratio of the rounds
#             fio went first and that of the rounds tidal went first: on the CI machine the
#             tool that goes second tends to gain, so both orders weigh the same whatever N.
# --pause S   (default 5) seconds of idle disk before each tool's turn: a virtual disk that
#             throttles after sustained I/O (a token bucket) otherwise charges one tool for the
#             I/O the other just did (tidal's untimed verification pass included).
# --two       stripes over two subdirectories DIR/a and DIR/b: tidal gets `--dir DIR/a,DIR/b`, fio
#             runs two concurrent jobs of SIZE/2, one file in each subdirectory.
# --json      also writes the figures (every round, and the medians) as one JSON object to FILE.
#
# Prints GB/s (10^9 bytes/s) of both and the ratio tidal/fio for write and read, per round and
# the median, and tidal's checksum CPU time. Exits non-zero when fio or tidal fails, or when
# tidal's verification fails. fio's files are removed at exit. The tidal binary is $TIDAL_BIN
# (default ./build/tidal).
set -euo pipefail

usage() {
  echo "usage: $0 [--two] [--rounds N] [--pause S] [--block B] [--depth Q] [--no-checksum] [--json FILE] DIR [SIZE]" >&2
  echo "       (SIZE default 2GiB; units B KiB MiB GiB KB MB GB)" >&2
  exit 2
}

two=0
# shellcheck source=bench/io_options.sh
source "$(dirname "$0")/io_options.sh"
own_option() {  # --two (the shared options: bench/io_options.sh)
  taken=0
  case "$1" in
    --two) two=1; taken=1 ;;
  esac
}
read_options "$@"
if [ ${#args[@]} -lt 1 ] || [ ${#args[@]} -gt 2 ]; then usage; fi
[[ "$rounds" =~ ^[1-9][0-9]*$ ]] || { echo "--rounds must be a positive integer" >&2; exit 2; }
[[ "$pause" =~ ^[0-9]+$ ]] || { echo "--pause must be whole seconds" >&2; exit 2; }
[[ "$depth" =~ ^[1-9][0-9]*$ ]] || { echo "--depth must be a positive integer" >&2; exit 2; }
dir="${args[0]}"
size_text="${args[1]:-2GiB}"
tidal_bin="${TIDAL_BIN:-./build/tidal}"

command -v fio >/dev/null || { echo "fio is not installed: run scripts/setup.sh" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed to read fio's JSON" >&2; exit 1; }
[ -x "$tidal_bin" ] || { echo "no tidal binary at $tidal_bin: build it or set TIDAL_BIN" >&2; exit 1; }
[ -d "$dir" ] || { echo "$dir is not a directory" >&2; exit 1; }

# shellcheck source=bench/sizes.sh
source "$(dirname "$0")/sizes.sh"
size=$(to_bytes "$size_text")
block=$(to_bytes "$block_text")
if [ "$block" -lt 4096 ] || [ $((block % 4096)) -ne 0 ]; then
  echo "--block must be a multiple of 4KiB (O_DIRECT)" >&2
  exit 2
fi
if [ "$size" -lt "$block" ]; then
  echo "SIZE must be at least one block ($block_text)" >&2
  exit 2
fi

created=()  # subdirectories this script made, removed again at exit when empty
if [ "$two" -eq 1 ]; then
  dirs=("$dir/a" "$dir/b")
  for d in "${dirs[@]}"; do
    [ -d "$d" ] || { mkdir "$d"; created+=("$d"); }
  done
  # Each fio job gets half, in whole blocks; tidal stripes the same total over both.
  per_file=$(((size / 2) / block * block))
  size=$((per_file * 2))
else
  dirs=("$dir")
  per_file=$((size / block * block))
  size=$per_file
fi

files=()
for i in "${!dirs[@]}"; do files+=("${dirs[$i]}/tidal_fio_bench.$i"); done
tmp=$(mktemp -d)
cleanup() {
  rm -f "${files[@]}" "$dir/tidal_fio_probe"
  rm -rf "$tmp"
  for d in "${created[@]}"; do rmdir "$d" 2>/dev/null || true; done
}
trap cleanup EXIT

# io_uring can be compiled into fio yet refused by the kernel or a seccomp filter: probe it.
engine=libaio
if fio --name=probe --filename="$dir/tidal_fio_probe" --size=1048576 --bs=4096 --rw=write \
     --direct=1 --ioengine=io_uring --output-format=json >/dev/null 2>&1; then
  engine=io_uring
fi

# One fio run over all files at once (one job per file), for one direction.
run_fio() {
  local rw=$1 out=$2
  local cmd=(fio --output-format=json --direct=1 --bs="$block" --iodepth="$depth"
             --ioengine="$engine" --size="$per_file" --rw="$rw" --thread)
  local i
  for i in "${!files[@]}"; do cmd+=(--name="$rw$i" --filename="${files[$i]}"); done
  if ! "${cmd[@]}" >"$out" 2>"$out.err"; then
    echo "fio $rw failed:" >&2
    cat "$out.err" >&2
    exit 1
  fi
}

fio_round() {
  rm -f "${files[@]}"
  sync
  sleep "$pause"
  run_fio write "$tmp/fio_write.$1.json"
  run_fio read "$tmp/fio_read.$1.json"
}

tidal_dirs=$(IFS=,; echo "${dirs[*]}")
tidal_cmd=("$tidal_bin" bench-io --dir "$tidal_dirs" --size "$size" --block "$block"
           --depth "$depth" --json $checksum_flag)
tidal_round() {
  local rc=0
  sync
  sleep "$pause"
  "${tidal_cmd[@]}" >"$tmp/tidal.$1.out" 2>"$tmp/tidal.$1.err" || rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "tidal bench-io failed (exit $rc):" >&2
    cat "$tmp/tidal.$1.err" "$tmp/tidal.$1.out" >&2
    exit 1
  fi
}

echo "fio: $engine, O_DIRECT, $block_text blocks, depth $depth, $size bytes over ${#files[@]} file(s)" >&2
echo "tidal: ${tidal_cmd[*]}" >&2
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then
    fio_round "$r"
    tidal_round "$r"
  else
    tidal_round "$r"
    fio_round "$r"
  fi
done

python3 - "$tmp" "$engine" "$size" "${#files[@]}" "$rounds" "$block" "$depth" "$json_out" <<'EOF'
import json, math, statistics, sys

tmp, engine, size, nfiles, rounds, block, depth, json_out = (
    sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
    int(sys.argv[6]), int(sys.argv[7]), sys.argv[8])


def fio_gbps(path, direction):
    # fio may print notices before its JSON: start at the first brace.
    text = open(path).read()
    data = json.loads(text[text.index("{"):])
    jobs = data["jobs"]
    moved = sum(j[direction]["io_bytes"] for j in jobs)
    # The jobs run concurrently: aggregate bandwidth is all bytes over the longest job.
    seconds = max(j[direction]["runtime"] for j in jobs) / 1000.0
    if moved == 0 or seconds <= 0:
        sys.exit(f"fio {direction}: no I/O measured")
    return moved / seconds / 1e9


def tidal_result(r):
    lines = [l for l in open(f"{tmp}/tidal.{r}.out").read().splitlines() if l.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, ValueError):
        sys.exit("tidal bench-io --json did not end with a JSON line")


per_round = []
verified = True
print(f"{'round':>5} {'first':>5} {'':6} {'fio GB/s':>9} {'tidal GB/s':>11} {'tidal/fio':>10} "
      f"{'checksum CPU s':>15}")
for r in range(1, rounds + 1):
    tidal = tidal_result(r)
    verified = verified and tidal.get("verified") is True
    row = {"round": r, "first": "fio" if r % 2 == 1 else "tidal"}
    for direction in ("write", "read"):
        f = fio_gbps(f"{tmp}/fio_{direction}.{r}.json", direction)
        t = float(tidal[f"{direction}_gbps"])
        c = float(tidal.get(f"{direction}_checksum_seconds", 0.0))
        row[f"fio_{direction}_gbps"] = f
        row[f"tidal_{direction}_gbps"] = t
        row[f"{direction}_ratio"] = t / f
        row[f"tidal_{direction}_checksum_seconds"] = c
        print(f"{r:>5} {row['first']:>5} {direction:6} {f:9.2f} {t:11.2f} {t / f:9.2f}x {c:15.3f}")
    per_round.append(row)

def balanced(direction):
    groups = [[row[f"{direction}_ratio"] for row in per_round if row["first"] == first]
              for first in ("fio", "tidal")]
    medians = [statistics.median(g) for g in groups if g]
    return math.prod(medians) ** (1.0 / len(medians))


medians = {d: balanced(d) for d in ("write", "read")}
print(f"tidal/fio over {rounds} round(s) (geometric mean of the fio-first and tidal-first "
      f"medians): write {medians['write']:.3f}x, read {medians['read']:.3f}x")
print(f"files {nfiles}, {size} bytes, block {block}, depth {depth}, fio engine {engine}; "
      f"tidal verified: {'yes' if verified else 'NO'}")

if json_out:
    result = {"size": size, "files": nfiles, "block": block, "depth": depth, "fio_engine": engine,
              "verified": verified, "rounds": per_round,
              "write_ratio": medians["write"], "read_ratio": medians["read"]}
    with open(json_out, "w") as out:
        json.dump(result, out, indent=2)
        out.write("\n")

sys.exit(0 if verified else 3)
EOF
