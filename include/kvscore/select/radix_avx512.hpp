// kvscore/select/radix_avx512.hpp — the selector's passes on AVX-512 (F/BW/VL/DQ + BMI2,
// POPCNT), 16 lanes, compiled with target attributes (internal; see select/radix.hpp).
//
// The AVX2 passes (radix_avx2.hpp) have the same loop shapes with other intrinsics: 16 vs 8
// lanes, unsigned mask compares vs AVX2's signed compares on sign-flipped keys, k-registers
// vs movemask. They are written out per ISA rather than over an xsimd batch because xsimd has
// no mask-register compress/popcount for these, and GCC will not inline an ISA-generic
// template into a target-attributed caller reliably; both are checked against the portable
// passes position by position (tests/test_select.cpp, every ISA).
#pragma once

#include "kvscore/select/radix_portable.hpp"

#if KVSCORE_SELECT_X86
// GCC 12 reports the _mm512_undefined_*() inside its own intrinsics as "may be used
// uninitialized" once they are inlined at -O2; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvscore::detail::sel {

#define KVSCORE_SELECT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,popcnt,bmi,bmi2")))

KVSCORE_SELECT_AVX512 inline __m512i key16_avx512_bits(__m512i u) noexcept {
  const __mmask16 neg = _mm512_movepi32_mask(u);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i pos = _mm512_or_si512(u, _mm512_set1_epi32(std::int32_t(0x80000000u)));
  const __m512i k = _mm512_mask_sub_epi32(pos, neg, _mm512_setzero_si512(), u);
  return _mm512_mask_mov_epi32(k, nan, _mm512_set1_epi32(std::int32_t(kNanKey)));
}
KVSCORE_SELECT_AVX512 inline __m512i key16_avx512(const float* p) noexcept {
  return key16_avx512_bits(_mm512_loadu_si512(p));
}
KVSCORE_SELECT_AVX512 inline __m512i key16_avx512(const std::uint32_t* p) noexcept {
  return _mm512_loadu_si512(p);
}

template <class Src>
KVSCORE_SELECT_AVX512 void hist_top_avx512(const Src* x, std::int64_t n, std::uint32_t* hist) noexcept {
  alignas(64) std::uint32_t sub[3][kTopBins];
  std::memset(sub, 0, sizeof sub);
  alignas(64) std::uint32_t idx[64];
  std::int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int q = 0; q < 4; ++q)
      _mm512_store_si512(idx + 16 * q, _mm512_maskz_srli_epi32(__mmask16(0xFFFF), key16_avx512(x + i + 16 * q), kTopShift));
    for (int r = 0; r < 64; r += 4) {
      ++hist[idx[r]];
      ++sub[0][idx[r + 1]];
      ++sub[1][idx[r + 2]];
      ++sub[2][idx[r + 3]];
    }
  }
  for (; i < n; ++i) ++hist[load_key(x, i) >> kTopShift];
  for (int b = 0; b < kTopBins; b += 16) {
    __m512i s = _mm512_loadu_si512(hist + b);
    s = _mm512_add_epi32(s, _mm512_load_si512(sub[0] + b));
    s = _mm512_add_epi32(s, _mm512_load_si512(sub[1] + b));
    s = _mm512_add_epi32(s, _mm512_load_si512(sub[2] + b));
    _mm512_storeu_si512(hist + b, s);
  }
}

template <class Src>
KVSCORE_SELECT_AVX512 std::int64_t window_avx512(const Src* x, std::int64_t n, std::uint32_t lo, std::uint32_t hi,
                                                 std::uint32_t* out, std::int64_t* above) noexcept {
  const __m512i vlo = _mm512_set1_epi32(std::int32_t(lo));
  const __m512i vhi = _mm512_set1_epi32(std::int32_t(hi));
  const __m512i vspan = _mm512_set1_epi32(std::int32_t(hi - lo));
  std::int64_t j = 0, i = 0, a = 0;
  for (; i + 16 <= n; i += 16) {  // j <= i, so a full 16-key store stays inside out[0, n)
    const __m512i k = key16_avx512(x + i);
    a += __builtin_popcount(unsigned(_mm512_cmpgt_epu32_mask(k, vhi)));
    const __mmask16 m = _mm512_cmple_epu32_mask(_mm512_sub_epi32(k, vlo), vspan);
    _mm512_storeu_si512(out + j, _mm512_maskz_compress_epi32(m, k));
    j += __builtin_popcount(unsigned(m));
  }
  for (; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    if (k - lo <= hi - lo) out[j++] = k;
    a += k > hi;
  }
  *above += a;
  return j;
}

