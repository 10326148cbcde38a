// Scorer properties shared by the five geometric scorers (KNorm, KeyDiff, ManifoldL2,
// WindowedManifoldL2, QFilter): zero keys, invalid rows (NaN, Inf, overflow), empty caches,
// output-shape errors and determinism, each checked on every scorer. Everything here is
// computed in the test itself (double precision where a reference value is needed); the
// numpy fixtures are covered by test_golden.cpp. What concerns one method alone is in its own
// file: test_knorm.cpp, test_keydiff.cpp, test_manifoldkv.cpp, test_windowed_manifoldkv.cpp,
// test_qfilter.cpp. The helpers (Cache, run(), close() and its tolerance: |a - e| <= 1e-5 *
// (|e| + scale), unless a property is exact by construction) are in test_support.hpp.
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {


using namespace test_support;  // Cache, random_cache, run, close, ...


bool any_nan(const Scores& s) {
  return std::any_of(s.values().begin(), s.values().end(), [](float x) { return std::isnan(x); });
}

/// Calls f(name, scorer) for each of the five scorers (QFilter with `filters` [heads][dim]).
template <class F>
void for_each_scorer(std::int64_t heads, std::int64_t dim, std::int64_t window, F&& f) {
  f("knorm", kvscore::KNorm{});
  f("keydiff", kvscore::KeyDiff{});
  f("l2", kvscore::ManifoldL2{});
  f("windowed-l2", kvscore::WindowedManifoldL2(window));
  f("qfilter", kvscore::QFilter(random_filters(77, heads, dim), heads, dim));
}

}  // namespace

// ------------------------------------------------------------------ query placement

TEST_CASE("query placement: both spellings parse, to_string round-trips, anything else names the value",
          "[placement]") {
  using kvscore::QueryPlacement;
  for (const QueryPlacement p : {QueryPlacement::in_cache, QueryPlacement::after_cache})
    CHECK(kvscore::parse_query_placement(kvscore::to_string(p)) == p);
  CHECK(kvscore::parse_query_placement("in-cache") == QueryPlacement::in_cache);
  CHECK(kvscore::parse_query_placement("after-cache") == QueryPlacement::after_cache);
  CHECK_THROWS_WITH(kvscore::parse_query_placement("after"), Catch::Matchers::Contains("'after'"));
}

// ------------------------------------------------------------------ zero keys

TEMPLATE_TEST_CASE("Zero keys: no NaN, KNorm 0, KeyDiff 0, L2 finite", "[properties]", float, half, bfloat16) {
  const std::int64_t H = 2, N = 10, d = 12;
  Cache c = random_cache(61, H, N, d, 1.f);
  for (std::int64_t t : {3, 7}) std::fill(c.row(0, t), c.row(0, t) + d, 0.f);
  std::fill(c.row(1, 0), c.row(1, 0) + N * d, 0.f);  // head 1: every key zero
  INFO(tname<TestType>());
  for_each_scorer(H, d, 4, [&](const char* name, const auto& scorer) {
    INFO(name);
    const Scores s = run<TestType>(scorer, c);
    CHECK_FALSE(any_nan(s));
    for (float x : s.values()) CHECK(std::isfinite(x));
    const std::string m = name;
    if (m == "knorm" || m == "keydiff" || m == "qfilter") {
      CHECK(s(0, 3) == 0.f);
      CHECK(s(0, 7) == 0.f);
      for (std::int64_t t = 0; t < N; ++t) CHECK(s(1, t) == 0.f);
    } else {  // distances: an all-zero head has centroid 0 and every distance 0
      for (std::int64_t t = 0; t < N; ++t) CHECK(s(1, t) == 0.f);
      CHECK(s(0, 3) > 0.f);
    }
  });
}

TEMPLATE_TEST_CASE("All-zero cache: every score finite (and 0)", "[properties]", float, half, bfloat16) {
  const Cache c(3, 9, 20);
  INFO(tname<TestType>());
  for_each_scorer(3, 20, 4, [&](const char* name, const auto& scorer) {
    INFO(name);
    const Scores s = run<TestType>(scorer, c);
    for (float x : s.values()) {
      CHECK(std::isfinite(x));
      CHECK(x == 0.f);
    }
  });
}

