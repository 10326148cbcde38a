// kvscore/pariskv/kernels.hpp — ParisKV's search kernels, one body per kernel set:
// portable C++ (every CPU), AVX2 + FMA, AVX-512 F/BW/VL/DQ + VBMI, and on AArch64 NEON (Stage
// I's collision table lookup; its other stages are the portable ones, which the compiler
// targets at AArch64 with native fused multiply-adds).
//
//   Stage I   collide_*          collision score S_i = Σ_b tbl[b][id_{i,b}] of 64 keys at a time
//             bucket_threshold*  the score T and ties to take so exactly C keys are candidates
//             bucket_collect_*   their positions, ascending
//   Stage II  rsq_ip_*           RSQ-IP estimates of the candidates from their records
//
// The vector sets are compiled with target attributes (the header stays header-only) and are
// chosen by resolve_kernels(): Kernels::best takes the widest set this CPU runs, capped by the
// kernel table KVSCORE_ISA / simd::set_active_isa() pinned (simd::isa_cap), so the one ISA pin
// governs ParisKV as it governs the scorers.
//
// Every set gives bit-identical results: Stage I is integer arithmetic, and Stage II follows
// one summation order (rsq_ip_portable_one spells it out) with fused multiply-adds throughout
// (std::fma on the portable path). See docs/methods/pariskv.md, "Kernels". Over 500 lines because it is
// one family: three stages × three kernel sets, kept side by side so they can be compared.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVSCORE_PARISKV_X86 1
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KVSCORE_PARISKV_NEON 1
#endif

#include "kvscore/core/cpu.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::pariskv {

/// Kernel sets of the search (tests and comparisons force one; `best` picks at run time).
enum class Kernels { best, avx512, avx2, portable, neon };

namespace detail {

/// A kernel set that runs here (what Kernels::best resolves to).
enum class KernelSet { portable, avx2, avx512, neon };

/// AVX2 set: AVX2, FMA, POPCNT, F16C (the attention's fp16 rows, pariskv/attention.hpp).
inline bool avx2_ok() noexcept {
  const auto& f = kvscore::detail::cpu();
  return f.avx2 && f.fma && f.popcnt && f.f16c;
}
/// AVX-512 set: F, BW, VL, DQ, VBMI (the 256-entry byte table lookup), BMI1/2, plus the AVX2 set.
inline bool avx512_ok() noexcept {
  const auto& f = kvscore::detail::cpu();
  return avx2_ok() && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vbmi && f.bmi1 && f.bmi2;
}

/// NEON set: Advanced SIMD, part of every AArch64 CPU (so: compiled for AArch64).
inline constexpr bool neon_ok() noexcept {
#if defined(KVSCORE_PARISKV_NEON)
  return true;
#else
  return false;
#endif
}

/// The search's set for an ISA level: the widest set this CPU has at or below it (`neon` is
/// at IsaLevel::baseline, as the `neon` row table).
inline KernelSet kernel_set_for(IsaLevel level) noexcept {
  if (level >= IsaLevel::avx512 && avx512_ok()) return KernelSet::avx512;
  if (level >= IsaLevel::avx2 && avx2_ok()) return KernelSet::avx2;
  if (level >= IsaLevel::baseline && neon_ok()) return KernelSet::neon;
  return KernelSet::portable;
}

inline KernelSet resolve_kernels(Kernels k, const std::string& who) {
  switch (k) {
    case Kernels::portable:
      return KernelSet::portable;
    case Kernels::avx2:
      if (!avx2_ok())
        throw std::invalid_argument(who + ": the avx2 kernel set (AVX2, FMA, POPCNT, F16C) is not supported by this CPU");
      return KernelSet::avx2;
    case Kernels::avx512:
      if (!avx512_ok())
        throw std::invalid_argument(who + ": the avx512 kernel set (AVX-512 F/BW/VL/DQ/VBMI) is not supported by this CPU");
      return KernelSet::avx512;
    case Kernels::neon:
      if (!neon_ok()) throw std::invalid_argument(who + ": the neon kernel set (AArch64 Advanced SIMD) is not supported by this CPU");
      return KernelSet::neon;
    case Kernels::best:
      break;
  }
  return kernel_set_for(simd::isa_cap());
}

inline const char* kernel_set_name(KernelSet s) noexcept {
  return s == KernelSet::avx512 ? "avx512" : s == KernelSet::avx2 ? "avx2" : s == KernelSet::neon ? "neon" : "portable";
}

#if defined(KVSCORE_PARISKV_X86)
// GCC's AVX-512 intrinsic headers trip -Wmaybe-uninitialized (their _mm512_undefined_*
// self-initialisations) when inlined into target-attribute functions.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#define KVSCORE_PARISKV_AVX2 __attribute__((target("avx2,fma,popcnt")))
// constant-trip loops over vector arrays fully unrolled, so that -O2 keeps the arrays in registers
#if defined(__clang__)
#define KVSCORE_PARISKV_UNROLL _Pragma("unroll")
#else
#define KVSCORE_PARISKV_UNROLL _Pragma("GCC unroll 32")
#endif
#define KVSCORE_PARISKV_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma,popcnt,bmi,bmi2")))
#endif

// ------------------------------------------------------------------ Stage I: collisions
// ids are block-major: [block of 64 keys][B subspaces][64]; tbl is [B][ncentroids] weights.

template <class Id, class S>
void collide_portable(const Id* ids, std::int64_t blocks, std::int64_t B, std::int64_t ncentroids, const std::uint8_t* tbl,
                      S* out) noexcept {
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    S acc[64] = {};
    const Id* p = ids + blk * B * 64;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::uint8_t* t = tbl + b * ncentroids;
      for (int l = 0; l < 64; ++l) acc[l] = S(acc[l] + t[p[b * 64 + l]]);
    }
    std::memcpy(out + blk * 64, acc, sizeof(acc));
  }
}

