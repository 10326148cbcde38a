// ProtoKV (include/kvscore/scorers/protokv.hpp, docs/methods/protokv.md): golden values from an
// independent float64 numpy implementation (tests/data/protokv/, tools/gen_protokv_fixtures.py),
// bit-exact RNG, planted structure (anchors kept whole at a 5% budget, chunk prototypes recover
// contiguous topics, sum vs mean ψ), the cluster-granular selection for every budget, equivalence
// to token-level selection when every cluster is a singleton, GQA, AdaKV composition, invalid and
// zero keys, every error path, determinism.
//
// The fixture generator asserts that every discrete decision (the p-th candidate, each LSH sign,
// each argmax, the order of ψ and of q̄·k inside a cluster) has a margin far above fp32 rounding,
// so ranks, candidates, buckets and clusters must match exactly; continuous values (S, ψ, σ) get
// tolerances from the fp32 dot error (d·2^-24·Σ|x_j y_j|, here < 1e-5 relative).
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/make_scorer.hpp>
#include <kvscore/scorers/protokv.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using kvscore::ProtoKV;
using Catch::Matchers::Contains;
using namespace test_support;  // randn, kernel_tables, BlockView, fixtures, ...


// ----------------------------------------------------------------- fixtures

struct PkCase {
  std::string name, dir, keys_dir;
  std::int64_t kv = 0, hq = 0, group = 0, N = 0, d = 0, w = 0;
  kvscore::ScorerArgs opt;  ///< ProtoKV's options (the members ScorerArgs and ProtoKV name alike)
};

std::vector<PkCase> pk_cases() {
  std::vector<PkCase> out;
  for (const std::string& line : manifest("protokv")) {
    PkCase c;
    c.name = line;
    c.dir = fixture_dir("protokv") + "/" + line;
    const std::string p = read_text(c.dir + "/params.json");
    c.keys_dir = fixture_dir("protokv") + "/" + json_value(p, "keys_from");
    c.kv = json_int(p, "kv_heads"), c.hq = json_int(p, "q_heads"), c.group = json_int(p, "group");
    c.N = json_int(p, "tokens"), c.d = json_int(p, "head_dim"), c.w = json_int(p, "window");
    kvscore::ScorerArgs& o = c.opt;
    o.kappa = json_int(p, "kappa"), o.sat_candidates = json_int(p, "sat_candidates");
    o.lsh_bits = int(json_int(p, "lsh_bits")), o.chunks = json_int(p, "chunks");
    o.bandwidth = std::stod(json_value(p, "bandwidth")), o.seed = std::stoull(json_value(p, "seed"));
    o.psi = json_value(p, "psi") == "mean" ? ProtoKV::Psi::mean : ProtoKV::Psi::sum;
    out.push_back(c);
  }
  return out;
}

ProtoKV pk_make(const PkCase& c, const std::vector<float>& q) {
  ProtoKV pk(q.data(), c.hq, c.w, c.d, c.group);
  const kvscore::ScorerArgs& o = c.opt;
  pk.kappa = o.kappa, pk.sat_candidates = o.sat_candidates, pk.lsh_bits = o.lsh_bits, pk.chunks = o.chunks;
  pk.bandwidth = o.bandwidth, pk.seed = o.seed, pk.psi = o.psi;
  return pk;
}

