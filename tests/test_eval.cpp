// The evaluator (include/kvscore/eval/evaluate.hpp, methods.hpp, report.hpp; docs/reference/evaluate.md):
// budgets, GQA mapping, averaging, multi-layer input, the three method kinds (selection,
// retrieval, hybrid), skipped budgets, input errors, determinism across threads, and the
// JSON / SVG / table writers.
#include <catch2/catch.hpp>

#include <kvscore/eval/evaluate.hpp>
#include <kvscore/eval/report.hpp>
#include <kvscore/synth.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace eval = kvscore::eval;
namespace synth = kvscore::synth;
using Catch::Matchers::Contains;

/// A small synthetic layer set (mixed kind), fp32.
struct EvalFixture {
  synth::Data D;
  std::vector<eval::LayerInput> layers;
  explicit EvalFixture(std::int64_t n_layers = 1, std::int64_t tokens = 256, std::int64_t group = 2) {
    synth::Spec s{.layers = n_layers, .kv_heads = 2, .group = group, .tokens = tokens, .head_dim = 32, .queries = 4,
                  .segment = 64};
    D = synth::generate(s);
    for (std::int64_t l = 0; l < n_layers; ++l) {
      eval::LayerInput in;
      in.keys = D.keys.data() + l * 2 * tokens * 32;
      in.values = D.values.data() + l * 2 * tokens * 32;
      in.queries = D.queries.data() + l * 2 * group * 4 * 32;
      in.kv_heads = 2;
      in.tokens = tokens;
      in.head_dim = 32;
      in.value_dim = 32;
      in.q_heads = 2 * group;
      in.n_queries = 4;
      layers.push_back(in);
    }
  }
};

eval::EvalOptions eval_opts(const std::string& methods, std::vector<double> keep) {
  eval::EvalOptions o;
  o.methods = eval::resolve_methods(methods);
  o.keep = std::move(keep);
  return o;
}

/// Registers a test method once (the registry is process-wide).
void eval_register_once(const std::string& name, eval::MethodFn fn) {
  for (const auto& m : eval::registry())
    if (m.name == name) return;
  eval::register_method({name, "test", std::move(fn)});
}

}  // namespace

TEST_CASE("eval: registry names, 'all', unknown and repeated methods", "[eval]") {
  const auto all = eval::resolve_methods("all");
  for (const char* m : {"knorm", "keydiff", "l2", "windowed-l2", "qfilter", "snapkv", "streaming_llm", "protokv", "pariskv", "pariskv-flat", "ojakv", "oracle"})
    CHECK(std::find(all.begin(), all.end(), m) != all.end());
  CHECK(eval::resolve_methods("l2,knorm") == std::vector<std::string>{"l2", "knorm"});
  CHECK_THROWS_WITH(eval::resolve_methods("l2,foo"), Contains("unknown method 'foo'") && Contains("knorm"));
  CHECK_THROWS_WITH(eval::resolve_methods("l2,l2"), Contains("'l2' is listed twice"));
  CHECK_THROWS_WITH(eval::resolve_methods(""), Contains("unknown method ''"));
  CHECK_THROWS_WITH(eval::register_method({"l2", "dup", eval::oracle_method}), Contains("'l2' is already registered"));
  CHECK_THROWS_WITH(eval::register_method({"a,b", "bad", eval::oracle_method}), Contains("'a,b'"));
}

TEST_CASE("eval: budgets, ordering, averaging and keep = 1", "[eval]") {
  const EvalFixture F;
  const eval::Report r = eval::evaluate(F.layers, eval_opts("knorm,l2,streaming_llm", {0.1, 1.0}));
  REQUIRE(r.results.size() == 6);
  CHECK(r.results[0].method == "knorm");
  CHECK(r.results[1].method == "knorm");
  CHECK(r.results[2].method == "l2");
  CHECK(r.results[0].keep == 0.1);
  CHECK(r.results[0].budget == 26);  // llround(25.6)
  CHECK(r.results[1].budget == 256);
  for (const auto& x : r.results) {
    REQUIRE(x.per_head.size() == 2);
    double s = 0;
    for (const auto& h : x.per_head) {
      CHECK(h.kept == x.budget);
      s += h.attention_mass_recall;
    }
    CHECK(x.attention_mass_recall == Approx(s / 2).epsilon(1e-15));
    CHECK(x.attention_mass_recall >= 0.0);
    CHECK(x.attention_mass_recall <= 1.0);
    CHECK(x.topk_overlap >= 0.0);
    CHECK(x.topk_overlap <= 1.0);
    if (x.keep == 1.0) {  // every token kept: exact
      CHECK(x.attention_mass_recall == Approx(1.0).margin(1e-12));
      CHECK(x.output_rel_error < 1e-12);
      CHECK(x.topk_overlap == 1.0);
    } else {
      CHECK(x.attention_mass_recall < 0.99);
    }
  }
  CHECK(r.skipped.empty());
}

