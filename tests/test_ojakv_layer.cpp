// OjaKV during generation (include/kvscore/ojakv/layer.hpp): the low-rank attention kernel
// against the reference attention, full rank against dense attention, the layer cache against
// one built by hand from the pieces, crop of the open block, memory and errors.
#include <catch2/catch.hpp>

#include <kvscore/ojakv/layer.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using kvscore::LayerStrides;
using kvscore::OjaHybridCache;
using kvscore::OjaLayerCache;
using kvscore::OjaLayerConfig;
using kvscore::OjaProjector;

using test_support::hf_strides;
using test_support::uniform_noise;

namespace {

/// Dense attention of q over rows [0, n) of one head (fp64).
std::vector<double> dense(const float* K, const float* V, std::int64_t n, std::int64_t d, const float* q, double s) {
  std::vector<double> l(static_cast<std::size_t>(n)), o(static_cast<std::size_t>(d), 0.0);
  double mx = -1e300, z = 0;
  for (std::int64_t t = 0; t < n; ++t) {
    double v = 0;
    for (std::int64_t j = 0; j < d; ++j) v += double(K[t * d + j]) * q[j];
    l[std::size_t(t)] = v * s;
    mx = std::max(mx, v * s);
  }
  for (std::int64_t t = 0; t < n; ++t) {
    const double p = std::exp(l[std::size_t(t)] - mx);
    z += p;
    for (std::int64_t j = 0; j < d; ++j) o[std::size_t(j)] += p * V[t * d + j];
  }
  for (double& x : o) x /= z;
  return o;
}

double rel_err(const float* got, const std::vector<double>& want) {
  double e = 0, n = 0;
  for (std::size_t j = 0; j < want.size(); ++j) {
    e += (got[j] - want[j]) * (got[j] - want[j]);
    n += want[j] * want[j];
  }
  return std::sqrt(e / std::max(n, 1e-300));
}

}  // namespace

TEST_CASE("ojakv layer: the low-rank attention equals the reference attention (A.4)", "[ojakv][layer]") {
  const std::int64_t H = 2, d = 32, r = 6, n = 90, T = 8;
  kvscore::OjaOptions oo;
  oo.period = T;
  const std::vector<float> K = uniform_noise(H * n * d, 1), V = uniform_noise(H * n * d, 2);
  std::vector<OjaProjector> proj;
  for (std::int64_t h = 0; h < H; ++h) proj.push_back(OjaProjector::random(d, r, r + 2, 7 + 2 * std::uint64_t(h), oo));
  const kvscore::KeysView<float> kv(K.data(), H, n, d, n * d, d), vv(V.data(), H, n, d, n * d, d);
  for (std::int64_t h = 0; h < H; ++h) proj[std::size_t(h)].prefill(kv, vv, h);
  kvscore::Selection full = kvscore::Selection::none(H, n);
  full.offsets = {0, 3, 5};
  full.positions = {0, 17, 40, 2, 89};
  OjaHybridCache c = OjaHybridCache::build(proj, kv, vv, full);
  const std::vector<float> extra = uniform_noise(2 * 5 * H * d, 3), qs = uniform_noise(5 * 2 * H * d, 4, -2, 2);
  OjaHybridCache::AttendWorkspace ws;
  std::vector<float> out(static_cast<std::size_t>(d));
  for (std::int64_t step = 0; step < 5; ++step) {  // an open block of 1..5 tokens
    c.append(proj, &extra[step * 2 * H * d], &extra[(step * 2 + 1) * H * d], &qs[step * 2 * H * d], 2 * H);
    for (std::int64_t h = 0; h < H; ++h)
      for (double scale : {0.0, 0.3}) {
        const float* q = &qs[(step * 2 * H + 2 * h) * d];
        c.attend(h, q, out.data(), scale, ws);
        // the reference attention uses 1/sqrt(d): scale the query instead
        std::vector<float> qq(q, q + d);
        if (scale > 0)
          for (auto& x : qq) x = float(x * scale * std::sqrt(double(d)));
        const std::vector<double> want = c.attention(h, qq.data());
        REQUIRE(rel_err(out.data(), want) < 2e-5);
      }
  }
}

