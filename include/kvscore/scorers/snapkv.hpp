// kvscore/scorers/snapkv.hpp — SnapKV (Li et al. 2024), the attention-based baseline:
// the tokens that the last `w` queries (the observation window) attend to are kept.
//
// Per KV head h, with the G = q_heads / kv_heads query heads of its group (contiguous:
// query heads h*G .. h*G+G-1, the Hugging Face repeat_kv order) and P = N - w:
//
//   p_{g,i}(t) = softmax_t(q_{g,i} · k_t / √d)  over the keys query i sees: t <= P + i
//                (query i of the window sits at position P + i; causal inside the window)
//   x(t)       = 1/(G·w) · Σ_g Σ_i p_{g,i}(t)                     mean over queries and group
//   score(t)   = 1/k · Σ_{|u-t| <= k/2, 0 <= u < P} x(u)   for t <  P   (avg pooling, kernel k = 5,
//                                                                       zero-padded, divisor k)
//   score(t)   = x(t)                                      for t >= P   (the window, not pooled)
//
// With `placement = QueryPlacement::after_cache` (queries that follow the cache, e.g. a decode
// step or held-out queries; scorer_base.hpp) P = N: every query sees every key, the whole
// cache is pooled, and nothing is protected (`protected_recent()` = 0); any window size works.
//
// Decisions (docs/methods/snapkv.md): pooling runs over the prefix [0, P) only (as kvpress does;
// window scores never leak into the prefix). The window tokens get their own mean
// attention x(t) — finite, never a sentinel; callers protect them with the selector's
// `recent = protected_recent()` (= w), a mask. N < w is an error. Softmax in fp32 logits
// with the row max subtracted, exp-sums and the mean accumulated in fp64.
//
// Invalid keys (fp32 squared norm not finite, scorer_base.hpp) take no part in any
// softmax (probability 0, so they add 0 to their neighbours' pooling) and score -inf.
// A non-finite logit of a valid key (|q|·|k| beyond fp32) is clamped: +inf to FLT_MAX
// (that key takes the query's mass), NaN dropped. A query that sees no valid key
// contributes nothing (its share 1/(G·w) is not redistributed).
//
// Cost per KV head: 2 passes over the keys (softmax statistics, then probabilities),
// each 2·G·w·N·d flops of dots and G·w·N exps (both from the kernel table, vectorised); the
// rows of a chunk are read from memory once and stay in L1 for the G·w queries.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kvscore/methods.hpp"
#include "kvscore/scorers/scorer_base.hpp"

namespace kvscore {


/// SnapKV (Li et al. 2024): each key is scored by the attention the last `window` queries of the prompt give it,
/// max-pooled over the prefix with an odd kernel; the window's own keys get their unpooled attention. Needs the
/// post-RoPE queries; GQA by shape.
class SnapKV : public ScorerOptions, public detail::AllocatingScore<SnapKV> {
 public:
  using detail::AllocatingScore<SnapKV>::score;

  static constexpr const char* name = "snapkv";  ///< the registry's CLI spelling
  static constexpr int passes = 2;  ///< reads of the keys per score()
  /// Observation window of the paper and of kvpress (queries the caller should capture).
  static constexpr std::int64_t kDefaultWindow = kDefaultSnapKVWindow;
  /// Average-pooling kernel of the paper's code and of kvpress.
  static constexpr std::int64_t kDefaultKernel = kDefaultSnapKVKernel;

  /// Pooling kernel over the prefix: odd, >= 1 (1 = no pooling). Default 5.
  std::int64_t kernel_size = kDefaultKernel;
  /// The queries are the cache's last `window` positions (default, kvpress) or follow the cache.
  QueryPlacement placement = QueryPlacement::in_cache;

  /// queries: [q_heads][window][head_dim] row-major fp32, the post-RoPE queries of the last
  /// `window` positions (query i at position N - window + i). Copied. `group` = q_heads /
  /// kv_heads, checked against the keys at score time; 0 = derive it from the keys.
  SnapKV(const float* queries, std::int64_t q_heads, std::int64_t window, std::int64_t head_dim,
         std::int64_t group = 0)
      : q_heads_(q_heads), window_(window), dim_(head_dim), group_(group) {
    detail::copy_query_window("kvscore::SnapKV", queries, q_heads, window, head_dim, group, queries_, scaled_);
  }

