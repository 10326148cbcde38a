// cuda/tests/test_cuda_pariskv.cpp — the GPU ParisKV index against the CPU index
// (kvscore/pariskv/pariskv.hpp) on the same keys and queries.
//
// [gpu]: the encoding (sign ids, 4-bit codes, weights, populations, μ) is bit-identical to the
// CPU's for fp32/fp16/bf16, three layouts, m = 2/4/8 and a padded head_dim, across appends that
// grow the buffers; Stage I collision scores are identical; search results (positions and
// scores) are identical to the CPU index searched with the portable kernels, for GQA and
// several queries per head, default and explicit β/ρ, k up to N; zero queries, invalid keys and
// queries, and option errors behave as on the CPU; two searches give the same bits.
// [host]: configuration errors rejected before any CUDA call.
#include "cuda_harness.hpp"

#include <kvscore/cuda/pariskv.hpp>
#include <kvscore/pariskv/pariskv.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace {

using kvscore::bfloat16;
using kvscore::half;
using Catch::Matchers::Contains;

/// Keys with a shared offset (what centring removes) and anisotropic channels.
template <class T>
std::vector<T> make_keys(std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> k(std::size_t(L.elems), kvscore::from_float<T>(0.f));
  std::vector<float> off(static_cast<std::size_t>(d)), scale(static_cast<std::size_t>(d));
  for (std::int64_t j = 0; j < d; ++j) {
    off[std::size_t(j)] = 2.f * nd(rng);
    scale[std::size_t(j)] = 0.3f + std::fabs(nd(rng));
  }
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < d; ++j)
        k[std::size_t(h * L.hs + t * L.ts + j)] =
            kvscore::from_float<T>(off[std::size_t(j)] + scale[std::size_t(j)] * nd(rng));
  return k;
}

std::vector<float> make_queries(std::int64_t rows, std::int64_t d, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> q(std::size_t(rows * d));
  for (auto& x : q) x = nd(rng);
  return q;
}

/// CPU indexes, one per head, fed the same batches [t0, t1) as the GPU index.
template <class T>
std::vector<kvscore::ParisKV> cpu_indexes(const std::vector<T>& keys, const Layout& L, std::int64_t H, std::int64_t d,
                                          const std::vector<std::int64_t>& cuts, const kvscore::ParisKVConfig& cfg) {
  std::vector<kvscore::ParisKV> idx;
  for (std::int64_t h = 0; h < H; ++h) {
    idx.emplace_back(d, cfg);
    for (std::size_t c = 0; c + 1 < cuts.size(); ++c)
      idx.back().append(keys.data() + h * L.hs + cuts[c] * L.ts, cuts[c + 1] - cuts[c], L.ts);
  }
  return idx;
}

template <class T>
void gpu_append(kc::ParisKV& g, const kc::DeviceBuffer& dk, const Layout& L, std::int64_t H, std::int64_t d,
                std::int64_t t0, std::int64_t t1) {
  g.append(kc::DeviceKeysView<T>(dk.as<T>() + t0 * L.ts, H, t1 - t0, d, L.hs, L.ts));
}

template <class T>
void compare_encoding(std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t m, const Layout& L, bool center) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " H " << H << " N " << N << " d " << d << " m " << m
                << " layout " << L.name << " center " << center);
  kvscore::ParisKVConfig cfg;
  cfg.m = m;
  cfg.center = center;
  const std::vector<T> keys = make_keys<T>(H, N, d, L, unsigned(N + 13 * d + m));
  const std::vector<std::int64_t> cuts = {0, N / 3, N / 3 + 1, N};  // the second batch is a single decoded key
  std::vector<kvscore::ParisKV> cpu = cpu_indexes(keys, L, H, d, cuts, cfg);
  const kc::DeviceBuffer dk = upload(keys);
  kc::ParisKV g(H, d, cfg);
  for (std::size_t c = 0; c + 1 < cuts.size(); ++c) gpu_append<T>(g, dk, L, H, d, cuts[c], cuts[c + 1]);
  REQUIRE(g.size() == N);
  REQUIRE(g.capacity() >= N);
  for (std::int64_t h = 0; h < H; ++h) {
    const kvscore::ParisKV& c = cpu[std::size_t(h)];
    const kc::ParisKV::Encoding e = g.encoding(h);
    const std::int64_t B = c.subspaces(), P = c.padded_dim();
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t b = 0; b < B; ++b) {
        INFO("head " << h << " key " << i << " subspace " << b);
        REQUIRE(e.ids[std::size_t(i * B + b)] == c.centroid_id(i, b));
        const float cw = c.weight(i, b), gw = e.w[std::size_t(i * B + b)];
        REQUIRE(std::memcmp(&cw, &gw, sizeof(float)) == 0);
      }
      for (std::int64_t j = 0; j < P; ++j) {
        INFO("head " << h << " key " << i << " coordinate " << j);
        REQUIRE(e.codes[std::size_t(i * P + j)] == c.code(i, j));
      }
    }
    for (std::int64_t b = 0; b < B; ++b)
      for (std::uint32_t id = 0; id < (1u << m); ++id)
        REQUIRE(e.pop[std::size_t(b * (1 << m) + id)] == c.population(b, id));
    REQUIRE(e.mu == c.center());
  }
}

