// Block-sparse decode over a token-major cell cache (kvscore/block_sparse/cells.hpp, llama.cpp's K
// layout): CellBlockSelector equal to cell_block_reference on f32 / f16 / q8_0 keys across steps
// (cells filled a few at a time, blocks summarised once, removals and rewrites), the exact choice
// against a brute force written here (dequantised independently, softmax shares, top k), a
// planted block found by the int4 default, sinks / newest / non-full blocks always in, attend = 1
// selecting every visible cell, and every error naming its value.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/block_sparse/cells.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using kvscore::BlockScore;
using kvscore::BlockSparseOptions;
using kvscore::CellBlockSelector;
using kvscore::CellKeys;
using kvscore::CellKeyType;
using kvscore::kCellBlockSize;
using test_support::error_of;

constexpr std::int64_t kKvHeads = 2, kQHeads = 6, kDim = 64, kRow = kKvHeads * kDim;

std::vector<float> normal(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> N(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = N(g);
  return v;
}

/// A cell cache of `cells` rows in one of the types, written from fp32 rows; `value(c, i)` the
/// stored value dequantised here (not by the library).
struct Cache {
  CellKeyType type;
  std::int64_t cells;
  std::vector<std::uint8_t> bytes;
  std::int64_t row_bytes() const {
    return type == CellKeyType::f32 ? 4 * kRow : type == CellKeyType::f16 ? 2 * kRow : kRow / 32 * 34;
  }
  Cache(CellKeyType t, std::int64_t n) : type(t), cells(n), bytes(std::size_t(n * row_bytes()), 0) {}
  CellKeys keys() const { return {type, bytes.data(), cells, kKvHeads, kDim, 0}; }
  void put(std::int64_t c, const float* x) {
    std::uint8_t* r = bytes.data() + c * row_bytes();
    if (type == CellKeyType::f32) {
      std::memcpy(r, x, std::size_t(4 * kRow));
    } else if (type == CellKeyType::f16) {
      for (std::int64_t i = 0; i < kRow; ++i) {
        const std::uint16_t h = kvscore::float_to_half_bits(x[i]);
        std::memcpy(r + 2 * i, &h, 2);
      }
    } else {  // ggml's quantize_row_q8_0_ref: d = amax / 127, q = round(x / d)
      for (std::int64_t b = 0; b < kRow / 32; ++b) {
        float amax = 0;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b * 32 + i]));
        const float d = amax / 127.f, id = d != 0 ? 1.f / d : 0.f;
        const std::uint16_t h = kvscore::float_to_half_bits(d);
        std::memcpy(r + b * 34, &h, 2);
        for (int i = 0; i < 32; ++i) r[b * 34 + 2 + i] = std::uint8_t(std::int8_t(std::lround(x[b * 32 + i] * id)));
      }
    }
  }
  float value(std::int64_t c, std::int64_t i) const {
    const std::uint8_t* r = bytes.data() + c * row_bytes();
    if (type == CellKeyType::f32) {
      float v;
      std::memcpy(&v, r + 4 * i, 4);
      return v;
    }
    std::uint16_t h;
    if (type == CellKeyType::f16) {
      std::memcpy(&h, r + 2 * i, 2);
      return kvscore::half_bits_to_float(h);
    }
    std::memcpy(&h, r + (i / 32) * 34, 2);
    return kvscore::half_bits_to_float(h) * float(std::int8_t(r[(i / 32) * 34 + 2 + i % 32]));
  }
};

std::vector<std::int64_t> cells_of(const std::vector<std::uint8_t>& a) {
  std::vector<std::int64_t> v;
  for (std::size_t c = 0; c < a.size(); ++c)
    if (a[c]) v.push_back(std::int64_t(c));
  return v;
}

