// kvscore/eval/methods_impl.hpp — the evaluator's built-in methods, built through the
// registry's constructors (kvscore/make_method.hpp: every scorer, the selector, ParisKV,
// OjaKV): inline in header-only use, compiled once into kvscore::dispatch otherwise
// (kvscore/detail/compiled.hpp).
#pragma once

#include "kvscore/eval/methods.hpp"

namespace kvscore::eval {

KVSCORE_IMPL_INLINE Compressed oracle_method(const LayerInput& in, std::int64_t n, const MethodOptions& o) {
  const std::int64_t H = in.kv_heads, N = in.tokens, d = in.head_dim, G = in.group();
  Scores s(H, N);
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<double> l(static_cast<std::size_t>(N)), acc(static_cast<std::size_t>(N));
  for (std::int64_t h = 0; h < H; ++h) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t i = 0; i < in.n_queries; ++i) {
        const float* q = in.query(h * G + g, i);
        double m = -INFINITY;
        for (std::int64_t t = 0; t < N; ++t) {
          const float* k = in.keys + (h * N + t) * d;
          double dot = 0;
          for (std::int64_t j = 0; j < d; ++j) dot += double(q[j]) * double(k[j]);
          l[std::size_t(t)] = dot * scale;
          m = std::max(m, l[std::size_t(t)]);
        }
        double z = 0;
        for (std::int64_t t = 0; t < N; ++t) z += (l[std::size_t(t)] = std::exp(l[std::size_t(t)] - m));
        for (std::int64_t t = 0; t < N; ++t) acc[std::size_t(t)] += l[std::size_t(t)] / z;
      }
    float* out = s.data() + h * N;
    for (std::int64_t t = 0; t < N; ++t) out[t] = float(acc[std::size_t(t)]);
  }
  return select_scores(s, n, o);
}

KVSCORE_IMPL_INLINE Compressed hybrid_method(std::string_view spelling, const LayerInput& in, std::int64_t n,
                                              const MethodOptions& o) {
  const std::int64_t H = in.kv_heads, N = in.tokens, d = in.head_dim, G = in.group();
  if (in.value_dim != d)
    throw std::invalid_argument(std::string(spelling) + ": value_dim " + std::to_string(in.value_dim) +
                                " must equal head_dim " + std::to_string(d) +
                                " (one projector dimension for keys and values)");
  HybridArgs a;
  a.budget = n;
  a.rank = ojakv_eval_rank(d);
  const bool leak_free = o.protocol == Protocol::leak_free;
  a.queries = leak_free ? in.window_queries : in.queries;  // leak-free: the residual rule's window is the cache's own
  a.q_heads = in.q_heads;
  a.n_queries = leak_free ? in.n_window : in.n_queries;
  a.placement = leak_free ? QueryPlacement::in_cache : o.placement;
  a.threads = o.threads;
  a.select = o.select;
  const KeysView<float> values(in.values, H, N, d, N * d, d);
  auto b = std::make_shared<HybridBuild>(make_hybrid(spelling, in.key_view(), values, a));
  Compressed c;
  c.kept = b->full_rank;
  const LayerInput layer = in;
  c.output = [b, layer, G, d](std::int64_t hq, std::int64_t i, double* out) {
    const std::vector<double> att = b->cache.attention(hq / G, layer.query(hq, i));
    std::copy(att.begin(), att.begin() + d, out);
  };
  return c;
}