template <class T>
void compare_search(std::int64_t H, std::int64_t G, std::int64_t nq, std::int64_t N, std::int64_t d, const Layout& L,
                    kvscore::ParisKVSearch opt) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " H " << H << " G " << G << " queries " << nq << " N "
                << N << " d " << d << " layout " << L.name << " k " << opt.k << " beta " << opt.beta << " rho "
                << opt.rho);
  const std::vector<T> keys = make_keys<T>(H, N, d, L, unsigned(7 * N + d));
  const std::vector<std::int64_t> cuts = {0, N - 17, N};
  const std::vector<kvscore::ParisKV> cpu = cpu_indexes(keys, L, H, d, cuts, {});
  const kc::DeviceBuffer dk = upload(keys);
  kc::ParisKV g(H, d);
  for (std::size_t c = 0; c + 1 < cuts.size(); ++c) gpu_append<T>(g, dk, L, H, d, cuts[c], cuts[c + 1]);
  const std::int64_t QH = H * G, R = QH * nq, k = opt.k;
  std::vector<float> q = make_queries(R, d, unsigned(N + 1));
  for (std::int64_t j = 0; j < d; ++j) q[std::size_t(1 * d + j)] = 0.f;  // row 1: a zero query
  if (R > 2)  // row 2: one-hot, so sign patterns tie exactly in every subspace
    for (std::int64_t j = 0; j < d; ++j) q[std::size_t(2 * d + j)] = j == 1 ? 3.f : 0.f;
  const kc::DeviceBuffer dq = upload(q);
  kc::DeviceBuffer ws(g.search_workspace_bytes(QH, nq, opt));
  kc::DeviceBuffer pos(std::size_t(std::max<std::int64_t>(1, R * k)) * sizeof(std::int64_t));
  kc::DeviceBuffer sc(std::size_t(std::max<std::int64_t>(1, R * k)) * sizeof(float));
  g.search(dq.as<float>(), QH, nq, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()});
  const std::vector<std::int64_t> gp = download<std::int64_t>(pos, std::size_t(R * k));
  const std::vector<float> gs = download<float>(sc, std::size_t(R * k));
  kvscore::ParisKVSearch copt = opt;
  copt.kernels = kvscore::pariskv::Kernels::portable;
  kvscore::ParisKV::Workspace cws;
  kvscore::ParisKVResult res;
  for (std::int64_t r = 0; r < R; ++r) {
    const std::int64_t kvh = (r / nq) / G;
    cpu[std::size_t(kvh)].search(q.data() + r * d, copt, cws, res);
    INFO("query row " << r << " (KV head " << kvh << ")");
    REQUIRE(std::int64_t(res.positions.size()) == k);
    for (std::int64_t i = 0; i < k; ++i) {
      INFO("rank " << i << " cpu position " << res.positions[std::size_t(i)] << " gpu " << gp[std::size_t(r * k + i)]
                   << " cpu score " << res.scores[std::size_t(i)] << " gpu " << gs[std::size_t(r * k + i)]);
      REQUIRE(gp[std::size_t(r * k + i)] == res.positions[std::size_t(i)]);
      REQUIRE(std::memcmp(&gs[std::size_t(r * k + i)], &res.scores[std::size_t(i)], sizeof(float)) == 0);
    }
    if (r == 1)  // the zero query: the first k positions, score 0 (the CPU's documented rule)
      for (std::int64_t i = 0; i < k; ++i) REQUIRE(gp[std::size_t(r * k + i)] == i);
  }
  // the same bits again
  g.search(dq.as<float>(), QH, nq, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()});
  REQUIRE(download<std::int64_t>(pos, std::size_t(R * k)) == gp);
  const std::vector<float> again = download<float>(sc, std::size_t(R * k));
  REQUIRE(std::memcmp(again.data(), gs.data(), gs.size() * sizeof(float)) == 0);
}

}  // namespace

