// kvscore/block_sparse.hpp — block-sparse decode attention over a paged KV cache: at every
// decode step each sequence attends its sink blocks, its newest blocks and the blocks whose keys
// score highest for this step's query; the rest of its blocks stay in the cache, unread this
// step (docs/block_sparse.md). The engine's own paged attention kernel runs unchanged on a
// shorter block table (vLLM: kvscore.vllm's `attend`).
//
// [snippet block-sparse: tests/test_snippets.cpp]
//   kvscore::BlockSparseOptions opt;                 // int4 codes, 4 sinks, 64 local tokens
//   kvscore::PagedBlockSelector sel(layers, num_blocks, kv_heads, head_dim, block_size, opt);
//   sel.begin_step(written_slots, first_blocks);     // once per step: the slots written since
//   sel.select(layer, keys, q_heads, rows);          // per layer: every rows[i].out is filled
//
// A block's score for one query head (q post-RoPE, like the keys):
//   quest    Σ_j max(q_j·min_j, q_j·max_j) over the block's per-dimension key min and max: an
//            upper bound of max_t q·k_t (Quest, Tang et al. 2024, per KV head and block).
//   meanstd  q·μ + z_n·sqrt(Σ_j q_j²σ_j²): the block's mean score plus z_n spreads, σ_j the keys'
//            per-dimension standard deviation and z_n the expected maximum of n = block_size
//            standard normals (2.07 at 32) — what the max of q·k over the block would be if the
//            keys' coordinates were independent Gaussians.
//   int4     max_t q·k̂_t over the block's keys quantised to 4 bits per coordinate within Quest's
//            per-dimension range (k̂_tj = min_j + step_j·c_tj, step_j = (max_j − min_j)/15, c_tj
//            rounded to nearest-even): the exact score on keys read at 1/8 of their fp32 bytes,
//            summed in integers (q_j·step_j rounded to 16 bits per block: the same result on every
//            ISA). Only the blocks among some query head's best `prefilter`·k by Quest's bound
//            (from the same min and max) are scored this way (k: the blocks still to choose), the
//            others of that KV head not at all. The per-block work is the kernel table's
//            (int4_summarize, int4_quest, int4_block: vector code, a KV head's queries at once).
//   pariskv  max over the block's tokens that ParisKV's index retrieves for q (its RSQ-IP
//            estimates, pariskv.hpp; one index per sequence and KV head, kept across steps);
//            blocks with no retrieved token score −inf.
//   exact    max_t q·k_t over the block's keys: what the bounds approximate. It reads every
//            key, so it is the ceiling of the others' recall, not a fast path.
// quest and meanstd read a summary of 2·head_dim floats per block and KV head (int4: 3·head_dim,
// min, max and step, and head_dim·block_size/2 bytes of codes), made once when the block is
// first needed full and dropped when any of its slots is written again (begin_step's slot list:
// a new owner, a preempted sequence recomputed).
//
// One block table row serves every KV head (vLLM's kernels), so a block is chosen per sequence
// and layer: each query head turns its block scores into a softmax over the candidate blocks
// (scores × the attention's scale: its estimated share of attention per block), and a block's
// score is the sum of those shares over the layer's query heads — a block that one sharp head
// needs outranks one that a flat head slightly prefers. The blocks chosen: the sinks' and the
// local window's (the last block always), then the best of the rest (ties: the lower logical
// block), written in ascending logical order. The count depends only on the sequence's length
// (attended_blocks), never on the layer, so every layer of a step has the same sequence lengths
// (one attention schedule per step).
//
// Determinism: each row is one thread's work in a fixed order; the result does not depend on
// the thread count. Errors: std::invalid_argument naming the value; select() validates every
// row before it writes any.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/core/names.hpp"
#include "kvscore/core/parallel.hpp"
#include "kvscore/paged.hpp"
#include "kvscore/pariskv/attention.hpp"
#include "kvscore/pariskv/pariskv.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore {

/// How a block is scored for a query (see the file comment).
enum class BlockScore { quest, meanstd, int4, pariskv, exact };

inline constexpr BlockScore kBlockScores[] = {BlockScore::quest, BlockScore::meanstd, BlockScore::int4,
                                              BlockScore::pariskv, BlockScore::exact};

inline const char* to_string(BlockScore s) noexcept {
  switch (s) {
    case BlockScore::quest: return "quest";
    case BlockScore::meanstd: return "meanstd";
    case BlockScore::int4: return "int4";
    case BlockScore::pariskv: return "pariskv";
    case BlockScore::exact: return "exact";
  }
  return "?";
}

inline BlockScore parse_block_score(std::string_view s) { return detail::parse_enum(s, kBlockScores, "block score"); }

/// Which queries score the blocks of a KV head: each of its query heads (GQA: G of them), or one,
/// their mean (G times less scoring; the group's shares of attention are then estimated as one).
enum class QueryGroup { heads, mean };

inline constexpr QueryGroup kQueryGroups[] = {QueryGroup::heads, QueryGroup::mean};

inline const char* to_string(QueryGroup g) noexcept { return g == QueryGroup::mean ? "mean" : "heads"; }

inline QueryGroup parse_query_group(std::string_view s) { return detail::parse_enum(s, kQueryGroups, "query group"); }

struct BlockSparseOptions {
  BlockScore score = BlockScore::int4;
  std::int64_t sinks = 4;   ///< positions [0, sinks): their blocks are always attended, >= 0
  std::int64_t local = 64;  ///< positions [tokens − local, tokens): their blocks too (the last block always), >= 0
  /// The attention's softmax scale (0: 1/√head_dim), which turns block scores into each query
  /// head's estimated share of attention per block (see the file comment).
  float scale = 0.f;
  /// int4: each query head scores exactly (on the codes) its best prefilter·k blocks by Quest's
  /// bound, k being the blocks still to choose (0: every candidate)
  std::int64_t prefilter = 4;
  QueryGroup group = QueryGroup::heads;  ///< the queries that score a KV head's blocks
  /// A sequence's blocks are scored every `refresh` steps (per layer); in between its last choice
  /// stands (the protected blocks follow the sequence's end; a block the window let go fills in
  /// for one it took). 1 = every step.
  std::int64_t refresh = 1;
  int num_threads = 0;      ///< threads over rows (0 = OpenMP's default); the result is the same for any
  /// Also choose with `exact` and count how many of its chosen blocks the score chose
  /// (PagedBlockSelector::probe()): the recall of the exact block choice, for benchmarks.
  bool probe = false;
};

