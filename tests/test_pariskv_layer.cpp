// ParisKV's layer-level decode cache (include/kvscore/pariskv/layer.hpp), the exact top-k
// retrieval mode of ParisKVCache and crop / ParisKV::truncate: against per-head caches, brute
// force and freshly built caches.
#include <catch2/catch.hpp>

#include <kvscore/pariskv/layer.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

using kvscore::LayerStrides;
using kvscore::ParisKVCache;
using kvscore::ParisKVCacheConfig;
using kvscore::ParisKVLayerCache;
using kvscore::ParisKVRetrieval;

using test_support::hf_strides;
using test_support::uniform_noise;

namespace {

/// Exact top-k of q·k over rows [b, e) of a contiguous [tokens][d] head, fp64 (ties: lower
/// position), ascending; also the smallest gap between the k-th and the (k+1)-th score.
std::vector<std::int64_t> brute_top(const float* K, std::int64_t d, std::int64_t b, std::int64_t e, const float* q,
                                    std::int64_t k, double* gap = nullptr) {
  std::vector<std::pair<double, std::int64_t>> s;
  for (std::int64_t t = b; t < e; ++t) {
    double v = 0;
    for (std::int64_t j = 0; j < d; ++j) v += double(K[t * d + j]) * q[j];
    s.push_back({-v, t});
  }
  k = std::min<std::int64_t>(k, std::int64_t(s.size()));
  std::sort(s.begin(), s.end());
  if (gap != nullptr)
    *gap = k < std::int64_t(s.size()) && k > 0 ? s[std::size_t(k)].first - s[std::size_t(k - 1)].first : 1.0;
  std::vector<std::int64_t> top;
  for (std::int64_t i = 0; i < k; ++i) top.push_back(s[std::size_t(i)].second);
  std::sort(top.begin(), top.end());
  return top;
}

ParisKVCacheConfig zones(std::int64_t S, std::int64_t L, std::int64_t k, ParisKVRetrieval how) {
  ParisKVCacheConfig c;
  c.sinks = S;
  c.local = L;
  c.update_interval = 1;  // every token beyond the local window is indexed at once
  c.dense_fallback = false;
  c.search.k = k;
  c.retrieval = how;
  return c;
}

}  // namespace

TEST_CASE("pariskv layer: equals one ParisKVCache per (row, KV head), GQA query heads on their own",
          "[pariskv][layer]") {
  const std::int64_t B = 2, H = 2, G = 3, Q = H * G, d = 24, n0 = 300, steps = 5;
  for (ParisKVRetrieval how : {ParisKVRetrieval::index, ParisKVRetrieval::exact}) {
    CAPTURE(int(how));
    const ParisKVCacheConfig cfg = zones(3, 16, 20, how);
    ParisKVLayerCache<float> layer(B, H, d, cfg);
    std::vector<ParisKVCache<float>> ref;
    for (std::int64_t i = 0; i < B * H; ++i) ref.emplace_back(d, cfg);
    const std::int64_t N = n0 + steps;
    const std::vector<float> K = uniform_noise(B * H * N * d, 1), V = uniform_noise(B * H * N * d, 2);
    const std::vector<float> Qs = uniform_noise(B * Q * steps * d, 3, -2, 2);
    // prefill: the first n0 tokens of a [B][H][N][d] tensor (strides of the whole tensor)
    layer.append(K.data(), V.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h) ref[std::size_t(b * H + h)].append(&K[((b * H + h) * N) * d], &V[((b * H + h) * N) * d], n0);
    REQUIRE(layer.size() == n0);
    // a multi-token forward (steps tokens at once) against one token at a time per head
    std::vector<float> out(std::size_t(B * Q * steps * d), -1.f);
    const float* k1 = &K[n0 * d];
    const float* v1 = &V[n0 * d];
    layer.forward(k1, v1, Qs.data(), Q, steps, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, steps, d), out.data(), hf_strides(Q, steps, d));
    REQUIRE(layer.size() == N);
    typename ParisKVCache<float>::Workspace ws;
    std::vector<float> o(static_cast<std::size_t>(d));
    for (std::int64_t i = 0; i < steps; ++i) {
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h) {
          const std::int64_t t = n0 + i;
          ref[std::size_t(b * H + h)].append(&K[((b * H + h) * N + t) * d], &V[((b * H + h) * N + t) * d]);
        }
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t j = 0; j < Q; ++j) {
          const float* q = &Qs[((b * Q + j) * steps + i) * d];
          ref[std::size_t(b * H + j / G)].attend(q, o.data(), ws);
          for (std::int64_t x = 0; x < d; ++x) REQUIRE(out[std::size_t(((b * Q + j) * steps + i) * d + x)] == o[std::size_t(x)]);
          if (i == steps - 1) REQUIRE(layer.positions(b, j) == ws.positions);
        }
    }
    // the query heads of one group retrieve for themselves: not all the same set
    bool differ = false;
    for (std::int64_t j = 1; j < G; ++j) differ |= layer.positions(0, j) != layer.positions(0, 0);
    CHECK(differ);
  }
}