template <class T>
void pk_golden(const PkCase& c) {
  const auto ka = kvscore::npy::load(c.keys_dir + "/keys_" + type_tag<T>() + ".npy");
  REQUIRE(ka.shape == std::vector<std::int64_t>{c.kv, c.N, c.d});
  const std::vector<T> keys = ka.template to_vector<T>();
  const std::vector<float> q = kvscore::npy::load(c.keys_dir + "/queries.npy").template to_vector<float>();
  REQUIRE(std::int64_t(q.size()) == c.hq * c.w * c.d);
  auto load = [&](const char* what) {
    return kvscore::npy::load(c.dir + "/" + type_tag<T>() + "_" + what + ".npy");
  };
  const std::vector<double> exp_scores = load("scores").template to_vector<double>();
  const std::vector<double> exp_S = load("similarity").template to_vector<double>();
  const auto ca = load("candidates");
  const std::vector<std::int64_t> exp_cand = ca.template to_vector<std::int64_t>();
  const std::vector<std::int64_t> exp_bucket = load("buckets").template to_vector<std::int64_t>();
  const std::vector<std::int64_t> exp_cl = load("cluster").template to_vector<std::int64_t>();
  const auto pa = load("psi");
  const std::vector<double> exp_psi = pa.template to_vector<double>();
  const std::vector<double> exp_sigma = load("bandwidth").template to_vector<double>();
  const std::int64_t p = ca.shape[1], Pmax = pa.shape[1];

  ProtoKV pk = pk_make(c, q);
  const KeysView<T> hf(keys.data(), c.kv, c.N, c.d, c.N * c.d, c.d);
  const std::vector<T> tm = token_major(keys, c.kv, c.N, c.d);
  const auto tmv = KeysView<T>::token_major(tm.data(), c.N, c.kv, c.d);
  const std::vector<T> bl = to_blocks(keys, c.kv, c.N, c.d, 7);
  const BlockView<T> blv{bl.data(), c.kv, c.N, c.d, 7};

  for (const auto* isa : kernel_tables()) {
    INFO("isa " << (isa ? isa->name : "active"));
    pk.isa = isa;
    const Scores s = pk.score(hf);
    for (std::int64_t i = 0; i < c.kv * c.N; ++i) {
      INFO("score [" << i / c.N << ", " << i % c.N << "]");
      REQUIRE(double(s.data()[i]) == exp_scores[std::size_t(i)]);
    }
    CHECK(pk.score(tmv).values() == s.values());
    CHECK(pk.score(blv).values() == s.values());
    for (std::int64_t h = 0; h < c.kv; ++h) {
      INFO("head " << h);
      const kvscore::ProtoKVHead a = pk.analyze(hf, h);
      for (std::int64_t t = 0; t < c.N; ++t) {
        const double e = exp_S[std::size_t(h * c.N + t)];
        if (std::isnan(e)) CHECK(std::isnan(a.similarity[std::size_t(t)]));
        else CHECK(std::fabs(a.similarity[std::size_t(t)] - e) <= 2e-6);
        CHECK(a.cluster[std::size_t(t)] == exp_cl[std::size_t(h * c.N + t)]);
      }
      REQUIRE(std::int64_t(a.candidates.size()) == p);
      for (std::int64_t x = 0; x < p; ++x) {
        CHECK(a.candidates[std::size_t(x)] == exp_cand[std::size_t(h * p + x)]);
        CHECK(a.candidate_bucket[std::size_t(x)] == exp_bucket[std::size_t(h * p + x)]);
      }
      CHECK(std::fabs(a.bandwidth - exp_sigma[std::size_t(h)]) <= 1e-6 * exp_sigma[std::size_t(h)]);
      const std::int64_t P = a.pdt_prototypes + a.sat_prototypes;
      REQUIRE(P <= Pmax);
      double qmax = 0;
      for (float x : a.qk) qmax = std::max(qmax, double(std::fabs(x)));
      for (std::int64_t cidx = 0; cidx < Pmax; ++cidx) {
        const double e = exp_psi[std::size_t(h * Pmax + cidx)];
        if (cidx >= P) {
          CHECK(std::isnan(e));
          continue;
        }
        // each member's fp32 q̄·k carries <= d·2^-24·Σ|q̄_j k_j| error
        CHECK(std::fabs(a.psi[std::size_t(cidx)] - e) <= 2e-5 * qmax * double(std::max<std::int64_t>(1, a.cluster_size[std::size_t(cidx)])));
      }
    }
  }
}

// ----------------------------------------------------------------- planted data

/// Keys with contiguous topics (segment s of length L shares a direction), a shared mean, noise.
std::vector<float> pk_topics(std::int64_t N, std::int64_t d, std::int64_t L, std::uint32_t seed, float noise = 0.3f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const std::int64_t T = (N + L - 1) / L;
  std::vector<float> dir(std::size_t(T * d)), mu(static_cast<std::size_t>(d));
  for (float& x : mu) x = nd(g) * 0.2f;
  for (float& x : dir) x = nd(g) * 2.f / std::sqrt(float(d));
  std::vector<float> k(std::size_t(N * d));
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t j = 0; j < d; ++j)
      k[std::size_t(t * d + j)] = mu[std::size_t(j)] + dir[std::size_t((t / L) * d + j)] + noise * nd(g) / std::sqrt(float(d));
  return k;
}

}  // namespace

TEST_CASE("ProtoKV golden: fixtures present (GQA 1/2/4, d 17/32/64, sum and mean, w = N)", "[protokv]") {
  const auto cs = pk_cases();
  REQUIRE(cs.size() == 4);
  bool mean = false;
  for (const auto& c : cs) mean = mean || c.opt.psi == ProtoKV::Psi::mean;
  CHECK(mean);
}

TEST_CASE("ProtoKV golden: float32 keys match the float64 numpy reference", "[protokv]") {
  for (const auto& c : pk_cases()) {
    INFO("case " << c.name);
    pk_golden<float>(c);
  }
}

TEST_CASE("ProtoKV golden: float16 keys match the float64 numpy reference", "[protokv]") {
  for (const auto& c : pk_cases()) {
    INFO("case " << c.name);
    pk_golden<half>(c);
  }
}

