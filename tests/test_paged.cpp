// Paged caches (vLLM block tables): PagedKeysView geometry and for_each_run invariants (NHD and
// HND, int32/int64 tables, non-contiguous block ids, partial last block), validation,
// selection -> physical slots, in-place compaction of a paged sequence, and scoring a paged
// view against a contiguous copy.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/kvscore.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using kvscore::BlockTable;
using kvscore::MutPagedKeysView;
using kvscore::PagedKeysView;
using kvscore::PagedLayout;
using kvscore::PhysicalSlot;
using kvscore::Selection;

using test_support::error_of;

/// A random paged geometry: pool of NB blocks, one sequence of N tokens over distinct random blocks
/// (a shuffled subset, so ids are non-contiguous and unordered, sometimes consecutive), plus
/// garbage entries after the used part of the table (vLLM pads its rows).
struct Geometry {
  std::int64_t NB = 0, BS = 1, H = 1, D = 1, N = 0;
  PagedLayout layout = PagedLayout::nhd;
  std::vector<std::int32_t> ids32;
  std::vector<std::int64_t> ids64;
  bool use64 = false;

  std::size_t pool_size() const { return std::size_t(NB * BS * H * D); }
  /// Element offset of row (h, t), computed independently of the view.
  std::size_t ref_offset(std::int64_t h, std::int64_t t) const {
    const std::int64_t b = ids64[std::size_t(t / BS)], o = t % BS;
    return std::size_t(layout == PagedLayout::nhd ? ((b * BS + o) * H + h) * D : ((b * H + h) * BS + o) * D);
  }
  BlockTable table() const {
    return use64 ? BlockTable(std::span<const std::int64_t>(ids64), BS, NB, N)
                 : BlockTable(std::span<const std::int32_t>(ids32), BS, NB, N);
  }
};

Geometry random_geometry(std::mt19937_64& rng, bool consecutive = false) {
  Geometry g;
  g.BS = 1 + std::int64_t(rng() % 8);
  g.H = 1 + std::int64_t(rng() % 4);
  g.D = 1 + std::int64_t(rng() % 9);
  g.N = std::int64_t(rng() % 40);
  g.layout = (rng() & 1) ? PagedLayout::nhd : PagedLayout::hnd;
  g.use64 = rng() & 1;
  const std::int64_t used = kvscore::blocks_for(g.N, g.BS);
  g.NB = used + std::int64_t(rng() % 6);
  std::vector<std::int64_t> perm(static_cast<std::size_t>(g.NB));
  std::iota(perm.begin(), perm.end(), 0);
  if (!consecutive) std::shuffle(perm.begin(), perm.end(), rng);
  perm.resize(std::size_t(used));
  const std::int64_t pad = std::int64_t(rng() % 3);
  for (std::int64_t i = 0; i < pad; ++i) perm.push_back(i == 0 ? -7 : 1000000);  // never read
  g.ids64 = perm;
  g.ids32.assign(perm.begin(), perm.end());
  return g;
}

template <class T>
PagedKeysView<T> view_of(const Geometry& g, const T* pool) {
  return g.layout == PagedLayout::nhd ? PagedKeysView<T>::nhd(pool, g.H, g.D, g.table())
                                      : PagedKeysView<T>::hnd(pool, g.H, g.D, g.table());
}

/// Runs of head h as (t0, n) pairs, checking that each run reproduces row(h, t).
template <class V>
std::vector<std::pair<std::int64_t, std::int64_t>> runs_of(const V& v, std::int64_t h, bool& rows_ok) {
  std::vector<std::pair<std::int64_t, std::int64_t>> runs;
  v.for_each_run(h, [&](const typename V::value_type* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
    runs.emplace_back(t0, n);
    for (std::int64_t i = 0; i < n; ++i) rows_ok = rows_ok && (first + i * stride == v.row(h, t0 + i));
  });
  return runs;
}

