#!/usr/bin/env bash
# tidal on a GPU machine, in one command of at most about 10 minutes (an H100 or H200 with its own
# torch 2.11 + CUDA 13 and Python 3.12):
#   (a) builds tidal into BUILD (default build-gpu) against THIS machine's torch;
#   (b) runs the CUDA tests: the CUDA gtests of tidal_io_tests (CudaDevice.*, CudaCuFile.*) and
#       of tidal_torch_tests (CudaSession.*: the trainer through a Session in every mode; no
#       ctest label marks them, so by gtest filter) and pytest tests/python/test_cuda.py;
#   (c) trains a GPT with CUDA tensors (`tidal train --device cuda`) in modes none, plan and
#       activations: gpt2-small at seq 1024, with the batch that fills about half the GPU;
#   (c2) each offloaded run writes its timeline (OUT/MODE.timeline.json for Perfetto, .svg);
#   (d) prints one table: per mode the CUDA allocator's peak, the step time and its ratio to none,
#       the bytes moved and the stall per step, each beside the simulator's prediction;
#   (e) times the store moving device memory through cuFile against the pinned staging (bounce)
#       buffers, with host memory (bench-io) beside them, on the store's directory.
# It stops at once, saying why, where there is no GPU (no nvidia-smi, or torch sees no device).
#
#   bench/gpu.sh [DIR]
#
# DIR: the store directory, on the SSD to measure (default: the first of TIDAL_DIRS, else
# /var/tmp/tidal-gpu); the store uses O_DIRECT, so not tmpfs. Results under ${OUT:-out/gpu}:
# table.txt, results.json, and each run's JSON and log.
#
# Which torch: the machine's own, with no venv. The build is configured with
# -DTIDAL_PYTHON=<that python> (TIDAL_PYTHON, else python3 on PATH): cmake/TidalTorch.cmake finds
# libtorch through its torch.utils.cmake_prefix_path, and tidal._C is built for that Python.
# Not a venv because scripts/setup.sh's venv part pip-installs torch 2.11.0 (about 5 GB) wherever
# its pins differ, and a --system-site-packages venv over a python3 that is itself a venv or a
# conda env does not see that env's torch. What that Python lacks of the build's other Python
# needs (pybind11, pytest; at scripts/requirements.txt's pins) is pip-installed with --target into
# BUILD/pydeps and put on PYTHONPATH: the machine's site-packages are never changed. Without them
# (no network) the Python module, pytest and the cuFile comparison are left out, saying so.
# Debian packages: when one the build needs is missing, the Debian half of scripts/setup.sh (the
# part before its "# Python:" line) runs; it installs only what is missing (apt, as root or with
# sudo). The CUDA toolkit (nvcc) must be there: torch's CMake config requires it.
#
# A GPU machine without network (the device tool's): make the Debian libraries travel with
# `bash bench/gpu_deps.sh` here (into .gpudeps, which gpu.sh then uses; TIDAL_GPU_DEPS=DIR for
# another folder) and carry that folder.
#
# Knobs: TIDAL_GPU_MODEL (model flags for every run, e.g. "--model gpt2-small --batch 8 --seq
# 1024"; default gpt2-small at seq 1024 with the batch a 2-step probe run sizes to TIDAL_GPU_FILL,
# default 0.5, of the GPU's memory), TIDAL_GPU_STEPS (offloaded steps per mode, default 3),
# TIDAL_GPU_BUDGET (plan mode's --mem-budget, default 50%), TIDAL_GPU_SECONDS (the whole script's
# time limit, default 570; each stage gets what is left, less what the later ones need),
# TIDAL_GPU_IO_SIZE (bytes per cuFile / staging run, default 2GiB), TIDAL_GPU_SIM_HARDWARE (the
# simulator's preset, default h100-4ssd, given the SSD figures the session measured),
# BUILD (default build-gpu), TIDAL_GPU_RUN (below), TIDAL_GPU_BUILD=0 (use BUILD as it is), TIDAL_GPU_DEVICE=cpu (checks
# this script's flow on a machine without a GPU, on a tiny model: no GPU check, no CUDA figures).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
t0=$(date +%s)
limit=${TIDAL_GPU_SECONDS:-570}
build=${BUILD:-build-gpu}
out=${OUT:-out/gpu}
device=${TIDAL_GPU_DEVICE:-cuda}
steps=${TIDAL_GPU_STEPS:-3}
budget=${TIDAL_GPU_BUDGET:-50%}
io_size=${TIDAL_GPU_IO_SIZE:-2GiB}
sim_hw=${TIDAL_GPU_SIM_HARDWARE:-h100-4ssd}
dir=${1:-${TIDAL_DIRS:-/var/tmp/tidal-gpu}}
dir=${dir%%,*}
bin=$build/tidal

