// Block-sparse decode (kvscore/block_sparse.hpp): the four block scores against brute force
// (Quest's bound never below the exact block maximum; meanstd's mean and spread in double; the
// exact maximum), the budget rule, the reference choice on planted blocks and ties, and
// PagedBlockSelector over paged pools (vLLM CPU's transposed layout and NHD; fp32/fp16/bf16)
// equal to the reference on the same keys across steps, block reuse and thread counts; every
// error.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/block_sparse.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <tuple>
#include <vector>

namespace {

using kvscore::BlockScore;
using kvscore::BlockSparseOptions;
using kvscore::BlockSparseRow;
using kvscore::PagedBlockSelector;
using test_support::error_of;

std::vector<float> normal(std::size_t n, std::uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> N(0.f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = N(g);
  return v;
}

// ------------------------------------------------------------------ formulas

TEST_CASE("block scores: names both ways, Quest's bound, meanstd and exact against brute force", "[block_sparse]") {
  for (BlockScore s : kvscore::kBlockScores) CHECK(kvscore::parse_block_score(kvscore::to_string(s)) == s);
  for (auto g : kvscore::kQueryGroups) CHECK(kvscore::parse_query_group(kvscore::to_string(g)) == g);
  CHECK(error_of([] { kvscore::parse_block_score("minmax"); }) ==
        "kvscore: block score 'minmax' must be 'quest', 'meanstd', 'int4', 'pariskv' or 'exact'");

  // E[max of n standard normals]: 1/√π at 2, 3/(2√π) at 3 (closed forms), 0 at 1
  CHECK(kvscore::detail::expected_max_normal(1) == 0.0);
  CHECK(kvscore::detail::expected_max_normal(2) == Approx(1.0 / std::sqrt(M_PI)).epsilon(1e-7));
  CHECK(kvscore::detail::expected_max_normal(3) == Approx(1.5 / std::sqrt(M_PI)).epsilon(1e-7));
  CHECK(kvscore::detail::expected_max_normal(32) == Approx(2.0697).margin(5e-4));

  const std::int64_t n = 32, d = 64;
  std::vector<float> acc(n), a(d), b(d);
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    const auto keys = normal(std::size_t(n * d), seed, seed % 3 == 0 ? 0.01f : 1.f);  // some nearly equal keys
    const auto q = normal(std::size_t(d), 1000 + seed);
    const kvscore::detail::KeyTile<float> tile{keys.data(), d, 1};
    double best = -1e300;
    for (std::int64_t t = 0; t < n; ++t) {
      double s = 0;
      for (std::int64_t j = 0; j < d; ++j) s += double(q[j]) * keys[t * d + j];
      best = std::max(best, s);
    }
    const float exact = kvscore::detail::exact_tile_score(q.data(), tile, n, d, acc.data());
    CHECK(exact == Approx(best).margin(1e-4));
    kvscore::detail::summarize_tile(BlockScore::quest, tile, n, d, a.data(), b.data());
    const float quest = kvscore::detail::summary_score(BlockScore::quest, q.data(), a.data(), b.data(), d, 0.f);
    CHECK(quest >= exact - 1e-4f);  // an upper bound of the block's best key
    // meanstd: mean and population spread per dimension, in double
    kvscore::detail::summarize_tile(BlockScore::meanstd, tile, n, d, a.data(), b.data());
    double m = 0, var = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      double mu = 0, ss = 0;
      for (std::int64_t t = 0; t < n; ++t) mu += keys[t * d + j];
      mu /= double(n);
      for (std::int64_t t = 0; t < n; ++t) ss += (keys[t * d + j] - mu) * (keys[t * d + j] - mu);
      CHECK(a[j] == Approx(mu).margin(1e-6));
      CHECK(b[j] == Approx(std::sqrt(ss / double(n))).epsilon(1e-5).margin(1e-7));
      m += q[j] * mu;
      var += double(q[j]) * q[j] * (ss / double(n));
    }
    // int4: q·k̂ of the dequantised keys (double) and within Σ|q_j|·step_j/2 of the exact maximum
    std::vector<std::uint8_t> codes(std::size_t(kvscore::detail::int4_code_bytes(d, n)));
    std::vector<float> mn(d), st(d);
    kvscore::detail::summarize_tile(BlockScore::int4, tile, n, d, mn.data(), st.data(), codes.data());
    double best4 = -1e300, err = 0;
    for (std::int64_t j = 0; j < d; ++j) err += std::fabs(double(q[j])) * st[j] / 2;
    for (std::int64_t t = 0; t < n; ++t) {
      double s4 = 0;
      for (std::int64_t j = 0; j < d; ++j) {
        const int c = (codes[std::size_t((j / 2) * n + 2 * (t % (n / 2)) + j % 2)] >> (t < n / 2 ? 0 : 4)) & 15;
        CHECK(std::fabs(mn[j] + st[j] * c - keys[t * d + j]) <= st[j] / 2 * (1 + 1e-5) + 1e-6);
        s4 += double(q[j]) * (double(mn[j]) + double(st[j]) * c);
      }
      best4 = std::max(best4, s4);
    }
    const float* qp = q.data();
    float i4 = 0.f;
    std::vector<std::int16_t> wq(static_cast<std::size_t>(d));
    std::vector<std::int32_t> acc4(static_cast<std::size_t>(n));
    kvscore::detail::int4_tile_scores(&qp, 1, mn.data(), st.data(), codes.data(), n, d, &i4, wq.data(), acc4.data());
    CHECK(i4 == Approx(best4).epsilon(1e-4).margin(2e-3));  // the 16-bit weights: ~1e-4 relative
    CHECK(std::fabs(double(i4) - best) <= err + 1e-3);
    const float z = 2.0697f;
    CHECK(kvscore::detail::summary_score(BlockScore::meanstd, q.data(), a.data(), b.data(), d, z) ==
          Approx(m + z * std::sqrt(var)).epsilon(1e-4).margin(1e-4));
  }
  // one key: Quest's bound is the key's own score
  const auto k1 = normal(64, 7), q1 = normal(64, 8);
  kvscore::detail::summarize_tile(BlockScore::quest, kvscore::detail::KeyTile<float>{k1.data(), 64, 1}, 1, 64, a.data(), b.data());
  double dot = 0;
  for (int j = 0; j < 64; ++j) dot += double(q1[j]) * k1[j];
  CHECK(kvscore::detail::summary_score(BlockScore::quest, q1.data(), a.data(), b.data(), 64, 0.f) == Approx(dot).margin(1e-4));
}