#if defined(KVSCORE_PARISKV_X86)
/// m = 8, byte scores. A 256-entry byte table lookup with pshufb, which indexes 16 entries:
/// for each 16-entry slice h of the table that holds a non-zero weight (most do not: only the
/// patterns ranked before ⌈ρN⌉ keys weigh), x = (id XOR 16h) +sat 0x70 has bit 7 clear exactly
/// when id's high nibble is h, and then its low nibble is id's, so pshufb(slice, x) is the
/// weight for those ids and 0 for every other id. `scratch` holds the slice lists.
KVSCORE_PARISKV_AVX2 inline void collide_avx2(const std::uint8_t* ids, std::int64_t blocks, std::int64_t B,
                                              const std::uint8_t* tbl, std::uint8_t* out,
                                              std::vector<std::uint8_t>& scratch) {
  scratch.assign(std::size_t(B * 17), 0);  // per subspace: count, then up to 16 slice numbers
  for (std::int64_t b = 0; b < B; ++b) {
    std::uint8_t* list = scratch.data() + b * 17;
    for (int h = 0; h < 16; ++h) {
      std::uint64_t lo, hi;
      std::memcpy(&lo, tbl + b * 256 + h * 16, 8);
      std::memcpy(&hi, tbl + b * 256 + h * 16 + 8, 8);
      if ((lo | hi) != 0) list[1 + list[0]++] = std::uint8_t(h);
    }
  }
  const __m256i bias = _mm256_set1_epi8(0x70);
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
    const std::uint8_t* p = ids + blk * B * 64;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::uint8_t* list = scratch.data() + b * 17;
      if (list[0] == 0) continue;
      const __m256i id0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * 64));
      const __m256i id1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + b * 64 + 32));
      for (int e = 1; e <= list[0]; ++e) {
        const int h = list[e];
        const __m256i slice =
            _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(tbl + b * 256 + h * 16)));
        const __m256i hv = _mm256_set1_epi8(char(h << 4));
        acc0 = _mm256_add_epi8(acc0, _mm256_shuffle_epi8(slice, _mm256_adds_epu8(_mm256_xor_si256(id0, hv), bias)));
        acc1 = _mm256_add_epi8(acc1, _mm256_shuffle_epi8(slice, _mm256_adds_epu8(_mm256_xor_si256(id1, hv), bias)));
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + blk * 64), acc0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + blk * 64 + 32), acc1);
  }
}