TEST_CASE("ojakv layer: at full rank the layer cache attends like dense attention", "[ojakv][layer]") {
  const std::int64_t B = 2, H = 2, G = 2, Q = H * G, d = 16, n0 = 64, steps = 20, N = n0 + steps;
  OjaLayerConfig cfg;
  cfg.rank_k = cfg.rank_v = d;
  cfg.anchors = 8;
  cfg.sinks = 2;
  cfg.window = 4;
  cfg.options.period = 8;  // two blocks close during the steps
  OjaLayerCache layer(B, H, d, cfg);
  const std::vector<float> K = uniform_noise(B * H * N * d, 11), V = uniform_noise(B * H * N * d, 12);
  const std::vector<float> Qp = uniform_noise(B * Q * 4 * d, 13), Qs = uniform_noise(B * Q * steps * d, 14, -2, 2);
  layer.prefill(K.data(), V.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d), Qp.data(), Q, 4, hf_strides(Q, 4, d));
  std::vector<float> out(std::size_t(B * Q * steps * d));
  layer.forward(&K[n0 * d], &V[n0 * d], Qs.data(), Q, steps, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, steps, d), out.data(),
                hf_strides(Q, steps, d));
  REQUIRE(layer.size() == N);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t j = 0; j < Q; ++j)
      for (std::int64_t i = 0; i < steps; ++i) {
        const std::int64_t h = j / G, n = n0 + i + 1;
        const std::vector<double> want = dense(&K[(b * H + h) * N * d], &V[(b * H + h) * N * d], n, d,
                                               &Qs[((b * Q + j) * steps + i) * d], 1.0 / std::sqrt(double(d)));
        REQUIRE(rel_err(&out[std::size_t(((b * Q + j) * steps + i) * d)], want) < 1e-5);
      }
}