TEST_CASE("attended_blocks: a fraction or a count of tokens, whole blocks, never below the protected ones",
          "[block_sparse]") {
  // 1000 tokens in blocks of 32: 32 blocks, the last holds 8; sinks 4 -> block 0; local 64 ->
  // tokens 936.. -> blocks 29, 30, 31: 4 protected
  CHECK(kvscore::attended_blocks(1000, 32, 0.1) == 4);    // 100 tokens -> 4 blocks
  CHECK(kvscore::attended_blocks(1000, 32, 0.05) == 4);   // 50 -> 2 blocks, below the protected 4
  CHECK(kvscore::attended_blocks(1000, 32, 0.5) == 16);
  CHECK(kvscore::attended_blocks(1000, 32, 0.3) == 10);   // 300 -> 9.4 -> 10
  CHECK(kvscore::attended_blocks(1000, 32, 1.0) == 32);   // dense
  CHECK(kvscore::attended_blocks(1000, 32, 200) == 7);    // a count
  CHECK(kvscore::attended_blocks(1000, 32, 4096) == 32);  // more than the sequence: all of it
  CHECK(kvscore::attended_blocks(8000, 32, 0.1) == 25);   // 800 tokens exactly (no float fuzz block)
  BlockSparseOptions o;
  o.sinks = 0;
  o.local = 0;  // the last block stays
  CHECK(kvscore::attended_blocks(1000, 32, 0.01, o) == 1);
  CHECK(kvscore::attended_blocks(0, 32, 0.1) == 0);
  for (double bad : {0.0, -1.0, 1.5, double(NAN), double(INFINITY)})
    CHECK(error_of([&] { kvscore::attended_blocks(1000, 32, bad); }).find("must be a fraction in (0, 1] or a whole count") !=
          std::string::npos);
  CHECK(error_of([] { kvscore::attended_blocks(1000, 0, 0.1); }) ==
        "kvscore::attended_blocks: block_size must be > 0 (got 0)");
  o.local = -1;
  CHECK(error_of([&] { kvscore::attended_blocks(1000, 32, 0.1, o); }) ==
        "kvscore::attended_blocks: local must be >= 0 (got -1)");
}

/// [kv_heads][tokens][d] keys, N(0, 1), with block `plant` of head `h` pointing along `q`.
std::vector<float> planted(std::int64_t H, std::int64_t T, std::int64_t d, std::int64_t bs, std::int64_t plant,
                           std::int64_t h, const std::vector<float>& q, std::uint64_t seed) {
  auto k = normal(std::size_t(H * T * d), seed, 0.5f);
  double qn = 0;
  for (float x : q) qn += double(x) * x;
  for (std::int64_t t = plant * bs; t < (plant + 1) * bs; ++t)
    for (std::int64_t j = 0; j < d; ++j) k[std::size_t((h * T + t) * d + j)] += float(10.0 * q[std::size_t(j)] / std::sqrt(qn));
  return k;
}

TEST_CASE("block_sparse_reference: every score finds a planted block, ties go to the lower block", "[block_sparse]") {
  const std::int64_t H = 2, G = 3, T = 32 * 24 + 5, d = 64, bs = 32;
  for (BlockScore how : kvscore::kBlockScores) {
    BlockSparseOptions o;
    o.score = how;
    auto q = normal(std::size_t(H * G * d), 99);
    // head 1's second query (query head 4) looks for block 11
    const std::vector<float> q4(q.begin() + 4 * d, q.begin() + 5 * d);
    const auto keys = planted(H, T, d, bs, 11, 1, q4, 5);
    const std::int64_t prot = kvscore::detail::protected_blocks_of(T, bs, o).count();
    const auto got = kvscore::block_sparse_reference(keys.data(), H, T, d, bs, q.data(), H * G, prot + 1, o);
    INFO(kvscore::to_string(how));
    REQUIRE(std::int64_t(got.size()) == prot + 1);
    CHECK(std::find(got.begin(), got.end(), 11) != got.end());
    CHECK(std::is_sorted(got.begin(), got.end()));
    // every key zero: every block ties, the lowest candidates win
    const std::vector<float> zero(std::size_t(H * T * d), 0.f);
    const auto tie = kvscore::block_sparse_reference(zero.data(), H, T, d, bs, q.data(), H * G, prot + 3, o);
    CHECK(tie == std::vector<std::int64_t>{0, 1, 2, 3, 22, 23, 24});
  }
  BlockSparseOptions o;
  auto q = normal(6 * 64, 1);
  const std::vector<float> keys(std::size_t(2 * 100 * 64), 0.f);
  CHECK(error_of([&] { kvscore::block_sparse_reference(keys.data(), 2, 100, 64, 32, q.data(), 5, 4, o); }) ==
        "kvscore::block_sparse_reference: q_heads 5 must be a positive multiple of kv_heads 2");
  CHECK(error_of([&] { kvscore::block_sparse_reference(keys.data(), 2, 100, 64, 32, q.data(), 6, 1, o); }) ==
        "kvscore::block_sparse_reference: attend 1 blocks out of range [4, 4]");
  q[7] = NAN;
  CHECK(error_of([&] { kvscore::block_sparse_reference(keys.data(), 2, 100, 64, 32, q.data(), 6, 4, o); })
            .find("query element 7 is not finite") != std::string::npos);
}

// ------------------------------------------------------------------ paged pools

/// A paged pool of NB blocks (vLLM CPU's [NB][H][bs][2d] with keys as [d][bs] tiles, or NHD
/// [NB][bs][H][d]) whose sequences' keys also live as plain [H][T][d] arrays.
template <class T>
struct Pool {
  std::int64_t NB, H, bs, d;
  bool transposed;
  std::vector<T> data;
  Pool(std::int64_t nb, std::int64_t h, std::int64_t b, std::int64_t dd, bool tr)
      : NB(nb), H(h), bs(b), d(dd), transposed(tr),
        data(std::size_t(nb * h * b * (tr ? 2 * dd : dd)), kvscore::from_float<T>(0.f)) {}
  void put(std::int64_t block, std::int64_t h, std::int64_t o, const float* k) {
    for (std::int64_t j = 0; j < d; ++j) {
      const std::size_t at = transposed ? std::size_t(((block * H + h) * bs) * 2 * d + j * bs + o)
                                        : std::size_t(((block * bs + o) * H + h) * d + j);
      data[at] = kvscore::from_float<T>(k[j]);
    }
  }
  float get(std::int64_t block, std::int64_t h, std::int64_t o, std::int64_t j) const {
    const std::size_t at = transposed ? std::size_t(((block * H + h) * bs) * 2 * d + j * bs + o)
                                      : std::size_t(((block * bs + o) * H + h) * d + j);
    return kvscore::to_float(data[at]);
  }
  template <class F>
  void with_view(F&& f) const {
    static const std::vector<std::int32_t> none;
    const kvscore::BlockTable t(std::span<const std::int32_t>(none), bs, NB, 0);
    if (transposed) f(kvscore::TransposedPagedKeysView<T>::vllm_cpu(data.data(), H, d, t));
    else f(kvscore::PagedKeysView<T>::nhd(data.data(), H, d, t));
  }
};