note() { echo "== [$(($(date +%s) - t0))s] $*" >&2; }
die() {
  echo "bench/gpu.sh: $*" >&2
  exit 1
}
left() { echo $((limit - ($(date +%s) - t0))); }
# limit_for CAP RESERVE: the seconds a stage may take: at most CAP, leaving RESERVE to the later
# stages where it can, but at least a third of CAP while that much is left; at least 1 (`timeout
# 0` would mean no limit).
limit_for() {
  local s=$(($(left) - $2)) floor=$(($1 / 3))
  ((s > $1)) && s=$1
  # A short TIDAL_GPU_SECONDS must not starve the stage at hand (the tests got 1 s): a third of
  # its cap, as far as time is left; the later stages are then left out, saying so.
  ((s < floor)) && s=$floor
  ((s > $(left))) && s=$(left)
  ((s < 1)) && s=1
  echo "$s"
}
failures=()

# ---- no GPU: stop here ------------------------------------------------------------------------
py=${TIDAL_PYTHON:-$(command -v python3 || true)}
if [ -z "$py" ] || [ ! -x "$py" ]; then
  die "no python3 on PATH (set TIDAL_PYTHON to the Python with the machine's torch)"
fi
if [ "$device" = cuda ]; then
  command -v nvidia-smi >/dev/null ||
    die "no GPU: nvidia-smi is not installed or not on PATH (this script is for a machine with an NVIDIA GPU and its driver)"
  nvidia-smi -L >/dev/null 2>&1 ||
    die "no GPU: nvidia-smi -L fails ($(nvidia-smi -L 2>&1 | head -n 1))"
fi
gpu_info=$("$py" - "$device" <<'PY'
import json, sys
try:
    import torch
except Exception as e:  # noqa: BLE001
    sys.exit(f"{sys.executable} cannot import torch ({e}); set TIDAL_PYTHON to the Python with "
             "the machine's torch")
info = {"python": sys.executable, "python_version": sys.version.split()[0],
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": sys.argv[1]}
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit(f"no GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) in "
                 f"{sys.executable} sees no CUDA device (torch.cuda.is_available() is False)")
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, gpu_memory=p.total_memory)
else:
    info.update(gpu="none (TIDAL_GPU_DEVICE=cpu: a check of this script's flow)", gpu_memory=0)
print(json.dumps(info))
PY
) || die "stopped before the build (see the line above)"
mkdir -p "$out" "$dir"
echo "$gpu_info" >"$out/machine.json"
note "machine: $gpu_info"

# ---- (a) build against this machine's torch ---------------------------------------------------
want_python=1
pydeps=$root/$build/pydeps
deps=${TIDAL_GPU_DEPS:-}
[ -z "$deps" ] && [ -f "$root/.gpudeps/env.sh" ] && deps=$root/.gpudeps
if [ -n "$deps" ]; then
  [ -f "$deps/env.sh" ] || die "TIDAL_GPU_DEPS=$deps has no env.sh (make it with bench/gpu_deps.sh)"
  # shellcheck disable=SC1091
  source "$deps/env.sh"
  note "the build's Debian libraries from $deps (bench/gpu_deps.sh), not the machine's"
