#!/usr/bin/env bash
# What `tidal train` reports is measured, or says that it is not: never a 0 that stands for
# "nothing was measured".
#
#   tests/cli/reports.sh PATH_TO_TIDAL
set -uo pipefail
tidal=$1
tmp=$(mktemp -d /var/tmp/tidal-reports-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
failures=0
py=$(command -v /usr/bin/python3 || command -v python3)

# (The other case, a plan under which no step ran because re-plans took every executed step,
# reports "not measured" and null: it arises under load and is not made to happen here.)
# A plan that ran: a measured peak, in bytes.
"$tidal" train --model gpt-tiny --batch 2 --seq 16 --steps 5 --warmup-steps 1 --profile-steps 1 \
  --offload plan --dir "$tmp" --json >"$tmp/out.json" 2>"$tmp/err.txt"
if tail -n 1 "$tmp/out.json" | "$py" -c '
import json, sys
j = json.load(sys.stdin)
assert j["steps_measured"] > 0 and j["peak_bytes"] > 0 and "peak_not_measured" not in j, j
'; then
  echo "ok   a plan that ran reports its measured peak"
else
  echo "FAIL a plan that ran: no measured peak"; failures=$((failures + 1))
fi

if ((failures > 0)); then
  echo "$failures failure(s)"
  exit 1
fi
echo "all report checks passed"