/// m = 8, byte scores, 64 keys at a time: a 256-entry byte table lookup = two 128-entry
/// vpermi2b + a blend on bit 7.
KVSCORE_PARISKV_AVX512 inline void collide_avx512(const std::uint8_t* ids, std::int64_t blocks, std::int64_t B,
                                                  const std::uint8_t* tbl, std::uint8_t* out) noexcept {
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    __m512i acc = _mm512_setzero_si512();
    const std::uint8_t* p = ids + blk * B * 64;
    for (std::int64_t b = 0; b < B; ++b) {
      const std::uint8_t* t = tbl + b * 256;
      const __m512i id = _mm512_loadu_si512(p + b * 64);
      const __m512i lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(t), id, _mm512_loadu_si512(t + 64));
      const __m512i hi = _mm512_permutex2var_epi8(_mm512_loadu_si512(t + 128), id, _mm512_loadu_si512(t + 192));
      acc = _mm512_add_epi8(acc, _mm512_mask_blend_epi8(_mm512_movepi8_mask(id), lo, hi));
    }
    _mm512_storeu_si512(out + blk * 64, acc);
  }
}
#endif

#if defined(KVSCORE_PARISKV_NEON)
/// m = 8, byte scores. A 256-entry byte table lookup is four 64-entry `tbl`/`tbx` lookups
/// (an index past a 64-byte table gives 0 / leaves the lane, so the id minus 64j picks quarter
/// j). A subspace's table fills 16 of the 32 vector registers, so subspaces are the outer
/// loop over a tile of blocks whose byte scores stay in L1.
inline void collide_neon(const std::uint8_t* ids, std::int64_t blocks, std::int64_t B, const std::uint8_t* tbl,
                         std::uint8_t* out) noexcept {
  constexpr std::int64_t kTile = 64;  // blocks: 4 KiB of scores
  const uint8x16_t k64 = vdupq_n_u8(64);
  for (std::int64_t b0 = 0; b0 < blocks; b0 += kTile) {
    const std::int64_t b1 = std::min(blocks, b0 + kTile);
    std::memset(out + b0 * 64, 0, std::size_t((b1 - b0) * 64));
    for (std::int64_t b = 0; b < B; ++b) {
      const std::uint8_t* t = tbl + b * 256;
      const uint8x16x4_t q0 = vld1q_u8_x4(t), q1 = vld1q_u8_x4(t + 64), q2 = vld1q_u8_x4(t + 128),
                         q3 = vld1q_u8_x4(t + 192);
      for (std::int64_t blk = b0; blk < b1; ++blk) {
        const std::uint8_t* p = ids + (blk * B + b) * 64;
        std::uint8_t* o = out + blk * 64;
        for (int l = 0; l < 64; l += 16) {
          uint8x16_t id = vld1q_u8(p + l);
          uint8x16_t w = vqtbl4q_u8(q0, id);
          id = vsubq_u8(id, k64);
          w = vqtbx4q_u8(w, q1, id);
          id = vsubq_u8(id, k64);
          w = vqtbx4q_u8(w, q2, id);
          id = vsubq_u8(id, k64);
          w = vqtbx4q_u8(w, q3, id);
          vst1q_u8(o + l, vaddq_u8(vld1q_u8(o + l), w));
        }
      }
    }
  }
}
#endif

/// Stage I's collision scores of n keys from the weight table tbl [B][ncentroids] (the
/// enumeration's output, ParisKV::weight_table): byte scores into s8 when m <= 8 and 6·B <= 255
/// (returns true; at m = 8 the `set`'s lookup kernel, else portable), otherwise 16-bit scores
/// into s16 (returns false). `scratch` holds the AVX2 kernel's slice lists.
inline bool collide_scores([[maybe_unused]] KernelSet set, const std::uint8_t* ids8, const std::uint16_t* ids16,
                           std::int64_t n, std::int64_t B, std::int64_t m, std::int64_t ncentroids,
                           const std::uint8_t* tbl, std::vector<std::uint8_t>& s8, std::vector<std::uint16_t>& s16,
                           [[maybe_unused]] std::vector<std::uint8_t>& scratch) {
  const std::int64_t blocks = (n + 63) / 64;
  const bool small = m <= 8 && 6 * B <= 255;
  if (small) {
    s8.resize(std::size_t(blocks * 64));
#if defined(KVSCORE_PARISKV_X86)
    if (m == 8 && set == KernelSet::avx512) {
      collide_avx512(ids8, blocks, B, tbl, s8.data());
      return true;
    }
    if (m == 8 && set == KernelSet::avx2) {
      collide_avx2(ids8, blocks, B, tbl, s8.data(), scratch);
      return true;
    }
#endif
#if defined(KVSCORE_PARISKV_NEON)
    if (m == 8 && set == KernelSet::neon) {
      collide_neon(ids8, blocks, B, tbl, s8.data());
      return true;
    }
#endif
    collide_portable(ids8, blocks, B, ncentroids, tbl, s8.data());
    return true;
  }
  s16.resize(std::size_t(blocks * 64));
  if (m <= 8) collide_portable(ids8, blocks, B, ncentroids, tbl, s16.data());
  else collide_portable(ids16, blocks, B, ncentroids, tbl, s16.data());
  return false;
}

