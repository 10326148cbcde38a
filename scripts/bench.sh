#!/usr/bin/env bash
# README command (1), the main job: install dependencies, build Release, run the benchmark
# suite on built-in synthetic data and print a summary, then evaluate every method's quality
# (kvscore eval) on a synthetic cache from kvscore synth. Extra arguments go to the
# benchmark binary (e.g. --benchmark_filter=fp16). Each step prints what it does and its time.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/steps.sh
T0=$(date +%s)
step deps "Debian packages (scripts/deps.sh; a few minutes on a fresh machine, else instant)"
bash scripts/deps.sh
step configure "cmake in build-release (Release)"
cmake -S . -B build-release -DCMAKE_BUILD_TYPE=Release -DKVSCORE_BUILD_TESTS=OFF -DKVSCORE_BUILD_EXAMPLES=OFF >/dev/null
step build "kvscore_bench and the kvscore CLI (about 5 min on 2 cores)"
cmake --build build-release -j"$(nproc)" --target kvscore_bench kvscore_cli
step benchmarks "the benchmark suite on synthetic data (each case prints as it finishes)"
./build-release/bench/kvscore_bench --benchmark_out=build-release/bench.json --benchmark_out_format=json "$@"
echo "full results (JSON, with every counter): build-release/bench.json"

step quality "kvscore eval on synthetic data (kvscore synth --kind mixed)"
S=build-release/synth
./build-release/tools/kvscore synth --kind mixed --out "$S"
./build-release/tools/kvscore eval --keys "$S/K.npy" --values "$S/V.npy" --queries "$S/Q.npy" \
  --keep 0.05,0.1,0.25,0.5 --window 256 --out "$S/report.json" --svg "$S/report.svg"
echo "report: $S/report.json, plot: $S/report.svg"
step_done
echo "scripts/bench.sh: $(($(date +%s) - T0)) s in all"