TEST_CASE("pariskv layer: the same outputs for 1 and 2 threads, and for token-major strides", "[pariskv][layer]") {
  const std::int64_t H = 3, G = 3, Q = H * G, d = 16, n0 = 200, steps = 3, N = n0 + steps;
  const ParisKVCacheConfig cfg = zones(4, 8, 12, ParisKVRetrieval::index);
  // token-major [N][H][d] keys and values: strides (0, d, H*d)
  const std::vector<float> K = uniform_noise(N * H * d, 11), V = uniform_noise(N * H * d, 12), Qs = uniform_noise(Q * steps * d, 13);
  const LayerStrides tm{0, d, H * d};
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2}) {
    ParisKVLayerCache<float> layer(1, H, d, cfg);
    layer.num_threads = threads;
    layer.append(K.data(), V.data(), n0, tm, tm);
    std::vector<float> out(std::size_t(Q * steps * d));
    layer.forward(&K[n0 * H * d], &V[n0 * H * d], Qs.data(), Q, steps, tm, tm, hf_strides(Q, steps, d), out.data(), hf_strides(Q, steps, d));
    outs.push_back(out);
  }
  REQUIRE(outs[0] == outs[1]);
  // the same keys in HF layout give the same outputs
  std::vector<float> Kh(K.size()), Vh(V.size());
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t x = 0; x < d; ++x) {
        Kh[std::size_t((h * N + t) * d + x)] = K[std::size_t((t * H + h) * d + x)];
        Vh[std::size_t((h * N + t) * d + x)] = V[std::size_t((t * H + h) * d + x)];
      }
  ParisKVLayerCache<float> layer(1, H, d, cfg);
  layer.append(Kh.data(), Vh.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d));
  std::vector<float> out(std::size_t(Q * steps * d));
  layer.forward(&Kh[n0 * d], &Vh[n0 * d], Qs.data(), Q, steps, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, steps, d), out.data(),
                hf_strides(Q, steps, d));
  REQUIRE(out == outs[0]);
}