// ------------------------------------------------------------------ Stage I: bucket top-C
// Deterministic top-C on small-range integer scores: the threshold T and the number of keys
// equal to T to take (lowest positions first), so that exactly C keys are kept.

template <class S>
void bucket_threshold_portable(const S* s, std::int64_t n, std::int64_t c, std::int64_t max_score,
                               std::vector<std::int64_t>& hist, std::int64_t* T, std::int64_t* need_eq) {
  hist.assign(std::size_t(max_score + 1) * 4, 0);
  std::int64_t* h0 = hist.data();
  std::int64_t* h1 = h0 + (max_score + 1);
  std::int64_t* h2 = h1 + (max_score + 1);
  std::int64_t* h3 = h2 + (max_score + 1);
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4) {  // four sub-histograms: no store-to-load stalls on repeated bins
    ++h0[s[i]];
    ++h1[s[i + 1]];
    ++h2[s[i + 2]];
    ++h3[s[i + 3]];
  }
  for (; i < n; ++i) ++h0[s[i]];
  std::int64_t above = 0;
  for (std::int64_t v = max_score; v >= 0; --v) {
    const std::int64_t cnt = h0[v] + h1[v] + h2[v] + h3[v];
    if (above + cnt >= c) {
      *T = v;
      *need_eq = c - above;
      return;
    }
    above += cnt;
  }
  *T = 0;
  *need_eq = c - above;  // unreachable for c <= n
}

/// Keys i in [i0, n) with s[i] > T, and with s[i] == T while need_eq lasts; returns the new j.
template <class S>
std::int64_t bucket_collect_tail(const S* s, std::int64_t i0, std::int64_t n, std::int64_t T, std::int64_t& need_eq,
                                 std::int64_t* out, std::int64_t j) noexcept {
  for (std::int64_t i = i0; i < n; ++i) {
    const bool take = std::int64_t(s[i]) > T || (std::int64_t(s[i]) == T && need_eq > 0);
    if (std::int64_t(s[i]) == T && need_eq > 0) --need_eq;
    if (take) out[j++] = i;
  }
  return j;
}

template <class S>
std::int64_t bucket_collect_portable(const S* s, std::int64_t n, std::int64_t T, std::int64_t need_eq,
                                     std::int64_t* out) noexcept {
  return bucket_collect_tail(s, 0, n, T, need_eq, out, 0);
}

/// The lowest `k` set bits of `mask` (k below its popcount).
inline std::uint64_t lowest_bits(std::uint64_t mask, std::int64_t k) noexcept {
  std::uint64_t r = 0;
  for (; k > 0; --k) {
    r |= mask & (~mask + 1);
    mask &= mask - 1;
  }
  return r;
}

/// Appends i0 + (bit positions of m) to out[j...]; returns the new j.
inline std::int64_t emit_bits(std::uint64_t m, std::int64_t i0, std::int64_t* out, std::int64_t j) noexcept {
  while (m) {
    out[j++] = i0 + __builtin_ctzll(m);
    m &= m - 1;
  }
  return j;
}

/// The ties to keep from one chunk's equal-to-T mask, updating need_eq.
inline std::uint64_t take_ties(std::uint64_t eq, std::int64_t& need_eq) noexcept {
  if (need_eq <= 0) return 0;
  const std::int64_t ne = __builtin_popcountll(eq);
  if (ne > need_eq) eq = lowest_bits(eq, need_eq);
  need_eq -= std::min(ne, need_eq);
  return eq;
}

