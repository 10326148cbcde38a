// cuda/tests/test_cuda.cpp — the CUDA path against the CPU path on the same data.
//
// GPU tests ([gpu]) compare every kernel with the CPU reference (kvscore/scorers/*.hpp,
// select.hpp, compact.hpp) on identical inputs: selections and compacted caches must be
// identical (random data without ties, plus tie/NaN/±0/±inf cases against the CPU's documented
// order); scores must agree to 1e-5 relative (see check_scores for the one documented floor),
// SnapKV to its derived bound (test_snapkv.cpp's). Without a device, main() says so and runs
// only the host-side tests: type rules, argument checks, and CUDA errors as exceptions.
#include "cuda_harness.hpp"

#include <cuda_runtime.h>

#include <kvscore/compact.hpp>
#include <kvscore/cuda/compact.hpp>
#include <kvscore/cuda/device.hpp>
#include <kvscore/cuda/scorers.hpp>
#include <kvscore/cuda/select.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvscore::bfloat16;
using kvscore::half;
using Catch::Matchers::Contains;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The memory space is in the type: device views are not CPU views and do not convert.
static_assert(!kvscore::KeyCacheView<kc::DeviceKeysView<float>>);
static_assert(!kvscore::KeyCacheView<kc::DeviceKeysView<half>>);
static_assert(kvscore::KeyCacheView<kvscore::KeysView<half>>);
static_assert(!std::is_convertible_v<kc::DeviceScoresView, kvscore::ScoresView>);
static_assert(!std::is_convertible_v<kvscore::ScoresView, kc::DeviceScoresView>);
static_assert(!std::is_convertible_v<kvscore::KeysView<float>, kc::DeviceKeysView<float>>);
static_assert(!kvscore::MutableCacheView<kc::DeviceMutKeysView<float>>);
static_assert(kc::DeviceKeysView<float>::space == kc::MemorySpace::device);

template <class T>
std::vector<T> make_keys(std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L, unsigned seed,
                         bool invalid_rows) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> k(std::size_t(L.elems), kvscore::from_float<T>(0.f));
  std::vector<float> dir(static_cast<std::size_t>(d));
  for (auto& x : dir) x = nd(rng);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < d; ++j)
        k[std::size_t(h * L.hs + t * L.ts + j)] = kvscore::from_float<T>(0.7f * dir[std::size_t(j)] + nd(rng));
  if (invalid_rows && N > 8) {
    k[std::size_t(0 * L.hs + 3 * L.ts + 1)] = kvscore::from_float<T>(kNaN);
    k[std::size_t((H - 1) * L.hs + 7 * L.ts)] = kvscore::from_float<T>(kInf);
    for (std::int64_t j = 0; j < d; ++j) k[std::size_t(0 * L.hs + 5 * L.ts + j)] = kvscore::from_float<T>(0.f);
  }
  return k;
}

/// GPU vs CPU scores: -inf exactly where the CPU has -inf, otherwise |gpu - cpu| <= 1e-5·|cpu|,
/// with a floor of 1e-5 · (largest |cpu| of the head) for QFilter and KeyDiff, whose scores are
/// dot products: cancellation makes a relative bound meaningless near 0 for any two summation
/// orders (the absolute error of a dot is bounded by d·u·Σ|k_j v_j|, not by |k·v|).
void check_scores(const std::vector<float>& cpu, const std::vector<float>& gpu, std::int64_t H, std::int64_t N,
                  bool dot_floor, double rel = 1e-5) {
  for (std::int64_t h = 0; h < H; ++h) {
    double mx = 0;
    for (std::int64_t t = 0; t < N; ++t)
      if (std::isfinite(cpu[std::size_t(h * N + t)])) mx = std::max(mx, double(std::fabs(cpu[std::size_t(h * N + t)])));
    for (std::int64_t t = 0; t < N; ++t) {
      const float c = cpu[std::size_t(h * N + t)], g = gpu[std::size_t(h * N + t)];
      INFO("head " << h << " token " << t << " cpu " << c << " gpu " << g);
      REQUIRE(!std::isnan(g));
      if (std::isinf(c)) {
        REQUIRE(g == c);
        continue;
      }
      const double tol = rel * std::fabs(double(c)) + (dot_floor ? rel * mx : 0.0) + 1e-30;
      REQUIRE(std::fabs(double(g) - double(c)) <= tol);
    }
  }
}

template <class S, class T>
void compare_scorer(const S& s_in, std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L, bool dot_floor) {
  INFO("scorer " << S::name << " dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " d " << d << " layout "
                 << L.name << " H " << H << " N " << N);
  S s = s_in;
  s.num_threads = 1;
  const std::vector<T> host = make_keys<T>(H, N, d, L, unsigned(H * 131 + N * 7 + d), true);
  const kvscore::Scores cpu = s.score(kvscore::KeysView<T>(host.data(), H, N, d, L.hs, L.ts));
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<T> keys(dk.as<T>(), H, N, d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys));
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  kc::score(s, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()});
  kc::synchronize();
  const std::vector<float> gpu = download<float>(out, std::size_t(H * N));
  check_scores(cpu.values(), gpu, H, N, dot_floor);
  // Deterministic: a second run gives the same bits.
  kc::score(s, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()});
  kc::synchronize();
  const std::vector<float> again = download<float>(out, std::size_t(H * N));
  REQUIRE(std::memcmp(gpu.data(), again.data(), gpu.size() * sizeof(float)) == 0);
}

