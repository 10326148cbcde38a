// kvscore/block_sparse/probe.hpp — the probe (BlockSparseOptions::probe): a decorator of the row
// chooser that, after the row's choice (scored or kept), also chooses with the exact score (max
// q·k over the block's keys, every query head) and counts how many of those blocks the choice
// holds: the recall of the exact block choice, for benchmarks. It changes no choice.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvscore/block_sparse/chooser.hpp"
#include "kvscore/block_sparse/score_exact.hpp"

namespace kvscore::detail {

/// The probe's scorer and totals (blocks the exact score chose beyond the protected ones, how
/// many of them the choice held), over every row and layer since construction.
struct BlockChoiceProbe {
  ExactScorer exact;
  std::int64_t chosen = 0, held = 0;
};

/// The decorator: `inner` chooses (kept or scored), then the probe counts (per row of the call,
/// into counts[row]: (k, held)). One per key source, whatever the scorer.
template <class Keys>
struct Probed {
  using Chooser = FunctionRef<void(const RowTask&, BlockChoiceScratch&)>;
  Chooser inner;
  const ExactScorer& exact;
  const LayerCall<Keys>& call;
  std::pair<std::int64_t, std::int64_t>* counts;

  void operator()(const RowTask& t, BlockChoiceScratch& w) const {
    inner(t, w);
    if (t.k <= 0) return;
    candidates(t.pb, w.cand);
    score_row(exact, nullptr, call, t, t.row.query, call.q_heads, w);
    choose_top(call.q_heads, t.k, call.scale, w, w.exact_chosen);
    std::int64_t hit = 0;
    for (const std::int64_t b : w.exact_chosen) hit += std::binary_search(w.chosen.begin(), w.chosen.end(), b);
    counts[t.index] = {t.k, hit};
  }
};

}  // namespace kvscore::detail