/// Finds T by bisection on counts #{s >= t} (about log2(6B) vectorised passes instead of a
/// scalar histogram); the same T and need_eq as bucket_threshold_portable.
template <class CountGe>
void bucket_threshold_bisect(CountGe count_ge, std::int64_t c, std::int64_t max_score, std::int64_t* T,
                             std::int64_t* need_eq) {
  std::int64_t lo = 0, hi = max_score + 1;  // count_ge(lo) = n >= c > count_ge(hi) = 0
  while (hi - lo > 1) {
    const std::int64_t mid = (lo + hi) / 2;
    (count_ge(std::uint8_t(mid)) >= c ? lo : hi) = mid;
  }
  *T = lo;
  *need_eq = c - (lo + 1 > max_score ? 0 : count_ge(std::uint8_t(lo + 1)));
}

#if defined(KVSCORE_PARISKV_X86)
/// #{i < n : s[i] >= t}, 32 bytes per step.
KVSCORE_PARISKV_AVX2 inline std::int64_t count_ge_avx2(const std::uint8_t* s, std::int64_t n, std::uint8_t t) noexcept {
  const __m256i tv = _mm256_set1_epi8(char(t));
  std::int64_t c = 0, i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    c += __builtin_popcount(unsigned(_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(v, tv), v))));
  }
  for (; i < n; ++i) c += s[i] >= t;
  return c;
}

KVSCORE_PARISKV_AVX2 inline std::int64_t bucket_collect_avx2(const std::uint8_t* s, std::int64_t n, std::int64_t T,
                                                             std::int64_t need_eq, std::int64_t* out) noexcept {
  if (T >= 255) return bucket_collect_tail(s, 0, n, T, need_eq, out, 0);
  const __m256i t = _mm256_set1_epi8(char(T)), t1 = _mm256_set1_epi8(char(T + 1));
  std::int64_t j = 0, i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const std::uint64_t gt = unsigned(_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(v, t1), v)));
    const std::uint64_t eq = unsigned(_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, t)));
    j = emit_bits(gt | take_ties(eq, need_eq), i, out, j);
  }
  return bucket_collect_tail(s, i, n, T, need_eq, out, j);
}

/// #{i < n : s[i] >= t}, 64 bytes per step (masked tail).
KVSCORE_PARISKV_AVX512 inline std::int64_t count_ge_avx512(const std::uint8_t* s, std::int64_t n, std::uint8_t t) noexcept {
  const __m512i tv = _mm512_set1_epi8(char(t));
  std::int64_t c = 0, i = 0;
  for (; i + 64 <= n; i += 64) c += __builtin_popcountll(_mm512_cmpge_epu8_mask(_mm512_loadu_si512(s + i), tv));
  if (i < n) {
    const __mmask64 m = (~std::uint64_t(0)) >> (64 - (n - i));
    c += __builtin_popcountll(_mm512_mask_cmpge_epu8_mask(m, _mm512_maskz_loadu_epi8(m, s + i), tv));
  }
  return c;
}

KVSCORE_PARISKV_AVX512 inline std::int64_t bucket_collect_avx512(const std::uint8_t* s, std::int64_t n, std::int64_t T,
                                                                 std::int64_t need_eq, std::int64_t* out) noexcept {
  const __m512i t = _mm512_set1_epi8(char(T));
  std::int64_t j = 0, i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m512i v = _mm512_loadu_si512(s + i);
    j = emit_bits(_mm512_cmpgt_epu8_mask(v, t) | take_ties(_mm512_cmpeq_epu8_mask(v, t), need_eq), i, out, j);
  }
  return bucket_collect_tail(s, i, n, T, need_eq, out, j);
}
#endif

/// Stage I top-C of byte scores with the chosen set: positions ascending into out.
inline void bucket_top_u8(KernelSet set, const std::uint8_t* s, std::int64_t n, std::int64_t c, std::int64_t max_score,
                          std::vector<std::int64_t>& hist, std::int64_t* out) {
  std::int64_t T = 0, need_eq = 0;
#if defined(KVSCORE_PARISKV_X86)
  if (set == KernelSet::avx512) {
    bucket_threshold_bisect([&](std::uint8_t t) { return count_ge_avx512(s, n, t); }, c, max_score, &T, &need_eq);
    bucket_collect_avx512(s, n, T, need_eq, out);
    return;
  }
  if (set == KernelSet::avx2) {
    bucket_threshold_bisect([&](std::uint8_t t) { return count_ge_avx2(s, n, t); }, c, max_score, &T, &need_eq);
    bucket_collect_avx2(s, n, T, need_eq, out);
    return;
  }
#endif
  (void)set;
  bucket_threshold_portable(s, n, c, max_score, hist, &T, &need_eq);
  bucket_collect_portable(s, n, T, need_eq, out);
}

