// kvscore/scorers/keydiff.hpp — KeyDiff (Park et al. 2025), kvpress's formula
// (manifoldkv.txt App. B.2): score = −cos(k, ā), ā = mean_i(k_i/‖k_i‖).
// Zero keys: cos is taken as 0 (score 0) and they add nothing to ā; if ā = 0
// every valid key scores 0. Two passes: norms + normalised sum, then dots.
#pragma once

#include <vector>

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

struct KeyDiff : ScorerBase<KeyDiff> {
  static constexpr const char* name = "keydiff";
  static constexpr int passes = 2;

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
        for (std::int64_t i = 0; i < m; ++i) o[i] = !detail::finite(o[i]) ? kInvalidScore : (o[i] > 0.f ? -dots[i] / o[i] : 0.f);
      }
    });
  }
};

}  // namespace kvscore
