#!/usr/bin/env bash
# The code's shape, checked in CI (scripts/test.sh): fails on
#   - a file in src/ over 600 lines;
#   - a function in src/ or tools/ over 80 lines (lizard's length: first line to last);
#   - a dated reference to earlier work in src/ or include/: the word session, issue or turn
#     followed by a number. A rule belongs in the code and its history in git; figures belong in
#     docs/results.md.
# lizard comes from PyPI (scripts/requirements.txt) into the project's venv.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${TIDAL_VENV:-$root/.venv}/bin/python
fail=0

long_files=$(find src -name '*.[ch]pp' -print0 | xargs -0 wc -l | awk '$2 != "total" && $1 > 600')
if [ -n "$long_files" ]; then
  echo "shape: files in src/ over 600 lines (cut them at a seam, one concept per file):"
  echo "$long_files"
  fail=1
fi

long_functions=$("$py" -m lizard -l cpp -L 80 -C 100000 -a 100000 -T nloc=100000 -w src tools 2>/dev/null || true)
if [ -n "$long_functions" ]; then
  echo "shape: functions in src/ or tools/ over 80 lines:"
  echo "$long_functions" | sed -E 's/ has [0-9]+ NLOC, [0-9]+ CCN, [0-9]+ token, [0-9]+ PARAM, ([0-9]+) length.*/: \1 lines/'
  fail=1
fi

dated=$(grep -rn -i -E '\b(session|issue|turn)s? ?#?[0-9]+' src include || true)
if [ -n "$dated" ]; then
  echo "shape: dated references to earlier work in src/ or include/ (say the rule, not when it came):"
  echo "$dated"
  fail=1
fi

if [ $fail = 0 ]; then
  echo "shape: files under 600 lines, functions under 80, no dated references"
fi
exit $fail