struct Seq {
  std::vector<std::int32_t> table;
  std::int64_t tokens = 0;
};

/// The sequence's keys read back as [H][T][d] floats (what an engine test reads from vLLM).
template <class T>
std::vector<float> read_back(const Pool<T>& p, const Seq& s) {
  std::vector<float> k(std::size_t(p.H * s.tokens * p.d));
  for (std::int64_t h = 0; h < p.H; ++h)
    for (std::int64_t t = 0; t < s.tokens; ++t)
      for (std::int64_t j = 0; j < p.d; ++j)
        k[std::size_t((h * s.tokens + t) * p.d + j)] = p.get(s.table[std::size_t(t / p.bs)], h, t % p.bs, j);
  return k;
}

template <class T>
void check_against_reference(BlockScore how, bool transposed, kvscore::QueryGroup group = kvscore::QueryGroup::heads) {
  const std::int64_t NB = 96, H = 2, G = 2, bs = 32, d = 32, L = 2;
  Pool<T> pool(NB, H, bs, d, transposed);
  BlockSparseOptions o;
  o.score = how;
  o.probe = true;
  o.group = group;
  o.refresh = 1;  // every step scored: each choice is the reference's
  PagedBlockSelector sel(L, NB, H, d, bs, o);
  BlockSparseOptions o1 = o;
  o1.num_threads = 1;
  PagedBlockSelector serial(L, NB, H, d, bs, o1);
  BlockSparseOptions o4 = o;
  o4.num_threads = 4;  // more threads than rows: each row's scoring split over them
  PagedBlockSelector split(L, NB, H, d, bs, o4);
  std::mt19937_64 g(11);
  // three sequences over a shuffled pool; keys written as an engine would (slot by slot)
  std::vector<std::int32_t> free_ids(NB);
  std::iota(free_ids.begin(), free_ids.end(), 0);
  std::shuffle(free_ids.begin(), free_ids.end(), g);
  std::vector<Seq> seqs(3);
  std::vector<std::int64_t> written;
  std::uint64_t seed = 1;
  auto write = [&](Seq& s, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i, ++s.tokens) {
      if (s.tokens % bs == 0) {
        s.table.push_back(free_ids.back());
        free_ids.pop_back();
      }
      const std::int64_t b = s.table.back(), o = s.tokens % bs;
      for (std::int64_t h = 0; h < H; ++h) pool.put(b, h, o, normal(std::size_t(d), seed++).data());
      written.push_back(b * bs + o);
    }
  };
  write(seqs[0], 700);
  write(seqs[1], 410);
  write(seqs[2], 64 * 4 + 1);
  for (int step = 0; step < 6; ++step) {
    if (step == 3) {
      // sequence 1 ends; its blocks go to a new sequence 1 with other keys (reuse)
      for (auto b : seqs[1].table) free_ids.push_back(b);
      seqs[1] = Seq{};
      write(seqs[1], 500);
    }
    sel.begin_step(written, std::vector<std::int64_t>{seqs[0].table[0], seqs[1].table[0], seqs[2].table[0]});
    serial.begin_step(written, std::vector<std::int64_t>{seqs[0].table[0], seqs[1].table[0], seqs[2].table[0]});
    split.begin_step(written, std::vector<std::int64_t>{seqs[0].table[0], seqs[1].table[0], seqs[2].table[0]});
    written.clear();
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<std::vector<float>> q;
      std::vector<std::vector<std::int32_t>> out(3), out1(3), out4(3);
      std::vector<BlockSparseRow> rows, rows1, rows4;
      for (std::size_t i = 0; i < 3; ++i) {
        q.push_back(normal(std::size_t(H * G * d), 5000 + 100 * step + 10 * l + i));
        const std::int64_t att = kvscore::attended_blocks(seqs[i].tokens, bs, 0.3, o);
        out[i].assign(std::size_t(att), -1);
        out1[i].assign(std::size_t(att), -1);
        out4[i].assign(std::size_t(att), -1);
        rows.push_back({seqs[i].table, seqs[i].tokens, q[i].data(), att, out[i].data()});
        rows1.push_back({seqs[i].table, seqs[i].tokens, q[i].data(), att, out1[i].data()});
        rows4.push_back({seqs[i].table, seqs[i].tokens, q[i].data(), att, out4[i].data()});
      }
      pool.with_view([&](const auto& v) {
        sel.select(l, v, H * G, rows);
        serial.select(l, v, H * G, rows1);
        split.select(l, v, H * G, rows4);
      });
      for (std::size_t i = 0; i < 3; ++i) {
        const auto keys = read_back(pool, seqs[i]);
        const auto ref = kvscore::block_sparse_reference(keys.data(), H, seqs[i].tokens, d, bs, q[i].data(), H * G,
                                                         rows[i].attend, o);
        std::vector<std::int32_t> want;
        for (auto b : ref) want.push_back(seqs[i].table[std::size_t(b)]);
        INFO("step " << step << " layer " << l << " seq " << i << " " << kvscore::to_string(how));
        CHECK(out[i] == want);
        CHECK(out1[i] == out[i]);  // any thread count
        CHECK(out4[i] == out[i]);
      }
    }
    for (auto& s : seqs) write(s, 13);  // the decode steps' tokens (some blocks fill)
  }
  if (how == BlockScore::exact && group == kvscore::QueryGroup::heads) CHECK(sel.probe().first == sel.probe().second);
  CHECK(sel.probe().first > 0);
  if (how == BlockScore::quest || how == BlockScore::meanstd) CHECK(sel.summaries_made() > 0);
  if (how == BlockScore::pariskv) CHECK(sel.indexes() == 3 * L);
}

TEST_CASE("PagedBlockSelector equals the reference on the keys read back, across steps, reuse and threads",
          "[block_sparse]") {
  for (BlockScore how : kvscore::kBlockScores) {
    check_against_reference<float>(how, true);
    check_against_reference<float>(how, false);
  }
  check_against_reference<kvscore::bfloat16>(BlockScore::quest, true);
  check_against_reference<kvscore::half>(BlockScore::meanstd, true);
  check_against_reference<kvscore::bfloat16>(BlockScore::pariskv, true);
  check_against_reference<float>(BlockScore::int4, true, kvscore::QueryGroup::mean);
  check_against_reference<kvscore::half>(BlockScore::quest, false, kvscore::QueryGroup::mean);
}