fi
if [ "${TIDAL_GPU_BUILD:-1}" != 0 ]; then
  # Debian packages the build needs (a subset of scripts/setup.sh's list).
  if [ -z "$deps" ] && command -v dpkg-query >/dev/null; then
    missing=()
    for p in build-essential cmake ninja-build pkg-config liburing-dev libxxhash-dev \
      nlohmann-json3-dev libcli11-dev libgtest-dev libgmock-dev; do
      dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if ((${#missing[@]} > 0)); then
      grep -q '^# Python: ' scripts/setup.sh || die "scripts/setup.sh has no '# Python:' line to cut its Debian half at; install ${missing[*]}"
      note "missing Debian packages ${missing[*]}: the Debian half of scripts/setup.sh"
      sed '/^# Python: /,$d' scripts/setup.sh >"$out/setup-debian.sh"
      bash "$out/setup-debian.sh" || die "could not install ${missing[*]} (scripts/setup.sh's Debian part failed; no network?)"
    fi
  fi
  if ! command -v nvcc >/dev/null; then
    for d in /usr/local/cuda/bin /usr/local/cuda-13*/bin; do
      [ -x "$d/nvcc" ] && PATH=$d:$PATH && break
    done
  fi
  command -v nvcc >/dev/null || [ "$device" != cuda ] ||
    die "no CUDA toolkit: nvcc is not on PATH nor in /usr/local/cuda/bin; torch's CMake config (Caffe2) needs it to build against the CUDA wheel's libtorch"
  # The build's Python needs beyond torch, at scripts/requirements.txt's pins, beside the build.
  if ! "$py" -c "import pybind11, pytest" 2>/dev/null; then
    read -r -a pins <<<"$(grep -E '^(pybind11|pytest)==' scripts/requirements.txt | xargs)"
    note "$py lacks pybind11 or pytest: pip install --target $pydeps ${pins[*]}"
    "$py" -m pip install -q --disable-pip-version-check --target "$pydeps" "${pins[@]}" >"$out/pip.log" 2>&1 ||
      note "pip failed (see $out/pip.log): no Python module, so no pytest and no cuFile comparison"
  fi
fi
[ -d "$pydeps" ] && export PYTHONPATH=$pydeps${PYTHONPATH:+:$PYTHONPATH}
"$py" -c "import pybind11, pytest" 2>/dev/null || want_python=0
"$py" -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))" ||
  { note "no Python.h for $py (install python3-dev): no Python module"; want_python=0; }

if [ "${TIDAL_GPU_BUILD:-1}" != 0 ]; then
  targets="tidal_cli tidal_torch_cli tidal_io_tests tidal_torch_tests"
  python_flag=OFF
  if ((want_python)); then
    targets+=" tidal_python"
    python_flag=ON
  fi
  cuda_flag=ON
  [ "$device" = cuda ] || cuda_flag=AUTO
  s=$(limit_for 300 150)
  note "build into $build ($targets; at most $s s): TIDAL_PYTHON=$py"
  BUILD_TYPE=${BUILD_TYPE:-Release} BUILD_DIR=$build TIDAL_TARGETS=$targets timeout "$s" bash scripts/build.sh \
    -DTIDAL_PYTHON="$py" -DTIDAL_WITH_TORCH=ON -DTIDAL_WITH_CUDA=$cuda_flag \
    -DTIDAL_BUILD_PYTHON=$python_flag -DTIDAL_BUILD_EXAMPLES=OFF -DTIDAL_BUILD_BENCH=OFF \
    -DTIDAL_INSTALL=OFF >"$out/build.log" 2>&1 ||
    { tail -n 30 "$out/build.log" >&2; die "the build failed or ran out of time (log: $out/build.log)"; }
fi
[ -x "$bin" ] || die "no tidal binary at $bin after the build"
[ -f "$build/python/tidal/__init__.py" ] || want_python=0
# Each binary over libtorch must load the shared libstdc++ (CMakeLists.txt names it by path): a
# static copy beside torch's crashed the Python module at its first formatted number.
for f in "$build"/tidal-torch "$build"/tests/tidal_torch_tests "$build"/python/tidal/_C*.so; do
  [ -f "$f" ] || continue
  readelf -d "$f" 2>/dev/null | grep -q 'NEEDED.*libstdc++\.so' ||
    note "WARNING: $f does not load libstdc++.so.6 (a static libstdc++): expect crashes"
done
grep -q "TIDAL_WITH_CUDA" "$build/compile_commands.json" 2>/dev/null || [ "$device" != cuda ] ||
  note "WARNING: $build was built without the CUDA backend (TIDAL_WITH_CUDA): device memory goes nowhere"

# TIDAL_GPU_RUN=CMD: after the build, run CMD (bash -c) instead of stages (b)-(e), with TIDAL_PY
# (the build's Python), BUILD and OUT exported and PYTHONPATH holding the build's module: a
# diagnosis on the GPU machine costs a build, not the whole script.
if [ -n "${TIDAL_GPU_RUN:-}" ]; then
  note "TIDAL_GPU_RUN: $TIDAL_GPU_RUN"
  export TIDAL_PY=$py BUILD=$build OUT=$out
  export PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH}
  rc=0
  bash -c "$TIDAL_GPU_RUN" || rc=$?
  note "TIDAL_GPU_RUN exited $rc"
  exit "$rc"