TEST_CASE("pariskv cache: exact retrieval is the brute-force top k of the zone at every step", "[pariskv][layer]") {
  const std::int64_t d = 20, S = 3, L = 10, k = 7, n0 = 60, steps = 120;
  ParisKVCache<float> c(d, zones(S, L, k, ParisKVRetrieval::exact));
  const std::vector<float> K = uniform_noise((n0 + steps) * d, 21), V = uniform_noise((n0 + steps) * d, 22);
  const std::vector<float> Qs = uniform_noise(steps * d, 23, -3, 3);
  c.append(K.data(), V.data(), n0);
  CHECK(c.memory_bytes() == 2 * std::size_t(n0 * d) * sizeof(float));  // no index
  typename ParisKVCache<float>::Workspace ws;
  for (std::int64_t i = 0; i < steps; ++i) {
    const std::int64_t N = n0 + i + 1;
    c.append(&K[(N - 1) * d], &V[(N - 1) * d]);
    REQUIRE(c.local_begin() == N - L);  // U = 1: every token beyond the window is in the zone
    const float* q = &Qs[i * d];
    c.select(q, ws);
    double gap = 0;
    std::vector<std::int64_t> want;
    for (std::int64_t t = 0; t < S; ++t) want.push_back(t);
    for (std::int64_t t : brute_top(K.data(), d, S, N - L, q, k, &gap)) want.push_back(t);
    for (std::int64_t t = N - L; t < N; ++t) want.push_back(t);
    if (gap < 1e-4) continue;  // an fp32 near-tie at the boundary may go either way
    REQUIRE(ws.positions == want);
  }
  // ties go to the lower position: equal keys, a query that scores them all alike
  ParisKVCache<float> t(4, zones(0, 0, 3, ParisKVRetrieval::exact));
  const std::vector<float> same(40, 0.5f);
  t.append(same.data(), same.data(), 10);
  const float q[4] = {1, 1, 1, 1};
  REQUIRE(t.select(q) == std::vector<std::int64_t>{0, 1, 2});
}

TEST_CASE("pariskv: truncate leaves the index a fresh build of its first n keys would give", "[pariskv][layer]") {
  const std::int64_t d = 32, N = 200;
  const std::vector<float> K = uniform_noise(N * d, 31);
  kvscore::ParisKV a(d);
  a.append(K.data(), N, d);
  for (std::int64_t n : {150, 128, 64, 63, 1}) {
    CAPTURE(n);
    kvscore::ParisKV full(d);
    full.append(K.data(), N, d);
    full.truncate(n);
    kvscore::ParisKV fresh(d);
    fresh.set_center(full.center().data());  // the truncated index keeps the first append's centre
    fresh.append(K.data(), n, d);
    REQUIRE(full.size() == n);
    REQUIRE(full.memory_bytes() == fresh.memory_bytes());
    for (std::int64_t i = 0; i < n; ++i)
      for (std::int64_t b = 0; b < full.subspaces(); ++b) {
        REQUIRE(full.centroid_id(i, b) == fresh.centroid_id(i, b));
        REQUIRE(full.weight(i, b) == fresh.weight(i, b));
      }
    for (std::int64_t b = 0; b < full.subspaces(); ++b)
      for (std::uint32_t id = 0; id < (1u << full.m()); ++id) REQUIRE(full.population(b, id) == fresh.population(b, id));
    // and it grows again like the fresh one
    full.append(&K[n * d], N - n, d);
    fresh.append(&K[n * d], N - n, d);
    kvscore::ParisKV::Workspace w1, w2;
    kvscore::ParisKVResult r1, r2;
    kvscore::ParisKVSearch opt;
    opt.k = 10;
    full.search(&K[5 * d], opt, w1, r1);
    fresh.search(&K[5 * d], opt, w2, r2);
    REQUIRE(r1.positions == r2.positions);
    REQUIRE(r1.scores == r2.scores);
  }
  REQUIRE_THROWS_WITH(a.truncate(201), Catch::Contains("n 201 out of range [0, 200]"));
}

TEST_CASE("pariskv cache: crop(n) selects as a cache that only ever held n tokens", "[pariskv][layer]") {
  const std::int64_t d = 16, S = 2, L = 12, k = 9, n = 150, extra = 30;
  const std::vector<float> K = uniform_noise((n + extra) * d, 41), V = uniform_noise((n + extra) * d, 42), Qs = uniform_noise(8 * d, 43);
  for (ParisKVRetrieval how : {ParisKVRetrieval::index, ParisKVRetrieval::exact}) {
    CAPTURE(int(how));
    ParisKVCacheConfig cfg = zones(S, L, k, how);
    ParisKVCache<float> grown(d, cfg), only(d, cfg);
    grown.append(K.data(), V.data(), n);
    for (std::int64_t i = 0; i < extra; ++i) grown.append(&K[(n + i) * d], &V[(n + i) * d]);  // a question + answer
    grown.crop(n);
    only.append(K.data(), V.data(), n);
    REQUIRE(grown.size() == n);
    REQUIRE(grown.local_begin() == only.local_begin());
    REQUIRE(grown.indexed() == only.indexed());
    for (std::int64_t i = 0; i < 8; ++i) REQUIRE(grown.select(&Qs[i * d]) == only.select(&Qs[i * d]));
    REQUIRE_THROWS_WITH(grown.crop(n + 1), Catch::Contains("out of range [0, 150]"));
    grown.crop(0);
    REQUIRE(grown.size() == 0);
    REQUIRE(grown.indexed() == 0);
  }
}

