// kvscore/joint.hpp — joint token selection: ONE set of kept positions shared by every head of
// every layer, for token-granular caches that can only drop a token everywhere at once
// (llama.cpp's cells, removed with llama_memory_seq_rm; paged caches whose blocks hold all heads).
//
// [snippet joint-header: tests/test_snippets.cpp]
//   kvscore::JointOptions opt;  opt.sinks = 4;  opt.recent = 64;   // aggregate: max by default
//   std::vector<std::int64_t> kept = kvscore::select_joint(per_layer, 100, opt);   // ascending
//
// per_layer: std::vector<kvscore::Scores>, one [kv_heads][tokens] per layer; then
// kvscore::evicted_ranges(kept, tokens) (slots.hpp) gives the ranges to remove, e.g. with
// llama.cpp's llama_memory_seq_rm(mem, seq, r.begin, r.end).
//
// Rows. Every (layer, head) row of fp32 scores (higher = keep) is one voice; all rows have the
// same `tokens`. Scales differ between heads and layers (a K-norm row of layer 0 and one of
// layer 29 are not comparable), so each row is first z-normalised on its own, exactly as
// select()'s AdaKV `normalize`: z = float((double(x) - mean) * (1 / std)), mean and population
// std over the row's finite scores (double sums in 8 lanes, lane = position % 8); std 0 -> z = 0;
// +-inf and NaN pass through.
//
// Aggregation (JointAggregate), per token t over the rows r in order:
//   max   J(t) = max_r z_r(t), NaN rows skipped (all NaN -> NaN): a token survives if some head
//         of some layer ranks it high. The default: it keeps the most attention mass of the
//         three on SmolLM2 (docs/reference/joint.md has the measurement).
//   mean  J(t) = float(sum_r z_r(t) / count), double sum over the non-NaN rows (none -> NaN;
//         +inf and -inf both present -> NaN).
//   vote  every row runs select() with the same budget and protection; J(t) = the number of
//         rows that keep t. Equal votes rank by the mean aggregate, then by lower position.
//
// Then the rules of select() (kvscore/select.hpp) on the one aggregated row: an integer budget
// counts every kept token, the first `sinks` and last `recent` positions are always kept (a
// mask, counted inside the budget), higher J first, equal J -> lower position first, NaN below
// every number, -0.0 == +0.0; result ascending. budget > tokens, or more protected tokens than
// the budget, is an error; budget == tokens keeps everything.
//
// Deterministic for any thread count (num_threads parallelises the rows' statistics and votes;
// every token's aggregate is summed over the rows in row order). Cost: O(R * N) for R rows and N
// tokens, plus R select() calls for vote. Errors: std::invalid_argument naming the value.
// See docs/reference/joint.md.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/select.hpp"

