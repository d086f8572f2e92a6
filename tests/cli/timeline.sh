#!/usr/bin/env bash
# `tidal train --timeline`: the Chrome trace and the SVG of the last steps, and the report of
# where the time went, checked against the run's own figures.
#
#   tests/cli/timeline.sh PATH_TO_TIDAL
set -uo pipefail
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh" timeline "$@"
check() {  # check NAME: runs the Python on stdin, with $tmp as argv[1]
  if "$py" - "$tmp" >"$tmp/check.txt" 2>&1; then
    echo "ok   $1"
  else
    echo "FAIL $1"
    cat "$tmp/check.txt"
    failures=$((failures + 1))
  fi
}

# The checks every timeline passes. argv: timeline, train's --json line, the run's mode.
cat >"$tmp/common.py" <<'PY'
import json, sys


def check_timeline(path, run, mode):
    doc = json.load(open(path))
    events = doc["traceEvents"]
    lanes = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {"steps", "ops (stalls nested)", "I/O SSD write", "I/O SSD read"} <= lanes, lanes
    steps = {e["args"]["step"]: e for e in events if e.get("cat") == "step"}
    assert len(steps) == 2, steps.keys()  # --timeline-steps 2
    # Every transfer lies within its step (one that ran on past the step's end is cut there, and
    # says by how much; one started between steps is flagged).
    misses = {s: 0 for s in steps}
    transfers = 0
    for e in events:
        if e.get("cat") != "transfer":
            continue
        transfers += 1
        s = steps[e["args"]["step"]]
        assert s["ts"] - 1 <= e["ts"] and e["ts"] + e["dur"] <= s["ts"] + s["dur"] + 1, (e, s)
        if e["args"]["kind"] == "miss" and not e["args"].get("between_steps"):
            misses[e["args"]["step"]] += 1
    assert transfers > 0, "no transfer in the last steps"
    # Each miss the stats counted is in the timeline.
    for step, e in steps.items():
        assert misses[step] == e["args"]["misses"], (step, misses[step], e["args"]["misses"])
    # The memory counter never exceeds the step's measured peak.
    peaks = {s: e["args"]["peak_bytes"] for s, e in steps.items()}
    windows = {s: (e["ts"], e["ts"] + e["dur"]) for s, e in steps.items()}
    counters = 0
    for e in events:
        if e["ph"] == "C" and e["name"] == "memory":
            counters += 1
            step = next(s for s, (lo, hi) in windows.items() if lo - 1 <= e["ts"] <= hi + 1)
            assert e["args"]["in_use"] <= peaks[step], (e, peaks[step])
    assert counters > 0, "no memory counter"
    if mode == "plan":
        assert any(e["ph"] == "C" and e["name"] == "planned memory" for e in events)
    # The report: its parts add up to the step, and the step is the trainer's own step.
    r = run["time_report"]
    assert r["steps"] == 2, r
    assert abs(r["accounted"] - 1) < 0.05, r
    trainer = sorted(run["step_seconds"][-2:])
    mean = sum(trainer) / 2
    assert abs(r["step_seconds"] - mean) <= 0.05 * mean + 0.002, (r["step_seconds"], trainer)
    assert r["limit"], r
    return r
PY

"$tidal" train --model gpt-tiny --steps 7 --offload plan --mem-budget 50% --strict-meter \
  --dir "$tmp" --timeline "$tmp/plan.json" --timeline "$tmp/plan.svg" --timeline-steps 2 --json \
  >"$tmp/plan.out" 2>"$tmp/plan.err"
check "plan mode: the timeline has its lanes, counters, misses, and a report that adds up" <<'PY'
import json, sys
sys.path.insert(0, sys.argv[1])
from common import check_timeline
tmp = sys.argv[1]
run = json.loads(open(f"{tmp}/plan.out").read().splitlines()[-1])
r = check_timeline(f"{tmp}/plan.json", run, "plan")
err = open(f"{tmp}/plan.err").read()
assert "where the time went" in err and "limit: " + r["limit"] in err, err
svg = open(f"{tmp}/plan.svg").read()
assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>") and "budget" in svg
PY

"$tidal" train --model gpt-tiny --steps 6 --offload activations --dir "$tmp" \
  --timeline "$tmp/act.json" --timeline-steps 2 --json >"$tmp/act.out" 2>"$tmp/act.err"
