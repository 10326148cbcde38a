// Windowed ManifoldKV (WindowedManifoldL2, kvscore/scorers/windowed_manifold_l2.hpp;
// docs/methods/windowed-manifoldkv.md): window boundaries under both tail rules, each window equal to
// ManifoldL2 of its slice, N <= W equal to ManifoldL2, and the window <= 0 error. Translation
// invariance is in test_manifoldkv.cpp, the cross-scorer properties in test_scorer_properties.cpp.
#include <catch2/catch.hpp>

#include <kvscore/scorers/manifold_l2.hpp>
#include <kvscore/scorers/windowed_manifold_l2.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <utility>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::Scores;
using namespace test_support;  // Cache, random_cache, run, close, ...

/// WindowedManifoldL2 on head h of c, recomputed as ManifoldL2 on each window slice.
std::vector<float> windowed_via_slices(const Cache& c, std::int64_t h, std::int64_t w,
                                       kvscore::WindowTail rule = kvscore::WindowTail::merge) {
  std::vector<float> out(std::size_t(c.tokens));
  for (const auto& [b, e] : spec_windows(c.tokens, w, rule)) {
    const Scores s = run(kvscore::ManifoldL2{}, c.head_slice(h, b, e));
    std::copy(s.head(0), s.head(0) + (e - b), out.begin() + b);
  }
  return out;
}

}  // namespace

TEST_CASE("WindowedManifoldL2 with N <= W (or a merged tail) equals ManifoldL2", "[properties][windowed_manifold_l2]") {
  const std::int64_t W = 16;
  for (std::int64_t n : {std::int64_t(1), std::int64_t(5), W - 1, W, W + 1, W + W / 2 - 1}) {
    CAPTURE(n);
    const Cache c = random_cache(std::uint32_t(100 + n), 2, n, 32, 1.f);
    const Scores g = run(kvscore::ManifoldL2{}, c), w = run(kvscore::WindowedManifoldL2(W, kvscore::WindowTail::merge), c);
    const double scale = max_row_norm(c);
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t t = 0; t < n; ++t) CHECK(close(w(h, t), g(h, t), scale, 1e-6));
  }
}

TEST_CASE("WindowedManifoldL2: window boundaries follow the tail rule", "[properties][windowed_manifold_l2]") {
  using WB = std::vector<std::pair<std::int64_t, std::int64_t>>;
  using kvscore::WindowTail;
  // The documented examples: the paper's rule (own) ...
  CHECK(spec_windows(37, 16, WindowTail::own) == WB{{0, 16}, {16, 32}, {32, 37}});
  CHECK(spec_windows(35, 16, WindowTail::own) == WB{{0, 16}, {16, 32}, {32, 35}});  // 2W+3: a 3-token window
  CHECK(spec_windows(5, 16, WindowTail::own) == WB{{0, 5}});
  // ... and merge, the default.
  CHECK(kvscore::WindowedManifoldL2(16).tail == WindowTail::merge);
  CHECK(spec_windows(37, 16, WindowTail::merge) == WB{{0, 16}, {16, 37}});
  CHECK(spec_windows(130, 48, WindowTail::merge) == WB{{0, 48}, {48, 96}, {96, 130}});
  CHECK(spec_windows(35, 16, WindowTail::merge) == WB{{0, 16}, {16, 35}});            // 2W+3: merged
  CHECK(spec_windows(41, 16, WindowTail::merge) == WB{{0, 16}, {16, 32}, {32, 41}});  // 2W+W/2+1: own window
  CHECK(spec_windows(40, 16, WindowTail::merge) == WB{{0, 16}, {16, 32}, {32, 40}});  // 2*tail == W: own window
  CHECK(spec_windows(39, 16, WindowTail::merge) == WB{{0, 16}, {16, 39}});            // 2*tail < W: merged

  for (const WindowTail rule : {WindowTail::own, WindowTail::merge}) {
    CAPTURE(int(rule));
    // The library's own windows() (public) agrees with the rule everywhere.
    for (std::int64_t w : {1, 2, 3, 5, 8, 16, 48}) {
      const kvscore::WindowedManifoldL2 s(w, rule);
      for (std::int64_t n = 0; n <= 5 * w + 3; ++n) {
        CAPTURE(w, n);
        auto lib = s.windows(n);
        const WB got(lib.begin(), lib.end());
        CHECK(got == spec_windows(n, w, rule));
      }
    }

    // And the scores: per window, ManifoldL2 of that slice (windows with different means,
    // so any wrong boundary moves the centroid and the scores by O(1)).
    for (std::int64_t w : {3, 5, 16}) {
      for (std::int64_t n = 1; n <= 4 * w + 2; ++n) {
        CAPTURE(w, n);
        Cache c = random_cache(std::uint32_t(1000 + 31 * w + n), 2, n, 12, 0.f, 1.f);
        for (std::int64_t h = 0; h < c.heads; ++h)
          for (std::int64_t t = 0; t < n; ++t) c.row(h, t)[0] += 5.f * float(t / w);  // per-window offset
        const Scores s = run(kvscore::WindowedManifoldL2(w, rule), c);
        const double scale = max_row_norm(c);
        for (std::int64_t h = 0; h < c.heads; ++h) {
          const std::vector<float> ref = windowed_via_slices(c, h, w, rule);
          for (std::int64_t t = 0; t < n; ++t) CHECK(close(s(h, t), ref[std::size_t(t)], scale, 1e-6));
        }
      }
    }
  }
  CHECK_THROWS_WITH(kvscore::parse_window_tail("last"), Catch::Matchers::Contains("'last'"));
  CHECK(kvscore::parse_window_tail("merge") == WindowTail::merge);
}