TEST_CASE("PagedBlockSelector: a summary is remade only when begin_step names a write to its block",
          "[block_sparse]") {
  const std::int64_t NB = 8, H = 1, bs = 32, d = 16;
  Pool<float> pool(NB, H, bs, d, true);
  Seq s{{0, 1, 2, 3, 4, 5, 6, 7}, 8 * bs};
  std::vector<std::int64_t> slots;
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t o = 0; o < bs; ++o) {
      pool.put(b, 0, o, normal(std::size_t(d), std::uint64_t(b * bs + o + 1), 0.1f).data());
      slots.push_back(b * bs + o);
    }
  BlockSparseOptions o;
  o.sinks = 1;
  o.local = 1;
  o.refresh = 1;  // every step scored
  PagedBlockSelector sel(1, NB, H, d, bs, o);
  const auto q = normal(std::size_t(d), 3);
  const std::vector<std::int64_t> live{s.table[0]};
  std::vector<std::int32_t> out(3);
  auto choose = [&] {
    std::vector<BlockSparseRow> rows{{s.table, s.tokens, q.data(), 3, out.data()}};
    pool.with_view([&](const auto& v) { sel.select(0, v, 1, rows); });
    return out[1];  // the one chosen between block 0 and the last block
  };
  sel.begin_step(slots, live);
  const std::int32_t first = choose();
  CHECK(sel.summaries_made() == 6);
  // plant a strong block 3 (or 4) where the choice was not
  const std::int64_t plant = first == 3 ? 4 : 3;
  for (std::int64_t o2 = 0; o2 < bs; ++o2) {
    std::vector<float> k(q.begin(), q.end());
    pool.put(plant, 0, o2, k.data());
  }
  sel.begin_step({}, live);
  CHECK(choose() == first);  // not told: the old summaries stand (the engine always tells)
  CHECK(sel.summaries_made() == 6);
  std::vector<std::int64_t> w{plant * bs + 5};
  sel.begin_step(w, live);
  CHECK(choose() == plant);  // told: block `plant` summarised again
  CHECK(sel.summaries_made() == 7);
}

TEST_CASE("PagedBlockSelector: errors name the value and leave every output unwritten", "[block_sparse]") {
  const std::int64_t NB = 8, H = 2, bs = 32, d = 16;
  Pool<float> pool(NB, H, bs, d, true);
  PagedBlockSelector sel(2, NB, H, d, bs);
  const auto q = normal(std::size_t(4 * d), 1);
  std::vector<std::int32_t> table{0, 1, 2, 3, 4}, out(5, -7);
  auto run = [&](std::vector<BlockSparseRow> rows, std::int64_t layer = 0, std::int64_t qh = 4) {
    return error_of([&] { pool.with_view([&](const auto& v) { sel.select(layer, v, qh, rows); }); });
  };
  CHECK(run({{table, 160, q.data(), 3, out.data()}}, 2) ==
        "kvscore::PagedBlockSelector::select: layer 2 out of range [0, 2)");
  CHECK(run({{table, 160, q.data(), 3, out.data()}}, 0, 3) ==
        "kvscore::PagedBlockSelector::select: q_heads 3 must be a positive multiple of kv_heads 2");
  CHECK(run({{table, 160, q.data(), 2, out.data()}}) ==
        "kvscore::PagedBlockSelector::select: row 0: attend 2 blocks out of range [3, 5] (protected .. all)");
  CHECK(run({{table, 170, q.data(), 3, out.data()}}) ==
        "kvscore::PagedBlockSelector::select: row 0: the table has 5 entries, 170 tokens need 6");
  std::vector<std::int32_t> bad{0, 1, 9, 3, 4};
  CHECK(run({{table, 160, q.data(), 3, out.data()}, {bad, 160, q.data(), 3, out.data()}}) ==
        "kvscore::PagedBlockSelector::select: row 1: table[2] = 9 out of range [0, 8)");
  auto qn = q;
  qn[3] = INFINITY;
  CHECK(run({{table, 160, qn.data(), 3, out.data()}}).find("row 0: query element 3 is not finite") != std::string::npos);
  CHECK(std::all_of(out.begin(), out.end(), [](std::int32_t x) { return x == -7; }));
  CHECK(error_of([&] { sel.begin_step(std::vector<std::int64_t>{3, 256}, {}); }) ==
        "kvscore::PagedBlockSelector::begin_step: slot 256 at 1 is past the pool's 256 slots");
  CHECK(error_of([&] { PagedBlockSelector(1, 8, 2, 0, 32); }) ==
        "kvscore::PagedBlockSelector: head_dim must be in [1, 4096] (got 0)");
  BlockSparseOptions o;
  o.score = BlockScore::pariskv;
  PagedBlockSelector par(1, NB, H, d, bs, o);
  std::vector<std::int32_t> other{0, 5, 6, 7, 1};
  CHECK(error_of([&] {
          std::vector<BlockSparseRow> rows{{table, 160, q.data(), 3, out.data()}, {other, 160, q.data(), 3, out.data()}};
          pool.with_view([&](const auto& v) { par.select(0, v, 4, rows); });
        }) == "kvscore::PagedBlockSelector::select: row 1 has the sequence key 0 of an earlier row (one sequence per row; "
              "rows sharing a first block need their own seq)");
  // the pool's shape must be the selector's
  Pool<float> small(4, H, bs, d, true);
  CHECK(error_of([&] {
          std::vector<BlockSparseRow> rows{{table, 100, q.data(), 3, out.data()}};
          small.with_view([&](const auto& v) { sel.select(0, v, 4, rows); });
        }) == "kvscore::PagedBlockSelector::select: the keys' (kv_heads, head_dim, block_size, num_blocks) = (2, 16, 32, "
              "4) differ from the selector's (2, 16, 32, 8)");
}

}  // namespace

