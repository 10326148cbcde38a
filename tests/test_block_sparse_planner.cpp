// BlockSparsePlanner (kvscore/block_sparse/planner.hpp), driven from C++ as an engine would (no
// Python): caches registered once, a step's rows planned once, each layer's call passing only its
// query. Its choices are the selector's on the same rows (and the reference's when scored), rows
// not planned are never written, the queries are gathered from any dtype and strides; every error
// names the value; sparse_attend / attended_tokens (which rows decode sparsely, and their length).
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/block_sparse.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using kvscore::BlockSparseOptions;
using kvscore::BlockSparsePlanner;
using kvscore::BlockSparseRow;
using test_support::error_of;

std::vector<float> normal(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> N(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = N(g);
  return v;
}

/// One layer's cache in vLLM CPU's layout [NB][H][bs][2d] (keys as [d][bs] tiles), in T.
template <class T>
std::vector<T> vllm_cpu_cache(std::int64_t NB, std::int64_t H, std::int64_t bs, std::int64_t d, std::uint64_t seed) {
  const auto v = normal(std::size_t(NB * H * bs * 2 * d), seed);
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = kvscore::from_float<T>(v[i]);
  return out;
}

/// The keys of one sequence read back from such a cache, [H][T][d] floats.
template <class T>
std::vector<float> read_back(const std::vector<T>& c, std::int64_t H, std::int64_t bs, std::int64_t d,
                             const std::int32_t* table, std::int64_t tokens) {
  std::vector<float> k(std::size_t(H * tokens * d));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t j = 0; j < d; ++j)
        k[std::size_t((h * tokens + t) * d + j)] =
            kvscore::to_float(c[std::size_t(((table[t / bs] * H + h) * bs) * 2 * d + j * bs + t % bs)]);
  return k;
}