TEST_CASE("WindowedManifoldL2: the merge rule (default) does not evict a short tail wholesale", "[properties][windowed_manifold_l2]") {
  // N = 2W + 3 and N = 2W + 1: the tail tokens come from the same distribution as the
  // window before them. Merged into it, their distances are typical of that window;
  // as their own window (the paper's rule) they sit next to their own centroid (0 for a
  // 1-token tail), which the last CHECKs show.
  const std::int64_t W = 16, d = 32;
  for (std::int64_t extra : {3, 1}) {
    const std::int64_t n = 2 * W + extra;
    CAPTURE(n);
    std::mt19937 rng(std::uint32_t(40 + extra));
    std::normal_distribution<float> nd;
    Cache c(2, n, d);
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const float m = t < W ? -4.f : 4.f;  // window 0 around -4, window 1 (and the tail) around +4
        for (std::int64_t j = 0; j < d; ++j) c.row(h, t)[j] = m + nd(rng);
      }
    const Scores s = run(kvscore::WindowedManifoldL2(W), c);
    const Scores own = run(kvscore::WindowedManifoldL2(W, kvscore::WindowTail::own), c);
    for (std::int64_t h = 0; h < c.heads; ++h) {
      double win = 0, tail = 0, own_tail = 0;
      for (std::int64_t t = 2 * W; t < n; ++t) own_tail += own(h, t) / double(extra);
      for (std::int64_t t = W; t < 2 * W; ++t) win += s(h, t) / double(W);
      for (std::int64_t t = 2 * W; t < n; ++t) tail += s(h, t) / double(extra);
      CAPTURE(h, win, tail);
      CHECK(tail > 0.5 * win);
      CHECK(tail < 2.0 * win);
      // Own window: the tail is scored against its own centroid alone (a 1-token tail: 0).
      const Scores alone = run(kvscore::ManifoldL2{}, c.head_slice(h, 2 * W, n));
      for (std::int64_t t = 2 * W; t < n; ++t) CHECK(close(own(h, t), alone(0, t - 2 * W), max_row_norm(c), 1e-6));
      if (extra == 1) CHECK(own_tail == 0.0);
      // Explicit boundaries: [0,W) and [W,n).
      const std::vector<float> ref = windowed_via_slices(c, h, W, kvscore::WindowTail::merge);
      const Scores w1 = run(kvscore::ManifoldL2{}, c.head_slice(h, W, n));
      for (std::int64_t t = W; t < n; ++t) CHECK(close(s(h, t), w1(0, t - W), max_row_norm(c), 1e-6));
      for (std::int64_t t = 0; t < n; ++t) CHECK(close(s(h, t), ref[std::size_t(t)], max_row_norm(c), 1e-6));
    }
  }
}

TEST_CASE("WindowedManifoldL2: a tail of at least W/2 tokens is its own window (both rules)", "[properties][windowed_manifold_l2]") {
  const std::int64_t W = 16;
  for (const kvscore::WindowTail rule : {kvscore::WindowTail::own, kvscore::WindowTail::merge})
  for (std::int64_t n : {2 * W + W / 2 + 1, 2 * W + W / 2}) {
    CAPTURE(n, int(rule));
    const Cache c = random_cache(std::uint32_t(50 + n), 2, n, 24, 1.f);
    const Scores s = run(kvscore::WindowedManifoldL2(W, rule), c);
    for (std::int64_t h = 0; h < c.heads; ++h) {
      const Scores tail = run(kvscore::ManifoldL2{}, c.head_slice(h, 2 * W, n));
      for (std::int64_t t = 2 * W; t < n; ++t) CHECK(close(s(h, t), tail(0, t - 2 * W), max_row_norm(c), 1e-6));
      const Scores mid = run(kvscore::ManifoldL2{}, c.head_slice(h, W, 2 * W));
      for (std::int64_t t = W; t < 2 * W; ++t) CHECK(close(s(h, t), mid(0, t - W), max_row_norm(c), 1e-6));
    }
  }
}

TEST_CASE("WindowedManifoldL2 rejects a window <= 0", "[properties][windowed_manifold_l2]") {
  CHECK_THROWS_AS(kvscore::WindowedManifoldL2(0), std::invalid_argument);
  CHECK_THROWS_AS(kvscore::WindowedManifoldL2(-3), std::invalid_argument);
  CHECK_NOTHROW(kvscore::WindowedManifoldL2(1));
  CHECK(kvscore::WindowedManifoldL2().window == 4096);
}