fi

# ---- (b) the CUDA tests -----------------------------------------------------------------------
export TIDAL_TEST_DIR=$dir
note "gtests: $build/tests/tidal_io_tests --gtest_filter='Cuda*'"
if ! timeout "$(limit_for 60 300)" "$build/tests/tidal_io_tests" --gtest_filter='Cuda*' \
  >"$out/gtest-cuda.log" 2>&1; then
  failures+=("gtest Cuda* (log: $out/gtest-cuda.log)")
fi
note "gtests: $build/tests/tidal_torch_tests --gtest_filter='Cuda*'"
if ! timeout "$(limit_for 60 300)" "$build/tests/tidal_torch_tests" --gtest_filter='Cuda*' \
  >>"$out/gtest-cuda.log" 2>&1; then
  failures+=("gtest tidal_torch_tests Cuda* (log: $out/gtest-cuda.log)")
fi
grep -E '^\[ +(OK|FAILED|SKIPPED) +\] .*\([0-9]+ ms\)$' "$out/gtest-cuda.log" >&2 || true
# Why a test skipped (gtest prints the reason on the line after "...: Skipped").
grep -A1 ': Skipped$' "$out/gtest-cuda.log" | grep -v -e ': Skipped$' -e '^--$' | sort | uniq -c |
  sed 's/^/   skipped: /' >&2 || true
if ((want_python)); then
  note "pytest tests/python/test_cuda.py"
  rc=0
  PYTHONFAULTHANDLER=1 PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} \
    timeout "$(limit_for 120 240)" "$py" -m pytest -q -rs -p no:cacheprovider \
    tests/python/test_cuda.py >"$out/pytest-cuda.log" 2>&1 || rc=$?
  if ((rc != 0)); then
    failures+=("pytest tests/python/test_cuda.py (exit $rc; log: $out/pytest-cuda.log)")
    # A crash (a signal, or Python's "Fatal Python error"): the native stack, where cuda-gdb is
    # there (the GPU images have no gdb), first failing test only.
    if { ((rc > 128 && rc != 137)) || grep -q "Fatal Python error" "$out/pytest-cuda.log"; } &&
      command -v cuda-gdb >/dev/null; then
      note "pytest crashed: the native stack under cuda-gdb (log: $out/gdb-pytest.log)"
      PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} timeout "$(limit_for 90 240)" \
        cuda-gdb -batch -ex run -ex bt --args "$py" -m pytest -x -q -p no:cacheprovider \
        tests/python/test_cuda.py >"$out/gdb-pytest.log" 2>&1 || true
      grep -A12 "received signal" "$out/gdb-pytest.log" >&2 || true
    fi
  fi
  tail -n 12 "$out/pytest-cuda.log" >&2
else
  note "pytest tests/python/test_cuda.py: left out (no Python module, see above)"
fi

# ---- (c) train a GPT in none, plan and activations modes --------------------------------------
# The store's capacity: most of the free space (a step's activations of half a GPU are tens of GB).
free_mib=$(df -Pm "$dir" | awk 'NR == 2 {print $4}')
capacity=$((free_mib * 6 / 10))
((capacity > 131072)) && capacity=131072
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}  # same kernels, same losses