// ------------------------------------------------------------------ Stage II: RSQ-IP
//
// Record of one key (`stride` bytes, ParisKV::record_bytes()): 4-bit codes, then B fp32 weights.
// The padded coordinates are cut into S segments of `len` consecutive coordinates, each inside
// one subspace (len = min(m, P/16), so S = max(B, 16); len = 1 and S = P when P < 16), and the
// segments into G = ⌈S/16⌉ lane groups of 16: lane l of group g is segment 16g + l. Group g's
// codes are `rows` = ⌈len/2⌉ blocks of 16 bytes; block t2 holds, for lane l in byte l, the code
// of coordinate 2·t2 of the segment in the low nibble and of coordinate 2·t2 + 1 in the high
// nibble. So one 16-byte load widened to 16 int32 is a row of 16 lanes' codes (vpermps reads the
// low 4 index bits) and a shift by 4 the next row; no lane ever sums across subspaces.
//
// The estimate, the same on every kernel set (all products fused: fma(a, b, c) = a·b + c
// rounded once):
//   part[g][l] = fma chain over t = 0..len−1 of value[code(g, l, t)] · qt[g][t][l], from 0
//   s[l]       = fma chain over g = 0..G−1 of w[wlane[l] + 16g] · part[g][l], from 0
//   est        = (((s[l] + s[l+8]) for l < 8, then + [l+4] for l < 4, then + [l+2] for l < 2),
//                 [0] + [1]) · ‖q‖
// where qt[g][t][l] is the rotated unit query's coordinate of lane l, row t (0 past S), and
// wlane[l] = the subspace of lane l of group 0 minus 16·0 (lanes of one group share weights
// only when B < 16; B ≥ 16 makes it the identity).

struct RerankPlan {
  const std::uint8_t* rec;    ///< [N][stride] records
  std::int64_t stride;        ///< bytes per record
  std::int64_t groups, len;   ///< G lane groups; coordinates per segment
  std::int64_t wofs;          ///< byte offset of the fp32 weights in a record (16-byte aligned in it)
  const float* qt;            ///< [G][len][16] transposed rotated unit query
  const float* value;         ///< 16 code values ±a[t] (bit 3 = negative)
  const std::int32_t* wlane;  ///< [16] weight index of each lane within its group
  float qnorm;
};

inline float rsq_ip_tree(const float* s, float qnorm) noexcept {
  float t8[8], t4[4];
  for (int l = 0; l < 8; ++l) t8[l] = s[l] + s[l + 8];
  for (int l = 0; l < 4; ++l) t4[l] = t8[l] + t8[l + 4];
  const float t2a = t4[0] + t4[2], t2b = t4[1] + t4[3];
  return (t2a + t2b) * qnorm;
}

/// The reference order (see above), fp32 with std::fma.
inline float rsq_ip_portable_one(const RerankPlan& p, const std::uint8_t* r) noexcept {
  const std::int64_t rows = (p.len + 1) / 2;
  const float* w = reinterpret_cast<const float*>(r + p.wofs);
  float s[16] = {};
  for (std::int64_t g = 0; g < p.groups; ++g) {
    const std::uint8_t* c = r + g * rows * 16;
    const float* q = p.qt + g * p.len * 16;
    for (int l = 0; l < 16; ++l) {
      float part = 0.f;
      for (std::int64_t t = 0; t < p.len; ++t) {
        const std::uint8_t byte = c[(t / 2) * 16 + l];
        part = std::fma(p.value[(t % 2 == 0) ? (byte & 15) : (byte >> 4)], q[t * 16 + l], part);
      }
      float wl;
      std::memcpy(&wl, w + 16 * g + p.wlane[l], sizeof(float));
      s[l] = std::fma(wl, part, s[l]);
    }
  }
  return rsq_ip_tree(s, p.qnorm);
}

#if defined(KVSCORE_PARISKV_X86)
/// 16 lanes' code values of one row: the magnitude a[code & 7] by vpermps, the sign from bit 3.
KVSCORE_PARISKV_AVX2 inline __m256 code_values_avx2(__m256 mag, __m256i code) noexcept {
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(code, 28), _mm256_set1_epi32(std::int32_t(0x80000000u)));
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(mag, code), _mm256_castsi256_ps(sign));
}

