#!/usr/bin/env bash
# clang-format over the C++ sources. --check: report files that would change and fail.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files -co --exclude-standard -- '*.cpp' '*.hpp' '*.h' '*.cu' | sort -u)
if [ "${1:-}" = "--check" ]; then
  bad=0
  for f in "${files[@]}"; do
    [ -f "$f" ] || continue
    clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || { echo "format: $f needs clang-format"; bad=1; }
  done
  [ $bad -eq 0 ] && echo "format: ${#files[@]} files clean"
  exit $bad
fi
clang-format -i "${files[@]}"