namespace kvscore {

/// How per-row normalised scores become one score per token (see the top of this file).
enum class JointAggregate {
  max,   ///< max over rows of the z-scores (default)
  mean,  ///< mean over rows of the z-scores
  vote,  ///< rows whose own select() keeps the token; ties by the mean
};

/// "max", "mean" or "vote".
inline constexpr std::string_view joint_aggregate_name(JointAggregate a) noexcept {
  switch (a) {
    case JointAggregate::max: return "max";
    case JointAggregate::mean: return "mean";
    case JointAggregate::vote: return "vote";
  }
  return "?";
}

/// "max", "mean" or "vote"; anything else is std::invalid_argument naming it.
inline JointAggregate parse_joint_aggregate(std::string_view s) {
  for (JointAggregate a : {JointAggregate::max, JointAggregate::mean, JointAggregate::vote})
    if (s == joint_aggregate_name(a)) return a;
  detail::throw_invalid("kvscore: joint aggregate '" + std::string(s) + "' must be 'max', 'mean' or 'vote'");
}

/// Options of select_joint(). Every field is validated; a bad value throws std::invalid_argument.
struct JointOptions {
  std::int64_t sinks = 0;   ///< first positions always kept, >= 0
  std::int64_t recent = 0;  ///< last positions always kept, >= 0
  JointAggregate aggregate = JointAggregate::max;  ///< over the rows per token: max (default), mean or vote
  int num_threads = 0;      ///< threads over rows: 0 = OpenMP default, 1 = serial; same result for any value
  SelectKernels kernels = SelectKernels::best;  ///< select()'s kernels (same result)
};

namespace detail::joint {

inline constexpr const char* kWho = "kvscore::select_joint";

/// Row pointers of every (layer, head), validated: all layers have the same tokens.
inline std::vector<const float*> rows_of(std::span<const ConstScoresView> layers, std::int64_t* tokens) {
  if (layers.empty()) throw_invalid(std::string(kWho) + ": no layers (needs at least one score row)");
  const std::int64_t T = layers[0].tokens();
  std::vector<const float*> rows;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const ConstScoresView& v = layers[l];
    if (v.tokens() != T)
      throw_invalid(std::string(kWho) + ": layer " + std::to_string(l) + " has " + std::to_string(v.tokens()) +
                    " tokens, layer 0 has " + std::to_string(T) + " (one set of positions for every layer)");
    if (v.data() == nullptr && v.heads() > 0 && T > 0)
      throw_invalid(std::string(kWho) + ": layer " + std::to_string(l) + " has no data");
    for (std::int64_t h = 0; h < v.heads(); ++h) rows.push_back(v.head(h));
  }
  if (rows.empty()) throw_invalid(std::string(kWho) + ": the layers have no heads (needs at least one score row)");
  *tokens = T;
  return rows;
}

/// z-score of x with the row's constants (select()'s AdaKV normalisation; non-finite x unchanged).
inline float zscore(float x, double mean, double inv_std) noexcept {
  return std::isfinite(x) ? float((double(x) - mean) * inv_std) : x;
}

/// max or mean over rows of z, one token block at a time (rows read contiguously).
inline void aggregate(const std::vector<const float*>& rows, std::int64_t T, const std::vector<double>& mean,
                      const std::vector<double>& inv, JointAggregate how, int threads, float* out) {
  constexpr std::int64_t kBlock = 2048;
  const std::int64_t blocks = (T + kBlock - 1) / kBlock;
  const std::int64_t R = std::int64_t(rows.size());
  // Small inputs stay serial (a parallel region costs more than it saves).
  const int t = std::int64_t(rows.size()) * T < (std::int64_t(1) << 18) ? 1 : threads;
  parallel_for(blocks, t, [&](std::int64_t b) {
    const std::int64_t t0 = b * kBlock, n = std::min(kBlock, T - t0);
    if (how == JointAggregate::max) {
      float* m = out + t0;
      std::fill(m, m + n, std::numeric_limits<float>::quiet_NaN());
      for (std::int64_t r = 0; r < R; ++r) {
        const float* x = rows[std::size_t(r)] + t0;
        for (std::int64_t i = 0; i < n; ++i) {
          const float z = zscore(x[i], mean[std::size_t(r)], inv[std::size_t(r)]);
          if (!std::isnan(z) && (std::isnan(m[i]) || z > m[i])) m[i] = z;
        }
      }
    } else {
      std::vector<double> sum(std::size_t(n), 0.0);
      std::vector<std::int64_t> cnt(std::size_t(n), 0);
      for (std::int64_t r = 0; r < R; ++r) {
        const float* x = rows[std::size_t(r)] + t0;
        for (std::int64_t i = 0; i < n; ++i) {
          const float z = zscore(x[i], mean[std::size_t(r)], inv[std::size_t(r)]);
          if (std::isnan(z)) continue;
          sum[std::size_t(i)] += double(z);
          ++cnt[std::size_t(i)];
        }
      }
      for (std::int64_t i = 0; i < n; ++i)
        out[t0 + i] = cnt[std::size_t(i)] == 0 ? std::numeric_limits<float>::quiet_NaN()
                                               : float(sum[std::size_t(i)] / double(cnt[std::size_t(i)]));
    }
  });
}

/// a ranks before b: higher (votes, then mean; NaN mean lowest), then lower position.
struct VoteOrder {
  const std::int32_t* votes;
  const float* mean;
  bool operator()(std::int64_t a, std::int64_t b) const noexcept {
    if (votes[a] != votes[b]) return votes[a] > votes[b];
    const float ma = mean[a], mb = mean[b];
    const bool na = std::isnan(ma), nb = std::isnan(mb);
    if (na != nb) return nb;
    if (!na && ma != mb) return ma > mb;
    return a < b;
  }
};

inline std::vector<std::int64_t> select_joint_impl(std::span<const ConstScoresView> layers, std::int64_t budget,
                                                    const JointOptions& opt) {
  const std::string who = kWho;
  if (opt.aggregate != JointAggregate::max && opt.aggregate != JointAggregate::mean &&
      opt.aggregate != JointAggregate::vote)
    throw_invalid(who + ": unknown JointAggregate value");
  if (opt.num_threads < 0)
    throw_invalid(who + ": num_threads must be >= 0 (got " + std::to_string(opt.num_threads) + ")");
  std::int64_t T = 0;
  const std::vector<const float*> rows = rows_of(layers, &T);
  if (budget < 0) throw_invalid(who + ": budget must be >= 0 (got " + std::to_string(budget) + ")");
  if (budget > T)
    throw_invalid(who + ": budget of " + std::to_string(budget) + " tokens exceeds the " + std::to_string(T) +
                  " tokens of the cache (k > N)");
  SelectOptions so;
  so.sinks = opt.sinks;
  so.recent = opt.recent;
  so.kernels = opt.kernels;
  so.num_threads = 1;
  // The budget, protection and kernel rules are select()'s: its plan validates them (its
  // messages name the offending sinks / recent / budget).
  const sel::Plan plan = [&] {
    try {
      return sel::make_plan(1, T, Budget::per_head(budget), so);
    } catch (const std::invalid_argument& e) {
      std::string m = e.what();
      const std::string sel_who = "kvscore::select: ";
      if (m.rfind(sel_who, 0) == 0) m.erase(0, sel_who.size());
      throw_invalid(who + ": " + m);
    }
  }();
  const std::int64_t R = std::int64_t(rows.size()), s0 = plan.sink_end, e0 = plan.recent_begin;
  if (budget == T || budget == plan.protect) {  // everything, or exactly the protected tokens
    std::vector<std::int64_t> out;
    for (std::int64_t t = 0; t < T; ++t)
      if (budget == T || t < s0 || t >= e0) out.push_back(t);
    return out;
  }

  // 1. Each row's normalisation constants (select()'s z-score), rows in parallel.
  const int threads = resolve_threads(opt.num_threads);
  const sel::Passes<float>& P = sel::passes<float>(opt.kernels);
  std::vector<double> mean(static_cast<std::size_t>(R)), inv(static_cast<std::size_t>(R));
  parallel_for(R, R * T < (std::int64_t(1) << 16) ? 1 : threads, [&](std::int64_t r) {
    sel::znorm_params(P, rows[std::size_t(r)], T, &mean[std::size_t(r)], &inv[std::size_t(r)]);
  });

  // 2. max / mean: one aggregated row, then select() on it.
  Scores agg(1, T);
  aggregate(rows, T, mean, inv, opt.aggregate == JointAggregate::max ? JointAggregate::max : JointAggregate::mean,
            threads, agg.data());
  if (opt.aggregate != JointAggregate::vote) {
    Selection s = select(agg, Budget::per_head(budget), so);
    return std::move(s.positions);
  }

  // 3. vote: every row's own select(), counted on the unprotected positions.
  std::vector<std::vector<std::int64_t>> kept(static_cast<std::size_t>(R));
  parallel_for(R, R * T < (std::int64_t(1) << 16) ? 1 : threads, [&](std::int64_t r) {
    kept[std::size_t(r)] = select(ConstScoresView(rows[std::size_t(r)], 1, T), Budget::per_head(budget), so).positions;
  });
  std::vector<std::int32_t> votes(std::size_t(T), 0);
  for (const auto& k : kept)
    for (const std::int64_t t : k) ++votes[std::size_t(t)];
  std::vector<std::int64_t> cand;
  cand.reserve(std::size_t(e0 - s0));
  for (std::int64_t t = s0; t < e0; ++t) cand.push_back(t);
  const std::int64_t m = budget - plan.protect;  // 0 < m < e0 - s0 here
  const VoteOrder order{votes.data(), agg.data()};
  std::nth_element(cand.begin(), cand.begin() + m, cand.end(), order);
  cand.resize(std::size_t(m));
  std::vector<std::int64_t> out;
  out.reserve(std::size_t(budget));
  for (std::int64_t t = 0; t < s0; ++t) out.push_back(t);
  std::sort(cand.begin(), cand.end());
  out.insert(out.end(), cand.begin(), cand.end());
  for (std::int64_t t = e0; t < T; ++t) out.push_back(t);
  return out;
}

}  // namespace detail::joint

