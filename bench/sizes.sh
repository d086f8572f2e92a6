# Shared by the bench scripts: source it. to_bytes SIZE prints the bytes in a size written with
# tidal's units (2GiB, 512MiB, 1.5GB), so that tidal and the tool beside it move exactly the same
# number of bytes; it exits naming the text when that is not a size.
to_bytes() {
  "${py:-python3}" - "$1" <<'EOF'
import re, sys
units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20,
         "mb": 10**6, "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40,
         "tb": 10**12}
m = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", sys.argv[1].strip().lower())
if not m or m.group(2) not in units:
    sys.exit(f"'{sys.argv[1]}' is not a size (e.g. 2GiB, 512MiB)")
print(int(float(m.group(1)) * units[m.group(2)]))
EOF
}