TEST_CASE("cuda pariskv: configurations the GPU path does not take are rejected before any CUDA call", "[cuda][host]") {
  kvscore::ParisKVConfig cfg;
  cfg.m = 16;
  REQUIRE_THROWS_WITH(kc::ParisKV(2, 128, cfg), Contains("m 16 is not supported on the GPU path"));
  REQUIRE_THROWS_WITH(kc::ParisKV(2, 1024), Contains("padded head_dim 1024"));
  REQUIRE_THROWS_WITH(kc::ParisKV(0, 128), Contains("kv_heads must be in [1, 65535] (got 0)"));
  REQUIRE_THROWS_WITH(kc::ParisKV(70000, 128), Contains("kv_heads must be in [1, 65535] (got 70000)"));
  cfg.m = 3;  // the CPU index's own check runs first
  REQUIRE_THROWS_WITH(kc::ParisKV(2, 128, cfg), Contains("m must be a power of two"));
  REQUIRE_THROWS_WITH(kc::ParisKV(2, 0), Contains("head_dim must be in [1, "));
}

TEST_CASE("cuda pariskv: the encoding is bit-identical to the CPU index", "[cuda][gpu][pariskv]") {
  compare_encoding<float>(3, 700, 128, 8, hf(3, 700, 128), true);
  compare_encoding<half>(2, 517, 128, 8, token_major(2, 517, 128), true);
  compare_encoding<bfloat16>(2, 300, 96, 8, padded(2, 300, 96, 5), true);  // P = 128: zero padding
  compare_encoding<float>(2, 200, 64, 4, hf(2, 200, 64), false);
  compare_encoding<half>(1, 130, 16, 2, hf(1, 130, 16), true);  // P < 32: one half-used code group
}

TEST_CASE("cuda pariskv: Stage I collision scores equal the CPU's", "[cuda][gpu][pariskv]") {
  const std::int64_t H = 2, N = 3000, d = 128;
  const Layout L = hf(H, N, d);
  const std::vector<half> keys = make_keys<half>(H, N, d, L, 5);
  const std::vector<kvscore::ParisKV> cpu = cpu_indexes(keys, L, H, d, {0, N}, {});
  const kc::DeviceBuffer dk = upload(keys);
  kc::ParisKV g(H, d);
  gpu_append<half>(g, dk, L, H, d, 0, N);
  const std::vector<float> q = make_queries(2 * H, d, 9);  // GQA group 2
  const kc::DeviceBuffer dq = upload(q);
  for (double rho : {0.05, 0.2, 1.0}) {
    const std::vector<std::int32_t> s = g.collision_scores(dq.as<float>(), 2 * H, 1, rho);
    for (std::int64_t r = 0; r < 2 * H; ++r) {
      const std::vector<std::int32_t> c =
          cpu[std::size_t(r / 2)].collision_scores(q.data() + r * d, rho, kvscore::pariskv::Kernels::portable);
      INFO("rho " << rho << " row " << r);
      REQUIRE(std::vector<std::int32_t>(s.begin() + r * N, s.begin() + (r + 1) * N) == c);
    }
  }
}

TEST_CASE("cuda pariskv: search equals the CPU index (positions and scores)", "[cuda][gpu][pariskv]") {
  kvscore::ParisKVSearch opt;
  opt.k = 100;
  compare_search<half>(2, 1, 3, 6000, 128, hf(2, 6000, 128), opt);  // default (β, ρ) = (0.25, 0.30)
  compare_search<float>(2, 4, 1, 40000, 128, token_major(2, 40000, 128), opt);  // GQA, (0.10, 0.20)
  opt.beta = 0.05;
  opt.rho = 0.1;
  compare_search<bfloat16>(1, 2, 2, 20000, 96, padded(1, 20000, 96, 5), opt);
  opt = {};
  opt.k = 250;  // k = N: every key
  compare_search<half>(1, 1, 2, 250, 64, hf(1, 250, 64), opt);
  opt.k = 1;
  compare_search<float>(3, 1, 2, 70, 128, hf(3, 70, 128), opt);  // N < 64
}

