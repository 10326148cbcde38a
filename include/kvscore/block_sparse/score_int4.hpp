// kvscore/block_sparse/score_int4.hpp — max_t q·k̂_t over the block's keys quantised to 4 bits per
// coordinate within Quest's per-dimension range (k̂_tj = min_j + step_j·c_tj, step_j = (max_j −
// min_j)/15, c_tj rounded to nearest-even): the exact score on keys read at 1/8 of their fp32
// bytes, summed in integers (q_j·step_j rounded to 16 bits per block: the same result on every
// ISA). Only the blocks among some query head's best `prefilter`·k by Quest's bound (from the same
// min and max) are scored this way (k: the blocks still to choose), the others of that KV head not
// at all. The per-block work is the kernel table's (int4_summarize, int4_quest, int4_block: vector
// code, a KV head's queries at once). Summary: [min | max | step], 3·head_dim floats, and
// int4_code_bytes of codes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "kvscore/block_sparse/scorer.hpp"
#include "kvscore/core/parallel.hpp"
#include "kvscore/pariskv/attention.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore::detail {

/// Bytes of int4 codes per (block, KV head): [⌈head_dim/2⌉][h = ⌈block_size/2⌉][2], two tokens
/// a byte: byte (j/2)·2h + 2t + j%2 holds dimension j's code of token t < h in its low nibble and
/// of token h + t in its high one (a pair of dimensions' bytes widen to the (c_tj, c_t,j+1) int16
/// pairs that (v)pmaddwd multiplies by (w_j, w_j+1): simd/table.hpp's int4_dots).
inline std::int64_t int4_code_bytes(std::int64_t head_dim, std::int64_t block_size) noexcept {
  return (head_dim + 1) / 2 * 2 * ((block_size + 1) / 2);
}

/// Per dimension j < d of n keys: min (mn), step and max (hi), and the 4-bit codes, on the kernel
/// table (int4_summarize); over the keys in place when they are fp32 with contiguous tokens.
template <BlockKeyTile Tile>
void int4_summary(const Tile& x, std::int64_t n, std::int64_t d, float* mn, float* step, std::uint8_t* codes,
                  float* hi) {
  std::vector<float> top;
  if (hi == nullptr) top.resize(static_cast<std::size_t>(d)), hi = top.data();
  if constexpr (std::is_same_v<Tile, KeyTile<float>>) {
    if (x.ts == 1) return simd::active_table().int4_summarize(x.p, x.js, n, d, mn, step, hi, codes);
  }
  std::vector<float> rows(static_cast<std::size_t>(n * d));  // [d][n] fp32
  for (std::int64_t j = 0; j < d; ++j)
    for (std::int64_t t = 0; t < n; ++t) rows[std::size_t(j * n + t)] = x.at(t, j);
  simd::active_table().int4_summarize(rows.data(), n, n, d, mn, step, hi, codes);
}

