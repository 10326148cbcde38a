// kvscore/select/radix_portable.hpp — the selector's keys, thresholds and portable passes
// (internal; the API is kvscore/select.hpp, the search over these passes select/radix.hpp).
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
// The portable passes are the reference: the AVX2 and AVX-512 ones (radix_avx2.hpp,
// radix_avx512.hpp) compute the same integers, checked position by position
// (tests/test_select.cpp, every ISA).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVSCORE_SELECT_X86 1  // the AVX2 and AVX-512 passes compile here (target attributes)
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

}  // namespace kvscore::detail::sel
