// kvscore/scorers/manifold_l2.hpp — ManifoldKV (manifoldkv.txt Alg. 1):
// score = ‖k − μ‖₂ with μ the mean of the head's (valid) raw keys. Two passes:
// the row sum (fused with the per-row validity check), then the distances.
#pragma once

#include <vector>

#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {

namespace detail {

/// ManifoldL2 on rows [0, n) of one head: out[i] = ‖row_i − mean(valid rows)‖, -inf if invalid.
template <class T>
void centroid_distance(const simd::KernelTable& table, const T* base, std::int64_t n, std::int64_t stride,
                       std::int64_t d, float* out) {
  const simd::RowOps<T>& ops = table.ops<T>();
  std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
  std::vector<float> mu(static_cast<std::size_t>(d));
  const std::int64_t valid = ops.sum(base, n, stride, d, acc.data(), out);  // out <- ‖k‖² (validity)
  if (valid == 0) {
    for (std::int64_t i = 0; i < n; ++i) out[i] = kInvalidScore;
    return;
  }
  for (std::int64_t j = 0; j < d; ++j) mu[std::size_t(j)] = float(acc[std::size_t(j)] / double(valid));
  float tmp[kChunkTokens];
  for (std::int64_t i0 = 0; i0 < n; i0 += kChunkTokens) {
    const std::int64_t m = std::min(kChunkTokens, n - i0);
    ops.sqdist(base + i0 * stride, m, stride, d, mu.data(), tmp);
    for (std::int64_t i = 0; i < m; ++i)
      out[i0 + i] = finite(out[i0 + i]) ? std::sqrt(tmp[i]) : kInvalidScore;
  }
}

}  // namespace detail

struct ManifoldL2 : ScorerBase<ManifoldL2> {
  static constexpr const char* name = "l2";
  static constexpr int passes = 2;

  template <class T>
  void score_head(const simd::KernelTable& table, const KeysView<T>& keys, std::int64_t h, float* out) const {
    detail::centroid_distance(table, keys.head(h), keys.tokens(), keys.token_stride(), keys.head_dim(), out);
  }
};

}  // namespace kvscore