/// Asks for the cache lines of [p, p + bytes) ahead of their use (a hint: no effect on results).
inline void prefetch(const void* p, std::int64_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  for (std::int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
#else
  (void)p, (void)bytes;
#endif
}

/// max_t q·k̂_t over n int4-coded keys (min, step, codes of int4_summary) for each of `g`
/// queries (out[g]): q·min in fp32 (16 lanes, then ParisKV's lane tree: a fixed order, not the
/// dimension order), plus s·max_t Σ_j w_j·c_tj where w_j = q_j·step_j / s rounded to
/// nearest-even 16-bit integers (s = max_j |q_j·step_j| / 32767) and the sums are exact int32
/// (the table's int4_block): the result does not depend on the ISA or the compiler's
/// vectorisation. `w` holds g·d int16 and `acc` g·2·⌈n/2⌉ int32 of scratch.
inline void int4_tile_scores(const float* const* q, std::int64_t g, const float* mn, const float* step,
                             const std::uint8_t* codes, std::int64_t n, std::int64_t d, float* out,
                             std::int16_t* w, std::int32_t* acc) noexcept {
  std::int32_t best[1];
  float scale[1], lanes[16];
  for (std::int64_t k = 0; k < g; ++k) {
    simd::active_table().int4_block(q[k], 1, d, mn, step, codes, n, w, acc, best, scale, lanes);
    out[k] = pariskv::detail::tree16(lanes) + scale[0] * float(best[0]);
  }
}

/// int4 scores of the candidates w.cand for every query head (w.score [q_heads][C]), with Quest's
/// prefilter: each query head ranks the candidates by Quest's bound (from the int4 summary's
/// min and max), and a (block, KV head) is scored when one of its G query heads has it among its
/// best `m` (−inf otherwise; m ≤ 0 or m ≥ C: every candidate). `summary(c, h)` gives the
/// candidate's (min, step, max, codes) for KV head h. The per-block work runs on the kernel
/// table (int4_quest, int4_block), a KV head's G queries at once, split over `threads` (a count:
/// a row scored alone, as at batch 1, leaves no core idle); every value is computed by one
/// thread the same way whatever the count, so the scores do not depend on it.
template <class Summary>
void int4_scores(const float* query, std::int64_t q_heads, std::int64_t kv_heads, std::int64_t d, std::int64_t bs,
                 std::int64_t m, Summary&& summary, BlockChoiceScratch& w, int threads = 1) {
  const std::int64_t C = std::int64_t(w.cand.size()), G = q_heads / kv_heads, half = (bs + 1) / 2;
  const simd::KernelTable& tb = simd::active_table();
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  w.score.assign(std::size_t(q_heads * C), ninf);
  std::vector<std::uint8_t> keep(static_cast<std::size_t>(kv_heads * C), std::uint8_t(m <= 0 || m >= C));
  // Each thread's scratch is allocated here, before any parallel region (nothing may throw in one).
  // The summaries and codes are read from memory the size of the cache's own metadata (MBs per
  // layer): the next block's are fetched while this one is scored (its loads stalled ~3/4 of
  // the time without).
  const std::size_t T = std::size_t(std::max(threads, 1));
  auto none = [](int) { return 0; };
  if (m > 0 && m < C) {
    w.agg.resize(std::size_t(q_heads * C));  // Quest's bound [q_heads][C]
    std::vector<float> lanes(T * std::size_t(G * 16));
    parallel_for_tid(C, threads, none, [&](int, std::int64_t c, int tid) {
      float* ln = lanes.data() + std::size_t(tid) * std::size_t(G * 16);
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const auto tile_summary = summary(c, h);
        if (c + 1 < C) prefetch(std::get<0>(summary(c + 1, h)), 2 * d * std::int64_t(sizeof(float)));
        tb.int4_quest(query + h * G * d, G, d, std::get<0>(tile_summary), std::get<2>(tile_summary), ln);
        for (std::int64_t g = 0; g < G; ++g) w.agg[std::size_t((h * G + g) * C + c)] = pariskv::detail::tree16(ln + g * 16);
      }
    });
    // per KV head, its G query heads' best m (a thread writes only its head's row of keep)
    std::vector<std::int64_t> orders(T * std::size_t(C));
    parallel_for_tid(kv_heads, threads, none, [&](int, std::int64_t h, int tid) {
      std::int64_t* order = orders.data() + std::size_t(tid) * std::size_t(C);
      for (std::int64_t jq = h * G; jq < (h + 1) * G; ++jq) {
        const float* bound = w.agg.data() + jq * C;
        for (std::int64_t c = 0; c < C; ++c) order[c] = c;
        std::nth_element(order, order + m, order + C, [&](std::int64_t x, std::int64_t y) {
          const float a = bound[x], b = bound[y];
          return a > b || (a == b && x < y);
        });
        for (std::int64_t i = 0; i < m; ++i) keep[std::size_t(h * C + order[i])] = 1;
      }
    });
  }
  std::vector<std::int64_t> todo;  // the (block, KV head)s to score, h·C + c, in memory order
  for (std::int64_t c = 0; c < C; ++c)
    for (std::int64_t h = 0; h < kv_heads; ++h)
      if (keep[std::size_t(h * C + c)]) todo.push_back(h * C + c);
  std::vector<std::int16_t> wq(T * std::size_t(G * d));
  std::vector<std::int32_t> acc(T * std::size_t(G * 2 * half)), best(T * std::size_t(G));
  std::vector<float> scale(T * std::size_t(G)), qlo(T * std::size_t(G * 16));
  const std::int64_t code_bytes = int4_code_bytes(d, bs), n = std::int64_t(todo.size());
  parallel_for_tid(n, threads, none, [&](int, std::int64_t i, int tid) {
    const std::size_t t = std::size_t(tid);
    const std::int64_t h = todo[std::size_t(i)] / C, c = todo[std::size_t(i)] % C;
    if (i + 1 < n) {
      const auto next = summary(todo[std::size_t(i + 1)] % C, todo[std::size_t(i + 1)] / C);
      prefetch(std::get<0>(next), d * std::int64_t(sizeof(float)));
      prefetch(std::get<1>(next), d * std::int64_t(sizeof(float)));
      prefetch(std::get<3>(next), code_bytes);
    }
    const float* qh = query + h * G * d;
    const auto [mn, st, mx, codes] = summary(c, h);
    std::int32_t* bt = best.data() + t * std::size_t(G);
    float* sc = scale.data() + t * std::size_t(G);
    float* ln = qlo.data() + t * std::size_t(G * 16);
    tb.int4_block(qh, G, d, mn, st, codes, bs, wq.data() + t * std::size_t(G * d),
                  acc.data() + t * std::size_t(G * 2 * half), bt, sc, ln);
    for (std::int64_t g = 0; g < G; ++g)
      w.score[std::size_t((h * G + g) * C + c)] = pariskv::detail::tree16(ln + g * 16) + sc[g] * float(bt[g]);
  });
}

class Int4Scorer : public StatelessBlockScorer {
 public:
  static constexpr BlockScore kind = BlockScore::int4;
  static constexpr bool kSummaries = true;  ///< reads a SummaryStore
  Int4Scorer(const BlockSparseOptions& o, std::int64_t /*layers*/, std::int64_t head_dim, std::int64_t block_size)
      : d_(head_dim), bs_(block_size), prefilter_(o.prefilter) {}
  /// [min | max | step]: the prefilter reads min and max side by side
  std::int64_t summary_floats() const noexcept { return 3 * d_; }
  std::int64_t code_bytes() const noexcept { return int4_code_bytes(d_, bs_); }
  template <BlockKeyTile Tile>
  void summarize(const Tile& x, float* s, std::uint8_t* codes) const {
    int4_summary(x, bs_, d_, s, s + 2 * d_, codes, s + d_);
  }
  template <class Keys>
  void score(const BlockScoreJob& job, const BlockReader<Keys>& rd, BlockChoiceScratch& w) const {
    int4_scores(job.query, job.q, job.kv_heads, d_, bs_, prefilter_ * job.k, [&](std::int64_t c, std::int64_t h) {
      const float* a = rd.summary(c, h);
      return std::tuple<const float*, const float*, const float*, const std::uint8_t*>{a, a + 2 * d_, a + d_,
                                                                                        rd.code(c, h)};
    }, w, job.threads);
  }

 private:
  std::int64_t d_, bs_, prefilter_;
};

}  // namespace kvscore::detail
