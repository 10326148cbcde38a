// kvscore/simd/radix.hpp — the kernels behind kvscore::select (internal; the API is in
// kvscore/select.hpp).
//
// Keys. Every fp32 score x maps to an order-preserving uint32 key:
//   key(x) = bits(x) | 0x80000000   sign bit clear (sign bit flipped)
//   key(x) = 2^32 - bits(x)         sign bit set (= all bits flipped, plus one, so that
//                                   -0.0 gets the key of +0.0: the two zeros are one value)
//   key(x) = 1                      every NaN, any sign or payload: below key(-inf) = 0x00800000
// Integer operations only (no FTZ/DAZ effects). Real scores give keys in [1, 0xFF800000];
// 0 and 0xFFFFFFFF never come from a score (the AdaKV step uses 0xFFFFFFFF to mark tokens
// that are kept no matter what).
//
// Thresholds. A selection of m out of a range is described by a Threshold {key K, need_eq e}:
// an element is selected iff key > K, or key == K and it is among the first e elements
// (in position order) whose key equals K. That is exactly "higher score first; equal scores,
// lower position first" and it lets one sequential pass emit the kept positions in
// ascending order without any sort.
//
// Finding K (find_threshold):
//  1. ranges >= kSampleMinTokens: a strided sample guesses a key window around the m-th
//     largest key; one pass counts the keys above it and copies the keys inside it. If the
//     m-th largest is inside (checked exactly), step 2 runs on that small buffer only. When
//     the sample shows at most kMaxTally distinct values there, a counting pass per value
//     settles it without a copy (few distinct scores, constant heads).
//  2. radix select on the key bits, digits of at most 11 bits from the top: the bucket of
//     the top digit holding the m-th largest key is copied into a scratch buffer (skipped
//     when step 1 already gave the buffer) and the lower digits are resolved on it, shrinking
//     it at every level. A bucket taken whole, or a buffer whose keys are all equal, ends the
//     search early. O(N) time, O(N) scratch per thread.
//
// Three implementations of the passes: portable C++, AVX2 (+BMI2) and AVX-512 (F/BW/VL/DQ
// +BMI2), chosen at run time from CPUID (SelectKernels). They compute the same integers, so
// the selected positions are identical on every path.
//
// Why this file is long (about 1050 lines, over the ~500 the tree aims for), and the one
// deliberate repetition in include/: the AVX2 and AVX-512 passes (count, tally, emit,
// bucket copy) have the same loop shape with different intrinsics: 8 vs 16 lanes, AVX2's
// signed compares on sign-flipped keys vs AVX-512's unsigned mask compares, movemask vs
// k-registers. They are written out per ISA rather than over an xsimd batch because
// xsimd has no mask-register compress/popcount for these, and GCC will not inline an
// ISA-generic template into a target-attributed caller reliably; both copies are checked
// against the portable one position by position (tests/test_select.cpp, every ISA).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvscore/core/cpu.hpp"
#include "kvscore/simd/dispatch.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVSCORE_SELECT_X86 1
#include <immintrin.h>
#else
#define KVSCORE_SELECT_X86 0
#endif