template <class T>
void all_geometric(std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L) {
  compare_scorer<kvscore::KNorm, T>(kvscore::KNorm{}, H, N, d, L, false);
  compare_scorer<kvscore::ManifoldL2, T>(kvscore::ManifoldL2{}, H, N, d, L, false);
  compare_scorer<kvscore::KeyDiff, T>(kvscore::KeyDiff{}, H, N, d, L, true);
  compare_scorer<kvscore::WindowedManifoldL2, T>(kvscore::WindowedManifoldL2(256), H, N, d, L, false);
  compare_scorer<kvscore::WindowedManifoldL2, T>(kvscore::WindowedManifoldL2(256, kvscore::WindowTail::own), H, N, d,
                                                 L, false);
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> f(std::size_t(H * d));
  for (auto& x : f) x = nd(rng);
  compare_scorer<kvscore::QFilter, T>(kvscore::QFilter(f, H, d), H, N, d, L, true);
}

// -------------------------------------------------------------- selection helpers

std::vector<float> random_scores(std::int64_t H, std::int64_t N, unsigned seed, int distinct = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> ud(0, std::max(distinct - 1, 0));
  std::vector<float> s(std::size_t(H * N));
  for (auto& x : s) x = distinct > 0 ? float(ud(rng)) : nd(rng);
  return s;
}

void compare_select(const std::vector<float>& scores, std::int64_t H, std::int64_t N, kvscore::Budget b,
                    const kvscore::SelectOptions& opt, kc::TopkPath path) {
  INFO("H " << H << " N " << N << " budget " << b.count() << " adakv " << (opt.alloc == kvscore::Alloc::adakv)
            << " sinks " << opt.sinks << " recent " << opt.recent << " alpha " << opt.alpha << " path "
            << int(path));
  const kvscore::Selection cpu = kvscore::select(kvscore::ConstScoresView(scores.data(), H, N), b, opt);
  const kc::DeviceBuffer d = upload(scores);
  const kvscore::Selection gpu = kc::select(kc::DeviceScoresView(d.as<float>(), H, N), b, opt, nullptr, path);
  REQUIRE(gpu.offsets == cpu.offsets);
  REQUIRE(gpu.positions == cpu.positions);
}

const kc::TopkPath kPaths[] = {kc::TopkPath::one_cta_per_row, kc::TopkPath::multi_cta_per_row,
                               kc::TopkPath::automatic};

}  // namespace

// ================================================================ host-side (no GPU needed)

TEST_CASE("cuda: device views validate like the CPU views", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));  // never dereferenced on the host
  REQUIRE_THROWS_WITH((kc::DeviceKeysView<float>(fake, 2, 10, 8, 8, 8)), Contains("overlap"));
  REQUIRE_THROWS_WITH((kc::DeviceKeysView<float>(fake, -1, 10, 8, 80, 8)), Contains("heads must be >= 0 (got -1)"));
  REQUIRE_THROWS_WITH((kc::DeviceKeysView<float>(nullptr, 2, 10, 8, 80, 8)), Contains("data is null"));
  REQUIRE_THROWS_WITH((kc::DeviceKeysView<float>(fake, 2, 10, 5000, 50000, 5000)), Contains("5000"));
  REQUIRE_THROWS_WITH((kc::DeviceScoresView(fake, 2, 10, 5)), Contains("head_stride 5"));
  const auto v = kc::DeviceKeysView<half>::hf(reinterpret_cast<half*>(fake), 1, 2, 4, 10, 64, 16);
  REQUIRE(v.head_stride() == 16 * 64);
  REQUIRE(v.data() == reinterpret_cast<half*>(fake) + 4 * 16 * 64);
  REQUIRE_THROWS_WITH((kc::DeviceKeysView<float>::hf(fake, 2, 2, 4, 10, 64)), Contains("batch_index 2"));
}