/// Lanes kept from one block: key > K, plus (want_eq) the first need - seen keys == K.
KVSCORE_SELECT_AVX512 inline __mmask16 collect_mask16(__m512i k, __m512i vK, bool want_eq, std::int64_t need,
                                                      std::int64_t& seen) noexcept {
  __mmask16 m = _mm512_cmpgt_epu32_mask(k, vK);
  if (want_eq) {
    __mmask16 eq = _mm512_cmpeq_epu32_mask(k, vK);
    const std::int64_t c = __builtin_popcount(unsigned(eq));
    if (seen + c > need) eq = __mmask16(_pdep_u32((1u << (need - seen)) - 1u, eq));
    seen += c;
    m = __mmask16(m | eq);
  }
  return m;
}

/// Writes base + the positions of m's lanes with two full 8 x int64 stores (out needs room
/// for 16); returns how many are kept.
KVSCORE_SELECT_AVX512 inline int collect_emit16(__mmask16 m, __m512i pos, __m512i vbase, std::int64_t* out) noexcept {
  const __m512i sel = _mm512_maskz_compress_epi32(m, pos);
  _mm512_storeu_si512(out, _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sel))));
  _mm512_storeu_si512(out + 8, _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sel, 1))));
  return __builtin_popcount(unsigned(m));
}

template <class Src>
KVSCORE_SELECT_AVX512 std::int64_t collect_avx512(const Src* x, std::int64_t n, Threshold th, std::int64_t base,
                                                  std::int64_t* out, std::int64_t limit) noexcept {
  if (n > std::int64_t(0x7FFFFFF0)) return collect_portable(x, n, th, base, out, limit);  // 32-bit lane positions
  const __m512i vK = _mm512_set1_epi32(std::int32_t(th.key));
  const __m512i vbase = _mm512_set1_epi64(base);
  const __m512i step = _mm512_set1_epi32(16);
  __m512i pos = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  std::int64_t j = 0, i = 0, seen = 0;
  const std::int64_t need = th.need_eq;
  // Full blocks with room for 16 more positions: plain stores (the tail is overwritten later).
  for (; i + 16 <= n && seen < need && j + 16 <= limit; i += 16) {
    const __mmask16 m = collect_mask16(key16_avx512(x + i), vK, true, need, seen);
    j += collect_emit16(m, pos, vbase, out + j);
    pos = _mm512_add_epi32(pos, step);
  }
  for (; i + 16 <= n && j + 16 <= limit; i += 16) {
    const __mmask16 m = _mm512_cmpgt_epu32_mask(key16_avx512(x + i), vK);
    j += collect_emit16(m, pos, vbase, out + j);
    pos = _mm512_add_epi32(pos, step);
  }
  // Blocks near the end of the output: masked stores, never past `limit`.
  for (; i + 16 <= n && j < limit; i += 16) {
    __mmask16 m = collect_mask16(key16_avx512(x + i), vK, seen < need, need, seen);
    const std::int64_t room = limit - j;  // < 16 here
    if (__builtin_popcount(unsigned(m)) > room) m = __mmask16(_pdep_u32((1u << room) - 1u, m));
    const int c = __builtin_popcount(unsigned(m));
    const __m512i sel = _mm512_maskz_compress_epi32(m, pos);
    const unsigned keep = (1u << c) - 1u;
    _mm512_mask_storeu_epi64(out + j, __mmask8(keep & 0xFF),
                             _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm512_castsi512_si256(sel))));
    _mm512_mask_storeu_epi64(out + j + 8, __mmask8(keep >> 8),
                             _mm512_add_epi64(vbase, _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(sel, 1))));
    j += c;
    pos = _mm512_add_epi32(pos, step);
  }
  for (; i < n && j < limit; ++i) {
    const std::uint32_t k = load_key(x, i);
    bool take = k > th.key;
    if (k == th.key) take = seen++ < need;
    if (take) out[j++] = base + i;
  }
  return j;
}

