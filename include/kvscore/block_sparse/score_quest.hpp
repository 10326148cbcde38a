// kvscore/block_sparse/score_quest.hpp — Quest's bound (Tang et al., 2024, per KV head and block):
// Σ_j max(q_j·min_j, q_j·max_j) over the block's per-dimension key min and max, an upper bound
// of max_t q·k_t. Summary: [min | max], 2·head_dim floats.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvscore/block_sparse/scorer.hpp"

namespace kvscore::detail {

/// Per dimension j < d, the min (a) and max (b) of n keys.
template <BlockKeyTile Tile>
void quest_summary(const Tile& x, std::int64_t n, std::int64_t d, float* a, float* b) {
  for (std::int64_t j = 0; j < d; ++j) {
    float mn = x.at(0, j), mx = mn;
    for (std::int64_t t = 1; t < n; ++t) {
      const float e = x.at(t, j);
      mn = std::min(mn, e);
      mx = std::max(mx, e);
    }
    a[j] = mn;
    b[j] = mx;
  }
}

/// Quest's bound of a query over a summary (dimension order).
inline float quest_bound(const float* q, const float* a, const float* b, std::int64_t d) noexcept {
  float s = 0.f;
  for (std::int64_t j = 0; j < d; ++j) s += std::max(q[j] * a[j], q[j] * b[j]);
  return s;
}

class QuestScorer : public StatelessBlockScorer {
 public:
  static constexpr BlockScore kind = BlockScore::quest;
  static constexpr bool kSummaries = true;  ///< reads a SummaryStore
  QuestScorer(const BlockSparseOptions&, std::int64_t /*layers*/, std::int64_t head_dim, std::int64_t block_size)
      : d_(head_dim), bs_(block_size) {}
  std::int64_t summary_floats() const noexcept { return 2 * d_; }
  template <BlockKeyTile Tile>
  void summarize(const Tile& x, float* s, std::uint8_t*) const {
    quest_summary(x, bs_, d_, s, s + d_);
  }
  template <class Keys>
  void score(const BlockScoreJob& job, const BlockReader<Keys>& rd, BlockChoiceScratch& w) const {
    score_each(job, w, [&](std::int64_t c, std::int64_t h, const float* q) {
      const float* a = rd.summary(c, h);
      return quest_bound(q, a, a + d_, d_);
    });
  }

 private:
  std::int64_t d_, bs_;
};

}  // namespace kvscore::detail