TEST_CASE("pariskv layer: errors name the value and leave every head unchanged", "[pariskv][layer]") {
  const std::int64_t H = 2, d = 8, N = 40;
  ParisKVLayerCache<float> layer(1, H, d, zones(2, 4, 3, ParisKVRetrieval::index));
  std::vector<float> K = uniform_noise(H * N * d, 51), V = uniform_noise(H * N * d, 52);
  layer.append(K.data(), V.data(), 30, hf_strides(H, N, d), hf_strides(H, N, d));
  K[std::size_t((1 * N + 31) * d + 5)] = test_support::kNaN;  // head 1, token 31
  std::vector<float> q(std::size_t(4 * 2 * d), 0.5f), out(q.size());
  const std::string e = test_support::error_of([&] {
    layer.forward(&K[30 * d], &V[30 * d], q.data(), 4, 2, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(4, 2, d), out.data(), hf_strides(4, 2, d));
  });
  CHECK_THAT(e, Catch::Contains("key [row 0, KV head 1, token 31] has a non-finite value at element 5"));
  REQUIRE(layer.size() == 30);
  REQUIRE(layer.head(0, 0).size() == 30);
  CHECK_THAT(test_support::error_of([&] {
               layer.forward(&K[30 * d], &V[30 * d], q.data(), 3, 1, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(3, 1, d), out.data(),
                             hf_strides(3, 1, d));
             }),
             Catch::Contains("q_heads 3 is not a positive multiple of the 2 KV heads"));
  q[3] = test_support::kInf;
  CHECK_THAT(test_support::error_of([&] {
               layer.forward(V.data(), V.data(), q.data(), 4, 1, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(4, 1, d), out.data(),
                             hf_strides(4, 1, d));
             }),
             Catch::Contains("query [row 0, head 0, token 0] has a non-finite value at element 3"));
  REQUIRE(layer.size() == 30);
  CHECK_THAT(test_support::error_of([&] { layer.positions(0, 9); }), Catch::Contains("out of range"));
  CHECK_THAT(test_support::error_of([&] { ParisKVLayerCache<float>(0, 2, 8); }), Catch::Contains("batch must be >= 1 (got 0)"));
  CHECK_THAT(test_support::error_of([&] { layer.crop(31); }), Catch::Contains("n 31 out of range [0, 30]"));
  ParisKVCacheConfig bad;
  bad.scale = -1;
  CHECK_THAT(test_support::error_of([&] { ParisKVCache<float>(8, bad); }), Catch::Contains("scale must be finite and >= 0"));
}

// ------------------------------------------------------------------ attention kernels, dense steps

namespace {

namespace pkd = kvscore::pariskv::detail;

std::vector<pkd::KernelSet> attend_sets() {
  std::vector<pkd::KernelSet> v{pkd::KernelSet::portable};
  if (pkd::avx2_ok()) v.push_back(pkd::KernelSet::avx2);
  if (pkd::avx512_ok()) v.push_back(pkd::KernelSet::avx512);
  return v;
}

/// softmax(scale·q·k)·v over the given rows, all in fp64 from the stored (rounded) elements.
template <class T>
std::vector<double> attend_fp64(const std::vector<T>& K, const std::vector<T>& V, std::int64_t d,
                                const std::vector<std::int64_t>& rows, const float* q, double scale) {
  std::vector<double> lg, out(static_cast<std::size_t>(d), 0.0);
  double mx = -1e300, z = 0;
  for (std::int64_t r : rows) {
    double s = 0;
    for (std::int64_t j = 0; j < d; ++j) s += double(kvscore::to_float(K[std::size_t(r * d + j)])) * q[j];
    lg.push_back(s * scale);
    mx = std::max(mx, lg.back());
  }
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const double w = std::exp(lg[i] - mx);
    z += w;
    for (std::int64_t j = 0; j < d; ++j) out[std::size_t(j)] += w * kvscore::to_float(V[std::size_t(rows[i] * d + j)]);
  }
  for (double& x : out) x /= z;
  return out;
}