namespace kvscore::detail::sel {

inline constexpr std::uint32_t kNanKey = 1u;
inline constexpr std::uint32_t kForcedKey = 0xFFFFFFFFu;  ///< above every score's key

/// The order-preserving key of one score (see the top of the file). Integer operations
/// only, so flush-to-zero / denormals-are-zero modes cannot change it.
inline std::uint32_t key_of(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return kNanKey;
  return (u >> 31) != 0 ? 0u - u : u | 0x80000000u;
}

/// Selected iff key > key, or key == key and among the first need_eq such elements.
struct Threshold {
  std::uint32_t key = kForcedKey;
  std::int64_t need_eq = 0;
};
inline constexpr Threshold kSelectNone{kForcedKey, 0};
inline constexpr Threshold kSelectAll{0u, 0};

inline constexpr int kTopBits = 11;                 // digit 1: key bits 31..21
inline constexpr int kTopShift = 32 - kTopBits;     // 21
inline constexpr int kTopBins = 1 << kTopBits;      // 2048

// ---------------------------------------------------------------------------------------
// Passes over a full range. `Src` is float (keys computed on the fly) or std::uint32_t
// (keys already computed, the AdaKV global step).

template <class Src>
inline std::uint32_t load_key(const Src* p, std::int64_t i) noexcept {
  if constexpr (std::is_same_v<Src, float>) return key_of(p[i]);
  else return p[i];
}

/// hist[key >> 21] += 1 for every element (hist has kTopBins entries, not cleared here).
template <class Src>
void hist_top_portable(const Src* x, std::int64_t n, std::uint32_t* hist) noexcept {
  constexpr std::int64_t kBlock = 256;
  alignas(64) std::uint32_t idx[kBlock];
  alignas(64) std::uint32_t sub[3][kTopBins];  // hist + 3 more: runs of one value don't serialise
  std::memset(sub, 0, sizeof sub);
  for (std::int64_t i0 = 0; i0 < n; i0 += kBlock) {
    const std::int64_t len = std::min(kBlock, n - i0);
    for (std::int64_t i = 0; i < len; ++i) idx[i] = load_key(x, i0 + i) >> kTopShift;
    std::int64_t i = 0;
    for (; i + 4 <= len; i += 4) {
      ++hist[idx[i]];
      ++sub[0][idx[i + 1]];
      ++sub[1][idx[i + 2]];
      ++sub[2][idx[i + 3]];
    }
    for (; i < len; ++i) ++hist[idx[i]];
  }
  for (int b = 0; b < kTopBins; ++b) hist[b] += sub[0][b] + sub[1][b] + sub[2][b];
}

/// Copies the keys in [lo, hi] to out (in position order) and adds the number of keys
/// above hi to *above; returns how many were copied. out has room for n keys.
template <class Src>
std::int64_t window_portable(const Src* x, std::int64_t n, std::uint32_t lo, std::uint32_t hi, std::uint32_t* out,
                             std::int64_t* above) noexcept {
  std::int64_t j = 0, a = 0;
  const std::uint32_t span = hi - lo;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    out[j] = k;
    j += (k - lo) <= span;
    a += k > hi;
  }
  *above += a;
  return j;
}

/// Writes base + i for every selected i (Threshold rule), ascending; stops after `limit`
/// positions (the caller knows the count, so out needs exactly that capacity).
template <class Src>
std::int64_t collect_portable(const Src* x, std::int64_t n, Threshold th, std::int64_t base, std::int64_t* out,
                              std::int64_t limit) noexcept {
  std::int64_t j = 0, i = 0;
  const std::uint32_t K = th.key;
  if (th.need_eq > 0) {
    std::int64_t seen = 0;
    for (; i < n && seen < th.need_eq; ++i) {
      if (j == limit) return j;
      const std::uint32_t k = load_key(x, i);
      const bool eq = k == K;
      out[j] = base + i;
      j += (k > K) | eq;  // seen < need_eq here, so an equal key is taken
      seen += eq;
    }
  }
  for (; i < n; ++i) {
    if (j == limit) return j;
    const std::uint32_t k = load_key(x, i);
    out[j] = base + i;
    j += k > K;
  }
  return j;
}

/// Counts keys > K and keys == K.
template <class Src>
void count_portable(const Src* x, std::int64_t n, std::uint32_t K, std::int64_t* gt, std::int64_t* eq) noexcept {
  std::int64_t g = 0, e = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    g += k > K;
    e += k == K;
  }
  *gt += g;
  *eq += e;
}

/// Up to kMaxTally distinct values v[0] > v[1] > ... > v[d-1]: counts keys above v[0],
/// keys equal to each v[i], and keys inside [v[d-1], v[0]].
inline constexpr int kMaxTally = 4;
struct Tally {
  std::int64_t above = 0, inside = 0;
  std::int64_t eq[kMaxTally] = {0, 0, 0, 0};
};