TEST_CASE("cuda: arguments are checked before anything is launched", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> keys(fake, 2, 10, 8, 80, 8);
  REQUIRE_THROWS_WITH(kc::score(kvscore::KNorm{}, keys, kc::DeviceScoresView(fake, 2, 9)),
                      Contains("scores shape (2, 9) does not match keys (2, 10)"));
  const kvscore::QFilter q(std::vector<float>(3 * 8, 1.f), 3, 8);
  REQUIRE_THROWS_WITH(kc::score(q, keys, kc::DeviceScoresView(fake, 2, 10)), Contains("kv_heads 3"));
  const std::vector<float> queries(2 * 16 * 8, 0.5f);
  const kvscore::SnapKV snap(queries.data(), 2, 16, 8);
  REQUIRE_THROWS_WITH(kc::score(snap, keys, kc::DeviceScoresView(fake, 2, 10)), Contains("window 16 > tokens 10"));
  kvscore::SnapKV after = snap;  // queries that follow the cache: any window
  after.placement = kvscore::QueryPlacement::after_cache;
  REQUIRE(kc::score_workspace_bytes(after, keys) > 0);
  const kc::DeviceScoresView s(fake, 2, 10);
  REQUIRE_THROWS_WITH(kc::select_workspace_bytes(s, kvscore::Budget::per_head(11)), Contains("11"));
  kvscore::SelectOptions o;
  o.sinks = 8;
  o.recent = 4;
  REQUIRE_THROWS_WITH(kc::select_total(s, kvscore::Budget::per_head(5), o), Contains("protect 10"));
  o = {};
  o.alloc = kvscore::Alloc::adakv;
  o.normalize = true;  // AdaKV z-scores run on the GPU too
  REQUIRE(kc::select_total(s, kvscore::Budget::per_head(5), o) == 10);
  o.normalize = false;
  REQUIRE(kc::select_total(s, kvscore::Budget::per_head(5), o) == 10);
  REQUIRE_THROWS_WITH(kc::select_into(s, kvscore::Budget::per_head(5), {}, {}, nullptr, nullptr, 10),
                      Contains("offsets is null"));
  std::int64_t dummy = 0;
  REQUIRE_THROWS_WITH(kc::select_into(s, kvscore::Budget::per_head(5), {}, {}, &dummy, &dummy, 9),
                      Contains("capacity 9"));
  kvscore::Selection bad;
  bad.heads = 2;
  bad.tokens = 10;
  bad.offsets = {0, 1, 2};
  bad.positions = {3, 10};
  const kc::DeviceMutKeysView<float> cache(fake, 2, 10, 8, 80, 8);
  REQUIRE_THROWS_AS(kc::compact(cache, bad, {}), std::invalid_argument);
}

TEST_CASE("cuda: CUDA failures become kvscore::cuda::Error with the CUDA error string", "[cuda][host]") {
  if (kc::device_count() == 0) {
    // No device here: the runtime's own error (no device / no driver) must come through.
    try {
      kc::DeviceBuffer b(1024);
      FAIL("cudaMalloc succeeded without a device");
    } catch (const kc::Error& e) {
      REQUIRE(e.code() != 0);
      REQUIRE_THAT(e.what(), Contains("cudaMalloc") && Contains("cudaError"));
    }
  } else {
    try {
      kc::DeviceBuffer b(std::size_t(1) << 60);
      FAIL("a 2^60-byte cudaMalloc succeeded");
    } catch (const kc::Error& e) {
      REQUIRE(e.code() == 2);  // cudaErrorMemoryAllocation
      REQUIRE_THAT(e.what(), Contains("cudaErrorMemoryAllocation") && Contains("out of memory"));
    }
  }
}

// ================================================================ GPU: scorers

TEST_CASE("cuda: geometric scorers match the CPU path (fp32/fp16/bf16, head_dim 64/128/256/generic)", "[cuda][gpu]") {
  for (std::int64_t d : {64, 128, 256, 40}) {
    all_geometric<float>(3, 1100, d, hf(3, 1100, d));
    all_geometric<half>(3, 1100, d, hf(3, 1100, d));
    all_geometric<bfloat16>(3, 1100, d, hf(3, 1100, d));
  }
  all_geometric<half>(4, 700, 128, token_major(4, 700, 128));
  all_geometric<bfloat16>(2, 900, 128, padded(2, 900, 128));
  all_geometric<float>(2, 5000, 64, hf(2, 5000, 64));  // several centroid parts and windows (+ a short tail)
}

TEST_CASE("cuda: windowed L2 keeps the CPU's tail rules", "[cuda][gpu]") {
  // 1000 = 3 x 256 + 232 (own window either way) and 900 = 3 x 256 + 132 (merged into the third
  // with WindowTail::merge, its own window with WindowTail::own).
  for (const kvscore::WindowTail tail : {kvscore::WindowTail::merge, kvscore::WindowTail::own})
    for (std::int64_t N : {1000, 900, 200, 256, 257})
      compare_scorer<kvscore::WindowedManifoldL2, float>(kvscore::WindowedManifoldL2(256, tail), 2, N, 64,
                                                         hf(2, N, 64), false);
}

