#!/usr/bin/env bash
# valgrind memcheck over the `kvscore` CLI: builds it (g++ -O1 -g, with the run-time dispatch
# kernel tables, no sanitizers), then runs a set of invocations under memcheck — every
# subcommand on a small synthetic cache, and bad inputs (truncated / corrupt / wrong-dtype
# .npy, budgets out of range, missing files) that must exit 2 cleanly. Fails on any memcheck
# error or definite leak, or on an unexpected exit code.
#   VG_BUILD_DIR (default build-valgrind)
#   VG_CLI=path: a CLI already built (CI passes README command (2)'s build/tools/kvscore, -O2 -g1:
#   memcheck needs no other flags, and its report keeps file:line) instead of building one (~2 min)
set -euo pipefail
cd "$(dirname "$0")/.."
B=${VG_BUILD_DIR:-build-valgrind}
command -v valgrind >/dev/null || { echo "valgrind.sh: valgrind not found (apt-get install valgrind)"; exit 1; }
mkdir -p "$B/obj" "$B/run"
t0=$(date +%s)
if [ -n "${VG_CLI:-}" ]; then
  [ -x "$VG_CLI" ] || { echo "valgrind.sh: VG_CLI=$VG_CLI is not an executable"; exit 1; }
  cp "$VG_CLI" "$B/kvscore"
  echo "valgrind.sh: the CLI from $VG_CLI"
else
  F=(-std=c++20 -O1 -g -fopenmp -Iinclude -I/usr/include/eigen3 -DKVSCORE_RUNTIME_DISPATCH=1 -DKVSCORE_COMPILED=1 -DKVSCORE_DISPATCH_X86=1)
  pids=()
  for s in tools/*.cpp src/dispatch.cpp src/impl_eval.cpp src/impl_linalg.cpp src/isa_sse2.cpp; do
    o="$B/obj/$(basename "${s%.cpp}").o"; [ "$o" -nt "$s" ] || { g++ "${F[@]}" -c "$s" -o "$o" & pids+=($!); }
  done
  o="$B/obj/isa_avx2.o"; [ "$o" -nt src/isa_avx2.cpp ] || { g++ "${F[@]}" -mavx2 -mfma -mf16c -c src/isa_avx2.cpp -o "$o" & pids+=($!); }
  o="$B/obj/isa_avx512.o"; [ "$o" -nt src/isa_avx512.cpp ] || { g++ "${F[@]}" -mavx512f -mavx512bw -mavx512dq \
    -mavx512vl -mavx512cd -mavx2 -mfma -mf16c -c src/isa_avx512.cpp -o "$o" & pids+=($!); }
  o="$B/obj/isa_avx512vnni.o"; [ "$o" -nt src/isa_avx512vnni.cpp ] || { g++ "${F[@]}" -mavx512f -mavx512bw -mavx512dq \
    -mavx512vl -mavx512cd -mavx512vnni -mavx2 -mfma -mf16c -c src/isa_avx512vnni.cpp -o "$o" & pids+=($!); }
  for p in "${pids[@]}"; do wait "$p"; done
  g++ -fopenmp "$B"/obj/*.o -o "$B/kvscore"
  echo "valgrind.sh: built in $(( $(date +%s) - t0 )) s"
fi
K="$B/kvscore"; R="$B/run"
# valgrind's CPU model has no AVX-512: the dispatcher picks avx2 under memcheck (scalar also checked).
VG=(valgrind --tool=memcheck --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite --quiet)
# Each invocation under memcheck is one thread of the machine (valgrind runs a process's threads
# one at a time): they run $(nproc) at a time, each into its own files; the synthetic data first.
n=0
JOBS=$(nproc)
run() {  # expected-exit-code args...
  local want=$1; shift; n=$((n + 1))
  local id=$n
  while (($(jobs -rp | wc -l) >= JOBS)); do wait -n || true; done
  (
    set +e; OMP_NUM_THREADS=2 "${VG[@]}" "$K" "$@" >"$R/out.$id.txt" 2>"$R/err.$id.txt"; got=$?
    if [ "$got" != "$want" ]; then
      { echo "FAIL (exit $got, want $want): kvscore $*"; tail -20 "$R/err.$id.txt"; } >"$R/fail.$id.txt"
    fi
  ) &
}
rm -f "$R"/fail.*.txt
run 0 synth --kind drift --out "$R/syn" --tokens 600 --segment 100
wait  # the data the others read
run 0 score --method knorm --keys "$R/syn/K.npy" --out "$R/s.npy"
run 0 score --method keydiff --keys "$R/syn/K.npy" --out "$R/s2.npy"
run 0 score --method windowed-l2 --window 256 --keys "$R/syn/K.npy" --out "$R/s3.npy"
run 0 score --method snapkv --queries "$R/syn/Q.npy" --keys "$R/syn/K.npy" --out "$R/s4.npy"
run 0 score --method protokv --queries "$R/syn/Q.npy" --keys "$R/syn/K.npy" --out "$R/s5.npy"
run 0 retrieve --keys "$R/syn/K.npy" --queries "$R/syn/Q.npy" --topk 20 --out "$R/idx.npy"
run 0 oja --keys "$R/syn/K.npy" --rank 8 --out-basis "$R/U.npy"
KVSCORE_ISA=scalar run 0 score --method knorm --keys "$R/syn/K.npy" --out "$R/s6.npy"
wait  # s.npy
run 0 select --scores "$R/s.npy" --keep 100 --recent 16 --out "$R/kept.npy"
wait  # kept.npy
# bad inputs: exit 2 with one line, no memory error
head -c 100 "$R/syn/K.npy" > "$R/trunc.npy"
printf '\x93NUMPY\x01\x00\xff\xff{garbage' > "$R/corrupt.npy"
run 2 score --method knorm --keys "$R/trunc.npy" --out "$R/x.npy"
run 2 score --method knorm --keys "$R/corrupt.npy" --out "$R/x.npy"
run 2 score --method knorm --keys "$R/kept.npy" --out "$R/x.npy"
run 2 score --method knorm --keys "$R/missing.npy" --out "$R/x.npy"
run 2 select --scores "$R/s.npy" --keep 100000 --out "$R/x.npy"
run 2 select --scores "$R/s.npy" --keep 10 --recent 64 --out "$R/x.npy"
run 2 retrieve --keys "$R/syn/K.npy" --queries "$R/trunc.npy" --topk 20 --out "$R/x.npy"
wait
failed=("$R"/fail.*.txt)
[ -e "${failed[0]}" ] || failed=()
fails=${#failed[@]}
((fails == 0)) || cat "${failed[@]}"
echo "valgrind.sh: $n invocations ($JOBS at a time), $fails failed, total $(( $(date +%s) - t0 )) s"
[ "$fails" = 0 ]