/// The exact choice by brute force: per query head the softmax over candidate blocks of
/// scale·max_t q·k_t, summed over heads; the top k (ties: lower block).
std::vector<std::int64_t> brute_exact(const Cache& cache, const float* q, const std::vector<std::int64_t>& cand,
                                      std::int64_t k) {
  const std::int64_t G = kQHeads / kKvHeads;
  std::vector<double> agg(cand.size(), 0.0);
  for (std::int64_t jq = 0; jq < kQHeads; ++jq) {
    const std::int64_t h = jq / G;
    std::vector<double> s(cand.size());
    for (std::size_t i = 0; i < cand.size(); ++i) {
      double best = -1e300;
      for (std::int64_t t = 0; t < kCellBlockSize; ++t) {
        double dot = 0;
        for (std::int64_t j = 0; j < kDim; ++j) dot += double(q[jq * kDim + j]) * cache.value(cand[i] * 32 + t, h * kDim + j);
        best = std::max(best, dot);
      }
      s[i] = best / std::sqrt(double(kDim));
    }
    const double m = *std::max_element(s.begin(), s.end());
    double z = 0;
    for (double& x : s) z += (x = std::exp(x - m));
    for (std::size_t i = 0; i < cand.size(); ++i) agg[i] += s[i] / z;
  }
  std::vector<std::size_t> order(cand.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return agg[a] > agg[b]; });
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < k; ++i) out.push_back(cand[order[std::size_t(i)]]);
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST_CASE("cell blocks: the selector equals the reference on f32, f16 and q8_0 as the cache fills", "[block_sparse][cells]") {
  const auto type = GENERATE(CellKeyType::f32, CellKeyType::f16, CellKeyType::q8_0);
  const auto score = GENERATE(BlockScore::int4, BlockScore::exact);
  CAPTURE(kvscore::to_string(type), kvscore::to_string(score));
  const std::int64_t cells = 30 * 32 + 7, layers = 2;
  Cache cache(type, cells);
  BlockSparseOptions o;
  o.score = score;
  o.sinks = 4;
  o.local = 40;
  o.num_threads = 1;
  CellBlockSelector sel(layers, cells, kKvHeads, kDim, o);
  std::vector<std::int32_t> pos(std::size_t(cells), -1);
  const std::vector<float> keys = normal(std::size_t(cells * kRow), 11);
  // a prefill of 600 cells, then steps of one cell; every 16th step checked (both layers)
  std::int64_t n = 0, checked = 0;
  auto write = [&](std::int64_t count) {
    std::vector<std::int64_t> w;
    for (std::int64_t i = 0; i < count; ++i, ++n) {
      cache.put(n, keys.data() + n * kRow);
      pos[std::size_t(n)] = std::int32_t(n);
      w.push_back(n);
    }
    sel.write(w);
    return w;
  };
  std::vector<std::int64_t> flight = write(600);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(cells));
  for (int step = 0; n < cells; ++step) {
    flight = write(1);
    if (step % 16) continue;
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::vector<float> q = normal(std::size_t(kQHeads * kDim), 1000 + std::uint64_t(step * 2 + l));
      const double attend = step % 32 ? 0.1 : 192.0;
      const std::int64_t got = sel.select(l, cache.keys(), pos, q.data(), kQHeads, attend, out);
      const std::vector<std::uint8_t> ref = kvscore::cell_block_reference(cache.keys(), pos, flight, q.data(), kQHeads, attend, o);
      REQUIRE(cells_of(out) == cells_of(ref));
      REQUIRE(got == std::int64_t(cells_of(out).size()));
      REQUIRE(got < n);  // sparse
      ++checked;
    }
  }
  CHECK(checked >= 40);
  // one summary per full block and layer: made once each (int4), none for exact
  if (score == BlockScore::int4) {
    CHECK(sel.summaries_made() > 0);
    CHECK(sel.summaries_made() <= layers * (cells / 32));
  } else {
    CHECK(sel.summaries_made() == 0);
  }
}

