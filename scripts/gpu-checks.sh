#!/usr/bin/env bash
# One GPU run of the CUDA path, from a kit made by scripts/gpu-kit.sh: every test, the bench with
# the torch column, memcheck over every [gpu] test, racecheck on compaction. Each stage has its own
# time limit, so a slow stage cannot take the rest; logs and a summary go to $OUT (default ./gpu-logs).
cd "$(dirname "$0")"
export LD_LIBRARY_PATH=$PWD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
O=${OUT:-$PWD/gpu-logs}
mkdir -p "$O"
S=$O/summary.txt
stage() {
  local name=$1 lim=$2
  shift 2
  local t0
  t0=$(date +%s)
  timeout "$lim" "$@" >"$O/$name.log" 2>&1
  echo "$name rc=$? $(($(date +%s) - t0))s" | tee -a "$S"
}
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; cat COMMIT 2>/dev/null; } >"$O/env.txt" 2>&1
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
stage tests 180 ./kvscore_cuda_tests -d yes
stage bench 120 ./kvscore_cuda_bench --benchmark_counters_tabular=true
stage torch_peer 150 python3 torch_peer.py ./kvscore_cuda_bench
# Catch2 v2: a test name with [brackets] must be matched with a trailing * (brackets read as tags)
[ -n "$CS" ] && stage memcheck 150 "$CS" --tool memcheck --error-exitcode 9 ./kvscore_cuda_tests "[gpu]"
[ -n "$CS" ] && stage racecheck 40 "$CS" --tool racecheck --error-exitcode 9 ./kvscore_cuda_tests "cuda: in-place compaction*"
grep -E "FAILED|test cases|ERROR SUMMARY|HAZARD" "$O"/*.log | head -40
cat "$S"