TEST_CASE("ProtoKV: RFF parameters are bit-exact with the Python splitmix64 + Box-Muller", "[protokv]") {
  using kvscore::detail::proto::SplitMix64;
  SplitMix64 g{1234567};  // published splitmix64 test vector
  CHECK(g.next() == 6457827717110365317ull);
  CHECK(g.next() == 3203168211198807973ull);
  CHECK(g.next() == 9817491932198370423ull);
  for (const auto& c : pk_cases()) {
    INFO("case " << c.name);
    const auto W = kvscore::npy::load(c.dir + "/rff_W.npy").to_vector<double>();
    const auto b = kvscore::npy::load(c.dir + "/rff_b.npy").to_vector<double>();
    for (std::int64_t h = 0; h < 2; ++h) {
      std::vector<double> w, bb;
      kvscore::detail::proto::rff_params(c.opt.seed, h, c.opt.lsh_bits, c.d, w, bb);
      REQUIRE(std::int64_t(w.size()) == c.opt.lsh_bits * c.d);
      for (std::size_t i = 0; i < w.size(); ++i)  // same libm here: equal; 1 ulp of slack elsewhere
        CHECK(std::fabs(w[i] - W[std::size_t(h) * w.size() + i]) <= 4e-16 * std::max(1.0, std::fabs(w[i])));
      for (std::size_t i = 0; i < bb.size(); ++i) CHECK(bb[i] == b[std::size_t(h) * bb.size() + i]);
    }
  }
}

TEST_CASE("ProtoKV planted: scattered compact anchors the queries attend to are kept whole at a 5% budget",
          "[protokv]") {
  const std::int64_t N = 4096, d = 64, w = 32, A = 24;
  std::vector<float> k = pk_topics(N, d, 97, 11);
  std::mt19937 g(12);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> anchor(static_cast<std::size_t>(d));
  for (float& x : anchor) x = nd(g);
  float an = 0;
  for (float x : anchor) an += x * x;
  for (float& x : anchor) x /= std::sqrt(an);
  std::set<std::int64_t> anchors;
  while (std::int64_t(anchors.size()) < A) anchors.insert(8 + std::int64_t(g() % std::uint32_t(N - 8 - w)));
  for (std::int64_t t : anchors)
    for (std::int64_t j = 0; j < d; ++j)
      k[std::size_t(t * d + j)] = 1.5f * anchor[std::size_t(j)] + 0.05f * nd(g) / std::sqrt(float(d));
  std::vector<float> q(std::size_t(w * d));
  for (std::int64_t m = 0; m < w; ++m)
    for (std::int64_t j = 0; j < d; ++j)
      q[std::size_t(m * d + j)] = anchor[std::size_t(j)] + 0.3f * nd(g) / std::sqrt(float(d));
  const KeysView<float> v(k.data(), 1, N, d, N * d, d);
  for (auto psi : {ProtoKV::Psi::sum, ProtoKV::Psi::mean}) {
    ProtoKV pk(q.data(), 1, w, d);
    pk.psi = psi;
    const kvscore::ProtoKVHead a = pk.analyze(v, 0);
    // every anchor is a SAT candidate (far from its neighbours) and lands in a SAT cluster
    std::set<std::int64_t> cand(a.candidates.begin(), a.candidates.end());
    std::set<std::int32_t> anchor_clusters;
    for (std::int64_t t : anchors) {
      CHECK(cand.count(t) == 1);
      CHECK(a.cluster[std::size_t(t)] >= a.pdt_prototypes);
      anchor_clusters.insert(a.cluster[std::size_t(t)]);
    }
    CHECK(a.sat_prototypes >= 1);
    CHECK(a.sat_prototypes <= 4);
    CHECK(a.pdt_prototypes == ProtoKV::kDefaultChunks);
    // the anchors' clusters rank first
    for (std::size_t r = 0; r < anchor_clusters.size(); ++r) CHECK(anchor_clusters.count(a.cluster_order[r]) == 1);

    const Scores s = pk.score(v);
    kvscore::SelectOptions o;
    o.sinks = 4;
    o.recent = pk.protected_recent();
    const std::int64_t n = kvscore::budget_from_ratio(N, 0.05);
    REQUIRE(n == 205);
    const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(n), o);
    std::set<std::int64_t> kept(sel.head(0).begin(), sel.head(0).end());
    for (std::int64_t t : anchors) CHECK(kept.count(t) == 1);
    // every cluster holding an anchor is kept whole (its unprotected members)
    for (std::int64_t t = 4; t < N - w; ++t)
      if (anchor_clusters.count(a.cluster[std::size_t(t)])) CHECK(kept.count(t) == 1);
  }
}

TEST_CASE("ProtoKV planted: PDT chunk prototypes recover contiguous topics", "[protokv]") {
  const std::int64_t L = 40, T = 12, N = L * T, d = 32, w = 8;
  const std::vector<float> k = pk_topics(N, d, L, 21, 0.4f);
  const std::vector<float> q = randn(std::size_t(w * d), 22);
  const KeysView<float> v(k.data(), 1, N, d, N * d, d);
  ProtoKV pk(q.data(), 1, w, d);
  pk.sat_candidates = 0;
  pk.chunks = T;
  kvscore::ProtoKVHead a = pk.analyze(v, 0);
  REQUIRE(a.pdt_prototypes == T);
  REQUIRE(a.sat_prototypes == 0);
  for (std::int64_t t = 0; t < N; ++t) CHECK(a.cluster[std::size_t(t)] == t / L);
  // with 4 SAT candidates taken out, the chunks no longer align with the topics, but the
  // nearest-prototype step still puts every token with its own topic's chunk majority
  pk.sat_candidates = 4;
  a = pk.analyze(v, 0);
  std::vector<std::set<std::int32_t>> topic_clusters(static_cast<std::size_t>(T));
  for (std::int64_t t = 0; t < N; ++t) topic_clusters[std::size_t(t / L)].insert(a.cluster[std::size_t(t)]);
  std::set<std::int32_t> seen;
  for (const auto& tc : topic_clusters) {
    for (std::int32_t c : tc) CHECK(seen.count(c) == 0);  // no cluster spans two topics
    seen.insert(tc.begin(), tc.end());
  }
}

