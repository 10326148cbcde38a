// kvscore/block_sparse/choice.hpp — from block scores to a row's choice, the same for every
// score: the candidates (the blocks that are not protected), the queries that score them
// (QueryGroup), each query head's softmax over the candidates summed over the heads, the top k
// (ties: the lower logical block), and the attended table written in ascending logical order.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "kvscore/block_sparse/options.hpp"

namespace kvscore::detail {

/// Scratch of one row's choice (one per thread; reused across rows).
struct BlockChoiceScratch {
  std::vector<float> score, agg, acc, meanq;
  std::vector<std::int64_t> cand, ids, order, chosen, exact_chosen;
};

/// The candidates of a row: every logical block that is not protected.
inline void candidates(const ProtectedBlocks& pb, std::vector<std::int64_t>& cand) {
  cand.clear();
  for (std::int64_t b = 0; b < pb.blocks; ++b)
    if (!pb.contains(b)) cand.push_back(b);
}

/// From w.score [q_heads][C]: each query head's softmax over the candidates' scores times
/// `scale` (its estimated share of attention per block), summed over the heads; then the k
/// candidates with the largest sums (ties: the lower logical block), ascending, into `out`.
inline void choose_top(std::int64_t q_heads, std::int64_t k, float scale, BlockChoiceScratch& w,
                       std::vector<std::int64_t>& out) {
  const std::int64_t C = std::int64_t(w.cand.size());
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  w.agg.assign(std::size_t(C), 0.f);
  w.acc.resize(std::size_t(C));
  for (std::int64_t jq = 0; jq < q_heads; ++jq) {
    const float* s = w.score.data() + jq * C;
    float best = ninf;
    for (std::int64_t c = 0; c < C; ++c) best = std::max(best, s[c]);
    if (best == ninf) continue;  // this head scored no candidate (pariskv retrieved none)
    double z = 0;
    for (std::int64_t c = 0; c < C; ++c) {
      w.acc[std::size_t(c)] = std::exp(scale * (s[c] - best));  // exp(−inf) = 0
      z += double(w.acc[std::size_t(c)]);
    }
    for (std::int64_t c = 0; c < C; ++c) w.agg[std::size_t(c)] += float(double(w.acc[std::size_t(c)]) / z);
  }
  w.order.resize(std::size_t(C));
  for (std::int64_t c = 0; c < C; ++c) w.order[std::size_t(c)] = c;
  auto better = [&](std::int64_t x, std::int64_t y) {
    const float a = w.agg[std::size_t(x)], b = w.agg[std::size_t(y)];
    return a > b || (a == b && x < y);
  };
  std::nth_element(w.order.begin(), w.order.begin() + k, w.order.end(), better);
  out.clear();
  for (std::int64_t i = 0; i < k; ++i) out.push_back(w.cand[std::size_t(w.order[std::size_t(i)])]);
  std::sort(out.begin(), out.end());
}

/// Writes the attended blocks' physical ids (sinks, chosen, local; ascending logical order).
template <class Id>
void write_choice(const ProtectedBlocks& pb, const std::vector<std::int64_t>& chosen, std::span<const Id> table,
                  std::int32_t* out) {
  std::int64_t o = 0;
  for (std::int64_t b = 0; b < std::min(pb.sink_end, pb.local_begin); ++b) out[o++] = std::int32_t(table[std::size_t(b)]);
  for (const std::int64_t b : chosen) out[o++] = std::int32_t(table[std::size_t(b)]);
  for (std::int64_t b = pb.local_begin; b < pb.blocks; ++b) out[o++] = std::int32_t(table[std::size_t(b)]);
}

/// The queries that score: `query` itself ([q_heads][d]) or, for QueryGroup::mean, each KV
/// head's mean query into `buf` ([kv_heads][d], in head order); returns the pointer, sets `n`.
inline const float* scoring_queries(const float* query, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t d,
                                    QueryGroup group, std::vector<float>& buf, std::int64_t& n) {
  if (group == QueryGroup::heads) {
    n = q_heads;
    return query;
  }
  const std::int64_t G = q_heads / kv_heads;
  buf.assign(static_cast<std::size_t>(kv_heads * d), 0.f);
  for (std::int64_t h = 0; h < kv_heads; ++h)
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t j = 0; j < d; ++j) buf[std::size_t(h * d + j)] += query[(h * G + g) * d + j];
  for (float& x : buf) x /= float(G);
  n = kv_heads;
  return buf.data();
}

}  // namespace kvscore::detail
