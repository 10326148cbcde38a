// Kernel table for AArch64 NEON (Advanced SIMD, baseline of every AArch64 CPU, so no CPU check
// and no extra -m flag). Compiled only when the target is AArch64 (CMakeLists.txt).
#include "kvscore/simd/kernels.hpp"

namespace kvscore::simd::detail {
const KernelTable& table_neon() noexcept { return make_table<XsimdPolicy<xsimd::neon64>>("neon"); }
}  // namespace kvscore::simd::detail