/// One set of kept positions (ascending) for every head of every layer: `layers[l]` holds the
/// scores [heads][tokens] of layer l (heads may differ between layers; tokens may not).
inline std::vector<std::int64_t> select_joint(std::span<const ConstScoresView> layers, std::int64_t budget,
                                              const JointOptions& opt = {}) {
  return detail::joint::select_joint_impl(layers, budget, opt);
}
/// The same from owning scores, one per layer.
inline std::vector<std::int64_t> select_joint(std::span<const Scores> layers, std::int64_t budget,
                                              const JointOptions& opt = {}) {
  std::vector<ConstScoresView> views;
  views.reserve(layers.size());
  for (const Scores& s : layers) views.push_back(s.view());
  return detail::joint::select_joint_impl(views, budget, opt);
}
/// One layer (or all rows stacked in one [rows][tokens] view).
inline std::vector<std::int64_t> select_joint(const ConstScoresView& rows, std::int64_t budget,
                                              const JointOptions& opt = {}) {
  return detail::joint::select_joint_impl(std::span<const ConstScoresView>(&rows, 1), budget, opt);
}

// ---------------------------------------------------------------- whole blocks (paged caches)
//
// A paged cache (vLLM) frees memory a block at a time: a block of `block_size` consecutive
// positions holds them for every head of every layer, so the keep list is a list of blocks.
//
//   J(t)     the joint token score above (max or mean over the z-normalised rows; vote is
//            not available here: it needs every row's own token budget);
//   B(i)     the block aggregate of J over the positions [i*bs, min((i+1)*bs, tokens)) of block i:
//            mean (default: a block is as good as its average token) or max; NaN tokens skipped
//            (all NaN -> NaN), mean summed in double in position order;
//   keep     `budget` blocks (every kept block counts): the blocks holding a position < sinks or
//            >= tokens - recent and a partial last block are always kept (a mask, inside the
//            budget); the others by higher B, equal B -> lower block index, NaN below every
//            number. Result: ascending logical block indices.
//
// Split over ranks (tensor parallelism: each rank holds some kv heads of every layer, the
// block table is shared): every rank calls joint_partial() on its own rows (z-normalisation is
// per row, so a rank needs nothing from the others), and ONE place -- vLLM's scheduler --
// calls combine_partials() on all the partials and decides with select_blocks(). With max the
// result equals select_joint_blocks() on all rows together for any split; with mean the
// double sums are added in partial order (equal up to double rounding; exact for one partial).
//
// select_joint_blocks(layers, bs, budget, opt) == select_blocks(block_scores(
//     combine_partials({joint_partial(layers, opt)}, opt), bs, opt), tokens, bs, budget, opt).