// ------------------------------------------------------------------ invalid rows

namespace {

enum class Bad { nan, pos_inf, neg_inf, overflow };

const char* bad_name(Bad b) {
  switch (b) {
    case Bad::nan: return "NaN element";
    case Bad::pos_inf: return "+Inf element";
    case Bad::neg_inf: return "-Inf element";
    case Bad::overflow: return "finite elements, fp32 squared norm overflows";
  }
  return "?";
}

void poison(float* row, std::int64_t d, Bad b) {
  switch (b) {
    case Bad::nan: row[d / 2] = kNaN; break;
    case Bad::pos_inf: row[d - 1] = kInf; break;
    case Bad::neg_inf: row[0] = -kInf; break;
    case Bad::overflow:
      // 3e19^2 = 9e38 > FLT_MAX: finite in float32 and bfloat16, not representable in half.
      for (std::int64_t j = 0; j < d; ++j) row[j] = (j % 2 ? -3e19f : 3e19f);
      break;
  }
}

/// Every scorer on a cache with invalid rows: those score exactly -inf, nothing is NaN, and
/// every other score equals the score computed without the invalid rows.
template <class T>
void check_invalid_rows(Bad bad) {
  const std::int64_t H = 2, N = 37, d = 20, W = 16;  // windows [0,16) [16,37)
  const Cache clean = random_cache(71, H, N, d, 1.f);
  Cache c = clean;
  // head 0: one bad row; head 1: two, one of them in the merged tail window.
  const std::vector<std::vector<std::int64_t>> bad_rows = {{5}, {0, 33}};
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t : bad_rows[std::size_t(h)]) poison(c.row(h, t), d, bad);
  const std::vector<float> filters = random_filters(77, H, d);
  const double scale = max_row_norm(clean);

  INFO(tname<T>() << ", " << bad_name(bad));
  for_each_scorer(H, d, W, [&](const char* name, const auto& scorer) {
    INFO(name);
    const Scores s = run<T>(scorer, c);
    CHECK_FALSE(any_nan(s));
    const std::string m = name;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto& drop = bad_rows[std::size_t(h)];
      for (std::int64_t t : drop) {
        CAPTURE(h, t);
        CHECK(s(h, t) == -kInf);
      }
      // Reference without the bad rows: the same scorer on the remaining rows of this head
      // (windowed: per window of the full cache, ManifoldL2 of the window's remaining rows).
      std::vector<float> ref(std::size_t(N), 0.f);
      std::vector<std::int64_t> kept;
      auto score_subset = [&](const Cache& sub, auto&& one_head_scorer, std::int64_t t0, std::int64_t t1) {
        const Scores r = run<T>(one_head_scorer, sub);
        std::int64_t i = 0;
        for (std::int64_t t = t0; t < t1; ++t)
          if (std::find(drop.begin(), drop.end(), t) == drop.end()) ref[std::size_t(t)] = r(0, i++);
      };
      if (m == "windowed-l2") {
        for (const auto& [b, e] : spec_windows(N, W)) score_subset(c.head_without(h, drop, b, e), kvscore::ManifoldL2{}, b, e);
      } else if (m == "qfilter") {
        score_subset(c.head_without(h, drop),
                     kvscore::QFilter(std::vector<float>(filters.begin() + h * d, filters.begin() + (h + 1) * d), 1, d),
                     0, N);
      } else {
        score_subset(c.head_without(h, drop), scorer, 0, N);
      }
      for (std::int64_t t = 0; t < N; ++t) {
        if (std::find(drop.begin(), drop.end(), t) != drop.end()) continue;
        CAPTURE(h, t);
        CHECK(std::isfinite(s(h, t)));
        CHECK(close(s(h, t), ref[std::size_t(t)], m == "keydiff" ? 1.0 : scale, 1e-6));
      }
    }
  });
}

}  // namespace

TEMPLATE_TEST_CASE("Invalid rows (NaN, Inf) score -inf and are left out of every centroid", "[properties]", float,
                   half, bfloat16) {
  for (Bad b : {Bad::nan, Bad::pos_inf, Bad::neg_inf}) check_invalid_rows<TestType>(b);
}