Selection random_selection(std::int64_t heads, std::int64_t tokens, std::mt19937_64& rng) {
  Selection s;
  s.heads = heads;
  s.tokens = tokens;
  for (std::int64_t h = 0; h < heads; ++h) {
    for (std::int64_t t = 0; t < tokens; ++t)
      if (rng() % 3 != 0) s.positions.push_back(t);
    s.offsets.push_back(std::int64_t(s.positions.size()));
  }
  return s;
}

}  // namespace

TEMPLATE_TEST_CASE("paged view: row(h, t) and for_each_run cover every row exactly once, in order", "[paged]", float,
                   kvscore::half, kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(21);
  for (int iter = 0; iter < 400; ++iter) {
    const Geometry g = random_geometry(rng, iter % 5 == 0);
    std::vector<T> pool(g.pool_size());
    const auto v = view_of(g, pool.data());
    REQUIRE(v.heads() == g.H);
    REQUIRE(v.tokens() == g.N);
    REQUIRE(v.head_dim() == g.D);
    REQUIRE(v.block_size() == g.BS);
    for (std::int64_t h = 0; h < g.H; ++h) {
      bool rows_ok = true;
      for (std::int64_t t = 0; t < g.N; ++t) rows_ok = rows_ok && v.row(h, t) == pool.data() + g.ref_offset(h, t);
      REQUIRE(rows_ok);
      const auto runs = runs_of(v, h, rows_ok);
      REQUIRE(rows_ok);
      std::int64_t next = 0;
      for (const auto& [t0, n] : runs) {
        REQUIRE(t0 == next);  // in token order, no gap, no overlap
        REQUIRE(n > 0);
        next = t0 + n;
      }
      REQUIRE(next == g.N);
      REQUIRE(runs.size() <= std::size_t(kvscore::blocks_for(g.N, g.BS)));
      for (std::int64_t t = 0; t < g.N; ++t) {
        const PhysicalSlot s = v.slot(t);
        REQUIRE(s.block == g.ids64[std::size_t(t / g.BS)]);
        REQUIRE(s.offset == t % g.BS);
      }
    }
  }
}

TEST_CASE("paged view: one run per block, merged only when the next block follows in memory", "[paged]") {
  const std::int64_t BS = 4, H = 2, D = 8, NB = 12, N = 14;  // 4 blocks, the last holds 2 tokens
  std::vector<float> pool(std::size_t(NB * BS * H * D));
  auto count_runs = [&](const PagedKeysView<float>& v) {
    std::vector<std::int64_t> lens;
    v.for_each_run(1, [&](const float*, std::int64_t, std::int64_t n, std::int64_t) { lens.push_back(n); });
    return lens;
  };
  const std::vector<std::int32_t> consecutive{5, 6, 7, 8}, scattered{7, 2, 9, 0}, descending{8, 7, 6, 5};
  const std::vector<std::int64_t> consecutive64{5, 6, 7, 8};
  // NHD: block b+1 starts one token stride after block b's last row -> one run
  REQUIRE(count_runs(PagedKeysView<float>::nhd(pool.data(), H, D, BlockTable(consecutive, BS, NB, N))) ==
          std::vector<std::int64_t>{14});
  REQUIRE(count_runs(PagedKeysView<float>::paged(pool.data(), PagedLayout::nhd, NB, BS, H, D, consecutive64, N)) ==
          std::vector<std::int64_t>{14});
  // HND with 2 heads: a head's rows of consecutive blocks are H*BS*D apart -> one run per block
  REQUIRE(count_runs(PagedKeysView<float>::hnd(pool.data(), H, D, BlockTable(consecutive, BS, NB, N))) ==
          std::vector<std::int64_t>{4, 4, 4, 2});
  // HND with one head is contiguous again
  REQUIRE(count_runs(PagedKeysView<float>::hnd(pool.data(), 1, D, BlockTable(consecutive, BS, NB, N))) ==
          std::vector<std::int64_t>{14});
  REQUIRE(count_runs(PagedKeysView<float>::nhd(pool.data(), H, D, BlockTable(scattered, BS, NB, N))) ==
          std::vector<std::int64_t>{4, 4, 4, 2});
  REQUIRE(count_runs(PagedKeysView<float>::nhd(pool.data(), H, D, BlockTable(descending, BS, NB, N))) ==
          std::vector<std::int64_t>{4, 4, 4, 2});
  // an empty sequence has no runs
  REQUIRE(count_runs(PagedKeysView<float>::nhd(pool.data(), H, D, BlockTable(scattered, BS, NB, 0))).empty());
}