TEST_CASE("cuda: a head with no valid key, and a zero KeyDiff anchor", "[cuda][gpu]") {
  const std::int64_t H = 2, N = 50, d = 64;
  std::vector<float> host(std::size_t(H * N * d), 1.f);
  for (std::int64_t t = 0; t < N; ++t) host[std::size_t(t * d)] = kNaN;               // head 0: all invalid
  for (std::int64_t t = 0; t < N; ++t)                                                 // head 1: k and -k
    for (std::int64_t j = 0; j < d; ++j) host[std::size_t((N + t) * d + j)] = (t % 2 ? -1.f : 1.f) * float(j + 1);
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<float> keys(dk.as<float>(), H, N, d, N * d, d);
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  kvscore::KeyDiff kd;
  kc::DeviceBuffer ws(kc::score_workspace_bytes(kd, keys));
  kc::score(kd, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()});
  const auto g = download<float>(out, std::size_t(H * N));
  for (std::int64_t t = 0; t < N; ++t) REQUIRE(g[std::size_t(t)] == -kInf);
  for (std::int64_t t = 0; t < N; ++t) REQUIRE(g[std::size_t(N + t)] == 0.f);  // anchor = 0: every valid key 0
  kvscore::ManifoldL2 l2;
  kc::DeviceBuffer ws2(kc::score_workspace_bytes(l2, keys));
  kc::score(l2, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws2.get(), ws2.bytes()});
  const auto g2 = download<float>(out, std::size_t(H * N));
  for (std::int64_t t = 0; t < N; ++t) REQUIRE(g2[std::size_t(t)] == -kInf);
}

namespace {
/// GPU SnapKV vs the CPU one on the same keys, within test_snapkv.cpp's bound.
template <class T>
void compare_snapkv(std::int64_t d, const Layout& L, float qscale = 0.3f) {
  const std::int64_t H = 2, G = 2, w = 16, N = 1500;
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " d " << d << " layout " << L.name << " qscale "
                << qscale);
  std::mt19937 rng(static_cast<unsigned>(d));
  std::normal_distribution<float> nd(0.f, qscale);
  std::vector<float> q(std::size_t(H * G * w * d));
  for (auto& x : q) x = nd(rng);
  kvscore::SnapKV s(q.data(), H * G, w, d);
  s.num_threads = 1;
  const std::vector<T> host = make_keys<T>(H, N, d, L, 3, true);
  const kvscore::KeysView<T> cview(host.data(), H, N, d, L.hs, L.ts);
  const kvscore::Scores cpu = s.score(cview);
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<T> keys(dk.as<T>(), H, N, d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys));
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  kc::score(s, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()});
  const auto g = download<float>(out, std::size_t(H * N));
  // test_snapkv.cpp's bound: (3(d+2)·L + 8)·u relative, L = max Σ_j |q_j k_j| / √d. The fp16
  // tensor-core path (q split into fp16 hi + lo, ~22 bits) stays inside it: its q rounding adds
  // 4·L·u, far below 3(d+2)·L·u.
  double Lmax = 0;
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t qi = 0; qi < G * w; ++qi)
      for (std::int64_t t = 0; t < N; ++t) {
        double a = 0;
        bool ok = true;
        for (std::int64_t j = 0; j < d; ++j) {
          const double k = kvscore::to_float(host[std::size_t(h * L.hs + t * L.ts + j)]);
          ok = ok && std::isfinite(k);
          a += std::fabs(double(q[std::size_t(((h * G * w) + qi) * d + j)]) * k);
        }
        if (ok) Lmax = std::max(Lmax, a / std::sqrt(double(d)));
      }
  const double rel = (3.0 * double(d + 2) * Lmax + 8.0) / 16777216.0;
  INFO("L " << Lmax << " rel bound " << rel);
  check_scores(cpu.values(), g, H, N, false, rel);
  kc::score(s, keys, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()});
  const auto again = download<float>(out, std::size_t(H * N));
  REQUIRE(std::memcmp(g.data(), again.data(), g.size() * sizeof(float)) == 0);  // deterministic
}
}  // namespace

TEST_CASE("cuda: SnapKV matches the CPU path", "[cuda][gpu]") {
  // fp16 at d = 64/128/256: the tensor-core path (16-byte rows, and padded rows: element loads);
  // d = 40, bf16 and fp32: the FMA path.
  for (std::int64_t d : {64, 128, 256, 40}) compare_snapkv<half>(d, hf(2, 1500, d));
  compare_snapkv<half>(128, token_major(2, 1500, 128));
  compare_snapkv<half>(64, padded(2, 1500, 64));
  compare_snapkv<half>(128, hf(2, 1500, 128), 40.f);    // large queries: q·2^e with e < 0
  compare_snapkv<half>(128, hf(2, 1500, 128), 1e-4f);  // tiny ones
  compare_snapkv<bfloat16>(64, hf(2, 1500, 64));
  compare_snapkv<float>(128, hf(2, 1500, 128));
}