TEMPLATE_TEST_CASE("Invalid rows (fp32 squared-norm overflow) score -inf", "[properties]", float, bfloat16) {
  check_invalid_rows<TestType>(Bad::overflow);
}

TEMPLATE_TEST_CASE("A head whose rows are all invalid scores -inf everywhere, never NaN", "[properties]", float, half,
                   bfloat16) {
  Cache c = random_cache(81, 2, 6, 8, 1.f);
  for (std::int64_t t = 0; t < 6; ++t) c.row(1, t)[t % 8] = (t % 2) ? kNaN : -kInf;
  for_each_scorer(2, 8, 4, [&](const char* name, const auto& scorer) {
    INFO(name << ", " << tname<TestType>());
    const Scores s = run<TestType>(scorer, c);
    CHECK_FALSE(any_nan(s));
    for (std::int64_t t = 0; t < 6; ++t) {
      CHECK(s(1, t) == -kInf);
      CHECK(std::isfinite(s(0, t)));
    }
  });
}

TEST_CASE("Random half bit patterns: never NaN - -inf exactly for rows with NaN/Inf", "[properties]") {
  // Every 16-bit pattern is a possible half value; 1/32 of them are Inf/NaN.
  const std::int64_t H = 3, N = 200, d = 8;
  std::mt19937 rng(99);
  std::vector<half> keys(std::size_t(H * N * d));
  for (auto& k : keys) k.bits = std::uint16_t(rng() & 0xffffu);
  const KeysView<half> v(keys.data(), H, N, d, N * d, d);
  std::vector<char> invalid(std::size_t(H * N), 0);
  int n_invalid = 0;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      for (std::int64_t j = 0; j < d; ++j)
        if (!std::isfinite(kvscore::to_float(keys[std::size_t((h * N + t) * d + j)]))) invalid[std::size_t(h * N + t)] = 1;
      n_invalid += invalid[std::size_t(h * N + t)];
    }
  REQUIRE(n_invalid > 10);
  REQUIRE(n_invalid < H * N - 10);
  for_each_scorer(H, d, 16, [&](const char* name, const auto& scorer) {
    INFO(name);
    const Scores s = scorer.score(v);
    CHECK_FALSE(any_nan(s));
    int mismatches = 0;
    for (std::int64_t i = 0; i < H * N; ++i)
      mismatches += (s.values()[std::size_t(i)] == -kInf) != bool(invalid[std::size_t(i)]);
    CHECK(mismatches == 0);
  });
}

// ------------------------------------------------------------------ empty caches

TEST_CASE("Empty caches: no throw, empty output", "[properties]") {
  const std::int64_t d = 8;
  SECTION("tokens = 0") {
    const KeysView<float> v(nullptr, 3, 0, d, /*head_stride=*/d, /*token_stride=*/3 * d);
    const KeysView<half> vh = KeysView<half>::hf(nullptr, 0, 1, 3, 0, d, /*capacity=*/16);
    const KeysView<bfloat16> vb = KeysView<bfloat16>::token_major(nullptr, 0, 3, d);
    for_each_scorer(3, d, 4, [&](const char* name, const auto& scorer) {
      INFO(name);
      Scores s;
      REQUIRE_NOTHROW(s = scorer.score(v));
      CHECK(s.heads() == 3);
      CHECK(s.tokens() == 0);
      CHECK(s.values().empty());
      CHECK_NOTHROW(scorer.score(v, ScoresView(nullptr, 3, 0)));
      CHECK_NOTHROW(s = scorer.score(vh));
      CHECK(s.values().empty());
      CHECK_NOTHROW(s = scorer.score(vb));
      CHECK(s.values().empty());
    });
  }
  SECTION("heads = 0") {
    // (QFilter needs kv_heads > 0 and a cache with the same number of heads, so it has
    // no zero-head case.)
    const std::vector<float> dummy(16, 1.f);
    const KeysView<float> v(dummy.data(), 0, 2, d, 2 * d, d);
    const KeysView<float> vnull(nullptr, 0, 5, d, 5 * d, d);
    auto check = [&](const char* name, const auto& scorer) {
      INFO(name);
      Scores s;
      REQUIRE_NOTHROW(s = scorer.score(v));
      CHECK(s.heads() == 0);
      CHECK(s.values().empty());
      REQUIRE_NOTHROW(s = scorer.score(vnull));
      CHECK(s.values().empty());
      CHECK_NOTHROW(scorer.score(vnull, ScoresView(nullptr, 0, 5)));
    };
    check("knorm", kvscore::KNorm{});
    check("keydiff", kvscore::KeyDiff{});
    check("l2", kvscore::ManifoldL2{});
    check("windowed-l2", kvscore::WindowedManifoldL2(4));
  }
}