TEST_CASE("cuda pariskv: invalid keys and queries throw naming the value, the index unchanged", "[cuda][gpu][pariskv]") {
  const std::int64_t H = 2, N = 500, d = 64;
  const Layout L = hf(H, N, d);
  std::vector<float> keys = make_keys<float>(H, N, d, L, 3);
  const kc::DeviceBuffer good = upload(keys);
  kc::ParisKV g(H, d);
  gpu_append<float>(g, good, L, H, d, 0, 300);
  const kc::ParisKV::Encoding before = g.encoding(1);
  keys[std::size_t(1 * L.hs + 310 * L.ts + 7)] = std::numeric_limits<float>::quiet_NaN();
  const kc::DeviceBuffer bad = upload(keys);
  REQUIRE_THROWS_WITH(gpu_append<float>(g, bad, L, H, d, 300, N),
                      Contains("key 310 of head 1 has a non-finite value nan at element 7"));
  keys[std::size_t(1 * L.hs + 310 * L.ts + 7)] = 1.f;
  for (std::int64_t j = 0; j < d; ++j) keys[std::size_t(0 * L.hs + 400 * L.ts + j)] = 1e19f;
  const kc::DeviceBuffer big = upload(keys);
  REQUIRE_THROWS_WITH(gpu_append<float>(g, big, L, H, d, 300, N), Contains("key 400 of head 0 has a squared norm"));
  REQUIRE(g.size() == 300);
  REQUIRE(g.capacity() == 320);  // validated before the buffers grow
  const kc::ParisKV::Encoding after = g.encoding(1);
  REQUIRE(after.ids == before.ids);
  REQUIRE(after.pop == before.pop);

  std::vector<float> q = make_queries(2 * H, d, 4);
  q[std::size_t(3 * d + 5)] = std::numeric_limits<float>::infinity();
  const kc::DeviceBuffer dq = upload(q);
  kvscore::ParisKVSearch opt;
  opt.k = 10;
  kc::DeviceBuffer ws(g.search_workspace_bytes(H, 2, opt));
  kc::DeviceBuffer pos(40 * sizeof(std::int64_t)), sc(40 * sizeof(float));
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 2, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("query 1 of query head 1 has a non-finite value inf at element 5"));
  opt.k = 301;
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("k 301 out of range [0, 300]"));
  opt.k = 10;
  opt.rerank_exact = 20;
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("rerank_exact 20 is not supported on the GPU path"));
  opt.rerank_exact = 0;
  opt.beta = 1.5;
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("beta must be in (0, 1]"));
  opt.beta = 0;
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), 3, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("query heads 3 must be a positive multiple of the 2 KV heads"));
  kc::DeviceBuffer small(16);
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {small.get(), small.bytes()}),
                      Contains("smaller than the"));
  std::vector<std::int64_t> host_pos(40);
  REQUIRE_THROWS_WITH(g.search(dq.as<float>(), H, 1, opt, host_pos.data(), sc.as<float>(), {ws.get(), ws.bytes()}),
                      Contains("positions is not device memory"));
  std::vector<half> hk(std::size_t(H * 10 * 32));
  const kc::DeviceBuffer dhk = upload(hk);
  REQUIRE_THROWS_WITH(g.append(kc::DeviceKeysView<half>(dhk.as<half>(), H, 10, 32, 320, 32)),
                      Contains("keys have 2 heads of head_dim 32, the index 2 of 64"));
}

TEST_CASE("cuda pariskv: set_center fixes mu before the first append", "[cuda][gpu][pariskv]") {
  const std::int64_t H = 2, N = 400, d = 32;
  const Layout L = hf(H, N, d);
  const std::vector<float> keys = make_keys<float>(H, N, d, L, 8);
  std::vector<float> mu(std::size_t(H * d));
  for (std::size_t i = 0; i < mu.size(); ++i) mu[i] = 0.25f * float(i % 7);
  kc::ParisKV g(H, d);
  g.set_center(mu.data());
  const kc::DeviceBuffer dk = upload(keys);
  gpu_append<float>(g, dk, L, H, d, 0, N);
  for (std::int64_t h = 0; h < H; ++h) {
    kvscore::ParisKV c(d);
    c.set_center(mu.data() + h * d);
    c.append(keys.data() + h * L.hs, N, L.ts);
    const kc::ParisKV::Encoding e = g.encoding(h);
    REQUIRE(e.mu == c.center());
    for (std::int64_t i = 0; i < N; ++i)
      for (std::int64_t b = 0; b < c.subspaces(); ++b) REQUIRE(e.ids[std::size_t(i * c.subspaces() + b)] == c.centroid_id(i, b));
  }
  REQUIRE_THROWS_WITH(g.set_center(mu.data()), Contains("already holds 400 keys"));
  mu[3] = std::numeric_limits<float>::quiet_NaN();
  kc::ParisKV g2(H, d);
  REQUIRE_THROWS_WITH(g2.set_center(mu.data()), Contains("mu value nan of head 0 at element 3 is not finite"));
}