TEST_CASE("BlockSparsePlanner: planned calls choose what the selector chooses on the same rows, the reference's when scored",
          "[block_sparse]") {
  using T = kvscore::bfloat16;
  const std::int64_t L = 3, NB = 96, H = 2, QH = 4, d = 16, bs = 8, R = 3, per = 30;
  std::vector<std::vector<T>> caches;
  for (std::int64_t l = 0; l < L; ++l) caches.push_back(vllm_cpu_cache<T>(NB, H, bs, d, std::uint64_t(l + 1)));
  for (const std::int64_t refresh : {std::int64_t(1), std::int64_t(3)}) {
    BlockSparseOptions o;
    o.sinks = 4;
    o.local = 8;
    o.refresh = refresh;
    o.num_threads = 2;
    BlockSparsePlanner planner(L, NB, H, d, bs, o);
    kvscore::PagedBlockSelector plain(L, NB, H, d, bs, o);
    std::vector<kvscore::KeyCache> kc;
    for (auto& c : caches) kc.push_back({kvscore::dtype::bf16, kvscore::KeyCacheLayout::vllm_cpu, c.data(), NB, H, bs, d});
    planner.register_caches(kc);
    // the step's block table [R][per]: a shuffled pool; row 1 is not sparse this step (untouched)
    std::vector<std::int32_t> perm(NB);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(5));
    const std::vector<std::int32_t> src(perm.begin(), perm.begin() + R * per);
    const std::vector<std::int64_t> rows{0, 2}, live{src[0], src[per], src[2 * per]};
    std::vector<std::int64_t> tokens{170, 0, 201};
    std::int64_t scored_total = 0;
    for (int step = 0; step < 7; ++step) {
      std::vector<std::int64_t> toks, attend, slots;
      for (const auto r : rows) {
        const std::int64_t n = tokens[std::size_t(r)];
        toks.push_back(n);
        attend.push_back(kvscore::attended_blocks(n, bs, 0.25, o));
        slots.push_back(std::int64_t(src[std::size_t(r * per + n / bs)]) * bs + n % bs);
      }
      planner.begin_step(slots, live);
      plain.begin_step(slots, live);
      std::vector<std::int32_t> dst(src), dst_plain(src);
      const std::vector<std::int64_t> ti{1, 0};  // each row's token in the layer's queries
      planner.plan(ti, {src.data(), R, per, per}, rows, toks, attend, {dst.data(), R, per, per});
      for (std::int64_t l = 0; l < L; ++l) {
        // the layer's queries [2 tokens][QH][d] in bf16, heads strided apart (not contiguous)
        const std::int64_t hs = d + 3;
        const auto qf = normal(std::size_t(2 * QH * hs), std::uint64_t(100 + step * L + l));
        std::vector<T> qt(qf.size());
        for (std::size_t i = 0; i < qf.size(); ++i) qt[i] = kvscore::from_float<T>(qf[i]);
        kvscore::QueryTensor q{kvscore::dtype::bf16, qt.data(), 2, QH, d, {QH * hs, hs, 1}};
        const std::int64_t n = planner.select_planned(l, q);
        // the same rows through the selector itself
        std::vector<std::vector<float>> qrow(rows.size());
        std::vector<std::uint8_t> fresh(rows.size(), 9);
        std::vector<BlockSparseRow> br;
        for (std::size_t i = 0; i < rows.size(); ++i) {
          for (std::int64_t h = 0; h < QH; ++h)
            for (std::int64_t j = 0; j < d; ++j)
              qrow[i].push_back(kvscore::to_float(qt[std::size_t(ti[i] * QH * hs + h * hs + j)]));
          br.push_back({std::span<const std::int32_t>(src.data() + rows[i] * per, std::size_t(per)), toks[i],
                        qrow[i].data(), attend[i], dst_plain.data() + rows[i] * per, fresh.data() + i});
        }
        const auto view = kvscore::TransposedPagedKeysView<T>::vllm_cpu(
            caches[std::size_t(l)].data(), H, d, kvscore::BlockTable(std::span<const std::int32_t>(), bs, NB, 0));
        plain.select(l, view, QH, br);
        INFO("refresh " << refresh << " step " << step << " layer " << l);
        CHECK(dst == dst_plain);
        CHECK(std::vector<std::uint8_t>(planner.fresh().begin(), planner.fresh().end()) == fresh);
        CHECK(n == std::count(fresh.begin(), fresh.end(), std::uint8_t(1)));
        CHECK(std::equal(dst.begin() + per, dst.begin() + 2 * per, src.begin() + per));  // row 1: never written
        scored_total += n;
        for (std::size_t i = 0; i < rows.size(); ++i) {
          if (!fresh[i]) continue;
          const std::int32_t* table = src.data() + rows[i] * per;
          const auto keys = read_back(caches[std::size_t(l)], H, bs, d, table, toks[i]);
          const auto ref = kvscore::block_sparse_reference(keys.data(), H, toks[i], d, bs, qrow[i].data(), QH, attend[i], o);
          std::vector<std::int32_t> want;
          for (const auto b : ref) want.push_back(table[b]);
          CHECK(std::vector<std::int32_t>(dst.begin() + rows[i] * per, dst.begin() + rows[i] * per + attend[i]) == want);
        }
      }
      for (const auto r : rows) ++tokens[std::size_t(r)];
    }
    // refresh 3: rows are scored on steps 0, 3 and 6 only (nothing is written to their kept blocks)
    CHECK(scored_total == (refresh == 1 ? 7 : 3) * L * std::int64_t(rows.size()));
  }
}

