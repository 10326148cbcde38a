// kvscore/select/radix_avx2.hpp — the selector's passes on AVX2 (+ BMI2, POPCNT), 8 lanes,
// compiled with target attributes (internal; see select/radix.hpp and, for why each ISA has
// its own file, radix_avx512.hpp).
#pragma once

#include "kvscore/select/radix_portable.hpp"

#if KVSCORE_SELECT_X86
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace kvscore::detail::sel {

// AVX2 (+ BMI2, POPCNT): the same passes, 8 lanes. Unsigned key compares go through
// "flipped" keys kf = key ^ 0x80000000 and signed compares; compression uses a permutation
// table indexed by the 8-bit lane mask.

#define KVSCORE_SELECT_AVX2 __attribute__((target("avx2,bmi,bmi2,popcnt")))

struct CompressTable {
  alignas(32) std::uint32_t idx[256][8];
  constexpr CompressTable() : idx{} {
    for (int m = 0; m < 256; ++m) {
      int j = 0;
      for (int b = 0; b < 8; ++b)
        if (m & (1 << b)) idx[m][j++] = std::uint32_t(b);
      for (; j < 8; ++j) idx[m][j] = 0;
    }
  }
};
inline constexpr CompressTable kCompress{};

/// Flipped keys (key ^ 0x80000000) of 8 scores / keys.
KVSCORE_SELECT_AVX2 inline __m256i kf8_avx2(__m256i u) noexcept {
  const __m256i sign = _mm256_set1_epi32(std::int32_t(0x80000000u));
  const __m256i neg = _mm256_srai_epi32(u, 31);
  const __m256i nk = _mm256_xor_si256(_mm256_sub_epi32(_mm256_setzero_si256(), u), sign);  // (0 - u) ^ sign
  const __m256i k = _mm256_blendv_epi8(u, nk, neg);  // non-negative: key ^ sign == u
  const __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                           _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(k, _mm256_set1_epi32(std::int32_t(kNanKey ^ 0x80000000u)), isnan);
}
KVSCORE_SELECT_AVX2 inline __m256i kf8_avx2(const float* p) noexcept {
  return kf8_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
KVSCORE_SELECT_AVX2 inline __m256i kf8_avx2(const std::uint32_t* p) noexcept {
  return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                          _mm256_set1_epi32(std::int32_t(0x80000000u)));
}
KVSCORE_SELECT_AVX2 inline unsigned mask8_avx2(__m256i v) noexcept {
  return unsigned(_mm256_movemask_ps(_mm256_castsi256_ps(v)));
}
KVSCORE_SELECT_AVX2 inline __m256i compress8_avx2(__m256i v, unsigned m) noexcept {
  return _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(kCompress.idx[m])));
}

template <class Src>
KVSCORE_SELECT_AVX2 void hist_top_avx2(const Src* x, std::int64_t n, std::uint32_t* hist) noexcept {
  alignas(64) std::uint32_t sub[3][kTopBins];
  std::memset(sub, 0, sizeof sub);
  alignas(32) std::uint32_t idx[32];
  const __m256i sign = _mm256_set1_epi32(std::int32_t(0x80000000u));
  std::int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int q = 0; q < 4; ++q)
      _mm256_store_si256(reinterpret_cast<__m256i*>(idx + 8 * q),
                         _mm256_srli_epi32(_mm256_xor_si256(kf8_avx2(x + i + 8 * q), sign), kTopShift));
    for (int r = 0; r < 32; r += 4) {
      ++hist[idx[r]];
      ++sub[0][idx[r + 1]];
      ++sub[1][idx[r + 2]];
      ++sub[2][idx[r + 3]];
    }
  }
  for (; i < n; ++i) ++hist[load_key(x, i) >> kTopShift];
  for (int b = 0; b < kTopBins; ++b) hist[b] += sub[0][b] + sub[1][b] + sub[2][b];
}