TEST_CASE("cuda: SnapKV with device queries checks its arguments as SnapKV does, before any launch", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> keys(fake, 2, 10, 8, 80, 8);
  kc::DeviceSnapKV snap;
  snap.queries = {fake, kvscore::dtype::f32, 1, 4, 16, 8, 0, 16 * 8, 8, 1};  // 4 query heads, 16 queries
  snap.window = 6;
  REQUIRE(snap.used() == 6);
  REQUIRE(snap.protected_recent() == 6);
  REQUIRE(kc::score_workspace_bytes(snap, keys) > 0);
  snap.window = 64;  // the last min(window, n) = 16 > 10 tokens, in the cache
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("window 16 > tokens 10"));
  snap.placement = kvscore::QueryPlacement::after_cache;  // after the cache: fine, nothing protected
  REQUIRE(kc::score_workspace_bytes(snap, keys) > 0);
  REQUIRE(snap.protected_recent() == 0);
  snap.kernel_size = 4;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("kernel_size must be odd"));
  snap.kernel_size = 5;
  snap.queries.heads = 3;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("q_heads 3 is not a multiple"));
  snap.queries.heads = 4;
  snap.queries.head_dim = 16;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("queries have head_dim 16"));
  snap.queries.head_dim = 8;
  snap.queries.batch = 3;  // 2 key heads are not 3 rows
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("not a multiple of the queries' batch 3"));
  snap.queries.batch = 2;  // 2 rows of 1 KV head, 4 query heads each
  REQUIRE(kc::score_workspace_bytes(snap, keys) > 0);
  snap.queries.data = nullptr;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("queries is null"));
  snap.queries.data = fake;
  snap.queries.n = 0;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(snap, keys), Contains("window must be > 0"));
}

TEST_CASE("cuda: batched selection plans each layer as the CPU plans it", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceScoresView s(fake, 6, 10);  // 3 layers of 2 heads, or 2 of 3
  REQUIRE(kc::select_batch_total(s, 3, kvscore::Budget::per_head(4)) == 24);
  kvscore::SelectOptions o;
  o.alloc = kvscore::Alloc::adakv;
  REQUIRE(kc::select_batch_total(s, 2, kvscore::Budget::per_head(4), o) == 24);
  REQUIRE_THROWS_WITH(kc::select_batch_total(s, 4, kvscore::Budget::per_head(4)), Contains("not batch 4 x heads"));
  REQUIRE_THROWS_WITH(kc::select_batch_total(s, 0, kvscore::Budget::per_head(4)), Contains("not batch 0 x heads"));
  REQUIRE_THROWS_WITH(kc::select_batch_total(s, 3, kvscore::Budget::per_head(11)), Contains("11"));
  std::int64_t dummy = 0;
  REQUIRE_THROWS_WITH(kc::select_batch_into(s, 3, kvscore::Budget::per_head(4), {}, {}, &dummy, &dummy, 23),
                      Contains("capacity 23"));
  REQUIRE(kc::select_batch_workspace_bytes(s, 3, kvscore::Budget::per_head(4)) > 0);
}

// ================================================================ GPU: selection

TEST_CASE("cuda: batched top-k equals the CPU selector (distinct scores)", "[cuda][gpu]") {
  for (auto path : kPaths)
    for (std::int64_t H : {1, 3, 40})
      for (std::int64_t N : {1000, 70000}) {
        const auto s = random_scores(H, N, unsigned(H + N));
        for (std::int64_t k : {std::int64_t(0), std::int64_t(1), N / 10, N / 2, N - 1, N})
          compare_select(s, H, N, kvscore::Budget::per_head(k), {}, path);
      }
}

TEST_CASE("cuda: ties, NaN, ±inf and ±0 follow the CPU's order", "[cuda][gpu]") {
  for (auto path : kPaths) {
    for (int distinct : {1, 2, 5}) {
      const auto s = random_scores(5, 9000, unsigned(distinct), distinct);
      for (std::int64_t k : {1, 100, 4500, 8999}) compare_select(s, 5, 9000, kvscore::Budget::per_head(k), {}, path);
    }
    std::vector<float> sp(4 * 3000);
    const float vals[] = {kNaN, -kNaN, -kInf, kInf, 0.f, -0.f, 1.f, -1.f};
    std::mt19937 rng(9);
    for (auto& x : sp) x = vals[rng() % 8];
    for (std::int64_t k : {1, 400, 1500, 2600, 2999}) compare_select(sp, 4, 3000, kvscore::Budget::per_head(k), {}, path);
  }
}

TEST_CASE("cuda: protection and AdaKV allocation equal the CPU selector", "[cuda][gpu]") {
  for (auto path : kPaths)
    for (int distinct : {0, 3}) {
      const std::int64_t H = 6, N = 5000;
      const auto s = random_scores(H, N, 17, distinct);
      kvscore::SelectOptions o;
      o.sinks = 4;
      o.recent = 64;
      for (std::int64_t k : {68, 69, 500, 4999}) compare_select(s, H, N, kvscore::Budget::per_head(k), o, path);
      o.alloc = kvscore::Alloc::adakv;
      for (double alpha : {0.0, 0.2, 1.0}) {
        o.alpha = alpha;
        for (std::int64_t B : {68 * 6, 3000, 12345, 29999}) compare_select(s, H, N, kvscore::Budget::per_layer(B), o, path);
      }
      o.sinks = o.recent = 0;
      o.alpha = 0.2;
      for (std::int64_t B : {0, 1, 7, 15000, 30000}) compare_select(s, H, N, kvscore::Budget::per_layer(B), o, path);
    }
}