template <class Src>
void tally_portable(const Src* x, std::int64_t n, const std::uint32_t* v, int d, Tally* out) noexcept {
  const std::uint32_t hi = v[0], lo = v[d - 1], span = hi - lo;
  std::uint32_t w[kMaxTally];
  for (int q = 0; q < kMaxTally; ++q) w[q] = v[q < d ? q : d - 1];
  std::int64_t a = 0, in = 0, e0 = 0, e1 = 0, e2 = 0, e3 = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t k = load_key(x, i);
    a += k > hi;
    in += (k - lo) <= span;
    e0 += k == w[0];
    e1 += k == w[1];
    e2 += k == w[2];
    e3 += k == w[3];
  }
  out->above += a;
  out->inside += in;
  const std::int64_t e[kMaxTally] = {e0, e1, e2, e3};
  for (int q = 0; q < d; ++q) out->eq[q] += e[q];
}

// ---------------------------------------------------------------------------------------
// Candidate-buffer operations (keys only).

inline void minmax_portable(const std::uint32_t* k, std::int64_t n, std::uint32_t* lo, std::uint32_t* hi) noexcept {
  std::uint32_t a = k[0], b = k[0];
  for (std::int64_t i = 1; i < n; ++i) {
    a = std::min(a, k[i]);
    b = std::max(b, k[i]);
  }
  *lo = a;
  *hi = b;
}

/// Keeps (in place, in order) the keys whose digit (key >> dshift) & mask equals b; returns how many.
inline std::int64_t keep_digit_portable(std::uint32_t* k, std::int64_t n, int dshift, std::uint32_t mask,
                                        std::uint32_t b) noexcept {
  std::int64_t j = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::uint32_t v = k[i];
    k[j] = v;
    j += ((v >> dshift) & mask) == b;
  }
  return j;
}

// ---------------------------------------------------------------------------------------
// AdaKV helpers.

/// z[i] = kForcedKey for the elements selected by th (the safeguard), else the key of
/// x[i], or of its z-score float((double(x) - mean) * inv_std) when `normalize` (non-finite
/// x keep their own key).
inline void fill_portable(const float* x, std::int64_t n, Threshold th, bool normalize, double mean, double inv_std,
                          std::uint32_t* z) noexcept {
  std::int64_t seen = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const std::uint32_t k = key_of(v);
    bool forced = k > th.key;
    if (k == th.key) forced = seen++ < th.need_eq;
    std::uint32_t out = k;
    if (normalize && std::isfinite(v)) out = key_of(float((double(v) - mean) * inv_std));
    z[i] = forced ? kForcedKey : out;
  }
}

/// Keeps a double product rounded on its own (no FMA contraction): the sums stay the
/// documented ones on every compiler and flag set.
inline double no_fma(double v) noexcept {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
  __asm__("" : "+x"(v));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(v));
#endif
  return v;
}

/// Eight interleaved double sums over the finite x[i] (lane i % 8) of x[i] (pass 1) or
/// (x[i] - mean)^2 (pass 2); *count gets the number of finite values (pass 1).
inline void lane_sums_portable(const float* x, std::int64_t n, bool squares, double mean, double* lanes,
                               std::int64_t* count) noexcept {
  std::int64_t c = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(x[i])) continue;
    const double d = squares ? no_fma((double(x[i]) - mean) * (double(x[i]) - mean)) : double(x[i]);
    lanes[i & 7] += d;
    ++c;
  }
  *count = c;
}

#if KVSCORE_SELECT_X86
// GCC 12 reports the _mm512_undefined_*() inside its own intrinsics as "may be used
// uninitialized" once they are inlined at -O2; the values are never read.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
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

// ---------------------------------------------------------------------------------------
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

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif  // KVSCORE_SELECT_X86

