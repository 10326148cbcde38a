// The method registry (include/kvscore/methods.hpp): every spelling finds its entry, the
// evaluator's built-ins are the registry in its order, each entry's header and doc page exist
// and the doc page names the method; its constructors (make_scorer.hpp,
// make_method.hpp) build under every spelling what a direct construction gives, and reject
// the rest. (The scorer types are tied to it in test_contract.cpp, the CLI in
// tests/cli/test_cli.cpp, Python in python/tests/test_core.py.)
#include <catch2/catch.hpp>

#include <kvscore/eval/methods.hpp>
#include <kvscore/make_method.hpp>
#include <kvscore/methods.hpp>
#include <kvscore/make_scorer.hpp>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

const fs::path kRoot = fs::path(KVSCORE_TEST_DATA_DIR) / ".." / "..";

std::vector<std::string> spellings(const kvscore::MethodInfo& m) {
  std::vector<std::string> s{std::string(m.name), std::string(m.cli)};
  for (std::string_view a : kvscore::split_list(m.aliases)) s.emplace_back(a);
  return s;
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

TEST_CASE("methods: every spelling finds its entry, and no other", "[methods]") {
  std::set<std::string> seen;
  for (const kvscore::MethodInfo& m : kvscore::kMethods) {
    INFO(m.name);
    CHECK(!m.summary.empty());
    for (const std::string& s : spellings(m)) {
      INFO(s);
      CHECK(kvscore::find_method_info(s) == &m);
      CHECK(&kvscore::method_info(s) == &m);
      if (s != m.name && s != m.cli) CHECK(seen.insert(s).second);  // an alias names one method
    }
    CHECK(seen.insert(std::string(m.name)).second);
    if (m.cli != m.name) CHECK(seen.insert(std::string(m.cli)).second);
  }
  CHECK(kvscore::find_method_info("") == nullptr);
  CHECK(kvscore::find_method_info("L2") == nullptr);  // spellings are exact
  CHECK(kvscore::find_method_info("l2,knorm") == nullptr);
  CHECK_THROWS_WITH(kvscore::method_info("nope"), Contains("unknown method 'nope'") && Contains("windowed-l2") &&
                                                      Contains("ojakv"));
}

TEST_CASE("methods: the evaluator's built-ins are the registry, in order, under the CLI spelling", "[methods]") {
  const std::vector<kvscore::eval::Method> b = kvscore::eval::builtin_methods();
  REQUIRE(b.size() == kvscore::kMethods.size());
  for (std::size_t i = 0; i < b.size(); ++i) {
    const kvscore::MethodInfo& m = kvscore::kMethods[i];
    INFO(m.name);
    CHECK(b[i].name == m.cli);
    CHECK(b[i].summary == m.summary);
    // every spelling reaches the same evaluator entry
    for (const std::string& s : spellings(m)) CHECK(kvscore::eval::find_method(s).name == m.cli);
  }
  CHECK(!kvscore::eval::builtin_run("not_a_method"));
  // one method under two spellings is listed twice; a built-in's alias cannot be registered
  CHECK_THROWS_WITH(kvscore::eval::resolve_methods("l2,manifold_l2"),
                    Contains("'manifold_l2' is listed twice (it is 'l2')"));
  CHECK(kvscore::eval::resolve_methods("manifoldkv,windowed_manifold_l2") ==
        std::vector<std::string>{"manifoldkv", "windowed_manifold_l2"});
  CHECK_THROWS_WITH(kvscore::eval::register_method({"manifoldkv", "dup", kvscore::eval::oracle_method}),
                    Contains("'manifoldkv' is already registered"));
}

TEST_CASE("methods: each entry's header and doc page exist, and the page names the method", "[methods]") {
  for (const kvscore::MethodInfo& m : kvscore::kMethods) {
    INFO(m.name << ": include/" << m.header << ", docs/" << m.doc);
    CHECK(fs::exists(kRoot / "include" / m.header));
    REQUIRE(fs::exists(kRoot / "docs" / m.doc));
    const std::string doc = read(kRoot / "docs" / m.doc);
    CHECK(doc.find(std::string(m.cli)) != std::string::npos);
    if (!m.cls.empty()) {
      CHECK(doc.find(std::string(m.cls)) != std::string::npos);
      CHECK(read(kRoot / "include" / m.header).find(" " + std::string(m.cls)) != std::string::npos);
    }
  }
}

namespace {

/// Scorer `s`'s scores equal `want`'s bit for bit on c as fp32 and bf16, and so does
/// protected_recent (same scorer, same input: nothing may differ).
template <class Want>
void same_scorer(const kvscore::AnyScorer& s, const Want& want, const test_support::Cache& c) {
  CHECK(std::string(s.name()) == Want::name);
  CHECK(s.get<Want>() != nullptr);
  CHECK(s.protected_recent() == kvscore::protected_recent(want));
  for (int bf16 = 0; bf16 < 2; ++bf16) {
    const kvscore::Scores a = bf16 ? test_support::run<kvscore::bfloat16>(s, c) : test_support::run(s, c);
    const kvscore::Scores b = bf16 ? test_support::run<kvscore::bfloat16>(want, c) : test_support::run(want, c);
    REQUIRE(a.heads() == b.heads());
    REQUIRE(a.tokens() == b.tokens());
    CHECK(std::memcmp(a.data(), b.data(), sizeof(float) * std::size_t(a.heads() * a.tokens())) == 0);
  }
}

}  // namespace

TEST_CASE("make_scorer: every scorer of the registry, under every spelling, equals a direct construction",
          "[methods][make_scorer]") {
  using namespace kvscore;
  const test_support::Cache c = test_support::random_cache(7, 2, 96, 16, 0.5f);
  const std::int64_t q_heads = 4, w = 8;
  const test_support::Cache q = test_support::random_cache(8, q_heads, w, 16);
  ScorerArgs a;
  a.window = 40;  // windowed_manifold_l2: 96 tokens = 2 windows + a merged tail
  a.window_tail = WindowTail::own;
  a.queries = q.v.data();
  a.q_heads = q_heads;
  a.n_queries = w;
  a.head_dim = 16;
  a.kv_heads = 2;
  a.placement = QueryPlacement::after_cache;
  int scorers = 0;
  for (const MethodInfo& m : kMethods) {
    if (!is_scorer(m)) continue;
    ++scorers;
    for (const std::string& sp : spellings(m)) {
      INFO(m.name << " as '" << sp << "'");
      const AnyScorer s = make_scorer(sp, a);
      if (m.name == "knorm") same_scorer(s, KNorm{}, c);
      else if (m.name == "keydiff") same_scorer(s, KeyDiff{}, c);
      else if (m.name == "manifold_l2") same_scorer(s, ManifoldL2{}, c);
      else if (m.name == "windowed_manifold_l2") same_scorer(s, WindowedManifoldL2(40, WindowTail::own), c);
      else if (m.name == "qfilter")  // no filters given: calibrated on the queries
        same_scorer(s, QFilter(calibrate_qfilters(q.v.data(), q_heads, w, 16, 2), 2, 16), c);
      else if (m.name == "snapkv") {
        SnapKV want(q.v.data(), q_heads, w, 16);
        want.placement = QueryPlacement::after_cache;
        same_scorer(s, want, c);
      } else if (m.name == "protokv") {
        ProtoKV want(q.v.data(), q_heads, w, 16);
        want.placement = QueryPlacement::after_cache;
        same_scorer(s, want, c);
      } else if (m.name == "kvzip") {
        KVzip want(q.v.data(), q_heads, w, 16);
        want.placement = QueryPlacement::after_cache;
        same_scorer(s, want, c);
      } else
        FAIL("a scorer of kMethods this test does not know: add it above");
    }
  }
  CHECK(scorers == int(std::tuple_size_v<ScorerTypes>));
}

TEST_CASE("make_scorer: given filters, threads, the ISA table and in-cache placement reach the scorer",
          "[methods][make_scorer]") {
  using namespace kvscore;
  const test_support::Cache c = test_support::random_cache(9, 3, 50, 8);
  ScorerArgs a;
  a.filters = test_support::random_filters(3, 3, 8);
  a.kv_heads = 3;
  a.head_dim = 8;
  a.threads = 3;
  a.isa = &simd::scalar_table();
  AnyScorer s = make_scorer("q-filters", a);
  CHECK(s.options().num_threads == 3);
  CHECK(s.options().isa == &simd::scalar_table());
  QFilter want(a.filters, 3, 8);
  want.isa = &simd::scalar_table();  // the same table: the scores are then bit-identical
  same_scorer(s, want, c);

  const test_support::Cache q = test_support::random_cache(10, 6, 5, 8);
  a.queries = q.v.data();
  a.q_heads = 6;
  a.n_queries = 5;
  const AnyScorer snap = make_scorer("snapkv", a);  // placement in_cache (the default): the window is protected
  CHECK(snap.protected_recent() == 5);
  CHECK(make_scorer("knorm", a).protected_recent() == 0);
}

TEST_CASE("make_scorer: each option reaches the scorers whose registry entry reads it, and no other",
          "[methods][make_scorer]") {
  using namespace kvscore;
  const test_support::Cache c = test_support::random_cache(12, 2, 80, 16, 0.5f);
  const test_support::Cache q = test_support::random_cache(13, 4, 6, 16);
  ScorerArgs base;
  base.queries = q.v.data(), base.q_heads = 4, base.n_queries = 6, base.head_dim = 16, base.kv_heads = 2;
  base.window = 35;  // windowed_manifold_l2: 80 tokens = 2 windows and a tail of 10 that merges
  // a value other than the default for every option a test can change; the inputs (queries,
  // group, filters) are not changed here
  const std::pair<const char*, std::function<void(ScorerArgs&)>> changes[] = {
      {"window", [](ScorerArgs& a) { a.window = 20; }},
      {"window_tail", [](ScorerArgs& a) { a.window_tail = WindowTail::own; }},
      {"placement", [](ScorerArgs& a) { a.placement = QueryPlacement::after_cache; }},
      {"kernel_size", [](ScorerArgs& a) { a.kernel_size = 3; }},
      {"seed", [](ScorerArgs& a) { a.seed = 9; }},
      {"kappa", [](ScorerArgs& a) { a.kappa = 2; }},
      {"sat_candidates", [](ScorerArgs& a) { a.sat_candidates = 10; }},
      {"lsh_bits", [](ScorerArgs& a) { a.lsh_bits = 3; }},
      {"chunks", [](ScorerArgs& a) { a.chunks = 7; }},
      {"bandwidth", [](ScorerArgs& a) { a.bandwidth = 0.5; }},
      {"psi", [](ScorerArgs& a) { a.psi = ProtoKV::Psi::sum; }},
      {"aggregate", [](ScorerArgs& a) { a.aggregate = QueryAggregate::mean; }},
  };
  const std::set<std::string> inputs = {"queries", "group", "filters"};
  for (const MethodInfo& m : kMethods) {
    if (!is_scorer(m)) continue;
    for (std::string_view o : split_list(m.options)) {
      INFO(m.name << " reads '" << o << "'");
      const bool known = inputs.count(std::string(o)) > 0 ||
                         std::any_of(std::begin(changes), std::end(changes), [&](const auto& x) { return o == x.first; });
      CHECK(known);  // a new option: add a change above
    }
    const AnyScorer ref = make_scorer(m.name, base);
    const kvscore::Scores ref_scores = test_support::run(ref, c);
    for (const auto& [option, change] : changes) {
      INFO(m.name << ", option " << option);
      ScorerArgs a = base;
      change(a);
      const AnyScorer s = make_scorer(m.name, a);
      const kvscore::Scores scores = test_support::run(s, c);
      const bool same = s.protected_recent() == ref.protected_recent() &&
                        std::memcmp(scores.data(), ref_scores.data(), sizeof(float) * ref_scores.values().size()) == 0;
      CHECK(same != reads_option(m, option));  // on this cache every option a scorer reads changes it
    }
  }

  // the ProtoKV and SnapKV members themselves: ScorerArgs names them as the scorers do
  const auto set = [](auto& x) {
    x.seed = 9, x.kappa = 2, x.sat_candidates = 10, x.lsh_bits = 3, x.chunks = 7, x.bandwidth = 0.5;
    x.psi = ProtoKV::Psi::mean;
  };
  ScorerArgs a = base;
  set(a);
  a.kernel_size = 3;
  ProtoKV proto(q.v.data(), 4, 6, 16);
  set(proto);
  same_scorer(make_scorer("protokv", a), proto, c);
  SnapKV snap(q.v.data(), 4, 6, 16);
  snap.kernel_size = 3;
  same_scorer(make_scorer("snapkv", a), snap, c);
  a.aggregate = QueryAggregate::mean;
  KVzip zip(q.v.data(), 4, 6, 16);
  zip.aggregate = QueryAggregate::mean;
  same_scorer(make_scorer("kvzip", a), zip, c);
}

TEST_CASE("make_scorer: a method that is not a scorer, an unknown name, missing queries or filters are errors",
          "[methods][make_scorer][errors]") {
  using namespace kvscore;
  const ScorerArgs none;
  for (const char* m : {"pariskv", "pariskv-flat", "ojakv", "streaming_llm", "oracle"})
    CHECK_THROWS_WITH(make_scorer(m, none), Contains(std::string("method '") + m + "'") && Contains("not a scorer") &&
                                                Contains("snapkv"));
  CHECK_THROWS_WITH(make_scorer("nope", none), Contains("unknown method 'nope'"));
  CHECK_THROWS_WITH(make_scorer("snapkv", none), Contains("'snapkv' needs queries"));
  CHECK_THROWS_WITH(make_scorer("protokv", none), Contains("'protokv' needs queries"));
  CHECK_THROWS_WITH(make_scorer("qfilter", none), Contains("needs filters or queries"));
  ScorerArgs bad;
  bad.window = 0;
  CHECK_THROWS_AS(make_scorer("windowed-l2", bad), std::invalid_argument);  // the scorer's own check
  bad.filters = {1.f, 2.f, 3.f};
  bad.kv_heads = 2;
  bad.head_dim = 2;
  CHECK_THROWS_WITH(make_scorer("qfilter", bad), Contains("filters hold 3 values"));
}

// ---------------------------------------------------------------- the other kinds (make_method.hpp)

TEST_CASE("make_retriever: a budget gives exactly the zones plus a direct index's top k, every spelling",
          "[methods][make_method][pariskv]") {
  using namespace kvscore;
  const std::int64_t N = 700, d = 32;
  const test_support::Cache k = test_support::random_cache(11, 1, N, d, 0.3f);
  const test_support::Cache v = test_support::random_cache(12, 1, N, d);
  const test_support::Cache q = test_support::random_cache(13, 1, 4, d);
  int retrievers = 0;
  for (const MethodInfo& m : kMethods) {
    if (m.kind != MethodKind::retriever) continue;
    ++retrievers;
    const bool flat = m.name == "pariskv_flat";
    REQUIRE((flat || m.name == "pariskv"));
    // 40: zones 4 + 18 + 18 retrieved; 600: R = 440 < 2k = 680, where the dense fallback would
    // return all 700 positions; 3: sinks only
    for (const std::int64_t n : {std::int64_t(3), std::int64_t(40), std::int64_t(600)})
      for (const std::string& sp : spellings(m)) {
        INFO(m.name << " as '" << sp << "', budget " << n);
        RetrieverArgs a;
        a.budget = n;
        ParisKVCache<float> r = make_retriever<float>(sp, d, a);
        r.append(k.v.data(), v.v.data(), N);
        const std::int64_t S = flat ? 0 : std::min<std::int64_t>(4, n);
        const std::int64_t L = flat ? 0 : std::min<std::int64_t>(256, (n - S) / 2);
        ParisKV index(d);  // the retrieval zone, indexed directly
        index.append(k.row(0, S), N - S - L, d);
        ParisKVSearch so;
        so.k = n - S - L;
        for (std::int64_t i = 0; i < 4; ++i) {
          std::vector<std::int64_t> want;
          for (std::int64_t t = 0; t < S; ++t) want.push_back(t);
          if (so.k > 0)
            for (std::int64_t p : index.search(q.row(0, i), so).positions) want.push_back(S + p);
          for (std::int64_t t = N - L; t < N; ++t) want.push_back(t);
          const std::vector<std::int64_t> got = r.select(q.row(0, i));
          CHECK(std::int64_t(got.size()) == n);
          CHECK(got == want);
        }
      }
  }
  CHECK(retrievers == 2);
  // no budget: the decode-time defaults (pariskv) or one zone-less index (pariskv_flat)
  const ParisKVCacheConfig def = retriever_config("pariskv", {}), flat = retriever_config("pariskv-flat", {});
  const ParisKVCacheConfig ref{};
  CHECK((def.sinks == ref.sinks && def.local == ref.local && def.update_interval == ref.update_interval &&
         def.search.k == ref.search.k && def.dense_fallback));
  CHECK((flat.sinks == 0 && flat.local == 0 && flat.search.k == ref.search.k && !flat.dense_fallback));
}

TEST_CASE("make_hybrid: OjaKV equals its direct construction (projectors, residual rule, store)",
          "[methods][make_method][ojakv]") {
  using namespace kvscore;
  const std::int64_t H = 2, N = 120, d = 16, G = 2, w = 6, n = 30;
  const test_support::Cache k = test_support::random_cache(21, H, N, d, 0.2f);
  const test_support::Cache v = test_support::random_cache(22, H, N, d);
  const test_support::Cache q = test_support::random_cache(23, H * G, w, d);
  const KeysView<float> keys(k.v.data(), H, N, d, N * d, d), values(v.v.data(), H, N, d, N * d, d);
  HybridArgs a;
  a.budget = n;
  a.rank = 5;
  a.seed = 9;
  a.queries = q.v.data();
  a.q_heads = H * G;
  a.n_queries = w;
  a.placement = QueryPlacement::after_cache;
  a.select.sinks = 2;
  const HybridBuild b = make_hybrid("ojakv", keys, values, a);

  std::vector<OjaProjector> proj;
  std::vector<Eigen::MatrixXd> bases;
  for (std::int64_t h = 0; h < H; ++h) {
    proj.push_back(OjaProjector::random(d, 5, 5, 9 + std::uint64_t(h)));
    proj.back().prefill(keys, values, h);
    bases.push_back(proj.back().key().basis());
  }
  OjaResidual res(q.v.data(), H * G, w, d, bases);
  res.placement = QueryPlacement::after_cache;
  SelectOptions so;
  so.sinks = 2;
  const Selection want = select(res.score(keys), Budget::per_head(n), so);
  const OjaHybridCache cache = OjaHybridCache::build(proj, keys, values, want);
  REQUIRE(b.projectors.size() == std::size_t(H));
  CHECK(b.full_rank.positions == want.positions);
  CHECK(b.full_rank.offsets == want.offsets);
  for (std::int64_t h = 0; h < H; ++h) {
    CHECK(b.projectors[std::size_t(h)].key().basis() == proj[std::size_t(h)].key().basis());
    CHECK(b.cache.reconstruct_keys(h) == cache.reconstruct_keys(h));
    CHECK(b.cache.reconstruct_values(h) == cache.reconstruct_values(h));
    for (std::int64_t t = 0; t < 2; ++t) CHECK(b.full_rank.head(h)[std::size_t(t)] == t);  // the sinks stay full rank
  }
  a.rank = 0;  // default rank: max(1, head_dim / 4)
  CHECK(make_hybrid("ojakv", keys, values, a).cache.head(0).uk.cols() == 4);
}

TEST_CASE("make_method: every entry but the reference builds through its kind's constructor, wrong kinds are errors",
          "[methods][make_method][errors]") {
  using namespace kvscore;
  const test_support::Cache k = test_support::random_cache(31, 1, 64, 8);
  const test_support::Cache q = test_support::random_cache(32, 1, 4, 8);
  const KeysView<float> keys(k.v.data(), 1, 64, 8, 64 * 8, 8);
  for (const MethodInfo& m : kMethods) {
    INFO(m.name);
    switch (m.kind) {
      case MethodKind::scorer:
      case MethodKind::query_scorer: {
        ScorerArgs a;
        a.queries = q.v.data();
        a.q_heads = 1;
        a.n_queries = 4;
        a.head_dim = 8;
        a.kv_heads = 1;
        CHECK(make_scorer(m.cli, a).score(keys).tokens() == 64);
        break;
      }
      case MethodKind::selection_rule:
        CHECK(make_selection_rule(m.cli, {2}).select(1, 64, Budget::per_head(10)).head(0).size() == 10);
        break;
      case MethodKind::retriever: {
        RetrieverArgs a;
        a.budget = 10;
        ParisKVCache<float> r = make_retriever<float>(m.cli, 8, a);
        r.append(k.v.data(), k.v.data(), 64);
        CHECK(r.select(q.row(0, 0)).size() == 10);
        break;
      }
      case MethodKind::hybrid: {
        HybridArgs a;
        a.budget = 10;
        a.queries = q.v.data();
        a.q_heads = 1;
        a.n_queries = 4;
        CHECK(make_hybrid(m.cli, keys, keys, a).cache.tokens() == 64);
        break;
      }
      case MethodKind::reference:
        CHECK(m.name == "oracle");  // the evaluator's own ceiling (eval::oracle_method)
        break;
    }
  }
  CHECK_THROWS_WITH(make_retriever<float>("knorm", 8), Contains("method 'knorm' is a scorer, not a retriever") &&
                                                           Contains("pariskv-flat"));
  CHECK_THROWS_WITH(make_selection_rule("pariskv"), Contains("is a retriever, not a selection_rule"));
  HybridArgs ha;
  CHECK_THROWS_WITH(make_hybrid("snapkv", keys, keys, ha), Contains("is a query_scorer, not a hybrid"));
  CHECK_THROWS_WITH(make_hybrid("ojakv", keys, keys, ha), Contains("'ojakv' needs queries"));
  CHECK_THROWS_WITH(make_retriever<float>("nope", 8), Contains("unknown method 'nope'"));
  RetrieverArgs neg;
  neg.budget = -1;
  CHECK_THROWS_WITH(make_retriever<float>("pariskv", 8, neg), Contains("budget must be >= 0 (got -1)"));
}
