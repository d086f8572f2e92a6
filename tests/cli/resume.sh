#!/usr/bin/env bash
# Checkpoint and resume: a run killed with SIGKILL in the middle of a step (activations and
# planned migrations in flight) and resumed from its last checkpoint gives the losses of an
# uninterrupted run, bit for bit, in each offload mode and optimizer schedule, with the optimizer
# step on the device or on the host.
#
#   tests/cli/resume.sh PATH_TO_TIDAL
set -uo pipefail
# shellcheck source=tests/cli/lib.sh
source "$(dirname "$0")/lib.sh" resume "$@"
mkdir -p "$tmp/store"

losses() {  # the losses of a --json run's last line, one per line, exactly as printed
  tail -n 1 "$1" | "$py" -c 'import json,sys; j=json.load(sys.stdin); print(j["first_step"]); [print(repr(x)) for x in j["losses"]]'
}

run_case() {  # run_case NAME ARGS...
  local name=$1
  shift
  local base=(train --model gpt-tiny --batch 4 --seq 32 --steps 10 --min-offload 4KiB
    --warmup-steps 0 --profile-steps 1 --dir "$tmp/store" --json "$@")
  local ck="$tmp/ck-$name"
  "$tidal" "${base[@]}" >"$tmp/$name.full" 2>"$tmp/$name.full.err" || {
    echo "FAIL $name: uninterrupted run failed"; tail -n 3 "$tmp/$name.full.err"
    failures=$((failures + 1)); return; }
  "$tidal" "${base[@]}" --checkpoint "$ck" --checkpoint-every 3 --kill-at-step 8 \
    >"$tmp/$name.killed" 2>&1
  local rc=$?
  if ((rc != 137)); then
    echo "FAIL $name: the run to be killed exited with $rc, not 137 (SIGKILL)"
    failures=$((failures + 1)); return
  fi
  if ls "$ck" | grep -q '\.tmp\.'; then
    echo "FAIL $name: a temporary checkpoint file was left as the checkpoint"; failures=$((failures + 1))
  fi
  # The store's files are unnamed (O_TMPFILE): the killed run left nothing in its directory.
  if [ -n "$(ls -A "$tmp/store")" ]; then
    echo "FAIL $name: the killed run left files in the store directory: $(ls -A "$tmp/store" | head -3)"
    failures=$((failures + 1))
  fi
  "$tidal" "${base[@]}" --resume "$ck" >"$tmp/$name.resumed" 2>"$tmp/$name.resumed.err" || {
    echo "FAIL $name: resumed run failed"; tail -n 3 "$tmp/$name.resumed.err"
    failures=$((failures + 1)); return; }
  mapfile -t full < <(losses "$tmp/$name.full")
  mapfile -t resumed < <(losses "$tmp/$name.resumed")
  local first=${resumed[0]}
  if [[ $first != 6 ]]; then
    echo "FAIL $name: resumed after step $first, expected 6 (checkpoints every 3, killed in 8)"
    failures=$((failures + 1)); return
  fi
  local want=("${full[@]:$((first + 1))}") got=("${resumed[@]:1}")
  if [[ "${want[*]}" != "${got[*]}" ]]; then
    echo "FAIL $name: losses differ after resuming"
    echo "    uninterrupted: ${want[*]}"
    echo "    resumed:       ${got[*]}"
    failures=$((failures + 1))
  else
    echo "ok   $name: steps 7-10 equal bit for bit (${got[*]})"
  fi
}

run_case none --offload none
run_case activations --offload activations
run_case plan --offload plan --mem-budget 50%
run_case plan-offloaded --offload plan --mem-budget 50% --between-steps offloaded
run_case deferred --offload plan --mem-budget 50% --optimizer-deferred --clip-grad-norm 1.0
run_case host-step --offload plan --mem-budget 50% --optimizer-step host
# The step on the host is the device step's arithmetic: the same losses as the plan run's.
if [[ "$(losses "$tmp/host-step.full")" != "$(losses "$tmp/plan.full")" ]]; then
  echo "FAIL host-step: its losses differ from the device step's"; failures=$((failures + 1))
else
  echo "ok   host-step: the losses of the device step, bit for bit"
fi

# Bad input: a missing checkpoint, and one written with other options.
out=$("$tidal" train --model gpt-tiny --steps 3 --resume "$tmp/nowhere" 2>&1)
if (($? == 0)) || ! grep -q "does not exist" <<<"$out"; then
  echo "FAIL --resume of a missing directory: $out"; failures=$((failures + 1))
else
  echo "ok   --resume of a missing directory says so"
fi
out=$("$tidal" train --model gpt-tiny --batch 2 --seq 32 --steps 12 --resume "$tmp/ck-none" 2>&1)
if (($? == 0)) || ! grep -q "written with batch = 4, this run has batch = 2" <<<"$out"; then
  echo "FAIL --resume with another batch: $out"; failures=$((failures + 1))
else
  echo "ok   --resume with another batch names it"
fi
refused_resume() {  # refused_resume DIR FRAGMENT WHAT: --resume DIR exits 1 or 2 saying FRAGMENT
  local out rc
  out=$("$tidal" train --model gpt-tiny --batch 4 --seq 32 --steps 12 --resume "$1" 2>&1)
  rc=$?
  if ((rc == 0 || rc > 2)) || ! grep -q "$2" <<<"$out"; then
    echo "FAIL --resume of $3 (rc $rc): $out"; failures=$((failures + 1))
  else
    echo "ok   --resume of $3 says '$2'"
  fi
}
head -c 1000 "$tmp/ck-none/checkpoint.pt" >"$tmp/truncated.pt"
mkdir -p "$tmp/ck-trunc" && mv "$tmp/truncated.pt" "$tmp/ck-trunc/checkpoint.pt"
refused_resume "$tmp/ck-trunc" "cannot be read" "a truncated checkpoint"