namespace detail {

inline void check_block_sparse(const BlockSparseOptions& o, const char* who) {
  if (o.sinks < 0) throw_invalid(std::string(who) + ": sinks must be >= 0 (got " + std::to_string(o.sinks) + ")");
  if (o.local < 0) throw_invalid(std::string(who) + ": local must be >= 0 (got " + std::to_string(o.local) + ")");
  if (o.refresh < 1)
    throw_invalid(std::string(who) + ": refresh must be >= 1 (got " + std::to_string(o.refresh) + ")");
  if (o.prefilter < 0)
    throw_invalid(std::string(who) + ": prefilter must be >= 0 (got " + std::to_string(o.prefilter) + ")");
  if (!(o.scale >= 0) || !std::isfinite(o.scale))
    throw_invalid(std::string(who) + ": scale must be >= 0 and finite (got " + std::to_string(o.scale) + ")");
}

/// Logical blocks [0, sink_end) and [local_begin, blocks) of a sequence are protected.
struct ProtectedBlocks {
  std::int64_t blocks = 0, sink_end = 0, local_begin = 0;
  std::int64_t count() const noexcept { return std::min(sink_end, local_begin) + (blocks - local_begin); }
  bool contains(std::int64_t b) const noexcept { return b < sink_end || b >= local_begin; }
};

inline ProtectedBlocks protected_blocks_of(std::int64_t tokens, std::int64_t bs, const BlockSparseOptions& o) {
  ProtectedBlocks p;
  p.blocks = blocks_for(tokens, bs);
  p.sink_end = std::min(p.blocks, blocks_for(std::min(o.sinks, tokens), bs));
  const std::int64_t first_local_token = std::max<std::int64_t>(0, tokens - std::max<std::int64_t>(o.local, 1));
  p.local_begin = std::min(p.blocks, first_local_token / bs);
  return p;
}

/// E[max of n independent standard normals] (n >= 1), by the trapezoid rule on
/// ∫ x·n·φ(x)·Φ(x)^(n−1) dx over [−12, 12]: 0 at n = 1, 1/√π at 2, 2.07 at 32.
inline double expected_max_normal(std::int64_t n) {
  if (n <= 1) return 0.0;
  const double h = 1e-3, inv_sqrt2pi = 0.3989422804014327;
  double acc = 0;
  for (int i = -12000; i <= 12000; ++i) {
    const double x = i * h;
    const double phi = inv_sqrt2pi * std::exp(-0.5 * x * x);
    const double Phi = 0.5 * std::erfc(-x / std::sqrt(2.0));
    acc += x * double(n) * phi * std::pow(Phi, double(n - 1));
  }
  return acc * h;
}

/// One (block, KV head)'s keys: element (t, j) at p[t * ts + j * js].
template <class T>
struct KeyTile {
  const T* p = nullptr;
  std::int64_t ts = 0, js = 1;
  float at(std::int64_t t, std::int64_t j) const noexcept { return to_float(p[t * ts + j * js]); }
};

/// Tile of physical block `p`, head h, in a paged view (PagedKeysView rows, or
/// TransposedPagedKeysView's [head_dim][block_size] tiles).
template <class View>
KeyTile<typename View::value_type> paged_tile(const View& v, std::int64_t h, std::int64_t p) noexcept {
  if constexpr (requires { v.token_stride(); })
    return {v.data() + p * v.block_stride() + h * v.head_stride(), v.token_stride(), 1};
  else
    return {v.data() + p * v.block_stride() + h * v.head_stride(), 1, v.block_size()};
}

/// Scratch of one row's choice.
struct BlockChoiceScratch {
  std::vector<float> score, agg, acc, summary, meanq;
  std::vector<std::int64_t> cand, order, chosen, exact_chosen;
};

/// Bytes of int4 codes per (block, KV head): [⌈head_dim/2⌉][h = ⌈block_size/2⌉][2], two tokens
/// a byte: byte (j/2)·2h + 2t + j%2 holds dimension j's code of token t < h in its low nibble and
/// of token h + t in its high one (a pair of dimensions' bytes widen to the (c_tj, c_t,j+1) int16
/// pairs that (v)pmaddwd multiplies by (w_j, w_j+1): simd/table.hpp's int4_dots).
inline std::int64_t int4_code_bytes(std::int64_t head_dim, std::int64_t block_size) noexcept {
  return (head_dim + 1) / 2 * 2 * ((block_size + 1) / 2);
}

/// The summary of n keys: quest (min, max), meanstd (mean, standard deviation) or int4 (min,
/// step, and `codes`: int4_code_bytes; `hi`, when given, the max) per dimension. int4 runs on the
/// kernel table (int4_summarize), over the keys in place when they are fp32 rows of n.
template <class T>
void summarize_tile(BlockScore how, const KeyTile<T>& x, std::int64_t n, std::int64_t d, float* a, float* b,
                    std::uint8_t* codes = nullptr, float* hi = nullptr) {
  if (how == BlockScore::int4) {
    std::vector<float> top;
    if (hi == nullptr) top.resize(static_cast<std::size_t>(d)), hi = top.data();
    if constexpr (std::is_same_v<T, float>) {
      if (x.ts == 1) return simd::active_table().int4_summarize(x.p, x.js, n, d, a, b, hi, codes);
    }
    std::vector<float> rows(static_cast<std::size_t>(n * d));  // [d][n] fp32
    for (std::int64_t j = 0; j < d; ++j)
      for (std::int64_t t = 0; t < n; ++t) rows[std::size_t(j * n + t)] = x.at(t, j);
    return simd::active_table().int4_summarize(rows.data(), n, n, d, a, b, hi, codes);
  }
  for (std::int64_t j = 0; j < d; ++j) {
    if (how == BlockScore::quest) {
      float mn = x.at(0, j), mx = mn;
      for (std::int64_t t = 1; t < n; ++t) {
        const float e = x.at(t, j);
        mn = std::min(mn, e);
        mx = std::max(mx, e);
      }
      a[j] = mn;
      b[j] = mx;
    } else {  // two passes in double: the spread of near-equal keys is small
      double s = 0;
      for (std::int64_t t = 0; t < n; ++t) s += double(x.at(t, j));
      const double mu = s / double(n);
      double ss = 0;
      for (std::int64_t t = 0; t < n; ++t) ss += (double(x.at(t, j)) - mu) * (double(x.at(t, j)) - mu);
      a[j] = float(mu);
      b[j] = float(std::sqrt(ss / double(n)));
    }
  }
}

/// A query's score of a summary (see the file comment).
inline float summary_score(BlockScore how, const float* q, const float* a, const float* b, std::int64_t d,
                           float z) noexcept {
  if (how == BlockScore::quest) {
    float s = 0.f;
    for (std::int64_t j = 0; j < d; ++j) s += std::max(q[j] * a[j], q[j] * b[j]);
    return s;
  }
  float m = 0.f, var = 0.f;
  for (std::int64_t j = 0; j < d; ++j) {
    m += q[j] * a[j];
    var += q[j] * q[j] * b[j] * b[j];
  }
  return m + z * std::sqrt(var);
}

/// Asks for the cache lines of [p, p + bytes) ahead of their use (a hint: no effect on results).
inline void prefetch(const void* p, std::int64_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  for (std::int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
#else
  (void)p, (void)bytes;
#endif
}

/// Σ_j f(j) for j < d in one fixed order that vectorises: 16 lanes (lane l sums the j ≡ l mod 16
/// in order), then ParisKV's lane tree (tree16). Not the dimension-order sum, but the same on
/// every ISA: the compiler turns the lanes into vectors instead of leaving a float reduction scalar.
template <class F>
inline float lane_sum(std::int64_t d, F&& f) noexcept {
  float lane[16] = {};
  std::int64_t j = 0;
  for (; j + 16 <= d; j += 16)
    for (int l = 0; l < 16; ++l) lane[l] += f(j + l);
  for (int l = 0; j < d; ++j, ++l) lane[l] += f(j);
  return pariskv::detail::tree16(lane);
}

/// max_t q·k̂_t over n int4-coded keys (min, step, codes of summarize_tile) for each of `g`
/// queries (out[g]): q·min in fp32 (lane_sum's order), plus s·max_t Σ_j w_j·c_tj where
/// w_j = q_j·step_j / s rounded to nearest-even 16-bit integers (s = max_j |q_j·step_j| / 32767)
/// and the sums are exact int32 (the table's int4_block): the result does not depend on the ISA
/// or the compiler's vectorisation. `w` holds g·d int16 and `acc` g·2·⌈n/2⌉ int32 of scratch.
inline void int4_tile_scores(const float* const* q, std::int64_t g, const float* mn, const float* step,
                             const std::uint8_t* codes, std::int64_t n, std::int64_t d, float* out,
                             std::int16_t* w, std::int32_t* acc) noexcept {
  std::int32_t best[1];
  float scale[1];
  for (std::int64_t k = 0; k < g; ++k) {
    simd::active_table().int4_block(q[k], 1, d, step, codes, n, w, acc, best, scale);
    const float* qk = q[k];
    out[k] = lane_sum(d, [&](std::int64_t j) { return qk[j] * mn[j]; }) + scale[0] * float(best[0]);
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
  std::vector<float> scale(T * std::size_t(G));
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
    tb.int4_block(qh, G, d, st, codes, bs, wq.data() + t * std::size_t(G * d), acc.data() + t * std::size_t(G * 2 * half),
                  bt, sc);
    for (std::int64_t g = 0; g < G; ++g) {
      const float* qk = qh + g * d;
      const float* lo = mn;
      w.score[std::size_t((h * G + g) * C + c)] = lane_sum(d, [&](std::int64_t j) { return qk[j] * lo[j]; }) + sc[g] * float(bt[g]);
    }
  });
}

/// max_t q·k_t over n keys (fp32 sums in dimension order); `acc` has n floats of scratch.
template <class T>
float exact_tile_score(const float* q, const KeyTile<T>& x, std::int64_t n, std::int64_t d, float* acc) noexcept {
  std::fill(acc, acc + n, 0.f);
  for (std::int64_t j = 0; j < d; ++j) {
    const float qj = q[j];
    for (std::int64_t t = 0; t < n; ++t) acc[t] += qj * x.at(t, j);
  }
  return *std::max_element(acc, acc + n);
}

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

/// Writes the attended blocks' physical ids (sinks, chosen, local; ascending logical order).
template <class Id>
void write_choice(const ProtectedBlocks& pb, const std::vector<std::int64_t>& chosen, std::span<const Id> table,
                  std::int32_t* out) {
  std::int64_t o = 0;
  for (std::int64_t b = 0; b < std::min(pb.sink_end, pb.local_begin); ++b) out[o++] = std::int32_t(table[std::size_t(b)]);
  for (const std::int64_t b : chosen) out[o++] = std::int32_t(table[std::size_t(b)]);
  for (std::int64_t b = pb.local_begin; b < pb.blocks; ++b) out[o++] = std::int32_t(table[std::size_t(b)]);
}

/// The per-sequence ParisKV indexes encode raw keys (no centring): each key's code is then its
/// own, so an index grown block by block equals one built at once (block_sparse_reference).
inline ParisKVConfig block_sparse_pariskv_config() {
  ParisKVConfig c;
  c.center = false;
  return c;
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

inline void check_query(const float* q, std::int64_t n, const std::string& at) {
  if (q == nullptr) throw_invalid(at + ": query is null");
  for (std::int64_t j = 0; j < n; ++j)
    if (!std::isfinite(q[j]))
      throw_invalid(at + ": query element " + std::to_string(j) + " is not finite (" + std::to_string(q[j]) + ")");
}

}  // namespace detail

/// Blocks a decode step of a sequence of `tokens` attends: `attend` is a fraction of its tokens
/// in (0, 1] or, above 1, a whole count of tokens; ⌈attend·tokens⌉ (or the count) tokens rounded
/// up to whole blocks, never fewer than the protected blocks (sinks, local, last), never more
/// than the sequence's blocks. Equal to blocks_for(tokens) means: attend densely.
inline std::int64_t attended_blocks(std::int64_t tokens, std::int64_t block_size, double attend,
                                    const BlockSparseOptions& opt = {}) {
  const std::string who = "kvscore::attended_blocks";
  if (block_size <= 0) detail::throw_invalid(who + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
  if (tokens < 0) detail::throw_invalid(who + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  if (!(attend > 0) || !std::isfinite(attend) || (attend > 1 && attend != std::floor(attend)))
    detail::throw_invalid(who + ": attend " + std::to_string(attend) +
                          " must be a fraction in (0, 1] or a whole count of tokens > 1");
  detail::check_block_sparse(opt, who.c_str());
  const std::int64_t blocks = blocks_for(tokens, block_size);
  // ⌈x·N·(1 − 1e−12)⌉: float fuzz in attend·tokens (0.1·8000 = 800.0000000000001) adds no token
  const double want = attend <= 1 ? std::ceil(attend * double(tokens) * (1.0 - 1e-12)) : attend;
  const std::int64_t want_blocks = blocks_for(std::int64_t(std::min(want, double(tokens))), block_size);
  const std::int64_t prot = detail::protected_blocks_of(tokens, block_size, opt).count();
  return std::min(blocks, std::max(want_blocks, prot));
}

/// The blocks one decode step attends, from a sequence's keys alone (no state): `keys` is
/// [kv_heads][tokens][head_dim] fp32 (C order), `query` [q_heads][head_dim]; returns `attend`
/// logical blocks, ascending. What PagedBlockSelector chooses from a paged cache with its
/// summaries and indexes (tests compare the two on keys read back from an engine's cache).
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
  std::vector<float> meanq;
  std::int64_t qn = q_heads;
  query = detail::scoring_queries(query, q_heads, kv_heads, head_dim, opt.group, meanq, qn);
  q_heads = qn;
  const std::int64_t G = q_heads / kv_heads, d = head_dim, bs = block_size;
  const std::int64_t k = attend - pb.count();
  detail::BlockChoiceScratch w;
  detail::candidates(pb, w.cand);
  auto tile = [&](std::int64_t h, std::int64_t b) {
    return detail::KeyTile<float>{keys + (h * tokens + b * bs) * d, d, 1};
  };
  auto score = [&](BlockScore how) {
    const std::int64_t C = std::int64_t(w.cand.size());
    if (how == BlockScore::pariskv) {
      const std::int64_t full = tokens / bs;
      std::vector<ParisKV> index;
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        index.emplace_back(d, detail::block_sparse_pariskv_config());
        index.back().append(keys + h * tokens * d, full * bs, d);
      }
      detail::pariskv_scores(query, q_heads, d, bs, pb.blocks, k * bs,
                             [&](std::int64_t jq) -> const ParisKV& { return index[std::size_t(jq / G)]; }, w);
      return;
    }
    if (how == BlockScore::int4) {
      // every candidate's summary and codes, then the shared prefilter + integer scoring
      const std::int64_t cb = detail::int4_code_bytes(d, bs);
      std::vector<float> sums(std::size_t(C * kv_heads * 3 * d));  // [min | max | step] per block and head
      std::vector<std::uint8_t> codes(std::size_t(C * kv_heads * cb));
      for (std::int64_t c = 0; c < C; ++c)
        for (std::int64_t h = 0; h < kv_heads; ++h) {
          float* a = sums.data() + (c * kv_heads + h) * 3 * d;
          detail::summarize_tile(how, tile(h, w.cand[std::size_t(c)]), bs, d, a, a + 2 * d,
                                 codes.data() + (c * kv_heads + h) * cb, a + d);
        }
      detail::int4_scores(query, q_heads, kv_heads, d, bs, opt.prefilter * k, [&](std::int64_t c, std::int64_t h) {
        const float* a = sums.data() + (c * kv_heads + h) * 3 * d;
        return std::tuple<const float*, const float*, const float*, const std::uint8_t*>{
            a, a + 2 * d, a + d, codes.data() + (c * kv_heads + h) * cb};
      }, w);
      return;
    }
    const float z = float(detail::expected_max_normal(bs));
    w.score.assign(std::size_t(q_heads * C), 0.f);
    w.summary.resize(std::size_t(2 * d));
    w.acc.resize(std::size_t(bs));
    for (std::int64_t c = 0; c < C; ++c)
      for (std::int64_t h = 0; h < kv_heads; ++h) {
        const auto x = tile(h, w.cand[std::size_t(c)]);
        const float* a = w.summary.data();
        if (how != BlockScore::exact) detail::summarize_tile(how, x, bs, d, w.summary.data(), w.summary.data() + d);
        for (std::int64_t jq = h * G; jq < (h + 1) * G; ++jq)
          w.score[std::size_t(jq * C + c)] = how == BlockScore::exact
                                                 ? detail::exact_tile_score(query + jq * d, x, bs, d, w.acc.data())
                                                 : detail::summary_score(how, query + jq * d, a, a + d, d, z);
      }
  };
  std::vector<std::int64_t> chosen;
  if (k > 0) {
    score(opt.score);
    detail::choose_top(q_heads, k, opt.scale > 0 ? opt.scale : 1.f / std::sqrt(float(head_dim)), w, chosen);
  }
  std::vector<std::int64_t> out;
  for (std::int64_t b = 0; b < pb.blocks; ++b)
    if (pb.contains(b) || std::binary_search(chosen.begin(), chosen.end(), b)) out.push_back(b);
  return out;
}

/// One decode row of a step: its block table (compacted: every entry a block it holds, in
/// logical order), its length, its query heads, how many blocks to attend, where to write them.
struct BlockSparseRow {
  std::span<const std::int32_t> table;  ///< >= blocks_for(tokens) physical ids
  std::int64_t tokens = 0;              ///< the sequence's length (its last block may be partial)
  const float* query = nullptr;         ///< [q_heads][head_dim] this step's query (post-RoPE), fp32
  std::int64_t attend = 0;              ///< blocks to attend: attended_blocks(...), in [protected, blocks]
  std::int32_t* out = nullptr;          ///< [attend] chosen physical ids, ascending logical order
  std::uint8_t* fresh = nullptr;        ///< optional: set to 1 when scored this step, 0 when a kept choice stood
};

/// The block choice of every decode row of a paged cache with `layers` layers, and what it keeps
/// between steps: quest/meanstd summaries per (layer, physical block), or one ParisKV index per
/// (layer, sequence, KV head). Driven by one engine worker: begin_step() once per step, then
/// select() per layer (which runs the rows in parallel, or splits a row's scoring over the
/// threads when fewer rows score than there are threads).
class PagedBlockSelector {
 public:
  PagedBlockSelector(std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads, std::int64_t head_dim,
                     std::int64_t block_size, const BlockSparseOptions& opt = {})
      : L_(layers), nb_(num_blocks), kh_(kv_heads), d_(head_dim), bs_(block_size), opt_(opt) {
    const std::string who = "kvscore::PagedBlockSelector";
    auto need = [&](bool ok, const char* what, std::int64_t v) {
      if (!ok) detail::throw_invalid(who + ": " + what + " (got " + std::to_string(v) + ")");
    };
    need(layers >= 1, "layers must be >= 1", layers);
    need(num_blocks >= 1, "num_blocks must be >= 1", num_blocks);
    need(kv_heads >= 1, "kv_heads must be >= 1", kv_heads);
    need(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim must be in [1, 4096]", head_dim);
    need(block_size >= 1, "block_size must be >= 1", block_size);
    detail::check_block_sparse(opt, who.c_str());
    z_ = float(detail::expected_max_normal(block_size));
    written_.assign(std::size_t(nb_), 0);
    if (uses_summaries()) {
      summary_.resize(std::size_t(L_));
      made_at_.assign(std::size_t(L_), std::vector<std::int64_t>(std::size_t(nb_), -1));
      for (auto& s : summary_) s.reset(new float[std::size_t(nb_ * kh_ * summary_floats())]);
      if (opt_.score == BlockScore::int4) {
        codes_.resize(std::size_t(L_));
        for (auto& c : codes_) c.reset(new std::uint8_t[std::size_t(nb_ * kh_ * code_bytes())]);
      }
    }
    if (opt_.score == BlockScore::pariskv) seqs_.resize(std::size_t(L_));
    if (opt_.refresh > 1) kept_.resize(std::size_t(L_));
  }

  // it owns per-layer summaries and indexes: movable, not copyable
  PagedBlockSelector(const PagedBlockSelector&) = delete;
  PagedBlockSelector& operator=(const PagedBlockSelector&) = delete;
  PagedBlockSelector(PagedBlockSelector&&) = default;
  PagedBlockSelector& operator=(PagedBlockSelector&&) = default;

  const BlockSparseOptions& options() const noexcept { return opt_; }
  std::int64_t layers() const noexcept { return L_; }
  std::int64_t num_blocks() const noexcept { return nb_; }
  std::int64_t kv_heads() const noexcept { return kh_; }
  std::int64_t head_dim() const noexcept { return d_; }
  std::int64_t block_size() const noexcept { return bs_; }
  /// Bytes of the per-block summaries (quest, meanstd, int4): 2·head_dim floats per block, head
  /// and layer (int4: 3·head_dim and its codes).
  std::int64_t summary_bytes() const noexcept {
    return uses_summaries() ? L_ * nb_ * kh_ * (summary_floats() * std::int64_t(sizeof(float)) +
                                                (opt_.score == BlockScore::int4 ? code_bytes() : 0))
                            : 0;
  }
  /// Summaries made since construction (quest, meanstd), for tests and benchmarks.
  std::int64_t summaries_made() const noexcept { return made_; }
  /// ParisKV indexes held (one per layer and sequence), for tests.
  std::int64_t indexes() const noexcept {
    std::int64_t n = 0;
    for (const auto& m : seqs_) n += std::int64_t(m.size());
    return n;
  }
  /// With options().probe: (blocks the exact score chose beyond the protected ones, how many of
  /// them this score chose too), summed over every row and layer since construction. With
  /// refresh, a step whose kept choice stands counts too: the kept blocks against that step's
  /// exact choice (what the choice lost by being kept).
  std::pair<std::int64_t, std::int64_t> probe() const noexcept { return {probe_exact_, probe_hit_}; }

  /// Once per engine step, before its first select(): `slots`, the physical slots written since
  /// the last step (vLLM's slot_mapping; negative entries are padding), make the summaries and
  /// indexes holding their blocks stale; `live` (the first block of every sequence in the step)
  /// lets the ParisKV indexes of sequences no longer running go.
  void begin_step(std::span<const std::int64_t> slots, std::span<const std::int64_t> live = {}) {
    const std::string who = "kvscore::PagedBlockSelector::begin_step";
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i] >= nb_ * bs_)
        detail::throw_invalid(who + ": slot " + std::to_string(slots[i]) + " at " + std::to_string(i) +
                              " is past the pool's " + std::to_string(nb_ * bs_) + " slots");
    ++step_;
    for (const std::int64_t s : slots)
      if (s >= 0) written_[std::size_t(s / bs_)] = step_;
    if (opt_.score == BlockScore::pariskv || opt_.refresh > 1) {
      const std::unordered_set<std::int64_t> keep(live.begin(), live.end());
      for (auto& m : seqs_)
        for (auto it = m.begin(); it != m.end();) it = keep.count(it->first) ? std::next(it) : m.erase(it);
      for (auto& m : kept_)
        for (auto it = m.begin(); it != m.end();) it = keep.count(it->first) ? std::next(it) : m.erase(it);
    }
  }