namespace {

TEST_CASE("PagedBlockSelector: with refresh a kept choice stands between scorings and dies with a write",
          "[block_sparse]") {
  const std::int64_t NB = 64, H = 1, bs = 32, d = 16;
  Pool<float> pool(NB, H, bs, d, true);
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t o = 0; o < bs; ++o) pool.put(b, 0, o, normal(std::size_t(d), std::uint64_t(b * bs + o + 1)).data());
  BlockSparseOptions o;
  o.refresh = 3;
  o.sinks = 1;
  o.local = 1;
  PagedBlockSelector sel(1, NB, H, d, bs, o);
  BlockSparseOptions o1 = o;
  o1.refresh = 1;
  PagedBlockSelector every(1, NB, H, d, bs, o1);
  BlockSparseOptions ox = o1;
  ox.score = BlockScore::exact;
  PagedBlockSelector exact(1, NB, H, d, bs, ox);
  o.probe = true;  // the probe: sel's choices against each step's exact one, kept steps included
  PagedBlockSelector probed(1, NB, H, d, bs, o);
  std::int64_t probe_k = 0, probe_hit = 0;
  std::vector<std::int32_t> table(NB);
  std::iota(table.begin(), table.end(), 0);
  std::vector<std::int32_t> kept_before;
  for (int step = 0; step < 7; ++step) {
    const std::int64_t tokens = 40 * bs + step * bs;  // a block more every step
    const auto q = normal(std::size_t(d), 100 + step);  // another query every step
    std::vector<std::int64_t> written;
    if (step == 5) written.push_back(kept_before.at(2) * bs);  // a kept block is written
    sel.begin_step(written, std::vector<std::int64_t>{0});
    every.begin_step(written, std::vector<std::int64_t>{0});
    exact.begin_step(written, std::vector<std::int64_t>{0});
    probed.begin_step(written, std::vector<std::int64_t>{0});
    std::vector<std::int32_t> out(6), ref(6), best(6), outp(6);
    std::uint8_t fresh = 9;
    std::vector<BlockSparseRow> rows{{table, tokens, q.data(), 6, out.data(), &fresh}};
    std::vector<BlockSparseRow> rows1{{table, tokens, q.data(), 6, ref.data()}};
    std::vector<BlockSparseRow> rowsx{{table, tokens, q.data(), 6, best.data()}};
    std::vector<BlockSparseRow> rowsp{{table, tokens, q.data(), 6, outp.data()}};
    const std::int64_t made = sel.summaries_made();
    pool.with_view([&](const auto& v) {
      sel.select(0, v, 1, rows);
      every.select(0, v, 1, rows1);
      exact.select(0, v, 1, rowsx);
      probed.select(0, v, 1, rowsp);
    });
    INFO("step " << step);
    CHECK(outp == out);  // probing changes nothing
    // 6 attended = 1 sink + the last (partial) block + 4 chosen; the probe counts, every step,
    // how many of the exact choice's 4 the choice holds (the protected two are in both)
    std::int64_t both = 0;
    for (const auto b : best) both += std::count(out.begin(), out.end(), b);
    probe_k += 4;
    probe_hit += both - 2;
    CHECK(probed.probe() == std::pair<std::int64_t, std::int64_t>{probe_k, probe_hit});
    const bool scored = step == 0 || step == 3 || step == 5;  // 0, 3 by the clock; 5 by the write (then 8)
    CHECK(fresh == std::uint8_t(scored));
    // a kept choice that stands reads no summary, so none is made for it (the blocks the window
    // let go since are summarised when the row is next scored); a scoring makes the missing ones
    if (scored)
      CHECK(sel.summaries_made() > made);
    else
      CHECK(sel.summaries_made() == made);
    CHECK(out.front() == 0);
    CHECK(out.back() == std::int32_t(tokens / bs - 1));  // the last block: always
    if (scored) {
      CHECK(out == ref);  // a scoring is the same as without refresh
    } else {
      // the kept blocks stand (the window moved on: the new last block replaces the old one)
      CHECK(std::vector<std::int32_t>(out.begin() + 1, out.end() - 1) ==
            std::vector<std::int32_t>(kept_before.begin() + 1, kept_before.end() - 1));
    }
    kept_before = out;
  }
  CHECK(probe_hit < probe_k);  // the case has kept choices that miss some exact blocks
}

TEST_CASE("PagedBlockSelector: with refresh, the few rows that score split over the threads, the same choice",
          "[block_sparse]") {
  // 6 rows whose refresh phases differ (row r joins at step r): most steps score one or two rows,
  // fewer than the 3 threads, so those rows' scoring is split; a serial selector must agree
  const std::int64_t NB = 6 * 48, H = 2, bs = 16, d = 16, R = 6;
  Pool<float> pool(NB, H, bs, d, true);
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t o = 0; o < bs; ++o)
        pool.put(b, h, o, normal(std::size_t(d), std::uint64_t((b * H + h) * bs + o + 7)).data());
  BlockSparseOptions o;
  o.refresh = 3;
  o.sinks = 1;
  o.local = 1;
  o.num_threads = 3;
  PagedBlockSelector split(2, NB, H, d, bs, o);
  o.num_threads = 1;
  PagedBlockSelector serial(2, NB, H, d, bs, o);
  std::vector<std::vector<std::int32_t>> tables(R);
  for (std::int64_t r = 0; r < R; ++r)
    for (std::int64_t i = 0; i < 48; ++i) tables[std::size_t(r)].push_back(std::int32_t(r * 48 + i));
  std::int64_t split_steps = 0;
  for (int step = 0; step < 9; ++step) {
    std::vector<std::int64_t> firsts;
    for (std::int64_t r = 0; r < R; ++r) firsts.push_back(r * 48);
    split.begin_step({}, firsts);
    serial.begin_step({}, firsts);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto q = normal(std::size_t(2 * H * d), std::uint64_t(1000 + step * 2 + layer));
      std::vector<std::int32_t> a(std::size_t(R * 8)), b(std::size_t(R * 8));
      std::vector<std::uint8_t> fa(static_cast<std::size_t>(R), 0), fb(static_cast<std::size_t>(R), 0);
      std::vector<BlockSparseRow> ra, rb;
      for (std::int64_t r = 0; r < R; ++r) {
        if (r > step) continue;  // row r decodes from step r on
        const std::int64_t tokens = 30 * bs + r * 5;
        ra.push_back({tables[std::size_t(r)], tokens, q.data(), 8, a.data() + r * 8, fa.data() + r});
        rb.push_back({tables[std::size_t(r)], tokens, q.data(), 8, b.data() + r * 8, fb.data() + r});
      }
      pool.with_view([&](const auto& v) {
        split.select(layer, v, 2 * H, ra);
        serial.select(layer, v, 2 * H, rb);
      });
      INFO("step " << step << " layer " << layer);
      CHECK(a == b);
      CHECK(fa == fb);
      const auto scored = std::count(fa.begin(), fa.end(), std::uint8_t(1));
      split_steps += std::int64_t(ra.size()) >= 3 && scored < 3 && scored > 0;
    }
  }
  CHECK(split_steps > 0);  // the case itself happened: as many rows as threads, fewer scoring
}

}  // namespace

namespace {

/// splitmix64: the same numbers on every platform (std::normal_distribution's are not).
struct SplitMix {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return float(next() >> 40) * (2.f / 16777216.f) - 1.f; }  // [-1, 1), exact in fp32
};