TEST_CASE("ProtoKV: any budget keeps whole clusters in decreasing psi, then the next cluster by q.k", "[protokv]") {
  const std::int64_t N = 700, d = 24, w = 16, H = 2, G = 2;
  std::vector<float> k;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kh = pk_topics(N, d, 35, 31 + std::uint32_t(h), 0.8f);
    k.insert(k.end(), kh.begin(), kh.end());
  }
  const std::vector<float> q = randn(std::size_t(H * G * w * d), 33, 0.5f);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  for (auto psi : {ProtoKV::Psi::sum, ProtoKV::Psi::mean}) {
    ProtoKV pk(q.data(), H * G, w, d);
    pk.chunks = 30;
    pk.psi = psi;
    const Scores s = pk.score(v);
    for (std::int64_t h = 0; h < H; ++h) {
      const kvscore::ProtoKVHead a = pk.analyze(v, h);
      // q̄·k and ψ recomputed here in double from the queries
      std::vector<double> qk(std::size_t(N), 0.0);
      for (std::int64_t t = 0; t < N; ++t)
        for (std::int64_t g = 0; g < G; ++g)
          for (std::int64_t m = 0; m < w; ++m)
            for (std::int64_t j = 0; j < d; ++j)
              qk[std::size_t(t)] += double(q[std::size_t((((h * G + g) * w) + m) * d + j)]) * k[std::size_t((h * N + t) * d + j)];
      const std::int64_t P = a.pdt_prototypes + a.sat_prototypes;
      std::vector<double> ps(std::size_t(P), 0.0);
      std::vector<std::int64_t> sz(std::size_t(P), 0);
      for (std::int64_t t = 0; t < N; ++t) {
        ps[std::size_t(a.cluster[std::size_t(t)])] += qk[std::size_t(t)];
        ++sz[std::size_t(a.cluster[std::size_t(t)])];
      }
      std::vector<std::int32_t> order;
      for (std::int64_t c = 0; c < P; ++c) {
        if (psi == ProtoKV::Psi::mean && sz[std::size_t(c)] > 0) ps[std::size_t(c)] /= double(sz[std::size_t(c)]);
        if (sz[std::size_t(c)] > 0) order.push_back(std::int32_t(c));
      }
      std::stable_sort(order.begin(), order.end(),
                       [&](std::int32_t x, std::int32_t y) { return ps[std::size_t(x)] > ps[std::size_t(y)]; });
      REQUIRE(order == a.cluster_order);  // random data: no ψ within fp32 error of another
      for (std::int64_t sinks : {0, 4})
        for (std::int64_t n : {std::int64_t(w + sinks), std::int64_t(50), std::int64_t(123), std::int64_t(350), N}) {
          kvscore::SelectOptions o;
          o.sinks = sinks;
          o.recent = w;
          const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(n), o);
          // reference: protected tokens, then whole clusters (unprotected members) while they fit,
          // then the best q̄·k of the next cluster
          std::set<std::int64_t> ref;
          for (std::int64_t t = 0; t < N; ++t)
            if (t < sinks || t >= N - w) ref.insert(t);
          std::int64_t left = n - std::int64_t(ref.size());
          for (std::int32_t c : order) {
            std::vector<std::int64_t> mem;
            for (std::int64_t t = 0; t < N; ++t)
              if (a.cluster[std::size_t(t)] == c && !ref.count(t) && !(t < sinks || t >= N - w)) mem.push_back(t);
            std::stable_sort(mem.begin(), mem.end(),
                             [&](std::int64_t x, std::int64_t y) { return qk[std::size_t(x)] > qk[std::size_t(y)]; });
            for (std::size_t i = 0; i < mem.size() && left > 0; ++i, --left) ref.insert(mem[i]);
            if (left == 0) break;
          }
          INFO("head " << h << " n " << n << " sinks " << sinks);
          CHECK(std::set<std::int64_t>(sel.head(h).begin(), sel.head(h).end()) == ref);
        }
    }
  }
}

