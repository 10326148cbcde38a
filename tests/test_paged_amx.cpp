// vLLM CPU's `amx` key layout (AmxPagedKeysView): pools packed here by a routine written from
// vLLM's reshape_and_cache (csrc/cpu/cpu_attn_amx.hpp: each key's 4-byte quadwords stored 16
// tokens apart, in groups of 16 tokens), independently of the view's own formula, read back
// bit for bit by at() and for_each_run; every scorer on the view equals the contiguous copy;
// PagedBlockSelector and BlockSparsePlanner over the amx view choose the same blocks as over the
// same keys in the transposed (vec) layout; vllm_cpu_key_layout's ISA map; every error.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/block_sparse.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/make_scorer.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace {

using kvscore::AmxPagedKeysView;
using kvscore::BlockTable;
using kvscore::TransposedPagedKeysView;
using test_support::error_of;

/// One layer's pool [NB][H][BS][2 * D] with one sequence of N tokens over `ids`, filled from
/// flat[h][t][j] the way vLLM's AMX reshape_and_cache writes it: per token, the key's int32
/// quadwords (4 / sizeof(T) elements each) go to the (block, head) tile as int32s at
/// (o / 16) * 16 * (D / P) + o % 16 + q * 16. (The transposed pool: element j at j * BS + o.)
template <class T>
std::vector<T> pack(std::int64_t NB, std::int64_t H, std::int64_t BS, std::int64_t D, const std::vector<std::int64_t>& ids,
                    std::int64_t N, const std::vector<T>& flat, bool amx, T fill) {
  std::vector<T> pool(std::size_t(NB * H * 2 * BS * D), fill);
  constexpr std::int64_t P = 4 / sizeof(T);
  const std::int64_t quadwords = D / P;
  for (std::int64_t t = 0; t < N; ++t)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t b = ids[std::size_t(t / BS)], o = t % BS;
      T* tile = pool.data() + (b * H + h) * 2 * BS * D;
      const T* key = flat.data() + (h * N + t) * D;
      if (!amx) {
        for (std::int64_t j = 0; j < D; ++j) tile[j * BS + o] = key[j];
        continue;
      }
      auto* dst = reinterpret_cast<unsigned char*>(tile) + 4 * ((o / 16) * 16 * quadwords + o % 16);
      for (std::int64_t q = 0; q < quadwords; ++q) std::memcpy(dst + 4 * 16 * q, key + q * P, 4);
    }
  return pool;
}

struct Geo {
  std::int64_t NB = 0, BS = 16, H = 1, D = 2, N = 0;
  std::vector<std::int64_t> ids;
  std::vector<std::int32_t> ids32;
  BlockTable table() const { return BlockTable(std::span<const std::int32_t>(ids32), BS, NB, N); }
};

template <class T>
Geo random_geo(std::mt19937_64& rng) {
  constexpr std::int64_t P = 4 / sizeof(T);
  Geo g;
  g.BS = 16 * (1 + std::int64_t(rng() % 3));
  g.H = 1 + std::int64_t(rng() % 3);
  g.D = P * (1 + std::int64_t(rng() % 40));
  g.N = std::int64_t(rng() % 150);
  const std::int64_t used = kvscore::blocks_for(g.N, g.BS);
  g.NB = used + 1 + std::int64_t(rng() % 4);
  std::vector<std::int64_t> all(std::size_t(g.NB));
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), rng);
  g.ids.assign(all.begin(), all.begin() + used);
  g.ids32.assign(g.ids.begin(), g.ids.end());
  return g;
}

}  // namespace

