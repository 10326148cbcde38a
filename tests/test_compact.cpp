// kvscore::compact: in-place gather of kept rows, per layout (HF with capacity, token-major,
// general strides) and dtype, against a naive copy made from the original buffer; error paths
// and the no-write-on-error guarantee.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/compact.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using kvscore::bfloat16;
using kvscore::CompactOptions;
using kvscore::CompactTail;
using kvscore::half;
using kvscore::MutKeysView;
using kvscore::Selection;

/// Each head keeps a random subset; counts range over 0..tokens (ragged), with all-or-nothing cases.
Selection random_selection(std::int64_t heads, std::int64_t tokens, std::mt19937_64& rng) {
  Selection s;
  s.heads = heads;
  s.tokens = tokens;
  s.offsets.assign(1, 0);
  for (std::int64_t h = 0; h < heads; ++h) {
    const int mode = int(rng() % 6);
    std::vector<std::int64_t> all(static_cast<std::size_t>(tokens));
    std::iota(all.begin(), all.end(), 0);
    std::int64_t k = tokens == 0 ? 0 : std::int64_t(rng() % std::uint64_t(tokens + 1));
    if (mode == 0) k = 0;
    if (mode == 1) k = tokens;
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(std::size_t(k));
    std::sort(all.begin(), all.end());
    s.positions.insert(s.positions.end(), all.begin(), all.end());
    s.offsets.push_back(std::int64_t(s.positions.size()));
  }
  return s;
}

Selection uniform_selection(std::int64_t heads, std::int64_t tokens, const std::vector<std::int64_t>& keep) {
  Selection s;
  s.heads = heads;
  s.tokens = tokens;
  for (std::int64_t h = 0; h < heads; ++h) {
    s.positions.insert(s.positions.end(), keep.begin(), keep.end());
    s.offsets.push_back(std::int64_t(s.positions.size()));
  }
  return s;
}

/// The expected buffer after compacting `v` (same geometry as `v`, over `before`).
template <class T>
std::vector<T> naive_compact(const std::vector<T>& before, const MutKeysView<T>& v, const Selection& s,
                             CompactTail tail) {
  std::vector<T> out = before;  // v.data() is before's first element
  auto off = [&](std::int64_t h, std::int64_t t) { return std::size_t(h * v.head_stride() + t * v.token_stride()); };
  for (std::int64_t h = 0; h < s.heads; ++h) {
    const auto keep = s.head(h);
    for (std::size_t i = 0; i < keep.size(); ++i)
      std::memcpy(out.data() + off(h, std::int64_t(i)), before.data() + off(h, keep[i]),
                  std::size_t(v.head_dim()) * sizeof(T));
    if (tail == CompactTail::zero)
      for (std::int64_t t = std::int64_t(keep.size()); t < v.tokens(); ++t)
        std::memset(static_cast<void*>(out.data() + off(h, t)), 0, std::size_t(v.head_dim()) * sizeof(T));
  }
  return out;
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

using test_support::error_of;

}  // namespace

TEMPLATE_TEST_CASE("compact HF layout with capacity: random ragged selections vs a naive copy", "[compact]", float,
                   half, bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 300; ++iter) {
    const std::int64_t B = 1 + std::int64_t(rng() % 3), H = 1 + std::int64_t(rng() % 4);
    const std::int64_t S = std::int64_t(rng() % 40), cap = S + std::int64_t(rng() % 5), D = 1 + std::int64_t(rng() % 9);
    const std::int64_t b = std::int64_t(rng() % std::uint64_t(B));
    const CompactTail tail = (iter & 1) ? CompactTail::zero : CompactTail::keep;
    std::vector<T> layer = test_support::random_bits<T>(std::size_t(B * H * cap * D), rng);
    const std::vector<T> before = layer;
    const auto v = MutKeysView<T>::hf(layer.data(), b, B, H, S, D, cap);
    const Selection s = random_selection(H, S, rng);
    CompactOptions opts;
    opts.tail = tail;
    opts.num_threads = iter % 10 == 0 ? 2 : 0;  // 0: serial at these sizes
    const auto lengths = kvscore::compact(v, s, opts);
    REQUIRE(lengths.size() == std::size_t(H));
    for (std::int64_t h = 0; h < H; ++h) REQUIRE(lengths[std::size_t(h)] == s.kept(h));

    // reference on the whole layer: only batch row b's first S rows per head may change
    std::vector<T> expect = before;
    for (std::int64_t h = 0; h < H; ++h) {
      auto row = [&](std::int64_t t) { return std::size_t(((b * H + h) * cap + t) * D); };
      const auto keep = s.head(h);
      for (std::size_t i = 0; i < keep.size(); ++i)
        std::memcpy(expect.data() + row(std::int64_t(i)), before.data() + row(keep[i]), std::size_t(D) * sizeof(T));
      if (tail == CompactTail::zero)
        for (std::int64_t t = std::int64_t(keep.size()); t < S; ++t)
          std::memset(static_cast<void*>(expect.data() + row(t)), 0, std::size_t(D) * sizeof(T));
    }
    INFO("B=" << B << " H=" << H << " S=" << S << " cap=" << cap << " D=" << D << " b=" << b);
    REQUIRE(same_bits(layer, expect));
  }
}

