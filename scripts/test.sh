#!/usr/bin/env bash
# README command (2): install dependencies, build everything, run the whole ctest suite.
# Extra arguments go to the CMake configure step; BUILD_DIR / BUILD_TYPE override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
# The Python packages' Debian parts too, unless the Python tests are off (CI's sanitizer build).
step deps "Debian packages (scripts/deps.sh; a few minutes on a fresh machine, else instant)"
if [ "${KVSCORE_PYTHON_TESTS:-1}" != 0 ]; then bash scripts/deps.sh python; else bash scripts/deps.sh; fi
BUILD=${BUILD_DIR:-build}
# Debug information as line tables only (-g1): backtraces and sanitizer reports keep
# file:line, and the build takes ~30 % less time than with full -g (docs/ci.md).
step configure "cmake in $BUILD"
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_DEBUG=-g1" "$@" >/dev/null
step build "every target: library, CLI, tests, benchmarks, examples (15-25 min on 2 cores)"
cmake --build "$BUILD" -j"$(nproc)"
step ctest "the C++ tests"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
# The Python package and its tests (scripts/test_python.sh); KVSCORE_PYTHON_TESTS=0 skips them
# (CI's sanitizer build of the same C++ tests).
if [ "${KVSCORE_PYTHON_TESTS:-1}" != 0 ]; then
  step_done
  KVSCORE_CLI="$(pwd)/$BUILD/tools/kvscore" bash scripts/test_python.sh
fi