TEMPLATE_TEST_CASE("vLLM CPU amx view: at(h, t, j) and for_each_run give the keys vLLM's packing wrote",
                   "[paged][vllm][amx]", float, kvscore::half, kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(66);
  for (int iter = 0; iter < 150; ++iter) {
    const Geo g = random_geo<T>(rng);
    std::vector<T> flat(std::size_t(g.H * g.N * g.D));
    for (std::size_t i = 0; i < flat.size(); ++i) flat[i] = kvscore::from_float<T>(float(i % 1000) + 1.f);
    const std::vector<T> pool = pack(g.NB, g.H, g.BS, g.D, g.ids, g.N, flat, true, kvscore::from_float<T>(-1.f));
    const auto v = AmxPagedKeysView<T>::vllm_cpu(pool.data(), g.H, g.D, g.table());
    REQUIRE(v.tokens() == g.N);
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

TEMPLATE_TEST_CASE("scoring a vLLM CPU amx view equals scoring the contiguous copy", "[paged][vllm][amx][scorers]",
                   float, kvscore::bfloat16) {
  using T = TestType;
  std::mt19937_64 rng(67);
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (const char* name : {"knorm", "keydiff", "manifoldkv", "windowed_manifold_l2"}) {
    const kvscore::AnyScorer scorer = kvscore::make_scorer(name, {});
    for (int iter = 0; iter < 6; ++iter) {
      Geo g = random_geo<T>(rng);
      g.N = std::max<std::int64_t>(g.N, 1);
      if (kvscore::blocks_for(g.N, g.BS) > std::int64_t(g.ids.size())) continue;
      std::vector<T> flat(std::size_t(g.H * g.N * g.D));
      for (auto& x : flat) x = kvscore::from_float<T>(gauss(rng) + 0.5f);
      const std::vector<T> pool = pack(g.NB, g.H, g.BS, g.D, g.ids, g.N, flat, true, kvscore::from_float<T>(1e30f));
      const auto view = AmxPagedKeysView<T>::vllm_cpu(pool.data(), g.H, g.D, g.table());
      const auto contiguous = kvscore::KeysView<T>::hf(flat.data(), 0, 1, g.H, g.N, g.D);
      const kvscore::Scores a = scorer.score(view), b = scorer.score(contiguous);
      INFO(name << " H " << g.H << " N " << g.N << " D " << g.D << " BS " << g.BS);
      REQUIRE(a.heads() == b.heads());
      REQUIRE(a.tokens() == b.tokens());
      for (std::int64_t h = 0; h < a.heads(); ++h)
        for (std::int64_t t = 0; t < a.tokens(); ++t)  // KeyDiff's mean sums per run: a rounding apart
          REQUIRE(std::abs(double(a(h, t)) - double(b(h, t))) <= 1e-5 * (std::abs(double(b(h, t))) + 1.0));
    }
  }
}

TEST_CASE("PagedBlockSelector and BlockSparsePlanner over the amx view choose what they choose over the vec layout",
          "[block_sparse][vllm][amx]") {
  using T = kvscore::bfloat16;
  const std::int64_t NB = 40, H = 2, G = 3, bs = 32, d = 64;
  std::mt19937_64 rng(68);
  std::normal_distribution<float> gauss(0.f, 1.f);
  // three sequences over shuffled blocks of one pool, and the same keys in both layouts
  std::vector<std::int64_t> perm(NB);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  const std::vector<std::int64_t> lens{390, 300, 150};
  std::vector<T> flat(std::size_t(NB * bs * H * d));
  for (auto& x : flat) x = kvscore::from_float<T>(gauss(rng));
  // pack the whole pool as one "sequence" over perm, so that every block holds keys
  const std::vector<T> amx = pack(NB, H, bs, d, perm, NB * bs, flat, true, T{});
  const std::vector<T> vec = pack(NB, H, bs, d, perm, NB * bs, flat, false, T{});
  std::vector<std::vector<std::int32_t>> tables;
  for (std::size_t i = 0, at = 0; i < lens.size(); ++i) {
    const std::int64_t nb = kvscore::blocks_for(lens[i], bs);
    tables.emplace_back(perm.begin() + std::ptrdiff_t(at), perm.begin() + std::ptrdiff_t(at + std::size_t(nb)));
    at += std::size_t(nb);
  }
  const BlockTable none(std::span<const std::int32_t>(), bs, NB, 0);
  const auto va = AmxPagedKeysView<T>::vllm_cpu(amx.data(), H, d, none);
  const auto vv = TransposedPagedKeysView<T>::vllm_cpu(vec.data(), H, d, none);
  for (const kvscore::BlockScore how : kvscore::kBlockScores) {
    kvscore::BlockSparseOptions o;
    o.score = how;
    o.refresh = 2;  // kept choices between scored steps, as the plugin's default may
    kvscore::PagedBlockSelector sa(1, NB, H, d, bs, o), sv(1, NB, H, d, bs, o);
    // the planner over type-erased caches of both layouts
    kvscore::BlockSparsePlanner pa(1, NB, H, d, bs, o), pv(1, NB, H, d, bs, o);
    pa.register_caches({{kvscore::dtype::bf16, kvscore::KeyCacheLayout::vllm_cpu_amx, amx.data(), NB, H, bs, d}});
    pv.register_caches({{kvscore::dtype::bf16, kvscore::KeyCacheLayout::vllm_cpu, vec.data(), NB, H, bs, d}});
    std::vector<std::int64_t> live;
    for (const auto& t : tables) live.push_back(t[0]);
    const std::int64_t per = 16;
    std::vector<std::int32_t> src(std::size_t(3 * per), 0);
    for (std::size_t i = 0; i < 3; ++i) std::copy(tables[i].begin(), tables[i].end(), src.begin() + std::ptrdiff_t(i * per));
    for (int step = 0; step < 4; ++step) {
      sa.begin_step({}, live);
      sv.begin_step({}, live);
      pa.begin_step({}, live);
      pv.begin_step({}, live);
      std::vector<std::vector<float>> q(3);
      std::vector<std::vector<std::int32_t>> oa(3), ov(3);
      std::vector<kvscore::BlockSparseRow> ra, rv;
      std::vector<std::int64_t> att, rows{0, 1, 2}, ti{0, 1, 2};
      std::vector<float> qs;
      for (std::size_t i = 0; i < 3; ++i) {
        for (std::int64_t k = 0; k < H * G * d; ++k) q[i].push_back(gauss(rng));
        qs.insert(qs.end(), q[i].begin(), q[i].end());
        att.push_back(kvscore::attended_blocks(lens[i], bs, 0.3, o));
        oa[i].assign(std::size_t(att[i]), -1);
        ov[i].assign(std::size_t(att[i]), -1);
        ra.push_back({tables[i], lens[i], q[i].data(), att[i], oa[i].data()});
        rv.push_back({tables[i], lens[i], q[i].data(), att[i], ov[i].data()});
      }
      sa.select(0, va, H * G, ra);
      sv.select(0, vv, H * G, rv);
      std::vector<std::int32_t> da(src), dv(src);
      pa.plan(ti, {src.data(), 3, per, per}, rows, lens, att, {da.data(), 3, per, per});
      pv.plan(ti, {src.data(), 3, per, per}, rows, lens, att, {dv.data(), 3, per, per});
      const kvscore::QueryTensor qt{kvscore::dtype::f32, qs.data(), 3, H * G, d, {H * G * d, d, 1}};
      CHECK(pa.select_planned(0, qt) == pv.select_planned(0, qt));
      INFO(kvscore::to_string(how) << " step " << step);
      for (std::size_t i = 0; i < 3; ++i) {
        CHECK(oa[i] == ov[i]);
        CHECK(std::find(oa[i].begin(), oa[i].end(), -1) == oa[i].end());
      }
      CHECK(da == dv);
      if (step == 0) {  // scored: the reference's choice on the keys read back through the amx view
        for (std::size_t i = 0; i < 3; ++i) {
          const BlockTable t(std::span<const std::int32_t>(tables[i]), bs, NB, lens[i]);
          const auto v = AmxPagedKeysView<T>::vllm_cpu(amx.data(), H, d, t);
          std::vector<float> keys(std::size_t(H * lens[i] * d));
          for (std::int64_t h = 0; h < H; ++h)
            for (std::int64_t tok = 0; tok < lens[i]; ++tok)
              for (std::int64_t j = 0; j < d; ++j)
                keys[std::size_t((h * lens[i] + tok) * d + j)] = kvscore::to_float(v.at(h, tok, j));
          const auto ref = kvscore::block_sparse_reference(keys.data(), H, lens[i], d, bs, q[i].data(), H * G, att[i], o);
          std::vector<std::int32_t> want;
          for (const auto b : ref) want.push_back(tables[i][std::size_t(b)]);
          CHECK(oa[i] == want);
        }
      }
    }
  }
}

TEST_CASE("vllm_cpu_key_layout: vLLM's ISA names to key layouts, others refused naming the ISA", "[paged][vllm][amx]") {
  using kvscore::VllmCpuKeyLayout;
  using kvscore::dtype;
  for (const dtype dt : {dtype::f32, dtype::f16, dtype::bf16}) {
    CHECK(kvscore::vllm_cpu_key_layout("vec", dt) == VllmCpuKeyLayout::transposed);
    CHECK(kvscore::vllm_cpu_key_layout("vec16", dt) == VllmCpuKeyLayout::transposed);
    CHECK(kvscore::vllm_cpu_key_layout("amx", dt) == VllmCpuKeyLayout::amx);
  }
  CHECK(kvscore::vllm_cpu_key_layout("neon", dtype::f32) == VllmCpuKeyLayout::transposed);
  CHECK(kvscore::vllm_cpu_key_layout("neon", dtype::f16) == VllmCpuKeyLayout::transposed);
  CHECK(error_of([] { kvscore::vllm_cpu_key_layout("neon", dtype::bf16); })
            .find("ISA 'neon' with bfloat16 keys") != std::string::npos);
  CHECK(error_of([] { kvscore::vllm_cpu_key_layout("vsx", dtype::f32); }).find("ISA 'vsx'") != std::string::npos);
  CHECK(kvscore::key_cache_layout(VllmCpuKeyLayout::amx) == kvscore::KeyCacheLayout::vllm_cpu_amx);
  CHECK(kvscore::key_cache_layout(VllmCpuKeyLayout::transposed) == kvscore::KeyCacheLayout::vllm_cpu);
}

TEST_CASE("vLLM CPU amx view: bad geometries throw std::invalid_argument naming the value", "[paged][vllm][amx][errors]") {
  std::vector<kvscore::bfloat16> pool(4 * 2 * 32 * 2 * 64);
  const std::vector<std::int32_t> ids{1, 3};
  const BlockTable t(std::span<const std::int32_t>(ids), 32, 4, 40);
  using V = AmxPagedKeysView<kvscore::bfloat16>;
  CHECK(error_of([&] { V::vllm_cpu(pool.data(), 2, 63, t); }).find("head_dim must be a multiple of 2 for 2-byte") !=
        std::string::npos);
  CHECK(error_of([&] { V::vllm_cpu(nullptr, 2, 64, t); }).find("data is null") != std::string::npos);
  const BlockTable t24(std::span<const std::int32_t>(ids), 24, 4, 40);
  CHECK(error_of([&] { V::vllm_cpu(pool.data(), 2, 64, t24); }).find("block_size must be a multiple of 16 (got 24)") !=
        std::string::npos);
  CHECK(error_of([&] { V(pool.data(), t, 2, 64, 8192, 100); }).find("head_stride 100 makes rows overlap") !=
        std::string::npos);
  // fp32: one element per quadword, any head_dim
  std::vector<float> f(4 * 2 * 32 * 2 * 7);
  CHECK(AmxPagedKeysView<float>::vllm_cpu(f.data(), 2, 7, t).head_dim() == 7);
}
