// kvscore/eval/metrics.hpp — quality metrics of a compressed KV cache against full attention.
//
// For one query q (post-RoPE, the scale 1/√d applied here) against one KV head's keys
// k_0..k_{N-1} and values v_0..v_{N-1}:
//
//   l_t      = q·k_t / √d                         logits, fp64 (products and sums in double)
//   p_t      = exp(l_t - lse),  lse = log Σ_u exp(l_u)     full-attention probabilities
//   o_full   = Σ_t p_t v_t                         full attention output
//   o_kept   = Σ_{t∈S} exp(l_t - m_S) v_t / Σ_{t∈S} exp(l_t - m_S),  m_S = max_{t∈S} l_t
//              (softmax over the kept set S only: what the engine computes after eviction)
//
//   attention_mass_recall(S) = Σ_{t∈S} p_t                      in [0, 1], 1 = nothing lost
//   output_rel_error(S)      = ‖o_kept − o_full‖₂ / ‖o_full‖₂   0 = exact
//   topk_overlap(S)          = |S ∩ T_k| / k,  k = |S|, T_k = the k tokens of largest p
//                              (ties: lower position first), i.e. the share of the oracle's
//                              choice at the same budget that S recovers, in [0, 1]
//
// Decisions (docs/reference/evaluate.md):
//   * no causal mask: the queries are those that attend after compression, so they see
//     every cached token;
//   * ‖o_full‖ = 0 (all-zero values): the error is the absolute ‖o_kept − o_full‖;
//   * an empty S: recall 0, overlap 1 (k = 0, nothing to recover), output error 1
//     (o_kept = 0 by convention) — the evaluator never asks for it (keep > 0);
//   * S must be ascending, without duplicates, inside [0, N) — otherwise invalid_argument.
//
// HeadReference holds the logits, lse, o_full and the rank of every token for all rows
// (query head × query) of one KV head, so that each (method, budget) costs O(|S|·d_v) per
// row instead of O(N·d). Logits come from one Eigen GEMM in double.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/detail/compiled.hpp"
#include "kvscore/detail/selection_check.hpp"

