// Run-time choice among the per-ISA kernel tables of kvscore::dispatch.
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::simd::detail {

#ifdef KVSCORE_DISPATCH_X86
const KernelTable& table_sse2() noexcept;
const KernelTable& table_avx2() noexcept;
const KernelTable& table_avx512() noexcept;
#endif

std::vector<const KernelTable*> compiled_tables() {
  std::vector<const KernelTable*> v;
#ifdef KVSCORE_DISPATCH_X86
  __builtin_cpu_init();
  v.push_back(&table_sse2());  // baseline of x86-64
  // The avx2 table also uses FMA and F16C; the avx512 one AVX-512 F/BW plus the same.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (avx2) v.push_back(&table_avx2());
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    v.push_back(&table_avx512());
#endif
  return v;
}

}  // namespace kvscore::simd::detail