TEST_CASE("ProtoKV: singleton clusters reduce to token-level selection by window q.k", "[protokv]") {
  const std::int64_t N = 300, d = 16, w = 8, H = 2;
  const std::vector<float> k = randn(std::size_t(H * N * d), 41);
  const std::vector<float> q = randn(std::size_t(H * w * d), 42);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  ProtoKV pk(q.data(), H, w, d);
  pk.sat_candidates = 0;
  pk.chunks = N;  // one token per chunk: every cluster is a singleton
  Scores tok(H, N);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      double s = 0;
      for (std::int64_t m = 0; m < w; ++m)
        for (std::int64_t j = 0; j < d; ++j)
          s += double(q[std::size_t((h * w + m) * d + j)]) * k[std::size_t((h * N + t) * d + j)];
      tok.data()[h * N + t] = float(s);
    }
  for (auto psi : {ProtoKV::Psi::sum, ProtoKV::Psi::mean}) {
    pk.psi = psi;
    const Scores s = pk.score(v);
    for (std::int64_t h = 0; h < H; ++h) {
      const auto a = pk.analyze(v, h);
      for (std::int64_t t = 0; t < N; ++t) CHECK(a.cluster[std::size_t(t)] == t);
    }
    for (std::int64_t n : {1, 7, 60, 150, 299}) {
      const auto x = kvscore::select(s, kvscore::Budget::per_head(n));
      const auto y = kvscore::select(tok, kvscore::Budget::per_head(n));
      CHECK(x.positions == y.positions);
    }
  }
}

TEST_CASE("ProtoKV: GQA sums the contiguous group's window queries", "[protokv]") {
  const std::int64_t N = 400, d = 32, w = 6, H = 2, G = 3;
  const std::vector<float> k = pk_topics(N * H, d, 50, 51);
  // integer-valued queries: every sum is exact, whatever its order
  std::vector<float> q(std::size_t(H * G * w * d));
  std::mt19937 g(52);
  for (float& x : q) x = float(int(g() % 9) - 4);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  const ProtoKV grouped(q.data(), H * G, w, d, G);
  // the same queries as one head per KV head with a window of G·w
  const ProtoKV flat(q.data(), H, G * w, d);
  // GQA in HF order: head h serves query heads h*G..h*G+G-1; another order differs
  std::vector<float> perm(q.size());
  for (std::int64_t hq = 0; hq < H * G; ++hq) {
    const std::int64_t src = (hq % G) * H + hq / G;  // strided groups
    std::copy_n(q.begin() + src * w * d, w * d, perm.begin() + hq * w * d);
  }
  const ProtoKV strided(perm.data(), H * G, w, d);
  const Scores a = grouped.score(v);
  CHECK(a.values() == flat.score(v).values());
  CHECK(a.values() != strided.score(v).values());
  CHECK_THROWS_WITH(ProtoKV(q.data(), H * G, w, d, 2).score(v),
                    Contains("group 2 does not match q_heads / kv_heads = 6 / 2 = 3"));
}

TEST_CASE("ProtoKV after_cache: the same scores (psi has no causal mask), nothing protected, any window",
          "[protokv][placement]") {
  const std::int64_t N = 300, d = 32, H = 2;
  const std::vector<float> k = pk_topics(N * H, d, 40, 61);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  std::mt19937 g(62);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (const std::int64_t w : {std::int64_t(8), N, N + 50}) {
    INFO("window " << w);
    std::vector<float> q(std::size_t(H * w * d));
    for (float& x : q) x = nd(g);
    for (const ProtoKV::Psi psi : {ProtoKV::Psi::attention, ProtoKV::Psi::sum}) {
      ProtoKV after(q.data(), H, w, d);
      after.psi = psi;
      after.placement = kvscore::QueryPlacement::after_cache;
      CHECK(after.protected_recent() == 0);
      ProtoKV in = after;
      in.placement = kvscore::QueryPlacement::in_cache;
      if (w <= N) {
        CHECK(in.protected_recent() == w);
        CHECK(after.score(v).values() == in.score(v).values());
      } else {
        CHECK_THROWS_WITH(in.score(v), Contains("window " + std::to_string(w) + " > tokens 300"));
        const Scores s = after.score(v);  // more queries than tokens: fine when they follow the cache
        CHECK(std::all_of(s.values().begin(), s.values().end(), [](float x) { return x >= 1.f; }));
      }
    }
  }
}

