// kvscore/block_sparse/chooser.hpp — one row's choice in one layer, the same code for the selector
// and the reference: a kept choice carried (refresh), or the row's candidates scored by the
// scorer and the top k taken. A chooser leaves the row's chosen logical blocks (beyond the
// protected ones, ascending) in w.chosen; probe.hpp's Probed wraps one.
#pragma once

#include <cstdint>

#include "kvscore/block_sparse/choice.hpp"
#include "kvscore/block_sparse/refresh.hpp"
#include "kvscore/block_sparse/scorer.hpp"
#include "kvscore/block_sparse/summary_store.hpp"

namespace kvscore::detail {

/// What every row of one layer's call reads.
template <class Keys>
struct LayerCall {
  const Keys& keys;
  std::int64_t layer = 0, q_heads = 0, kv_heads = 0, head_dim = 0, block_size = 0;
  float scale = 0.f;  ///< the softmax scale of choose_top
  const BlockWrites& writes;
};

/// One row of the call.
struct RowTask {
  std::size_t index = 0;  ///< in the call's rows
  const BlockSparseRow& row;
  ProtectedBlocks pb;
  std::int64_t k = 0;   ///< blocks to choose beyond the protected ones
  bool stands = false;  ///< its kept choice stands (RefreshPolicy::stands)
  int threads = 1;      ///< threads the row may use (> 1: it has them to itself)

  template <class Keys>
  RefreshRow refresh_row(const LayerCall<Keys>& c) const {
    return {row, c.layer, c.q_heads, c.head_dim, c.writes.step(), pb};
  }
};

/// w.score [q][C] of the row's candidates w.cand by `scorer`, for the queries `query` [q][head_dim].
template <class Scorer, class Keys>
void score_row(const Scorer& scorer, const SummaryStore* store, const LayerCall<Keys>& call, const RowTask& t,
               const float* query, std::int64_t q, BlockChoiceScratch& w) {
  const std::size_t C = w.cand.size();
  w.ids.resize(C);
  for (std::size_t c = 0; c < C; ++c) w.ids[c] = t.row.table[std::size_t(w.cand[c])];
  const bool sums = store != nullptr && !store->empty();
  const BlockReader<Keys> rd{call.keys,  sums ? store->sums(call.layer) : nullptr, sums ? store->codes(call.layer) : nullptr,
                             call.kv_heads, sums ? store->floats() : 0, sums ? store->code_bytes() : 0, w.ids.data()};
  BlockScoreJob job;
  job.query = query;
  job.q = q;
  job.kv_heads = call.kv_heads;
  job.head_dim = call.head_dim;
  job.block_size = call.block_size;
  job.k = t.k;
  job.layer = call.layer;
  job.table = t.row.table;
  job.tokens = t.row.tokens;
  job.seq = row_sequence(t.row);
  job.writes = &call.writes;
  job.threads = t.threads;
  scorer.score(job, rd, w);
}

/// The chooser: the kept choice when it stands, else the scorer's top k (and the choice kept).
template <class Scorer>
struct ScoredChooser {
  const Scorer& scorer;
  const SummaryStore& store;
  RefreshPolicy& refresh;
  QueryGroup group = QueryGroup::heads;

  template <class Keys>
  void operator()(const LayerCall<Keys>& call, const RowTask& t, BlockChoiceScratch& w) const {
    const RefreshRow rr = t.refresh_row(call);
    if (t.stands) {
      refresh.carry(rr, t.k, w.chosen);
      if (t.row.fresh) *t.row.fresh = 0;
      return;
    }
    if (t.row.fresh) *t.row.fresh = 1;
    w.chosen.clear();
    candidates(t.pb, w.cand);
    if (t.k > 0) {
      std::int64_t q = call.q_heads;
      const float* query = scoring_queries(t.row.query, call.q_heads, call.kv_heads, call.head_dim, group, w.meanq, q);
      score_row(scorer, &store, call, t, query, q, w);
      choose_top(q, t.k, call.scale, w, w.chosen);
    }
    refresh.record(rr, w.chosen);
  }
};

}  // namespace kvscore::detail