template <class T>
void check_attention_kernels() {
  const std::int64_t G = 3;
  for (std::int64_t d : {16, 24, 64, 128})
    for (std::int64_t n : {1, 7, 37, 300}) {
      CAPTURE(d, n);
      const std::vector<float> kf = uniform_noise(n * d, 20 + std::uint64_t(d), -2, 2), vf = uniform_noise(n * d, 21);
      std::vector<T> K(kf.size()), V(vf.size());
      for (std::size_t i = 0; i < kf.size(); ++i) {
        K[i] = kvscore::from_float<T>(kf[i]);
        V[i] = kvscore::from_float<T>(vf[i]);
      }
      const std::vector<float> qs = uniform_noise(G * d, 22, -3, 3);
      std::vector<std::int64_t> some, all(static_cast<std::size_t>(n));
      for (std::int64_t t = 0; t < n; ++t) {
        all[std::size_t(t)] = t;
        if (t % 3 != 1) some.push_back(t);
      }
      const float scale = 1.f / std::sqrt(float(d));
      std::vector<std::vector<float>> first;  // the portable set's outputs: [rows some][rows all][group]
      for (pkd::KernelSet set : attend_sets()) {
        CAPTURE(pkd::kernel_set_name(set));
        pkd::AttendScratch ws;
        std::vector<std::vector<float>> got;
        for (std::int64_t g = 0; g < G; ++g) {
          const float* q = qs.data() + g * d;
          std::vector<float> a(static_cast<std::size_t>(d)), b(static_cast<std::size_t>(d));
          pkd::attend_rows(set, K.data(), V.data(), d, some.data(), std::int64_t(some.size()), q, scale, a.data(), ws);
          pkd::attend_rows(set, K.data(), V.data(), d, nullptr, n, q, scale, b.data(), ws);
          const std::vector<double> ra = attend_fp64(K, V, d, some, q, scale), rb = attend_fp64(K, V, d, all, q, scale);
          for (std::int64_t j = 0; j < d; ++j) {
            CHECK(a[std::size_t(j)] == Approx(ra[std::size_t(j)]).epsilon(1e-5).margin(1e-6));
            CHECK(b[std::size_t(j)] == Approx(rb[std::size_t(j)]).epsilon(1e-5).margin(1e-6));
          }
          got.push_back(a);
          got.push_back(b);
        }
        // the G queries together, one read of K and V: each query's output bit for bit
        std::vector<float> og(static_cast<std::size_t>(G * d), -1.f);
        std::vector<const float*> qp;
        std::vector<float*> op;
        for (std::int64_t g = 0; g < G; ++g) {
          qp.push_back(qs.data() + g * d);
          op.push_back(og.data() + g * d);
        }
        pkd::attend_dense_group(set, K.data(), V.data(), d, n, qp.data(), G, scale, op.data(), ws);
        for (std::int64_t g = 0; g < G; ++g)
          CHECK(std::vector<float>(og.begin() + g * d, og.begin() + (g + 1) * d) == got[std::size_t(2 * g + 1)]);
        if (first.empty()) first = got;
        else CHECK(got == first);  // every set: the same bits
      }
    }
}

}  // namespace