/// How the joint scores J(t) of a block's positions become the block's score.
enum class BlockAggregate {
  mean,  ///< mean of J over the block's positions (default)
  max,   ///< max of J over the block's positions
};

/// "mean" or "max".
inline constexpr std::string_view block_aggregate_name(BlockAggregate a) noexcept {
  return a == BlockAggregate::max ? "max" : a == BlockAggregate::mean ? "mean" : "?";
}

/// "mean" or "max"; anything else is std::invalid_argument naming it.
inline BlockAggregate parse_block_aggregate(std::string_view s) {
  for (BlockAggregate a : {BlockAggregate::mean, BlockAggregate::max})
    if (s == block_aggregate_name(a)) return a;
  detail::throw_invalid("kvscore: block aggregate '" + std::string(s) + "' must be 'mean' or 'max'");
}

/// Options of the block-granular joint selection.
struct BlockJointOptions {
  std::int64_t sinks = 0;   ///< positions [0, sinks) always kept (their blocks), >= 0
  std::int64_t recent = 0;  ///< positions [tokens - recent, tokens) always kept (their blocks), >= 0
  JointAggregate aggregate = JointAggregate::max;      ///< over rows: max or mean (vote: error)
  BlockAggregate block_aggregate = BlockAggregate::mean;  ///< over a block's positions
  int num_threads = 0;      ///< threads over rows (same result for any value)
};