TEST_CASE("cell blocks: the exact choice is the brute force's, and int4 finds a planted block", "[block_sparse][cells]") {
  const auto type = GENERATE(CellKeyType::f32, CellKeyType::f16, CellKeyType::q8_0);
  CAPTURE(kvscore::to_string(type));
  const std::int64_t cells = 64 * 32;
  Cache cache(type, cells);
  const std::vector<float> keys = normal(std::size_t(cells * kRow), 5);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(cells));
  for (std::int64_t c = 0; c < cells; ++c) {
    cache.put(c, keys.data() + c * kRow);
    pos[std::size_t(c)] = std::int32_t(c);
  }
  const std::vector<float> q = normal(std::size_t(kQHeads * kDim), 77);
  BlockSparseOptions o;
  o.score = BlockScore::exact;
  o.sinks = 4;
  o.local = 64;
  const std::vector<std::int64_t> none;
  const auto got = cells_of(kvscore::cell_block_reference(cache.keys(), pos, none, q.data(), kQHeads, 0.25, o));
  // candidates: blocks 1 .. 61 (block 0 holds the sinks and competes too: 28 of its cells are open)
  std::vector<std::int64_t> cand;
  for (std::int64_t b = 0; b < 62; ++b) cand.push_back(b);
  // protected: 4 sinks + 64 newest (blocks 62, 63 whole) = 68 cells; target ⌈0.25·2048⌉ = 512 → ⌈444/32⌉ = 14 blocks
  const std::vector<std::int64_t> top = brute_exact(cache, q.data(), cand, 14);
  std::vector<std::int64_t> want;
  for (std::int64_t c = 0; c < 4; ++c) want.push_back(c);
  for (const std::int64_t b : top)
    for (std::int64_t c = b * 32; c < b * 32 + 32; ++c) want.push_back(c);
  for (std::int64_t c = cells - 64; c < cells; ++c) want.push_back(c);
  std::sort(want.begin(), want.end());
  want.erase(std::unique(want.begin(), want.end()), want.end());
  CHECK(got == want);

  // a block whose keys are the query heads' directions (×4): the int4 default attends it
  for (std::int64_t t = 0; t < 32; ++t) {
    std::vector<float> row(static_cast<std::size_t>(kRow));
    for (std::int64_t h = 0; h < kKvHeads; ++h)
      for (std::int64_t j = 0; j < kDim; ++j) row[std::size_t(h * kDim + j)] = 4.f * q[std::size_t((h * 3 + t % 3) * kDim + j)];
    cache.put(30 * 32 + t, row.data());
  }
  BlockSparseOptions i4;
  i4.sinks = 4;
  i4.local = 64;
  const auto a = kvscore::cell_block_reference(cache.keys(), pos, none, q.data(), kQHeads, 3 * 32 + 68, i4);
  for (std::int64_t c = 30 * 32; c < 31 * 32; ++c) CHECK(a[std::size_t(c)] == 1);
  CHECK(cells_of(a).size() <= 4 + 64 + 3 * 32);
}

TEST_CASE("cell blocks: sinks, newest and non-full blocks are always in, attend 1 is every visible cell",
          "[block_sparse][cells]") {
  const std::int64_t cells = 20 * 32;
  Cache cache(CellKeyType::f16, cells);
  const std::vector<float> keys = normal(std::size_t(cells * kRow), 9);
  // positions scattered over cells (an eviction leaves holes): cell c holds position 3c/2 unless c % 97 == 5 (empty)
  std::vector<std::int32_t> pos(std::size_t(cells), -1);
  for (std::int64_t c = 0; c < cells; ++c) {
    cache.put(c, keys.data() + c * kRow);
    if (c % 97 != 5) pos[std::size_t(c)] = std::int32_t(3 * c / 2);
  }
  BlockSparseOptions o;
  o.sinks = 6;
  o.local = 50;
  const std::vector<float> q = normal(std::size_t(kQHeads * kDim), 3);
  CellBlockSelector sel(1, cells, kKvHeads, kDim, o);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(cells));
  sel.select(0, cache.keys(), pos, q.data(), kQHeads, 0.05, out);
  std::vector<std::int32_t> vis;
  for (const std::int32_t p : pos)
    if (p >= 0) vis.push_back(p);
  std::sort(vis.begin(), vis.end(), std::greater<>());
  const std::int32_t newest_from = vis[49];
  for (std::int64_t c = 0; c < cells; ++c) {
    const std::int32_t p = pos[std::size_t(c)];
    if (p < 0) CHECK(out[std::size_t(c)] == 0);  // never an invisible cell
    if (p >= 0 && (p < 6 || p >= newest_from)) CHECK(out[std::size_t(c)] == 1);
    const std::int64_t b = c / 32;
    bool full = true;
    for (std::int64_t x = b * 32; x < b * 32 + 32; ++x) full &= pos[std::size_t(x)] >= 0;
    if (!full && p >= 0) CHECK(out[std::size_t(c)] == 1);  // a block with a hole is attended whole
  }
  // attended: protected + non-full + whole chosen blocks, fewer than all
  const auto n = cells_of(out).size();
  CHECK(n < vis.size());
  // attend = 1: every visible cell, exactly
  const std::int64_t all = sel.select(0, cache.keys(), pos, q.data(), kQHeads, 1.0, out);
  CHECK(all == std::int64_t(vis.size()));
  for (std::int64_t c = 0; c < cells; ++c) CHECK(out[std::size_t(c)] == std::uint8_t(pos[std::size_t(c)] >= 0));
  // a count at least the visible cells: all of them too
  CHECK(sel.select(0, cache.keys(), pos, q.data(), kQHeads, double(vis.size()), out) == std::int64_t(vis.size()));
}