TEST_CASE("paged view over an SGLang slot pool (block_size 1): consecutive slots form one run", "[paged]") {
  const std::int64_t slots = 32, H = 3, D = 4;
  std::vector<kvscore::half> pool(std::size_t(slots * H * D));
  const std::vector<std::int64_t> req_to_token{4, 5, 6, 10, 11, 30};
  for (const PagedLayout layout : {PagedLayout::nhd, PagedLayout::hnd}) {
    const auto v = PagedKeysView<kvscore::half>::paged(pool.data(), layout, slots, 1, H, D, req_to_token, 6);
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t t = 0; t < 6; ++t)
        REQUIRE(v.row(h, t) == pool.data() + std::size_t((req_to_token[std::size_t(t)] * H + h) * D));
      bool ok = true;
      const auto runs = runs_of(v, h, ok);
      REQUIRE(ok);
      REQUIRE(runs == std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 3}, {3, 2}, {5, 1}});
    }
  }
}

TEMPLATE_TEST_CASE("paged view: gathering the runs equals a contiguous copy", "[paged]", float, kvscore::half,
                   kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(22);
  for (int iter = 0; iter < 100; ++iter) {
    const Geometry g = random_geometry(rng);
    const std::vector<T> pool = test_support::random_bits<T>(g.pool_size(), rng);
    const auto v = view_of(g, pool.data());
    std::vector<T> via_runs(std::size_t(g.H * g.N * g.D)), via_ref(via_runs.size());
    for (std::int64_t h = 0; h < g.H; ++h) {
      v.for_each_run(h, [&](const T* first, std::int64_t t0, std::int64_t n, std::int64_t stride) {
        for (std::int64_t i = 0; i < n; ++i)
          std::memcpy(via_runs.data() + (h * g.N + t0 + i) * g.D, first + i * stride, std::size_t(g.D) * sizeof(T));
      });
      for (std::int64_t t = 0; t < g.N; ++t)
        std::memcpy(via_ref.data() + (h * g.N + t) * g.D, pool.data() + g.ref_offset(h, t), std::size_t(g.D) * sizeof(T));
    }
    REQUIRE((via_ref.empty() || std::memcmp(via_runs.data(), via_ref.data(), via_ref.size() * sizeof(T)) == 0));
  }
}