  std::int64_t q_heads() const noexcept { return q_heads_; }  ///< query heads of the window queries
  std::int64_t window() const noexcept { return window_; }  ///< queries per head (the observation window)
  std::int64_t head_dim() const noexcept { return dim_; }  ///< dimensions of a query
  /// The group size given to the constructor (0 = derived from the keys).
  std::int64_t group() const noexcept { return group_; }
  /// Queries as given, [q_heads][window][head_dim].
  const std::vector<float>& queries() const noexcept { return queries_; }
  /// q/√d rounded once to fp32, [q_heads][window][head_dim]: what the scores are computed from.
  const std::vector<float>& scaled_queries() const noexcept { return scaled_; }
  /// Tokens at the end of the cache that SnapKV always keeps (the observation window; 0 when
  /// the queries follow the cache): pass it to the selector, `SelectOptions::recent`.
  std::int64_t protected_recent() const noexcept { return placement == QueryPlacement::in_cache ? window_ : 0; }

  /// Throws std::invalid_argument unless these keys can be scored with these queries.
  template <class View>
  void check(const View& keys) const {
    const std::string who = "kvscore::SnapKV: ";
    const std::int64_t kv = keys.heads();
    detail::check_queries_match_keys(who, q_heads_, group_, dim_, kv, keys.head_dim());
    if (placement == QueryPlacement::in_cache && window_ > keys.tokens())
      detail::throw_invalid(who + "window " + std::to_string(window_) + " > tokens " +
                            std::to_string(keys.tokens()) + " (the window's queries sit at the last " +
                            std::to_string(window_) + " positions of the cache; pass at most N queries, or set "
                            "placement = QueryPlacement::after_cache for queries that follow the cache)");
    if (kernel_size < 1 || kernel_size % 2 == 0)
      detail::throw_invalid(who + "kernel_size must be odd and >= 1 (got " + std::to_string(kernel_size) + ")");
  }

  /// Scores `keys` into `out` ([kv_heads][tokens]); std::invalid_argument for shapes that do not match the queries.
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    detail::check_scores_shape(keys, out, name);
    check(keys);
    const simd::KernelTable& table = isa != nullptr ? *isa : simd::active_table();
    const std::int64_t heads = keys.heads(), n = keys.tokens();
    // All scratch is allocated here, outside the parallel region (nothing in it throws).
    const std::int64_t nq = q_heads_ / heads * window_;
    std::vector<double> acc(std::size_t(detail::checked_mul(heads, n, name)));
    std::vector<unsigned char> valid(acc.size());
    std::vector<float> mx(std::size_t(heads * nq));
    std::vector<double> sum(mx.size());
    detail::for_each_head(heads, num_threads, [&](std::int64_t h) {
      const std::size_t o = std::size_t(h * n), oq = std::size_t(h * nq);
      score_head(table, keys, h, out.head(h), acc.data() + o, valid.data() + o, mx.data() + oq, sum.data() + oq);
    });
  }

 private:
  /// Rows per chunk: ~32 KB of keys, so a chunk stays in L1 while every query reads it.
  static constexpr std::int64_t kMaxChunk = 512;
  static std::int64_t chunk_rows(std::int64_t d, std::size_t elem) noexcept {
    const std::int64_t c = std::int64_t(32768 / (std::size_t(d) * elem)) & ~std::int64_t(3);
    return std::clamp<std::int64_t>(c, 16, kMaxChunk);
  }

  /// Logits of query row q (already /√d) for m rows from `first`; invalid rows, NaN -> -inf,
  /// +inf -> FLT_MAX. Returns the max.
  template <class T>
  float logits(const simd::RowOps<T>& ops, const T* first, std::int64_t m, std::int64_t stride, const float* q,
               const unsigned char* valid, float* l) const noexcept {
    constexpr float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
    ops.dot(first, m, stride, dim_, q, l);
    float best = -inf;
    for (std::int64_t j = 0; j < m; ++j) {
      float x = l[j];
      x = (valid[j] && x == x) ? x : -inf;  // invalid row or NaN: left out
      x = x > big ? big : x;                // +inf: clamped
      l[j] = x;
      best = best < x ? x : best;
    }
    return best;
  }

