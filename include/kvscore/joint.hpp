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
//         three on SmolLM2 (docs/joint.md has the measurement).
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
// See docs/joint.md.
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
  JointAggregate aggregate = JointAggregate::max;
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

}  // namespace kvscore
