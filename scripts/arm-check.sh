#!/usr/bin/env bash
# Cross-compiles part of the test suite for AArch64 with the NEON table (src/isa_neon.cpp)
# and runs it under qemu-aarch64: every table against scalar ([simd], [dtype]), the selector
# and ParisKV's portable paths, the numpy goldens, each geometric scorer's own tests. No Arm
# machine is needed; what qemu cannot show is speed (docs/design/simd.md, "Arm").
#   scripts/arm-check.sh [build-dir]      (needs g++-aarch64-linux-gnu and qemu-user)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/build-arm}"
mkdir -p "$out/inc"
# the header-only dependencies, without the rest of the host's /usr/include
ln -sfn /usr/include/xsimd "$out/inc/xsimd"
ln -sfn /usr/include/catch2 "$out/inc/catch2"
ln -sfn /usr/include/eigen3/Eigen "$out/inc/Eigen"
cxx=aarch64-linux-gnu-g++
flags=(-std=c++20 -O1 -g0 -Wall -Wextra -Werror -DKVSCORE_RUNTIME_DISPATCH=1 -DKVSCORE_COMPILED=1
       -DKVSCORE_DISPATCH_NEON=1 "-DKVSCORE_TEST_DATA_DIR=\"$root/tests/data\""
       -I"$root/include" -isystem "$out/inc")
srcs=(src/dispatch.cpp src/isa_neon.cpp src/impl_eval.cpp src/impl_linalg.cpp tests/main.cpp
      tests/test_simd.cpp tests/test_dtype.cpp tests/test_select.cpp tests/test_pariskv.cpp
      tests/test_golden.cpp tests/test_scorer_properties.cpp tests/test_knorm.cpp tests/test_keydiff.cpp
      tests/test_manifoldkv.cpp tests/test_windowed_manifoldkv.cpp tests/test_qfilter.cpp
      tests/test_streaming_llm.cpp)
jobs="${KVSCORE_ARM_JOBS:-$(nproc)}"
printf '%s\n' "${srcs[@]}" | xargs -P "$jobs" -I{} sh -c \
  'o="$1/$(echo "$2" | tr / _).o"; '"$cxx ${flags[*]@Q}"' -c "$3/$2" -o "$o"' _ "$out" {} "$root"
$cxx -o "$out/kvscore_tests_arm" "$out"/*.o -pthread
echo "built $out/kvscore_tests_arm ($($cxx --version | head -1))"
KVSCORE_ISA="" qemu-aarch64 -L /usr/aarch64-linux-gnu "$out/kvscore_tests_arm" "${@:2}"
