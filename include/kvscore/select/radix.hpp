// kvscore/select/radix.hpp — the search behind kvscore::select: the kernel sets and the
// threshold search over their passes (internal; the API is kvscore/select.hpp).
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
// Three sets of passes: portable C++ (radix_portable.hpp, also the keys and thresholds),
// AVX2 (+BMI2, radix_avx2.hpp) and AVX-512 (F/BW/VL/DQ +BMI2, radix_avx512.hpp), chosen at run
// time from CPUID under the ISA pin (SelectKernels). They compute the same integers, so the
// selected positions are identical on every path.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvscore/core/cpu.hpp"
#include "kvscore/select/options.hpp"
#include "kvscore/select/radix_avx2.hpp"
#include "kvscore/select/radix_avx512.hpp"
#include "kvscore/select/radix_portable.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::detail::sel {

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