TEST_CASE("ojakv layer: equals the store built by hand, any thread count", "[ojakv][layer]") {
  const std::int64_t H = 3, G = 3, Q = H * G, d = 32, n0 = 120, w = 6, steps = 4, N = n0 + steps;
  OjaLayerConfig cfg;
  cfg.rank_k = 6;
  cfg.rank_v = 5;
  cfg.anchors = 20;
  cfg.sinks = 3;
  cfg.window = w;
  cfg.seed = 100;
  const std::vector<float> K = uniform_noise(H * N * d, 21), V = uniform_noise(H * N * d, 22);
  const std::vector<float> Qp = uniform_noise(Q * w * d, 23), Qs = uniform_noise(Q * steps * d, 24);
  std::vector<std::vector<float>> outs;
  for (int threads : {1, 2}) {
    OjaLayerCache layer(1, H, d, cfg);
    layer.num_threads = threads;
    layer.prefill(K.data(), V.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d), Qp.data(), Q, w, hf_strides(Q, w, d));
    std::vector<float> out(std::size_t(Q * steps * d));
    layer.forward(&K[n0 * d], &V[n0 * d], Qs.data(), Q, steps, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, steps, d), out.data(),
                  hf_strides(Q, steps, d));
    outs.push_back(out);
    // by hand: projectors, residual rule with the window protected, selection, build
    const kvscore::KeysView<float> kv(K.data(), H, n0, d, N * d, d), vv(V.data(), H, n0, d, N * d, d);
    std::vector<OjaProjector> proj;
    for (std::int64_t h = 0; h < H; ++h) {
      proj.push_back(OjaProjector(kvscore::OjaBasis::random(d, 6, 100 + 2 * std::uint64_t(h)),
                                  kvscore::OjaBasis::random(d, 5, 101 + 2 * std::uint64_t(h))));
      proj.back().prefill(kv, vv, h);
    }
    std::vector<Eigen::MatrixXd> uk;
    for (auto& p : proj) uk.push_back(p.key().basis());
    kvscore::OjaResidual rule(Qp.data(), Q, w, d, uk);
    kvscore::SelectOptions so;
    so.sinks = 3;
    so.recent = w;
    const kvscore::Selection full = kvscore::select(rule.score(kv), kvscore::Budget::per_head(20), so);
    for (std::int64_t h = 0; h < H; ++h) {
      const auto fh = full.head(h);
      REQUIRE(layer.store(0).head(h).full_pos == std::vector<std::int64_t>(fh.begin(), fh.end()));
      REQUIRE(layer.projectors(0)[std::size_t(h)].key().basis() == proj[std::size_t(h)].key().basis());
    }
    OjaHybridCache c = OjaHybridCache::build(proj, kv, vv, full);
    OjaHybridCache::AttendWorkspace ws;
    std::vector<float> o(static_cast<std::size_t>(d)), kr(std::size_t(H * d)), vr(std::size_t(H * d)), qr(std::size_t(Q * d));
    for (std::int64_t i = 0; i < steps; ++i) {
      for (std::int64_t h = 0; h < H; ++h) {
        std::copy_n(&K[(h * N + n0 + i) * d], d, &kr[std::size_t(h * d)]);
        std::copy_n(&V[(h * N + n0 + i) * d], d, &vr[std::size_t(h * d)]);
      }
      for (std::int64_t j = 0; j < Q; ++j) std::copy_n(&Qs[(j * steps + i) * d], d, &qr[std::size_t(j * d)]);
      c.append(proj, kr.data(), vr.data(), qr.data(), Q);
      for (std::int64_t j = 0; j < Q; ++j) {
        c.attend(j / G, &qr[std::size_t(j * d)], o.data(), 0, ws);
        for (std::int64_t x = 0; x < d; ++x) REQUIRE(out[std::size_t((j * steps + i) * d + x)] == o[std::size_t(x)]);
      }
    }
  }
  REQUIRE(outs[0] == outs[1]);
}

TEST_CASE("ojakv layer: crop drops open-block tokens as if they never came", "[ojakv][layer]") {
  const std::int64_t H = 2, Q = 4, d = 16, n0 = 50, N = n0 + 12;
  OjaLayerConfig cfg;
  cfg.rank_k = 4;
  cfg.anchors = 10;
  cfg.window = 4;
  cfg.options.period = 8;
  const std::vector<float> K = uniform_noise(H * N * d, 31), V = uniform_noise(H * N * d, 32), Qp = uniform_noise(Q * 4 * d, 33),
                           Qs = uniform_noise(Q * 12 * d, 34);
  auto make = [&] {
    OjaLayerCache l(1, H, d, cfg);
    l.prefill(K.data(), V.data(), n0, hf_strides(H, N, d), hf_strides(H, N, d), Qp.data(), Q, 4, hf_strides(Q, 4, d));
    return l;
  };
  OjaLayerCache a = make(), b = make();
  std::vector<float> out(std::size_t(Q * 12 * d)), out_b(out.size());
  // a: 3 tokens (a question), 4 more (an answer), then crop back to n0 + 3
  a.forward(&K[n0 * d], &V[n0 * d], Qs.data(), Q, 7, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, 12, d), out.data(), hf_strides(Q, 12, d));
  a.crop(n0 + 3);
  b.forward(&K[n0 * d], &V[n0 * d], Qs.data(), Q, 3, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, 12, d), out_b.data(), hf_strides(Q, 12, d));
  REQUIRE(a.size() == n0 + 3);
  REQUIRE(a.projectors(0)[1].key().buffered() == 3);
  // the next 6 tokens close the block (T = 8) on both: the same updated bases and outputs
  std::fill(out.begin(), out.end(), 0.f);
  std::fill(out_b.begin(), out_b.end(), 0.f);
  a.forward(&K[(n0 + 3) * d], &V[(n0 + 3) * d], &Qs[3 * d], Q, 6, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, 12, d), out.data(),
            hf_strides(Q, 12, d));
  b.forward(&K[(n0 + 3) * d], &V[(n0 + 3) * d], &Qs[3 * d], Q, 6, hf_strides(H, N, d), hf_strides(H, N, d), hf_strides(Q, 12, d), out_b.data(),
            hf_strides(Q, 12, d));
  REQUIRE(a.projectors(0)[0].key().decode_updates() == 1);
  REQUIRE(a.projectors(0)[0].key().basis() == b.projectors(0)[0].key().basis());
  REQUIRE(out == out_b);
  CHECK_THAT(test_support::error_of([&] { a.crop(n0); }), Catch::Contains("tokens before 58 are in closed blocks"));
}

