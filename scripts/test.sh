#!/usr/bin/env bash
# README command (2): install dependencies, build everything, run the whole ctest suite.
# Extra arguments go to the CMake configure step; BUILD_DIR / BUILD_TYPE override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
BUILD=${BUILD_DIR:-build}
# examples/llama_cpp and its tests (docs/integration.md) need llama.cpp, built from the
# llama-cpp-python sdist (scripts/llama_cpp.sh), and the SmolLM2 GGUF (scripts/fetch_smollm2.sh);
# both downloads run in the background while kvscore builds. KVSCORE_LLAMA=0 leaves them out.
LLAMA=${KVSCORE_LLAMA:-1}
if [ "$LLAMA" != 0 ]; then
  mkdir -p "$BUILD"
  (bash scripts/llama_cpp.sh fetch && bash scripts/fetch_smollm2.sh) >"$BUILD/llama-fetch.log" 2>&1 &
  FETCH=$!
fi
# Debug information as line tables only (-g1): backtraces and sanitizer reports keep
# file:line, and the build takes ~30 % less time than with full -g (docs/ci.md).
configure() {
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" \
    "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCMAKE_CXX_FLAGS_DEBUG=-g1" "$@" >/dev/null
}
configure "$@"
cmake --build "$BUILD" -j"$(nproc)"
if [ "$LLAMA" != 0 ]; then
  wait "$FETCH" || { cat "$BUILD/llama-fetch.log"; echo "test.sh: fetching llama.cpp or the model failed"; exit 1; }
  t0=$(date +%s)
  PREFIX=$(bash scripts/llama_cpp.sh build)
  MODEL=$(bash scripts/fetch_smollm2.sh)
  configure "$@" -DKVSCORE_LLAMA_CPP="$PREFIX" -DKVSCORE_LLAMA_MODEL="$MODEL"
  cmake --build "$BUILD" -j"$(nproc)"
  echo "llama.cpp (cached when unchanged) + examples/llama_cpp: $(($(date +%s) - t0)) s"
fi
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
# The Python package and its tests (scripts/test_python.sh); KVSCORE_PYTHON_TESTS=0 skips them
# (CI's sanitizer build of the same C++ tests).
if [ "${KVSCORE_PYTHON_TESTS:-1}" != 0 ]; then
  KVSCORE_CLI="$(pwd)/$BUILD/tools/kvscore" bash scripts/test_python.sh
fi