// The tier table of the GPU path (tier_table in cuda/src/pariskv.cu) ranks the patterns of a
// subspace by sorting (cost, id) with the best pattern first, where the CPU enumerates flip sets
// best-first with a heap. This replays the GPU rule on the host, on the CPU index's own ids,
// populations and rotation, and requires the CPU's collision scores: the two orders agree
// (runs without a device, so the algorithm is checked even where the kernel cannot run),
// exact ties included (one-hot queries).
TEST_CASE("cuda pariskv: the sorted tier-table rule reproduces the CPU's collision scores", "[cuda][host][pariskv]") {
  for (std::int64_t m : {2, 4, 8}) {
    const std::int64_t N = 2000, d = 64;
    kvscore::ParisKVConfig cfg;
    cfg.m = m;
    kvscore::ParisKV idx(d, cfg);
    const Layout L = hf(1, N, d);
    const std::vector<float> keys = make_keys<float>(1, N, d, L, unsigned(m));
    idx.append(keys.data(), N, d);
    const std::int64_t P = idx.padded_dim(), B = idx.subspaces(), nc = std::int64_t(1) << m;
    std::vector<float> qs = make_queries(8, d, unsigned(40 + m));
    for (std::int64_t j = 0; j < d; ++j) {  // rows 6, 7: one-hot queries, every |q̃_j| equal (exact ties)
      qs[std::size_t(6 * d + j)] = j == 3 ? 1.5f : 0.f;
      qs[std::size_t(7 * d + j)] = j == d - 1 ? -2.f : 0.f;
    }
    for (std::int64_t qi = 0; qi < 8; ++qi)
      for (double rho : {0.02, 0.2, 0.7}) {
        const float* q = qs.data() + qi * d;
        // prepare: ‖q‖ in fp64, unit query rounded to fp32, rotated in fp32
        double sq = 0;
        for (std::int64_t j = 0; j < d; ++j) sq += double(q[j]) * double(q[j]);
        const double qn = std::sqrt(sq);
        std::vector<float> x(static_cast<std::size_t>(d)), y(static_cast<std::size_t>(P));
        for (std::int64_t j = 0; j < d; ++j) x[std::size_t(j)] = float(double(q[j]) / qn);
        idx.rotation().apply(x.data(), y.data());
        const std::int64_t collided = kvscore::pariskv::ratio_count(rho, N);
        std::int64_t limit[6];
        const int pct[6] = {5, 15, 30, 50, 75, 100};
        for (int t = 0; t < 6; ++t) limit[t] = (collided * pct[t] + 99) / 100;
        std::vector<int> table(std::size_t(B * nc), 0);
        for (std::int64_t b = 0; b < B; ++b) {
          float cost[16];
          int ord[16];
          unsigned best = 0;
          for (std::int64_t j = 0; j < m; ++j) {
            cost[j] = 2.f * std::fabs(y[std::size_t(b * m + j)]);
            if (y[std::size_t(b * m + j)] >= 0.f) best |= 1u << j;
          }
          for (std::int64_t j = 0; j < m; ++j) {
            int rk = 0;
            for (std::int64_t i = 0; i < m; ++i) rk += cost[i] < cost[j] || (cost[i] == cost[j] && i < j);
            ord[rk] = int(j);
          }
          std::vector<unsigned long long> key(static_cast<std::size_t>(nc));
          for (std::int64_t id = 0; id < nc; ++id) {
            const unsigned flip = unsigned(id) ^ best;
            float s = 0.f;
            for (std::int64_t r = 0; r < m; ++r)
              if (flip & (1u << ord[r])) s = s + cost[ord[r]];
            std::uint32_t bits;
            std::memcpy(&bits, &s, 4);
            key[std::size_t(id)] = unsigned(id) == best ? 0ull : (std::uint64_t(bits) << 32) | std::uint64_t(id + 1);
          }
          std::sort(key.begin(), key.end());
          std::int64_t before = 0;
          for (const unsigned long long k : key) {
            const unsigned id = k == 0 ? best : unsigned(k & 0xFFFFFFFFull) - 1u;
            int w = 0;
            for (int t = 0; t < 6; ++t) w += before < limit[t];
            table[std::size_t(b * nc + id)] = w;
            before += idx.population(b, id);
          }
        }
        const std::vector<std::int32_t> cpu = idx.collision_scores(q, rho, kvscore::pariskv::Kernels::portable);
        for (std::int64_t i = 0; i < N; ++i) {
          std::int32_t s = 0;
          for (std::int64_t b = 0; b < B; ++b) s += table[std::size_t(b * nc + idx.centroid_id(i, b))];
          INFO("m " << m << " query " << qi << " rho " << rho << " key " << i);
          REQUIRE(s == cpu[std::size_t(i)]);
        }
      }
  }
}