TEST_CASE("ProtoKV: attention psi is each cluster's mean softmax mass over the window queries", "[protokv]") {
  const std::int64_t N = 500, d = 24, w = 8, H = 2, G = 2;
  std::vector<float> k;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kh = pk_topics(N, d, 25, 71 + std::uint32_t(h), 0.8f);
    k.insert(k.end(), kh.begin(), kh.end());
  }
  k[std::size_t((1 * N + 7) * d + 2)] = kNaN;  // an invalid key (head 1) takes no part
  const std::vector<float> q = randn(std::size_t(H * G * w * d), 72, 1.5f);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  ProtoKV pk(q.data(), H * G, w, d);
  pk.chunks = 20;
  pk.psi = ProtoKV::Psi::attention;
  const Scores s = pk.score(v);
  for (std::int64_t h = 0; h < H; ++h) {
    const kvscore::ProtoKVHead a = pk.analyze(v, h);
    // brute force in double: softmax over the valid keys per window query, mean over the G·w rows
    std::vector<double> mass(std::size_t(N), 0.0);
    for (std::int64_t r = 0; r < G * w; ++r) {
      std::vector<double> l(std::size_t(N), -std::numeric_limits<double>::infinity());
      double mx = -std::numeric_limits<double>::infinity(), z = 0;
      for (std::int64_t t = 0; t < N; ++t) {
        if (!a.valid[std::size_t(t)]) continue;
        double x = 0;
        for (std::int64_t j = 0; j < d; ++j)
          x += double(q[std::size_t(((h * G * w) + r) * d + j)]) * double(k[std::size_t((h * N + t) * d + j)]);
        l[std::size_t(t)] = x / std::sqrt(double(d));
        mx = std::max(mx, l[std::size_t(t)]);
      }
      for (std::int64_t t = 0; t < N; ++t) z += std::exp(l[std::size_t(t)] - mx);
      for (std::int64_t t = 0; t < N; ++t) mass[std::size_t(t)] += std::exp(l[std::size_t(t)] - mx) / z / double(G * w);
    }
    const std::int64_t P = a.pdt_prototypes + a.sat_prototypes;
    std::vector<double> ps(std::size_t(P), 0.0);
    double total = 0;
    for (std::int64_t t = 0; t < N; ++t)
      if (a.cluster[std::size_t(t)] >= 0) ps[std::size_t(a.cluster[std::size_t(t)])] += mass[std::size_t(t)];
    for (std::int64_t c = 0; c < P; ++c) {
      CAPTURE(h, c);
      CHECK(std::fabs(a.psi[std::size_t(c)] - ps[std::size_t(c)]) <= 1e-5);
      total += a.psi[std::size_t(c)];
    }
    CHECK(std::fabs(total - 1.0) <= 1e-9);  // the clusters share all of the mass
    std::vector<std::int32_t> order;
    for (std::int64_t c = 0; c < P; ++c)
      if (a.cluster_size[std::size_t(c)] > 0) order.push_back(std::int32_t(c));
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t x, std::int32_t y) { return ps[std::size_t(x)] > ps[std::size_t(y)]; });
    CHECK(order == a.cluster_order);
    CHECK(s.head(h)[7] == (h == 1 ? -std::numeric_limits<float>::infinity() : s.head(h)[7]));
  }
}

TEST_CASE("ProtoKV: sum psi favours a big lukewarm cluster, mean psi a small hot one", "[protokv]") {
  // Two topics with one prototype each: topic A (300 tokens) along q a little, topic B
  // (20 tokens) along q strongly; everything else orthogonal to q.
  const std::int64_t d = 16, w = 4;
  std::vector<float> k;
  auto push = [&](std::int64_t n, std::int64_t axis, float along_q) {
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t j = 0; j < d; ++j) k.push_back(j == axis ? 1.f : j == 0 ? along_q : 0.f);
  };
  push(300, 1, 0.2f);  // A: q̄·k = 0.2·w each
  push(20, 2, 2.0f);   // B: q̄·k = 2·w each
  push(80, 3, 0.0f);
  const std::int64_t N = std::int64_t(k.size()) / d;
  std::vector<float> q(std::size_t(w * d), 0.f);
  for (std::int64_t m = 0; m < w; ++m) q[std::size_t(m * d)] = 1.f;
  const KeysView<float> v(k.data(), 1, N, d, N * d, d);
  ProtoKV pk(q.data(), 1, w, d);
  pk.sat_candidates = 0;
  pk.chunks = 4;  // chunks of 100 tokens: [0,100) [100,200) [200,300) A, [300,400) B + 80 others
  pk.psi = ProtoKV::Psi::sum;
  const auto s = pk.analyze(v, 0);
  pk.psi = ProtoKV::Psi::mean;
  const auto m = pk.analyze(v, 0);
  // all A chunks have the same prototype, so every A token joins the first (ties: lower index);
  // chunk 3 ([300, 400): the 20 B tokens and 80 others) is nearer to B and the others than A is
  for (std::int64_t t = 0; t < 300; ++t) REQUIRE(s.cluster[std::size_t(t)] == 0);
  for (std::int64_t t = 300; t < N; ++t) REQUIRE(s.cluster[std::size_t(t)] == 3);
  CHECK(s.cluster_order == std::vector<std::int32_t>{0, 3});  // sum: 300·0.2·4 = 240 > 20·2·4 = 160
  CHECK(m.cluster_order == std::vector<std::int32_t>{3, 0});  // mean: 160/100 = 1.6 > 240/300 = 0.8
  CHECK(std::fabs(s.psi[0] - 240.0) < 1e-3);
  CHECK(std::fabs(m.psi[3] - 1.6) < 1e-5);
}