TEST_CASE("BlockSparsePlanner: a cache given with the call, NHD and fp32, and every error naming the value",
          "[block_sparse]") {
  const std::int64_t L = 2, NB = 32, H = 2, QH = 4, d = 16, bs = 8;
  BlockSparseOptions o;
  o.refresh = 1;
  o.local = 8;
  BlockSparsePlanner planner(L, NB, H, d, bs, o);
  kvscore::PagedBlockSelector plain(L, NB, H, d, bs, o);
  const auto pool = normal(std::size_t(NB * bs * H * d), 9);  // NHD [NB][bs][H][d]
  const kvscore::KeyCache nhd{kvscore::dtype::f32, kvscore::KeyCacheLayout::nhd, pool.data(), NB, H, bs, d};
  std::vector<std::int32_t> src(20);
  std::iota(src.begin(), src.end(), 0);
  const auto qv = normal(std::size_t(QH * d), 3);
  const kvscore::QueryTensor q{kvscore::dtype::f32, qv.data(), 1, QH, d, {QH * d, d, 1}};
  const std::vector<std::int64_t> one{0}, live{0};
  CHECK(error_of([&] { planner.select_planned(0, nhd, q); }) ==
        "select_planned: no plan for this step (plan() after begin_step())");
  CHECK(error_of([&] { planner.register_caches({nhd}); }) == "caches: 1 given, the selector has 2 layers");
  kvscore::KeyCache small = nhd;
  small.num_blocks = 16;
  CHECK(error_of([&] { planner.register_caches({nhd, small}); }) ==
        "caches[1]: (kv_heads, head_dim, block_size, num_blocks) = (2, 16, 8, 16) differ from the selector's (2, 16, 8, 32)");
  CHECK(error_of([&] { planner.select_planned(0, q); }) == "select_planned: layer 0 has no registered cache (0 registered)");
  planner.begin_step({}, live);
  plain.begin_step({}, live);
  std::vector<std::int32_t> dst(src), dst_plain(src);
  const kvscore::BlockTableRows S{src.data(), 1, 20, 20};
  const kvscore::MutableBlockTableRows D{dst.data(), 1, 20, 20};
  const std::vector<std::int64_t> five{5}, n150{150}, two{150, 151}, six{6}, many{21};
  CHECK(error_of([&] { planner.plan(one, S, five, n150, six, D); }) == "rows[0] = 5 out of range [0, 1)");
  CHECK(error_of([&] { planner.plan(one, S, one, two, six, D); }) ==
        "token_index, rows, tokens and attend must have one entry per decode row (1)");
  CHECK(error_of([&] { planner.plan(one, S, one, n150, many, D); }) == "attend[0] = 21 is more than a table row holds");
  CHECK(error_of([&] { planner.plan(one, S, one, n150, six, {dst.data(), 1, 19, 19}); }) ==
        "dst: shape (1, 19) is smaller than src's (1, 20)");
  planner.plan(one, S, one, n150, six, D);
  CHECK(error_of([&] { planner.select_planned(0, nhd, {kvscore::dtype::f32, qv.data(), 0, QH, d, {QH * d, d, 1}}); }) ==
        "token_index[0] = 0 out of range [0, 0)");
  CHECK(error_of([&] { planner.select_planned(0, nhd, {kvscore::dtype::f32, qv.data(), 1, QH, 8, {QH * 8, 8, 1}}); }) ==
        "query: head_dim 8 differs from the cache's 16");
  CHECK(error_of([&] { planner.select_planned(0, small, q); }).find("kv_cache: (kv_heads, head_dim, block_size, num_blocks)") == 0);
  CHECK(dst == src);  // nothing written by a refused call
  CHECK(planner.select_planned(1, nhd, q) == 1);
  std::vector<BlockSparseRow> br{{src, 150, qv.data(), 6, dst_plain.data()}};
  plain.select(1, kvscore::PagedKeysView<float>::nhd(pool.data(), H, d, kvscore::BlockTable(std::span<const std::int32_t>(), bs, NB, 0)),
               QH, br);
  CHECK(dst == dst_plain);
  CHECK(dst != src);
  planner.begin_step({}, live);  // a plan is one step's
  CHECK(!planner.planned());
  CHECK(error_of([&] { planner.select_planned(0, nhd, q); }) ==
        "select_planned: no plan for this step (plan() after begin_step())");
}

TEST_CASE("sparse_attend and attended_tokens: which rows decode sparsely, the length their kernel sees", "[block_sparse]") {
  // 1000 tokens, blocks of 32: 32 blocks (the last holds 8); attend 0.1 -> 4 blocks
  CHECK(kvscore::sparse_attend(1000, 32, 0.1, 0) == 4);
  CHECK(kvscore::sparse_attend(1000, 32, 0.1) == 0);       // shorter than the default dense_below (1024)
  CHECK(kvscore::kDefaultDenseBelow == 1024);
  CHECK(kvscore::sparse_attend(1024, 32, 0.1) == kvscore::attended_blocks(1024, 32, 0.1));
  CHECK(kvscore::sparse_attend(1000, 32, 1.0, 0) == 0);    // every block: dense
  CHECK(kvscore::sparse_attend(100, 32, 0.5, 0) == 0);     // the protected blocks are all of them
  CHECK(kvscore::attended_tokens(1000, 32, 4) == 3 * 32 + 8);
  CHECK(kvscore::attended_tokens(1024, 32, 4) == 4 * 32);  // a full last block
  CHECK(error_of([] { kvscore::sparse_attend(1000, 32, 0.1, -1); }) ==
        "kvscore::sparse_attend: dense_below must be >= 0 (got -1)");
  CHECK(error_of([] { kvscore::sparse_attend(1000, 32, 1.5, 0); }).find("attend 1.5") != std::string::npos);
}

}  // namespace