/// One rank's share of the joint token scores: over its rows, per position, the max of the
/// z-scores (NaN where every row is NaN), their double sum and the count of non-NaN rows.
struct JointPartial {
  std::int64_t tokens = 0;  ///< positions of the sequence
  std::int64_t rows = 0;  ///< rows (layer, head) the partial covers
  std::vector<float> max;  ///< per position: the max of the rows' z-scores (NaN where every row is NaN)
  std::vector<double> sum;  ///< per position: the sum of the rows' z-scores, in double
  std::vector<std::int64_t> count;  ///< per position: the rows whose z-score is a number
};

namespace detail::joint {

inline constexpr const char* kBlockWho = "kvscore::select_joint_blocks";

inline void check_block_options(const BlockJointOptions& opt, const char* who) {
  if (opt.aggregate != JointAggregate::max && opt.aggregate != JointAggregate::mean)
    throw_invalid(std::string(who) + ": aggregate must be 'max' or 'mean' for blocks (got '" +
                  std::string(joint_aggregate_name(opt.aggregate)) + "')");
  if (opt.block_aggregate != BlockAggregate::mean && opt.block_aggregate != BlockAggregate::max)
    throw_invalid(std::string(who) + ": unknown BlockAggregate value");
  if (opt.sinks < 0) throw_invalid(std::string(who) + ": sinks must be >= 0 (got " + std::to_string(opt.sinks) + ")");
  if (opt.recent < 0)
    throw_invalid(std::string(who) + ": recent must be >= 0 (got " + std::to_string(opt.recent) + ")");
  if (opt.num_threads < 0)
    throw_invalid(std::string(who) + ": num_threads must be >= 0 (got " + std::to_string(opt.num_threads) + ")");
}

}  // namespace detail::joint

/// This rank's partial over its rows (layers[l]: [heads][tokens] of layer l, as select_joint).
inline JointPartial joint_partial(std::span<const ConstScoresView> layers, const BlockJointOptions& opt = {}) {
  using namespace detail::joint;
  check_block_options(opt, "kvscore::joint_partial");
  std::int64_t T = 0;
  const std::vector<const float*> rows = rows_of(layers, &T);
  const std::int64_t R = std::int64_t(rows.size());
  const int threads = detail::resolve_threads(opt.num_threads);
  const detail::sel::Passes<float>& P = detail::sel::passes<float>(SelectKernels::best);
  std::vector<double> mean(static_cast<std::size_t>(R)), inv(static_cast<std::size_t>(R));
  detail::parallel_for(R, R * T < (std::int64_t(1) << 16) ? 1 : threads, [&](std::int64_t r) {
    detail::sel::znorm_params(P, rows[std::size_t(r)], T, &mean[std::size_t(r)], &inv[std::size_t(r)]);
  });
  JointPartial out;
  out.tokens = T;
  out.rows = R;
  out.max.assign(std::size_t(T), std::numeric_limits<float>::quiet_NaN());
  out.sum.assign(std::size_t(T), 0.0);
  out.count.assign(std::size_t(T), 0);
  constexpr std::int64_t kBlock = 2048;
  detail::parallel_for((T + kBlock - 1) / kBlock, R * T < (std::int64_t(1) << 18) ? 1 : threads, [&](std::int64_t b) {
    const std::int64_t t0 = b * kBlock, n = std::min(kBlock, T - t0);
    for (std::int64_t r = 0; r < R; ++r) {
      const float* x = rows[std::size_t(r)] + t0;
      for (std::int64_t i = 0; i < n; ++i) {
        const float z = zscore(x[i], mean[std::size_t(r)], inv[std::size_t(r)]);
        if (std::isnan(z)) continue;
        const std::size_t t = std::size_t(t0 + i);
        if (std::isnan(out.max[t]) || z > out.max[t]) out.max[t] = z;
        out.sum[t] += double(z);
        ++out.count[t];
      }
    }
  });
  return out;
}
/// The same from owning scores, one per layer.
inline JointPartial joint_partial(std::span<const Scores> layers, const BlockJointOptions& opt = {}) {
  std::vector<ConstScoresView> views;
  views.reserve(layers.size());
  for (const Scores& s : layers) views.push_back(s.view());
  return joint_partial(std::span<const ConstScoresView>(views), opt);
}