KVSCORE_PARISKV_AVX2 inline float rsq_ip_avx2_one(const RerankPlan& p, const std::uint8_t* r) noexcept {
  const std::int64_t rows = (p.len + 1) / 2;
  const float* w = reinterpret_cast<const float*>(r + p.wofs);
  const __m256 mag = _mm256_loadu_ps(p.value);  // a[0..7]; value[8..15] = −a[0..7]
  const __m256i wl0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.wlane));
  const __m256i wl1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.wlane + 8));
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (std::int64_t g = 0; g < p.groups; ++g) {
    const std::uint8_t* c = r + g * rows * 16;
    const float* q = p.qt + g * p.len * 16;
    __m256 d0 = _mm256_setzero_ps(), d1 = _mm256_setzero_ps();
    for (std::int64_t t = 0; t < p.len; t += 2) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (t / 2) * 16));
      __m256i b0 = _mm256_cvtepu8_epi32(raw), b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(raw, raw));
      d0 = _mm256_fmadd_ps(code_values_avx2(mag, b0), _mm256_loadu_ps(q + t * 16), d0);
      d1 = _mm256_fmadd_ps(code_values_avx2(mag, b1), _mm256_loadu_ps(q + t * 16 + 8), d1);
      if (t + 1 < p.len) {
        b0 = _mm256_srli_epi32(b0, 4);
        b1 = _mm256_srli_epi32(b1, 4);
        d0 = _mm256_fmadd_ps(code_values_avx2(mag, b0), _mm256_loadu_ps(q + t * 16 + 16), d0);
        d1 = _mm256_fmadd_ps(code_values_avx2(mag, b1), _mm256_loadu_ps(q + t * 16 + 24), d1);
      }
    }
    const __m256 wg0 = _mm256_loadu_ps(w + 16 * g), wg1 = _mm256_loadu_ps(w + 16 * g + 8);
    // lanes of one group read weights 0..15 of it: lanes 8-15 may need weights 0-7 (B < 16)
    const __m256 w0 = _mm256_permutevar8x32_ps(wg0, wl0);
    const __m256 w1 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(wg0, wl1), _mm256_permutevar8x32_ps(wg1, wl1),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(wl1, 28)));
    s0 = _mm256_fmadd_ps(w0, d0, s0);
    s1 = _mm256_fmadd_ps(w1, d1, s1);
  }
  const __m256 t8 = _mm256_add_ps(s0, s1);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1))) * p.qnorm;
}

/// Lane r = tree16(s[r]) for 16 lane vectors at once (a transposing butterfly whose adds are
/// exactly tree16's: (l, l+8), then +4, then (0, 2) and (1, 3), then their sum).
KVSCORE_PARISKV_AVX512 inline __m512 tree16x16_avx512(const __m512* s) noexcept {
  __m512 u[8], v[4], w[2];
  KVSCORE_PARISKV_UNROLL
  for (int p = 0; p < 8; ++p)
    u[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(s[2 * p], s[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  KVSCORE_PARISKV_UNROLL
  for (int p = 0; p < 4; ++p)
    v[p] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * p], u[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  KVSCORE_PARISKV_UNROLL
  for (int p = 0; p < 2; ++p)
    w[p] = _mm512_add_ps(_mm512_shuffle_ps(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // f's lane 4k + e holds row 4e + k
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
}

/// The 16 lane sums s[l] of one record (before rsq_ip_tree).
KVSCORE_PARISKV_AVX512 inline __m512 rsq_ip_lanes_avx512(const RerankPlan& p, const std::uint8_t* r) noexcept {
  const std::int64_t rows = (p.len + 1) / 2;
  const float* w = reinterpret_cast<const float*>(r + p.wofs);
  const __m512 vt = _mm512_loadu_ps(p.value);
  const __m512i wl = _mm512_loadu_si512(p.wlane);
  __m512 s = _mm512_setzero_ps();
  for (std::int64_t g = 0; g < p.groups; ++g) {
    const std::uint8_t* c = r + g * rows * 16;
    const float* q = p.qt + g * p.len * 16;
    __m512 d = _mm512_setzero_ps();
    for (std::int64_t t = 0; t < p.len; t += 2) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c + (t / 2) * 16)));
      d = _mm512_fmadd_ps(_mm512_permutexvar_ps(b, vt), _mm512_loadu_ps(q + t * 16), d);
      if (t + 1 < p.len)
        d = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), vt), _mm512_loadu_ps(q + t * 16 + 16), d);
    }
    s = _mm512_fmadd_ps(_mm512_permutexvar_ps(wl, _mm512_loadu_ps(w + 16 * g)), d, s);
  }
  return s;
}

