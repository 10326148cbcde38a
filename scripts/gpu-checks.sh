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
stage tests 150 ./kvscore_cuda_tests -d yes
# the whole bench once (its wall time is the stage's); torch_peer.py reads its JSON (no second run)
stage bench 150 ./kvscore_cuda_bench --benchmark_counters_tabular=true --benchmark_out="$O/bench.json" \
  --benchmark_out_format=json
stage torch_peer 150 python3 torch_peer.py ./kvscore_cuda_bench --json "$O/bench.json"
# a kit of an earlier commit beside this one (KIT/before, scripts/gpu-kit.sh BEFORE_REF): its bench
# on the same GPU in the same run, for before/after figures
[ -x before/kvscore_cuda_bench ] && stage bench_before 90 before/kvscore_cuda_bench --benchmark_counters_tabular=true \
  --benchmark_filter="${BEFORE_FILTER:-BM_cuda_(knorm|keydiff|l2|windowed_l2|qfilter|topk)/}"
# Catch2 v2: a test name with [brackets] must be matched with a trailing * (brackets read as tags)
[ -n "$CS" ] && stage memcheck 110 "$CS" --tool memcheck --report-api-errors no --error-exitcode 9 ./kvscore_cuda_tests "[gpu]"
[ -n "$CS" ] && stage racecheck 30 "$CS" --tool racecheck --error-exitcode 9 ./kvscore_cuda_tests "cuda: in-place compaction*"
grep -E "FAILED|test cases|ERROR SUMMARY|HAZARD" "$O"/*.log | head -40
cat "$S"