train() { # name cap reserve flags...: one `tidal train --json` run, its JSON in $out/name.json
  local name=$1 cap=$2 reserve=$3 s rc=0
  shift 3
  s=$(limit_for "$cap" "$reserve")
  if ((s < 20)); then
    note "$name: left out, out of time"
    echo '{"failed": "left out: out of time"}' >"$out/$name.json"
    return 0
  fi
  note "$name (at most $s s): $bin train ${model[*]} --device $device $* --json"
  timeout --kill-after=15 "$s" "$bin" train "${model[@]}" --device "$device" "$@" --json \
    2>"$out/$name.log" | tail -n 1 >"$out/$name.json" || rc=$?
  if ((rc != 0)) || ! "$py" -c "import json,sys; json.load(open(sys.argv[1]))" "$out/$name.json" 2>/dev/null; then
    local why="exit $rc"
    ((rc == 124 || rc == 137)) && why="timed out after $s s"
    "$py" -c "import json,sys; print(json.dumps({'failed': sys.argv[1]}))" \
      "$why: $(tail -n 2 "$out/$name.log" | tr -d '\r' | tail -c 300)" >"$out/$name.json"
    failures+=("train $name ($why; log: $out/$name.log)")
  fi
}

gpu_mem=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['gpu_memory'])" "$out/machine.json")
if [ -n "${TIDAL_GPU_MODEL:-}" ]; then
  read -r -a model <<<"$TIDAL_GPU_MODEL"
elif [ "$device" != cuda ]; then
  model=(--model gpt-tiny --layers 2 --batch 4 --seq 64)
else
  # Size the batch: peak(batch) ~ state + batch x per-sequence bytes, from one probe at batch 2;
  # state ~ 16 bytes a parameter (fp32 weights, gradients, two AdamW moments).
  model=(--model gpt2-small --seq 1024 --batch 2)
  train probe 90 220 --steps 2 --offload none
  batch=$("$py" - "$out/probe.json" "$gpu_mem" "${TIDAL_GPU_FILL:-0.5}" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
total, fill = int(sys.argv[2]), float(sys.argv[3])
if "failed" in j:
    print(8)
    sys.exit()
state = 16 * j["parameters"]
per = (j["peak_bytes"] - state) / 2
print(max(1, min(256, int((fill * total - state) / per))) if per > 0 else 8)
PY
)
  model=(--model gpt2-small --seq 1024 --batch "$batch")
fi
note "model: ${model[*]} (store: $dir, capacity ${capacity}MiB)"
store=(--dir "$dir" --store-capacity "${capacity}MiB")
train none 90 190 --steps $((steps + 1)) --offload none
train plan 170 130 --steps $((steps + 3)) --offload plan --mem-budget "$budget" "${store[@]}" \
  --save-trace "$out/plan.trace.json" --save-plan "$out/plan.plan.json" \
  --timeline "$out/plan.timeline.json" --timeline "$out/plan.timeline.svg"
train activations 150 90 --steps $((steps + 2)) --offload activations "${store[@]}" \
  --timeline "$out/activations.timeline.json" --timeline "$out/activations.timeline.svg"

# The simulator's inputs: a trace profiled with CUDA_LAUNCH_BLOCKING=1, so that each op's time is
# its GPU time (the tracer times ops on the host: without it a CUDA op's time is its launch).
s=$(limit_for 80 65)
rm -f "$out/profile.trace.json"
if ((s >= 20)); then
  note "profile (at most $s s): CUDA_LAUNCH_BLOCKING=1 $bin profile ${model[*]} --device $device --steps 2"
  CUDA_LAUNCH_BLOCKING=1 timeout --kill-after=15 "$s" "$bin" profile "${model[@]}" --device "$device" \
    --steps 2 --baseline-steps 0 --out "$out/profile.trace.json" >"$out/profile.log" 2>&1 ||
    note "profile failed or ran out of time (log: $out/profile.log): predictions from the plan run's trace"
fi
trace=$out/profile.trace.json
[ -s "$trace" ] || trace=$out/plan.trace.json

# SSD figures and capacity as the session measured and planned them (as bench/sim_vs_exec.sh).
read -r cap ssd < <("$py" - "$out/plan.json" "$out/plan.plan.json" <<'PY'
import json, re, sys
try:
    cap = json.load(open(sys.argv[2]))["summary"]["capacity_bytes"]
except Exception:  # noqa: BLE001
    cap = 0
try:
    m = re.search(r"SSD (\d+)x([\d.]+)/([\d.]+)MB/s", json.load(open(sys.argv[1]))["plan_summary"])
    ssd = f"{m.group(1)}x{m.group(2)}/{m.group(3)}MB/s"
except Exception:  # noqa: BLE001
    ssd = "-"
print(cap, ssd)
PY
)
sim=("$bin" simulate --hardware "$sim_hw" --host-mem 0 --margin 0 --io-compute-cost 0/0/0
  --min-bytes 1MiB --json)
