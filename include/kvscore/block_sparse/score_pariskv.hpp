// kvscore/block_sparse/score_pariskv.hpp — the best RSQ-IP estimate among the block's tokens that
// ParisKV's index retrieves for q (pariskv.hpp); blocks with no retrieved token score −inf. One
// index per (layer, sequence, KV head) over the keys of the sequence's full blocks, kept across
// steps: rebuilt when a block it holds was written since (or the sequence's table no longer
// starts with its blocks), extended by the blocks filled since. The indexes encode raw keys (no
// centring), so an index grown block by block equals one built at once (block_sparse_reference
// builds one at once). No summary.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "kvscore/block_sparse/scorer.hpp"
#include "kvscore/pariskv/pariskv.hpp"

namespace kvscore::detail {

/// The per-sequence ParisKV indexes encode raw keys (no centring): each key's code is then its
/// own, so an index grown block by block equals one built at once (block_sparse_reference).
inline ParisKVConfig block_sparse_pariskv_config() {
  ParisKVConfig c;
  c.center = false;
  return c;
}

/// ParisKV's scores of the candidates: per query head, a search of `index_of(jq)` for k tokens;
/// a block's score is the best estimate among its retrieved tokens (−inf: none retrieved).
template <class IndexOf>
void pariskv_scores(const float* query, std::int64_t q_heads, std::int64_t d, std::int64_t bs, std::int64_t blocks,
                    std::int64_t k, IndexOf&& index_of, BlockChoiceScratch& w) {
  const std::int64_t C = std::int64_t(w.cand.size());
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  w.score.assign(std::size_t(q_heads * C), ninf);
  if (k <= 0) return;
  for (std::int64_t jq = 0; jq < q_heads; ++jq) {
    const ParisKV& index = index_of(jq);
    ParisKVSearch so;
    so.k = std::min(k, index.size());
    const ParisKVResult res = index.search(query + jq * d, so);
    w.agg.assign(std::size_t(blocks), ninf);
    for (std::size_t i = 0; i < res.positions.size(); ++i) {
      float& a = w.agg[std::size_t(res.positions[i] / bs)];
      a = std::max(a, res.scores[i]);
    }
    for (std::int64_t c = 0; c < C; ++c) w.score[std::size_t(jq * C + c)] = w.agg[std::size_t(w.cand[std::size_t(c)])];
  }
}

class ParisKVScorer {
 public:
  static constexpr BlockScore kind = BlockScore::pariskv;
  static constexpr bool kSummaries = false;  ///< reads a SummaryStore
  ParisKVScorer(const BlockSparseOptions&, std::int64_t layers, std::int64_t head_dim, std::int64_t block_size)
      : d_(head_dim), bs_(block_size), seqs_(layers) {}
  std::int64_t summary_floats() const noexcept { return 0; }
  std::int64_t code_bytes() const noexcept { return 0; }
  template <BlockKeyTile Tile>
  void summarize(const Tile&, float*, std::uint8_t*) const {}  // never called: no summary
  void begin_step(const LiveSequences& live) { seqs_.keep_only(live); }
  void prepare(std::int64_t layer, std::int64_t first) { seqs_.ensure(layer, first); }
  /// Indexes held: one per (layer, sequence).
  std::int64_t indexes() const noexcept { return seqs_.size(); }

  template <class Keys>
  void score(const BlockScoreJob& job, const BlockReader<Keys>& rd, BlockChoiceScratch& w) const {
    const SeqIndex& s = grown(job, rd.keys);
    const std::int64_t G = job.q / job.kv_heads;
    pariskv_scores(job.query, job.q, d_, bs_, blocks_for(job.tokens, bs_), job.k * bs_,
                   [&](std::int64_t jq) -> const ParisKV& { return s.heads[std::size_t(jq / G)]; }, w);
  }

 private:
  struct SeqIndex {
    std::vector<std::int64_t> ids;  // blocks indexed, in logical order
    std::int64_t built = 0;         // step of the last build or append
    std::vector<ParisKV> heads;
  };

  /// The row's indexes over the keys of its full blocks, rebuilt or extended as needed (one
  /// append per head: the first one, the prompt's blocks, is the index built at once).
  template <class Keys>
  const SeqIndex& grown(const BlockScoreJob& job, const Keys& keys) const {
    SeqIndex& s = seqs_.at(job.layer, job.seq);
    const std::int64_t full = job.tokens / bs_;
    bool stale = std::int64_t(s.ids.size()) > full || s.heads.empty();
    for (std::size_t b = 0; b < s.ids.size() && !stale; ++b)
      stale = s.ids[b] != job.table[b] || (job.writes != nullptr && job.writes->written(s.ids[b]) > s.built);
    if (stale) {
      s.ids.clear();
      s.heads.assign(std::size_t(job.kv_heads), ParisKV(d_, block_sparse_pariskv_config()));
    }
    const std::int64_t have = std::int64_t(s.ids.size());
    if (full > have) {
      std::vector<float> rows(std::size_t((full - have) * bs_ * d_));
      for (std::int64_t h = 0; h < job.kv_heads; ++h) {
        for (std::int64_t b = have; b < full; ++b) {
          const auto x = keys.tile(h, std::int64_t(job.table[std::size_t(b)]));
          float* dst = rows.data() + (b - have) * bs_ * d_;
          for (std::int64_t t = 0; t < bs_; ++t)
            for (std::int64_t j = 0; j < d_; ++j) dst[t * d_ + j] = x.at(t, j);
        }
        s.heads[std::size_t(h)].append(rows.data(), (full - have) * bs_, d_);
      }
      for (std::int64_t b = have; b < full; ++b) s.ids.push_back(job.table[std::size_t(b)]);
    }
    s.built = job.writes != nullptr ? job.writes->step() : 0;
    return s;
  }

  std::int64_t d_, bs_;
  SequenceStates<SeqIndex> seqs_;
};

}  // namespace kvscore::detail
