// kvscore/scorers/kvzip.hpp — KVzip (Kim et al. 2025, "KVzip: Query-Agnostic KV Cache
// Compression with Context Reconstruction"): each cached token is scored by the attention it
// receives from a set of queries — in KVzip, the queries of a second forward pass in which the
// model reconstructs the context from its cache ("Repeat the previous context exactly." + the
// context). The scorer itself takes any set of post-RoPE queries (a reconstruction pass, a
// SnapKV window, a question); docs/methods/kvzip.md has the algorithm around it.
//
// Per KV head h, with the G = q_heads / kv_heads query heads of its group (contiguous, the
// Hugging Face repeat_kv order) and m queries, query i of head g sees the key set
//
//   S_i = sinks [0, s) ∪ span [b, e) ∪ own rows [0, i]        (s = min(sinks, b))
//
// where the own rows are the queries' own keys (query i sits at own row i: causal), and
//
//   p_{g,i}(t) = exp(q_{g,i}·k_t/√d) / Σ_{u ∈ S_i} exp(q_{g,i}·k_u/√d)       t ∈ S_i
//   score(t)   = max_{g,i} α_i β_{g,t} p_{g,i}(t)       (aggregate = max: KVzip)
//              = 1/(G·m) Σ_{g,i} α_i β_{g,t} p_{g,i}(t)  (aggregate = mean)
//
// for the span's rows t ∈ [b, e) (α_i: query weights, β_{g,t}: key weights, default 1; KVzip+
// uses α_i = 1/‖h_i‖ and β_{g,t} = ‖W_O^{(g)} v_t‖). score_span() runs one such pass: kvpress's
// KVzipPress scores the context in chunks, one reconstruction pass per chunk [b, e), with its
// first n_sink cache rows as sinks, and writes only the chunk's scores.
//
// score(keys) is the registry's form (make_scorer, the CLI, the evaluator): with
// `placement = in_cache` the queries are the cache's last w rows (P = N − w): span [0, P), own
// rows [P, N), and the window rows are scored too, by the attention they receive from the later
// window queries (causal); protected_recent() = w. With `after_cache` every query sees every
// key (span [0, N), no own rows) and nothing is protected.
//
// Decisions (docs/methods/kvzip.md): the softmax is over S_i only, as kvpress computes it (not over the
// whole cache the model attended to); invalid keys (fp32 squared norm not finite,
// scorer_base.hpp) take no part in any softmax and score -inf; a +inf logit is clamped to
// FLT_MAX and a NaN logit dropped (as SnapKV); a query that sees no valid key adds nothing.
//
// Cost and numerics: the keys a head's queries see are widened to fp32 once (one contiguous
// copy, invalid rows zeroed, packed in panels of 16 keys), then one GEMM pass per block of
// queries: the logits of a block (its G heads × up to kMaxBlock queries against every key it
// sees) come from the kernel table's gemm_panels (broadcast-FMA register tiles; each logit one
// fp32 chain over the dimensions, independent of the tiling) into a buffer of at most ~256 KB; each query row then takes its max (max_f32), exp and sum (exp_sum: fp32 exp, the sum
// in fp32 blocks added in fp64), and its probabilities go into the per-token max (max_scaled,
// fp32) or the fp64 sum (mean). So the scores do not depend on `query_block` (the chunking over
// queries) or on the thread count: bit-identical.
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

/// One reconstruction pass of KVzip::score_span(): the cache rows it scores, its sinks, and the
/// optional weights of KVzip+.
struct KVzipSpan {
  std::int64_t begin = 0;  ///< first scored cache row
  std::int64_t end = -1;   ///< one past the last scored cache row (-1: the cache's end)
  std::int64_t sinks = 0;  ///< cache rows [0, min(sinks, begin)) join every softmax, unscored (kvpress's n_sink)
  /// α_i > 0, [n_queries] (KVzip+: 1/‖h_i‖ of the query's hidden state); nullptr = 1.
  const float* query_weights = nullptr;
  /// β_{g,t} >= 0, [q_heads][end − begin] (KVzip+: ‖W_O^{(g)} v_t‖ of query head g); nullptr = 1.
  const float* key_weights = nullptr;
};

