// kvscore/scorers/keydiff.hpp — KeyDiff (Park et al. 2025), kvpress's formula
// (manifoldkv.txt App. B.2): score = −cos(k, ā), ā = mean_i(k_i/‖k_i‖).
// Zero keys: cos is taken as 0 (score 0) and they add nothing to ā; if ā = 0
// every valid key scores 0. Two passes: norms + normalised sum, then dots; keys with
// ‖k‖ < 2⁻⁶³ (subnormal fp32 squared norm) are done in fp64. Scores lie in [−1, 1].
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

/// KeyDiff (Park et al. 2025): score = −cos(k, ā), ā the mean of the head's normalised keys; scores in [−1, 1]. Two
/// passes; no parameters.
struct KeyDiff : ScorerBase<KeyDiff> {
  static constexpr const char* name = "keydiff";  ///< the registry's CLI spelling
  static constexpr int passes = 2;  ///< reads of the keys per score() (benchmarks count bytes with it)

  /// ScorerBase's step for head h (the two passes, fp64 sums).
  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out) const {
    using T = typename View::value_type;
    const simd::RowOps<T>& ops = table.ops<T>();
    const std::int64_t d = keys.head_dim();
    std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
    std::vector<float> anchor(static_cast<std::size_t>(d));
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      ops.sum_normalized(first, n, stride, d, acc.data(), out + t0);  // out <- ‖k‖
    });
    // Tiny keys, ‖k‖ < 2⁻⁶³: their fp32 squared norm is subnormal (a few bits left: ‖k‖ = 1.4e-22
    // came out 1 % off) or 0 although the key is not zero. Redo them in fp64: swap the kernel's
    // k/‖k‖ in ā for the exact one, and mark them for an fp64 cosine below. Rare, so cheap.
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      for (std::int64_t i = 0; i < n; ++i) {
        float& o = out[t0 + i];
        if (!detail::finite(o) || o >= kTinyNorm) continue;
        const T* r = first + i * stride;
        double s = 0;
        for (std::int64_t j = 0; j < d; ++j) s += double(to_float(r[j])) * double(to_float(r[j]));
        if (s == 0) continue;  // a zero key: score 0, nothing in ā
        const double w = 1.0 / std::sqrt(s) - (o > 0.f ? 1.0 / double(o) : 0.0);
        for (std::int64_t j = 0; j < d; ++j) acc[std::size_t(j)] += double(to_float(r[j])) * w;
        o = kTinyMark;
      }
    });
    double anorm2 = 0.0;
    for (std::int64_t j = 0; j < d; ++j) anorm2 += acc[std::size_t(j)] * acc[std::size_t(j)];
    const double anorm = std::sqrt(anorm2);
    if (!(anorm > 0.0)) {
      for (std::int64_t t = 0; t < keys.tokens(); ++t) out[t] = detail::finite(out[t]) ? 0.f : kInvalidScore;
      return;
    }
    // Unit anchor: the scale of ā does not change cos, and a unit vector keeps the dots in range.
    for (std::int64_t j = 0; j < d; ++j) anchor[std::size_t(j)] = float(acc[std::size_t(j)] / anorm);
    float dots[detail::kChunkTokens];
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      for (std::int64_t i0 = 0; i0 < n; i0 += detail::kChunkTokens) {
        const std::int64_t m = std::min(detail::kChunkTokens, n - i0);
        ops.dot(first + i0 * stride, m, stride, d, anchor.data(), dots);
        float* o = out + t0 + i0;
        for (std::int64_t i = 0; i < m; ++i) {
          if (!detail::finite(o[i])) {
            o[i] = kInvalidScore;
          } else if (o[i] == kTinyMark) {
            const T* r = first + (i0 + i) * stride;
            double dt = 0, s = 0;
            for (std::int64_t j = 0; j < d; ++j) {
              const double x = double(to_float(r[j]));
              dt += x * acc[std::size_t(j)];
              s += x * x;
            }
            o[i] = float(std::clamp(-dt / (std::sqrt(s) * anorm), -1.0, 1.0));
          } else {
            // fp32 rounding can put |cos| a few ulps above 1.
            o[i] = o[i] > 0.f ? std::clamp(-dots[i] / o[i], -1.f, 1.f) : 0.f;
          }
        }
      }
    });
  }

 private:
  static constexpr float kTinyNorm = 0x1p-63f;  // ‖k‖² < FLT_MIN (subnormal)
  static constexpr float kTinyMark = -1.f;      // a norm is never negative
};

}  // namespace kvscore