TEST_CASE("Empty caches: C-order strides of a zero-token cache are accepted", "[properties]") {
  // A Hugging Face DynamicCache before prefill is [batch, kv_heads, 0, head_dim]; its
  // C-order head stride is 0 * head_dim = 0 (numpy reports exactly that). There are no
  // rows, so no two rows can overlap: wrapping and scoring it must not throw.
  const std::int64_t d = 8;
  KeysView<half> v;
  REQUIRE_NOTHROW(v = KeysView<half>::hf(nullptr, 0, 1, 3, 0, d));
  REQUIRE_NOTHROW(KeysView<float>(nullptr, 3, 0, d, 0, d));
  CHECK(v.empty());
  for_each_scorer(3, d, 4, [&](const char* name, const auto& scorer) {
    INFO(name);
    Scores s;
    REQUIRE_NOTHROW(s = scorer.score(v));
    CHECK(s.heads() == 3);
    CHECK(s.values().empty());
  });
}

// ------------------------------------------------------------------ error paths

TEST_CASE("score(keys, out) rejects an output of the wrong shape", "[properties]") {
  const Cache c = random_cache(91, 2, 10, 8);
  const std::vector<float> keys = c.v;
  const auto v = view_of(keys, c);
  std::vector<float> buf(64, 123.f);
  for_each_scorer(2, 8, 4, [&](const char* name, const auto& scorer) {
    INFO(name);
    CHECK_THROWS_AS(scorer.score(v, ScoresView(buf.data(), 3, 10)), std::invalid_argument);
    CHECK_THROWS_AS(scorer.score(v, ScoresView(buf.data(), 2, 9)), std::invalid_argument);
    CHECK_THROWS_AS(scorer.score(v, ScoresView(buf.data(), 2, 11)), std::invalid_argument);
    CHECK_THROWS_AS(scorer.score(v, ScoresView(buf.data(), 1, 20)), std::invalid_argument);
    CHECK_THROWS_AS(scorer.score(v, ScoresView()), std::invalid_argument);
    // Nothing was written before the check.
    CHECK(std::all_of(buf.begin(), buf.end(), [](float x) { return x == 123.f; }));
  });
}

// ------------------------------------------------------------------ determinism

TEMPLATE_TEST_CASE("Scores are bit-identical for any num_threads and across runs", "[properties]", float, half,
                   bfloat16) {
  // Enough heads for the threads to split them, and more than 512 tokens so the chunked
  // second pass and several 64-row sum blocks are exercised.
  const std::int64_t H = 8, N = 700, d = 64;
  Cache c = random_cache(123, H, N, d, 1.f);
  poison(c.row(2, 100), d, Bad::nan);
  const std::vector<TestType> keys = c.as<TestType>();
  const auto v = view_of(keys, c);
  for_each_scorer(H, d, 128, [&](const char* name, auto scorer) {
    for (const auto* isa : kvscore::simd::available_tables()) {
      INFO(name << ", " << tname<TestType>() << ", isa " << isa->name);
      scorer.isa = isa;
      scorer.num_threads = 1;
      const Scores ref = scorer.score(v);
      const Scores again = scorer.score(v);
      REQUIRE(ref.values().size() == std::size_t(H * N));
      CHECK(std::memcmp(ref.data(), again.data(), sizeof(float) * ref.values().size()) == 0);
      for (int nt : {2, 4, 0}) {
        CAPTURE(nt);
        scorer.num_threads = nt;
        const Scores s = scorer.score(v);
        CHECK(std::memcmp(ref.data(), s.data(), sizeof(float) * ref.values().size()) == 0);
      }
    }
  });
}