TEST_CASE("eval: query head hq is measured against KV head hq / G", "[eval]") {
  // 2 KV heads, G = 2, d = 4, N = 16. KV head 0 has one big key at token 3 along e0,
  // KV head 1 at token 11 along e1; query heads 0,1 look along e0, 2,3 along e1. With the
  // contiguous mapping the oracle at budget 1 recovers almost all mass; with hq % H it would not.
  const std::int64_t N = 16, d = 4;
  std::vector<float> K(2 * N * d, 0.f), V(2 * N * d, 1.f), Q(4 * 1 * d, 0.f);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t t = 0; t < N; ++t) K[std::size_t((h * N + t) * d + 2)] = 0.1f * float(t % 3);
  K[std::size_t((0 * N + 3) * d + 0)] = 20.f;
  K[std::size_t((1 * N + 11) * d + 1)] = 20.f;
  for (std::int64_t hq = 0; hq < 4; ++hq) Q[std::size_t(hq * d + (hq < 2 ? 0 : 1))] = 2.f;
  eval::LayerInput in{K.data(), V.data(), Q.data(), 2, N, d, d, 4, 1};
  const eval::Report r = eval::evaluate({in}, eval_opts("oracle", {1.0 / 16}));
  REQUIRE(r.results.size() == 1);
  CHECK(r.results[0].budget == 1);
  CHECK(r.results[0].attention_mass_recall > 0.99);
  CHECK(r.results[0].topk_overlap == 1.0);
}

TEST_CASE("eval: multi-layer input averages layers - per_head names them", "[eval]") {
  const EvalFixture F2(2);
  const eval::Report r = eval::evaluate(F2.layers, eval_opts("l2", {0.25}));
  REQUIRE(r.results[0].per_head.size() == 4);
  CHECK(r.results[0].per_head[0].layer == 0);
  CHECK(r.results[0].per_head[3].layer == 1);
  CHECK(r.results[0].per_head[3].head == 1);
  // each layer alone gives the per-head values of the two-layer run
  const eval::Report r1 = eval::evaluate({F2.layers[1]}, eval_opts("l2", {0.25}));
  CHECK(r1.results[0].per_head[1].attention_mass_recall == r.results[0].per_head[3].attention_mass_recall);
  double s = 0;
  for (const auto& h : r.results[0].per_head) s += h.output_rel_error;
  CHECK(r.results[0].output_rel_error == Approx(s / 4).epsilon(1e-15));
}

TEST_CASE("eval: same numbers for any thread count", "[eval]") {
  const EvalFixture F(2);
  auto o = eval_opts("knorm,keydiff,l2,windowed-l2,qfilter,snapkv,streaming_llm,oracle", {0.1, 0.5});
  o.method.window = 64;
  o.threads = 1;
  o.method.threads = 1;
  const eval::Report a = eval::evaluate(F.layers, o);
  o.threads = 3;
  o.method.threads = 2;
  const eval::Report b = eval::evaluate(F.layers, o);
  REQUIRE(a.results.size() == b.results.size());
  for (std::size_t i = 0; i < a.results.size(); ++i) {
    INFO(a.results[i].method << " " << a.results[i].keep);
    CHECK(a.results[i].attention_mass_recall == b.results[i].attention_mass_recall);
    CHECK(a.results[i].output_rel_error == b.results[i].output_rel_error);
    CHECK(a.results[i].topk_overlap == b.results[i].topk_overlap);
  }
}

