// Kernel table for sse2; this file alone is compiled with the matching -m flags (CMakeLists.txt).
// Only templates on the arch are instantiated here, so no wide-ISA code leaks into shared symbols.
#include "kvscore/simd/kernels.hpp"

namespace kvscore::simd::detail {
const KernelTable& table_sse2() noexcept { return make_table<XsimdPolicy<xsimd::sse2>>("sse2"); }
}  // namespace kvscore::simd::detail