TEST_CASE("ProtoKV: invalid keys score -inf and join no cluster - zero keys are finite", "[protokv]") {
  const std::int64_t N = 200, d = 16, w = 8;
  std::vector<float> k = pk_topics(N, d, 20, 61);
  const std::vector<float> q = randn(std::size_t(w * d), 62);
  k[std::size_t(10 * d + 3)] = kNaN;
  k[std::size_t(50 * d)] = kInf;
  k[std::size_t(90 * d + 1)] = 3e19f;  // squared norm overflows fp32
  for (std::int64_t j = 0; j < d; ++j) k[std::size_t(120 * d + j)] = 0.f;
  const KeysView<float> v(k.data(), 1, N, d, N * d, d);
  ProtoKV pk(q.data(), 1, w, d);
  pk.chunks = 10;
  const Scores s = pk.score(v);
  const auto a = pk.analyze(v, 0);
  std::vector<float> finite;
  for (std::int64_t t = 0; t < N; ++t) {
    const bool bad = t == 10 || t == 50 || t == 90;
    CHECK(std::isnan(s(0, t)) == false);
    if (bad) {
      CHECK(s(0, t) == -kInf);
      CHECK(a.cluster[std::size_t(t)] == -1);
      CHECK(std::find(a.candidates.begin(), a.candidates.end(), t) == a.candidates.end());
    } else {
      CHECK(std::isfinite(s(0, t)));
      finite.push_back(s(0, t));
    }
  }
  // ranks 1..M exactly once
  std::sort(finite.begin(), finite.end());
  for (std::size_t i = 0; i < finite.size(); ++i) CHECK(finite[i] == float(i + 1));
  // the zero key: never a candidate, q̄·k = 0, in some cluster
  CHECK(std::find(a.candidates.begin(), a.candidates.end(), 120) == a.candidates.end());
  CHECK(a.qk[120] == 0.f);
  CHECK(a.cluster[120] >= 0);
  for (float x : a.prototypes) CHECK(std::isfinite(x));
  // every key invalid: every score -inf
  std::vector<float> all(std::size_t(N * d), kNaN);
  const Scores none = pk.score(KeysView<float>(all.data(), 1, N, d, N * d, d));
  for (float x : none.values()) CHECK(x == -kInf);
}

TEST_CASE("ProtoKV composes with AdaKV: every head keeps a prefix of its cluster order", "[protokv]") {
  const std::int64_t N = 500, d = 16, w = 8, H = 4;
  std::vector<float> k;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kh = pk_topics(N, d, 25 + 10 * h, 71 + std::uint32_t(h));
    k.insert(k.end(), kh.begin(), kh.end());
  }
  const std::vector<float> q = randn(std::size_t(H * w * d), 72);
  const KeysView<float> v(k.data(), H, N, d, N * d, d);
  ProtoKV pk(q.data(), H, w, d);
  pk.chunks = 40;
  const Scores s = pk.score(v);
  for (bool norm : {false, true}) {
    kvscore::SelectOptions o;
    o.alloc = kvscore::Alloc::adakv;
    o.normalize = norm;
    o.sinks = 2;
    o.recent = w;
    const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(60), o);
    CHECK(sel.total() == 60 * H);
    for (std::int64_t h = 0; h < H; ++h) {
      // kept unprotected tokens = the top kept-count of that head's own order
      std::vector<std::pair<float, std::int64_t>> un;
      for (std::int64_t t = 2; t < N - w; ++t) un.push_back({s(h, t), t});
      std::sort(un.begin(), un.end(), [](auto x, auto y) { return x.first > y.first; });
      std::set<std::int64_t> kept;
      for (std::int64_t t : sel.head(h))
        if (t >= 2 && t < N - w) kept.insert(t);
      std::set<std::int64_t> prefix;
      for (std::size_t i = 0; i < kept.size(); ++i) prefix.insert(un[i].second);
      CHECK(kept == prefix);
    }
  }
}

