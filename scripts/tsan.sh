#!/usr/bin/env bash
# ThreadSanitizer over the threaded paths: tests/test_robustness.cpp's [threads] cases (every
# scorer on 1..4 threads, select on 1..16 threads x every kernel set, ParisKV retrieval on 1..4
# threads), built with clang -fsanitize=thread -fopenmp against LLVM's libomp, with the run-time
# dispatch tables. libomp is not TSan-instrumented: its barriers / fork-join are made visible to
# TSan by the Archer OMPT tool (libarcher, from libomp-dev), and races reported inside libomp
# itself are suppressed (scripts/tsan.supp). Any report in kvscore code fails the run.
#   TSAN_BUILD_DIR (default build-tsan), TSAN_FILTER (Catch2 filter, default "[threads]")
set -euo pipefail
cd "$(dirname "$0")/.."
B=${TSAN_BUILD_DIR:-build-tsan}
CXX=${TSAN_CXX:-clang++}
ARCHER=${ARCHER_LIB:-$(ls /usr/lib/llvm-*/lib/libarcher.so 2>/dev/null | sort -V | tail -1)}
[ -n "$ARCHER" ] || { echo "tsan.sh: libarcher.so not found (apt-get install libomp-dev)"; exit 1; }
mkdir -p "$B"
F=(-std=c++20 -O1 -gline-tables-only -fno-omit-frame-pointer -fsanitize=thread -fopenmp -Iinclude -I/usr/include/eigen3
   -DKVSCORE_RUNTIME_DISPATCH=1 -DKVSCORE_COMPILED=1 -DKVSCORE_DISPATCH_X86=1 -DKVSCORE_TEST_DATA_DIR="\"$PWD/tests/data\"")
t0=$(date +%s)
"$CXX" "${F[@]}" -c tests/main.cpp -o "$B/main.o" &
"$CXX" "${F[@]}" -c src/dispatch.cpp -o "$B/dispatch.o" &
"$CXX" "${F[@]}" -c src/impl_eval.cpp -o "$B/impl_eval.o" &
"$CXX" "${F[@]}" -c src/impl_linalg.cpp -o "$B/impl_linalg.o" &
"$CXX" "${F[@]}" -c src/isa_sse2.cpp -o "$B/sse2.o" &
wait
"$CXX" "${F[@]}" -mavx2 -mfma -mf16c -c src/isa_avx2.cpp -o "$B/avx2.o" &
"$CXX" "${F[@]}" -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512cd -mavx2 -mfma -mf16c \
  -c src/isa_avx512.cpp -o "$B/avx512.o" &
"$CXX" "${F[@]}" -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512cd -mavx512vnni -mavx2 -mfma -mf16c \
  -c src/isa_avx512vnni.cpp -o "$B/avx512vnni.o" &
"$CXX" "${F[@]}" -c tests/test_robustness.cpp -o "$B/test_robustness.o" &
wait
"$CXX" -fsanitize=thread -fopenmp "$B"/*.o -o "$B/kvscore_tsan_tests"
echo "tsan.sh: built in $(( $(date +%s) - t0 )) s"
export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp ignore_noninstrumented_modules=1 halt_on_error=1 second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export OMP_TOOL_LIBRARIES="$ARCHER" OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
"$B/kvscore_tsan_tests" "${TSAN_FILTER:-[threads]}"
echo "tsan.sh: total $(( $(date +%s) - t0 )) s"