KVSCORE_PARISKV_AVX512 inline float rsq_ip_avx512_one(const RerankPlan& p, const std::uint8_t* r) noexcept {
  const __m512 s = rsq_ip_lanes_avx512(p, r);
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1))) * p.qnorm;
}
#endif

/// Candidates ahead whose records are requested early: they are scattered over the index.
inline constexpr std::int64_t kPrefetchAhead = 16;

// On x86 the instruction is written out: GCC 12 did not inline a __builtin_prefetch helper into
// the target-attribute kernels, found it free of side effects and deleted the call.
inline void prefetch_line(const char* a) noexcept {
#if defined(KVSCORE_PARISKV_X86) && defined(__GNUC__)
  __asm__ volatile("prefetcht0 %0" : : "m"(*a));
#elif defined(__GNUC__)
  __builtin_prefetch(a, 0, 3);
#else
  (void)a;
#endif
}

/// Requests the record of candidate c + kPrefetchAhead (plain inline code: it inlines into
/// every kernel set's loop).
inline void prefetch_ahead(const RerankPlan& p, const std::int64_t* cand, std::int64_t c, std::int64_t n) noexcept {
  if (c + kPrefetchAhead >= n) return;
  const std::int64_t nx = cand != nullptr ? cand[c + kPrefetchAhead] : c + kPrefetchAhead;
  const char* r = reinterpret_cast<const char*>(p.rec + nx * p.stride);
  for (std::int64_t o = 0; o < p.stride; o += 64) prefetch_line(r + o);
  prefetch_line(r + p.stride - 1);
}
inline const std::uint8_t* record(const RerankPlan& p, const std::int64_t* cand, std::int64_t c) noexcept {
  return p.rec + (cand != nullptr ? cand[c] : c) * p.stride;
}

#if defined(KVSCORE_PARISKV_X86)
KVSCORE_PARISKV_AVX2 inline void rsq_ip_avx2(const RerankPlan& p, const std::int64_t* cand, std::int64_t n, float* out) noexcept {
  for (std::int64_t c = 0; c < n; ++c) {
    prefetch_ahead(p, cand, c, n);
    out[c] = rsq_ip_avx2_one(p, record(p, cand, c));
  }
}
KVSCORE_PARISKV_AVX512 inline void rsq_ip_avx512(const RerankPlan& p, const std::int64_t* cand, std::int64_t n,
                                                 float* out) noexcept {
  std::int64_t c = 0;
  const __m512 qn = _mm512_set1_ps(p.qnorm);
  for (; c + 16 <= n; c += 16) {  // 16 records' trees at once: the same sums as rsq_ip_tree
    __m512 s[16];
    KVSCORE_PARISKV_UNROLL
    for (int r = 0; r < 16; ++r) {
      prefetch_ahead(p, cand, c + r, n);
      s[r] = rsq_ip_lanes_avx512(p, record(p, cand, c + r));
    }
    _mm512_storeu_ps(out + c, _mm512_mul_ps(tree16x16_avx512(s), qn));
  }
  for (; c < n; ++c) {
    prefetch_ahead(p, cand, c, n);
    out[c] = rsq_ip_avx512_one(p, record(p, cand, c));
  }
}
#endif

/// RSQ-IP estimates of keys cand[0..n) (cand null: keys 0..n) into out, with the chosen set.
inline void rsq_ip(KernelSet set, const RerankPlan& p, const std::int64_t* cand, std::int64_t n, float* out) noexcept {
#if defined(KVSCORE_PARISKV_X86)
  if (set == KernelSet::avx512) return rsq_ip_avx512(p, cand, n, out);
  if (set == KernelSet::avx2) return rsq_ip_avx2(p, cand, n, out);
#endif
  (void)set;
  for (std::int64_t c = 0; c < n; ++c) {
    prefetch_ahead(p, cand, c, n);
    out[c] = rsq_ip_portable_one(p, record(p, cand, c));
  }
}

#if defined(KVSCORE_PARISKV_X86) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace detail
}  // namespace kvscore::pariskv