TEST_CASE("cell blocks: removals and rewrites keep the summaries right", "[block_sparse][cells]") {
  const auto type = GENERATE(CellKeyType::f16, CellKeyType::q8_0);
  CAPTURE(kvscore::to_string(type));
  const std::int64_t cells = 30 * 32;
  Cache cache(type, cells);
  std::vector<float> keys = normal(std::size_t(cells * kRow), 21);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(cells));
  std::vector<std::int64_t> all(static_cast<std::size_t>(cells));
  for (std::int64_t c = 0; c < cells; ++c) {
    cache.put(c, keys.data() + c * kRow);
    pos[std::size_t(c)] = std::int32_t(c);
    all[std::size_t(c)] = c;
  }
  BlockSparseOptions o;  // int4
  o.sinks = 4;
  o.local = 32;
  CellBlockSelector sel(1, cells, kKvHeads, kDim, o);
  sel.write(all);
  const std::vector<std::int64_t> none;
  sel.write(none);  // nothing in flight
  std::vector<std::uint8_t> out(static_cast<std::size_t>(cells));
  const std::vector<float> q = normal(std::size_t(kQHeads * kDim), 8);
  auto same = [&](const std::vector<std::int64_t>& flight) {
    sel.select(0, cache.keys(), pos, q.data(), kQHeads, 0.2, out);
    return cells_of(out) == cells_of(kvscore::cell_block_reference(cache.keys(), pos, flight, q.data(), kQHeads, 0.2, o));
  };
  CHECK(same(none));
  const std::int64_t made = sel.summaries_made();
  CHECK(made == 29);  // blocks 0 .. 28 compete (block 0's cells after the sinks are open; 29 is the newest)
  // the query's best block now: plant its keys in block 12, rewrite the cells, tell the selector
  for (std::int64_t t = 0; t < 32; ++t) {
    std::vector<float> row(static_cast<std::size_t>(kRow));
    for (std::int64_t i = 0; i < kRow; ++i) row[std::size_t(i)] = 4.f * q[std::size_t(((i / kDim) * 3) * kDim + i % kDim)];
    cache.put(12 * 32 + t, row.data());
  }
  std::vector<std::int64_t> rewritten;
  for (std::int64_t c = 12 * 32; c < 13 * 32; ++c) rewritten.push_back(c);
  sel.write(rewritten);
  sel.write(none);
  CHECK(same(none));
  CHECK(sel.summaries_made() == made + 1);  // only block 12 made again
  for (std::int64_t c = 12 * 32; c < 13 * 32; ++c) CHECK(out[std::size_t(c)] == 1);
  // removal: cells 200..209 leave (block 6 not full: attended whole, its visible cells only)
  std::vector<std::int64_t> removed;
  for (std::int64_t c = 200; c < 210; ++c) pos[std::size_t(c)] = -1, removed.push_back(c);
  sel.write(removed);
  CHECK(same(removed));
  for (std::int64_t c = 192; c < 224; ++c) CHECK(out[std::size_t(c)] == std::uint8_t(c < 200 || c >= 210));
  // refilled with other keys at new positions: the block is full again, its summary made anew
  for (std::int64_t c = 200; c < 210; ++c) {
    const std::vector<float> r = normal(std::size_t(kRow), 900 + std::uint64_t(c));
    cache.put(c, r.data());
    pos[std::size_t(c)] = std::int32_t(cells + c);
  }
  sel.write(removed);
  sel.write(none);
  CHECK(same(none));
}