TEMPLATE_TEST_CASE("compact token-major layout: ragged heads, each head's column compacted", "[compact]", float, half,
                   bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(12);
  for (int iter = 0; iter < 300; ++iter) {
    const std::int64_t N = std::int64_t(rng() % 40), H = 1 + std::int64_t(rng() % 5), D = 1 + std::int64_t(rng() % 9);
    const CompactTail tail = (iter & 1) ? CompactTail::zero : CompactTail::keep;
    std::vector<T> cache = test_support::random_bits<T>(std::size_t(N * H * D), rng);
    const std::vector<T> before = cache;
    const auto v = MutKeysView<T>::token_major(cache.data(), N, H, D);
    const Selection s = random_selection(H, N, rng);
    CompactOptions opts;
    opts.tail = tail;
    const auto lengths = kvscore::compact(v, s, opts);
    for (std::int64_t h = 0; h < H; ++h) REQUIRE(lengths[std::size_t(h)] == s.kept(h));
    REQUIRE(same_bits(cache, naive_compact(before, v, s, tail)));
  }
}

TEMPLATE_TEST_CASE("compact a general strided view with gaps between rows and heads", "[compact]", float, half,
                   bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(13);
  for (int iter = 0; iter < 100; ++iter) {
    const std::int64_t N = 1 + std::int64_t(rng() % 30), H = 1 + std::int64_t(rng() % 4), D = 1 + std::int64_t(rng() % 8);
    const std::int64_t ts = D + std::int64_t(rng() % 3), hs = N * ts + std::int64_t(rng() % 5);
    std::vector<T> buf = test_support::random_bits<T>(std::size_t(H * hs), rng);
    const std::vector<T> before = buf;
    const MutKeysView<T> v(buf.data(), H, N, D, hs, ts);
    const Selection s = random_selection(H, N, rng);
    kvscore::compact(v, s, CompactOptions{CompactTail::zero, false, 1});
    REQUIRE(same_bits(buf, naive_compact(before, v, s, CompactTail::zero)));  // gaps untouched
  }
}

TEMPLATE_TEST_CASE("compact K and V together (different head_dim), lengths to caller memory", "[compact]", float, half,
                   bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(14);
  for (int iter = 0; iter < 100; ++iter) {
    const std::int64_t N = std::int64_t(rng() % 33), H = 1 + std::int64_t(rng() % 4);
    const std::int64_t Dk = 1 + std::int64_t(rng() % 9), Dv = 1 + std::int64_t(rng() % 9);
    std::vector<T> k = test_support::random_bits<T>(std::size_t(N * H * Dk), rng), vv = test_support::random_bits<T>(std::size_t(N * H * Dv), rng);
    const std::vector<T> k0 = k, v0 = vv;
    const bool token_major = iter & 1;
    const auto kv = token_major ? MutKeysView<T>::token_major(k.data(), N, H, Dk)
                                : MutKeysView<T>::hf(k.data(), 0, 1, H, N, Dk);
    const auto vvv = token_major ? MutKeysView<T>::token_major(vv.data(), N, H, Dv)
                                 : MutKeysView<T>::hf(vv.data(), 0, 1, H, N, Dv);
    const Selection s = random_selection(H, N, rng);
    std::vector<std::int64_t> lengths(std::size_t(H), -1);
    kvscore::compact(kv, vvv, s, std::span<std::int64_t>(lengths));
    for (std::int64_t h = 0; h < H; ++h) REQUIRE(lengths[std::size_t(h)] == s.kept(h));
    REQUIRE(same_bits(k, naive_compact(k0, kv, s, CompactTail::keep)));
    REQUIRE(same_bits(vv, naive_compact(v0, vvv, s, CompactTail::keep)));
  }
}