/// The passes over a full range, for one source type, on one instruction set.
template <class Src>
struct Passes {
  void (*minmax)(const std::uint32_t*, std::int64_t, std::uint32_t*, std::uint32_t*) noexcept;
  std::int64_t (*keep_digit)(std::uint32_t*, std::int64_t, int, std::uint32_t, std::uint32_t) noexcept;
  void (*fill)(const float*, std::int64_t, Threshold, bool, double, double, std::uint32_t*) noexcept;
  void (*lane_sums)(const float*, std::int64_t, bool, double, double*, std::int64_t*) noexcept;
  void (*hist_top)(const Src*, std::int64_t, std::uint32_t*) noexcept;
  std::int64_t (*window)(const Src*, std::int64_t, std::uint32_t, std::uint32_t, std::uint32_t*, std::int64_t*) noexcept;
  std::int64_t (*collect)(const Src*, std::int64_t, Threshold, std::int64_t, std::int64_t*, std::int64_t) noexcept;
  void (*count)(const Src*, std::int64_t, std::uint32_t, std::int64_t*, std::int64_t*) noexcept;
  void (*tally)(const Src*, std::int64_t, const std::uint32_t*, int, Tally*) noexcept;
  const char* name;
};

inline bool avx512_usable() noexcept {
#if KVSCORE_SELECT_X86
  const CpuFeatures& f = cpu();
  return f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.bmi2 && f.popcnt;
#else
  return false;
#endif
}

inline bool avx2_usable() noexcept {
#if KVSCORE_SELECT_X86
  const CpuFeatures& f = cpu();
  return f.avx2 && f.bmi2 && f.popcnt;
#else
  return false;
#endif
}

}  // namespace kvscore::detail::sel

namespace kvscore {

/// Kernel set of kvscore::select (SelectOptions::kernels). `best` picks AVX-512, then AVX2,
/// then portable C++ from CPUID, no wider than a KVSCORE_ISA pin; the others force one set (for tests and comparisons) and
/// throw std::invalid_argument when this CPU cannot run it. Every set gives the same result.
enum class SelectKernels { best, avx512, avx2, portable };

namespace detail::sel {
/// The selector's set for an ISA level: the widest set this CPU has at or below it.
inline SelectKernels select_kernels_for(IsaLevel level) noexcept {
  if (level >= IsaLevel::avx512 && avx512_usable()) return SelectKernels::avx512;
  if (level >= IsaLevel::avx2 && avx2_usable()) return SelectKernels::avx2;
  return SelectKernels::portable;
}
/// What SelectKernels::best runs: the set of the pinned level (KVSCORE_ISA /
/// simd::set_active_isa, simd::isa_cap), like every kernel family.
inline SelectKernels best_select_kernels() { return select_kernels_for(simd::isa_cap()); }
}  // namespace detail::sel

/// Whether this CPU (and build) can run `k`.
inline bool select_kernels_supported(SelectKernels k) noexcept {
  switch (k) {
    case SelectKernels::avx512: return detail::sel::avx512_usable();
    case SelectKernels::avx2: return detail::sel::avx2_usable();
    default: return true;
  }
}

/// Name of the set `best` resolves to on this CPU ("avx512", "avx2" or "portable").
inline const char* select_kernels_name(SelectKernels k = SelectKernels::best) {
  if (k == SelectKernels::best) k = detail::sel::best_select_kernels();
  return k == SelectKernels::avx512 ? "avx512" : k == SelectKernels::avx2 ? "avx2" : "portable";
}

}  // namespace kvscore