TEST_CASE("ProtoKV: bad arguments throw std::invalid_argument naming the values", "[protokv]") {
  const std::int64_t N = 40, d = 8, w = 4;
  const std::vector<float> k = randn(std::size_t(2 * N * d), 81);
  const std::vector<float> q = randn(std::size_t(4 * w * d), 82);
  const KeysView<float> v(k.data(), 2, N, d, N * d, d);
  auto mk = [&] { return ProtoKV(q.data(), 2, w, d); };

  CHECK_THROWS_AS(ProtoKV(q.data(), 3, w, d).score(v), std::invalid_argument);
  CHECK_THROWS_WITH(ProtoKV(q.data(), 3, w, d).score(v), Contains("q_heads 3 is not a multiple of the keys' kv_heads 2"));
  CHECK_THROWS_WITH(ProtoKV(q.data(), 6, w, d, 4), Contains("group 4 must be >= 0 and divide q_heads 6"));
  CHECK_THROWS_WITH(ProtoKV(q.data(), 2, w, 4).score(v), Contains("queries have head_dim 4 but keys have head_dim 8"));
  CHECK_THROWS_WITH(ProtoKV(q.data(), 2, 0, d), Contains("window must be > 0 (got 0)"));
  CHECK_THROWS_WITH(ProtoKV(q.data(), 0, w, d), Contains("q_heads must be > 0 (got 0)"));
  CHECK_THROWS_WITH(ProtoKV(q.data(), 2, w, 0), Contains("head_dim must be in [1, 4096] (got 0)"));
  CHECK_THROWS_WITH(ProtoKV(nullptr, 2, w, d), Contains("queries is null"));
  const std::vector<float> q50 = randn(std::size_t(2 * 50 * d), 83);
  CHECK_THROWS_WITH(ProtoKV(q50.data(), 2, 50, d).score(v), Contains("window 50 > tokens 40"));
  std::vector<float> bad = q;
  bad[std::size_t((1 * w + 2) * d + 5)] = kNaN;
  CHECK_THROWS_WITH(ProtoKV(bad.data(), 2, w, d), Contains("[head 1, query 2, dim 5] is not finite"));

  ProtoKV pk = mk();
  pk.sat_candidates = 41;
  CHECK_THROWS_WITH(pk.score(v), Contains("sat_candidates 41 must be in [0, tokens 40]"));
  pk.sat_candidates = -1;
  CHECK_THROWS_WITH(pk.score(v), Contains("sat_candidates -1"));
  pk = mk();
  pk.kappa = 0;
  CHECK_THROWS_WITH(pk.score(v), Contains("kappa must be >= 1 (got 0)"));
  pk = mk();
  pk.lsh_bits = 17;
  CHECK_THROWS_WITH(pk.score(v), Contains("lsh_bits 17 must be in [0, 16]"));
  pk.lsh_bits = -1;
  CHECK_THROWS_WITH(pk.score(v), Contains("lsh_bits -1"));
  pk = mk();
  pk.chunks = -2;
  CHECK_THROWS_WITH(pk.score(v), Contains("chunks must be >= 0 (got -2)"));
  pk.chunks = 0;
  pk.sat_candidates = 0;
  CHECK_THROWS_WITH(pk.score(v), Contains("chunks 0 and sat_candidates 0 leave no prototypes"));
  pk = mk();
  pk.bandwidth = -0.5;
  CHECK_THROWS_WITH(pk.score(v), Contains("bandwidth -0.5"));
  pk.bandwidth = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_WITH(pk.score(v), Contains("must be finite and >= 0"));
  pk = mk();
  pk.psi = static_cast<ProtoKV::Psi>(7);
  CHECK_THROWS_WITH(pk.score(v), Contains("psi must be Psi::sum, Psi::mean or Psi::attention"));
  pk = mk();
  std::vector<float> out(std::size_t(2 * N));
  CHECK_THROWS_WITH(pk.score(v, ScoresView(out.data(), 2, N - 1)), Contains("does not match keys (2, 40)"));
  CHECK_THROWS_WITH(pk.score(KeysView<float>(k.data(), 0, N, d, N * d, d)), Contains("kv_heads 0"));
  CHECK_THROWS_WITH(pk.analyze(v, 2), Contains("head 2 out of range [0, 2)"));
  // an empty cache is shorter than any window
  CHECK_THROWS_WITH(pk.score(KeysView<float>(k.data(), 2, 0, d, N * d, d)), Contains("window 4 > tokens 0"));
  // scores are integer ranks in fp32: at most 2^24 tokens (checked before any work)
  const std::int64_t big = ProtoKV::kMaxTokens + 1;
  std::vector<float> huge(std::size_t(big), 1.f);
  const std::vector<float> q1(std::size_t(w), 1.f);
  CHECK_THROWS_WITH(ProtoKV(q1.data(), 1, w, 1).check(KeysView<float>(huge.data(), 1, big, 1, big, 1)),
                    Contains("tokens 16777217 > 16777216"));
}

TEST_CASE("ProtoKV: bit-identical for any num_threads, across runs, and per seed", "[protokv]") {
  const std::int64_t H = 6, N = 900, d = 64, w = 16;
  std::vector<float> kf;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto kh = pk_topics(N, d, 30, 91 + std::uint32_t(h), 0.6f);
    kf.insert(kf.end(), kh.begin(), kh.end());
  }
  kf[std::size_t((3 * N + 100) * d)] = kNaN;
  std::vector<half> kh(kf.size());
  kvscore::convert(kf.data(), kh.data(), kf.size());
  const std::vector<float> q = randn(std::size_t(H * w * d), 92, 0.3f);
  const KeysView<half> v(kh.data(), H, N, d, N * d, d);
  ProtoKV pk(q.data(), H, w, d);
  pk.chunks = 64;
  pk.seed = 2024;
  pk.num_threads = 1;
  const Scores ref = pk.score(v);
  CHECK(pk.score(v).values() == ref.values());
  for (int nt : {2, 3, 8, 0}) {
    CAPTURE(nt);
    pk.num_threads = nt;
    CHECK(std::memcmp(ref.data(), pk.score(v).data(), sizeof(float) * ref.values().size()) == 0);
  }
  // one head alone (Eigen's GEMM never goes multi-threaded, so N x P x d of any size agrees)
  const KeysView<half> one(kh.data(), 1, N, d, N * d, d);
  ProtoKV pk1(q.data(), 1, w, d);  // head 0's queries
  pk1.chunks = 64;
  pk1.seed = 2024;
  const Scores s1 = pk1.score(one);
  CHECK(std::equal(s1.values().begin(), s1.values().end(), ref.values().begin()));
  // another seed draws other RFF directions
  std::vector<double> w1, b1, w2, b2;
  kvscore::detail::proto::rff_params(2024, 0, 2, d, w1, b1);
  kvscore::detail::proto::rff_params(2025, 0, 2, d, w2, b2);
  CHECK(w1 != w2);
  kvscore::detail::proto::rff_params(2024, 1, 2, d, w2, b2);
  CHECK(w1 != w2);  // and another head
}