/// KVzip (Kim et al. 2025): each key scored by the attention it receives from the queries of a
/// context-reconstruction pass (max or mean over the queries and the group's heads). score(keys) takes the queries
/// as the cache's last rows; score_span scores one pass's span, attend_span also computes the pass's attention
/// output (the fused pass).
class KVzip : public ScorerOptions, public detail::AllocatingScore<KVzip> {
 public:
  using detail::AllocatingScore<KVzip>::score;

  static constexpr const char* name = "kvzip";  ///< the registry's CLI spelling
  static constexpr int passes = 1;  ///< reads of the keys per block of queries
  /// Queries per block at most (query_block = 0 picks up to this many by the buffer's size).
  static constexpr std::int64_t kMaxBlock = 64;
  /// attend_span: the scores reuse the attention's exp(l - row max) while the scored subset's max
  /// is at most this far below the row's (its probabilities then keep fp32's relative precision
  /// down to e^-(87 - 16) of the subset's largest); farther, the subset gets its own exp.
  static constexpr float kRescaleLimit = 16.f;

  /// max (KVzip, default) or mean over the group's query heads and the queries.
  QueryAggregate aggregate = QueryAggregate::max;
  /// score(keys): the queries are the cache's last rows (default) or follow the cache.
  QueryPlacement placement = QueryPlacement::in_cache;
  /// Queries per block (the chunking over queries), >= 0; 0 = automatic. The scores are the same
  /// for any value.
  std::int64_t query_block = 0;

  /// queries: [q_heads][n_queries][head_dim] row-major fp32, post-RoPE. Copied. `group` =
  /// q_heads / kv_heads, checked against the keys; 0 = derive it from the keys.
  KVzip(const float* queries, std::int64_t q_heads, std::int64_t n_queries, std::int64_t head_dim,
        std::int64_t group = 0)
      : q_heads_(q_heads), n_(n_queries), dim_(head_dim), group_(group) {
    detail::copy_query_window("kvscore::KVzip", queries, q_heads, n_queries, head_dim, group, queries_, scaled_);
  }

  std::int64_t q_heads() const noexcept { return q_heads_; }  ///< query heads of the queries
  std::int64_t n_queries() const noexcept { return n_; }  ///< queries per head
  std::int64_t head_dim() const noexcept { return dim_; }  ///< dimensions of a query
  std::int64_t group() const noexcept { return group_; }  ///< q_heads / kv_heads (0: from the keys)
  /// The queries as given, [q_heads][n_queries][head_dim].
  const std::vector<float>& queries() const noexcept { return queries_; }
  /// Tokens at the end of the cache to protect (SelectOptions::recent): the in-cache queries'
  /// own rows; 0 when they follow the cache.
  std::int64_t protected_recent() const noexcept { return placement == QueryPlacement::in_cache ? n_ : 0; }

  /// Throws std::invalid_argument unless score(keys) can run on these keys.
  template <class View>
  void check(const View& keys) const {
    const std::string who = "kvscore::KVzip: ";
    check_common(who, keys.heads(), keys.head_dim());
    if (placement == QueryPlacement::in_cache && n_ > keys.tokens())
      detail::throw_invalid(who + "n_queries " + std::to_string(n_) + " > tokens " + std::to_string(keys.tokens()) +
                            " (in_cache: the queries are the cache's last rows; set placement = "
                            "QueryPlacement::after_cache for queries that follow the cache)");
  }