TEST_CASE("ojakv layer: memory is the paper's formula, errors name the value", "[ojakv][layer]") {
  const std::int64_t B = 2, H = 3, d = 64, n0 = 200;
  OjaLayerConfig cfg;
  cfg.rank_k = 16;
  cfg.rank_v = 12;
  cfg.anchors = 40;
  cfg.window = 8;
  OjaLayerCache layer(B, H, d, cfg);
  CHECK(layer.size() == 0);
  const std::vector<float> K = uniform_noise(B * H * n0 * d, 41), V = uniform_noise(B * H * n0 * d, 42), Qp = uniform_noise(B * H * 8 * d, 43);
  std::vector<float> out(std::size_t(B * H * d));
  CHECK_THAT(test_support::error_of([&] {
               layer.forward(K.data(), V.data(), Qp.data(), H, 1, hf_strides(H, n0, d), hf_strides(H, n0, d), hf_strides(H, 8, d), out.data(),
                             hf_strides(H, 1, d));
             }),
             Catch::Contains("prefill first"));
  OjaLayerConfig few = cfg;
  few.anchors = 11;  // < 4 sinks + 8 window
  OjaLayerCache small(B, H, d, few);
  CHECK_THAT(test_support::error_of([&] {
               small.prefill(K.data(), V.data(), n0, hf_strides(H, n0, d), hf_strides(H, n0, d), Qp.data(), H, 8, hf_strides(H, 8, d));
             }),
             Catch::Contains("anchors 11 < the 12 protected tokens"));
  CHECK(small.size() == 0);
  layer.prefill(K.data(), V.data(), n0, hf_strides(H, n0, d), hf_strides(H, n0, d), Qp.data(), H, 8, hf_strides(H, 8, d));
  const kvscore::OjaMemory m = layer.memory(2);
  // per head: (N − m)(r_k + r_v)·b + m(2d·b + 4) + d(r_k + r_v)·b, m = 40 anchors
  const std::int64_t per = (n0 - 40) * (16 + 12) * 2 + 40 * (2 * d * 2 + 4) + d * (16 + 12) * 2;
  CHECK(m.hybrid_bytes == B * H * per);
  CHECK(m.full_bytes == B * H * n0 * 2 * d * 2);
  CHECK_THAT(test_support::error_of([&] {
               layer.prefill(K.data(), V.data(), n0, hf_strides(H, n0, d), hf_strides(H, n0, d), Qp.data(), H, 8, hf_strides(H, 8, d));
             }),
             Catch::Contains("prefilled already (200 tokens)"));
  CHECK_THAT(test_support::error_of([&] {
               layer.forward(K.data(), V.data(), Qp.data(), 4, 1, hf_strides(H, n0, d), hf_strides(H, n0, d), hf_strides(4, 8, d), out.data(),
                             hf_strides(4, 1, d));
             }),
             Catch::Contains("q_heads 4 is not a positive multiple of the 3 KV heads"));
  OjaLayerConfig r0 = cfg;
  r0.rank_k = 65;
  CHECK_THAT(test_support::error_of([&] { OjaLayerCache(1, 1, d, r0); }), Catch::Contains("65"));
}