TEST_CASE("pariskv attention: every kernel set gives the same bits, near the fp64 attention", "[pariskv][layer][simd]") {
  check_attention_kernels<float>();
  check_attention_kernels<kvscore::half>();
  check_attention_kernels<kvscore::bfloat16>();
  // the softmax's exponential: a few ulps of std::exp over the range it is used on
  double worst = 0;
  for (int i = 0; i <= 200000; ++i) {
    const float x = -87.f * float(i) / 200000.f;
    worst = std::max(worst, std::fabs(double(pkd::exp_neg_portable(x)) / std::exp(double(x)) - 1.0));
  }
  CHECK(worst < 3e-7);
  CHECK(pkd::exp_neg_portable(0.f) == 1.f);
  CHECK(pkd::exp_neg_portable(-1000.f) < 1e-37f);
}

TEST_CASE("pariskv layer: below the dense threshold every query head attends every position", "[pariskv][layer]") {
  // dense while N < max(dense_min, S + L + 2k): n0 + 1 is dense, n0 + 2 on retrieve; the dense
  // step reads each KV head once for its G query heads and gives each the per-head cache's bits
  const std::int64_t B = 2, H = 2, G = 3, Q = H * G, n0 = 200, steps = 4, N = n0 + steps;
  for (std::int64_t d : {24, 64}) {
    CAPTURE(d);
    ParisKVCacheConfig cfg = zones(4, 8, 12, ParisKVRetrieval::index);
    cfg.dense_fallback = true;
    cfg.dense_min = n0 + 2;
    const std::vector<float> K = uniform_noise(B * H * N * d, 31), V = uniform_noise(B * H * N * d, 32);
    const std::vector<float> Qs = uniform_noise(B * Q * steps * d, 33, -2, 2);
    std::vector<float> outs[2];
    for (int threads : {1, 2}) {
      ParisKVLayerCache<float> layer(B, H, d, cfg);
      layer.num_threads = threads;
      std::vector<ParisKVCache<float>> ref;
      for (std::int64_t i = 0; i < B * H; ++i) ref.emplace_back(d, cfg);
      layer.append(K.data(), V.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d));
      for (std::int64_t x = 0; x < B * H; ++x) ref[std::size_t(x)].append(&K[std::size_t(x * N * d)], &V[std::size_t(x * N * d)], n0);
      std::vector<float> out(static_cast<std::size_t>(B * Q * steps * d));
      typename ParisKVCache<float>::Workspace ws;
      std::vector<float> o(static_cast<std::size_t>(d));
      for (std::int64_t i = 0; i < steps; ++i) {  // one token per forward, as a decode
        const std::int64_t t = n0 + i;
        layer.forward(&K[std::size_t(t * d)], &V[std::size_t(t * d)], &Qs[std::size_t(i * d)], Q, 1, hf_strides(H, N, d),
                      hf_strides(H, N, d), hf_strides(Q, steps, d), &out[std::size_t(i * d)], hf_strides(Q, steps, d));
        CHECK(layer.head(0, 0).dense() == (t + 1 < n0 + 2));
        for (std::int64_t x = 0; x < B * H; ++x)
          ref[std::size_t(x)].append(&K[std::size_t((x * N + t) * d)], &V[std::size_t((x * N + t) * d)]);
        for (std::int64_t b = 0; b < B; ++b)
          for (std::int64_t j = 0; j < Q; ++j) {
            const float* q = &Qs[std::size_t(((b * Q + j) * steps + i) * d)];
            ref[std::size_t(b * H + j / G)].attend(q, o.data(), ws);
            for (std::int64_t x = 0; x < d; ++x) REQUIRE(out[std::size_t(((b * Q + j) * steps + i) * d + x)] == o[std::size_t(x)]);
            REQUIRE(layer.positions(b, j) == ws.positions);
            if (t + 1 < n0 + 2) CHECK(ws.positions.size() == std::size_t(t + 1));
            else CHECK(ws.positions.size() == std::size_t(4 + 12 + 8));
          }
      }
      outs[threads - 1] = out;
    }
    CHECK(outs[0] == outs[1]);
  }
}
