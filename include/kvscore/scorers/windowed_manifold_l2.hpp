// kvscore/scorers/windowed_manifold_l2.hpp — WindowedManifoldKV (manifoldkv.txt Alg. 2):
// ‖k − μ_w‖₂ with μ_w the centroid of k's window of W tokens (default 4096, the
// paper's best); selection stays global. Fights centroid dilution at 64K+ tokens.
//
// Short tail (our choice, the paper is silent): the windows are [0,W), [W,2W), ...;
// a final partial window shorter than W/2 is merged into the window before it. A
// 3-token window would sit at distance ~0 from its own centroid and be evicted
// wholesale; merged, its tokens are judged against W+ neighbours like every other
// token. A tail of at least W/2 tokens has enough samples for its own centroid
// (the paper needs ~20-50 at intrinsic dimension ~9), and stays a window.
#pragma once

#include <string>
#include <utility>

#include "kvscore/scorers/manifold_l2.hpp"

namespace kvscore {

struct WindowedManifoldL2 : ScorerBase<WindowedManifoldL2> {
  static constexpr const char* name = "windowed-l2";
  static constexpr int passes = 2;
  std::int64_t window = 4096;

  explicit WindowedManifoldL2(std::int64_t w = 4096) : window(w) {
    if (w <= 0)
      detail::throw_invalid("kvscore::WindowedManifoldL2: window must be > 0 (got " + std::to_string(w) + ")");
  }

  /// Window boundaries [begin, end) for a cache of n tokens (see the tail rule above).
  std::vector<std::pair<std::int64_t, std::int64_t>> windows(std::int64_t n) const {
    std::vector<std::pair<std::int64_t, std::int64_t>> w;
    const std::int64_t full = n / window, tail = n % window;
    for (std::int64_t k = 0; k < full; ++k) w.emplace_back(k * window, (k + 1) * window);
    if (tail > 0) {
      if (full >= 1 && 2 * tail < window) w.back().second = n;
      else w.emplace_back(full * window, n);
    }
    return w;
  }

  template <class View>
  void check(const View&) const {
    if (window <= 0)
      detail::throw_invalid("kvscore::WindowedManifoldL2: window must be > 0 (got " + std::to_string(window) + ")");
  }

  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out) const {
    for (const auto& [b, e] : windows(keys.tokens())) detail::centroid_distance(table, keys, h, b, e, out);
  }
};

}  // namespace kvscore