TEST_CASE("eval: retrieval and hybrid methods", "[eval]") {
  // retrieval: the exact top-n of each query → overlap 1; hybrid: the exact full output with
  // nothing kept → recall 0, error 0.
  eval_register_once("test-exact-topn", [](const eval::LayerInput& in, std::int64_t n, const eval::MethodOptions&) {
    eval::Compressed c;
    for (std::int64_t hq = 0; hq < in.q_heads; ++hq)
      for (std::int64_t i = 0; i < in.n_queries; ++i) {
        const std::int64_t h = hq / in.group();
        const eval::HeadReference ref(in.keys + h * in.tokens * in.head_dim, in.head_dim,
                                      in.values + h * in.tokens * in.value_dim, in.value_dim, in.query(hq, i),
                                      in.head_dim, 1, in.tokens, in.head_dim, in.value_dim);
        std::vector<std::int64_t> s;
        for (std::int64_t t = 0; t < in.tokens; ++t)
          if (ref.ranks(0)[t] < n) s.push_back(t);
        c.per_query.push_back(s);
      }
    return c;
  });
  eval_register_once("test-exact-output", [](const eval::LayerInput& in, std::int64_t, const eval::MethodOptions&) {
    eval::Compressed c;
    c.kept.heads = in.kv_heads;
    c.kept.tokens = in.tokens;
    c.kept.offsets.assign(std::size_t(in.kv_heads + 1), 0);
    c.output = [in](std::int64_t hq, std::int64_t i, double* out) {
      const std::int64_t h = hq / in.group();
      const eval::HeadReference ref(in.keys + h * in.tokens * in.head_dim, in.head_dim,
                                    in.values + h * in.tokens * in.value_dim, in.value_dim, in.query(hq, i),
                                    in.head_dim, 1, in.tokens, in.head_dim, in.value_dim);
      std::copy(ref.full_output(0), ref.full_output(0) + in.value_dim, out);
    };
    return c;
  });
  const EvalFixture F;
  const eval::Report r = eval::evaluate(F.layers, eval_opts("test-exact-topn,test-exact-output", {0.1}));
  REQUIRE(r.results.size() == 2);
  CHECK(r.results[0].topk_overlap == 1.0);
  CHECK(r.results[0].per_head[0].kept == 26);
  CHECK(r.results[1].attention_mass_recall == 0.0);
  CHECK(r.results[1].output_rel_error < 1e-12);
}

TEST_CASE("eval: a method's bad selection is an error naming the method", "[eval]") {
  eval_register_once("test-unsorted", [](const eval::LayerInput& in, std::int64_t, const eval::MethodOptions&) {
    eval::Compressed c;
    c.kept.heads = in.kv_heads;
    c.kept.tokens = in.tokens;
    c.kept.offsets = {0, 2, 4};
    c.kept.positions = {5, 1, 0, 1};
    return c;
  });
  const EvalFixture F;
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("test-unsorted", {0.1})),
                    Contains("'test-unsorted'") && Contains("1 after 5"));
}

TEST_CASE("eval: budgets a method rejects are skipped with the reason", "[eval]") {
  const EvalFixture F;
  auto o = eval_opts("l2,knorm", {0.05, 0.5});
  o.method.select.sinks = 4;
  o.method.select.recent = 20;  // 24 protected > 13 = budget at 5 %
  const eval::Report r = eval::evaluate(F.layers, o);
  REQUIRE(r.results.size() == 2);
  CHECK(r.results[0].keep == 0.5);
  REQUIRE(r.skipped.size() == 2);
  CHECK(r.skipped[0].method == "l2");
  CHECK(r.skipped[0].keep == 0.05);
  CHECK_THAT(r.skipped[0].reason, Contains("protect 24 tokens"));
}

TEST_CASE("eval: bad input is rejected with the offending value", "[eval]") {
  EvalFixture F;
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {0.0})), Contains("keep fraction 0 must be in (0, 1]"));
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {1.5})), Contains("keep fraction 1.5"));
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {std::nan("")})), Contains("keep fraction nan"));
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {})), Contains("no keep fractions"));
  CHECK_THROWS_WITH(eval::evaluate({}, eval_opts("l2", {0.5})), Contains("no layers"));
  auto bad = F.layers;
  bad[0].q_heads = 3;
  CHECK_THROWS_WITH(eval::evaluate(bad, eval_opts("l2", {0.5})), Contains("q_heads 3") && Contains("kv_heads 2"));
  F.D.keys[70] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {0.5})),
                    Contains("layer 0 keys") && Contains("flat index 70") && Contains("not finite"));
  F.D.keys[70] = 0.f;
  F.D.queries[3] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(eval::evaluate(F.layers, eval_opts("l2", {0.5})), Contains("layer 0 queries") && Contains("index 3"));
  const EvalFixture G2(2);
  auto mixed = G2.layers;
  mixed[1].tokens = 128;
  CHECK_THROWS_WITH(eval::evaluate(mixed, eval_opts("l2", {0.5})), Contains("layer 1 has a different shape"));
}

