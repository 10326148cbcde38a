// kvscore/scorers/knorm.hpp — K-norm (Devoto et al. 2024; qfilters.txt §2.1):
// score = -‖k‖₂, i.e. keep the low-norm keys. One pass over the keys.
#pragma once

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

struct KNorm : ScorerBase<KNorm> {
  static constexpr const char* name = "knorm";
  static constexpr int passes = 1;  ///< reads of the keys per score() (benchmarks count bytes with it)

  template <class T>
  void score_head(const simd::KernelTable& table, const KeysView<T>& keys, std::int64_t h, float* out) const {
    table.ops<T>().sqnorm(keys.head(h), keys.tokens(), keys.token_stride(), keys.head_dim(), out);
    for (std::int64_t t = 0; t < keys.tokens(); ++t)
      out[t] = detail::finite(out[t]) ? -std::sqrt(out[t]) : kInvalidScore;
  }
};

}  // namespace kvscore