/// J(t) of all ranks' partials (same tokens): max of the maxima, or float(sum of sums / sum of
/// counts) added in partial order. NaN where no row of any partial has a number.
inline std::vector<float> combine_partials(std::span<const JointPartial> parts, const BlockJointOptions& opt = {}) {
  const char* who = "kvscore::combine_partials";
  detail::joint::check_block_options(opt, who);
  if (parts.empty()) detail::throw_invalid(std::string(who) + ": no partials (needs one per rank)");
  const std::int64_t T = parts[0].tokens;
  for (std::size_t p = 0; p < parts.size(); ++p) {
    const JointPartial& q = parts[p];
    if (q.tokens != T)
      detail::throw_invalid(std::string(who) + ": partial " + std::to_string(p) + " has " + std::to_string(q.tokens) +
                            " tokens, partial 0 has " + std::to_string(T));
    if (std::int64_t(q.max.size()) != T || std::int64_t(q.sum.size()) != T || std::int64_t(q.count.size()) != T)
      detail::throw_invalid(std::string(who) + ": partial " + std::to_string(p) + " has arrays of the wrong length");
  }
  std::vector<float> J(std::size_t(T), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t t = 0; t < T; ++t) {
    const std::size_t i = std::size_t(t);
    if (opt.aggregate == JointAggregate::max) {
      for (const JointPartial& q : parts)
        if (!std::isnan(q.max[i]) && (std::isnan(J[i]) || q.max[i] > J[i])) J[i] = q.max[i];
    } else {
      double s = 0.0;
      std::int64_t c = 0;
      for (const JointPartial& q : parts) {
        s += q.sum[i];
        c += q.count[i];
      }
      if (c > 0) J[i] = float(s / double(c));
    }
  }
  return J;
}

/// B(i) for every block of `block_size` positions of the joint row J (the last block may be partial).
inline std::vector<float> block_scores(std::span<const float> joint, std::int64_t block_size,
                                       const BlockJointOptions& opt = {}) {
  const char* who = "kvscore::block_scores";
  detail::joint::check_block_options(opt, who);
  if (block_size <= 0)
    detail::throw_invalid(std::string(who) + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
  const std::int64_t T = std::int64_t(joint.size()), nb = (T + block_size - 1) / block_size;
  std::vector<float> B(std::size_t(nb), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t t0 = b * block_size, t1 = std::min(T, t0 + block_size);
    double s = 0.0;
    std::int64_t c = 0;
    float m = std::numeric_limits<float>::quiet_NaN();
    for (std::int64_t t = t0; t < t1; ++t) {
      const float x = joint[std::size_t(t)];
      if (std::isnan(x)) continue;
      s += double(x);
      ++c;
      if (std::isnan(m) || x > m) m = x;
    }
    if (c > 0) B[std::size_t(b)] = opt.block_aggregate == BlockAggregate::max ? m : float(s / double(c));
  }
  return B;
}

/// Number of blocks that select_blocks() always keeps (sinks, recent, a partial last block).
inline std::int64_t protected_blocks(std::int64_t tokens, std::int64_t block_size, std::int64_t sinks,
                                     std::int64_t recent) {
  if (tokens <= 0 || block_size <= 0) return 0;
  const std::int64_t nb = (tokens + block_size - 1) / block_size;
  std::int64_t n = 0;
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t t0 = b * block_size, t1 = std::min(tokens, t0 + block_size);
    if (t0 < sinks || t1 > tokens - recent || t1 - t0 < block_size) ++n;
  }
  return n;
}

