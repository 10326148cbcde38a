// kvscore/block_sparse/scorer.hpp — what a block scorer is (one per BlockScore: score_quest.hpp,
// score_meanstd.hpp, score_int4.hpp, score_pariskv.hpp, score_exact.hpp). The selector and the
// stateless reference both call the same scorer:
//
//   kSummaries                       it reads summaries (a SummaryStore) rather than the keys
//   summary_floats(), code_bytes()   its summary format per (block, KV head) (0: none)
//   summarize(tile, floats, codes)   a block's summary from its key tile (summary scorers)
//   score(job, reader, w)            w.score [job.q][C] for the candidates w.cand, reading
//                                    summaries / tiles through `reader` (candidate c, KV head h)
//   begin_step(live), prepare(layer, first), indexes()
//                                    per-(layer, sequence) state (ParisKV's indexes); no-ops for
//                                    the stateless scorers
//
// score() runs on the row's thread (rows are distinct sequences); `job.threads` > 1 means the
// row has the threads to itself (fewer rows score than there are threads).
#pragma once

#include <cstdint>
#include <span>
#include <utility>

#include "kvscore/block_sparse/choice.hpp"
#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/state.hpp"
#include "kvscore/block_sparse/summary_store.hpp"

namespace kvscore::detail {

/// One row's scoring: the queries that score, the shapes, how many blocks are left to choose,
/// and the row's sequence (its table: logical block -> the key source's block).
struct BlockScoreJob {
  const float* query = nullptr;  ///< [q][head_dim] (the row's query, or its groups' means)
  std::int64_t q = 0;            ///< scoring queries: q_heads, or kv_heads under QueryGroup::mean
  std::int64_t kv_heads = 0, head_dim = 0, block_size = 0;
  std::int64_t k = 0;            ///< blocks to choose beyond the protected ones (> 0)
  std::int64_t layer = 0;
  std::span<const std::int32_t> table;  ///< the row's blocks, logical order
  std::int64_t tokens = 0;              ///< the sequence's length
  std::int64_t seq = 0;                 ///< the sequence's key (row_sequence)
  const BlockWrites* writes = nullptr;  ///< the write log (null: nothing was written, a one-off choice)
  int threads = 1;
};

/// Candidate c's summaries and keys: reader.ids[c] is its block in the key source and the store.
template <class Keys>
struct BlockReader {
  const Keys& keys;
  const float* sums = nullptr;         ///< the layer's summaries (null: none)
  const std::uint8_t* codes = nullptr;  ///< the layer's codes (null: none)
  std::int64_t kv_heads = 0, floats = 0, code_bytes = 0;
  const std::int64_t* ids = nullptr;

  auto tile(std::int64_t c, std::int64_t h) const noexcept { return keys.tile(h, ids[c]); }
  const float* summary(std::int64_t c, std::int64_t h) const noexcept { return sums + (ids[c] * kv_heads + h) * floats; }
  const std::uint8_t* code(std::int64_t c, std::int64_t h) const noexcept {
    return codes + (ids[c] * kv_heads + h) * code_bytes;
  }
};

/// w.score [job.q][C] = f(c, h, q) for candidate c, KV head h and each of h's scoring queries q
/// (a pointer to its head_dim floats): the loop of the scorers that score one (block, query) at a time.
template <class F>
void score_each(const BlockScoreJob& job, BlockChoiceScratch& w, F&& f) {
  const std::int64_t C = std::int64_t(w.cand.size()), G = job.q / job.kv_heads, d = job.head_dim;
  w.score.assign(std::size_t(job.q * C), 0.f);
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t h = 0; h < job.kv_heads; ++h)
      for (std::int64_t jq = h * G; jq < (h + 1) * G; ++jq) w.score[std::size_t(jq * C + c)] = f(c, h, job.query + jq * d);
}

/// A non-owning reference to a callable: the selector's row loop is compiled once, not once per
/// scorer and key source (the call per row costs nothing next to a row's choice).
template <class Sig>
class FunctionRef;
template <class R, class... A>
class FunctionRef<R(A...)> {
 public:
  template <class F>
  FunctionRef(const F& f) noexcept  // NOLINT: implicit, as a function parameter
      : obj_(&f), call_([](const void* o, A... a) -> R { return (*static_cast<const F*>(o))(std::forward<A>(a)...); }) {}
  R operator()(A... a) const { return call_(obj_, std::forward<A>(a)...); }

 private:
  const void* obj_;
  R (*call_)(const void*, A...);
};

/// The no-ops of a scorer that keeps no state between calls.
struct StatelessBlockScorer {
  void begin_step(const LiveSequences&) noexcept {}
  void prepare(std::int64_t, std::int64_t) noexcept {}
  std::int64_t indexes() const noexcept { return 0; }
  std::int64_t summary_floats() const noexcept { return 0; }
  std::int64_t code_bytes() const noexcept { return 0; }
};

}  // namespace kvscore::detail