TEST_CASE("eval: JSON, table and SVG carry every result", "[eval]") {
  const EvalFixture F;
  auto o = eval_opts("l2,streaming_llm", {0.1, 0.25});
  o.method.select.sinks = 2;
  const eval::Report r = eval::evaluate(F.layers, o);
  const std::string j = eval::to_json(r);
  CHECK_THAT(j, Contains("\"results\": ["));
  CHECK_THAT(j, Contains("{\"method\": \"l2\", \"keep\": 0.10000000000000001, \"budget\": 26, \"attention_mass_recall\": "));
  CHECK_THAT(j, Contains("\"per_head\": [{\"layer\": 0, \"head\": 0, \"kept\": 26, "));
  CHECK_THAT(j, Contains("\"sinks\": 2"));
  CHECK_THAT(j, Contains("\"alloc\": \"per-head\""));
  CHECK(std::count(j.begin(), j.end(), '{') == std::count(j.begin(), j.end(), '}'));
  CHECK(std::count(j.begin(), j.end(), '[') == std::count(j.begin(), j.end(), ']'));
  CHECK(j.find("nan") == std::string::npos);
  const std::string t = eval::to_table(r);
  CHECK(std::count(t.begin(), t.end(), '\n') == 2 + 4);
  CHECK_THAT(t, Contains("streaming_llm"));
  const std::string s = eval::to_svg(r);
  CHECK(s.rfind("<svg", 0) == 0);
  CHECK_THAT(s, Contains("</svg>"));
  // 3 panels x 2 methods
  std::size_t lines = 0;
  for (std::size_t p = s.find("<polyline"); p != std::string::npos; p = s.find("<polyline", p + 1)) ++lines;
  CHECK(lines == 6);
  CHECK_THAT(s, Contains("data-method=\"streaming_llm\""));
  CHECK(eval::detail::json_str("a\"b\\c\n") == "\"a\\\"b\\\\c\\n\"");
}

TEST_CASE("eval: the queries follow the cache by default - snapkv, protokv and ojakv see every key and protect "
          "nothing; in-cache on request",
          "[eval][placement]") {
  const EvalFixture F;
  const eval::LayerInput& in = F.layers[0];
  const std::int64_t n = 26;
  eval::MethodOptions o;
  CHECK(o.placement == kvscore::QueryPlacement::after_cache);
  kvscore::SnapKV snap(in.queries, in.q_heads, in.n_queries, in.head_dim);
  snap.placement = kvscore::QueryPlacement::after_cache;
  const kvscore::Selection after = kvscore::select(snap.score(in.key_view()), kvscore::Budget::per_head(n));
  snap.placement = kvscore::QueryPlacement::in_cache;
  kvscore::SelectOptions protect;
  protect.recent = in.n_queries;
  const kvscore::Selection in_cache = kvscore::select(snap.score(in.key_view()), kvscore::Budget::per_head(n), protect);
  REQUIRE(after.positions != in_cache.positions);  // the two modes keep different tokens here
  CHECK(eval::find_method("snapkv").run(in, n, o).kept.positions == after.positions);
  o.placement = kvscore::QueryPlacement::in_cache;
  CHECK(eval::find_method("snapkv").run(in, n, o).kept.positions == in_cache.positions);

  // ProtoKV below its window: in-cache protects n_q = 4 tokens > a budget of 3 (skipped);
  // after-cache protects nothing and runs.
  auto opt = eval_opts("protokv,snapkv,ojakv", {0.01});
  const eval::Report a = eval::evaluate(F.layers, opt);
  CHECK(a.results.size() == 3);
  CHECK(a.skipped.empty());
  CHECK_THAT(eval::to_json(a), Contains("\"query_placement\": \"after-cache\""));
  opt.method.placement = kvscore::QueryPlacement::in_cache;
  const eval::Report b = eval::evaluate(F.layers, opt);
  CHECK(b.results.size() == 1);  // ojakv protects nothing in either mode
  REQUIRE(b.skipped.size() == 2);
  CHECK_THAT(b.skipped[0].reason, Contains("protect 4 tokens"));
  CHECK_THAT(eval::to_json(b), Contains("\"query_placement\": \"in-cache\""));
}