KVSCORE_IMPL_INLINE Compressed retriever_method(std::string_view spelling, const LayerInput& in, std::int64_t n) {
  const std::int64_t N = in.tokens, d = in.head_dim;
  // only positions are measured here; the cache's values (head_dim wide) are the keys when the
  // layer's value_dim differs
  const float* values = in.value_dim == d ? in.values : in.keys;
  RetrieverArgs a;
  a.budget = n;
  Compressed c;
  c.per_query.resize(std::size_t(in.q_heads * in.n_queries));
  ParisKVCache<float>::Workspace ws;
  for (std::int64_t h = 0; h < in.kv_heads; ++h) {
    ParisKVCache<float> r = make_retriever<float>(spelling, d, a);
    r.append(in.keys + h * N * d, values + h * N * d, N);
    for (std::int64_t hq = h * in.group(); hq < (h + 1) * in.group(); ++hq)
      for (std::int64_t i = 0; i < in.n_queries; ++i) {
        r.select(in.query(hq, i), ws);
        c.per_query[std::size_t(hq * in.n_queries + i)] = ws.positions;
      }
  }
  return c;
}

KVSCORE_IMPL_INLINE MethodFn builtin_run(std::string_view name) {
  // every method of the registry through its constructor (kvscore/make_method.hpp), by kind;
  // only the reference (oracle) is the evaluator's own
  const MethodInfo* info = find_method_info(name);
  if (info == nullptr) return {};
  switch (info->kind) {
    case MethodKind::scorer:
    case MethodKind::query_scorer:
      // shared protocol: the evaluation queries as the window (and as Q-Filters' calibration
      // set), the command line's placement; leak-free: the cache's last-window queries (in the
      // cache) and the calibration queries of other text (for a scorer whose registry options
      // name filters: Q-Filters calibrate on queries). A query scorer's in-cache window is
      // protected.
      return [spelling = std::string(name), kind = info->kind, calibrated = reads_option(*info, "filters"),
              title = std::string(info->summary.substr(0, info->summary.find(':')))](
                 const LayerInput& in, std::int64_t n, const MethodOptions& o) {
        ScorerArgs a;
        a.threads = o.threads;
        a.window = o.window;
        a.window_tail = o.window_tail;
        a.kv_heads = in.kv_heads;
        a.queries = in.queries;
        a.q_heads = in.q_heads;
        a.n_queries = in.n_queries;
        a.head_dim = in.head_dim;
        a.placement = o.placement;
        if (o.protocol == Protocol::leak_free) {
          a.placement = QueryPlacement::in_cache;
          if (kind == MethodKind::query_scorer) {
            a.queries = in.window_queries;
            a.n_queries = in.n_window;
          } else {
            if (calibrated && in.calib_queries == nullptr)
              throw std::invalid_argument(spelling + ": the leak-free protocol calibrates " + title + " on other text; "
                                          "give calibration queries (kvscore eval --calib-queries, dump_kv.py "
                                          "--calib-text)");
            a.queries = in.calib_queries;
            a.n_queries = in.n_calib;
          }
        }
        const AnyScorer s = make_scorer(spelling, a);
        return select_scores(s.score(in.key_view()), n, o, s.protected_recent());
      };
    case MethodKind::selection_rule:
      return [spelling = std::string(name)](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
        const StreamingLLM s = make_selection_rule(spelling, {o.select.sinks > 0 ? o.select.sinks : o.streaming_sinks});
        Compressed c;
        c.kept = s.select(in.kv_heads, in.tokens, Budget::per_head(n));
        return c;
      };
    case MethodKind::retriever:
      return [spelling = std::string(name)](const LayerInput& in, std::int64_t n, const MethodOptions&) {
        return retriever_method(spelling, in, n);
      };
    case MethodKind::hybrid:
      return [spelling = std::string(name)](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
        return hybrid_method(spelling, in, n, o);
      };
    case MethodKind::reference: return oracle_method;
  }
  return {};
}

KVSCORE_IMPL_INLINE std::vector<Method> builtin_methods() {
  std::vector<Method> m;
  for (const MethodInfo& info : kMethods) {
    MethodFn run = builtin_run(info.name);
    if (!run)  // a method added to kvscore/methods.hpp without its evaluator entry (builtin_run)
      throw std::logic_error("kvscore::eval: method '" + std::string(info.name) + "' has no evaluator entry");
    m.push_back({std::string(info.cli), std::string(info.summary), std::move(run)});
  }
  return m;
}

}  // namespace kvscore::eval