template <class Src>
KVSCORE_SELECT_AVX512 void count_avx512(const Src* x, std::int64_t n, std::uint32_t K, std::int64_t* gt,
                                        std::int64_t* eq) noexcept {
  const __m512i vK = _mm512_set1_epi32(std::int32_t(K));
  std::int64_t g = 0, e = 0, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i k = key16_avx512(x + i);
    g += __builtin_popcount(unsigned(_mm512_cmpgt_epu32_mask(k, vK)));
    e += __builtin_popcount(unsigned(_mm512_cmpeq_epu32_mask(k, vK)));
  }
  for (; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    g += k > K;
    e += k == K;
  }
  *gt += g;
  *eq += e;
}
template <int D, class Src>
KVSCORE_SELECT_AVX512 void tally_avx512_d(const Src* x, std::int64_t n, const std::uint32_t* v, Tally* out) noexcept {
  const std::uint32_t hi = v[0], lo = v[D - 1];
  const __m512i vhi = _mm512_set1_epi32(std::int32_t(hi)), vlo = _mm512_set1_epi32(std::int32_t(lo));
  const __m512i vspan = _mm512_set1_epi32(std::int32_t(hi - lo));
  __m512i w[D];
  for (int q = 0; q < D; ++q) w[q] = _mm512_set1_epi32(std::int32_t(v[q]));
  std::int64_t a = 0, in = 0, e[D] = {}, i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i k = key16_avx512(x + i);
    a += __builtin_popcount(unsigned(_mm512_cmpgt_epu32_mask(k, vhi)));
    if constexpr (D > 1) in += __builtin_popcount(unsigned(_mm512_cmple_epu32_mask(_mm512_sub_epi32(k, vlo), vspan)));
    for (int q = 0; q < D; ++q) e[q] += __builtin_popcount(unsigned(_mm512_cmpeq_epu32_mask(k, w[q])));
  }
  for (; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    a += k > hi;
    in += k - lo <= hi - lo;
    for (int q = 0; q < D; ++q) e[q] += k == v[q];
  }
  if constexpr (D == 1) in = e[0];  // one value: inside == equal
  out->above += a;
  out->inside += in;
  for (int q = 0; q < D; ++q) out->eq[q] += e[q];
}

template <class Src>
KVSCORE_SELECT_AVX512 void tally_avx512(const Src* x, std::int64_t n, const std::uint32_t* v, int d,
                                        Tally* out) noexcept {
  switch (d) {
    case 1: return tally_avx512_d<1>(x, n, v, out);
    case 2: return tally_avx512_d<2>(x, n, v, out);
    case 3: return tally_avx512_d<3>(x, n, v, out);
    default: return tally_avx512_d<4>(x, n, v, out);
  }
}

KVSCORE_SELECT_AVX512 inline void minmax_avx512(const std::uint32_t* k, std::int64_t n, std::uint32_t* lo,
                                                 std::uint32_t* hi) noexcept {
  __m512i a = _mm512_set1_epi32(std::int32_t(k[0])), b = a;
  std::int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_loadu_si512(k + i);
    a = _mm512_min_epu32(a, v);
    b = _mm512_max_epu32(b, v);
  }
  if (i < n) {
    const __mmask16 m = __mmask16((1u << (n - i)) - 1u);
    const __m512i v = _mm512_maskz_loadu_epi32(m, k + i);
    a = _mm512_mask_min_epu32(a, m, a, v);
    b = _mm512_mask_max_epu32(b, m, b, v);
  }
  *lo = _mm512_reduce_min_epu32(a);
  *hi = _mm512_reduce_max_epu32(b);
}

KVSCORE_SELECT_AVX512 inline std::int64_t keep_digit_avx512(std::uint32_t* k, std::int64_t n, int dshift,
                                                            std::uint32_t mask, std::uint32_t b) noexcept {
  const __m512i vm = _mm512_set1_epi32(std::int32_t(mask)), vb = _mm512_set1_epi32(std::int32_t(b));
  const __m128i sh = _mm_cvtsi32_si128(dshift);
  std::int64_t j = 0, i = 0;
  for (; i + 16 <= n; i += 16) {  // j <= i: the store never overtakes the reads
    const __m512i v = _mm512_loadu_si512(k + i);
    const __mmask16 m = _mm512_cmpeq_epu32_mask(_mm512_and_si512(_mm512_srl_epi32(v, sh), vm), vb);
    const int c = __builtin_popcount(unsigned(m));
    _mm512_mask_storeu_epi32(k + j, __mmask16((1u << c) - 1u), _mm512_maskz_compress_epi32(m, v));
    j += c;
  }
  for (; i < n; ++i) {
    const std::uint32_t v = k[i];
    if (((v >> dshift) & mask) == b) k[j++] = v;
  }
  return j;
}