TEST_CASE("eval: pariskv keeps its zones, pariskv-flat retrieves the whole budget", "[eval][pariskv]") {
  const EvalFixture F;
  const eval::LayerInput& in = F.layers[0];
  for (std::int64_t n : {std::int64_t(3), std::int64_t(40), in.tokens / 2}) {
    INFO("n = " << n);
    const eval::ParisKVZones z = eval::pariskv_zones(n);
    CHECK(z.sinks == std::min<std::int64_t>(4, n));
    CHECK(z.local == std::min<std::int64_t>(256, (n - z.sinks) / 2));
    const eval::Compressed c = eval::retriever_method("pariskv", in, n);
    const eval::Compressed f = eval::retriever_method("pariskv_flat", in, n);
    REQUIRE(c.per_query.size() == std::size_t(in.q_heads * in.n_queries));
    for (std::size_t i = 0; i < c.per_query.size(); ++i) {
      const auto& p = c.per_query[i];
      REQUIRE(p.size() == std::size_t(n));
      CHECK(std::is_sorted(p.begin(), p.end()));
      CHECK(std::adjacent_find(p.begin(), p.end()) == p.end());
      for (std::int64_t t = 0; t < z.sinks; ++t) CHECK(p[std::size_t(t)] == t);
      for (std::int64_t t = 0; t < z.local; ++t) CHECK(p[p.size() - 1 - std::size_t(t)] == in.tokens - 1 - t);
      CHECK(f.per_query[i].size() == std::size_t(n));
    }
  }
}

namespace {

/// A layer where the evaluation queries and the cache's window queries want different tokens:
/// keys in two clusters (first half along +e0, second half along +e1, small noise); the
/// evaluation queries point at cluster A (e0), the window queries at cluster B (e1), the
/// calibration queries along e1 too. A method that sees the evaluation queries keeps A; one that
/// sees only the window keeps B.
struct LeakFixture {
  std::int64_t H = 2, G = 2, N = 128, d = 16, nq = 4, nw = 8, nc = 6;
  std::vector<float> K, V, Q, W, C;
  eval::LayerInput in;
  LeakFixture() {
    K.resize(std::size_t(H * N * d));
    V.resize(K.size());
    std::uint64_t s = 12345;
    auto u = [&] {  // deterministic noise in [-0.05, 0.05)
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      return float(double(s >> 11) / double(1ULL << 53) - 0.5) * 0.1f;
    };
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < N; ++t)
        for (std::int64_t j = 0; j < d; ++j) {
          const std::size_t i = std::size_t((h * N + t) * d + j);
          K[i] = u() + (j == (t < N / 2 ? 0 : 1) ? 1.0f : 0.0f);
          V[i] = u() + (j == 2 ? float(t % 5) : 0.0f);
        }
    auto queries = [&](std::int64_t n, std::int64_t axis) {
      std::vector<float> q(std::size_t(H * G * n * d));
      for (std::size_t i = 0; i < q.size(); ++i) q[i] = u() + (std::int64_t(i) % d == axis ? 6.0f : 0.0f);
      return q;
    };
    Q = queries(nq, 0);
    W = queries(nw, 1);
    C = queries(nc, 1);
    in.keys = K.data();
    in.values = V.data();
    in.queries = Q.data();
    in.kv_heads = H;
    in.tokens = N;
    in.head_dim = d;
    in.value_dim = d;
    in.q_heads = H * G;
    in.n_queries = nq;
    in.window_queries = W.data();
    in.n_window = nw;
    in.calib_queries = C.data();
    in.n_calib = nc;
  }
  /// Share of head h's kept tokens in cluster A (the first half).
  double share_a(const kvscore::Selection& s, std::int64_t h) const {
    const auto k = s.head(h);
    return double(std::count_if(k.begin(), k.end(), [&](std::int64_t t) { return t < N / 2; })) / double(k.size());
  }
};

}  // namespace