TEST_CASE("paged view: bad tables and geometries throw std::invalid_argument naming the value", "[paged][errors]") {
  std::vector<float> pool(8 * 4 * 2 * 8);
  const std::vector<std::int32_t> ids{3, 1, 7};
  const std::vector<std::int64_t> bad_ids{3, 8, 1};
  CHECK_THAT(error_of([&] { BlockTable(ids, 0, 8, 5); }), Catch::Contains("block_size") && Catch::Contains("got 0"));
  CHECK_THAT(error_of([&] { BlockTable(ids, 4, -1, 5); }), Catch::Contains("num_blocks") && Catch::Contains("-1"));
  CHECK_THAT(error_of([&] { BlockTable(ids, 4, 8, -2); }), Catch::Contains("tokens") && Catch::Contains("-2"));
  CHECK_THAT(error_of([&] { BlockTable(ids, 4, 8, 13); }),
             Catch::Contains("3 entries") && Catch::Contains("13 tokens need 4 blocks of 4"));
  CHECK_THAT(error_of([&] { BlockTable(bad_ids, 4, 8, 12); }),
             Catch::Contains("block_table[1] = 8") && Catch::Contains("[0, 8)"));
  const std::vector<std::int32_t> negative{2, -1};
  CHECK_THAT(error_of([&] { BlockTable(negative, 4, 8, 5); }), Catch::Contains("block_table[1] = -1"));
  // entries past the sequence's blocks are not read
  REQUIRE(BlockTable(bad_ids, 4, 8, 4).blocks_used() == 1);
  const BlockTable t(ids, 4, 8, 10);
  CHECK_THAT(error_of([&] { PagedKeysView<float>::nhd(pool.data(), -1, 8, t); }), Catch::Contains("-1"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>::nhd(pool.data(), 2, 0, t); }),
             Catch::Contains("head_dim") && Catch::Contains("got 0"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>::hnd(nullptr, 2, 8, t); }), Catch::Contains("null"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>(pool.data(), t, 2, 8, 64, 8, 8); }),
             Catch::Contains("head_stride 8") && Catch::Contains("overlap"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>(pool.data(), t, 2, 8, 16, 8, 16); }),
             Catch::Contains("block_stride 16") && Catch::Contains("overlap"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>(pool.data(), t, 2, 8, 64, 8, -16); }), Catch::Contains("-16"));
  CHECK_THAT(error_of([&] { PagedKeysView<float>(pool.data(), t, 2, 8, std::int64_t(1) << 61, 8, 16); }),
             Catch::Contains("overflow"));
  // empty sequences need no data
  REQUIRE(PagedKeysView<float>::nhd(nullptr, 2, 8, BlockTable(ids, 4, 8, 0)).empty());
  // other nestings work through the general constructor: heads outermost [kv_heads, num_blocks, block_size, d]
  const auto outer = PagedKeysView<float>(pool.data(), t, 2, 8, /*block*/ 4 * 8, /*head*/ 8 * 4 * 8, /*token*/ 8);
  REQUIRE(outer.row(1, 5) == pool.data() + 8 * 4 * 8 + 1 * 32 + 1 * 8);
}

TEST_CASE("selection -> physical slots", "[paged]") {
  std::mt19937_64 rng(23);
  for (int iter = 0; iter < 100; ++iter) {
    const Geometry g = random_geometry(rng);
    std::vector<float> pool(g.pool_size());
    const auto v = view_of(g, pool.data());
    const Selection s = random_selection(g.H, g.N, rng);
    const kvscore::PhysicalSlots ps = kvscore::physical_slots(v, s);
    REQUIRE(ps.heads == g.H);
    REQUIRE(ps.block_size == g.BS);
    for (std::int64_t h = 0; h < g.H; ++h) {
      const auto keep = s.head(h);
      const auto slots = ps.head(h);
      const auto flat = ps.slot_mapping(h);
      REQUIRE(slots.size() == keep.size());
      for (std::size_t i = 0; i < keep.size(); ++i) {
        const std::int64_t p = keep[i];
        REQUIRE(slots[i] == PhysicalSlot{g.ids64[std::size_t(p / g.BS)], p % g.BS});
        REQUIRE(flat[i] == g.ids64[std::size_t(p / g.BS)] * g.BS + p % g.BS);
      }
    }
  }
  std::vector<float> pool(4 * 2 * 2 * 8);
  const std::vector<std::int32_t> ids{3, 1};
  const auto v = PagedKeysView<float>::nhd(pool.data(), 2, 8, BlockTable(ids, 2, 4, 4));
  Selection wrong;
  wrong.heads = 3;
  wrong.tokens = 4;
  wrong.offsets = {0, 0, 0, 0};
  CHECK_THAT(error_of([&] { kvscore::physical_slots(v, wrong); }), Catch::Contains("3 heads"));
  wrong.tokens = 5;
  CHECK_THAT(error_of([&] { kvscore::physical_slots(v.table(), wrong); }), Catch::Contains("5 tokens"));
}

