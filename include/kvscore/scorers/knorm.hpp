// kvscore/scorers/knorm.hpp — K-norm (Devoto et al. 2024; qfilters.txt §2.1):
// score = -‖k‖₂, i.e. keep the low-norm keys. One pass over the keys.
#pragma once

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

/// K-norm (Devoto et al. 2024): score = −‖k‖₂, so the low-norm keys are kept. One pass over the keys; no
/// parameters.
struct KNorm : ScorerBase<KNorm> {
  static constexpr const char* name = "knorm";  ///< the registry's CLI spelling
  static constexpr int passes = 1;  ///< reads of the keys per score() (benchmarks count bytes with it)

  /// ScorerBase's step for head h: out[t] = −‖k_t‖₂, or kInvalidScore for a non-finite key.
  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out) const {
    using T = typename View::value_type;
    keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
      table.ops<T>().sqnorm(first, n, stride, keys.head_dim(), out + t0);
    });
    for (std::int64_t t = 0; t < keys.tokens(); ++t)
      out[t] = detail::finite(out[t]) ? -std::sqrt(out[t]) : kInvalidScore;
  }
};

}  // namespace kvscore
