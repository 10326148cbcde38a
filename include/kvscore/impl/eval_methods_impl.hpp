// kvscore/impl/eval_methods_impl.hpp — the evaluator's built-in methods (they instantiate every
// scorer, the selector, ParisKV and OjaKV): inline in header-only use, compiled once into
// kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
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

KVSCORE_IMPL_INLINE Compressed ojakv_method(const LayerInput& in, std::int64_t n, const MethodOptions& o) {
  const std::int64_t H = in.kv_heads, N = in.tokens, d = in.head_dim, G = in.group();
  if (in.value_dim != d)
    throw std::invalid_argument("ojakv: value_dim " + std::to_string(in.value_dim) + " must equal head_dim " +
                                std::to_string(d) + " (one projector dimension for keys and values)");
  const std::int64_t r = ojakv_eval_rank(d);
  const KeysView<float> keys = in.key_view();
  const KeysView<float> values(in.values, H, N, d, N * d, d);
  std::vector<OjaProjector> proj;
  std::vector<Eigen::MatrixXd> bases;
  proj.reserve(std::size_t(H));
  for (std::int64_t h = 0; h < H; ++h) {
    proj.push_back(OjaProjector::random(d, r, r, std::uint64_t(h)));
    proj.back().prefill(keys, values, h);
    bases.push_back(proj.back().key().basis());
  }
  OjaResidual res(in.queries, in.q_heads, in.n_queries, d, std::move(bases));
  res.num_threads = o.threads;
  res.placement = o.placement;
  Compressed c = select_scores(res.score(keys), n, o);
  auto cache = std::make_shared<const OjaHybridCache>(OjaHybridCache::build(proj, keys, values, c.kept));
  const LayerInput layer = in;
  c.output = [cache, layer, G, d](std::int64_t hq, std::int64_t i, double* out) {
    const std::vector<double> a = cache->attention(hq / G, layer.query(hq, i));
    std::copy(a.begin(), a.begin() + d, out);
  };
  return c;
}

KVSCORE_IMPL_INLINE Compressed pariskv_flat_method(const LayerInput& in, std::int64_t n, const MethodOptions&) {
  Compressed c;
  c.per_query.resize(std::size_t(in.q_heads * in.n_queries));
  ParisKVSearch so;
  so.k = n;
  ParisKV::Workspace ws;
  ParisKVResult r;
  for (std::int64_t h = 0; h < in.kv_heads; ++h) {
    ParisKV index(in.head_dim);
    index.append(in.keys + h * in.tokens * in.head_dim, in.tokens, in.head_dim);
    for (std::int64_t hq = h * in.group(); hq < (h + 1) * in.group(); ++hq)
      for (std::int64_t i = 0; i < in.n_queries; ++i) {
        index.search(in.query(hq, i), so, ws, r);
        c.per_query[std::size_t(hq * in.n_queries + i)] = r.positions;
      }
  }
  return c;
}

KVSCORE_IMPL_INLINE ParisKVZones pariskv_zones(std::int64_t n) noexcept {
  ParisKVZones z;
  z.sinks = std::min<std::int64_t>(4, n);
  z.local = std::min<std::int64_t>(256, (n - z.sinks) / 2);
  return z;
}

KVSCORE_IMPL_INLINE Compressed pariskv_method(const LayerInput& in, std::int64_t n, const MethodOptions&) {
  // the decode-time layout (kvscore::ParisKVCache): sinks + local window always attended, the
  // rest of the budget retrieved per query from an index of the tokens between them
  const ParisKVZones z = pariskv_zones(n);
  const std::int64_t S = z.sinks, L = z.local, k = n - S - L, R = in.tokens - S - L;
  Compressed c;
  c.per_query.resize(std::size_t(in.q_heads * in.n_queries));
  ParisKVSearch so;
  so.k = std::min(k, R);
  ParisKV::Workspace ws;
  ParisKVResult r;
  for (std::int64_t h = 0; h < in.kv_heads; ++h) {
    ParisKV index(in.head_dim);
    if (R > 0) index.append(in.keys + (h * in.tokens + S) * in.head_dim, R, in.head_dim);
    for (std::int64_t hq = h * in.group(); hq < (h + 1) * in.group(); ++hq)
      for (std::int64_t i = 0; i < in.n_queries; ++i) {
        std::vector<std::int64_t>& out = c.per_query[std::size_t(hq * in.n_queries + i)];
        for (std::int64_t t = 0; t < S; ++t) out.push_back(t);
        if (so.k > 0) {
          index.search(in.query(hq, i), so, ws, r);
          for (std::int64_t p : r.positions) out.push_back(S + p);
        }
        for (std::int64_t t = in.tokens - L; t < in.tokens; ++t) out.push_back(t);
      }
  }
  return c;
}

KVSCORE_IMPL_INLINE MethodFn builtin_run(std::string_view name) {
  // every scorer through the registry's constructor (kvscore/scorers/make_scorer.hpp): the
  // evaluation queries as the window (and as Q-Filters' calibration set), the command line's
  // window, placement and threads; a query scorer's in-cache window is protected
  if (const MethodInfo* info = find_method_info(name); info != nullptr && is_scorer(*info))
    return [spelling = std::string(name)](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
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
      const AnyScorer s = make_scorer(spelling, a);
      return select_scores(s.score(in.key_view()), n, o, s.protected_recent());
    };
  if (name == "streaming_llm")
    return [](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
      const StreamingLLM s{o.select.sinks > 0 ? o.select.sinks : o.streaming_sinks};
      Compressed c;
      c.kept = s.select(in.kv_heads, in.tokens, Budget::per_head(n));
      return c;
    };
  if (name == "pariskv") return pariskv_method;
  if (name == "pariskv_flat") return pariskv_flat_method;
  if (name == "ojakv") return ojakv_method;
  if (name == "oracle") return oracle_method;
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
