// kvscore/eval/methods.hpp — the evaluator's method registry: what `kvscore eval --methods`
// can name, and how each method turns one layer's cache into the tokens it keeps.
//
// A method is a name plus a function (layer, per-head budget n, options) -> Compressed:
//   * selection methods (scorers + the selector, StreamingLLM) fill `kept`, one set per
//     KV head shared by the head's queries;
//   * retrieval methods (ParisKV) fill `per_query`, one set per (query head, query);
//   * hybrid methods (OjaKV: kept tokens full rank, the rest low rank) fill `kept` and
//     `output`, which returns the method's own attention output for a query (the
//     evaluator then measures recall/overlap on `kept` and the error of `output`).
// The evaluator times the whole call (scoring + selection), so a method should do all its
// work inside it. `output` is called from several threads at once and must be const-safe.
//
// Adding a method (e.g. ProtoKV): one entry in builtin_methods() below, or at run time
// register_method({"protokv", "summary", fn}) before evaluate().
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/ojakv.hpp"
#include "kvscore/pariskv.hpp"
#include "kvscore/scorers/protokv.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/snapkv.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"
#include "kvscore/select.hpp"
#include "kvscore/streaming_llm.hpp"
#include "kvscore/view.hpp"

namespace kvscore::eval {

/// One layer of the evaluator's input, fp32, C order:
/// keys [kv_heads][tokens][head_dim], values [kv_heads][tokens][value_dim],
/// queries [q_heads][n_queries][head_dim]; query head hq belongs to KV head hq / group().
struct LayerInput {
  const float* keys = nullptr;
  const float* values = nullptr;
  const float* queries = nullptr;
  std::int64_t kv_heads = 0, tokens = 0, head_dim = 0, value_dim = 0, q_heads = 0, n_queries = 0;

