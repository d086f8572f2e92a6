#!/usr/bin/env bash
# Compares tidal's tensor store with fio on the same directory, in the same run.
#
#   bench/io_vs_fio.sh [--two] [--json FILE] DIR [SIZE]
#
# fio: O_DIRECT, 1 MiB blocks, queue depth 16, io_uring (libaio where io_uring does not work),
# a sequential write then a sequential read of SIZE bytes (default 2GiB) in one file in DIR.
# tidal: `tidal bench-io --dir DIR --size SIZE --block 1MiB --depth 16 --json`, which writes then
# reads SIZE bytes of random data and verifies every byte.
#
# --two   stripes over two subdirectories DIR/a and DIR/b: tidal gets `--dir DIR/a,DIR/b`, fio
#         runs two concurrent jobs of SIZE/2, one file in each subdirectory.
# --json  also writes the figures as one JSON object to FILE.
#
# Prints GB/s (10^9 bytes/s) of both and the ratio tidal/fio for write and read. Exits non-zero
# when fio or tidal fails, or when tidal's verification fails. fio's files are removed at exit.
# The tidal binary is $TIDAL_BIN (default ./build/tidal).
set -euo pipefail

usage() {
  echo "usage: $0 [--two] [--json FILE] DIR [SIZE]   (SIZE default 2GiB; units B KiB MiB GiB KB MB GB)" >&2
  exit 2
}

two=0
json_out=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --two) two=1 ;;
    --json) [ $# -ge 2 ] || usage; json_out="$2"; shift ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $1" >&2; usage ;;
    *) args+=("$1") ;;
  esac
  shift
done
if [ ${#args[@]} -lt 1 ] || [ ${#args[@]} -gt 2 ]; then usage; fi
dir="${args[0]}"
size_text="${args[1]:-2GiB}"
tidal_bin="${TIDAL_BIN:-./build/tidal}"

command -v fio >/dev/null || { echo "fio is not installed: run scripts/setup.sh" >&2; exit 1; }
command -v python3 >/dev/null || { echo "python3 is needed to read fio's JSON" >&2; exit 1; }
[ -x "$tidal_bin" ] || { echo "no tidal binary at $tidal_bin: build it or set TIDAL_BIN" >&2; exit 1; }
[ -d "$dir" ] || { echo "$dir is not a directory" >&2; exit 1; }

# The same units as tidal's parser, so both tools move exactly the same number of bytes.
size=$(python3 - "$size_text" <<'EOF'
import re, sys
units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
         "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40,
         "tb": 10**12}
m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", sys.argv[1].strip().lower())
if not m or m.group(2) not in units:
    sys.exit(f"'{sys.argv[1]}' is not a size (e.g. 2GiB, 512MiB)")
print(int(float(m.group(1)) * units[m.group(2)]))
EOF
)
block=$((1 << 20))
if [ "$size" -lt "$block" ]; then
  echo "SIZE must be at least 1MiB" >&2
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
  local cmd=(fio --output-format=json --direct=1 --bs="$block" --iodepth=16 --ioengine="$engine"
             --size="$per_file" --rw="$rw" --thread)
  local i
  for i in "${!files[@]}"; do cmd+=(--name="$rw$i" --filename="${files[$i]}"); done
  if ! "${cmd[@]}" >"$out" 2>"$out.err"; then
    echo "fio $rw failed:" >&2
    cat "$out.err" >&2
    exit 1
  fi
}

echo "fio: $engine, O_DIRECT, 1MiB blocks, depth 16, $size bytes over ${#files[@]} file(s)" >&2
run_fio write "$tmp/fio_write.json"
run_fio read "$tmp/fio_read.json"

tidal_dirs=$(IFS=,; echo "${dirs[*]}")
echo "tidal: $tidal_bin bench-io --dir $tidal_dirs --size $size --block 1MiB --depth 16 --json" >&2
tidal_rc=0
"$tidal_bin" bench-io --dir "$tidal_dirs" --size "$size" --block 1MiB --depth 16 --json \
  >"$tmp/tidal.out" 2>"$tmp/tidal.err" || tidal_rc=$?
if [ "$tidal_rc" -ne 0 ]; then
  echo "tidal bench-io failed (exit $tidal_rc):" >&2
  cat "$tmp/tidal.err" "$tmp/tidal.out" >&2
  exit 1
fi

python3 - "$tmp" "$engine" "$size" "${#files[@]}" "$json_out" <<'EOF'
import json, sys

tmp, engine, size, nfiles, json_out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]


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


lines = [l for l in open(f"{tmp}/tidal.out").read().splitlines() if l.strip()]
try:
    tidal = json.loads(lines[-1])
except (IndexError, ValueError):
    sys.exit("tidal bench-io --json did not end with a JSON line")

rows = []
for direction, key in (("write", "write_gbps"), ("read", "read_gbps")):
    f = fio_gbps(f"{tmp}/fio_{direction}.json", direction)
    t = float(tidal[key])
    rows.append((direction, f, t, t / f if f > 0 else 0.0))

print(f"{'':6} {'fio GB/s':>9} {'tidal GB/s':>11} {'tidal/fio':>10}")
for direction, f, t, r in rows:
    print(f"{direction:6} {f:9.2f} {t:11.2f} {r:9.2f}x")
verified = tidal.get("verified") is True
print(f"files {nfiles}, {size} bytes, fio engine {engine}; tidal verified: {'yes' if verified else 'NO'}")

if json_out:
    result = {"size": size, "files": nfiles, "fio_engine": engine, "verified": verified}
    for direction, f, t, r in rows:
        result[f"fio_{direction}_gbps"] = f
        result[f"tidal_{direction}_gbps"] = t
        result[f"{direction}_ratio"] = r
    with open(json_out, "w") as out:
        json.dump(result, out, indent=2)
        out.write("\n")

sys.exit(0 if verified else 3)
EOF
