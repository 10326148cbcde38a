// The decode-time compressor (include/kvscore/decoding.hpp) against a brute-force simulation
// of its rule: hold at most target + interval tokens, and when full keep the target best per
// head by the scorer (sinks/recent protected, ties to the lower position), in position order.
#include <catch2/catch.hpp>

#include <kvscore/decoding.hpp>
#include <kvscore/scorers/keydiff.hpp>
#include <kvscore/scorers/knorm.hpp>
#include <kvscore/synth.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

using kvscore::DecodingCompressor;
using kvscore::DecodingOptions;

namespace {

/// Brute force of the rule with K-norm scores (−‖k‖ in fp64; kept = the target largest, ties to
/// the lower position, the first `sinks` and last `recent` held rows always kept).
struct Reference {
  std::int64_t d, target, cap, sinks, recent;
  std::vector<std::vector<std::pair<std::int64_t, std::vector<float>>>> held;  // [head][row] = (pos, key)
  void append(const std::vector<float>& K, std::int64_t heads, std::int64_t n, std::int64_t first_pos) {
    held.resize(std::size_t(heads));
    for (std::int64_t t = 0; t < n; ++t) {
      for (std::int64_t h = 0; h < heads; ++h)
        held[std::size_t(h)].push_back(
            {first_pos + t, std::vector<float>(K.begin() + (h * n + t) * d, K.begin() + (h * n + t + 1) * d)});
      if (std::int64_t(held[0].size()) == cap)
        for (auto& rows : held) compress(rows);
    }
  }
  void compress(std::vector<std::pair<std::int64_t, std::vector<float>>>& rows) const {
    const std::int64_t L = std::int64_t(rows.size());
    std::vector<std::pair<double, std::int64_t>> s;  // (−score, index): sorts best first, ties low index
    std::vector<char> keep(static_cast<std::size_t>(L), 0);
    std::int64_t forced = 0;
    for (std::int64_t i = 0; i < L; ++i) {
      if (i < sinks || i >= L - recent) {
        keep[std::size_t(i)] = 1;
        ++forced;
        continue;
      }
      double sq = 0;
      for (float x : rows[std::size_t(i)].second) sq += double(x) * x;
      s.push_back({std::sqrt(sq), i});  // score −‖k‖: the largest score is the smallest norm
    }
    std::sort(s.begin(), s.end());
    for (std::int64_t i = 0; i < target - forced; ++i) keep[std::size_t(s[std::size_t(i)].second)] = 1;
    std::vector<std::pair<std::int64_t, std::vector<float>>> out;
    for (std::int64_t i = 0; i < L; ++i)
      if (keep[std::size_t(i)]) out.push_back(rows[std::size_t(i)]);
    rows = std::move(out);
  }
};

std::vector<float> uniform(std::size_t n, std::uint64_t seed) {
  kvscore::detail::SplitMix64 rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = float(rng.uniform_nonzero() * 2.0 - 1.0);
  return v;
}

}  // namespace

TEST_CASE("decoding: K-norm compressor equals the brute-force rule step by step", "[decoding]") {
  const std::int64_t H = 3, d = 16, N = 700;
  for (auto [sinks, recent] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {2, 5}}) {
    INFO("sinks " << sinks << " recent " << recent);
    DecodingOptions o;
    o.target = 20;
    o.interval = 8;
    o.select.sinks = sinks;
    o.select.recent = recent;
    DecodingCompressor<float, kvscore::KNorm> dc(H, d, kvscore::KNorm{}, o);
    Reference ref{d, 20, 28, sinks, recent, {}};
    const auto K = uniform(std::size_t(H * N * d), 1), V = uniform(std::size_t(H * N * d), 2);
    for (std::int64_t t = 0; t < N; ++t) {
      std::vector<float> k(static_cast<std::size_t>(H * d)), v(static_cast<std::size_t>(H * d));
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t j = 0; j < d; ++j) {
          k[std::size_t(h * d + j)] = K[std::size_t((h * N + t) * d + j)];
          v[std::size_t(h * d + j)] = V[std::size_t((h * N + t) * d + j)];
        }
      dc.append(k.data(), v.data(), 1);
      ref.append(k, H, 1, t);
      REQUIRE(dc.length() <= 28);
      REQUIRE(dc.length() == std::int64_t(ref.held[0].size()));
      for (std::int64_t h = 0; h < H; ++h) {
        const auto pos = dc.positions(h);
        for (std::int64_t i = 0; i < dc.length(); ++i) {
          REQUIRE(pos[std::size_t(i)] == ref.held[std::size_t(h)][std::size_t(i)].first);
          // the rows moved with their positions: key and value of the original token
          const std::int64_t p = pos[std::size_t(i)];
          CHECK(dc.key_view().row(h, i)[3] == K[std::size_t((h * N + p) * d + 3)]);
          CHECK(dc.value_view().row(h, i)[5] == V[std::size_t((h * N + p) * d + 5)]);
        }
      }
    }
    CHECK(dc.appended() == N);
    CHECK(dc.compressions() == (N - 28) / 8 + 1);
    CHECK(dc.memory_bytes() == std::size_t(2 * H * 28 * d) * sizeof(float) + std::size_t(H * 28) * 8);
  }
}