  std::int64_t group() const noexcept { return kv_heads > 0 ? q_heads / kv_heads : 0; }
  KeysView<float> key_view() const { return KeysView<float>(keys, kv_heads, tokens, head_dim, tokens * head_dim, head_dim); }
  const float* query(std::int64_t hq, std::int64_t i) const noexcept {
    return queries + (hq * n_queries + i) * head_dim;
  }
};

/// Options shared by every method (from the command line).
struct MethodOptions {
  SelectOptions select;        ///< sinks, recent, alloc (per_head / adakv), threads
  std::int64_t window = 4096;  ///< windowed-l2: window W (manifoldkv.txt Alg. 2 default)
  std::int64_t streaming_sinks = 4;  ///< streaming_llm sinks when select.sinks is 0 (Xiao et al.)
  int threads = 0;             ///< scorer threads (0 = OpenMP default)
};

/// What a method keeps for one layer (see the top of this file).
struct Compressed {
  Selection kept;
  std::vector<std::vector<std::int64_t>> per_query;  ///< retrieval: [hq * n_queries + i], ascending
  std::function<void(std::int64_t hq, std::int64_t i, double* out)> output;  ///< hybrid: value_dim outputs
};

using MethodFn = std::function<Compressed(const LayerInput&, std::int64_t per_head_budget, const MethodOptions&)>;

struct Method {
  std::string name;     ///< as given to --methods
  std::string summary;  ///< one line for --help and docs
  MethodFn run;
};

/// Selection from scores with the command line's protection and allocation.
inline Compressed select_scores(const Scores& s, std::int64_t n, const MethodOptions& o, std::int64_t min_recent = 0) {
  SelectOptions so = o.select;
  so.recent = std::max(so.recent, min_recent);
  Compressed c;
  c.kept = select(s, Budget::per_head(n), so);
  return c;
}

/// Scorer methods: score the layer's keys with a scorer and select.
template <class Scorer>
MethodFn scorer_method(std::function<Scorer(const LayerInput&, const MethodOptions&)> make) {
  return [make](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
    Scorer sc = make(in, o);
    sc.num_threads = o.threads;
    return select_scores(sc.score(in.key_view()), n, o);
  };
}

/// The oracle: keeps the tokens with the largest mean full-attention probability over the
/// head's evaluation queries — the ceiling a query-agnostic eviction could reach (it sees
/// the very queries it is scored on).
inline Compressed oracle_method(const LayerInput& in, std::int64_t n, const MethodOptions& o) {
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

/// Ranks of OjaKV's bases in the evaluator: r = max(1, head_dim / 4) for keys and values
/// (32 of 128), seeded random start + prefill (docs/ojakv.md defaults), so the low-rank part
/// costs a quarter of the full cache and the budget n is the number of full-rank tokens.
inline std::int64_t ojakv_eval_rank(std::int64_t head_dim) noexcept { return std::max<std::int64_t>(1, head_dim / 4); }

/// OjaKV as hybrid attention: per KV head a projector (seeded random start, prefill on the
/// layer's keys and values), the n tokens with the largest query-weighted residual (the
/// evaluation queries as the window) kept full rank through the selector, every other token
/// as low-rank codes; `output` is the hybrid cache's reference attention.
inline Compressed ojakv_method(const LayerInput& in, std::int64_t n, const MethodOptions& o) {
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
  Compressed c = select_scores(res.score(keys), n, o);
  auto cache = std::make_shared<const OjaHybridCache>(OjaHybridCache::build(proj, keys, values, c.kept));
  const LayerInput layer = in;
  c.output = [cache, layer, G, d](std::int64_t hq, std::int64_t i, double* out) {
    const std::vector<double> a = cache->attention(hq / G, layer.query(hq, i));
    std::copy(a.begin(), a.begin() + d, out);
  };
  return c;
}

/// ParisKV as retrieval: one index per KV head (built inside the timed call), one top-n search
/// per (query head, query) with the paper's length-adaptive (beta, rho); no protection.
inline Compressed pariskv_method(const LayerInput& in, std::int64_t n, const MethodOptions&) {
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

/// The methods `--methods all` runs, in report order.
inline std::vector<Method> builtin_methods() {
  std::vector<Method> m;
  m.push_back({"knorm", "K-norm: keep low-norm keys", scorer_method<KNorm>([](const LayerInput&, const MethodOptions&) {
                 return KNorm{};
               })});
  m.push_back({"keydiff", "KeyDiff: keep keys least similar (cosine) to the mean direction",
               scorer_method<KeyDiff>([](const LayerInput&, const MethodOptions&) { return KeyDiff{}; })});
  m.push_back({"l2", "ManifoldKV: keep keys far (L2) from the centroid",
               scorer_method<ManifoldL2>([](const LayerInput&, const MethodOptions&) { return ManifoldL2{}; })});
  m.push_back({"windowed-l2", "windowed ManifoldKV: L2 to the centroid of the key's window (--window)",
               scorer_method<WindowedManifoldL2>(
                   [](const LayerInput&, const MethodOptions& o) { return WindowedManifoldL2(o.window); })});
  m.push_back({"qfilter", "Q-Filters: <k, f_h>, filters calibrated on the evaluation queries",
               scorer_method<QFilter>([](const LayerInput& in, const MethodOptions&) {
                 return QFilter(calibrate_qfilters(in.queries, in.q_heads, in.n_queries, in.head_dim, in.kv_heads),
                                in.kv_heads, in.head_dim);
               })});
  m.push_back({"snapkv", "SnapKV: attention of the evaluation queries as the observation window (kept)",
               [](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
                 SnapKV s(in.queries, in.q_heads, in.n_queries, in.head_dim);
                 s.num_threads = o.threads;
                 return select_scores(s.score(in.key_view()), n, o, s.protected_recent());
               }});
  m.push_back({"streaming_llm", "StreamingLLM: sinks + most recent tokens (per head)",
               [](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
                 const StreamingLLM s{o.select.sinks > 0 ? o.select.sinks : o.streaming_sinks};
                 Compressed c;
                 c.kept = s.select(in.kv_heads, in.tokens, Budget::per_head(n));
                 return c;
               }});
  m.push_back({"protokv", "ProtoKV: prototype clusters scored by the evaluation queries (window protected)",
               [](const LayerInput& in, std::int64_t n, const MethodOptions& o) {
                 ProtoKV p(in.queries, in.q_heads, in.n_queries, in.head_dim);
                 p.num_threads = o.threads;
                 return select_scores(p.score(in.key_view()), n, o, in.n_queries);
               }});
  m.push_back({"pariskv", "ParisKV: per-query top-n retrieval (collision votes + RSQ-IP rerank)", pariskv_method});
  m.push_back({"ojakv", "OjaKV: n full-rank tokens by query-weighted residual, the rest at rank head_dim/4 (hybrid)",
               ojakv_method});
  m.push_back({"oracle", "oracle: top mean full attention of the evaluation queries (ceiling)", oracle_method});
  return m;
}

/// The registry (built-ins first); register_method() appends to it.
inline std::vector<Method>& registry() {
  static std::vector<Method> r = builtin_methods();
  return r;
}

/// Adds a method; a name already registered is an error.
inline void register_method(Method m) {
  if (m.name.empty() || m.name.find(',') != std::string::npos || !m.run)
    throw std::invalid_argument("kvscore::eval::register_method: method name '" + m.name +
                                "' must be non-empty without ',' and have a run function");
  for (const Method& x : registry())
    if (x.name == m.name)
      throw std::invalid_argument("kvscore::eval::register_method: method '" + m.name + "' is already registered");
  registry().push_back(std::move(m));
}

inline std::string method_names() {
  std::string s;
  for (const Method& m : registry()) s += (s.empty() ? "" : ", ") + m.name;
  return s;
}

inline const Method& find_method(const std::string& name) {
  for (const Method& m : registry())
    if (m.name == name) return m;
  throw std::invalid_argument("kvscore::eval: unknown method '" + name + "' (expected all or a comma list of " +
                              method_names() + ")");
}

/// "all" -> every registered method; "a,b" -> those (each known, no repeats).
inline std::vector<std::string> resolve_methods(const std::string& spec) {
  std::vector<std::string> out;
  if (spec == "all") {
    for (const Method& m : registry()) out.push_back(m.name);
    return out;
  }
  std::size_t b = 0;
  for (;;) {
    const std::size_t e = spec.find(',', b);
    const std::string name = spec.substr(b, e == std::string::npos ? std::string::npos : e - b);
    find_method(name);
    if (std::find(out.begin(), out.end(), name) != out.end())
      throw std::invalid_argument("kvscore::eval: method '" + name + "' is listed twice");
    out.push_back(name);
    if (e == std::string::npos) break;
    b = e + 1;
  }
  return out;
}

}  // namespace kvscore::eval
