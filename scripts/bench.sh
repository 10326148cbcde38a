#!/usr/bin/env bash
# README command (1), the main job: install dependencies, build Release, run the benchmark
# suite on built-in synthetic data and print a summary. Extra arguments go to the
# benchmark binary (e.g. --benchmark_filter=fp16).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
cmake -S . -B build-release -DCMAKE_BUILD_TYPE=Release -DKVSCORE_BUILD_TESTS=OFF -DKVSCORE_BUILD_EXAMPLES=OFF >/dev/null
cmake --build build-release -j"$(nproc)" --target kvscore_bench
./build-release/bench/kvscore_bench --benchmark_out=build-release/bench.json --benchmark_out_format=json "$@"
echo "full results (JSON, with every counter): build-release/bench.json"