[ "$ssd" != - ] && sim+=(--ssd "$ssd")
full_mem=$gpu_mem
((full_mem > 0)) || full_mem=$((80 << 30))
rm -f "$out"/sim-*.json
if [ -s "$trace" ]; then
  note "simulate: $trace (keep-all, activations; tidal at the plan's capacity $cap), SSD $ssd"
  "${sim[@]}" --trace "$trace" --gpu-mem "$full_mem" --policy keep-all,activations \
    2>"$out/sim-baselines.log" | tail -n 1 >"$out/sim-baselines.json" || true
  if ((cap > 0)); then
    "${sim[@]}" --trace "$trace" --gpu-mem "$cap" --policy tidal 2>"$out/sim-tidal.log" |
      tail -n 1 >"$out/sim-tidal.json" || true
  fi
fi
if [ -s "$out/plan.trace.json" ] && [ -s "$out/plan.plan.json" ] && ((cap > 0)); then
  "${sim[@]}" --trace "$out/plan.trace.json" --plan "$out/plan.plan.json" --gpu-mem "$cap" \
    2>"$out/sim-replay.log" | tail -n 1 >"$out/sim-replay.json" || true
fi

# ---- (e) cuFile against the staging buffers, host memory beside them --------------------------
# `tidal bench-io` writes from host buffers only (tools/bench_io.cpp has no device-buffer option),
# and the store sends only device pointers to cuFile: so device memory is timed through the
# Python module, one process per TIDAL_GDS setting (read once per process): 64 MiB activations of
# a chain of sin() offloaded by tidal.offload_activations (checksums off), written, then read back
# by backward.
io_dir=$dir/io
mkdir -p "$io_dir"
s=$(limit_for 40 45)
note "bench-io, host memory (at most $s s): $bin bench-io --dir $io_dir --size $io_size --block 64MiB"
timeout "$s" "$bin" bench-io --dir "$io_dir" --size "$io_size" --block 64MiB --depth 8 --no-checksum \
  --json 2>"$out/io-host.log" | tail -n 1 >"$out/io-host.json" || echo '{"failed": "see io-host.log"}' >"$out/io-host.json"
for gds in on off; do
  if ((want_python == 0)); then
    echo '{"failed": "no Python module"}' >"$out/io-gds-$gds.json"
    continue
  fi
  reserve=5
  [ "$gds" = on ] && reserve=25
  s=$(limit_for 40 "$reserve")
  note "device memory through the store, TIDAL_GDS=$gds (at most $s s)"
  TIDAL_GDS=$gds PYTHONPATH=$build/python${PYTHONPATH:+:$PYTHONPATH} timeout "$s" "$py" - \
    "$io_dir" "$io_size" 64MiB "$device" >"$out/io-gds-$gds.json" 2>"$out/io-gds-$gds.log" <<'PY' ||
import json, os, sys, time

import torch

import tidal