# One bit flipped in the middle of a checkpoint (tensor data): a clear error, not a resumed run
# that trains on wrong weights.
mkdir -p "$tmp/ck-flip" && cp "$tmp/ck-none/checkpoint.pt" "$tmp/ck-flip/checkpoint.pt"
"$py" - "$tmp/ck-flip/checkpoint.pt" <<'PY'
import os, sys
path = sys.argv[1]
with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x10]))
PY
refused_resume "$tmp/ck-flip" "is damaged" "a checkpoint with a flipped bit"
# The same bit flipped and the file's last byte dropped: its checksum trailer is cut, and the
# file is not taken for one written without a checksum.
mkdir -p "$tmp/ck-cut" && head -c -1 "$tmp/ck-flip/checkpoint.pt" >"$tmp/ck-cut/checkpoint.pt"
refused_resume "$tmp/ck-cut" "is damaged: it was written with a checksum, but does not end with it" \
  "a checkpoint with a flipped bit and its last byte dropped"

# Another --layers: the layer count named, not the model's name it changes.
out=$("$tidal" train --model gpt-tiny --layers 3 --batch 4 --seq 32 --steps 12 --resume "$tmp/ck-none" 2>&1)
if (($? == 0)) || ! grep -q "written with layers = [0-9]*, this run has layers = 3" <<<"$out"; then
  echo "FAIL --resume with other --layers: $out"; failures=$((failures + 1))
else
  echo "ok   --resume with other --layers names the layer count"
fi

# The --data file's contents changed since the checkpoint (same path, same size): refused.
head -c 4096 /dev/urandom | base64 >"$tmp/data.txt"
data_run=(train --model gpt-tiny --batch 2 --seq 32 --data "$tmp/data.txt")
if ! "$tidal" "${data_run[@]}" --steps 2 --checkpoint "$tmp/ck-data" >/dev/null 2>"$tmp/data.err"; then
  echo "FAIL a run on --data: $(tail -n 2 "$tmp/data.err")"; failures=$((failures + 1))
else
  "$py" - "$tmp/data.txt" <<'PY'
import sys
path = sys.argv[1]
b = bytearray(open(path, "rb").read())
b[100] = ord("A") if b[100] != ord("A") else ord("B")
open(path, "wb").write(bytes(b))
PY
  out=$("$tidal" "${data_run[@]}" --steps 3 --resume "$tmp/ck-data" 2>&1)
  rc=$?
  if ((rc == 0 || rc > 2)) || ! grep -q "its contents changed since" <<<"$out"; then
    echo "FAIL --resume after the --data file changed (rc $rc): $out"; failures=$((failures + 1))
  else
    echo "ok   --resume after the --data file changed is refused"
  fi
fi

# The disk fills while the checkpoint is written (a file size limit: EFBIG where a full disk
# gives ENOSPC): an error that says so, exit 1 or 2 (not an abort), no temporary file left.
out=$(trap '' XFSZ; ulimit -f 64; "$tidal" train --model gpt-tiny --batch 4 --seq 32 --steps 2 \
  --checkpoint "$tmp/ck-full" 2>&1)
rc=$?
if ((rc == 0 || rc > 2)) || ! grep -q "untouched" <<<"$out"; then
  echo "FAIL a checkpoint on a full disk (rc $rc): $(tail -n 2 <<<"$out")"; failures=$((failures + 1))
elif ls "$tmp/ck-full" | grep -q '\.tmp\.'; then
  echo "FAIL a checkpoint on a full disk left a temporary file"; failures=$((failures + 1))
else
  echo "ok   a checkpoint on a full disk fails with the reason and leaves nothing behind"
fi

# --checkpoint naming a file: the option and the reason, not a filesystem exception.
touch "$tmp/a-file"
out=$("$tidal" train --model gpt-tiny --batch 4 --seq 32 --steps 2 --checkpoint "$tmp/a-file" 2>&1)
rc=$?
if ((rc == 0 || rc > 2)) || ! grep -q -- "--checkpoint '$tmp/a-file' cannot be made a directory" <<<"$out"; then
  echo "FAIL --checkpoint on a file (rc $rc): $out"; failures=$((failures + 1))
else
  echo "ok   --checkpoint on a file names the option"
fi

# SIGTERM (a batch system's notice) once a checkpoint exists: the run dies of the signal and says
# which step the checkpoint holds and how to continue.
"$tidal" train --model gpt-tiny --batch 4 --seq 32 --steps 100000 --checkpoint "$tmp/ck-term" \
  --checkpoint-every 1 >/dev/null 2>"$tmp/term.err" &
pid=$!
for _ in $(seq 1 300); do [ -f "$tmp/ck-term/checkpoint.pt" ] && break; sleep 0.1; done
sleep 0.3
kill -TERM "$pid"
wait "$pid"
rc=$?
if ((rc != 143)) || ! grep -q "interrupted during step .*: the last checkpoint is after step [0-9]*, in '$tmp/ck-term' (continue with --resume" "$tmp/term.err"; then
  echo "FAIL SIGTERM during a run (rc $rc): $(tail -c 300 "$tmp/term.err")"; failures=$((failures + 1))
else
  echo "ok   SIGTERM during a run says what the checkpoint holds ($(grep -o 'after step [0-9]*' "$tmp/term.err"))"
fi

finish resume