  /// Chooses the blocks of every row for one layer from the layer's keys: `keys` is a paged view
  /// of the pool (PagedKeysView or TransposedPagedKeysView over any table: only its data, strides
  /// and shape are read), each row's query [q_heads][head_dim]. Every row is validated first.
  template <class View>
  void select(std::int64_t layer, const View& keys, std::int64_t q_heads, std::span<const BlockSparseRow> rows) {
    const std::string who = "kvscore::PagedBlockSelector::select";
    if (layer < 0 || layer >= L_)
      detail::throw_invalid(who + ": layer " + std::to_string(layer) + " out of range [0, " + std::to_string(L_) + ")");
    if (keys.heads() != kh_ || keys.head_dim() != d_ || keys.block_size() != bs_ || keys.num_blocks() != nb_)
      detail::throw_invalid(who + ": the keys' (kv_heads, head_dim, block_size, num_blocks) = (" +
                            std::to_string(keys.heads()) + ", " + std::to_string(keys.head_dim()) + ", " +
                            std::to_string(keys.block_size()) + ", " + std::to_string(keys.num_blocks()) +
                            ") differ from the selector's (" + std::to_string(kh_) + ", " + std::to_string(d_) + ", " +
                            std::to_string(bs_) + ", " + std::to_string(nb_) + ")");
    if (q_heads < kh_ || q_heads % kh_ != 0)
      detail::throw_invalid(who + ": q_heads " + std::to_string(q_heads) + " must be a positive multiple of kv_heads " +
                            std::to_string(kh_));
    for (std::size_t i = 0; i < rows.size(); ++i) check_row(rows[i], i, q_heads, who);
    if (opt_.score == BlockScore::pariskv || opt_.refresh > 1) {
      // per-sequence state (an index, a kept choice), found by the first block: rows are distinct
      // sequences. Created here, serially; each row's thread then uses its own.
      std::unordered_set<std::int64_t> firsts;
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const std::int64_t f = rows[i].table[0];
        if (!firsts.insert(f).second)
          detail::throw_invalid(who + ": row " + std::to_string(i) + " starts with block " + std::to_string(f) +
                                " as an earlier row does (one sequence per row)");
        if (opt_.score == BlockScore::pariskv) {
          auto& s = seqs_[std::size_t(layer)][f];
          if (!s) s = std::make_unique<SeqIndex>();
        }
        if (opt_.refresh > 1) {
          auto& s = kept_[std::size_t(layer)][f];
          if (!s) s = std::make_unique<Kept>();
        }
      }
    }
    // Which rows' kept choices stand is known before anything is read: those rows touch only their
    // kept blocks (no summary scan: at batch 1 that scan over cold memory was most of a call).
    std::vector<std::uint8_t> stands(rows.size(), 0);
    if (opt_.refresh > 1)
      for (std::size_t i = 0; i < rows.size(); ++i) stands[i] = kept_stands(layer, rows[i]);
    if (uses_summaries()) {
      // the candidate blocks whose summary is missing or stale, each once, made in parallel
      std::vector<std::int64_t> todo;
      std::vector<std::int64_t>& made_at = made_at_[std::size_t(layer)];
      for (std::size_t i = 0; i < rows.size(); ++i) {
        const BlockSparseRow& r = rows[i];
        const detail::ProtectedBlocks pb = detail::protected_blocks_of(r.tokens, bs_, opt_);
        if (r.attend == pb.count() || stands[i]) continue;  // nothing to choose, or nothing to score
        for (std::int64_t b = 0; b < pb.blocks; ++b) {
          const std::int64_t p = r.table[std::size_t(b)];
          if (!pb.contains(b) && made_at[std::size_t(p)] < written_[std::size_t(p)]) {
            made_at[std::size_t(p)] = written_[std::size_t(p)];
            todo.push_back(p);
          }
        }
      }
      float* S = summary_[std::size_t(layer)].get();
      std::uint8_t* K4 = codes_.empty() ? nullptr : codes_[std::size_t(layer)].get();
      detail::parallel_for(std::int64_t(todo.size()), opt_.num_threads, [&](std::int64_t i) {
        const std::int64_t p = todo[std::size_t(i)];
        for (std::int64_t h = 0; h < kh_; ++h) {
          float* a = S + (p * kh_ + h) * summary_floats();
          // int4: [min | max | step], the prefilter's two side by side
          detail::summarize_tile(opt_.score, detail::paged_tile(keys, h, p), bs_, d_, a, K4 ? a + 2 * d_ : a + d_,
                                 K4 ? K4 + (p * kh_ + h) * code_bytes() : nullptr, K4 ? a + d_ : nullptr);
        }
      });
      made_ += std::int64_t(todo.size());
    }
    std::vector<std::pair<std::int64_t, std::int64_t>> probe(rows.size(), {0, 0});
    const int threads = detail::resolve_threads(opt_.num_threads);
    // Fewer rows to score than threads (batch 1; or, with refresh, a step where most rows' kept
    // choices stand): each scoring row's work is split over the threads; the others are cheap.
    const auto scoring = std::int64_t(std::count(stands.begin(), stands.end(), std::uint8_t(0)));
    if (scoring < threads) {
      detail::BlockChoiceScratch w;
      for (std::size_t i = 0; i < rows.size(); ++i)
        probe[i] = choose(layer, keys, q_heads, rows[i], stands[i], w, threads);
    } else {
      detail::parallel_for_state<detail::BlockChoiceScratch>(
          std::int64_t(rows.size()), threads, [&](detail::BlockChoiceScratch& w, std::int64_t i) {
            probe[std::size_t(i)] = choose(layer, keys, q_heads, rows[std::size_t(i)], stands[std::size_t(i)], w, 1);
          });
    }
    for (const auto& [e, h] : probe) {
      probe_exact_ += e;
      probe_hit_ += h;
    }
  }

 private:
  struct SeqIndex {
    std::vector<std::int64_t> ids;  // physical blocks indexed, in logical order
    std::int64_t built = 0;         // step of the last build or append
    std::vector<ParisKV> heads;
  };
  struct Kept {                        // a sequence's last scored choice in one layer (refresh > 1)
    std::int64_t step = -1;            // the step it was scored
    std::vector<std::int64_t> blocks;  // chosen logical blocks, ascending
    std::vector<std::int64_t> ids;     // their physical ids then
  };

  bool uses_summaries() const noexcept {
    return opt_.score == BlockScore::quest || opt_.score == BlockScore::meanstd || opt_.score == BlockScore::int4;
  }
  std::int64_t code_bytes() const noexcept { return detail::int4_code_bytes(d_, bs_); }
  /// Floats of one (block, KV head) summary: (min, max) or (mean, spread); int4 (min, max, step).
  std::int64_t summary_floats() const noexcept { return (opt_.score == BlockScore::int4 ? 3 : 2) * d_; }
  float scale() const noexcept { return opt_.scale > 0 ? opt_.scale : 1.f / std::sqrt(float(d_)); }

  void check_row(const BlockSparseRow& r, std::size_t i, std::int64_t q_heads, const std::string& who) const {
    const std::string at = who + ": row " + std::to_string(i);
    if (r.tokens < 1) detail::throw_invalid(at + ": tokens must be >= 1 (got " + std::to_string(r.tokens) + ")");
    const std::int64_t nb = blocks_for(r.tokens, bs_);
    if (std::int64_t(r.table.size()) < nb)
      detail::throw_invalid(at + ": the table has " + std::to_string(r.table.size()) + " entries, " +
                            std::to_string(r.tokens) + " tokens need " + std::to_string(nb));
    for (std::int64_t b = 0; b < nb; ++b)
      if (r.table[std::size_t(b)] < 0 || r.table[std::size_t(b)] >= nb_)
        detail::throw_invalid(at + ": table[" + std::to_string(b) + "] = " + std::to_string(r.table[std::size_t(b)]) +
                              " out of range [0, " + std::to_string(nb_) + ")");
    const std::int64_t prot = detail::protected_blocks_of(r.tokens, bs_, opt_).count();
    if (r.attend < prot || r.attend > nb)
      detail::throw_invalid(at + ": attend " + std::to_string(r.attend) + " blocks out of range [" +
                            std::to_string(prot) + ", " + std::to_string(nb) + "] (protected .. all)");
    detail::check_query(r.query, q_heads * d_, at);
    if (r.out == nullptr) detail::throw_invalid(at + ": out is null");
  }

  /// The scores w.score [q_heads][C] of the row's candidates w.cand.
  template <class View>
  void score(std::int64_t l, const View& v, const BlockSparseRow& r, std::int64_t q_heads, BlockScore how,
             std::int64_t k, detail::BlockChoiceScratch& w, int threads) {
    const std::int64_t C = std::int64_t(w.cand.size()), G = q_heads / kh_;
    if (how == BlockScore::pariskv) {
      SeqIndex& s = index_of(l, v, r);
      detail::pariskv_scores(r.query, q_heads, d_, bs_, blocks_for(r.tokens, bs_), k * bs_,
                             [&](std::int64_t jq) -> const ParisKV& { return s.heads[std::size_t(jq / G)]; }, w);
      return;
    }
    const float* S = uses_summaries() ? summary_[std::size_t(l)].get() : nullptr;
    if (how == BlockScore::int4) {
      const std::uint8_t* K4 = codes_[std::size_t(l)].get();
      detail::int4_scores(r.query, q_heads, kh_, d_, bs_, opt_.prefilter * k, [&](std::int64_t c, std::int64_t h) {
        const std::int64_t p = r.table[std::size_t(w.cand[std::size_t(c)])];
        const float* a = S + (p * kh_ + h) * summary_floats();
        return std::tuple<const float*, const float*, const float*, const std::uint8_t*>{
            a, a + 2 * d_, a + d_, K4 + (p * kh_ + h) * code_bytes()};
      }, w, threads);
      return;
    }
    w.score.assign(std::size_t(q_heads * C), 0.f);
    w.acc.resize(std::size_t(bs_));
    for (std::int64_t c = 0; c < C; ++c) {
      const std::int64_t p = r.table[std::size_t(w.cand[std::size_t(c)])];
      for (std::int64_t h = 0; h < kh_; ++h)
        for (std::int64_t jq = h * G; jq < (h + 1) * G; ++jq) {
          float s;
          if (how == BlockScore::exact) {
            s = detail::exact_tile_score(r.query + jq * d_, detail::paged_tile(v, h, p), bs_, d_, w.acc.data());
          } else {
            const float* a = S + (p * kh_ + h) * summary_floats();
            s = detail::summary_score(how, r.query + jq * d_, a, a + d_, d_, z_);
          }
          w.score[std::size_t(jq * C + c)] = s;
        }
    }
  }

  /// The row's ParisKV indexes (one per KV head over the keys of its full blocks): rebuilt when
  /// a block they hold was written since (or the row's table no longer starts with their
  /// blocks), extended by the blocks filled since, in one append per head (the first one, the
  /// prompt's blocks, fixes each index's centre).
  template <class View>
  SeqIndex& index_of(std::int64_t l, const View& v, const BlockSparseRow& r) {
    SeqIndex& s = *seqs_[std::size_t(l)].at(std::int64_t(r.table[0]));
    const std::int64_t full = r.tokens / bs_;
    bool stale = std::int64_t(s.ids.size()) > full || s.heads.empty();
    for (std::size_t b = 0; b < s.ids.size() && !stale; ++b)
      stale = s.ids[b] != r.table[b] || written_[std::size_t(s.ids[b])] > s.built;
    if (stale) {
      s.ids.clear();
      s.heads.assign(std::size_t(kh_), ParisKV(d_, detail::block_sparse_pariskv_config()));
    }
    const std::int64_t have = std::int64_t(s.ids.size());
    if (full > have) {
      std::vector<float> rows(std::size_t((full - have) * bs_ * d_));
      for (std::int64_t h = 0; h < kh_; ++h) {
        for (std::int64_t b = have; b < full; ++b) {
          const auto x = detail::paged_tile(v, h, std::int64_t(r.table[std::size_t(b)]));
          float* dst = rows.data() + (b - have) * bs_ * d_;
          for (std::int64_t t = 0; t < bs_; ++t)
            for (std::int64_t j = 0; j < d_; ++j) dst[t * d_ + j] = x.at(t, j);
        }
        s.heads[std::size_t(h)].append(rows.data(), (full - have) * bs_, d_);
      }
      for (std::int64_t b = have; b < full; ++b) s.ids.push_back(r.table[std::size_t(b)]);
    }
    s.built = step_;
    return s;
  }

  /// The row's last scored choice in layer l stands this step (refresh > 1): it has one, it is
  /// fewer than `refresh` steps old, and its blocks are still the row's, unwritten since.
  bool kept_stands(std::int64_t l, const BlockSparseRow& r) const {
    const detail::ProtectedBlocks pb = detail::protected_blocks_of(r.tokens, bs_, opt_);
    const Kept& kept = *kept_[std::size_t(l)].at(std::int64_t(r.table[0]));
    return r.attend > pb.count() && kept.step >= 0 && step_ - kept.step < opt_.refresh && still_held(kept, r);
  }

  template <class View>
  std::pair<std::int64_t, std::int64_t> choose(std::int64_t l, const View& v, std::int64_t q_heads,
                                               const BlockSparseRow& r, bool stands, detail::BlockChoiceScratch& w,
                                               int threads) {
    const detail::ProtectedBlocks pb = detail::protected_blocks_of(r.tokens, bs_, opt_);
    const std::int64_t k = r.attend - pb.count();
    w.chosen.clear();
    std::pair<std::int64_t, std::int64_t> probe{0, 0};
    Kept* kept = opt_.refresh > 1 ? kept_[std::size_t(l)].at(std::int64_t(r.table[0])).get() : nullptr;
    if (stands) {
      // the last choice stands: its blocks that are not protected now, topped up (or cut) to k
      // with the newest candidates (the blocks the local window let go since)
      for (const std::int64_t b : kept->blocks)
        if (!pb.contains(b)) w.chosen.push_back(b);
      while (std::int64_t(w.chosen.size()) > k) w.chosen.erase(w.chosen.begin());  // the oldest go
      for (std::int64_t b = pb.local_begin - 1; std::int64_t(w.chosen.size()) < k && b >= pb.sink_end; --b)
        if (!std::binary_search(w.chosen.begin(), w.chosen.end(), b)) w.chosen.insert(std::lower_bound(w.chosen.begin(), w.chosen.end(), b), b);
      if (r.fresh) *r.fresh = 0;
      if (opt_.probe && k > 0) {  // what the kept choice misses of this step's exact choice
        detail::candidates(pb, w.cand);
        probe = probe_exact(l, v, q_heads, r, k, w, threads);
      }
      detail::write_choice(pb, w.chosen, r.table, r.out);
      return probe;
    }
    if (r.fresh) *r.fresh = 1;
    detail::candidates(pb, w.cand);
    if (k > 0) {
      std::int64_t qn = q_heads;
      BlockSparseRow rq = r;
      rq.query = detail::scoring_queries(r.query, q_heads, kh_, d_, opt_.group, w.meanq, qn);
      score(l, v, rq, qn, opt_.score, k, w, threads);
      detail::choose_top(qn, k, scale(), w, w.chosen);
      if (opt_.probe) probe = probe_exact(l, v, q_heads, r, k, w, threads);
    }
    if (kept != nullptr) {
      kept->step = step_;
      kept->blocks = w.chosen;
      kept->ids.clear();
      for (const std::int64_t b : w.chosen) kept->ids.push_back(r.table[std::size_t(b)]);
    }
    detail::write_choice(pb, w.chosen, r.table, r.out);
    return probe;
  }

  /// (k, how many of the exact score's top k over w.cand -- every query head's -- the choice
  /// w.chosen holds): the probe's count for one row and layer.
  template <class View>
  std::pair<std::int64_t, std::int64_t> probe_exact(std::int64_t l, const View& v, std::int64_t q_heads,
                                                    const BlockSparseRow& r, std::int64_t k,
                                                    detail::BlockChoiceScratch& w, int threads) {
    score(l, v, r, q_heads, BlockScore::exact, k, w, threads);
    detail::choose_top(q_heads, k, scale(), w, w.exact_chosen);
    std::int64_t hit = 0;
    for (const std::int64_t b : w.exact_chosen) hit += std::binary_search(w.chosen.begin(), w.chosen.end(), b);
    return {k, hit};
  }

  /// A kept choice's blocks are still the sequence's, unwritten since it was scored.
  bool still_held(const Kept& kept, const BlockSparseRow& r) const noexcept {
    const std::int64_t nb = blocks_for(r.tokens, bs_);
    for (std::size_t i = 0; i < kept.blocks.size(); ++i) {
      const std::int64_t b = kept.blocks[i];
      if (b >= nb || r.table[std::size_t(b)] != kept.ids[i] || written_[std::size_t(kept.ids[i])] > kept.step) return false;
    }
    return true;
  }

  std::int64_t L_, nb_, kh_, d_, bs_;
  BlockSparseOptions opt_;
  float z_ = 0.f;
  std::vector<std::unique_ptr<float[]>> summary_;        // per layer [num_blocks][kv_heads][2][head_dim]
  std::vector<std::unique_ptr<std::uint8_t[]>> codes_;   // int4, per layer [num_blocks][kv_heads][code_bytes]
  std::vector<std::vector<std::int64_t>> made_at_;       // per layer and block: the write step summarised (-1: none)
  std::vector<std::int64_t> written_;                    // per block: the step it was last written (0: never)
  std::vector<std::unordered_map<std::int64_t, std::unique_ptr<SeqIndex>>> seqs_;  // pariskv, per layer, by first block
  std::vector<std::unordered_map<std::int64_t, std::unique_ptr<Kept>>> kept_;      // refresh > 1, per layer, by first block
  std::int64_t step_ = 0, made_ = 0, probe_exact_ = 0, probe_hit_ = 0;
};

}  // namespace kvscore
