// Q-Filters (QFilter, score = <k, f_h>, and calibrate_qfilters; kvscore/scorers/qfilter.hpp;
// docs/methods/qfilters.md): linearity in keys and filter, shape errors, the calibration's sign rule and
// GQA mean. Against numpy: test_golden.cpp (fixtures, from_npy, SVD); the published filter
// convention: test_safetensors.cpp; the cross-scorer properties: test_scorer_properties.cpp.
#include <catch2/catch.hpp>

#include <kvscore/scorers/qfilter.hpp>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::Scores;
using namespace test_support;  // Cache, random_cache, run, close, ...

}  // namespace

TEST_CASE("QFilter is linear in the keys and in the filter", "[properties][qfilter]") {
  const std::int64_t H = 3, N = 25, d = 40;
  const Cache k1 = random_cache(21, H, N, d, 1.f), k2 = random_cache(22, H, N, d, 1.f);
  const double a = 2.0, b = -0.5;
  Cache k3(H, N, d);
  for (std::size_t i = 0; i < k3.v.size(); ++i) k3.v[i] = float(a * k1.v[i] + b * k2.v[i]);
  const std::vector<float> f = random_filters(3, H, d);
  const kvscore::QFilter q(f, H, d);
  const Scores s1 = run(q, k1), s2 = run(q, k2), s3 = run(q, k3);
  const double scale = (std::fabs(a) * max_row_norm(k1) + std::fabs(b) * max_row_norm(k2)) * 1.0;  // ‖f_h‖ ~ 1
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) CHECK(close(s3(h, t), a * s1(h, t) + b * s2(h, t), scale));

  std::vector<float> f2(f);
  for (auto& x : f2) x *= -3.f;
  const Scores s4 = run(kvscore::QFilter(f2, H, d), k1);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) CHECK(close(s4(h, t), -3.0 * s1(h, t), 3.0 * max_row_norm(k1)));
}

TEST_CASE("QFilter rejects keys of another shape, naming both", "[properties][qfilter]") {
  using Catch::Matchers::Contains;
  const kvscore::QFilter q(random_filters(1, 3, 24), 3, 24);
  {
    const Cache c = random_cache(92, 7, 4, 24);
    const auto keys = c.v;
    CHECK_THROWS_AS(q.score(view_of(keys, c)), std::invalid_argument);
    CHECK_THROWS_WITH(q.score(view_of(keys, c)), Contains("7") && Contains("3"));
  }
  {
    const Cache c = random_cache(93, 3, 4, 40);
    const auto keys = c.v;
    CHECK_THROWS_AS(q.score(view_of(keys, c)), std::invalid_argument);
    CHECK_THROWS_WITH(q.score(view_of(keys, c)), Contains("40") && Contains("24"));
  }
  // The filters themselves must have kv_heads * head_dim values.
  CHECK_THROWS_AS(kvscore::QFilter(std::vector<float>(10, 1.f), 3, 4), std::invalid_argument);
  CHECK_THROWS_AS(kvscore::QFilter(std::vector<float>(13, 1.f), 3, 4), std::invalid_argument);
}

TEST_CASE("calibrate_qfilters rejects q_heads that are not a multiple of kv_heads", "[properties][qfilter]") {
  const std::vector<float> q(std::size_t(6 * 10 * 4), 1.f);
  CHECK_THROWS_AS(kvscore::calibrate_qfilters(q.data(), 3, 10, 4, 2), std::invalid_argument);
  CHECK_THROWS_AS(kvscore::calibrate_qfilters(q.data(), 5, 10, 4, 4), std::invalid_argument);
  CHECK_THROWS_AS(kvscore::calibrate_qfilters(q.data(), 6, 10, 4, 0), std::invalid_argument);
  CHECK_NOTHROW(kvscore::calibrate_qfilters(q.data(), 6, 10, 4, 3));
}

TEST_CASE("calibrate_qfilters: sign rule and GQA mean on a rank-one input", "[properties][qfilter]") {
  // Rank-one query heads: head 0's samples are c_i*u, head 1's are -c_i*u (c_i > 0).
  // v1 is ±u for both; the sign rule makes the samples project positively, so the
  // filters are +u and -u. Grouped together (kv_heads = 1) their plain mean is 0.
  const std::int64_t n = 12, d = 6;
  std::vector<float> u = {0.5f, -0.5f, 0.5f, 0.f, 0.5f, 0.f};  // unit
  std::vector<float> q(std::size_t(2 * n * d));
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < d; ++j) {
      q[std::size_t((0 * n + i) * d + j)] = float(1 + i % 3) * u[std::size_t(j)];
      q[std::size_t((1 * n + i) * d + j)] = -float(1 + i % 3) * u[std::size_t(j)];
    }
  const auto f = kvscore::calibrate_qfilters(q.data(), 2, n, d, 2);
  REQUIRE(f.size() == std::size_t(2 * d));
  for (std::int64_t j = 0; j < d; ++j) {
    CHECK(f[std::size_t(j)] == Approx(u[std::size_t(j)]).margin(1e-6));       // head 0: +u
    CHECK(f[std::size_t(d + j)] == Approx(-u[std::size_t(j)]).margin(1e-6));  // head 1: -u (majority positive)
  }
  // One group of both heads: the plain mean of +u and -u is 0 (no renormalisation).
  const auto g = kvscore::calibrate_qfilters(q.data(), 2, n, d, 1);
  for (std::int64_t j = 0; j < d; ++j) CHECK(g[std::size_t(j)] == Approx(0.0).margin(1e-6));
}
