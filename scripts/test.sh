#!/usr/bin/env bash
# The test command of README.md (and of .ci/run): set-up, build, all tests, then the suite under
# AddressSanitizer+UBSan, the store's concurrency tests under ThreadSanitizer, a format check and
# clang-tidy on the torch-free layers, and the code's shape (scripts/shape_check.sh).
# TIDAL_QUICK=1 skips the sanitizer builds.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - start ))s] $*"; }

stamp "set-up"
bash scripts/setup.sh

stamp "build"
BUILD_DIR=build bash scripts/build.sh
stamp "tests"
ctest --test-dir build --output-on-failure -j "$(nproc)" --timeout 600

if [ "${TIDAL_QUICK:-0}" != 1 ]; then
  # The sanitizer builds leave out the libtorch layers: libtorch itself is not instrumented.
  stamp "build with AddressSanitizer+UBSan (torch-free layers)"
  TIDAL_TARGETS="tidal_common_tests tidal_io_tests tidal_trace_tests tidal_plan_tests tidal_cli" \
    BUILD_DIR=build-asan BUILD_TYPE=Debug bash scripts/build.sh -DTIDAL_WITH_TORCH=OFF \
    -DTIDAL_BUILD_BENCH=OFF -DTIDAL_INSTALL=OFF -DTIDAL_SANITIZE=address,undefined
  stamp "tests under ASan+UBSan"
  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    ctest --test-dir build-asan --output-on-failure -j "$(nproc)" --timeout 900

  stamp "build with ThreadSanitizer (torch-free layers)"
  TIDAL_TARGETS="tidal_io_tests tidal_plan_tests" \
    BUILD_DIR=build-tsan BUILD_TYPE=RelWithDebInfo bash scripts/build.sh -DTIDAL_WITH_TORCH=OFF \
    -DTIDAL_BUILD_BENCH=OFF -DTIDAL_INSTALL=OFF -DTIDAL_SANITIZE=thread
  stamp "store concurrency tests under TSan"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure -L io --timeout 900
  stamp "the planner's threads under TSan (the ways of a plan, the micro-batch orders)"
  TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
    ctest --test-dir build-tsan --output-on-failure --timeout 900 \
    -R "tidal_plan_tests[.](OrderChoice[.]|PlannerFuzz[.](SsdWhereNeeded|HostMemoryByDensity|TheWaysStartedTogether))"
fi

stamp "format check"
bash scripts/format.sh --check
stamp "shape check (files under 600 lines, functions under 80, no dated comments)"
bash scripts/shape_check.sh
stamp "clang-tidy (torch-free layers)"
bash scripts/tidy.sh
stamp "all tests passed"