TEST_CASE("compact: empty selection, keep-all, empty caches", "[compact]") {
  const std::int64_t H = 3, N = 10, D = 4;
  std::mt19937_64 rng(15);
  std::vector<half> cache = test_support::random_bits<half>(std::size_t(H * N * D), rng);
  const std::vector<half> before = cache;
  const auto v = MutKeysView<half>::token_major(cache.data(), N, H, D);

  std::vector<std::int64_t> all(N);
  std::iota(all.begin(), all.end(), 0);
  auto lengths = kvscore::compact(v, uniform_selection(H, N, all), CompactOptions{CompactTail::zero, true, 0});
  REQUIRE(lengths == std::vector<std::int64_t>(H, N));
  REQUIRE(same_bits(cache, before));  // keep-all is the identity, even with zero tails

  lengths = kvscore::compact(v, uniform_selection(H, N, {}));
  REQUIRE(lengths == std::vector<std::int64_t>(H, 0));
  REQUIRE(same_bits(cache, before));  // CompactTail::keep: nothing moves
  lengths = kvscore::compact(v, uniform_selection(H, N, {}), CompactOptions{CompactTail::zero});
  REQUIRE(std::all_of(cache.begin(), cache.end(), [](half x) { return x.bits == 0; }));

  // a cache with no tokens, or no heads, needs no data
  REQUIRE(kvscore::compact(MutKeysView<float>(nullptr, 2, 0, 8, 0, 8), uniform_selection(2, 0, {})) ==
          std::vector<std::int64_t>{0, 0});
  REQUIRE(kvscore::compact(MutKeysView<float>(nullptr, 0, 5, 8, 0, 8), Selection{0, 5, {0}, {}}).empty());
}

TEST_CASE("compact: a single kept row at the end moves to the front - adjacent runs overlap", "[compact]") {
  // HF layout, one head: rows 2..8 move to 0..6 (overlapping memmove)
  const std::int64_t N = 10, D = 3;
  std::vector<float> c(std::size_t(N * D));
  for (std::size_t i = 0; i < c.size(); ++i) c[i] = float(i);
  const auto v = MutKeysView<float>::hf(c.data(), 0, 1, 1, N, D);
  kvscore::compact(v, uniform_selection(1, N, {2, 3, 4, 5, 6, 7, 8}));
  for (std::int64_t i = 0; i < 7; ++i)
    for (std::int64_t j = 0; j < D; ++j) REQUIRE(c[std::size_t(i * D + j)] == float((i + 2) * D + j));
  kvscore::compact(v, uniform_selection(1, N, {9}));
  REQUIRE(c[0] == 27.f);
  REQUIRE(c[2] == 29.f);
}

