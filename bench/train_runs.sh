# shellcheck shell=bash disable=SC2154  # bin, py, rounds: set by the script that sources it
# Shared by the bench scripts that compare `tidal train` runs: source it once bin (the tidal
# binary), py (a Python) and rounds are set. It makes log, a scratch directory removed at exit,
# train_run and report.
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT

# train_run NAME ARGS...: `$bin train ARGS... --json`, its output in $log/NAME.log and its last
# line (the run's JSON) in $log/NAME.json; a run that fails shows its last lines and exits 1.
train_run() {
  local name=$1
  shift
  "$bin" train "$@" --json >"$log/$name.log" 2>&1 || {
    tail -5 "$log/$name.log" >&2
    exit 1
  }
  awk 'NF { last = $0 } END { print last }' "$log/$name.log" >"$log/$name.json"
}

# report: runs the Python on stdin (the script's table) after lines that give it log, rounds,
# the json and statistics modules, and load(*name), the JSON of the run train_run named
# "-".join(name).
report() {
  {
    cat <<'PY'
import json, statistics, sys
log, rounds = sys.argv[1], int(sys.argv[2])
def load(*name):
    return json.load(open(f"{log}/{'-'.join(map(str, name))}.json"))
PY
    cat
  } | "$py" - "$log" "$rounds"
}