TEMPLATE_TEST_CASE("compact a paged sequence in place: other blocks untouched", "[paged][compact]", float,
                   kvscore::half, kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(24);
  for (int iter = 0; iter < 200; ++iter) {
    const Geometry g = random_geometry(rng, iter % 4 == 0);
    std::vector<T> kpool = test_support::random_bits<T>(g.pool_size(), rng), vpool = test_support::random_bits<T>(g.pool_size(), rng);
    const std::vector<T> k0 = kpool, v0 = vpool;
    const BlockTable table = g.table();
    const auto kv = g.layout == PagedLayout::nhd ? MutPagedKeysView<T>::nhd(kpool.data(), g.H, g.D, table)
                                                 : MutPagedKeysView<T>::hnd(kpool.data(), g.H, g.D, table);
    const auto vv = g.layout == PagedLayout::nhd ? MutPagedKeysView<T>::nhd(vpool.data(), g.H, g.D, table)
                                                 : MutPagedKeysView<T>::hnd(vpool.data(), g.H, g.D, table);
    const Selection s = random_selection(g.H, g.N, rng);
    const kvscore::CompactTail tail = (iter & 1) ? kvscore::CompactTail::zero : kvscore::CompactTail::keep;
    kvscore::CompactOptions opts;
    opts.tail = tail;
    const auto lengths = kvscore::compact(kv, vv, s, opts);
    for (std::int64_t h = 0; h < g.H; ++h) REQUIRE(lengths[std::size_t(h)] == s.kept(h));
    for (const auto* pair : {&k0, &v0}) {
      std::vector<T> expect = *pair;
      for (std::int64_t h = 0; h < g.H; ++h) {
        const auto keep = s.head(h);
        for (std::size_t i = 0; i < keep.size(); ++i)
          std::memcpy(expect.data() + g.ref_offset(h, std::int64_t(i)), pair->data() + g.ref_offset(h, keep[i]),
                      std::size_t(g.D) * sizeof(T));
        if (tail == kvscore::CompactTail::zero)
          for (std::int64_t t = std::int64_t(keep.size()); t < g.N; ++t)
            std::memset(static_cast<void*>(expect.data() + g.ref_offset(h, t)), 0, std::size_t(g.D) * sizeof(T));
      }
      const std::vector<T>& got = pair == &k0 ? kpool : vpool;
      REQUIRE((expect.empty() || std::memcmp(got.data(), expect.data(), expect.size() * sizeof(T)) == 0));
    }
  }
}

TEST_CASE("compact a paged sequence: a block listed twice is rejected before any write", "[paged][compact][errors]") {
  std::vector<float> pool(6 * 4 * 1 * 2);
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = float(i);
  const std::vector<float> before = pool;
  const std::vector<std::int64_t> ids{4, 1, 4};
  const auto v = MutPagedKeysView<float>::nhd(pool.data(), 1, 2, BlockTable(ids, 4, 6, 10));
  Selection s;
  s.heads = 1;
  s.tokens = 10;
  s.positions = {1, 9};
  s.offsets = {0, 2};
  CHECK_THAT(error_of([&] { kvscore::compact(v, s); }),
             Catch::Contains("block_table[2] = 4") && Catch::Contains("distinct"));
  REQUIRE(pool == before);
  // scoring it is fine: the read-only view allows repeated blocks
  REQUIRE(v.view().row(0, 8) == v.view().row(0, 0));
}

// ---- scoring a paged view equals scoring its contiguous copy (every scorer, every dtype)

