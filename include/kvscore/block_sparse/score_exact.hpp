// kvscore/block_sparse/score_exact.hpp — max_t q·k_t over the block's keys: what the bounds
// approximate. It reads every key, so it is the ceiling of the others' recall (and the probe's
// reference choice, probe.hpp), not a fast path. No summary.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kvscore/block_sparse/scorer.hpp"

namespace kvscore::detail {

/// max_t q·k_t over n keys (fp32 sums in dimension order); `acc` has n floats of scratch.
template <BlockKeyTile Tile>
float exact_tile_score(const float* q, const Tile& x, std::int64_t n, std::int64_t d, float* acc) noexcept {
  std::fill(acc, acc + n, 0.f);
  for (std::int64_t j = 0; j < d; ++j) {
    const float qj = q[j];
    for (std::int64_t t = 0; t < n; ++t) acc[t] += qj * x.at(t, j);
  }
  return *std::max_element(acc, acc + n);
}

class ExactScorer : public StatelessBlockScorer {
 public:
  static constexpr BlockScore kind = BlockScore::exact;
  static constexpr bool kSummaries = false;  ///< reads a SummaryStore
  ExactScorer(const BlockSparseOptions&, std::int64_t /*layers*/, std::int64_t head_dim, std::int64_t block_size)
      : d_(head_dim), bs_(block_size) {}
  template <BlockKeyTile Tile>
  void summarize(const Tile&, float*, std::uint8_t*) const {}  // never called: no summary
  template <class Keys>
  void score(const BlockScoreJob& job, const BlockReader<Keys>& rd, BlockChoiceScratch& w) const {
    w.acc.resize(std::size_t(bs_));
    score_each(job, w, [&](std::int64_t c, std::int64_t h, const float* q) {
      return exact_tile_score(q, rd.tile(c, h), bs_, d_, w.acc.data());
    });
  }

 private:
  std::int64_t d_, bs_;
};

}  // namespace kvscore::detail