namespace kvscore::detail::sel {

/// The passes for kernel set `k` (already checked with select_kernels_supported).
template <class Src>
const Passes<Src>& passes(SelectKernels k) {
  static const Passes<Src> portable{&minmax_portable, &keep_digit_portable, &fill_portable, &lane_sums_portable,
                                    &hist_top_portable<Src>, &window_portable<Src>, &collect_portable<Src>,
                                    &count_portable<Src>, &tally_portable<Src>, "portable"};
#if KVSCORE_SELECT_X86
  static const Passes<Src> avx512{&minmax_avx512, &keep_digit_avx512, &fill_avx512, &lane_sums_avx512,
                                  &hist_top_avx512<Src>, &window_avx512<Src>, &collect_avx512<Src>,
                                  &count_avx512<Src>, &tally_avx512<Src>, "avx512"};
  static const Passes<Src> avx2{&minmax_avx2, &keep_digit_avx2, &fill_portable, &lane_sums_portable,
                                &hist_top_avx2<Src>, &window_avx2<Src>, &collect_avx2<Src>,
                                &count_avx2<Src>, &tally_avx2<Src>, "avx2"};
  if (k == SelectKernels::best) k = best_select_kernels();
  if (k == SelectKernels::avx512) return avx512;
  if (k == SelectKernels::avx2) return avx2;
#endif
  (void)k;
  return portable;
}

// ---------------------------------------------------------------------------------------
// Resolving the threshold inside the candidate buffer.

/// Threshold for the m-th largest of keys[0..n) (1 <= m <= n), knowing that the keys agree
/// on every bit at or above bit `shift` (shift = 32: nothing known). Radix select with
/// digits of at most 11 bits from the top; the buffer is compacted in place at every level.
template <class Src>
Threshold resolve_in_buffer(const Passes<Src>& P, std::uint32_t* keys, std::int64_t n, std::int64_t m,
                            int shift) noexcept {
  std::uint32_t hist[kTopBins];
  while (true) {
    // All remaining keys equal: done (few distinct values, constant heads).
    std::uint32_t lo, hi;
    P.minmax(keys, n, &lo, &hi);
    if (lo == hi) return {lo, m};
    shift = std::min(shift, 32 - std::countl_zero(lo ^ hi));  // skip bits they all share
    // Small buffers: a direct selection is cheaper than another histogram.
    if (n <= 64) {
      std::nth_element(keys, keys + (m - 1), keys + n, [](std::uint32_t a, std::uint32_t b) { return a > b; });
      const std::uint32_t K = keys[m - 1];
      std::int64_t gt = 0;
      for (std::int64_t i = 0; i < n; ++i) gt += keys[i] > K;
      return {K, m - gt};
    }
    const int bits = std::min(shift, kTopBits);
    const int dshift = shift - bits;
    const std::uint32_t mask = (1u << bits) - 1u;
    const int bins = 1 << bits;
    std::memset(hist, 0, sizeof(std::uint32_t) * std::size_t(bins));
    for (std::int64_t i = 0; i < n; ++i) ++hist[(keys[i] >> dshift) & mask];
    std::int64_t above = 0;
    int b = bins - 1;
    for (; b > 0; --b) {
      if (above + hist[b] >= m) break;
      above += hist[b];
    }
    const std::int64_t mb = m - above, cb = hist[b];
    const std::uint32_t high = shift >= 32 ? 0u : (keys[0] >> shift) << shift;  // shared bits
    const std::uint32_t bucket_lo = high | (std::uint32_t(b) << dshift);
    if (dshift == 0) return {bucket_lo, mb};                     // full key resolved
    if (cb == mb && bucket_lo != 0) return {bucket_lo - 1u, 0};  // bucket taken whole
    n = P.keep_digit(keys, n, dshift, mask, std::uint32_t(b));
    m = mb;
    shift = dshift;
  }
}

/// Ranges shorter than this skip the sampled window and go straight to the histogram.
inline constexpr std::int64_t kSampleMinTokens = 16384;
inline constexpr int kMaxSample = 8192;

/// Guesses a key window [lo, hi] that holds the m-th largest key of x[0..n) from a strided
/// sample of S ~ (n/2)^(2/3) keys: the sample's order statistics at the expected rank
/// +- (3 sigma + 4) of the binomial spread. Deterministic (fixed positions). When the
/// sample's keys inside the window take at most kMaxTally distinct values, they are
/// returned in vals[0..*nvals), descending (else *nvals = 0).
/// Sample size for a range of n >= kSampleMinTokens; sample j is at j * (n / S) + (n / S) / 2.
inline int sample_size(std::int64_t n) noexcept {
  const double cb = std::cbrt(double(n) / 2);
  return int(std::clamp(cb * cb, 256.0, double(kMaxSample)));
}

template <class Src>
void sample_window(const Src* x, std::int64_t n, std::int64_t m, std::uint32_t* lo, std::uint32_t* hi,
                   std::uint32_t* vals, int* nvals) noexcept {
  const int S = sample_size(n);
  std::uint32_t smp[kMaxSample];
  const std::int64_t stride = n / S;
  for (int j = 0; j < S; ++j) smp[j] = load_key(x, std::int64_t(j) * stride + stride / 2);
  const double q = double(m) / double(n), r = q * S;
  const double d = 3.0 * std::sqrt(double(S) * q * (1 - q)) + 4;
  const auto r_hi = std::int64_t(std::floor(r - d)), r_lo = std::int64_t(std::ceil(r + d));
  auto desc = [](std::uint32_t a, std::uint32_t b) { return a > b; };
  std::uint32_t* first = smp;
  if (r_hi >= 0) {  // descending rank r_hi (0 = largest)
    std::nth_element(smp, smp + r_hi, smp + S, desc);
    *hi = smp[r_hi];
    first = smp + r_hi;
  } else {
    *hi = kForcedKey;
  }
  std::uint32_t* last = smp + S;
  if (r_lo < S) {
    std::nth_element(first + (r_hi >= 0 ? 1 : 0), smp + r_lo, smp + S, desc);
    *lo = smp[r_lo];
    last = smp + r_lo + 1;
  } else {
    *lo = 0;
  }
  // sample keys of ranks [max(r_hi, 0), min(r_lo, S - 1)]: the window's population
  int nv = 0;
  for (const std::uint32_t* p = first; p != last; ++p) {
    bool known = false;
    for (int t = 0; t < nv; ++t) known |= vals[t] == *p;
    if (known) continue;
    if (nv == kMaxTally) {
      nv = -1;
      break;
    }
    vals[nv++] = *p;
  }
  if (nv > 0) std::sort(vals, vals + nv, desc);
  *nvals = std::max(nv, 0);
}

/// Threshold for keeping the m highest of x[0..n) (0 <= m <= n). `cand` has room for n keys.
///
/// Long ranges first try one pass over a sampled key window: count the keys above it and
/// copy the keys inside it; if the m-th largest lies inside (almost always), the radix select
/// runs on that small buffer only. Otherwise (or for short ranges) the first digit is
/// histogrammed over the whole range and its bucket copied out.
template <class Src>
Threshold find_threshold(const Passes<Src>& P, const Src* x, std::int64_t n, std::int64_t m,
                         std::uint32_t* cand) noexcept {
  if (m <= 0) return kSelectNone;
  if (m >= n) return kSelectAll;
  if (n >= kSampleMinTokens) {
    std::uint32_t lo = 0, hi = kForcedKey, vals[kMaxTally];
    int nv = 0;
    sample_window(x, n, m, &lo, &hi, vals, &nv);
    bool tallied = false;
    if (nv > 0) {  // few distinct values near the threshold: count them, nothing to copy
      Tally t;
      P.tally(x, n, vals, nv, &t);
      std::int64_t sum = 0;
      for (int q = 0; q < nv; ++q) sum += t.eq[q];
      if (sum == t.inside && t.above < m && m <= t.above + t.inside) {  // only those values in between
        std::int64_t cum = t.above;
        for (int q = 0;; ++q) {
          if (cum + t.eq[q] >= m) return {vals[q], m - cum};
          cum += t.eq[q];
        }
      }
      tallied = sum == t.inside;  // (if so, the threshold lies outside the window)
    }
    if (!tallied) {
      std::int64_t above = 0;
      const std::int64_t inside = P.window(x, n, lo, hi, cand, &above);
      if (above < m && m <= above + inside) return resolve_in_buffer(P, cand, inside, m - above, 32);
    }
  }
  alignas(64) std::uint32_t hist[kTopBins];
  std::memset(hist, 0, sizeof hist);
  P.hist_top(x, n, hist);
  std::int64_t above = 0;
  int b = kTopBins - 1;
  for (; b > 0; --b) {
    if (above + hist[b] >= m) break;
    above += hist[b];
  }
  const std::int64_t mb = m - above, cb = hist[b];
  const std::uint32_t lo = std::uint32_t(b) << kTopShift, hi = lo | ((1u << kTopShift) - 1u);
  if (cb == mb && lo != 0) return {lo - 1u, 0};
  std::int64_t ignored = 0;
  const std::int64_t c = P.window(x, n, lo, hi, cand, &ignored);
  return resolve_in_buffer(P, cand, c, mb, kTopShift);
}

}  // namespace kvscore::detail::sel