/// FNV-1a over every choice and fresh flag of a fixed run: 5 sequences over a shuffled pool,
/// 8 steps of 2 layers (rows sitting steps out, a sequence ended and its blocks reused, a block
/// rewritten in place), attend 0.1 / 0.25 / 0.4.
template <class T>
std::uint64_t run_digest(BlockScore how, std::int64_t refresh, kvscore::QueryGroup group, bool probe, int threads,
                         bool transposed, std::uint64_t seed) {
  const std::int64_t NB = 120, H = 2, G = 3, bs = 16, d = 32, L = 2, R = 5;
  Pool<T> pool(NB, H, bs, d, transposed);
  BlockSparseOptions o;
  o.score = how;
  o.refresh = refresh;
  o.group = group;
  o.probe = probe;
  o.num_threads = threads;
  o.sinks = 4;
  o.local = 20;
  o.prefilter = seed % 3 == 0 ? 0 : 2;
  PagedBlockSelector sel(L, NB, H, d, bs, o);
  SplitMix g{seed};
  std::vector<std::int32_t> free_ids(NB);
  std::iota(free_ids.begin(), free_ids.end(), 0);
  for (std::size_t i = free_ids.size(); i > 1; --i) std::swap(free_ids[i - 1], free_ids[g.next() % i]);
  std::vector<Seq> seqs(R);
  std::vector<std::int64_t> written;
  std::vector<float> k(static_cast<std::size_t>(d));
  auto put_random = [&](std::int64_t b, std::int64_t off) {
    for (std::int64_t h = 0; h < H; ++h) {
      for (auto& x : k) x = g.uniform();
      pool.put(b, h, off, k.data());
    }
    written.push_back(b * bs + off);
  };
  auto write = [&](Seq& s, std::int64_t n) {
    for (std::int64_t i = 0; i < n; ++i, ++s.tokens) {
      if (s.tokens % bs == 0) {
        s.table.push_back(free_ids.back());
        free_ids.pop_back();
      }
      put_random(s.table.back(), s.tokens % bs);
    }
  };
  const std::int64_t lens[R] = {300, 210, 97, 380, 161};
  for (std::int64_t i = 0; i < R; ++i) write(seqs[std::size_t(i)], lens[i]);
  std::uint64_t h = 1469598103934665603ull;
  auto mix = [&](std::uint64_t x) { h = (h ^ x) * 1099511628211ull; };
  for (int step = 0; step < 8; ++step) {
    if (step == 3) {  // sequence 1 ends; its blocks go to a new one
      for (auto b : seqs[1].table) free_ids.push_back(b);
      seqs[1] = Seq{};
      write(seqs[1], 230);
    }
    if (step == 5)
      for (std::int64_t off = 0; off < bs; ++off) put_random(seqs[0].table[3], off);  // rewritten in place
    std::vector<std::int64_t> live;
    for (auto& s : seqs) live.push_back(s.table[0]);
    written.push_back(-1);  // padding
    sel.begin_step(written, live);
    written.clear();
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<std::vector<float>> q(R);
      std::vector<std::vector<std::int32_t>> outs(R);
      std::vector<std::uint8_t> fresh(R, 7);
      std::vector<BlockSparseRow> rows;
      const double frac[] = {0.1, 0.25, 0.4};
      for (std::int64_t i = 0; i < R; ++i) {
        if ((step + i) % 4 == 3) continue;  // a row sits a step out now and then
        auto& s = seqs[std::size_t(i)];
        q[std::size_t(i)].resize(std::size_t(H * G * d));
        for (auto& x : q[std::size_t(i)]) x = 2.f * g.uniform();
        const std::int64_t att = kvscore::attended_blocks(s.tokens, bs, frac[(i + l) % 3], o);
        outs[std::size_t(i)].assign(std::size_t(att), -1);
        rows.push_back({s.table, s.tokens, q[std::size_t(i)].data(), att, outs[std::size_t(i)].data(), fresh.data() + i});
      }
      pool.with_view([&](const auto& v) { sel.select(l, v, H * G, rows); });
      for (std::int64_t i = 0; i < R; ++i) {
        mix(fresh[std::size_t(i)]);
        for (auto b : outs[std::size_t(i)]) mix(std::uint64_t(b));
      }
    }
    for (auto& s : seqs) write(s, 1 + std::int64_t(g.next() % 20));
  }
  mix(std::uint64_t(sel.probe().first));
  mix(std::uint64_t(sel.probe().second));
  return h;
}

TEST_CASE("PagedBlockSelector: a fixed run chooses what the selector chose before its split into block_sparse/",
          "[block_sparse]") {
  // Digests of every choice, recorded with block_sparse.hpp as one file (main at 0dce1d9): the
  // refactored selector must choose the same blocks, bit for bit. The run's numbers are exact
  // (splitmix64); the scores are fp32 in fixed orders.
  struct Case {
    BlockScore how;
    std::int64_t refresh;
    kvscore::QueryGroup group;
    bool probe;
    int threads;
    std::uint64_t want;
  };
  using kvscore::QueryGroup;
  const Case cases[] = {
      {BlockScore::quest, 1, QueryGroup::heads, false, 1, 0xbad2d6591c2a3edfull},   {BlockScore::quest, 3, QueryGroup::mean, true, 3, 0x3d07f71427c8702eull},
      {BlockScore::meanstd, 1, QueryGroup::heads, true, 1, 0x7ceed029b452309eull},  {BlockScore::meanstd, 3, QueryGroup::heads, false, 2, 0x82e562272cbff244ull},
      {BlockScore::int4, 1, QueryGroup::heads, false, 3, 0xddeedc567f84c949ull},    {BlockScore::int4, 3, QueryGroup::heads, true, 1, 0x5f367b32e6d6706dull},
      {BlockScore::int4, 4, QueryGroup::mean, false, 2, 0x7feeab172d1cb96eull},     {BlockScore::pariskv, 1, QueryGroup::heads, true, 2, 0x3a429c563c4f22a2ull},
      {BlockScore::pariskv, 3, QueryGroup::mean, false, 1, 0x00a3de24e4ad1741ull},  {BlockScore::exact, 1, QueryGroup::heads, false, 2, 0xad345e3a443c17cfull},
      {BlockScore::exact, 3, QueryGroup::heads, true, 3, 0x341935f421521e17ull},
  };
  const std::string before = kvscore::simd::active_table().name;
  for (const kvscore::simd::KernelTable* t : kvscore::simd::available_tables()) {  // and on every ISA
    kvscore::simd::set_active_isa(t->name);
    std::uint64_t seed = 100;
    for (const Case& c : cases) {
      ++seed;
      const std::uint64_t got =
          seed % 3 == 0   ? run_digest<float>(c.how, c.refresh, c.group, c.probe, c.threads, true, seed)
          : seed % 3 == 1 ? run_digest<kvscore::bfloat16>(c.how, c.refresh, c.group, c.probe, c.threads, false, seed)
                          : run_digest<kvscore::half>(c.how, c.refresh, c.group, c.probe, c.threads, true, seed);
      INFO("isa " << t->name << ": " << kvscore::to_string(c.how) << " refresh " << c.refresh << " "
                  << kvscore::to_string(c.group) << " probe " << c.probe << " threads " << c.threads);
      CHECK(got == c.want);
    }
  }
  kvscore::simd::set_active_isa(before);
}

}  // namespace

