// kvscore/block_sparse/reference.hpp — block_sparse_reference: the blocks one decode step attends,
// from a sequence's keys and query alone (no state): the selector's own scorer and chooser over
// the sequence's keys as a one-off pool whose block b is logical block b, nothing kept, nothing
// written. What PagedBlockSelector chooses from a paged cache with its summaries, indexes and
// threads when it scores the row (tests compare the two on keys read back from an engine's cache).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "kvscore/block_sparse/chooser.hpp"
#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/scorers.hpp"

namespace kvscore {

/// `keys` is [kv_heads][tokens][head_dim] fp32 (C order), `query` [q_heads][head_dim]; returns
/// `attend` logical blocks, ascending.
inline std::vector<std::int64_t> block_sparse_reference(const float* keys, std::int64_t kv_heads, std::int64_t tokens,
                                                        std::int64_t head_dim, std::int64_t block_size,
                                                        const float* query, std::int64_t q_heads, std::int64_t attend,
                                                        const BlockSparseOptions& opt = {}) {
  const std::string who = "kvscore::block_sparse_reference";
  detail::check_block_sparse(opt, who.c_str());
  if (kv_heads < 1 || q_heads < kv_heads || q_heads % kv_heads != 0)
    detail::throw_invalid(who + ": q_heads " + std::to_string(q_heads) + " must be a positive multiple of kv_heads " +
                          std::to_string(kv_heads));
  if (head_dim < 1 || head_dim > kMaxHeadDim || block_size < 1 || tokens < 1 || keys == nullptr)
    detail::throw_invalid(who + ": needs keys, tokens >= 1, head_dim in [1, 4096] and block_size >= 1");
  detail::check_query(query, q_heads * head_dim, who);
  const detail::ProtectedBlocks pb = detail::protected_blocks_of(tokens, block_size, opt);
  if (attend < pb.count() || attend > pb.blocks)
    detail::throw_invalid(who + ": attend " + std::to_string(attend) + " blocks out of range [" +
                          std::to_string(pb.count()) + ", " + std::to_string(pb.blocks) + "]");
  BlockSparseOptions o = opt;  // one scoring, serial, nothing kept
  o.refresh = 1;
  o.probe = false;
  o.num_threads = 1;
  const DenseBlockKeys src{keys, kv_heads, tokens, head_dim, block_size};
  std::vector<std::int32_t> table(std::size_t(pb.blocks));
  std::iota(table.begin(), table.end(), 0);
  const BlockSparseRow row{table, tokens, query, attend, nullptr};
  const detail::BlockWrites writes(pb.blocks, block_size);
  RefreshPolicy refresh(o, 1);
  detail::AnyBlockScorer any = detail::make_block_scorer(o, 1, head_dim, block_size);
  detail::BlockChoiceScratch w;
  detail::visit_scorer(any, [&](auto& scorer) {
    scorer.prepare(0, 0);
    detail::SummaryStore store(1, pb.blocks, kv_heads, scorer.summary_floats(), scorer.code_bytes());
    const detail::RowTask t{0, row, pb, attend - pb.count(), false, 1};
    if (!store.empty() && t.k > 0) {
      std::vector<std::int64_t> todo;
      for (std::int64_t b = 0; b < pb.blocks; ++b)
        if (!pb.contains(b) && store.claim(0, b, writes)) todo.push_back(b);
      store.make(0, src, todo, 1, [&](const auto& tile, float* s, std::uint8_t* c) { scorer.summarize(tile, s, c); });
    }
    const float scale = o.scale > 0 ? o.scale : 1.f / std::sqrt(float(head_dim));
    const detail::LayerCall<DenseBlockKeys> call{src, 0, q_heads, kv_heads, head_dim, block_size, scale, writes};
    detail::ScoredChooser<std::decay_t<decltype(scorer)>>{scorer, store, refresh, o.group}(call, t, w);
  });
  std::vector<std::int64_t> out;
  for (std::int64_t b = 0; b < pb.blocks; ++b)
    if (pb.contains(b) || std::binary_search(w.chosen.begin(), w.chosen.end(), b)) out.push_back(b);
  return out;
}

}  // namespace kvscore
