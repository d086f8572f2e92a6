#!/usr/bin/env bash
# Size sweep of tidal's tensor store against fio, nccl-tests style: block sizes from -b to -e
# (each -f times the last) at each queue depth of -q, one row per shape, with both tools'
# GB/s and the ratio for write and read. Every row is one bench/io_vs_fio.sh run (O_DIRECT,
# same directory, same run, checksums on).
#
#   bench/io_sweep.sh [-b 64KiB] [-e 16MiB] [-f 4] [-q "1 4 16 64"] [-r ROUNDS] [-s SIZE]
#                     [--json FILE] DIR
#
# SIZE (default 512MiB) is the bytes each tool writes then reads per row, raised to 4 blocks x
# depth where that is more (at most 1GiB). Shapes whose tensors in flight (block x depth) pass
# 256MiB are skipped (bench-io holds them all in memory twice). ROUNDS (default 1) is passed to
# io_vs_fio.sh: with more, each ratio is the median of that many rounds that alternate which
# tool goes first. --json writes every row to FILE.
set -euo pipefail

usage() {
  echo "usage: $0 [-b MIN] [-e MAX] [-f FACTOR] [-q \"DEPTHS\"] [-r ROUNDS] [-s SIZE] [--json FILE] DIR" >&2
  exit 2
}
min=64KiB
max=16MiB
factor=4
depths="1 4 16 64"
rounds=1
size=512MiB
json_out=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -b) min="$2"; shift ;;
    -e) max="$2"; shift ;;
    -f) factor="$2"; shift ;;
    -q) depths="$2"; shift ;;
    -r) rounds="$2"; shift ;;
    -s) size="$2"; shift ;;
    --json) json_out="$2"; shift ;;
    -h|--help) usage ;;
    -*) echo "unknown option: $1" >&2; usage ;;
    *) args+=("$1") ;;
  esac
  shift
done
[ ${#args[@]} -eq 1 ] || usage
dir="${args[0]}"
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

bytes() {
  python3 -c '
import re, sys
u = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}
m = re.fullmatch(r"([0-9]+)([a-z]*)", sys.argv[1].strip().lower())
if not m or m.group(2) not in u:
    sys.exit(f"{sys.argv[1]!r} is not a size in KiB/MiB/GiB")
print(int(m.group(1)) * u[m.group(2)])' "$1"
}
lo=$(bytes "$min")
hi=$(bytes "$max")
base=$(bytes "$size")
[[ "$factor" =~ ^[2-9][0-9]*$ ]] || { echo "-f must be an integer >= 2" >&2; exit 2; }

rows=()
block=$lo
while [ "$block" -le "$hi" ]; do
  for q in $depths; do
    inflight=$((block * q))
    if [ "$inflight" -gt $((256 << 20)) ]; then
      echo "skip block $block depth $q: $((inflight >> 20)) MiB in flight" >&2
      continue
    fi
    n=$base
    [ $((4 * inflight)) -gt "$n" ] && n=$((4 * inflight))
    [ "$n" -gt $((1 << 30)) ] && n=$((1 << 30))
    out="$tmp/row.$block.$q.json"
    echo "block $block depth $q size $n" >&2
    bash "$here/io_vs_fio.sh" --rounds "$rounds" --pause 2 --block "$block" --depth "$q" --json "$out" \
      "$dir" "$n" >/dev/null
    rows+=("$out")
  done
  block=$((block * factor))
done

python3 - "$json_out" "${rows[@]}" <<'EOF'
import json, sys

json_out, paths = sys.argv[1], sys.argv[2:]
rows = [json.load(open(p)) for p in paths]


def human(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def median_of(row, key):
    vals = sorted(r[key] for r in row["rounds"])
    return vals[len(vals) // 2] if len(vals) % 2 else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2


print("#                         ----------- write -----------   ------------ read -----------")
print(f"# {'block':>8} {'depth':>5} {'size':>8}   {'fio GB/s':>8} {'tidal':>8} {'ratio':>7}   "
      f"{'fio GB/s':>8} {'tidal':>8} {'ratio':>7}")
for r in rows:
    print(f"  {human(r['block']):>8} {r['depth']:>5} {human(r['size']):>8}   "
          f"{median_of(r, 'fio_write_gbps'):8.2f} {median_of(r, 'tidal_write_gbps'):8.2f} "
          f"{r['write_ratio']:6.2f}x   "
          f"{median_of(r, 'fio_read_gbps'):8.2f} {median_of(r, 'tidal_read_gbps'):8.2f} "
          f"{r['read_ratio']:6.2f}x")
print(f"# O_DIRECT, checksums on, fio engine {rows[0]['fio_engine'] if rows else '?'}; "
      f"{len(rows[0]['rounds']) if rows else 0} round(s) per row; GB/s = 10^9 bytes/s")
if json_out:
    with open(json_out, "w") as f:
        json.dump(rows, f, indent=2)
        f.write("\n")
EOF