template <class Src>
KVSCORE_SELECT_AVX2 std::int64_t window_avx2(const Src* x, std::int64_t n, std::uint32_t lo, std::uint32_t hi,
                                             std::uint32_t* out, std::int64_t* above) noexcept {
  const __m256i sign = _mm256_set1_epi32(std::int32_t(0x80000000u));
  const __m256i hif = _mm256_set1_epi32(std::int32_t(hi ^ 0x80000000u));
  const __m256i lo8 = _mm256_set1_epi32(std::int32_t(lo));
  const __m256i spanf = _mm256_set1_epi32(std::int32_t((hi - lo) ^ 0x80000000u));
  std::int64_t j = 0, i = 0, a = 0;
  for (; i + 8 <= n; i += 8) {  // j <= i: a full 8-key store stays inside out[0, n)
    const __m256i kf = kf8_avx2(x + i);
    a += __builtin_popcount(mask8_avx2(_mm256_cmpgt_epi32(kf, hif)));
    const __m256i k = _mm256_xor_si256(kf, sign);
    const __m256i off = _mm256_xor_si256(_mm256_sub_epi32(k, lo8), sign);  // (k - lo) flipped
    const unsigned m = ~mask8_avx2(_mm256_cmpgt_epi32(off, spanf)) & 0xFFu;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), compress8_avx2(k, m));
    j += __builtin_popcount(m);
  }
  for (; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    if (k - lo <= hi - lo) out[j++] = k;
    a += k > hi;
  }
  *above += a;
  return j;
}

template <class Src>
KVSCORE_SELECT_AVX2 std::int64_t collect_avx2(const Src* x, std::int64_t n, Threshold th, std::int64_t base,
                                              std::int64_t* out, std::int64_t limit) noexcept {
  if (n > std::int64_t(0x7FFFFFF0)) return collect_portable(x, n, th, base, out, limit);
  const __m256i Kf = _mm256_set1_epi32(std::int32_t(th.key ^ 0x80000000u));
  const __m256i vbase = _mm256_set1_epi64x(base);
  const __m256i step = _mm256_set1_epi32(8);
  __m256i pos = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  std::int64_t j = 0, i = 0, seen = 0;
  const std::int64_t need = th.need_eq;
  for (; i + 8 <= n && j + 8 <= limit; i += 8) {
    const __m256i kf = kf8_avx2(x + i);
    unsigned m = mask8_avx2(_mm256_cmpgt_epi32(kf, Kf));
    if (seen < need) {
      unsigned eq = mask8_avx2(_mm256_cmpeq_epi32(kf, Kf));
      const std::int64_t c = __builtin_popcount(eq);
      if (seen + c > need) eq = _pdep_u32((1u << (need - seen)) - 1u, eq);
      seen += c;
      m |= eq;
    }
    const __m256i sel = compress8_avx2(pos, m);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j),
                        _mm256_add_epi64(vbase, _mm256_cvtepu32_epi64(_mm256_castsi256_si128(sel))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j + 4),
                        _mm256_add_epi64(vbase, _mm256_cvtepu32_epi64(_mm256_extracti128_si256(sel, 1))));
    j += __builtin_popcount(m);
    pos = _mm256_add_epi32(pos, step);
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
KVSCORE_SELECT_AVX2 void count_avx2(const Src* x, std::int64_t n, std::uint32_t K, std::int64_t* gt,
                                    std::int64_t* eq) noexcept {
  const __m256i Kf = _mm256_set1_epi32(std::int32_t(K ^ 0x80000000u));
  std::int64_t g = 0, e = 0, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i kf = kf8_avx2(x + i);
    g += __builtin_popcount(mask8_avx2(_mm256_cmpgt_epi32(kf, Kf)));
    e += __builtin_popcount(mask8_avx2(_mm256_cmpeq_epi32(kf, Kf)));
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
KVSCORE_SELECT_AVX2 void tally_avx2_d(const Src* x, std::int64_t n, const std::uint32_t* v, Tally* out) noexcept {
  const std::uint32_t hi = v[0], lo = v[D - 1];
  const __m256i sign = _mm256_set1_epi32(std::int32_t(0x80000000u));
  const __m256i hif = _mm256_set1_epi32(std::int32_t(hi ^ 0x80000000u)), lo8 = _mm256_set1_epi32(std::int32_t(lo));
  const __m256i spanf = _mm256_set1_epi32(std::int32_t((hi - lo) ^ 0x80000000u));
  __m256i w[D];
  for (int q = 0; q < D; ++q) w[q] = _mm256_set1_epi32(std::int32_t(v[q] ^ 0x80000000u));
  std::int64_t a = 0, in = 0, e[D] = {}, i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i kf = kf8_avx2(x + i);
    a += __builtin_popcount(mask8_avx2(_mm256_cmpgt_epi32(kf, hif)));
    if constexpr (D > 1) {
      const __m256i off = _mm256_xor_si256(_mm256_sub_epi32(_mm256_xor_si256(kf, sign), lo8), sign);
      in += 8 - __builtin_popcount(mask8_avx2(_mm256_cmpgt_epi32(off, spanf)));
    }
    for (int q = 0; q < D; ++q) e[q] += __builtin_popcount(mask8_avx2(_mm256_cmpeq_epi32(kf, w[q])));
  }
  for (; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    a += k > hi;
    in += k - lo <= hi - lo;
    for (int q = 0; q < D; ++q) e[q] += k == v[q];
  }
  if constexpr (D == 1) in = e[0];
  out->above += a;
  out->inside += in;
  for (int q = 0; q < D; ++q) out->eq[q] += e[q];
}