TEST_CASE("eval: leak-free protocol - snapkv, protokv and ojakv see only the window queries, in the cache", "[eval][leakfree]") {
  const LeakFixture F;
  const std::int64_t n = 32;
  eval::MethodOptions shared, leak;
  leak.protocol = eval::Protocol::leak_free;
  // the same selection as SnapKV built on the window queries, in the cache, the window protected
  kvscore::SnapKV snap(F.W.data(), F.in.q_heads, F.nw, F.d);
  snap.placement = kvscore::QueryPlacement::in_cache;
  kvscore::SelectOptions protect;
  protect.recent = F.nw;
  const kvscore::Selection expect = kvscore::select(snap.score(F.in.key_view()), kvscore::Budget::per_head(n), protect);
  const eval::Compressed lf = eval::find_method("snapkv").run(F.in, n, leak);
  CHECK(lf.kept.positions == expect.positions);
  // shared: snapkv saw the evaluation queries and keeps cluster A; leak-free: the window's cluster B
  const eval::Compressed sh = eval::find_method("snapkv").run(F.in, n, shared);
  for (std::int64_t h = 0; h < F.H; ++h) {
    CHECK(F.share_a(sh.kept, h) == 1.0);
    CHECK(F.share_a(lf.kept, h) < 0.2);
    CHECK(F.share_a(eval::find_method("protokv").run(F.in, n, shared).kept, h) > 0.8);
    CHECK(F.share_a(eval::find_method("protokv").run(F.in, n, leak).kept, h) < 0.5);
  }
  // query-agnostic methods do not depend on the protocol
  for (const char* m : {"knorm", "l2", "streaming_llm"})
    CHECK(eval::find_method(m).run(F.in, n, shared).kept.positions == eval::find_method(m).run(F.in, n, leak).kept.positions);
  // the report: the evaluation queries measure both, so recall drops from the leaky to the fair run
  std::vector<eval::LayerInput> layers{F.in};
  auto opt = eval_opts("snapkv,protokv,ojakv,knorm,oracle", {0.25});
  const eval::Report a = eval::evaluate(layers, opt);
  opt.method.protocol = eval::Protocol::leak_free;
  const eval::Report b = eval::evaluate(layers, opt);
  REQUIRE(a.results.size() == 5);
  REQUIRE(b.results.size() == 5);
  CHECK(b.results[0].attention_mass_recall < a.results[0].attention_mass_recall - 0.3);  // snapkv
  CHECK(b.results[1].attention_mass_recall < a.results[1].attention_mass_recall - 0.2);  // protokv
  CHECK(b.results[3].attention_mass_recall == a.results[3].attention_mass_recall);       // knorm
  CHECK(b.results[4].attention_mass_recall == a.results[4].attention_mass_recall);       // oracle: the ceiling
  const std::string js = eval::to_json(b);
  CHECK_THAT(js, Contains("\"protocol\": \"leak-free\""));
  CHECK_THAT(js, Contains("\"window_queries\": 8, \"calib_queries\": 6"));
  CHECK_THAT(js, Contains("\"query_placement\": \"in-cache\""));  // where the window sits
  CHECK_THAT(eval::to_table(b), Contains("protocol leak-free, 8 window queries, 6 calibration queries"));
}

TEST_CASE("eval: leak-free protocol - qfilter is calibrated on the calibration queries, skipped without them", "[eval][leakfree]") {
  LeakFixture F;
  const std::int64_t n = 32;
  eval::MethodOptions leak;
  leak.protocol = eval::Protocol::leak_free;
  const std::vector<float> f = kvscore::calibrate_qfilters(F.C.data(), F.in.q_heads, F.nc, F.d, F.H);
  const kvscore::QFilter qf(f, F.H, F.d);
  const kvscore::Selection expect = kvscore::select(qf.score(F.in.key_view()), kvscore::Budget::per_head(n));
  CHECK(eval::find_method("qfilter").run(F.in, n, leak).kept.positions == expect.positions);
  for (std::int64_t h = 0; h < F.H; ++h) {
    CHECK(F.share_a(eval::find_method("qfilter").run(F.in, n, eval::MethodOptions{}).kept, h) == 1.0);  // shared: Q
    CHECK(F.share_a(expect, h) == 0.0);  // calibrated on e1: cluster B
  }
  F.in.calib_queries = nullptr;
  F.in.n_calib = 0;
  std::vector<eval::LayerInput> layers{F.in};
  auto opt = eval_opts("qfilter,knorm", {0.25});
  opt.method.protocol = eval::Protocol::leak_free;
  const eval::Report r = eval::evaluate(layers, opt);
  REQUIRE(r.results.size() == 1);
  REQUIRE(r.skipped.size() == 1);
  CHECK(r.skipped[0].method == "qfilter");
  CHECK_THAT(r.skipped[0].reason, Contains("calibrates Q-Filters on other text") && Contains("--calib-queries"));
}

