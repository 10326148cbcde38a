#!/usr/bin/env bash
# README command (2): install dependencies, build everything, run the whole ctest suite.
# Extra arguments go to the CMake configure step; BUILD_DIR / BUILD_TYPE override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
BUILD=${BUILD_DIR:-build}
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE="${BUILD_TYPE:-RelWithDebInfo}" "$@" >/dev/null
cmake --build "$BUILD" -j"$(nproc)"
ctest --test-dir "$BUILD" --output-on-failure -j"$(nproc)"