TEST_CASE("cell blocks: bad input throws naming the value", "[block_sparse][cells]") {
  const std::int64_t cells = 128;
  Cache cache(CellKeyType::f16, cells);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(cells));
  std::iota(pos.begin(), pos.end(), 0);
  const std::vector<float> q(std::size_t(kQHeads * kDim), 0.5f);
  std::vector<std::uint8_t> out(static_cast<std::size_t>(cells));
  CellBlockSelector sel(2, cells, kKvHeads, kDim);
  auto sel_err = [&](double attend) {
    return error_of([&] { sel.select(0, cache.keys(), pos, q.data(), kQHeads, attend, out); });
  };
  CHECK_THAT(sel_err(0.0), Catch::Contains("attend 0.000000 must be a fraction in (0, 1]"));
  CHECK_THAT(sel_err(1.5), Catch::Contains("attend 1.500000"));
  CHECK_THAT(sel_err(-2), Catch::Contains("attend -2.000000"));
  CHECK_THAT(error_of([&] { sel.select(2, cache.keys(), pos, q.data(), kQHeads, 0.5, out); }),
             Catch::Contains("layer 2 out of range [0, 2)"));
  CHECK_THAT(error_of([&] { sel.select(0, cache.keys(), pos, q.data(), 5, 0.5, out); }),
             Catch::Contains("q_heads 5 must be a positive multiple of kv_heads 2"));
  const std::vector<std::int32_t> short_pos(10, 0);
  CHECK_THAT(error_of([&] { sel.select(0, cache.keys(), short_pos, q.data(), kQHeads, 0.5, out); }),
             Catch::Contains("pos has 10 entries for 128 cells"));
  std::vector<std::uint8_t> small(3);
  CHECK_THAT(error_of([&] { sel.select(0, cache.keys(), pos, q.data(), kQHeads, 0.5, small); }),
             Catch::Contains("out has 3 entries for 128 cells"));
  std::vector<float> bad = q;
  bad[7] = NAN;
  CHECK_THAT(error_of([&] { sel.select(0, cache.keys(), pos, bad.data(), kQHeads, 0.5, out); }),
             Catch::Contains("query element 7 is not finite"));
  CellKeys k = cache.keys();
  k.row_bytes = 10;
  CHECK_THAT(error_of([&] { sel.select(0, k, pos, q.data(), kQHeads, 0.5, out); }),
             Catch::Contains("row_bytes 10 is less than a f16 row of 128 values (256 bytes)"));
  k = cache.keys();
  k.cells = 64;
  const std::vector<std::int32_t> pos64(64, 0);
  CHECK_THAT(error_of([&] { sel.select(0, k, pos64, q.data(), kQHeads, 0.5, out); }),
             Catch::Contains("(cells, kv_heads, head_dim) = (64, 2, 64) differ from the selector's (128, 2, 64)"));
  const std::vector<std::int64_t> past{3, 128};
  CHECK_THAT(error_of([&] { sel.write(past); }), Catch::Contains("cell 128 at 1 is past the cache's 128 cells"));
  BlockSparseOptions p;
  p.score = BlockScore::pariskv;
  CHECK_THAT(error_of([&] { CellBlockSelector(1, cells, kKvHeads, kDim, p); }), Catch::Contains("score pariskv"));
  BlockSparseOptions neg;
  neg.local = -3;
  CHECK_THAT(error_of([&] { CellBlockSelector(1, cells, kKvHeads, kDim, neg); }), Catch::Contains("local must be >= 0 (got -3)"));
  CHECK_THAT(error_of([&] { CellBlockSelector(1, 0, kKvHeads, kDim); }), Catch::Contains("cells must be >= 1 (got 0)"));
  CellKeys q8{CellKeyType::q8_0, cache.bytes.data(), cells, 1, 40, 0};
  CHECK_THAT(error_of([&] { (void)kvscore::cell_block_reference(q8, pos, {}, q.data(), 3, 0.5); }),
             Catch::Contains("q8_0 rows need kv_heads·head_dim a multiple of 32 (got 40)"));
  CHECK_THAT(error_of([] { (void)kvscore::parse_cell_key_type("q4_0"); }), Catch::Contains("q4_0"));
}