TEST_CASE("decoding: one big append equals token-by-token appends", "[decoding]") {
  const std::int64_t H = 2, d = 8, N = 333;
  DecodingOptions o;
  o.target = 40;
  o.interval = 16;
  const auto K = uniform(std::size_t(H * N * d), 3), V = uniform(std::size_t(H * N * d), 4);
  DecodingCompressor<float, kvscore::KeyDiff> a(H, d, kvscore::KeyDiff{}, o), b(H, d, kvscore::KeyDiff{}, o);
  a.append(K.data(), V.data(), N);
  for (std::int64_t t = 0; t < N; ++t) {
    std::vector<float> k, v;
    for (std::int64_t h = 0; h < H; ++h) {
      k.insert(k.end(), K.begin() + (h * N + t) * d, K.begin() + (h * N + t + 1) * d);
      v.insert(v.end(), V.begin() + (h * N + t) * d, V.begin() + (h * N + t + 1) * d);
    }
    b.append(k.data(), v.data(), 1);
  }
  REQUIRE(a.length() == b.length());
  for (std::int64_t h = 0; h < H; ++h) {
    const auto pa = a.positions(h), pb = b.positions(h);
    CHECK(std::vector<std::int64_t>(pa.begin(), pa.end()) == std::vector<std::int64_t>(pb.begin(), pb.end()));
  }
}

TEST_CASE("decoding: 64K steps on drifting keys stay bounded and match the rule", "[decoding][drift]") {
  const std::int64_t tokens = 65536;
  const auto D = test_support::drift_head(tokens, 32, 8);
  DecodingOptions o;
  o.target = 512;
  o.interval = 128;
  o.select.sinks = 4;
  DecodingCompressor<float, kvscore::KNorm> dc(1, 32, kvscore::KNorm{}, o);
  Reference ref{32, 512, 640, 4, 0, {}};
  for (std::int64_t t = 0; t < tokens; ++t) {
    dc.append(D.keys.data() + t * 32, D.values.data() + t * 32, 1);
    REQUIRE(dc.length() <= 640);
  }
  ref.append(D.keys, 1, tokens, 0);
  const auto pos = dc.positions(0);
  REQUIRE(dc.length() == std::int64_t(ref.held[0].size()));
  std::int64_t same = 0;
  for (std::int64_t i = 0; i < dc.length(); ++i) same += pos[std::size_t(i)] == ref.held[0][std::size_t(i)].first;
  CHECK(same == dc.length());
  for (std::int64_t i = 0; i < 4; ++i) CHECK(pos[std::size_t(i)] == i);  // sinks survive 500 compressions
  CHECK(dc.compressions() == (65536 - 640) / 128 + 1);
}

TEST_CASE("decoding: bad options and rows are rejected by name", "[decoding][errors]") {
  DecodingOptions o;
  o.target = 0;
  CHECK_THROWS_WITH((DecodingCompressor<float, kvscore::KNorm>(1, 8, {}, o)), Catch::Contains("target must be >= 1 (got 0)"));
  o = {};
  o.interval = -3;
  CHECK_THROWS_WITH((DecodingCompressor<float, kvscore::KNorm>(1, 8, {}, o)), Catch::Contains("interval"));
  o = {};
  o.target = 10;
  o.select.sinks = 8;
  o.select.recent = 8;
  CHECK_THROWS_WITH((DecodingCompressor<float, kvscore::KNorm>(1, 8, {}, o)), Catch::Contains("sinks + recent must be <= target"));
  o = {};
  o.select.alloc = kvscore::Alloc::adakv;
  CHECK_THROWS_WITH((DecodingCompressor<float, kvscore::KNorm>(1, 8, {}, o)), Catch::Contains("per_head"));
  DecodingCompressor<float, kvscore::KNorm> dc(2, 4, {}, {});
  std::vector<float> k(16, 1.f), v(16, 1.f);
  k[13] = std::nanf("");  // head 1, token 1 of a 2-token append
  CHECK_THROWS_WITH(dc.append(k.data(), v.data(), 2), Catch::Contains("key of head 1, token 1"));
  CHECK(dc.appended() == 0);
  CHECK_THROWS_WITH(dc.positions(2), Catch::Contains("head 2 out of range"));
}