namespace {

/// A scorer gives the same scores (to 1e-5 relative) on a view and on its contiguous copy.
template <class T, class Scorer, class View>
void require_same_scores(const Scorer& scorer, const View& view, const kvscore::KeysView<T>& contiguous) {
  const kvscore::Scores a = scorer.score(view), b = scorer.score(contiguous);
  REQUIRE(a.heads() == b.heads());
  REQUIRE(a.tokens() == b.tokens());
  for (std::size_t i = 0; i < a.values().size(); ++i) {
    const float x = a.values()[i], y = b.values()[i];
    INFO(Scorer::name << " " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " i=" << i);
    REQUIRE(std::abs(double(x) - double(y)) <= 1e-5 * (std::abs(double(y)) + 1.0));
  }
}

template <class T, class Scorer>
void check_paged_scores(const Scorer& scorer, std::mt19937_64& rng) {
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (int iter = 0; iter < 40; ++iter) {
    Geometry g = random_geometry(rng, iter % 4 == 0);
    g.D = 16 + std::int64_t(rng() % 20);  // fixed below for QFilter
    if constexpr (std::is_same_v<Scorer, kvscore::QFilter>) {
      g.H = scorer.kv_heads();
      g.D = scorer.head_dim();
    }
    std::vector<T> pool(g.pool_size());
    for (auto& x : pool) x = kvscore::from_float<T>(gauss(rng) + 0.5f);
    const auto paged = view_of(g, pool.data());
    std::vector<T> flat(std::size_t(g.H * g.N * g.D));
    for (std::int64_t h = 0; h < g.H; ++h)
      for (std::int64_t t = 0; t < g.N; ++t)
        std::memcpy(flat.data() + (h * g.N + t) * g.D, paged.row(h, t), std::size_t(g.D) * sizeof(T));
    const auto contiguous = kvscore::KeysView<T>::hf(flat.data(), 0, 1, g.H, g.N, g.D);
    require_same_scores<T>(scorer, paged, contiguous);
  }
}

struct PagedCheck {
  template <class T, class Scorer>
  static void run(const Scorer& s, std::mt19937_64& rng) { check_paged_scores<T>(s, rng); }
};

/// Check::run<T>(scorer, rng) for every scorer of the registry that needs no queries.
template <class T, class Check = PagedCheck>
void check_all_scorers(std::mt19937_64& rng) {
  Check::template run<T>(kvscore::KNorm{}, rng);
  Check::template run<T>(kvscore::KeyDiff{}, rng);
  Check::template run<T>(kvscore::ManifoldL2{}, rng);
  Check::template run<T>(kvscore::WindowedManifoldL2{7}, rng);
  const std::int64_t H = 3, D = 24;
  std::vector<float> filters(std::size_t(H * D));
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (auto& f : filters) f = gauss(rng);
  Check::template run<T>(kvscore::QFilter(filters, H, D), rng);
}

}  // namespace

TEST_CASE("scoring a PagedKeysView equals scoring the contiguous copy (every scorer and dtype)", "[paged][scorers]") {
  std::mt19937_64 rng(25);
  check_all_scorers<float>(rng);
  check_all_scorers<kvscore::half>(rng);
  check_all_scorers<kvscore::bfloat16>(rng);
}

// ------------------------------------------------------------------ vLLM CPU (transposed keys)

namespace {

/// A vLLM CPU pool [NB][H][BS][2 * D] filled from contiguous keys flat[h][t][d] (and values after
/// the keys of each tile), written with the layout's formula here: key element j of token t
/// (block b = table[t / BS], row o = t % BS) at ((b * H + h) * 2 * BS * D) + j * BS + o.
template <class T>
std::vector<T> vllm_cpu_pool(const Geometry& g, const std::vector<T>& flat, T fill) {
  std::vector<T> pool(std::size_t(g.NB * g.H * 2 * g.BS * g.D), fill);
  for (std::int64_t h = 0; h < g.H; ++h)
    for (std::int64_t t = 0; t < g.N; ++t)
      for (std::int64_t j = 0; j < g.D; ++j) {
        const std::int64_t b = g.ids64[std::size_t(t / g.BS)], o = t % g.BS;
        pool[std::size_t((b * g.H + h) * 2 * g.BS * g.D + j * g.BS + o)] = flat[std::size_t((h * g.N + t) * g.D + j)];
      }
  return pool;
}

template <class T, class Scorer>
void check_vllm_cpu_scores(const Scorer& scorer, std::mt19937_64& rng) {
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (int iter = 0; iter < 30; ++iter) {
    Geometry g = random_geometry(rng, iter % 4 == 0);
    g.D = 16 + std::int64_t(rng() % 20);
    if constexpr (std::is_same_v<Scorer, kvscore::QFilter>) {
      g.H = scorer.kv_heads();
      g.D = scorer.head_dim();
    }
    std::vector<T> flat(std::size_t(g.H * g.N * g.D));
    for (auto& x : flat) x = kvscore::from_float<T>(gauss(rng) + 0.5f);
    const std::vector<T> pool = vllm_cpu_pool(g, flat, kvscore::from_float<T>(1e30f));
    const auto view = kvscore::TransposedPagedKeysView<T>::vllm_cpu(pool.data(), g.H, g.D, g.table());
    const auto contiguous = kvscore::KeysView<T>::hf(flat.data(), 0, 1, g.H, g.N, g.D);
    require_same_scores<T>(scorer, view, contiguous);
  }
}

struct VllmCpuCheck {
  template <class T, class Scorer>
  static void run(const Scorer& s, std::mt19937_64& rng) { check_vllm_cpu_scores<T>(s, rng); }
};

}  // namespace

