// kvscore/scorers/manifold_l2.hpp — ManifoldKV (manifoldkv.txt Alg. 1):
// score = ‖k − μ‖₂ with μ the mean of the head's (valid) raw keys. Two passes:
// the row sum (fused with the per-row validity check), then the distances.
#pragma once

#include <vector>

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

namespace detail {

/// ManifoldL2 on tokens [b, e) of head h: out[t] = ‖k_t − mean(valid k in [b, e))‖, −inf if invalid.
/// `out` points at token 0 of the head.
template <class View>
void centroid_distance(const simd::KernelTable& table, const View& keys, std::int64_t h, std::int64_t b,
                       std::int64_t e, float* out) {
  using T = typename View::value_type;
  const simd::RowOps<T>& ops = table.ops<T>();
  const std::int64_t d = keys.head_dim();
  std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
  std::vector<float> mu(static_cast<std::size_t>(d));
  std::int64_t valid = 0;
  for_each_run_in(keys, h, b, e, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
    valid += ops.sum(first, n, stride, d, acc.data(), out + t0);  // out <- ‖k‖² (validity)
  });
  if (valid == 0) {
    for (std::int64_t t = b; t < e; ++t) out[t] = kInvalidScore;
    return;
  }
  for (std::int64_t j = 0; j < d; ++j) mu[std::size_t(j)] = float(acc[std::size_t(j)] / double(valid));
  float tmp[kChunkTokens];
  for_each_run_in(keys, h, b, e, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
    for (std::int64_t i0 = 0; i0 < n; i0 += kChunkTokens) {
      const std::int64_t m = std::min(kChunkTokens, n - i0);
      ops.sqdist(first + i0 * stride, m, stride, d, mu.data(), tmp);
      float* o = out + t0 + i0;
      for (std::int64_t i = 0; i < m; ++i) o[i] = finite(o[i]) ? std::sqrt(tmp[i]) : kInvalidScore;
    }
  });
}

}  // namespace detail

/// ManifoldKV: score = ‖k − μ‖₂, μ the head's key centroid (keys far from it are kept). Two passes; no parameters.
struct ManifoldL2 : ScorerBase<ManifoldL2> {
  static constexpr const char* name = "l2";  ///< the registry's CLI spelling
  static constexpr int passes = 2;  ///< reads of the keys per score() (benchmarks count bytes with it)

  /// ScorerBase's step for head h: the centroid, then each key's distance to it.
  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out) const {
    detail::centroid_distance(table, keys, h, 0, keys.tokens(), out);
  }
};

}  // namespace kvscore