TEST_CASE("cuda: topk_into writes [rows][k] ascending positions", "[cuda][gpu]") {
  const std::int64_t R = 7, N = 20000, k = 1234;
  const auto s = random_scores(R, N, 3);
  const kvscore::Selection cpu = kvscore::select(kvscore::ConstScoresView(s.data(), R, N),
                                                 kvscore::Budget::per_head(k));
  const kc::DeviceBuffer d = upload(s);
  const kc::DeviceScoresView v(d.as<float>(), R, N);
  for (auto path : kPaths) {
    kc::DeviceBuffer ws(kc::topk_workspace_bytes(v, k, path));
    kc::DeviceBuffer out(std::size_t(R * k) * sizeof(std::int64_t));
    kc::topk_into(v, k, {ws.get(), ws.bytes()}, out.as<std::int64_t>(), nullptr, path);
    REQUIRE(download<std::int64_t>(out, std::size_t(R * k)) == cpu.positions);
  }
}

// ================================================================ GPU: compaction

namespace {
template <class T>
void compare_compact(std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L, kvscore::CompactTail tail,
                     bool adakv) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " d " << d << " layout " << L.name << " tail "
                << int(tail) << " adakv " << adakv);
  const auto scores = random_scores(H, N, 23);
  kvscore::SelectOptions o;
  o.sinks = 2;
  o.recent = 8;
  if (adakv) o.alloc = kvscore::Alloc::adakv;
  const kvscore::Budget b = adakv ? kvscore::Budget::per_layer(H * N / 3) : kvscore::Budget::per_head(N / 3);
  const kvscore::Selection sel = kvscore::select(kvscore::ConstScoresView(scores.data(), H, N), b, o);
  std::vector<T> k = make_keys<T>(H, N, d, L, 1, false), v = make_keys<T>(H, N, d, L, 2, false);
  const kc::DeviceBuffer dk = upload(k), dv = upload(v);
  kvscore::CompactOptions co;
  co.tail = tail;
  kvscore::compact(kvscore::MutKeysView<T>(k.data(), H, N, d, L.hs, L.ts),
                   kvscore::MutKeysView<T>(v.data(), H, N, d, L.hs, L.ts), sel, co);
  // Host Selection on K and V, then a device selection (from select_into) on a fresh copy.
  kc::DeviceBuffer ws(kc::compact_workspace_bytes(sel));
  kc::compact(kc::DeviceMutKeysView<T>(dk.as<T>(), H, N, d, L.hs, L.ts),
              kc::DeviceMutKeysView<T>(dv.as<T>(), H, N, d, L.hs, L.ts), sel, {ws.get(), ws.bytes()}, co);
  kc::synchronize();
  const auto gk = download<T>(dk, k.size()), gv = download<T>(dv, v.size());
  REQUIRE(std::memcmp(gk.data(), k.data(), k.size() * sizeof(T)) == 0);
  REQUIRE(std::memcmp(gv.data(), v.data(), v.size() * sizeof(T)) == 0);

  const kc::DeviceBuffer dk2 = upload(make_keys<T>(H, N, d, L, 1, false)), ds = upload(scores);
  const kc::DeviceScoresView sv(ds.as<float>(), H, N);
  kc::DeviceBuffer sws(kc::select_workspace_bytes(sv, b, o));
  kc::DeviceBuffer off(std::size_t(H + 1) * 8), pos(std::size_t(sel.total()) * 8);
  kc::select_into(sv, b, o, {sws.get(), sws.bytes()}, off.as<std::int64_t>(), pos.as<std::int64_t>(),
                  std::size_t(sel.total()));
  kc::compact(kc::DeviceMutKeysView<T>(dk2.as<T>(), H, N, d, L.hs, L.ts),
              kc::DeviceSelection{H, N, off.as<std::int64_t>(), pos.as<std::int64_t>()}, co);
  const auto gk2 = download<T>(dk2, k.size());
  REQUIRE(std::memcmp(gk2.data(), k.data(), k.size() * sizeof(T)) == 0);
}
}  // namespace

TEST_CASE("cuda: in-place compaction equals the CPU compact()", "[cuda][gpu]") {
  for (auto tail : {kvscore::CompactTail::keep, kvscore::CompactTail::zero})
    for (bool adakv : {false, true}) {
      compare_compact<half>(4, 3000, 128, hf(4, 3000, 128), tail, adakv);
      compare_compact<float>(3, 1000, 40, token_major(3, 1000, 40), tail, adakv);
      compare_compact<bfloat16>(2, 700, 24, padded(2, 700, 24), tail, adakv);
      compare_compact<half>(2, 500, 7, hf(2, 500, 7), tail, adakv);  // 14-byte rows: 2-byte words
    }
}

