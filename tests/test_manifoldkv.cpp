// ManifoldKV (ManifoldL2, score = ‖k - μ‖, kvscore/scorers/manifold_l2.hpp; docs/methods/manifoldkv.md):
// the paper's Thm A.1 closed form (a radial outlier kept by ManifoldL2, evicted by KeyDiff) and
// invariance to translating every key. Windows: test_windowed_manifoldkv.cpp; numpy fixtures:
// test_golden.cpp; the cross-scorer properties: test_scorer_properties.cpp.
#include <catch2/catch.hpp>

#include <kvscore/scorers/keydiff.hpp>
#include <kvscore/scorers/manifold_l2.hpp>
#include <kvscore/scorers/windowed_manifold_l2.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <tuple>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::Scores;
using namespace test_support;  // Cache, random_cache, run, close, ...

}  // namespace

TEST_CASE("ManifoldKV Thm A.1: a radial outlier is kept by ManifoldL2 and evicted by KeyDiff", "[properties][manifold_l2]") {
  // mu = e1; common tokens e1 + eps*v_i with v_i ⟂ e1 unit vectors, in +/- pairs so that
  // their tangential parts cancel; one radial outlier 100*e1 (same direction, 100x norm).
  const std::int64_t d = 16, pairs = 32, n = 2 * pairs + 1, outlier = 17;
  const double eps = 0.05;
  std::mt19937 rng(7);
  std::normal_distribution<double> nd;
  Cache c(1, n, d);
  std::int64_t t = 0;
  for (std::int64_t p = 0; p < pairs; ++p) {
    std::vector<double> v(static_cast<std::size_t>(d));
    v[0] = 0;
    double s = 0;
    for (std::int64_t j = 1; j < d; ++j) s += (v[std::size_t(j)] = nd(rng)) * v[std::size_t(j)];
    for (auto& x : v) x /= std::sqrt(s);
    for (int sign : {1, -1}) {
      if (t == outlier) ++t;
      c.row(0, t)[0] = 1.f;
      for (std::int64_t j = 1; j < d; ++j) c.row(0, t)[j] = float(sign * eps * v[std::size_t(j)]);
      ++t;
    }
  }
  c.row(0, outlier)[0] = 100.f;

  // Sample mean in double from the stored (fp32) keys.
  std::vector<double> mu(std::size_t(d), 0.0);
  for (std::int64_t i = 0; i < n; ++i)
    for (std::int64_t j = 0; j < d; ++j) mu[std::size_t(j)] += c.row(0, i)[j] / double(n);
  auto dist_to_mu = [&](std::int64_t i) {
    double s = 0;
    for (std::int64_t j = 0; j < d; ++j) s += (c.row(0, i)[j] - mu[std::size_t(j)]) * (c.row(0, i)[j] - mu[std::size_t(j)]);
    return std::sqrt(s);
  };

  const Scores kd = run(kvscore::KeyDiff{}, c);
  const Scores l2 = run(kvscore::ManifoldL2{}, c);

  // KeyDiff: the anchor is exactly along e1, so the outlier has cos = 1 (score -1, the
  // minimum: evicted first) and a common token cos = 1/sqrt(1 + eps^2).
  CHECK(std::min_element(kd.values().begin(), kd.values().end()) - kd.values().begin() == outlier);
  CHECK(kd(0, outlier) == Approx(-1.0).margin(1e-6));
  for (std::int64_t i = 0; i < n; ++i) {
    if (i == outlier) continue;
    CHECK(kd(0, i) > kd(0, outlier));
    CHECK(kd(0, i) == Approx(-1.0 / std::sqrt(1.0 + eps * eps)).margin(2e-6));
  }

  // ManifoldL2: mu_hat = (2*pairs + 100)/(2*pairs + 1) e1, so the outlier sits at
  // 100 - mu_hat_1 = 99*(n-1)/n and is ranked first (kept).
  const double m1 = (2.0 * pairs + 100.0) / double(n);
  const double scale = 100.0;
  CHECK(std::max_element(l2.values().begin(), l2.values().end()) - l2.values().begin() == outlier);
  CHECK(close(l2(0, outlier), 99.0 * double(n - 1) / double(n), scale));
  CHECK(close(l2(0, outlier), dist_to_mu(outlier), scale));
  for (std::int64_t i = 0; i < n; ++i) {
    if (i == outlier) continue;
    CHECK(close(l2(0, i), std::sqrt((1.0 - m1) * (1.0 - m1) + eps * eps), scale));
    CHECK(close(l2(0, i), dist_to_mu(i), scale));
    CHECK(l2(0, i) < l2(0, outlier));
  }
}

TEST_CASE("ManifoldL2 and WindowedManifoldL2 are invariant to translating every key", "[properties][manifold_l2]") {
  const Cache c = random_cache(13, 2, 50, 32, 0.5f);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> shift(std::size_t(c.dim));
  for (auto& x : shift) x = 2.f * nd(rng);
  Cache s = c;
  for (std::int64_t h = 0; h < c.heads; ++h)
    for (std::int64_t t = 0; t < c.tokens; ++t)
      for (std::int64_t j = 0; j < c.dim; ++j) s.row(h, t)[j] += shift[std::size_t(j)];
  const double scale = std::max(max_row_norm(c), max_row_norm(s));
  for (const auto& [name, a, b] : {std::tuple{"l2", run(kvscore::ManifoldL2{}, c), run(kvscore::ManifoldL2{}, s)},
                                   std::tuple{"windowed-l2", run(kvscore::WindowedManifoldL2(16), c),
                                              run(kvscore::WindowedManifoldL2(16), s)}}) {
    INFO(name);
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t t = 0; t < c.tokens; ++t) CHECK(close(b(h, t), a(h, t), scale));
  }
}
