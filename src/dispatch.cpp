// Run-time choice among the per-ISA kernel tables of kvscore::dispatch.
#include "kvscore/core/cpu.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::simd::detail {

#ifdef KVSCORE_DISPATCH_X86
const KernelTable& table_sse2() noexcept;
const KernelTable& table_avx2() noexcept;
const KernelTable& table_avx512() noexcept;
const KernelTable& table_avx512vnni() noexcept;
#endif
#ifdef KVSCORE_DISPATCH_NEON
const KernelTable& table_neon() noexcept;
#endif

std::vector<const KernelTable*> compiled_tables() {
  std::vector<const KernelTable*> v;
#ifdef KVSCORE_DISPATCH_X86
  const kvscore::detail::CpuFeatures& f = kvscore::detail::cpu();
  v.push_back(&table_sse2());  // baseline of x86-64
  // The avx2 table also uses FMA and F16C; the avx512 one AVX-512 F/BW/DQ/VL plus the same.
  const bool avx2 = f.avx2 && f.fma && f.f16c;
  if (avx2) v.push_back(&table_avx2());
  const bool avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl;
  if (avx512) v.push_back(&table_avx512());
  if (avx512 && f.avx512vnni) v.push_back(&table_avx512vnni());  // Ice Lake, Zen 4 and later
#endif
#ifdef KVSCORE_DISPATCH_NEON
  v.push_back(&table_neon());  // Advanced SIMD is part of every AArch64 CPU
#endif
  return v;
}

}  // namespace kvscore::simd::detail