TEMPLATE_TEST_CASE("vLLM CPU view: at(h, t, j) and for_each_run give the keys written with the layout's formula",
                   "[paged][vllm]", float, kvscore::half, kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(31);
  for (int iter = 0; iter < 200; ++iter) {
    const Geometry g = random_geometry(rng, iter % 3 == 0);
    std::vector<T> flat(std::size_t(g.H * g.N * g.D));
    for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = kvscore::from_float<T>(float(i % 1000) + 1.f);
    const std::vector<T> pool = vllm_cpu_pool(g, flat, kvscore::from_float<T>(-1.f));
    const auto v = kvscore::TransposedPagedKeysView<T>::vllm_cpu(pool.data(), g.H, g.D, g.table());
    REQUIRE(v.tokens() == g.N);
    REQUIRE(v.heads() == g.H);
    REQUIRE(v.block_stride() == g.H * 2 * g.BS * g.D);
    REQUIRE(v.head_stride() == 2 * g.BS * g.D);
    for (std::int64_t h = 0; h < g.H; ++h) {
      std::int64_t next = 0;
      v.for_each_run(h, [&](const T* rows, std::int64_t t0, std::int64_t n, std::int64_t stride) {
        REQUIRE(t0 == next);
        REQUIRE(stride == g.D);
        REQUIRE(n == std::min(g.BS, g.N - t0));  // one call per block, the last one partial
        for (std::int64_t i = 0; i < n; ++i)
          for (std::int64_t j = 0; j < g.D; ++j) {
            const T want = flat[std::size_t((h * g.N + t0 + i) * g.D + j)];
            REQUIRE(std::memcmp(&rows[i * stride + j], &want, sizeof(T)) == 0);
            const T got = v.at(h, t0 + i, j);
            REQUIRE(std::memcmp(&got, &want, sizeof(T)) == 0);
          }
        next = t0 + n;
      });
      REQUIRE(next == g.N);
    }
  }
}

TEST_CASE("scoring a vLLM CPU view equals scoring the contiguous copy (every scorer and dtype)",
          "[paged][vllm][scorers]") {
  std::mt19937_64 rng(26);
  check_all_scorers<float, VllmCpuCheck>(rng);
  check_all_scorers<kvscore::half, VllmCpuCheck>(rng);
  check_all_scorers<kvscore::bfloat16, VllmCpuCheck>(rng);
}

TEST_CASE("vLLM CPU view: bad geometries throw std::invalid_argument naming the value", "[paged][vllm][errors]") {
  std::vector<float> pool(4 * 2 * 32 * 2 * 8, 0.f);
  const std::vector<std::int32_t> ids{1, 3};
  const BlockTable t(std::span<const std::int32_t>(ids), 32, 4, 40);
  using V = kvscore::TransposedPagedKeysView<float>;
  CHECK(error_of([&] { V::vllm_cpu(pool.data(), 2, 0, t); }).find("head_dim must be in [1,") != std::string::npos);
  CHECK(error_of([&] { V::vllm_cpu(nullptr, 2, 8, t); }).find("data is null") != std::string::npos);
  // head tiles of 8 * 32 elements 100 apart overlap
  CHECK(error_of([&] { V(pool.data(), t, 2, 8, 1024, 100); }).find("head_stride 100 makes rows overlap") !=
        std::string::npos);
  CHECK(error_of([&] { V(pool.data(), t, 2, 8, -1, 512); }).find("block_stride must be >= 0 (got -1)") !=
        std::string::npos);
  const std::vector<std::int32_t> bad{1, 4};
  CHECK(error_of([&] { BlockTable(std::span<const std::int32_t>(bad), 32, 4, 40); })
            .find("block_table[1] = 4 out of range [0, 4)") != std::string::npos);
}