/// The kept blocks (ascending logical indices) of a sequence of `tokens` positions, from its
/// block scores (one per block: ceil(tokens / block_size)). Errors name the value.
inline std::vector<std::int64_t> select_blocks(std::span<const float> scores, std::int64_t tokens,
                                               std::int64_t block_size, std::int64_t budget,
                                               const BlockJointOptions& opt = {}) {
  const std::string who = "kvscore::select_blocks";
  detail::joint::check_block_options(opt, who.c_str());
  if (block_size <= 0) detail::throw_invalid(who + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
  if (tokens < 0) detail::throw_invalid(who + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  const std::int64_t nb = (tokens + block_size - 1) / block_size;
  if (std::int64_t(scores.size()) != nb)
    detail::throw_invalid(who + ": " + std::to_string(scores.size()) + " block scores for " + std::to_string(tokens) +
                          " tokens in blocks of " + std::to_string(block_size) + " (needs " + std::to_string(nb) + ")");
  if (budget < 0 || budget > nb)
    detail::throw_invalid(who + ": budget of " + std::to_string(budget) + " blocks out of range [0, " +
                          std::to_string(nb) + "]");
  const std::int64_t prot = protected_blocks(tokens, block_size, opt.sinks, opt.recent);
  if (budget < prot)
    detail::throw_invalid(who + ": budget of " + std::to_string(budget) + " blocks is below the " + std::to_string(prot) +
                          " protected blocks (sinks " + std::to_string(opt.sinks) + ", recent " +
                          std::to_string(opt.recent) + ", partial last block)");
  std::vector<std::int64_t> keep, cand;
  for (std::int64_t b = 0; b < nb; ++b) {
    const std::int64_t t0 = b * block_size, t1 = std::min(tokens, t0 + block_size);
    (t0 < opt.sinks || t1 > tokens - opt.recent || t1 - t0 < block_size ? keep : cand).push_back(b);
  }
  const std::int64_t m = budget - prot;
  auto above = [&](std::int64_t a, std::int64_t b) {
    const float x = scores[std::size_t(a)], y = scores[std::size_t(b)];
    const bool nx = std::isnan(x), ny = std::isnan(y);
    if (nx != ny) return ny;
    if (!nx && x != y) return x > y;
    return a < b;
  };
  std::nth_element(cand.begin(), cand.begin() + m, cand.end(), above);
  keep.insert(keep.end(), cand.begin(), cand.begin() + m);
  std::sort(keep.begin(), keep.end());
  return keep;
}

/// All of it on one process's rows: the kept blocks of `budget` (see the top of this section).
inline std::vector<std::int64_t> select_joint_blocks(std::span<const ConstScoresView> layers, std::int64_t block_size,
                                                     std::int64_t budget, const BlockJointOptions& opt = {}) {
  using namespace detail::joint;
  check_block_options(opt, kBlockWho);
  if (block_size <= 0)
    detail::throw_invalid(std::string(kBlockWho) + ": block_size must be > 0 (got " + std::to_string(block_size) + ")");
  const JointPartial p = joint_partial(layers, opt);
  const std::vector<float> J = combine_partials(std::span<const JointPartial>(&p, 1), opt);
  const std::vector<float> B = block_scores(J, block_size, opt);
  return select_blocks(B, p.tokens, block_size, budget, opt);
}
/// The same from owning scores, one per layer.
inline std::vector<std::int64_t> select_joint_blocks(std::span<const Scores> layers, std::int64_t block_size,
                                                     std::int64_t budget, const BlockJointOptions& opt = {}) {
  std::vector<ConstScoresView> views;
  views.reserve(layers.size());
  for (const Scores& s : layers) views.push_back(s.view());
  return select_joint_blocks(std::span<const ConstScoresView>(views), block_size, budget, opt);
}

}  // namespace kvscore