TEST_CASE("compact: bad selections and views throw std::invalid_argument naming the value - nothing is written",
          "[compact][errors]") {
  const std::int64_t H = 4, N = 16, D = 8;
  std::mt19937_64 rng(16);
  std::vector<float> k = test_support::random_bits<float>(std::size_t(H * N * D), rng), val = test_support::random_bits<float>(std::size_t(H * N * D), rng);
  const std::vector<float> k0 = k, v0 = val;
  const auto kv = MutKeysView<float>::hf(k.data(), 0, 1, H, N, D);
  const auto vv = MutKeysView<float>::hf(val.data(), 0, 1, H, N, D);
  const Selection good = uniform_selection(H, N, {1, 5, 9});

  auto sel_with = [&](auto&& edit) {
    Selection s = good;
    edit(s);
    return s;
  };
  CHECK_THAT(error_of([&] { kvscore::compact(kv, uniform_selection(3, N, {1})); }),
             Catch::Contains("3 heads") && Catch::Contains("4"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, uniform_selection(H, 20, {1})); }),
             Catch::Contains("20 tokens") && Catch::Contains("16"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.positions[4] = 16; })); }),
             Catch::Contains("position 16") && Catch::Contains("head 1"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.positions[4] = -1; })); }),
             Catch::Contains("position -1"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.positions[8] = 5; })); }),
             Catch::Contains("ascending") && Catch::Contains("5 after 5") && Catch::Contains("head 2"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.offsets.pop_back(); })); }),
             Catch::Contains("offsets has 4 entries"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.offsets[2] = 2; })); }),
             Catch::Contains("decrease at head 1 (3 > 2)"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.offsets[0] = 1; })); }),
             Catch::Contains("offsets[0] = 1"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, sel_with([](Selection& s) { s.positions.push_back(3); })); }),
             Catch::Contains("13 entries"));
  // K and V must agree
  const auto v_short = MutKeysView<float>::hf(val.data(), 0, 1, H, N - 1, D);
  CHECK_THAT(error_of([&] { kvscore::compact(kv, v_short, good); }),
             Catch::Contains("15 tokens") && Catch::Contains("differ"));
  const auto v_heads = MutKeysView<float>::hf(val.data(), 0, 1, H - 1, N, D);
  CHECK_THAT(error_of([&] { kvscore::compact(kv, v_heads, good); }), Catch::Contains("3 heads"));
  CHECK_THAT(error_of([&] { kvscore::compact(kv, kv, good); }), Catch::Contains("same memory"));
  std::vector<std::int64_t> three(3);
  CHECK_THAT(error_of([&] { kvscore::compact(kv, good, std::span<std::int64_t>(three)); }),
             Catch::Contains("new_lengths has 3 entries") && Catch::Contains("4"));
  Selection ragged = good;
  ragged.positions.erase(ragged.positions.begin() + 3);  // head 1 keeps 2
  for (std::size_t h = 2; h < ragged.offsets.size(); ++h) --ragged.offsets[h];
  CompactOptions eq;
  eq.require_equal_lengths = true;
  CHECK_THAT(error_of([&] { kvscore::compact(kv, vv, ragged, eq); }),
             Catch::Contains("head 1 keeps 2") && Catch::Contains("head 0 keeps 3"));
  // a bad position in the last head: neither K nor V was touched
  CHECK_THAT(error_of([&] { kvscore::compact(kv, vv, sel_with([](Selection& s) { s.positions.back() = 99; })); }),
             Catch::Contains("99"));
  REQUIRE(same_bits(k, k0));
  REQUIRE(same_bits(val, v0));
  // the mutable view validates exactly like KeysView
  CHECK_THAT(error_of([&] { MutKeysView<float>(k.data(), 2, 4, 8, 32, 4); }), Catch::Contains("token_stride 4"));
  CHECK_THAT(error_of([&] { MutKeysView<float>::hf(k.data(), 1, 1, 1, 4, 8); }), Catch::Contains("batch_index 1"));
  // and the good selection still works afterwards
  REQUIRE(kvscore::compact(kv, vv, good, eq) == std::vector<std::int64_t>(H, 3));
}

TEST_CASE("compact: results do not depend on the thread count", "[compact]") {
  std::mt19937_64 rng(17);
  const std::int64_t N = 257, H = 8, D = 64;
  const std::vector<bfloat16> orig = test_support::random_bits<bfloat16>(std::size_t(N * H * D), rng);
  const Selection s = random_selection(H, N, rng);
  std::vector<bfloat16> a = orig, b = orig;
  kvscore::compact(MutKeysView<bfloat16>::token_major(a.data(), N, H, D), s, CompactOptions{CompactTail::zero, false, 1});
  kvscore::compact(MutKeysView<bfloat16>::token_major(b.data(), N, H, D), s, CompactOptions{CompactTail::zero, false, 4});
  REQUIRE(same_bits(a, b));
}