namespace {

// begin_step's `live` cannot be left out: begin_step(slots) does not compile, and a row whose
// sequence the step's `live` did not name is refused (the trap it was: an empty `live` dropped
// every kept choice each step, so refresh quietly became 1)
template <class S>
concept begin_step_without_live = requires(S& s, std::span<const std::int64_t> slots) { s.begin_step(slots); };
template <class S>
concept begin_step_with_live = requires(S& s, std::span<const std::int64_t> slots) { s.begin_step(slots, slots); };
static_assert(!begin_step_without_live<PagedBlockSelector> && begin_step_with_live<PagedBlockSelector>);
static_assert(!begin_step_without_live<kvscore::BlockSparsePlanner> && begin_step_with_live<kvscore::BlockSparsePlanner>);

TEST_CASE("PagedBlockSelector: begin_step must name the live sequences, and their kept choices stand",
          "[block_sparse]") {
  const std::int64_t NB = 64, H = 1, bs = 32, d = 16;
  Pool<float> pool(NB, H, bs, d, true);
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t o = 0; o < bs; ++o) pool.put(b, 0, o, normal(std::size_t(d), std::uint64_t(b * bs + o + 1)).data());
  BlockSparseOptions o;
  o.refresh = 8;  // a kept choice stands for 8 steps (the default, 1, keeps none)
  o.sinks = 1;
  o.local = 1;
  PagedBlockSelector sel(1, NB, H, d, bs, o);
  std::vector<std::int32_t> table(NB);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<std::int64_t> live{0};
  std::int64_t scored = 0;
  for (int step = 0; step < 3; ++step) {
    const auto q = normal(std::size_t(d), 200 + step);
    std::vector<std::int32_t> out(6);
    std::uint8_t fresh = 9;
    std::vector<BlockSparseRow> rows{{table, 40 * bs + step, q.data(), 6, out.data(), &fresh}};
    sel.begin_step({}, live);
    pool.with_view([&](const auto& v) { sel.select(0, v, 1, rows); });
    scored += fresh;
  }
  CHECK(scored == 1);  // scored once, then kept: refresh works only because `live` names the row
  // leaving the row's sequence out of `live` drops its kept choice: select refuses the row
  const auto q = normal(std::size_t(d), 300);
  std::vector<std::int32_t> out(6, -7);
  std::vector<BlockSparseRow> rows{{table, 40 * bs + 3, q.data(), 6, out.data()}};
  sel.begin_step({}, {});
  CHECK(error_of([&] { pool.with_view([&](const auto& v) { sel.select(0, v, 1, rows); }); }) ==
        "kvscore::PagedBlockSelector::select: row 0's sequence (key 0) is not among the live sequences "
        "begin_step named this step");
  CHECK(std::all_of(out.begin(), out.end(), [](std::int32_t x) { return x == -7; }));
}

TEST_CASE("PagedBlockSelector: rows sharing their first blocks (prefix caching) are told apart by seq, and a shared "
          "block's summary is made once", "[block_sparse]") {
  const std::int64_t NB = 64, H = 2, bs = 32, d = 16, qh = 4;
  Pool<float> pool(NB, H, bs, d, true);
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t o = 0; o < bs; ++o) pool.put(b, h, o, normal(std::size_t(d), std::uint64_t((b * H + h) * bs + o + 7)).data());
  // A and B share their first 20 blocks (a cached prefix), then each has 4 of its own
  std::vector<std::int32_t> ta(24), tb(24);
  std::iota(ta.begin(), ta.end(), 0);
  std::iota(tb.begin(), tb.begin() + 20, 0);
  std::iota(tb.begin() + 20, tb.end(), 40);
  const std::int64_t tokens = 24 * bs - 5;
  const auto qa = normal(std::size_t(qh * d), 11), qb = normal(std::size_t(qh * d), 12);
  // with and without int4's prefilter, by each query head or the group's mean: each row's choice
  // is its own
  using kvscore::QueryGroup;
  for (const auto& [score, prefilter, group] :
       {std::tuple{BlockScore::int4, 0, QueryGroup::heads}, std::tuple{BlockScore::int4, 2, QueryGroup::heads},
        std::tuple{BlockScore::int4, 2, QueryGroup::mean}, std::tuple{BlockScore::pariskv, 0, QueryGroup::heads}}) {
    CAPTURE(kvscore::to_string(score), prefilter, kvscore::to_string(group));
    BlockSparseOptions o;
    o.score = score;
    o.prefilter = prefilter;
    o.group = group;
    o.sinks = 1;
    o.local = 1;
    o.refresh = 4;
    PagedBlockSelector sel(1, NB, H, d, bs, o), alone(1, NB, H, d, bs, o);
    std::vector<std::int32_t> oa(6), ob(6), ra(6), rb(6);
    std::vector<std::uint8_t> fresh(2, 9);
    const std::vector<std::int64_t> live{7, 3};
    for (int step = 0; step < 3; ++step) {
      std::vector<BlockSparseRow> rows{{ta, tokens, qa.data(), 6, oa.data(), &fresh[0], 7},
                                       {tb, tokens, qb.data(), 6, ob.data(), &fresh[1], 3}};
      sel.begin_step({}, live);
      pool.with_view([&](const auto& v) { sel.select(0, v, qh, rows); });
      CHECK(int(fresh[0]) == (step == 0));  // each sequence's kept choice stands on its own
      CHECK(int(fresh[1]) == (step == 0));
    }
    // each row chose what it chooses alone (a selector that saw only it), from the same summaries
    for (const auto& [t, q, want, key] : {std::tuple{&ta, &qa, &ra, 7}, std::tuple{&tb, &qb, &rb, 3}}) {
      std::vector<BlockSparseRow> one{{*t, tokens, q->data(), 6, want->data(), nullptr, key}};
      const std::vector<std::int64_t> l1{key};
      alone.begin_step({}, l1);
      pool.with_view([&](const auto& v) { alone.select(0, v, qh, one); });
    }
    CHECK(oa == ra);
    CHECK(ob == rb);
    CHECK(oa != ob);  // (the two queries choose differently: the rows were not mixed up)
    if (score == BlockScore::int4) {
      // candidates: blocks 1..22 of each (block 0 a sink, 23 the local/last): 20 shared ids
      // (1..19 and A's 20..22 are 20, 21, 22; B's are 40, 41, 42): 19 + 3 + 3 made once each
      CHECK(sel.summaries_made() == 25);
    } else {
      CHECK(sel.indexes() == 2);  // one index per sequence, not per first block
    }
  }
  // without seq the two rows are one sequence: refused, naming the key
  PagedBlockSelector sel(1, NB, H, d, bs);
  std::vector<std::int32_t> oa(6, -7), ob(6, -7);
  std::vector<BlockSparseRow> rows{{ta, tokens, qa.data(), 6, oa.data()}, {tb, tokens, qb.data(), 6, ob.data()}};
  const std::vector<std::int64_t> live{0};
  sel.begin_step({}, live);
  CHECK(error_of([&] { pool.with_view([&](const auto& v) { sel.select(0, v, qh, rows); }); }) ==
        "kvscore::PagedBlockSelector::select: row 1 has the sequence key 0 of an earlier row (one sequence per row; "
        "rows sharing a first block need their own seq)");
}