  /// The registry's form: every token scored (see the header comment).
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    detail::check_scores_shape(keys, out, name);
    check(keys);
    const std::int64_t n = keys.tokens();
    const bool own = placement == QueryPlacement::in_cache;
    const std::int64_t P = own ? n - n_ : n;
    run(keys, keys, own ? P : 0, own ? n_ : 0, 0, P, 0, own, nullptr, nullptr, out);
  }

  /// One reconstruction pass: the queries are the pass's tokens, whose own keys are `own`'s n_queries
  /// rows (query i at own row i); `cache` holds the context. Writes out[h][t] for t in
  /// [span.begin, span.end) and nothing else (out: [heads][cache.tokens()]), so the passes of a
  /// chunked reconstruction fill one score array.
  template <KeyCacheView Cache, KeyCacheView Own>
  void score_span(const Cache& cache, const Own& own, const KVzipSpan& span, ScoresView out) const {
    const std::int64_t e = check_span("kvscore::KVzip::score_span: ", cache, own, span, out);
    run(cache, own, 0, n_, span.begin, e, std::min(span.sinks, span.begin), false, span.query_weights,
        span.key_weights, out);
  }

  /// One reconstruction pass with the pass's attention computed here, from the same logits (the
  /// fused pass, docs/methods/kvzip.md#the-fused-pass): writes score_span()'s scores (the same logits;
  /// the scored subset's softmax taken from the attention's exponentials, so equal to ~1e-6
  /// relative, not bit for bit) and each query's attention output, the softmax over every row it sees (the whole cache,
  /// then its own rows up to itself: the model's causal attention for the pass) times the
  /// values. The pass's q·k are computed once instead of twice (by the model's attention, then
  /// again by score_span). values / own_values: the cache's and the pass's values, the keys'
  /// heads and tokens (any head_dim dv). attn_out: [n_queries][q_heads][dv] fp32, row-major
  /// (transformers' attention-output layout). Invalid keys take no part in either softmax; a
  /// query that sees no valid key gets a zero output.
  template <KeyCacheView Cache, KeyCacheView Own, KeyCacheView CacheV, KeyCacheView OwnV>
  void attend_span(const Cache& cache, const Own& own, const CacheV& values, const OwnV& own_values,
                   const KVzipSpan& span, ScoresView out, float* attn_out) const {
    const std::string who = "kvscore::KVzip::attend_span: ";
    const std::int64_t e = check_span(who, cache, own, span, out);
    auto shape = [&](const char* what, std::int64_t heads, std::int64_t tokens, std::int64_t want) {
      if (heads != cache.heads() || tokens != want)
        detail::throw_invalid(who + what + " [" + std::to_string(heads) + " heads, " + std::to_string(tokens) +
                              " rows] do not match the keys [" + std::to_string(cache.heads()) + ", " +
                              std::to_string(want) + "]");
    };
    shape("values", values.heads(), values.tokens(), cache.tokens());
    shape("own values", own_values.heads(), own_values.tokens(), n_);
    if (own_values.head_dim() != values.head_dim())
      detail::throw_invalid(who + "own values' head_dim " + std::to_string(own_values.head_dim()) +
                            " differs from the values' " + std::to_string(values.head_dim()));
    if (attn_out == nullptr && n_ > 0) detail::throw_invalid(who + "attn_out is null");
    const std::int64_t heads = cache.heads();
    if (heads == 0) return;
    const simd::KernelTable& table = isa != nullptr ? *isa : simd::active_table();
    const std::int64_t b = span.begin, s = std::min(span.sinks, span.begin), nb = e - b, m = n_;
    if (m == 0 || cache.tokens() + m == 0) return;
    // Parallel over (KV head, chunk of kTaskQueries queries), not heads alone: a GQA model has
    // few KV heads (SmolLM2: 3 for 2 threads). The chunks are fixed, whatever the thread count,
    // and their partial scores are combined in chunk order: the same result on any thread count.
    std::vector<AttendPack> packs(static_cast<std::size_t>(heads));
    detail::for_each_head(heads, num_threads, [&](std::int64_t h) {
      pack_head(table, cache, own, values, own_values, h, packs[std::size_t(h)]);
    });
    const std::int64_t chunks = (m + kTaskQueries - 1) / kTaskQueries;
    const bool mean = aggregate == QueryAggregate::mean;
    std::vector<float> part_max(mean ? 0 : static_cast<std::size_t>(heads * chunks * nb));
    std::vector<double> part_sum(mean ? static_cast<std::size_t>(heads * chunks * nb) : 0);
    detail::parallel_for_state<AttendScratch>(heads * chunks, num_threads, [&](AttendScratch& w, std::int64_t t) {
      const std::int64_t h = t / chunks, c = t % chunks, off = (h * chunks + c) * nb;
      attend_chunk(table, packs[std::size_t(h)], h, c * kTaskQueries, std::min(m, (c + 1) * kTaskQueries), b, e, s,
                   span.query_weights, span.key_weights, mean ? nullptr : part_max.data() + off,
                   mean ? part_sum.data() + off : nullptr, attn_out, w);
    });
    const double scale = 1.0 / double(q_heads_ * m / heads);
    detail::for_each_head(heads, num_threads, [&](std::int64_t h) {
      float* o = out.head(h);
      const std::vector<unsigned char>& valid = packs[std::size_t(h)].valid;
      for (std::int64_t u = 0; u < nb; ++u) {
        float v = 0.f;
        if (mean) {
          double sum = 0;
          for (std::int64_t c = 0; c < chunks; ++c) sum += part_sum[std::size_t((h * chunks + c) * nb + u)];
          v = float(sum * scale);
        } else {
          for (std::int64_t c = 0; c < chunks; ++c) v = std::max(v, part_max[std::size_t((h * chunks + c) * nb + u)]);
        }
        o[b + u] = valid[std::size_t(b + u)] ? v : kInvalidScore;
      }
    });
  }

 private:
  /// score_span's and attend_span's checks; the span's end.
  template <class Cache, class Own>
  std::int64_t check_span(const std::string& who, const Cache& cache, const Own& own, const KVzipSpan& span,
                          ScoresView out) const {
    detail::check_scores_shape(cache, out, name);
    check_common(who, cache.heads(), cache.head_dim());
    if (own.heads() != cache.heads() || own.head_dim() != cache.head_dim())
      detail::throw_invalid(who + "own keys [" + std::to_string(own.heads()) + " heads, head_dim " +
                            std::to_string(own.head_dim()) + "] do not match the cache [" +
                            std::to_string(cache.heads()) + ", " + std::to_string(cache.head_dim()) + "]");
    if (own.tokens() != n_)
      detail::throw_invalid(who + "own keys have " + std::to_string(own.tokens()) + " rows, expected one per query (" +
                            std::to_string(n_) + ")");
    const std::int64_t n = cache.tokens(), e = span.end < 0 ? n : span.end;
    if (span.begin < 0 || span.begin > e || e > n)
      detail::throw_invalid(who + "span [" + std::to_string(span.begin) + ", " + std::to_string(span.end) +
                            ") is not inside the cache's " + std::to_string(n) + " rows");
    if (span.sinks < 0) detail::throw_invalid(who + "sinks must be >= 0 (got " + std::to_string(span.sinks) + ")");
    if (span.query_weights)
      for (std::int64_t i = 0; i < n_; ++i)
        if (!(span.query_weights[i] > 0.f) || !std::isfinite(span.query_weights[i]))
          detail::throw_invalid(who + "query_weights[" + std::to_string(i) + "] = " +
                                std::to_string(span.query_weights[i]) + " must be finite and > 0");
    if (span.key_weights)
      for (std::int64_t i = 0; i < q_heads_ * (e - span.begin); ++i)
        if (!(span.key_weights[i] >= 0.f) || !std::isfinite(span.key_weights[i]))
          detail::throw_invalid(who + "key_weights[" + std::to_string(i / (e - span.begin)) + "][" +
                                std::to_string(i % (e - span.begin)) + "] = " + std::to_string(span.key_weights[i]) +
                                " must be finite and >= 0");
    return e;
  }

  void check_common(const std::string& who, std::int64_t kv_heads, std::int64_t key_dim) const {
    detail::check_queries_match_keys(who, q_heads_, group_, dim_, kv_heads, key_dim);
    if (query_block < 0)
      detail::throw_invalid(who + "query_block must be >= 0 (got " + std::to_string(query_block) + "; 0 = automatic)");
  }

  /// Cache rows [0, s) and [b, e) plus own rows [o0, o0 + m_own) (query i sees own rows up to o0 + i).
  template <class Cache, class Own>
  void run(const Cache& cache, const Own& own, std::int64_t o0, std::int64_t m_own, std::int64_t b, std::int64_t e,
           std::int64_t s, bool score_own, const float* qw, const float* kw, ScoresView out) const {
    const std::int64_t heads = cache.heads();
    if (heads == 0) return;
    const simd::KernelTable& table = isa != nullptr ? *isa : simd::active_table();
    detail::for_each_head(heads, num_threads, [&](std::int64_t h) {
      score_head(table, cache, own, h, o0, m_own, b, e, s, score_own, qw, kw, out.head(h));
    });
  }

  /// Invalid or NaN logits -> -inf, +inf -> FLT_MAX (the rare path: a row whose max or sum is not finite).
  static void clean_row(float* l, std::int64_t n, const unsigned char* valid) noexcept {
    constexpr float inf = std::numeric_limits<float>::infinity(), big = std::numeric_limits<float>::max();
    for (std::int64_t t = 0; t < n; ++t) {
      float x = l[t];
      x = ((valid == nullptr || valid[t]) && x == x) ? x : -inf;
      l[t] = x > big ? big : x;
    }
  }
  /// One softmax row's exponentials e[t] = exp(l[t] - max) and their sum; a row whose max or sum is
  /// not finite (an overflowed or NaN logit) is cleaned first (clean_row) and taken again. sum = 0:
  /// no finite logit (e not written). `cleaned`: the first try failed.
  struct ExpRow {
    double sum;
    float max;
    bool cleaned;
  };
  static ExpRow exp_row(const simd::KernelTable& table, float* l, std::int64_t n, const unsigned char* valid,
                        float* e) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    float mx = table.max_f32(l, n);
    const double z = mx > -inf && mx < inf ? table.exp_sum(l, mx, n, e) : 0.0;
    if (z > 0 && z < inf) return {z, mx, false};
    clean_row(l, n, valid);
    mx = table.max_f32(l, n);
    return {mx == -inf ? 0.0 : table.exp_sum(l, mx, n, e), mx, true};
  }

  template <class Cache, class Own>
  void score_head(const simd::KernelTable& table, const Cache& cache, const Own& own, std::int64_t h, std::int64_t o0,
                  std::int64_t m_own, std::int64_t b, std::int64_t e, std::int64_t s, bool score_own, const float* qw,
                  const float* kw, float* out) const {
    constexpr float inf = std::numeric_limits<float>::infinity();
    const std::int64_t G = q_heads_ / cache.heads(), m = n_, d = dim_;
    const std::int64_t nb = e - b, nc = s + nb;  // cache rows in every softmax: sinks, then the span
    const std::int64_t R = nc + m_own;           // + the own rows
    const std::int64_t scored = nb + (score_own ? m_own : 0);
    if (R == 0) return;

    // Every row once as fp32, contiguous (row r: sink r, span b + r - s, own o0 + r - nc): the basis
    // the query blocks' logits are projected on. Invalid rows are zeroed and left out below.
    const auto rn = static_cast<std::size_t>(R);
    std::vector<float> k32(rn * std::size_t(d)), buf(rn);
    std::vector<unsigned char> valid(rn);
    auto rows = [&](auto&& f) {  // f(first, r0, n, stride) over the rows in order
      detail::for_each_run_in(cache, h, 0, s, [&](const auto* p, std::int64_t t0, std::int64_t n, std::int64_t st) {
        f(p, t0, n, st);
      });
      detail::for_each_run_in(cache, h, b, e, [&](const auto* p, std::int64_t t0, std::int64_t n, std::int64_t st) {
        f(p, s + t0 - b, n, st);
      });
      detail::for_each_run_in(own, h, o0, o0 + m_own,
                              [&](const auto* p, std::int64_t t0, std::int64_t n, std::int64_t st) {
                                f(p, nc + t0 - o0, n, st);
                              });
    };
    rows([&](const auto* p, std::int64_t r0, std::int64_t n, std::int64_t st) {
      table.ops<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>>().sqnorm(p, n, st, d, buf.data() + r0);
      for (std::int64_t i = 0; i < n; ++i) {
        float* dst = k32.data() + (r0 + i) * d;
        for (std::int64_t j = 0; j < d; ++j) dst[j] = to_float(p[i * st + j]);
      }
    });
    std::vector<std::int64_t> invalid;
    for (std::int64_t r = 0; r < R; ++r) {
      valid[std::size_t(r)] = std::isfinite(buf[std::size_t(r)]) ? 1 : 0;
      if (!valid[std::size_t(r)]) {
        invalid.push_back(r);
        std::fill(k32.begin() + r * d, k32.begin() + (r + 1) * d, 0.f);
      }
    }
    const std::int64_t panels = (R + simd::kGemmPanel - 1) / simd::kGemmPanel;
    std::vector<float> kpack(static_cast<std::size_t>(panels * simd::kGemmPanel * d));
    table.pack_panels(k32.data(), R, d, d, kpack.data());

    // Queries per block: the block's logits [G·Q][rows] stay within ~256 KB (results do not depend on it).
    std::int64_t Q = query_block > 0 ? query_block
                                     : std::clamp<std::int64_t>(65536 / std::max<std::int64_t>(R * G, 1), 1, kMaxBlock);
    Q = std::min(Q, std::max<std::int64_t>(m, 1));
    std::vector<float> qblock(static_cast<std::size_t>(G * Q * d)), logits(static_cast<std::size_t>(R * G * Q)),
        ex(rn), accf(static_cast<std::size_t>(scored), 0.f);  // probabilities are >= 0: 0 is max's identity
    std::vector<double> acc(aggregate == QueryAggregate::mean ? static_cast<std::size_t>(scored) : 0, 0.0);
    const float* qh = scaled_.data() + h * G * m * d;  // the group's queries, [G][m][d]

    for (std::int64_t i0 = 0; i0 < m; i0 += Q) {
      const std::int64_t qn = std::min(Q, m - i0), r = G * qn;
      const std::int64_t seen = m_own > 0 ? nc + std::min(i0 + qn, m_own) : nc;  // rows the block sees
      for (std::int64_t g = 0; g < G; ++g)
        std::copy(qh + (g * m + i0) * d, qh + (g * m + i0 + qn) * d, qblock.data() + g * qn * d);
      // logits[c][t] = q_c · k_t for the block's queries c and the rows t it sees
      table.gemm_panels(qblock.data(), r, kpack.data(), seen, d, logits.data(), seen);
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < qn; ++j) {
          const std::int64_t i = i0 + j;
          float* l = logits.data() + (g * qn + j) * seen;
          const std::int64_t ni = m_own > 0 ? nc + std::min(i + 1, m_own) : nc;  // keys query i sees
          for (std::int64_t t : invalid) {
            if (t >= ni) break;
            l[t] = -inf;
          }
          const double z = exp_row(table, l, ni, valid.data(), ex.data()).sum;
          if (z == 0) continue;  // no valid key: this query adds nothing
          const double w = (qw ? double(qw[i]) : 1.0) / z;
          const float* kwg = kw ? kw + (h * G + g) * nb : nullptr;
          if (aggregate == QueryAggregate::max) {
            table.max_scaled(ex.data() + s, float(w), kwg, nb, accf.data());
            if (score_own) table.max_scaled(ex.data() + nc, float(w), nullptr, ni - nc, accf.data() + nb);
          } else {
            for (std::int64_t u = 0; u < nb; ++u)
              acc[std::size_t(u)] += double(ex[std::size_t(s + u)]) * w * (kwg ? double(kwg[u]) : 1.0);
            if (score_own)
              for (std::int64_t u = nc; u < ni; ++u) acc[std::size_t(nb + u - nc)] += double(ex[std::size_t(u)]) * w;
          }
        }
    }

    const double scale = 1.0 / double(G * m);
    auto value = [&](std::int64_t u) {
      return aggregate == QueryAggregate::max ? accf[std::size_t(u)] : float(acc[std::size_t(u)] * scale);
    };
    for (std::int64_t u = 0; u < nb; ++u) out[b + u] = valid[std::size_t(s + u)] ? value(u) : kInvalidScore;
    if (score_own)
      for (std::int64_t u = 0; u < m_own; ++u)
        out[o0 + u] = valid[std::size_t(nc + u)] ? value(nb + u) : kInvalidScore;
  }

  /// Rows [b, e) of `v`'s head h as fp32 into dst (row-major, `ld` floats apart) from row r0 on,
  /// or transposed (dst[j * ld + r]) with `transposed`.
  template <class View>
  static void widen_rows(const View& v, std::int64_t h, std::int64_t b, std::int64_t e, std::int64_t r0, float* dst,
                         std::int64_t ld, bool transposed) {
    const std::int64_t d = v.head_dim();
    detail::for_each_run_in(v, h, b, e, [&](const auto* p, std::int64_t t0, std::int64_t n, std::int64_t st) {
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t r = r0 + t0 - b + i;
        for (std::int64_t j = 0; j < d; ++j)
          (transposed ? dst[j * ld + r] : dst[r * ld + j]) = to_float(p[i * st + j]);
      }
    });
  }

  /// Queries per task of attend_span (a fixed split: the result does not depend on the threads).
  static constexpr std::int64_t kTaskQueries = 64;

  /// One KV head's rows for attend_span, fp32: the keys packed as panels (the cache's n rows,
  /// then the pass's own m), the values transposed ([dv][T]) and packed, which rows are valid.
  struct AttendPack {
    std::vector<float> kpack, vpack;
    std::vector<unsigned char> valid;
    std::vector<std::int64_t> invalid;  ///< ascending
    std::int64_t n = 0, T = 0, dv = 0, kv_heads = 1;
  };
  /// Per-thread buffers of attend_chunk.
  struct AttendScratch {
    std::vector<float> qblock, logits, E, obuf, row, ex;
    std::vector<double> invz;
  };

  template <class Cache, class Own, class CacheV, class OwnV>
  void pack_head(const simd::KernelTable& table, const Cache& cache, const Own& own, const CacheV& values,
                 const OwnV& own_values, std::int64_t h, AttendPack& pk) const {
    const std::int64_t d = dim_, m = n_, dv = values.head_dim(), n = cache.tokens(), T = n + m;
    pk.n = n, pk.T = T, pk.dv = dv, pk.kv_heads = cache.heads();
    const auto tn = static_cast<std::size_t>(T);
    std::vector<float> k32(tn * std::size_t(d)), buf(tn), vt(static_cast<std::size_t>(dv * T));
    auto sq = [&](const auto& view, std::int64_t r0) {
      detail::for_each_run_in(view, h, 0, view.tokens(),
                              [&](const auto* p, std::int64_t t0, std::int64_t cnt, std::int64_t st) {
                                table.ops<std::remove_cv_t<std::remove_pointer_t<decltype(p)>>>().sqnorm(
                                    p, cnt, st, d, buf.data() + r0 + t0);
                              });
    };
    sq(cache, 0);
    sq(own, n);
    widen_rows(cache, h, 0, n, 0, k32.data(), d, false);
    widen_rows(own, h, 0, m, n, k32.data(), d, false);
    // values transposed, [dv][T]: E·V as gemm_panels' "queries E against keys Vᵀ"
    widen_rows(values, h, 0, n, 0, vt.data(), T, true);
    widen_rows(own_values, h, 0, m, n, vt.data(), T, true);
    pk.valid.assign(tn, 1);
    pk.invalid.clear();
    for (std::int64_t r = 0; r < T; ++r)
      if (!std::isfinite(buf[std::size_t(r)])) {
        pk.valid[std::size_t(r)] = 0;
        pk.invalid.push_back(r);
        std::fill(k32.begin() + r * d, k32.begin() + (r + 1) * d, 0.f);
        for (std::int64_t j = 0; j < dv; ++j) vt[std::size_t(j * T + r)] = 0.f;  // 0·NaN would spread
      }
    const std::int64_t kp = (T + simd::kGemmPanel - 1) / simd::kGemmPanel;
    const std::int64_t vp = (dv + simd::kGemmPanel - 1) / simd::kGemmPanel;
    pk.kpack.resize(static_cast<std::size_t>(kp * simd::kGemmPanel * d));
    pk.vpack.resize(static_cast<std::size_t>(vp * simd::kGemmPanel * T));
    table.pack_panels(k32.data(), T, d, d, pk.kpack.data());
    table.pack_panels(vt.data(), dv, T, T, pk.vpack.data());
  }

  /// attend_span for KV head h's queries [q0, q1) (query i sees the cache's n rows and the own
  /// rows up to i). Each block's logits against every row it sees come from one gemm_panels;
  /// each query row then (a) takes the softmax over everything it sees into E (exp(l - max),
  /// one exp per logit), and (b) scores from the same exponentials: the score's softmax runs
  /// over a subset of the row (sinks, span, own rows up to i), so its probabilities are E's over
  /// their sum, E[t] / Σ_subset E. Only when the subset's max lies more than kRescaleLimit below
  /// the row's (its E would lose bits to underflow) does the row take score_head's own steps.
  /// E times the values (packed panels of 16 dimensions) is the output, one fp32 chain per value
  /// over the rows (gemm_panels again), scaled by 1 / Σ. The chunk's scores go to pmax (max:
  /// the running max) or psum (mean: the sum of weighted probabilities, queries in order).
  void attend_chunk(const simd::KernelTable& table, const AttendPack& pk, std::int64_t h, std::int64_t q0,
                    std::int64_t q1, std::int64_t b, std::int64_t e, std::int64_t s, const float* qw, const float* kw,
                    float* pmax, double* psum, float* attn_out, AttendScratch& w) const {
    constexpr float inf = std::numeric_limits<float>::infinity();
    const std::int64_t G = q_heads_ / pk.kv_heads, m = n_, d = dim_, dv = pk.dv, n = pk.n, T = pk.T, nb = e - b, nc = s + nb;
    const std::int64_t vp = (dv + simd::kGemmPanel - 1) / simd::kGemmPanel;
    std::int64_t Q = query_block > 0 ? query_block
                                     : std::clamp<std::int64_t>(65536 / std::max<std::int64_t>(T * G, 1), 1, kMaxBlock);
    Q = std::min(Q, q1 - q0);
    const auto rmax = static_cast<std::size_t>(G * Q), tn = static_cast<std::size_t>(T);
    w.qblock.resize(rmax * std::size_t(d));
    w.logits.resize(rmax * tn);
    w.E.resize(rmax * tn);
    w.obuf.resize(rmax * std::size_t(dv));
    w.row.resize(static_cast<std::size_t>(nc + m));
    w.ex.resize(static_cast<std::size_t>(nc + m));
    w.invz.resize(rmax);
    if (pmax != nullptr) std::fill(pmax, pmax + nb, 0.f);
    if (psum != nullptr) std::fill(psum, psum + nb, 0.0);
    const float* qh = scaled_.data() + h * G * m * d;

    for (std::int64_t i0 = q0; i0 < q1; i0 += Q) {
      const std::int64_t qn = std::min(Q, q1 - i0), r = G * qn, seen = n + i0 + qn;
      for (std::int64_t g = 0; g < G; ++g)
        std::copy(qh + (g * m + i0) * d, qh + (g * m + i0 + qn) * d, w.qblock.data() + g * qn * d);
      table.gemm_panels(w.qblock.data(), r, pk.kpack.data(), seen, d, w.logits.data(), seen);
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < qn; ++j) {
          const std::int64_t i = i0 + j, c = g * qn + j, vis = n + i + 1, ni = nc + i + 1;
          float* l = w.logits.data() + c * seen;
          for (std::int64_t t : pk.invalid) {
            if (t >= vis) break;
            l[t] = -inf;
          }
          // (a) the pass's attention: softmax over the vis rows it sees into E's row
          float* er = w.E.data() + c * seen;
          const ExpRow att = exp_row(table, l, vis, nullptr, er);
          std::fill(er + (att.sum > 0 ? vis : 0), er + seen, 0.f);
          w.invz[std::size_t(c)] = att.sum > 0 ? 1.0 / att.sum : 0.0;
          // (b) the scores: the subset's softmax from E where E holds it to fp32 precision
          const float mxs = std::max({table.max_f32(l, s), table.max_f32(l + b, nb), table.max_f32(l + n, i + 1)});
          const float* ps = nullptr;  // the span's unnormalised probabilities
          double z = 0;
          if (!att.cleaned && mxs > -inf && att.max - mxs <= kRescaleLimit) {
            z = table.reduce_f32(er, s) + table.reduce_f32(er + b, nb) + table.reduce_f32(er + n, i + 1);
            ps = er + b;
          } else {  // score_head's steps on the subset's own row
            float* row = w.row.data();
            std::copy(l, l + s, row);
            std::copy(l + b, l + e, row + s);
            std::copy(l + n, l + vis, row + nc);
            z = exp_row(table, row, ni, nullptr, w.ex.data()).sum;
            if (z > 0) ps = w.ex.data() + s;
          }
          if (ps != nullptr && z > 0) {
            const double wt = (qw ? double(qw[i]) : 1.0) / z;
            const float* kwg = kw ? kw + (h * G + g) * nb : nullptr;
            if (pmax != nullptr) {
              table.max_scaled(ps, float(wt), kwg, nb, pmax);
            } else {
              for (std::int64_t u = 0; u < nb; ++u) psum[u] += double(ps[u]) * wt * (kwg ? double(kwg[u]) : 1.0);
            }
          }
        }
      // obuf[c][j] = Σ_t E[c][t] · v_t[j], panel by panel of 16 value dimensions
      for (std::int64_t p = 0; p < vp; ++p)
        table.gemm_panels(w.E.data(), r, pk.vpack.data() + p * simd::kGemmPanel * T,
                          std::min<std::int64_t>(simd::kGemmPanel, dv - p * simd::kGemmPanel), seen,
                          w.obuf.data() + p * simd::kGemmPanel, dv);
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t j = 0; j < qn; ++j) {
          const std::int64_t c = g * qn + j;
          float* o = attn_out + ((i0 + j) * q_heads_ + h * G + g) * dv;
          for (std::int64_t u = 0; u < dv; ++u)
            o[u] = float(double(w.obuf[std::size_t(c * dv + u)]) * w.invz[std::size_t(c)]);
        }
    }
  }

  std::vector<float> queries_, scaled_;
  std::int64_t q_heads_, n_, dim_, group_;
};

}  // namespace kvscore