KVSCORE_SELECT_AVX512 inline void fill_avx512(const float* x, std::int64_t n, Threshold th, bool normalize,
                                              double mean, double inv_std, std::uint32_t* z) noexcept {
  const __m512i vK = _mm512_set1_epi32(std::int32_t(th.key));
  const __m512i forced = _mm512_set1_epi32(std::int32_t(kForcedKey));
  const __m512d vmean = _mm512_set1_pd(mean), vinv = _mm512_set1_pd(inv_std);
  const __m512i expo = _mm512_set1_epi32(0x7F800000);
  std::int64_t i = 0, seen = 0;
  const std::int64_t need = th.need_eq;
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __m512i k = key16_avx512_bits(u);
    __mmask16 m = _mm512_cmpgt_epu32_mask(k, vK);
    if (seen < need) {
      __mmask16 eq = _mm512_cmpeq_epu32_mask(k, vK);
      const std::int64_t c = __builtin_popcount(unsigned(eq));
      if (seen + c > need) eq = __mmask16(_pdep_u32((1u << (need - seen)) - 1u, eq));
      seen += c;
      m = __mmask16(m | eq);
    }
    __m512i val = k;
    if (normalize) {
      const __m512 xv = _mm512_castsi512_ps(u);
      const __m256 lo = _mm512_castps512_ps256(xv);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(xv), 1));
      const __m256 zlo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(lo), vmean), vinv));
      const __m256 zhi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(hi), vmean), vinv));
      const __m512i zb = _mm512_castps_si512(_mm512_insertf32x8(_mm512_castps256_ps512(zlo), zhi, 1));
      const __mmask16 finite = _mm512_cmpneq_epi32_mask(_mm512_and_si512(u, expo), expo);
      val = _mm512_mask_mov_epi32(k, finite, key16_avx512_bits(zb));
    }
    _mm512_storeu_si512(z + i, _mm512_mask_mov_epi32(val, m, forced));
  }
  if (i < n) {
    Threshold rest = th;
    rest.need_eq = std::max<std::int64_t>(0, need - seen);
    fill_portable(x + i, n - i, rest, normalize, mean, inv_std, z + i);
  }
}

KVSCORE_SELECT_AVX512 inline void lane_sums_avx512(const float* x, std::int64_t n, bool squares, double mean,
                                                   double* lanes, std::int64_t* count) noexcept {
  __m512d acc = _mm512_loadu_pd(lanes);
  const __m512d vmean = _mm512_set1_pd(mean);
  const __m256i expo = _mm256_set1_epi32(0x7F800000);
  std::int64_t c = 0, i = 0;
  for (; i + 8 <= n; i += 8) {  // lane j of the vector is element i + j, i % 8 == 0
    const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __mmask8 finite = _mm256_cmpneq_epi32_mask(_mm256_and_si256(u, expo), expo);
    __m512d d = _mm512_cvtps_pd(_mm256_castsi256_ps(u));
    if (squares) {
      d = _mm512_sub_pd(d, vmean);
      d = _mm512_mul_pd(d, d);
      __asm__("" : "+v"(d));  // no FMA contraction with the add below
    }
    acc = _mm512_mask_add_pd(acc, finite, acc, d);
    c += __builtin_popcount(unsigned(finite));
  }
  _mm512_storeu_pd(lanes, acc);
  std::int64_t rest = 0;
  if (i < n) {
    double tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    lane_sums_portable(x + i, n - i, squares, mean, tail, &rest);
    for (int j = 0; j < 8; ++j) lanes[j] += tail[j];  // tail element i + j sits in lane j: i % 8 == 0
  }
  *count = c + rest;
}


}  // namespace kvscore::detail::sel

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVSCORE_SELECT_X86