  template <class View>
  void score_head(const simd::KernelTable& table, const View& keys, std::int64_t h, float* out, double* acc,
                  unsigned char* valid, float* mx, double* sum) const noexcept {
    using T = typename View::value_type;
    const simd::RowOps<T>& ops = table.ops<T>();
    const std::int64_t n = keys.tokens(), w = window_;
    const std::int64_t P = placement == QueryPlacement::in_cache ? n - w : n;  // queries at P + i
    const std::int64_t G = q_heads_ / keys.heads(), nq = G * w;
    const float* qh = scaled_.data() + h * nq * dim_;  // the group's queries, [G][w][d]
    const std::int64_t C = chunk_rows(dim_, sizeof(T));
    float l[kMaxChunk], e[kMaxChunk];

    std::fill(mx, mx + nq, -std::numeric_limits<float>::infinity());
    std::fill(sum, sum + nq, 0.0);
    std::fill(acc, acc + n, 0.0);

    // Calls f(first_row, t0, m, stride) for chunks of at most C rows, in token order.
    auto for_each_chunk = [&](auto&& f) {
      keys.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t len, std::int64_t stride) {
        for (std::int64_t i = 0; i < len; i += C) f(first + i * stride, t0 + i, std::min(C, len - i), stride);
      });
    };
    // Rows of the chunk [t0, t0+m) that query q sees (query i at position P + i sees t <= P + i).
    auto seen = [&](std::int64_t q, std::int64_t t0, std::int64_t m) {
      return std::clamp<std::int64_t>(P + q % w + 1 - t0, 0, m);
    };

    // Pass 1: validity, then per query the running max and the fp64 sum of exp(l - max).
    for_each_chunk([&](const T* first, std::int64_t t0, std::int64_t m, std::int64_t stride) {
      ops.sqnorm(first, m, stride, dim_, l);
      for (std::int64_t j = 0; j < m; ++j) valid[t0 + j] = std::isfinite(l[j]) ? 1 : 0;
      for (std::int64_t q = 0; q < nq; ++q) {
        const std::int64_t ms = seen(q, t0, m);
        if (ms == 0) continue;
        const float cm = logits(ops, first, ms, stride, qh + q * dim_, valid + t0, l);
        if (cm == -std::numeric_limits<float>::infinity()) continue;
        if (cm > mx[q]) {
          sum[q] *= std::exp(double(mx[q]) - double(cm));  // exp(-inf) = 0 on the first finite chunk
          mx[q] = cm;
        }
        table.exp_shifted(l, mx[q], ms, e);
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains: fp64 adds are latency-bound
        std::int64_t j = 0;
        for (; j + 4 <= ms; j += 4) {
          s0 += double(e[j]);
          s1 += double(e[j + 1]);
          s2 += double(e[j + 2]);
          s3 += double(e[j + 3]);
        }
        for (; j < ms; ++j) s0 += double(e[j]);
        sum[q] += (s0 + s1) + (s2 + s3);
      }
    });

    // Pass 2: the same logits again, p = exp(l - max) / sum, summed per token in fp64.
    for_each_chunk([&](const T* first, std::int64_t t0, std::int64_t m, std::int64_t stride) {
      for (std::int64_t q = 0; q < nq; ++q) {
        const std::int64_t ms = seen(q, t0, m);
        if (ms == 0 || !(sum[q] > 0)) continue;
        logits(ops, first, ms, stride, qh + q * dim_, valid + t0, l);
        table.exp_shifted(l, mx[q], ms, e);
        const double inv = 1.0 / sum[q];
        for (std::int64_t j = 0; j < ms; ++j) acc[t0 + j] += double(e[j]) * inv;
      }
    });

    // Mean over the G·w queries, pooling over the prefix, the window as is.
    const double mean = 1.0 / double(nq);
    const std::int64_t r = kernel_size / 2;
    const double pool = mean / double(kernel_size);
    for (std::int64_t t = 0; t < P; ++t) {
      double s = 0;
      for (std::int64_t u = std::max<std::int64_t>(0, t - r); u <= std::min(P - 1, t + r); ++u) s += acc[u];
      out[t] = valid[t] ? float(s * pool) : kInvalidScore;
    }
    for (std::int64_t t = std::max<std::int64_t>(P, 0); t < n; ++t)
      out[t] = valid[t] ? float(acc[t] * mean) : kInvalidScore;
  }

  std::vector<float> queries_, scaled_;
  std::int64_t q_heads_, window_, dim_, group_;
};

}  // namespace kvscore