TEST_CASE("cuda: host memory and small workspaces are rejected", "[cuda][gpu]") {
  std::vector<float> host(2 * 100 * 64, 1.f), out(200);
  const kc::DeviceKeysView<float> hk(host.data(), 2, 100, 64, 6400, 64);  // host pointer in a device view
  kc::DeviceBuffer dout(200 * sizeof(float));
  REQUIRE_THROWS_WITH(kc::score(kvscore::KNorm{}, hk, kc::DeviceScoresView(dout.as<float>(), 2, 100)),
                      Contains("keys is not device memory"));
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<float> keys(dk.as<float>(), 2, 100, 64, 6400, 64);
  kvscore::ManifoldL2 l2;
  kc::DeviceBuffer ws(kc::score_workspace_bytes(l2, keys) - 1);
  REQUIRE_THROWS_WITH(kc::score(l2, keys, kc::DeviceScoresView(dout.as<float>(), 2, 100), {ws.get(), ws.bytes()}),
                      Contains("smaller than the"));
}

// ================================================================ GPU: what kvscore._kvscore_cuda needs (issue 48)

namespace {
/// SnapKV with device queries (any dtype and strides, the last `window` of n) gives the bits of
/// SnapKV built from the same queries on the host, on the GPU, in both placements; a batch of
/// rows in one call gives each row's bits.
template <class Q>
void compare_device_snapkv(kvscore::QueryPlacement placement) {
  const std::int64_t H = 2, G = 2, n = 24, w = 16, N = 900, d = 64, B = 2;
  INFO("query dtype " << kvscore::dtype_name(kvscore::dtype_of<Q>()) << " placement " << kvscore::to_string(placement));
  // queries [B][n][H*G][d] (token-major, as a model's projection writes them), read as [B][H*G][n][d]
  std::mt19937 rng(31);
  std::normal_distribution<float> nd(0.f, 0.3f);
  std::vector<Q> q(std::size_t(B * n * H * G * d));
  for (auto& x : q) x = kvscore::from_float<Q>(nd(rng));
  const Layout L = hf(B * H, N, d);
  const std::vector<half> host = make_keys<half>(B * H, N, d, L, 5, true);
  const kc::DeviceBuffer dk = upload(host), dq = upload(q);
  kc::DeviceBuffer out(std::size_t(B * H * N) * sizeof(float)), ref(std::size_t(H * N) * sizeof(float));
  kc::DeviceSnapKV ds;
  ds.queries = {dq.get(), kvscore::dtype_of<Q>(), B, H * G, n, d, n * H * G * d, d, H * G * d, 1};
  ds.window = w;
  ds.placement = placement;
  const kc::DeviceKeysView<half> all(dk.as<half>(), B * H, N, d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(ds, all));
  kc::score(ds, all, kc::DeviceScoresView(out.as<float>(), B * H, N), {ws.get(), ws.bytes()});
  const auto got = download<float>(out, std::size_t(B * H * N));
  for (std::int64_t b = 0; b < B; ++b) {
    // the same row from host queries: the last w of row b, gathered to fp32 as the Python module does
    std::vector<float> hq(std::size_t(H * G * w * d));
    for (std::int64_t g = 0; g < H * G; ++g)
      for (std::int64_t i = 0; i < w; ++i)
        for (std::int64_t j = 0; j < d; ++j)
          hq[std::size_t((g * w + i) * d + j)] =
              kvscore::to_float(q[std::size_t(((b * n + n - w + i) * H * G + g) * d + j)]);
    kvscore::SnapKV s(hq.data(), H * G, w, d);
    s.placement = placement;
    s.num_threads = 1;
    const kc::DeviceKeysView<half> row(dk.as<half>() + b * H * L.hs, H, N, d, L.hs, L.ts);
    kc::DeviceBuffer ws1(kc::score_workspace_bytes(s, row));
    kc::score(s, row, kc::DeviceScoresView(ref.as<float>(), H, N), {ws1.get(), ws1.bytes()});
    const auto want = download<float>(ref, std::size_t(H * N));
    INFO("row " << b);
    REQUIRE(std::memcmp(want.data(), got.data() + b * H * N, want.size() * sizeof(float)) == 0);
    // and the CPU's scores, within SnapKV's bound (compare_snapkv's, loosely: L ~ 0.3·|k|·√d here)
    const kvscore::Scores cpu =
        s.score(kvscore::KeysView<half>(host.data() + b * H * L.hs, H, N, d, L.hs, L.ts));
    check_scores(cpu.values(), want, H, N, false, 1e-3);
  }
}
}  // namespace

TEST_CASE("cuda: SnapKV from device queries equals SnapKV from host queries, bit for bit", "[cuda][gpu]") {
  for (auto placement : {kvscore::QueryPlacement::in_cache, kvscore::QueryPlacement::after_cache}) {
    compare_device_snapkv<half>(placement);
    compare_device_snapkv<bfloat16>(placement);
    compare_device_snapkv<float>(placement);
  }
}