where, size, block, device = sys.argv[1], tidal.parse_bytes(sys.argv[2]), tidal.parse_bytes(sys.argv[3]), sys.argv[4]
n = max(2, size // block)
res = {"TIDAL_GDS": os.environ.get("TIDAL_GDS", ""), "device": device, "tensors": n - 1,
       "block": block}
try:
    offload = tidal.offload_activations(dirs=[where], min_bytes=0, capacity=(n + 4) * block,
                                        lookahead=size, adaptive=False, checksum=False)
except tidal.Error as e:
    res["failed"] = str(e)
    print(json.dumps(res))
    sys.exit(0)
x = torch.randn(block // 4, device=device, requires_grad=True)  # a leaf: kept, not offloaded


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


sync()
start = time.perf_counter()
with offload:
    t = x
    for _ in range(n):
        t = torch.sin(t)  # saves its input: n - 1 activations of `block` bytes
    total = t.sum()
deadline = time.monotonic() + 120
while offload.store_stats()["writes"] < n - 1 and time.monotonic() < deadline:
    time.sleep(0.001)
write_s = time.perf_counter() - start
start = time.perf_counter()
total.backward()
sync()
read_s = time.perf_counter() - start
offload.end_step()
st, last = offload.store_stats(), offload.stats()
offload.close()
res.update(write_seconds=write_s, read_seconds=read_s, bytes_written=st["bytes_written"],
           bytes_read=st["bytes_read"], write_gbps=st["bytes_written"] / write_s / 1e9,
           read_gbps=st["bytes_read"] / read_s / 1e9, backend=st["backend"],
           staged_ops=st["staged_ops"], offloaded=last.offloaded, forwarded=last.forwarded,
           misses=last.misses, failed_requests=st["failed_requests"])
print(json.dumps(res))
PY
    {
      rc=$?
      why=$(tail -n 2 "$out/io-gds-$gds.log" | tail -c 300)
      ((rc == 124)) && why="timed out after $s s${why:+: $why}"
      [ -z "$why" ] && why="exit $rc, no message"
      "$py" -c "import json,sys; print(json.dumps({'failed': sys.argv[1]}))" \
        "TIDAL_GDS=$gds: $why" >"$out/io-gds-$gds.json"
    }
done

# ---- (d) the table ----------------------------------------------------------------------------
"$py" - "$out" "${model[*]}" "$dir" "$ssd" "$sim_hw" "$trace" <<'PY' | tee "$out/table.txt"
import json, statistics, sys

out, model, where, ssd, hw, trace = sys.argv[1:7]


def load(name):
    try:
        with open(f"{out}/{name}") as f:
            text = f.read().strip()
        return json.loads(text.splitlines()[-1]) if text else {"failed": "no output"}
    except Exception as e:  # noqa: BLE001
        return {"failed": f"{name}: {e}"}


machine = load("machine.json")
runs = {m: load(f"{m}.json") for m in ("none", "plan", "activations")}
base = load("sim-baselines.json").get("policies", {})
sims = {"none": base.get("keep-all"), "activations": base.get("activations"),
        "plan": load("sim-tidal.json").get("policies", {}).get("tidal")}
replay = load("sim-replay.json")


def measured(mode, j):
    if "failed" in j:
        return None
    # The steps that ran as the mode runs: none after its first step; activations after the
    # warm-up and the reference step (both keep everything); plan after warm-up and profiling.
    skip = {"none": 1, "activations": 2, "plan": 3}[mode]
    seconds = j["step_seconds"][skip:] or j["step_seconds"]
    n = len(seconds)
    peak = max(j["step_peak_bytes"][-n:])  # the CUDA allocator's, per step
    if mode == "plan" and j.get("steps_measured", 0) > 0:
        peak = j["peak_bytes"]  # the steps of its last plan (after any re-plan for memory)
    moved = (j.get("bytes_written", 0) + j.get("bytes_read", 0) + j.get("bytes_to_host", 0) +
             j.get("bytes_from_host", 0)) / n
    stall = (j.get("stall_seconds", 0) + j.get("write_stall_seconds", 0)) / n
    return {"peak": peak, "seconds": statistics.median(seconds), "moved": moved,
            "stall": stall, "steps": n, "losses": j["losses"]}


def predicted(s):
    if not s or "iteration_seconds" not in s:
        return None
    return {"peak": s["peak_bytes"], "seconds": s["iteration_seconds"],
            "moved": s["ssd_bytes_written"] + s["ssd_bytes_read"] + s["host_bytes_written"] +
            s["host_bytes_read"], "stall": s["stall_seconds"], "fits": s.get("fits")}


rows = {m: (measured(m, runs[m]), predicted(sims[m])) for m in runs}
rows["plan (replay)"] = (None, predicted(replay if "iteration_seconds" in replay else None))
none_m, none_p = rows["none"]


def f(v, fmt):
    return format("-", ">" + fmt.split(".")[0]) if v is None else format(v, fmt)


def get(d, k, scale=1.0):
    return None if d is None else d[k] / scale


print(f"{model} on {machine.get('gpu')} (torch {machine.get('torch')}, CUDA "
      f"{machine.get('cuda')}); store {where} ({runs['plan'].get('io_backend', '?')}), SSD "
      f"{ssd} as the session measured it")
print(f"{'mode':<14} {'peak GiB':>8} {'(sim)':>7} {'s/step':>8} {'(sim)':>7} {'x none':>7} "
      f"{'(sim)':>6} {'GB moved/step':>13} {'(sim)':>7} {'stall s/step':>12} {'(sim)':>7} "
      f"same losses")
table = []
for mode, (m, p) in rows.items():
    ratio = m["seconds"] / none_m["seconds"] if m and none_m else None
    pratio = p["seconds"] / none_p["seconds"] if p and none_p else None
    same = "-"
    if m and none_m and mode != "none":
        k = min(len(m["losses"]), len(none_m["losses"]))
        same = "yes" if m["losses"][:k] == none_m["losses"][:k] else "NO"
    failed = runs.get(mode, {}).get("failed")
    print(f"{mode:<14} {f(get(m, 'peak', 2**30), '8.2f')} {f(get(p, 'peak', 2**30), '7.2f')} "
          f"{f(get(m, 'seconds'), '8.3f')} {f(get(p, 'seconds'), '7.3f')} {f(ratio, '7.2f')} "
          f"{f(pratio, '6.2f')} {f(get(m, 'moved', 1e9), '13.2f')} "
          f"{f(get(p, 'moved', 1e9), '7.2f')} {f(get(m, 'stall'), '12.3f')} "
          f"{f(get(p, 'stall'), '7.3f')} {same}" + (f"  FAILED: {failed}" if failed else ""))
    table.append({"mode": mode, "measured": m and {k: v for k, v in m.items() if k != "losses"},
                  "predicted": p, "ratio_to_none": ratio, "predicted_ratio_to_none": pratio,
                  "same_losses": same, "failed": failed})
print(f"measured: `tidal train --device {machine.get('device', 'cuda')}` over the steps that "
      f"ran in the mode (peak: the CUDA caching allocator's allocated bytes, plan: over the "
      f"steps of its last plan; time: median step; bytes moved and stall per step).\n"
      f"sim: `tidal simulate --trace {trace.split('/')[-1]}` ({hw}, the measured SSD figures, no "
      f"I/O compute cost, no margin): keep-all for none, activations (SSDTrain) for activations, "
      f"its own plan (tidal) at the executed plan's capacity for plan; peaks are trace tensors "
      f"(the allocator adds rounding and workspaces). plan (replay): the executed plan replayed "
      f"on its own trace (as bench/sim_vs_exec.sh), whose op times are host-side launch times "
      f"on CUDA.")

for mode, j in runs.items():
    if j.get("store_full_writes") or j.get("write_failures") or j.get("store_degraded"):
        print(f"{mode}: DEGRADED: {j.get('write_failures', 0)} failed writes "
              f"({j.get('store_full_writes', 0)} for want of store space: those tensors stayed "
              f"in GPU memory); {json.dumps(j.get('store_degraded', {}))[:300]}")
    if mode == "plan" and "failed" not in j:
        print(f"plan: budget {j['memory_budget'] / 2**30:.2f} GiB of a profiled peak of "
              f"{j['profiled_peak_bytes'] / 2**30:.2f} GiB, within budget: {j['within_budget']}; "
              f"{j['plan_summary']}")

io = {"host memory (bench-io)": load("io-host.json"),
      "device memory, cuFile (TIDAL_GDS=on)": load("io-gds-on.json"),
      "device memory, staging buffers (TIDAL_GDS=off)": load("io-gds-off.json")}
print()
print(f"{'store I/O on ' + where + '/io':<48} {'write GB/s':>10} {'read GB/s':>10} "
      f"{'staged ops':>10}  backend")
for name, j in io.items():
    if "failed" in j:
        print(f"{name:<48} {'-':>10} {'-':>10} {'-':>10}  FAILED: {j['failed']}")
        continue
    print(f"{name:<48} {j['write_gbps']:>10.2f} {j['read_gbps']:>10.2f} "
          f"{j.get('staged_ops', 0):>10}  {j.get('backend', '?')}")
json.dump({"machine": machine, "model": model, "store": where, "ssd": ssd, "hardware": hw,
           "trace": trace, "modes": table, "io": io}, open(f"{out}/results.json", "w"), indent=1)
PY

note "done in $(($(date +%s) - t0)) s; results in $out (table.txt, results.json)"
if ((${#failures[@]} > 0)); then
  printf 'FAILED: %s\n' "${failures[@]}" >&2
  exit 1
fi
