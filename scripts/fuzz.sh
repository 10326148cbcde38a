#!/usr/bin/env bash
# libFuzzer harnesses (fuzz/fuzz_*.cpp): build each with clang -fsanitize=fuzzer,address,undefined
# (plus the run-time-dispatch kernel tables, so every SIMD path is fuzzed) and run each for a
# bounded time from its committed seed corpus (fuzz/corpus/<harness>/, never modified: the
# run works on a copy). Fails on the first finding; the reproducer is left in
# $FUZZ_BUILD_DIR/artifacts/<harness>/ and can be replayed with `<binary> <file>`.
#
#   FUZZ_SECONDS  seconds per harness (default 25)       FUZZ_TARGETS  harness names (default all)
#   FUZZ_BUILD_DIR  build folder (default build-fuzz)    FUZZ_JOBS     parallel compiles (default nproc)
#   FUZZ_BUILD_ONLY=1  build, run each harness once over its corpus only (smoke), no fuzzing
#   FUZZ_SEED  libFuzzer -seed (default: random). CI fixes it, so a CI run is reproducible and a
#              longer local run with the same seed covers what CI will try (timing aside).
# Needs: clang (14+) and libclang-rt-dev (libFuzzer, ASan/UBSan runtimes).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SECS=${FUZZ_SECONDS:-25}
B=${FUZZ_BUILD_DIR:-build-fuzz}
JOBS=${FUZZ_JOBS:-$(nproc)}
CXX=${FUZZ_CXX:-clang++}
TARGETS=${FUZZ_TARGETS:-$(cd fuzz && ls fuzz_*.cpp | sed 's/\.cpp$//' | tr '\n' ' ')}
command -v "$CXX" >/dev/null || { echo "fuzz.sh: $CXX not found (apt-get install clang libclang-rt-dev)"; exit 1; }
mkdir -p "$B/obj" "$B/artifacts"
FLAGS=(-std=c++20 -O1 -gline-tables-only -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined
       -fopenmp -Iinclude -Ifuzz -I/usr/include/eigen3 -DKVSCORE_RUNTIME_DISPATCH=1 -DKVSCORE_COMPILED=1 -DKVSCORE_DISPATCH_X86=1)
t0=$(date +%s)
# Kernel tables of kvscore::dispatch, with the ISA flags of CMakeLists.txt; not src/impl_eval.cpp (no
# harness calls the evaluator: ~55 s of CPU). Line tables only: reports keep file:line, ~15 % less CPU.
build_obj() {  # src out extra-flags...
  local src=$1 out=$2; shift 2
  [ "$out" -nt "$src" ] || "$CXX" "${FLAGS[@]}" -fsanitize=fuzzer-no-link "$@" -c "$src" -o "$out"
}
rm -f "$B/obj/impl_eval.o"  # left by an older fuzz.sh
build_obj src/dispatch.cpp "$B/obj/dispatch.o" &
build_obj src/impl_linalg.cpp "$B/obj/impl_linalg.o" &
build_obj src/isa_sse2.cpp "$B/obj/sse2.o" &
build_obj src/isa_avx2.cpp "$B/obj/avx2.o" -mavx2 -mfma -mf16c &
build_obj src/isa_avx512.cpp "$B/obj/avx512.o" -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512cd -mavx2 -mfma -mf16c &
build_obj src/isa_avx512vnni.cpp "$B/obj/avx512vnni.o" -mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx512cd -mavx512vnni \
  -mavx2 -mfma -mf16c &
wait
export CXX B ROOT
export FLAGS_STR="${FLAGS[*]}"
printf '%s\n' $TARGETS | xargs -P "$JOBS" -I{} bash -c \
  '$CXX $FLAGS_STR -fsanitize=fuzzer fuzz/{}.cpp "$B"/obj/*.o -o "$B/{}" || { echo "build of {} failed"; exit 255; }'
t1=$(date +%s)
echo "fuzz.sh: built $(echo $TARGETS | wc -w) harnesses in $((t1 - t0)) s"

# The harnesses run $JOBS at a time (each libFuzzer process is one thread: the same fuzzing time per
# harness in half the wall time on 2 cores); each writes its summary line to $B/<harness>.summary.
fuzz_one() {
  local t=$1 work="$B/corpus/$1" log="$B/$1.log" args runs cov
  rm -rf "$work" "$B/artifacts/$t" "$B/$t.summary" && mkdir -p "$work" "$B/artifacts/$t"
  [ -d "fuzz/corpus/$t" ] && cp -r "fuzz/corpus/$t/." "$work/"
  if [ "${FUZZ_BUILD_ONLY:-0}" = 1 ]; then
    args=(-runs=0 "$work")
  else
    args=(-max_total_time="$SECS" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1
          -artifact_prefix="$B/artifacts/$t/" "$work")
    [ -n "${FUZZ_SEED:-}" ] && args=(-seed="$FUZZ_SEED" "${args[@]}")
  fi
  if ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 "$B/$t" "${args[@]}" >"$log" 2>&1; then
    runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
    [ -n "$runs" ] || runs=$(grep -o 'Done [0-9]* runs' "$log" | grep -o '[0-9]*' || echo "?")
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo "?")
    printf '%-14s ok    %10s executions  cov %s  corpus %s\n' "$t" "$runs" "$cov" "$(ls "$work" | wc -l)" >"$B/$t.summary"
  else
    printf '%-14s FAIL  (log: %s, reproducer: %s)\n' "$t" "$log" "$(ls "$B/artifacts/$t" | head -1)" >"$B/$t.summary"
    grep -E 'INVARIANT BROKEN|ERROR: AddressSanitizer|runtime error|deadly signal|uncaught exception|terminate called' "$log" | sed -n 1,5p || true
  fi
}
for t in $TARGETS; do
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  fuzz_one "$t" &
done
wait
status=0
echo
for t in $TARGETS; do
  cat "$B/$t.summary" 2>/dev/null || { printf '%-14s FAIL  (no summary: the run died)\n' "$t"; status=1; }
  grep -q ' FAIL ' "$B/$t.summary" 2>/dev/null && status=1
done
echo "fuzz.sh: total $(( $(date +%s) - t0 )) s ($JOBS at a time)"
exit $status