TEST_CASE("cuda: AdaKV with normalize (z-scores) equals the CPU selector", "[cuda][gpu]") {
  for (auto path : kPaths)
    for (int distinct : {0, 4}) {
      const std::int64_t H = 5, N = 3000;
      auto s = random_scores(H, N, 41, distinct);
      for (std::int64_t h = 0; h < H; ++h)  // heads on different scales: what normalize is for
        for (std::int64_t t = 0; t < N; ++t) s[std::size_t(h * N + t)] = s[std::size_t(h * N + t)] * float(1 + 3 * h) + float(h);
      s[7] = kNaN;
      s[N + 9] = -kInf;
      s[2 * N + 11] = kInf;
      kvscore::SelectOptions o;
      o.alloc = kvscore::Alloc::adakv;
      o.normalize = true;
      for (double alpha : {0.0, 0.2, 1.0}) {
        o.alpha = alpha;
        for (std::int64_t B : {1, 500, 7000, 14999}) compare_select(s, H, N, kvscore::Budget::per_layer(B), o, path);
      }
      o.sinks = 3;
      o.recent = 20;
      o.alpha = 0.2;
      compare_select(s, H, N, kvscore::Budget::per_layer(4000), o, path);
    }
}

TEST_CASE("cuda: select_batch_into selects each layer of a batch as select does", "[cuda][gpu]") {
  const std::int64_t B = 3, H = 4, N = 2500;
  const auto s = random_scores(B * H, N, 57, 0);
  const kc::DeviceBuffer d = upload(s);
  const kc::DeviceScoresView v(d.as<float>(), B * H, N);
  for (bool adakv : {false, true}) {
    kvscore::SelectOptions o;
    o.sinks = 2;
    o.recent = 16;
    if (adakv) o.alloc = kvscore::Alloc::adakv;
    const kvscore::Budget b = kvscore::Budget::per_head(300);
    const std::int64_t total = kc::select_batch_total(v, B, b, o);
    kc::DeviceBuffer ws(kc::select_batch_workspace_bytes(v, B, b, o));
    kc::DeviceBuffer off(std::size_t(B * H + 1) * 8), pos(std::size_t(total) * 8);
    REQUIRE(kc::select_batch_into(v, B, b, o, {ws.get(), ws.bytes()}, off.as<std::int64_t>(), pos.as<std::int64_t>(),
                                  std::size_t(total)) == total);
    const auto goff = download<std::int64_t>(off, std::size_t(B * H + 1));
    const auto gpos = download<std::int64_t>(pos, std::size_t(total));
    std::vector<std::int64_t> want_off{0}, want_pos;
    for (std::int64_t l = 0; l < B; ++l) {
      const kvscore::Selection c = kvscore::select(kvscore::ConstScoresView(s.data() + l * H * N, H, N), b, o);
      for (std::int64_t h = 0; h < H; ++h) want_off.push_back(want_off.back() + c.kept(h));
      want_pos.insert(want_pos.end(), c.positions.begin(), c.positions.end());
    }
    INFO("adakv " << adakv);
    REQUIRE(goff == want_off);
    REQUIRE(gpos == want_pos);
  }
}

TEST_CASE("cuda: check_selection rejects what the CPU compact() rejects, with its messages", "[cuda][gpu]") {
  const std::int64_t H = 2, N = 10;
  auto check = [&](std::vector<std::int64_t> off, std::vector<std::int64_t> pos) {
    const kc::DeviceBuffer doff = upload(off), dpos = upload(pos);
    kc::DeviceBuffer ws(kc::selection_check_workspace_bytes());
    return kc::check_selection(kc::DeviceSelection{H, N, doff.as<std::int64_t>(), dpos.as<std::int64_t>()},
                               std::int64_t(pos.size()), {ws.get(), ws.bytes()}, nullptr, "kvscore::compact");
  };
  REQUIRE(check({0, 2, 3}, {1, 4, 9}) == std::vector<std::int64_t>{0, 2, 3});
  REQUIRE_THROWS_WITH(check({0, 2, 3}, {1, 10, 9}), Contains("kvscore::compact: head 0: position 10 out of range [0, 10)"));
  REQUIRE_THROWS_WITH(check({0, 2, 3}, {4, 4, 9}), Contains("head 0: positions must be strictly ascending (4 after 4)"));
  REQUIRE_THROWS_WITH(check({0, 1, 3}, {4, 5, 2}), Contains("head 1: positions must be strictly ascending (2 after 5)"));
  REQUIRE_THROWS_WITH(check({0, 1, 3}, {-1, 5, 6}), Contains("head 0: position -1 out of range"));
  REQUIRE_THROWS_WITH(check({1, 2, 3}, {1, 4, 9}), Contains("selection.offsets[0] = 1, expected 0"));
  REQUIRE_THROWS_WITH(check({0, 2, 2}, {1, 4, 9}), Contains("selection.offsets[2] = 2 but positions has 3 entries"));
  REQUIRE_THROWS_WITH(check({0, 3, 2}, {1, 4}), Contains("selection.offsets decrease at head 1 (3 > 2)"));
  REQUIRE(cudaPeekAtLastError() == cudaSuccess);
}