template <class Src>
KVSCORE_SELECT_AVX2 void tally_avx2(const Src* x, std::int64_t n, const std::uint32_t* v, int d, Tally* out) noexcept {
  switch (d) {
    case 1: return tally_avx2_d<1>(x, n, v, out);
    case 2: return tally_avx2_d<2>(x, n, v, out);
    case 3: return tally_avx2_d<3>(x, n, v, out);
    default: return tally_avx2_d<4>(x, n, v, out);
  }
}

KVSCORE_SELECT_AVX2 inline void minmax_avx2(const std::uint32_t* k, std::int64_t n, std::uint32_t* lo,
                                            std::uint32_t* hi) noexcept {
  __m256i a = _mm256_set1_epi32(std::int32_t(k[0])), b = a;
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i));
    a = _mm256_min_epu32(a, v);
    b = _mm256_max_epu32(b, v);
  }
  alignas(32) std::uint32_t la[8], lb[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(la), a);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lb), b);
  std::uint32_t mn = la[0], mx = lb[0];
  for (int q = 1; q < 8; ++q) {
    mn = std::min(mn, la[q]);
    mx = std::max(mx, lb[q]);
  }
  for (; i < n; ++i) {
    mn = std::min(mn, k[i]);
    mx = std::max(mx, k[i]);
  }
  *lo = mn;
  *hi = mx;
}

KVSCORE_SELECT_AVX2 inline std::int64_t keep_digit_avx2(std::uint32_t* k, std::int64_t n, int dshift,
                                                        std::uint32_t mask, std::uint32_t b) noexcept {
  const __m256i vm = _mm256_set1_epi32(std::int32_t(mask)), vb = _mm256_set1_epi32(std::int32_t(b));
  const __m128i sh = _mm_cvtsi32_si128(dshift);
  std::int64_t j = 0, i = 0;
  for (; i + 8 <= n; i += 8) {  // j <= i; the 8-key store may cover keys not read yet: read first
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + i));
    const unsigned m = mask8_avx2(_mm256_cmpeq_epi32(_mm256_and_si256(_mm256_srl_epi32(v, sh), vm), vb));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(k + j), compress8_avx2(v, m));
    j += __builtin_popcount(m);
  }
  for (; i < n; ++i) {
    const std::uint32_t v = k[i];
    if (((v >> dshift) & mask) == b) k[j++] = v;
  }
  return j;
}


}  // namespace kvscore::detail::sel

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVSCORE_SELECT_X86