check "activation mode: a timeline and a report" <<'PY'
import json, sys
tmp = sys.argv[1]
run = json.loads(open(f"{tmp}/act.out").read().splitlines()[-1])
doc = json.load(open(f"{tmp}/act.json"))
steps = [e for e in doc["traceEvents"] if e.get("cat") == "step"]
assert len(steps) == 2, steps
ops = {e["name"] for e in doc["traceEvents"] if e.get("cat") == "op"}
assert {"forward", "backward"} <= ops, ops  # its phases are its ops
r = run["time_report"]
assert r["steps"] == 2 and abs(r["accounted"] - 1) < 0.05 and r["limit"], r
PY

refused() {  # refused WHAT SAID FRAGMENT ARGS...: `tidal ARGS...` fails, saying FRAGMENT
  local what=$1 said=$2 fragment=$3
  shift 3
  if "$tidal" "$@" >/dev/null 2>"$tmp/refused.err"; then
    echo "FAIL $what was accepted"; failures=$((failures + 1))
  elif grep -q -- "$fragment" "$tmp/refused.err"; then
    echo "ok   $what $said"
  else
    echo "FAIL $what: unclear message"; cat "$tmp/refused.err"
    failures=$((failures + 1))
  fi
}
refused "--timeline with --offload none" "says what it is for" \
  "it is for --offload plan or activations" \
  train --model gpt-tiny --steps 2 --offload none --timeline "$tmp/x.json"
refused "an unwritable --timeline" "fails before the run, naming the flag" "(--timeline)" \
  train --model gpt-tiny --steps 4 --offload plan --dir "$tmp" --timeline /nonexistent-dir/t.json

# The check of a --timeline path before the run creates nothing: at a dangling symlink it made
# the link's target (an empty file), which another user may have chosen.
ln -s "$tmp/chosen-target" "$tmp/dangling.json"
if ! "$tidal" train --model gpt-tiny --batch 2 --seq 16 --steps 3 --offload activations \
  --dir "$tmp" --timeline "$tmp/dangling.json" >/dev/null 2>"$tmp/dangling.err"; then
  echo "FAIL --timeline at a dangling symlink: the run failed"; tail -n 3 "$tmp/dangling.err"
  failures=$((failures + 1))
elif [ -e "$tmp/chosen-target" ]; then
  echo "FAIL --timeline at a dangling symlink created the link's target"
  failures=$((failures + 1))
elif [ -L "$tmp/dangling.json" ] || [ ! -s "$tmp/dangling.json" ]; then
  echo "FAIL --timeline at a dangling symlink: the timeline is not a file there"
  failures=$((failures + 1))
else
  echo "ok   --timeline at a dangling symlink creates nothing at its target"
fi

# The timeline's directory removed during the run: the results (the --json line, the summary)
# are printed all the same, the failed write is a warning naming the path, and the exit status
# is 0 since training succeeded. Removed once the run has started (its first line is printed
# after the paths are checked) and long before its 40 steps end.
mkdir -p "$tmp/gone"
"$tidal" train --model gpt-tiny --batch 2 --seq 16 --steps 40 --offload activations --dir "$tmp" \
  --timeline "$tmp/gone/run.json" --json >"$tmp/gone.out" 2>"$tmp/gone.err" &
pid=$!
for _ in $(seq 1 600); do grep -q "^tidal train: " "$tmp/gone.err" && break; sleep 0.05; done
rm -rf "$tmp/gone"
wait "$pid"
rc=$?
if grep -q "timeline of the last" "$tmp/gone.err"; then
  echo "FAIL the run ended before its timeline's directory was removed: raise its --steps"
  failures=$((failures + 1))
elif ((rc != 0)); then
  echo "FAIL a failed timeline write after training ended the run with $rc"
  tail -n 3 "$tmp/gone.err"; failures=$((failures + 1))
elif ! tail -n 1 "$tmp/gone.out" | "$py" -c 'import json, sys; assert len(json.load(sys.stdin)["losses"]) == 40'; then
  echo "FAIL a failed timeline write lost the --json line"; failures=$((failures + 1))
elif ! grep -qF "warning: --timeline '$tmp/gone/run.json' was not written" "$tmp/gone.err" ||
  ! grep -q "^final loss" "$tmp/gone.err"; then
  echo "FAIL a failed timeline write: no warning naming the path, or no summary"
  tail -n 3 "$tmp/gone.err"; failures=$((failures + 1))
else
  echo "ok   a timeline that cannot be written after the run is a warning; the results are kept"
fi

finish timeline