/// A trigger that fires while this step's query differs from the one the kept choice was scored
/// with in its first element (what a "query moved" trigger keeps: its data per (layer, sequence)).
struct FirstElementMoved : kvscore::RefreshTrigger {
  mutable std::int64_t fired = 0;
  bool fires(const kvscore::KeptChoice& kept, const std::vector<float>& data, const kvscore::RefreshRow& r) const override {
    CHECK(kept.step >= 1);
    CHECK(data.size() == 1);  // what scored() kept
    const bool moved = data.empty() || data[0] != r.row.query[0];
    fired += moved;
    return moved;
  }
  void scored(const kvscore::KeptChoice& kept, std::vector<float>& data, const kvscore::RefreshRow& r) const override {
    CHECK(kept.step == r.step);  // the new choice is in place
    data.assign(1, r.row.query[0]);
  }
};

TEST_CASE("RefreshPolicy: a trigger sees the kept choice, its own data and this step's query, and makes the row score",
          "[block_sparse]") {
  const std::int64_t NB = 64, H = 1, bs = 32, d = 16;
  Pool<float> pool(NB, H, bs, d, true);
  for (std::int64_t b = 0; b < NB; ++b)
    for (std::int64_t o = 0; o < bs; ++o) pool.put(b, 0, o, normal(std::size_t(d), std::uint64_t(b * bs + o + 3)).data());
  BlockSparseOptions o;
  o.sinks = 1;
  o.local = 1;
  o.refresh = 100;
  PagedBlockSelector sel(1, NB, H, d, bs, o), every(1, NB, H, d, bs, [&] {
    BlockSparseOptions o1 = o;
    o1.refresh = 1;
    return o1;
  }());
  auto trigger = std::make_unique<FirstElementMoved>();
  const FirstElementMoved* t = trigger.get();
  sel.refresh_policy().add(std::move(trigger));
  CHECK(error_of([&] { sel.refresh_policy().add(nullptr); }) == "kvscore::RefreshPolicy::add: the trigger is null");
  std::vector<std::int32_t> table(NB);
  std::iota(table.begin(), table.end(), 0);
  const std::vector<std::int64_t> live{0};
  auto q = normal(std::size_t(d), 1);
  std::vector<int> fresh_seen;
  for (int step = 0; step < 6; ++step) {
    if (step == 3) q = normal(std::size_t(d), 2);  // the query moves once, then stays
    std::vector<std::int32_t> out(6), ref(6);
    std::uint8_t fresh = 9;
    std::vector<BlockSparseRow> rows{{table, 40 * bs, q.data(), 6, out.data(), &fresh}};
    std::vector<BlockSparseRow> rows1{{table, 40 * bs, q.data(), 6, ref.data()}};
    sel.begin_step({}, live);
    every.begin_step({}, live);
    pool.with_view([&](const auto& v) {
      sel.select(0, v, 1, rows);
      every.select(0, v, 1, rows1);
    });
    fresh_seen.push_back(fresh);
    CHECK(out == ref);  // the query is the same between scorings: the kept choice is the scored one
  }
  CHECK(fresh_seen == std::vector<int>{1, 0, 0, 1, 0, 0});
  CHECK(t->fired == 1);
  const kvscore::KeptChoice* kept = sel.refresh_policy().kept(0, 0);
  REQUIRE(kept != nullptr);
  CHECK(kept->step == 4);  // steps count from 1
  CHECK(kept->data == std::vector<std::vector<float>>{{q[0]}});
}

/// A token-major cell cache as llama.cpp keeps its K: [cells][kv_heads · head_dim] rows, here
/// fp16; a block is block_size consecutive cells. Only its tiles are new: the scorers are shared.
struct CellBlockKeys {
  const kvscore::half* rows = nullptr;
  std::int64_t cells = 0, kv_heads = 0, dim = 0, bs = 0;
  std::int64_t heads() const noexcept { return kv_heads; }
  std::int64_t head_dim() const noexcept { return dim; }
  std::int64_t block_size() const noexcept { return bs; }
  std::int64_t num_blocks() const noexcept { return cells / bs; }
  kvscore::detail::KeyTile<kvscore::half> tile(std::int64_t h, std::int64_t b) const noexcept {
    return {rows + b * bs * kv_heads * dim + h * dim, kv_heads * dim, 1};
  }
};
static_assert(kvscore::BlockKeySource<CellBlockKeys>);

TEST_CASE("PagedBlockSelector::select_blocks over a token-major cell cache equals the reference, every score",
          "[block_sparse]") {
  const std::int64_t H = 2, G = 2, d = 32, bs = 32, cells = 32 * 20, T = 32 * 17 + 9;
  std::vector<kvscore::half> rows(std::size_t(cells * H * d));
  const auto k = normal(rows.size(), 17);
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = kvscore::from_float<kvscore::half>(k[i]);
  std::vector<float> keys(std::size_t(H * T * d));  // the sequence's keys read back, [H][T][d]
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t j = 0; j < d; ++j)
        keys[std::size_t((h * T + t) * d + j)] = kvscore::to_float(rows[std::size_t(t * H * d + h * d + j)]);
  const CellBlockKeys cache{rows.data(), cells, H, d, bs};
  std::vector<std::int32_t> table(20);
  std::iota(table.begin(), table.end(), 0);
  for (BlockScore how : kvscore::kBlockScores) {
    BlockSparseOptions o;
    o.score = how;
    o.refresh = 1;
    PagedBlockSelector sel(1, cells / bs, H, d, bs, o);
    for (int step = 0; step < 2; ++step) {
      const auto q = normal(std::size_t(H * G * d), std::uint64_t(40 + step));
      const std::int64_t att = kvscore::attended_blocks(T, bs, 0.3, o);
      std::vector<std::int32_t> out(static_cast<std::size_t>(att));
      std::vector<BlockSparseRow> r{{table, T, q.data(), att, out.data()}};
      sel.begin_step({}, std::vector<std::int64_t>{0});
      sel.select_blocks(0, cache, H * G, r);
      const auto ref = kvscore::block_sparse_reference(keys.data(), H, T, d, bs, q.data(), H * G, att, o);
      INFO(kvscore::to_string(how) << " step " << step);
      CHECK(std::vector<std::int64_t>(out.begin(), out.end()) == ref);  // cell block b is logical block b here
    }
  }
}

}  // namespace
