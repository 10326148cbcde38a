// kvscore/core/cpu.hpp — x86 CPU feature detection (cpuid + XGETBV, so a feature
// the OS does not save registers for counts as absent). Compiler-neutral: g++ and clang.
// Also the one ISA level scale (IsaLevel) and the one pin on it (isa_cap_slot), so that every floor, the ground floor's
// fp16 conversion included, obeys KVSCORE_ISA / simd::set_active_isa.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string_view>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace kvscore::detail {

struct CpuFeatures {
  bool avx = false, f16c = false, fma = false, avx2 = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512vbmi = false, avx512vnni = false, popcnt = false, bmi1 = false, bmi2 = false;
};

inline CpuFeatures detect_cpu() noexcept {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27);
  if (!osxsave) return f;
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const bool ymm_state = (lo & 0x6u) == 0x6u;        // XMM + YMM saved by the OS
  const bool zmm_state = (lo & 0xe6u) == 0xe6u;      // + opmask, ZMM_Hi256, Hi16_ZMM
  f.avx = ymm_state && (c & (1u << 28));
  f.f16c = f.avx && (c & (1u << 29));
  f.fma = f.avx && (c & (1u << 12));
  f.popcnt = (c & (1u << 23)) != 0;
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = f.avx && (b & (1u << 5));
    f.avx512f = zmm_state && (b & (1u << 16));
    f.avx512dq = f.avx512f && (b & (1u << 17));
    f.avx512bw = f.avx512f && (b & (1u << 30));
    f.avx512vl = f.avx512f && (b & (1u << 31));
    f.avx512vbmi = f.avx512f && (c & (1u << 1));
    f.avx512vnni = f.avx512f && (c & (1u << 11));
    f.bmi1 = (b & (1u << 3)) != 0;
    f.bmi2 = (b & (1u << 8)) != 0;
  }
#endif
  return f;
}

inline const CpuFeatures& cpu() noexcept {
  static const CpuFeatures f = detect_cpu();
  return f;
}

}  // namespace kvscore::detail

namespace kvscore {

/// The one scale of instruction sets every kernel family maps to its own sets (faiss's
/// SIMDLevel): the row tables (simd/dispatch.hpp), the selector's passes (select/radix.hpp),
/// ParisKV's search (pariskv/kernels.hpp) and the fp16 conversion (core/dtype.hpp).
enum class IsaLevel : int {
  scalar = 0,    ///< no vector code
  baseline = 1,  ///< SSE2 up to AVX (no AVX2) on x86-64; NEON on AArch64
  avx2 = 2,      ///< AVX2 + FMA
  avx512 = 3,    ///< AVX-512
};

}  // namespace kvscore

namespace kvscore::detail {

/// The level of a kernel table name: "scalar", then by what the name contains ("avx512",
/// "avx2"; xsimd arch names such as "fma3+avx2" or "avx512bw" included), else `baseline`.
inline IsaLevel isa_level(std::string_view name) noexcept {
  if (name == "scalar") return IsaLevel::scalar;
  if (name.find("avx512") != std::string_view::npos) return IsaLevel::avx512;
  if (name.find("avx2") != std::string_view::npos) return IsaLevel::avx2;
  return IsaLevel::baseline;
}

/// KVSCORE_ISA, read once at first use ("" when unset or empty). An unknown name is reported
/// by simd::active_table(), which is the one reader that checks it.
inline std::string_view isa_env() noexcept {
  static const std::string_view env = [] {
    const char* e = std::getenv("KVSCORE_ISA");
    return e != nullptr ? std::string_view(e) : std::string_view();
  }();
  return env;
}

/// The highest ISA level any kernel may use: KVSCORE_ISA's level at first use, then the level
/// of the table simd::set_active_isa() pins; IsaLevel::avx512 (no limit) when nothing pins it.
inline std::atomic<IsaLevel>& isa_cap_slot() noexcept {
  static std::atomic<IsaLevel> cap{isa_env().empty() ? IsaLevel::avx512 : isa_level(isa_env())};
  return cap;
}

}  // namespace kvscore::detail
