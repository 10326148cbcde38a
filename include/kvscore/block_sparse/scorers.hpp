// kvscore/block_sparse/scorers.hpp — the five block scorers as one value: AnyBlockScorer holds the
// one BlockSparseOptions::score names, made once (make_block_scorer) and visited once per call
// (visit_scorer): the selector and the reference never branch on BlockScore themselves. Also
// summarize_tile / summary_score, the score-named entry points the tests check formulas with.
#pragma once

#include <cstdint>
#include <variant>

#include "kvscore/block_sparse/score_exact.hpp"
#include "kvscore/block_sparse/score_int4.hpp"
#include "kvscore/block_sparse/score_meanstd.hpp"
#include "kvscore/block_sparse/score_pariskv.hpp"
#include "kvscore/block_sparse/score_quest.hpp"

namespace kvscore::detail {

using AnyBlockScorer = std::variant<QuestScorer, MeanStdScorer, Int4Scorer, ParisKVScorer, ExactScorer>;

/// The scorer of o.score, for `layers` layers of head_dim-dimensional keys in blocks of block_size.
inline AnyBlockScorer make_block_scorer(const BlockSparseOptions& o, std::int64_t layers, std::int64_t head_dim,
                                        std::int64_t block_size) {
  switch (o.score) {
    case BlockScore::quest: return QuestScorer(o, layers, head_dim, block_size);
    case BlockScore::meanstd: return MeanStdScorer(o, layers, head_dim, block_size);
    case BlockScore::int4: return Int4Scorer(o, layers, head_dim, block_size);
    case BlockScore::pariskv: return ParisKVScorer(o, layers, head_dim, block_size);
    case BlockScore::exact: break;
  }
  return ExactScorer(o, layers, head_dim, block_size);
}

template <class F>
decltype(auto) visit_scorer(AnyBlockScorer& s, F&& f) {
  return std::visit(std::forward<F>(f), s);
}
template <class F>
decltype(auto) visit_scorer(const AnyBlockScorer& s, F&& f) {
  return std::visit(std::forward<F>(f), s);
}

/// The summary of n keys: quest (min, max), meanstd (mean, standard deviation) or int4 (min,
/// step, and `codes`: int4_code_bytes; `hi`, when given, the max) per dimension.
template <BlockKeyTile Tile>
void summarize_tile(BlockScore how, const Tile& x, std::int64_t n, std::int64_t d, float* a, float* b,
                    std::uint8_t* codes = nullptr, float* hi = nullptr) {
  if (how == BlockScore::int4) return int4_summary(x, n, d, a, b, codes, hi);
  if (how == BlockScore::quest) return quest_summary(x, n, d, a, b);
  meanstd_summary(x, n, d, a, b);
}

/// A query's score of a quest or meanstd summary (z: meanstd's z_n).
inline float summary_score(BlockScore how, const float* q, const float* a, const float* b, std::int64_t d,
                           float z) noexcept {
  return how == BlockScore::quest ? quest_bound(q, a, b, d) : meanstd_score(q, a, b, d, z);
}

}  // namespace kvscore::detail
