# shellcheck shell=bash disable=SC2154  # bin: set by the script that sources it
# Shared by the bench scripts that compare `tidal train` runs: source it once bin (the tidal
# binary) is set. It makes log, a scratch directory removed at exit, and train_run.
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
