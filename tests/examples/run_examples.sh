#!/usr/bin/env bash
# Runs every example in the three offload modes (none, activations, plan) and checks what
# offloading promises: the same losses bit for bit (the examples print them as hex floats), an
# activations peak no higher than no offloading's, over every step, and plan mode within its
# budget (the strict meter's wall; each example at a budget its plan can meet). Prints a
# table of peaks, bytes written, misses and step times.
#
#   tests/examples/run_examples.sh BUILD_DIR
set -euo pipefail

build=${1:?usage: run_examples.sh BUILD_DIR}
modes=(none activations plan)
tmp=$(mktemp -d /var/tmp/tidal-examples.XXXXXX)
trap 'rm -rf "$tmp"' EXIT

failures=0
table=()

fail() {
  echo "FAIL $*"
  failures=$((failures + 1))
}

# field SUMMARY_LINE NAME: the value of NAME=... in a summary line.
field() {
  sed -n "s/.* $2=\([^ ]*\).*/\1/p" <<<"$1"
}

# run_example NAME STEPS [ARGS...]: runs tidal_example_NAME in every mode and checks it.
run_example() {
  local name=$1 steps=$2
  shift 2
  local bin="$build/tidal_example_$name"
  declare -A summary=()
  local mode rc
  for mode in "${modes[@]}"; do
    local out="$tmp/$name.$mode.out" err="$tmp/$name.$mode.err"
    rc=0
    # TIDAL_TIMELINE: the session writes its timeline there when it ends (checked below).
    TIDAL_TIMELINE="$tmp/$name.$mode.timeline.json" \
      "$bin" --mode "$mode" --dir "$tmp/store-$name-$mode" --steps "$steps" "$@" >"$out" 2>"$err" ||
      rc=$?
    grep '^step ' "$out" >"$tmp/$name.$mode.steps" || true
    if ((rc != 0)); then
      fail "$name --mode $mode exited with status $rc after $(wc -l <"$tmp/$name.$mode.steps") steps:"
      tail -n 20 "$err" | sed 's/^/    /'
      continue
    fi
    local lines
    lines=$(wc -l <"$tmp/$name.$mode.steps")
    if ((lines != steps)); then
      fail "$name --mode $mode printed $lines step lines, expected $steps"
    fi
    summary[$mode]=$(grep '^summary ' "$out" || true)
    if [[ -z ${summary[$mode]} ]]; then
      fail "$name --mode $mode printed no summary line"
      continue
    fi
    table+=("$(printf '%-10s %-12s %12s %12s %12s %14s %8s %9s' "$name" "$mode" \
      "$(field "${summary[$mode]}" peak_bytes)" "$(field "${summary[$mode]}" steady_peak_bytes)" \
      "$(field "${summary[$mode]}" budget)" \
      "$(field "${summary[$mode]}" bytes_written)" "$(field "${summary[$mode]}" misses)" \
      "$(field "${summary[$mode]}" step_seconds)")")
  done

  # Offloading must not change a single bit of the losses.
  for mode in activations plan; do
    [[ -n ${summary[$mode]:-} && -n ${summary[none]:-} ]] || continue
    if ! cmp -s "$tmp/$name.none.steps" "$tmp/$name.$mode.steps"; then
      fail "$name: losses differ between --mode none and --mode $mode; first difference:"
      diff "$tmp/$name.none.steps" "$tmp/$name.$mode.steps" | head -n 4 | sed 's/^/    /' || true
    else
      echo "ok   $name: $mode losses identical to none ($steps steps)"
    fi
  done

  if [[ -n ${summary[none]:-} && -n ${summary[activations]:-} ]]; then
    # Activation mode's peak, over every step (its reference step and its trial included),
    # must not be above no offloading's.
    local peak_none peak_act
    peak_none=$(field "${summary[none]}" peak_bytes)
    peak_act=$(field "${summary[activations]}" peak_bytes)
    if ((peak_act > peak_none)); then
      fail "$name: activations peak $peak_act B is above none's $peak_none B"
    else
      echo "ok   $name: activations peak $peak_act B <= none's $peak_none B (every step)"
    fi
  fi

  # The timeline each offloading run wrote (TIDAL_TIMELINE), and where its time went: the parts
  # add up to the step within 5%.
  for mode in activations plan; do
    [[ -n ${summary[$mode]:-} ]] || continue
    local verdict
    if verdict=$(/usr/bin/python3 - "$tmp/$name.$mode.timeline.json" "$mode" <<'PY' 2>&1
import json, sys
doc = json.load(open(sys.argv[1]))
r = doc["otherData"]["where_the_time_went"]
assert r["steps"] > 0, r
parts = (r["compute_seconds"] + r["between_ops_seconds"] + r["write_stall_seconds"]
         + sum(r["read_stall_seconds"].values()))
assert abs(parts / r["step_seconds"] - 1) < 0.05, (parts, r)
# Plan mode's ops come from its tracer; activation mode's phases only while it offloads (its
# adaptive rule may have stopped it).
if sys.argv[2] == "plan":
    assert any(e.get("cat") == "op" for e in doc["traceEvents"]), "no op in the timeline"
print(f"{r['step_seconds']:.4f} s a step, parts {parts / r['step_seconds']:.1%}; limit: "
      + " ".join(r["limit"].split()[:6]))
PY
    ); then
      echo "ok   $name: $mode timeline written (TIDAL_TIMELINE): $verdict"
    else
      fail "$name: $mode timeline: $verdict"
    fi
  done

  if [[ -n ${summary[plan]:-} ]]; then
    # Under the strict meter a step over the budget would be an out-of-memory error on a GPU:
    # each example runs at a budget its plan can meet, and missing it fails.
    if [[ $(field "${summary[plan]}" within_budget) != 1 ]]; then
      fail "$name: plan mode over its budget: budget $(field "${summary[plan]}" budget) B," \
        "peak $(field "${summary[plan]}" peak_bytes) B over all steps," \
        "$(field "${summary[plan]}" steady_peak_bytes) B after the first 4"
      grep '^budget: ' "$tmp/$name.plan.out" | sed 's/^/    /' || true
    else
      echo "ok   $name: plan mode within its budget of $(field "${summary[plan]}" budget) B"
    fi
  fi
}

"$build/tidal_example_mnist_cnn" --make-data "$tmp/mnist" 10000 >/dev/null
# 80%: max_pool2d's backward needs 46.5 MiB at once, more than 70% of this model's step.
run_example mnist_cnn 30 --data "$tmp/mnist" --mem-budget 0.8
run_example gan 40
run_example train_loop 8

echo
printf '%-10s %-12s %12s %12s %12s %14s %8s %9s\n' example mode peak_bytes steady_peak \
  budget bytes_written misses step_s
printf '%s\n' "${table[@]}"
echo
if ((failures > 0)); then
  echo "$failures check(s) failed"
  exit 1
fi
echo "all checks passed"