TEST_CASE("eval: leak-free protocol - bad window and calibration queries are rejected", "[eval][leakfree]") {
  LeakFixture F;
  auto opt = eval_opts("knorm", {0.25});
  opt.method.protocol = eval::Protocol::leak_free;
  auto run = [&](eval::LayerInput in) { return eval::evaluate(std::vector<eval::LayerInput>{in}, opt); };
  eval::LayerInput no_window = F.in;
  no_window.window_queries = nullptr;
  CHECK_THROWS_WITH(run(no_window), Contains("leak-free protocol needs the cache's last-window queries"));
  eval::LayerInput too_many = F.in;
  too_many.n_window = F.N + 1;
  CHECK_THROWS_WITH(run(too_many), Contains("the 129 window queries are the cache's last positions"));
  eval::LayerInput zero = F.in;
  zero.n_calib = 0;
  CHECK_THROWS_WITH(run(zero), Contains("n_calib must be >= 1"));
  F.W[17] = std::numeric_limits<float>::infinity();
  CHECK_THROWS_WITH(run(F.in), Contains("window queries: value inf at flat index 17 is not finite"));
  F.W[17] = 0;
  F.C[3] = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_WITH(run(F.in), Contains("calibration queries: value nan at flat index 3"));
  F.C[3] = 0;
  eval::LayerInput other = F.in;
  other.n_window = 4;
  CHECK_THROWS_WITH(eval::evaluate(std::vector<eval::LayerInput>{F.in, other}, opt),
                    Contains("layer 1 has other window or calibration queries than layer 0"));
  // the shared protocol ignores them
  opt.method.protocol = eval::Protocol::shared;
  CHECK(run(no_window).results.size() == 1);
}

TEST_CASE("eval: per_layer_best picks the best press-able method per layer at each keep", "[eval][mix]") {
  eval::Report r;
  r.layers = 2;
  r.kv_heads = 2;
  auto result = [](const std::string& m, double keep, std::vector<double> recall, std::vector<double> err) {
    eval::Result x;
    x.method = m;
    x.keep = keep;
    for (std::int64_t l = 0; l < 2; ++l)
      for (std::int64_t h = 0; h < 2; ++h) {
        eval::HeadResult hr;
        hr.layer = l;
        hr.head = h;
        hr.attention_mass_recall = recall[std::size_t(l * 2 + h)];
        hr.output_rel_error = err[std::size_t(l * 2 + h)];
        x.per_head.push_back(hr);
      }
    return x;
  };
  // layer 0: snapkv best by recall (0.8 vs 0.7); layer 1: l2 (0.65 vs 0.55). knorm ties snapkv in
  // layer 0 at keep 0.5 and comes later, so snapkv keeps it. oracle, pariskv and ojakv are never
  // chosen. By error (lower is better), layer 0 goes to l2.
  r.results = {result("snapkv", 0.25, {0.9, 0.7, 0.5, 0.6}, {0.3, 0.3, 0.5, 0.5}),
               result("l2", 0.25, {0.7, 0.7, 0.6, 0.7}, {0.2, 0.2, 0.6, 0.6}),
               result("oracle", 0.25, {1, 1, 1, 1}, {0, 0, 0, 0}),
               result("pariskv", 0.25, {1, 1, 1, 1}, {0, 0, 0, 0}),
               result("ojakv", 0.25, {1, 1, 1, 1}, {0, 0, 0, 0}),
               result("snapkv", 0.5, {0.9, 0.9, 0.9, 0.9}, {0, 0, 0, 0}),
               result("knorm", 0.5, {0.9, 0.9, 0.95, 0.9}, {0, 0, 0, 0})};
  const auto best = eval::per_layer_best(r);
  REQUIRE(best.size() == 2);
  CHECK(best[0].keep == 0.25);
  CHECK(best[0].methods == std::vector<std::string>{"snapkv", "l2"});
  CHECK(best[0].values[0] == Approx(0.8));
  CHECK(best[0].values[1] == Approx(0.65));
  CHECK(best[1].methods == std::vector<std::string>{"snapkv", "knorm"});
  const auto by_err = eval::per_layer_best(r, eval::MixMetric::output_error);
  CHECK(by_err[0].methods == std::vector<std::string>{"l2", "snapkv"});
  CHECK(by_err[0].values[0] == Approx(0.2));
  CHECK(eval::mixable("streaming_llm"));
  CHECK(eval::mixable("manifoldkv"));
  CHECK(!eval::mixable("oracle"));
  CHECK(!eval::mixable("pariskv-flat"));
  CHECK(!eval::mixable("ojakv"));
  CHECK(!eval::mixable("mine"));
  const std::string js = eval::to_json(r);
  CHECK_THAT(js, Contains("\"per_layer_best\": [\n    {\"keep\": 0.25, \"metric\": \"attention_mass_recall\", "
                          "\"methods\": [\"snapkv\", \"l2\"], \"values\": [0.80000000000000004, 0.6499999999999999"));
  r.results.resize(5);  // no entry for keep 0.5 then; and none at all without a mixable method
  CHECK(eval::per_layer_best(r).size() == 1);
  r.results.erase(r.results.begin(), r.results.begin() + 2);
  CHECK(eval::per_layer_best(r).empty());
  CHECK_THAT(eval::to_json(r), Contains("\"per_layer_best\": []\n}"));
}