namespace kvscore::eval {

namespace detail {
[[noreturn]] inline void invalid(const std::string& m) { throw std::invalid_argument(m); }

}  // namespace detail

/// log Σ exp(l_t) of n logits (max subtracted; fp64). n must be > 0.
inline double log_sum_exp(const double* l, std::int64_t n) {
  double m = -INFINITY;
  for (std::int64_t t = 0; t < n; ++t) m = std::max(m, l[t]);
  double s = 0;
  for (std::int64_t t = 0; t < n; ++t) s += std::exp(l[t] - m);
  return m + std::log(s);
}

/// Σ_{t∈S} exp(l_t − lse): the full-attention mass on the kept positions.
inline double attention_mass_recall(const double* logits, double lse, std::span<const std::int64_t> kept) {
  double s = 0;
  for (const std::int64_t t : kept) s += std::exp(logits[t] - lse);
  return std::min(s, 1.0);  // rounding can exceed 1 by a few ulps when S is everything
}

/// out[j] = Σ_{t∈S} w_t v_t[j] / Σ w_t with w_t = exp(l_t − max_S l). values: rows of dv
/// floats, `value_stride` floats apart. An empty S gives 0.
inline void kept_attention_output(const double* logits, std::span<const std::int64_t> kept, const float* values,
                                  std::int64_t value_stride, std::int64_t dv, double* out) {
  std::fill(out, out + dv, 0.0);
  if (kept.empty()) return;
  double m = -INFINITY;
  for (const std::int64_t t : kept) m = std::max(m, logits[t]);
  double s = 0;
  for (const std::int64_t t : kept) {
    const double w = std::exp(logits[t] - m);
    s += w;
    const float* v = values + t * value_stride;
    for (std::int64_t j = 0; j < dv; ++j) out[j] += w * double(v[j]);
  }
  for (std::int64_t j = 0; j < dv; ++j) out[j] /= s;
}

/// ‖a − ref‖₂ / ‖ref‖₂ over d entries; ‖ref‖ = 0 gives the absolute ‖a − ref‖₂.
inline double relative_error(const double* a, const double* ref, std::int64_t d) {
  double num = 0, den = 0;
  for (std::int64_t j = 0; j < d; ++j) {
    const double e = a[j] - ref[j];
    num += e * e;
    den += ref[j] * ref[j];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// rank[t] = place of token t when tokens are ordered by logit descending, ties by lower
/// position (rank 0 = most attended).
inline void attention_ranks(const double* logits, std::int64_t n, std::int32_t* rank) {
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  for (std::int64_t i = 0; i < n; ++i) rank[order[std::size_t(i)]] = std::int32_t(i);
}

/// |S ∩ T_k| / k with k = |S| (1 for an empty S), from attention_ranks().
inline double topk_overlap(const std::int32_t* rank, std::span<const std::int64_t> kept) {
  if (kept.empty()) return 1.0;
  const auto k = std::int64_t(kept.size());
  std::int64_t hit = 0;
  for (const std::int64_t t : kept) hit += rank[t] < k;
  return double(hit) / double(k);
}

/// The three metrics of one query row and one kept set.
struct RowMetrics {
  double recall = 0;     ///< attention-mass recall
  double rel_error = 0;  ///< relative output error
  double overlap = 0;    ///< top-k overlap
};

/// Full-attention reference of one KV head for `rows` queries (e.g. the G query heads of a
/// GQA group × n_q queries): logits, lse, o_full and ranks per row.
class HeadReference {
 public:
  HeadReference() = default;

  /// keys: N rows of d floats, key_stride apart; values: N rows of dv floats, value_stride
  /// apart; queries: `rows` rows of d floats, query_stride apart. Inputs must be finite
  /// (the evaluator checks them first). N >= 1.
  HeadReference(const float* keys, std::int64_t key_stride, const float* values, std::int64_t value_stride,
                const float* queries, std::int64_t query_stride, std::int64_t rows, std::int64_t n, std::int64_t d,
                std::int64_t dv);

  std::int64_t rows() const noexcept { return rows_; }  ///< query rows
  std::int64_t tokens() const noexcept { return n_; }  ///< keys (N)
  std::int64_t value_dim() const noexcept { return dv_; }  ///< dimensions of a value
  /// Row r's logits q·k/√d, [N], fp64.
  const double* logit_row(std::int64_t r) const noexcept { return logits_.data() + r * n_; }
  double lse(std::int64_t r) const noexcept { return lse_[std::size_t(r)]; }  ///< row r's log-sum-exp of the logits
  /// Row r's full-attention output, [value_dim], fp64.
  const double* full_output(std::int64_t r) const noexcept { return out_.data() + r * dv_; }
  /// Row r's rank of each key by logit (0 = the highest).
  const std::int32_t* ranks(std::int64_t r) const noexcept { return ranks_.data() + r * n_; }
  /// p_t of row r.
  double prob(std::int64_t r, std::int64_t t) const noexcept { return std::exp(logit_row(r)[t] - lse(r)); }

  /// Metrics of row r for the kept set S (validated: ascending, unique, in range).
  /// `approx_output` (dv values) replaces the kept-softmax output when given (hybrid methods).
  RowMetrics row_metrics(std::int64_t r, std::span<const std::int64_t> kept,
                         const double* approx_output = nullptr) const {
    kvscore::detail::require_ascending(kept, n_, "kvscore::eval::HeadReference::row_metrics");
    RowMetrics m;
    m.recall = attention_mass_recall(logit_row(r), lse(r), kept);
    m.overlap = topk_overlap(ranks(r), kept);
    if (approx_output != nullptr) {
      m.rel_error = relative_error(approx_output, full_output(r), dv_);
    } else {
      std::vector<double> o(static_cast<std::size_t>(dv_));
      kept_attention_output(logit_row(r), kept, values_, value_stride_, dv_, o.data());
      m.rel_error = relative_error(o.data(), full_output(r), dv_);
    }
    return m;
  }

 private:
  std::int64_t rows_ = 0, n_ = 0, dv_ = 0;
  const float* values_ = nullptr;
  std::int64_t value_stride_ = 0;
  std::vector<double> logits_, lse_, out_;
  std::vector<std::int32_t> ranks_;
};

}  // namespace kvscore::eval

#if !defined(KVSCORE_COMPILED)
#include "kvscore/eval/metrics_impl.hpp"
#endif
