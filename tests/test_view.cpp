// KeysView / ScoresView construction: engine layouts map without copies, bad shapes throw.
#include <catch2/catch.hpp>

#include <stdexcept>
#include <type_traits>
#include <vector>

#include "kvscore/core/view.hpp"

using kvscore::KeysView;

TEST_CASE("HF layout [batch, kv_heads, seq, head_dim]: rows point into the cache", "[view]") {
  const std::int64_t B = 2, H = 3, S = 5, D = 4, cap = 7;
  std::vector<float> cache(std::size_t(B * H * cap * D));
  for (std::size_t i = 0; i < cache.size(); ++i) cache[i] = float(i);
  const auto v = KeysView<float>::hf(cache.data(), 1, B, H, S, D, cap);
  REQUIRE(v.heads() == H);
  REQUIRE(v.tokens() == S);
  REQUIRE(v.head_dim() == D);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < S; ++t)
      REQUIRE(v.row(h, t) == cache.data() + ((1 * H + h) * cap + t) * D);
  const auto s = v.tokens_slice(2, 4);
  REQUIRE(s.tokens() == 2);
  REQUIRE(s.row(1, 0) == v.row(1, 2));
}

TEST_CASE("token-major layout [tokens, kv_heads, head_dim]", "[view]") {
  const std::int64_t N = 6, H = 2, D = 8;
  std::vector<kvscore::half> cache(std::size_t(N * H * D));
  const auto v = KeysView<kvscore::half>::token_major(cache.data(), N, H, D);
  REQUIRE(v.head_stride() == D);
  REQUIRE(v.token_stride() == H * D);
  REQUIRE(v.row(1, 3) == cache.data() + (3 * H + 1) * D);
}

TEST_CASE("bad views throw std::invalid_argument naming the value", "[view][errors]") {
  std::vector<float> buf(1024);
  auto msg = [](auto&& f) {
    try { f(); } catch (const std::invalid_argument& e) { return std::string(e.what()); }
    return std::string("no throw");
  };
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 2, 4, 0, 32, 8); }), Catch::Contains("head_dim") && Catch::Contains("got 0"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 1, 4, 5000, 0, 5000); }), Catch::Contains("5000"));
  CHECK_THAT(msg([&] { KeysView<float>(nullptr, 2, 4, 8, 32, 8); }), Catch::Contains("null"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 2, 4, 8, -32, 8); }), Catch::Contains("-32"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 2, 4, 8, 32, -8); }), Catch::Contains("-8"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 2, 4, 8, 32, 4); }), Catch::Contains("overlap") && Catch::Contains("token_stride 4"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 2, 4, 8, 16, 8); }), Catch::Contains("head_stride 16"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), -1, 4, 8, 32, 8); }), Catch::Contains("-1"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 3, 4, 8, std::int64_t(1) << 62, 8); }), Catch::Contains("overflow"));
  CHECK_THAT(msg([&] { KeysView<float>::hf(buf.data(), 2, 2, 1, 4, 8); }), Catch::Contains("batch_index 2"));
  CHECK_THAT(msg([&] { KeysView<float>::hf(buf.data(), 0, 1, 1, 9, 8, 4); }), Catch::Contains("capacity 4"));
  CHECK_THAT(msg([&] { KeysView<float>(buf.data(), 1, 4, 8, 0, 8).tokens_slice(3, 9); }), Catch::Contains("9"));
  CHECK_THAT(msg([&] { kvscore::ScoresView(buf.data(), 2, 10, 5); }), Catch::Contains("head_stride 5"));
  CHECK_THAT(msg([&] { kvscore::ScoresView(nullptr, 2, 10); }), Catch::Contains("null"));
}

TEST_CASE("degenerate but valid views", "[view]") {
  // empty caches and single-row views need no data; zero strides are fine when the extent is 1
  REQUIRE(KeysView<float>(nullptr, 0, 5, 8, 0, 8).empty());
  REQUIRE(KeysView<float>(nullptr, 4, 0, 8, 0, 0).empty());
  float one[8] = {};
  REQUIRE_NOTHROW(KeysView<float>(one, 1, 1, 8, 0, 0));
}

TEST_CASE("fuzz findings F1/F3: no pointer is formed from an unchecked offset", "[view][errors]") {
  using Catch::Matchers::Contains;
  std::vector<float> buf(16, 1.f);
  const std::int64_t huge = std::int64_t(1) << 61;
  // F1a: a view with 0 heads never checks its strides; slicing it must not offset the pointer.
  const kvscore::KeysView<float> no_heads(buf.data(), 0, 10, 4, 0, huge);
  const auto s0 = no_heads.tokens_slice(5, 10);
  CHECK(s0.tokens() == 5);
  CHECK(s0.data() == buf.data());
  // F1b: an empty slice at t0 == tokens lies one extent past the checked span.
  const kvscore::KeysView<float> v(buf.data(), 1, 4, 4, 16, 4);
  const auto e = v.tokens_slice(4, 4);
  CHECK(e.tokens() == 0);
  CHECK(e.empty());
  CHECK(v.tokens_slice(1, 3).data() == buf.data() + 4);
  // F1c: a span that fits int64 in elements but not in bytes is rejected at construction.
  CHECK_THROWS_WITH((kvscore::KeysView<float>(buf.data(), 1, 3, 1, 0, huge)), Contains("overflows int64"));
  CHECK_NOTHROW(kvscore::KeysView<float>(buf.data(), 1, 3, 1, 0, huge / 8));  // 2^59 elements = 2^61 bytes: fits
  // F3: hf() validates the shape before forming the batch pointer, and bounds the byte offset.
  CHECK_THROWS_WITH(kvscore::KeysView<float>::hf(buf.data(), 1, 2, -3, 4, 4), Contains("kv_heads must be >= 0 (got -3)"));
  CHECK_THROWS_WITH(kvscore::KeysView<float>::hf(buf.data(), 1, 2, 1, -4, 4), Contains("seq must be >= 0 (got -4)"));
  CHECK_THROWS_WITH(kvscore::KeysView<float>::hf(buf.data(), 1, 2, 1, 4, 0), Contains("head_dim must be in [1, 4096] (got 0)"));
  CHECK_THROWS_WITH(kvscore::KeysView<float>::hf(buf.data(), 1, 2, 1, 4, 4, huge), Contains("overflows int64"));
}

TEST_CASE("ConstScoresView: the read-only twin a ScoresView and a const Scores convert to", "[view]") {
  static_assert(std::is_convertible_v<kvscore::ScoresView, kvscore::ConstScoresView>);
  static_assert(!std::is_convertible_v<kvscore::ConstScoresView, kvscore::ScoresView>);
  static_assert(std::is_same_v<decltype(kvscore::ConstScoresView().data()), const float*>);
  std::vector<float> buf(2 * 8);
  const kvscore::ScoresView w(buf.data(), 2, 5, 8);
  const kvscore::ConstScoresView r = w;
  CHECK((r.data() == buf.data() && r.heads() == 2 && r.tokens() == 5 && r.head_stride() == 8));
  CHECK(r.head(1) == buf.data() + 8);
  const kvscore::Scores s(3, 4);
  CHECK(s.view().data() == s.data());
  CHECK_THROWS_WITH(kvscore::ConstScoresView(buf.data(), 2, 10, 5), Catch::Contains("ConstScoresView: head_stride 5"));
}