TEST_CASE("names: every option enum round-trips through to_string / parse, the CLI spelling too", "[eval][names]") {
  using kvscore::detail::cli_spelling;
  const auto round_trip = [](const auto& values, auto parse) {
    for (const auto v : values) {
      INFO(to_string(v));
      CHECK(parse(to_string(v)) == v);
      CHECK(parse(cli_spelling(to_string(v))) == v);
    }
  };
  round_trip(kvscore::kAllocs, [](std::string_view s) { return kvscore::parse_alloc(s); });
  round_trip(kvscore::kBudgetRoundings, [](std::string_view s) { return kvscore::parse_budget_rounding(s); });
  round_trip(kvscore::kQueryPlacements, [](std::string_view s) { return kvscore::parse_query_placement(s); });
  round_trip(kvscore::kWindowTails, [](std::string_view s) { return kvscore::parse_window_tail(s); });
  round_trip(kvscore::eval::kProtocols, [](std::string_view s) { return kvscore::eval::parse_protocol(s); });
  round_trip(kvscore::eval::kMixMetrics, [](std::string_view s) { return kvscore::eval::parse_mix_metric(s); });
  round_trip(kvscore::kPsis, [](std::string_view s) { return kvscore::parse_psi(s); });
  CHECK(std::string(to_string(kvscore::Alloc::per_head)) == "per_head");
  CHECK(cli_spelling(to_string(kvscore::eval::Protocol::leak_free)) == "leak-free");
  CHECK(kvscore::detail::spellings(kvscore::eval::kMixMetrics) == "'recall', 'error' or 'overlap'");
  CHECK(kvscore::detail::spellings(kvscore::kAllocs, true) == "per-head or adakv");
  CHECK_THROWS_WITH(kvscore::parse_alloc("greedy"), "kvscore: alloc 'greedy' must be 'per_head' or 'adakv'");
  CHECK_THROWS_WITH(kvscore::eval::parse_protocol("leak free"), Contains("protocol 'leak free'"));
  CHECK_THROWS_AS(kvscore::parse_budget_rounding(""), std::invalid_argument);
}

TEST_CASE("eval: layer_inputs cuts 4-D tensors into layers and names the tensor that does not fit", "[eval]") {
  namespace ev = kvscore::eval;
  const std::vector<float> k(2 * 2 * 5 * 4), v(2 * 2 * 5 * 3), q(2 * 4 * 3 * 4), w(2 * 4 * 2 * 4);
  ev::EvalInputs in{{k.data(), {2, 2, 5, 4}, "K"}, {v.data(), {2, 2, 5, 3}, "V"}, {q.data(), {2, 4, 3, 4}, "Q"},
                    {w.data(), {2, 4, 2, 4}, "W"}, {nullptr, {}, "C"}};
  const std::vector<ev::LayerInput> layers = ev::layer_inputs(in);
  REQUIRE(layers.size() == 2);
  CHECK(layers[1].keys == k.data() + 2 * 5 * 4);
  CHECK(layers[1].values == v.data() + 2 * 5 * 3);
  CHECK(layers[1].queries == q.data() + 4 * 3 * 4);
  CHECK(layers[1].window_queries == w.data() + 4 * 2 * 4);
  CHECK((layers[0].kv_heads == 2 && layers[0].tokens == 5 && layers[0].head_dim == 4 && layers[0].value_dim == 3));
  CHECK((layers[0].q_heads == 4 && layers[0].n_queries == 3 && layers[0].n_window == 2 && layers[0].n_calib == 0));
  ev::EvalInputs bad = in;
  bad.values.shape = {2, 2, 4, 3};
  CHECK_THROWS_WITH(ev::layer_inputs(bad), Contains("V: values [2, 2, 4, 3] do not match keys [2, 2, 5, 4]"));
  bad = in;
  bad.queries.shape = {2, 3, 3, 4};
  CHECK_THROWS_WITH(ev::layer_inputs(bad), Contains("Q: q_heads 3 is not a multiple of the 2 kv_heads of K"));
  bad = in;
  bad.window.shape = {2, 4, 6, 4};
  CHECK_THROWS_WITH(ev::layer_inputs(bad), Contains("W: 6 window queries"));
}
