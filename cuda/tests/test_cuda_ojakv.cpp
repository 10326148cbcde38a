// cuda/tests/test_cuda_ojakv.cpp — OjaKV on the GPU (kvscore/cuda/ojakv.hpp) against the CPU
// path (kvscore/ojakv/ojakv.hpp) on the same data.
//
// [gpu] tests, one per piece: projection (vs OjaHybridCache codes), reconstruction (vs
// reconstruct_keys), the residual score (vs OjaResidual::score) and the selection it feeds
// (vs kvscore::select), the pooled covariance (vs oja::PooledCovariance), prefill and decode
// updates (vs OjaBasis::prefill / push). Every tolerance is derived from the arithmetic of the
// two paths (see each check). [host] tests need no device and never touch the CUDA runtime:
// argument checks, the packing layout, and the device formula of the residual replayed on the host.
#include "cuda_harness.hpp"

#include <kvscore/cuda/ojakv.hpp>
#include <kvscore/cuda/select.hpp>
#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
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
using Eigen::MatrixXd;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr double kU32 = 0x1.0p-24;  // unit roundoff, fp32
constexpr double kU64 = 0x1.0p-53;  // unit roundoff, fp64

static_assert(std::is_base_of_v<kvscore::OjaResidual, kc::OjaResidual>);
static_assert(kc::DeviceBasesView::space == kc::MemorySpace::device);

/// Keys near a rank-6 subspace per head (+ noise), so that Oja has something to find.
/// invalid: NaN at (0, 3), +inf at (H-1, 7), a zero row at (0, 5), and window [8, 12) of head 0 NaN.
template <class T>
std::vector<T> lowrank_keys(std::int64_t H, std::int64_t N, std::int64_t d, const Layout& L, unsigned seed,
                            bool invalid) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<T> k(std::size_t(L.elems), kvscore::from_float<T>(0.f));
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<float> basis(std::size_t(6 * d));
    for (auto& x : basis) x = nd(rng);
    for (std::int64_t t = 0; t < N; ++t) {
      float z[6];
      for (int c = 0; c < 6; ++c) z[c] = nd(rng) * float(6 - c);
      for (std::int64_t j = 0; j < d; ++j) {
        float v = 0.3f * nd(rng);
        for (int c = 0; c < 6; ++c) v += z[c] * basis[std::size_t(c * d + j)];
        k[std::size_t(h * L.hs + t * L.ts + j)] = kvscore::from_float<T>(v);
      }
    }
  }
  if (invalid && N > 16) {
    k[std::size_t(0 * L.hs + 3 * L.ts + 1)] = kvscore::from_float<T>(kNaN);
    k[std::size_t((H - 1) * L.hs + 7 * L.ts)] = kvscore::from_float<T>(kInf);
    for (std::int64_t j = 0; j < d; ++j) k[std::size_t(0 * L.hs + 5 * L.ts + j)] = kvscore::from_float<T>(0.f);
    for (std::int64_t t = 8; t < 12; ++t) k[std::size_t(0 * L.hs + t * L.ts + 2)] = kvscore::from_float<T>(kNaN);
  }
  return k;
}

std::vector<float> random_queries(std::int64_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 0.5f);
  std::vector<float> q(static_cast<std::size_t>(n));
  for (auto& x : q) x = nd(rng);
  return q;
}

std::vector<MatrixXd> random_bases(std::int64_t H, std::int64_t d, const std::vector<std::int64_t>& ranks,
                                   std::uint64_t seed) {
  std::vector<MatrixXd> b;
  for (std::int64_t h = 0; h < H; ++h)
    b.push_back(kvscore::oja::random_orthonormal(d, ranks[std::size_t(h) % ranks.size()], seed + std::uint64_t(h)));
  return b;
}

/// Host replay of the device formula: e_t from [k, −Uᵀk]·[q, Uᵀq] in fp64, the GPU kernel's
/// arithmetic (not its order). Also returns the error scale B_t = mean over the visible queries
/// of (Σ_j |q_j k_j| + Σ_i |p_i c_i|) / √d, the magnitude any fp64 summation order errs against.
template <class T>
void device_formula(const std::vector<T>& keys, const Layout& L, std::int64_t H, std::int64_t N, std::int64_t d,
                    const std::vector<float>& q, std::int64_t q_heads, std::int64_t w, const std::vector<MatrixXd>& U,
                    std::vector<float>& e, std::vector<double>& scale) {
  const std::int64_t G = q_heads / H, P = N - w;
  e.assign(std::size_t(H * N), 0.f);
  scale.assign(std::size_t(H * N), 0.0);
  for (std::int64_t h = 0; h < H; ++h) {
    const MatrixXd& u = U[std::size_t(h)];
    for (std::int64_t t = 0; t < N; ++t) {
      Eigen::VectorXd k(d);
      double s2 = 0;
      for (std::int64_t j = 0; j < d; ++j) {
        k(j) = kvscore::to_float(keys[std::size_t(h * L.hs + t * L.ts + j)]);
        s2 += k(j) * k(j);
      }
      if (!(std::isfinite(s2) && s2 <= double(std::numeric_limits<float>::max()))) {
        e[std::size_t(h * N + t)] = -kInf;
        continue;
      }
      const Eigen::VectorXd c = u.transpose() * k;
      const std::int64_t first = std::max<std::int64_t>(0, t - P);
      double acc = 0, sc = 0;
      for (std::int64_t g = 0; g < G; ++g)
        for (std::int64_t i = first; i < w; ++i) {
          Eigen::VectorXd qq(d);
          for (std::int64_t j = 0; j < d; ++j) qq(j) = q[std::size_t(((h * G + g) * w + i) * d + j)];
          const Eigen::VectorXd p = u.transpose() * qq;
          acc += std::fabs(qq.dot(k) - p.dot(c));
          sc += qq.cwiseProduct(k).cwiseAbs().sum() + p.cwiseProduct(c).cwiseAbs().sum();
        }
      const double n = double(G * (w - first));
      e[std::size_t(h * N + t)] = float(acc / n * (1.0 / std::sqrt(double(d))));
      scale[std::size_t(h * N + t)] = sc / n / std::sqrt(double(d));
    }
  }
}

/// Residual scores agree: −inf exactly where the reference has it; otherwise within two fp32
/// roundings of the value (both sides round an fp64 number) plus 4(d + r + G·w) fp64 roundings
/// of the error scale B_t (the two fp64 sums differ only in order and in k − UUᵀk vs the split form).
void check_residual(const std::vector<float>& ref, const std::vector<float>& got, const std::vector<double>& scale,
                    std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t r, std::int64_t gw) {
  for (std::int64_t i = 0; i < H * N; ++i) {
    const float c = ref[std::size_t(i)], g = got[std::size_t(i)];
    INFO("head " << i / N << " token " << i % N << " ref " << c << " got " << g);
    REQUIRE(!std::isnan(g));
    if (std::isinf(c)) {
      REQUIRE(g == c);
      continue;
    }
    const double tol = 2.0 * kU32 * std::fabs(double(c)) + 4.0 * double(d + r + gw) * kU64 * scale[std::size_t(i)];
    REQUIRE(std::fabs(double(g) - double(c)) <= tol);
  }
}

}  // namespace

// ================================================================ host-side (no GPU needed)

TEST_CASE("cuda ojakv: bases views and packing validate on the host", "[cuda][host]") {
  const float* fake = reinterpret_cast<const float*>(std::uintptr_t(4096));
  REQUIRE_THROWS_WITH(kc::DeviceBasesView(fake, -1, 8, 2), Contains("heads must be >= 0 (got -1)"));
  REQUIRE_THROWS_WITH(kc::DeviceBasesView(fake, 2, 8, 9), Contains("rank must be in [1, head_dim = 8] (got 9)"));
  REQUIRE_THROWS_WITH(kc::DeviceBasesView(fake, 2, 8, 0), Contains("(got 0)"));
  REQUIRE_THROWS_WITH(kc::DeviceBasesView(nullptr, 2, 8, 2), Contains("data is null"));
  const auto b = random_bases(2, 8, {3}, 7);
  const std::vector<float> packed = kc::pack_bases(b);
  REQUIRE(packed.size() == 2 * 8 * 3);
  for (int h = 0; h < 2; ++h)
    for (int j = 0; j < 8; ++j)
      for (int i = 0; i < 3; ++i) REQUIRE(packed[std::size_t((h * 8 + j) * 3 + i)] == float(b[std::size_t(h)](j, i)));
  REQUIRE_THROWS_WITH(kc::pack_bases({b[0], random_bases(1, 8, {2}, 1)[0]}), Contains("basis 1 is 8 x 2"));
  REQUIRE_THROWS_WITH(kc::pack_bases({}), Contains("0 heads"));
  std::vector<kvscore::OjaProjector> p{kvscore::OjaProjector::random(8, 3, 2, 5)};
  REQUIRE(kc::pack_key_bases(p).size() == 8 * 3);
  REQUIRE(kc::pack_value_bases(p).size() == 8 * 2);
}

TEST_CASE("cuda ojakv: projection and reconstruction check shapes before any launch", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> keys(fake, 2, 10, 8, 80, 8);
  const kc::DeviceBasesView bases(fake, 2, 8, 3);
  REQUIRE_THROWS_WITH(kc::project(keys, kc::DeviceBasesView(fake, 3, 8, 3), kc::DeviceMutKeysView<float>(fake, 2, 10, 3, 30, 3)),
                      Contains("bases are (3 heads, head_dim 8), keys (2 heads, head_dim 8)"));
  REQUIRE_THROWS_WITH(kc::project(keys, bases, kc::DeviceMutKeysView<float>(fake, 2, 10, 4, 40, 4)),
                      Contains("codes shape (2, 10, 4) is not (heads, tokens, rank) = (2, 10, 3)"));
  const kc::DeviceKeysView<float> codes(fake, 2, 10, 3, 30, 3);
  REQUIRE_THROWS_WITH(kc::reconstruct(codes, kc::DeviceBasesView(fake, 2, 8, 4), kc::DeviceMutKeysView<float>(fake, 2, 10, 8, 80, 8)),
                      Contains("rank 4"));
  REQUIRE_THROWS_WITH(kc::reconstruct(codes, bases, kc::DeviceMutKeysView<float>(fake, 2, 9, 8, 72, 8)),
                      Contains("output shape (2, 9, 8)"));
}

TEST_CASE("cuda ojakv: OjaResidual validates like the CPU object and scores like it on the host", "[cuda][host]") {
  const std::int64_t H = 2, G = 2, w = 4, d = 8, N = 40;
  const auto q = random_queries(H * G * w * d, 3);
  const auto bases = random_bases(H, d, {3, 5}, 11);
  REQUIRE_THROWS_WITH(kc::OjaResidual(q.data(), 3, w, d, bases), Contains("q_heads 3 is not a multiple of the 2 bases"));
  REQUIRE_THROWS_WITH(kc::OjaResidual(q.data(), H * G, 0, d, bases), Contains("window must be > 0 (got 0)"));
  const kc::OjaResidual gpu_obj(q.data(), H * G, w, d, bases);
  REQUIRE(gpu_obj.max_rank() == 5);
  REQUIRE(gpu_obj.augmented_queries().size() == std::size_t(H * G * w * (d + 5)));
  REQUIRE(gpu_obj.device_bases()[std::size_t(0 * 5 + 3)] == 0.0);  // head 0 (rank 3) padded with zeros
  const kvscore::OjaResidual cpu(q.data(), H * G, w, d, bases);
  const auto keys = lowrank_keys<float>(H, N, d, hf(H, N, d), 9, true);
  const kvscore::KeysView<float> kv(keys.data(), H, N, d, N * d, d);
  REQUIRE(gpu_obj.score(kv).values() == cpu.score(kv).values());  // it is the CPU object too

  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> dk(fake, H, 3, d, 3 * d, d);
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(gpu_obj, dk), Contains("window 4 > tokens 3"));
  REQUIRE_THROWS_WITH(kc::score(gpu_obj, dk, kc::DeviceScoresView(fake, H, 3)), Contains("window 4 > tokens 3"));
  const kc::DeviceKeysView<float> dk2(fake, H, N, d, N * d, d);
  REQUIRE_THROWS_WITH(kc::score(gpu_obj, dk2, kc::DeviceScoresView(fake, H, N - 1)),
                      Contains("scores shape (2, 39) does not match keys (2, 40)"));
  const kc::DeviceKeysView<float> dk3(fake, 3, N, d, N * d, d);
  REQUIRE_THROWS_WITH(kc::score(gpu_obj, dk3, kc::DeviceScoresView(fake, 3, N)), Contains("keys have 3 heads"));
  kc::OjaResidual after = gpu_obj;  // queries that follow the cache: CPU only, rejected by name
  after.placement = kvscore::QueryPlacement::after_cache;
  REQUIRE_THROWS_WITH(kc::score(after, dk2, kc::DeviceScoresView(fake, H, N)), Contains("after_cache"));
}

TEST_CASE("cuda ojakv: the device formula q.k - (U^T q).(U^T k) reproduces the CPU residual score", "[cuda][host]") {
  for (std::int64_t d : {16, 40}) {
    const std::int64_t H = 2, G = 2, w = 8, N = 120;
    const auto q = random_queries(H * G * w * d, unsigned(d));
    const auto bases = random_bases(H, d, {4, 7}, 21);
    const auto keys = lowrank_keys<half>(H, N, d, hf(H, N, d), 4, true);
    const kvscore::OjaResidual cpu(q.data(), H * G, w, d, bases);
    const auto ref = cpu.score(kvscore::KeysView<half>(keys.data(), H, N, d, N * d, d));
    std::vector<float> e;
    std::vector<double> scale;
    device_formula(keys, hf(H, N, d), H, N, d, q, H * G, w, bases, e, scale);
    check_residual(ref.values(), e, scale, H, N, d, 7, G * w);
  }
}

TEST_CASE("cuda ojakv: Oja update arguments are checked before any launch", "[cuda][host]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> rows(fake, 2, 10, 8, 80, 8);
  REQUIRE_THROWS_WITH(kc::covariance_workspace_bytes(rows, 0), Contains("pool must be >= 1 (got 0)"));
  double* cov = reinterpret_cast<double*>(std::uintptr_t(8192));
  REQUIRE_THROWS_WITH(kc::pooled_covariance_into(rows, 4, {}, nullptr), Contains("cov is null"));
  REQUIRE_THROWS_WITH(kc::pooled_covariance_into(kc::DeviceKeysView<float>(fake, 2, 0, 8, 0, 8), 4, {}, cov),
                      Contains("no rows (0 tokens)"));
  REQUIRE_THROWS_WITH(kc::pooled_covariances(rows, -2, {}), Contains("pool must be >= 1 (got -2)"));
  std::vector<kvscore::OjaBasis> one{kvscore::OjaBasis::random(8, 2, 1)};
  REQUIRE_THROWS_WITH(kc::prefill(one, rows, {}), Contains("1 bases for 2 heads"));
  std::vector<kvscore::OjaBasis> wrong_d{kvscore::OjaBasis::random(6, 2, 1), kvscore::OjaBasis::random(6, 2, 2)};
  REQUIRE_THROWS_WITH(kc::prefill(wrong_d, rows, {}), Contains("basis 0 has head_dim 6, rows 8"));
  kvscore::OjaOptions o;
  o.pool = 2;
  std::vector<kvscore::OjaBasis> pools{kvscore::OjaBasis::random(8, 2, 1), kvscore::OjaBasis::random(8, 2, 2, o)};
  REQUIRE_THROWS_WITH(kc::decode_update(pools, rows, {}), Contains("basis 1 pools 2 tokens, basis 0 pools 4"));
  std::vector<kvscore::OjaBasis> buffered{kvscore::OjaBasis::random(8, 2, 1), kvscore::OjaBasis::random(8, 2, 2)};
  const std::vector<float> row(8, 1.f);
  buffered[1].push(row.data());
  REQUIRE_THROWS_WITH(kc::decode_update(buffered, rows, {}), Contains("basis 1 has 1 decode rows buffered"));
  std::vector<kvscore::OjaProjector> proj{kvscore::OjaProjector::random(8, 2, 2, 1)};
  REQUIRE_THROWS_WITH(kc::prefill(proj, rows, rows, {}), Contains("1 bases for 2 heads"));
}

// ================================================================ GPU: projection / reconstruction

namespace {
template <class T>
void compare_projection(std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t r, const Layout& L) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " d " << d << " r " << r << " layout " << L.name);
  const auto host = lowrank_keys<T>(H, N, d, L, unsigned(d + r), false);
  std::vector<kvscore::OjaProjector> proj;
  for (std::int64_t h = 0; h < H; ++h) proj.push_back(kvscore::OjaProjector::random(d, r, r, std::uint64_t(100 + h)));
  const kvscore::KeysView<T> kv(host.data(), H, N, d, L.hs, L.ts);
  const auto cache = kvscore::OjaHybridCache::build(proj, kv, kv, kvscore::Selection::none(H, N));
  const std::vector<float> ub = kc::pack_key_bases(proj);
  const kc::DeviceBuffer dk = upload(host), du = upload(ub);
  kc::DeviceBuffer codes(std::size_t(H * N * r) * sizeof(float)), rec(std::size_t(H * N * d) * sizeof(float));
  const kc::DeviceBasesView bases(du.as<float>(), H, d, r);
  kc::project(kc::DeviceKeysView<T>(dk.as<T>(), H, N, d, L.hs, L.ts), bases,
              kc::DeviceMutKeysView<float>(codes.as<float>(), H, N, r, N * r, r));
  const auto g = download<float>(codes, std::size_t(H * N * r));
  for (std::int64_t h = 0; h < H; ++h) {
    const auto& hd = cache.head(h);
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t i = 0; i < r; ++i) {
        // CPU: fp32 GEMM, |err| <= d·u·Σ_j |k_j U_ji| (+ rounding); GPU: one fp32 rounding.
        double mag = 0;
        for (std::int64_t j = 0; j < d; ++j)
          mag += std::fabs(double(kvscore::to_float(host[std::size_t(h * L.hs + t * L.ts + j)])) * double(hd.uk(j, i)));
        const double c = hd.codes_k(t, i), x = g[std::size_t((h * N + t) * r + i)];
        INFO("head " << h << " token " << t << " i " << i << " cpu " << c << " gpu " << x);
        REQUIRE(std::fabs(x - c) <= double(d + 2) * kU32 * mag + 1e-30);
      }
  }
  // Reconstruction from the CPU's own codes: K^ = codes Uᵀ, |err| <= (r + 2)·u·Σ_i |c_i U_ji|.
  std::vector<float> cc(std::size_t(H * N * r));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t i = 0; i < r; ++i) cc[std::size_t((h * N + t) * r + i)] = cache.head(h).codes_k(t, i);
  const kc::DeviceBuffer dc = upload(cc);
  kc::reconstruct(kc::DeviceKeysView<float>(dc.as<float>(), H, N, r, N * r, r), bases,
                  kc::DeviceMutKeysView<float>(rec.as<float>(), H, N, d, N * d, d));
  const auto gr = download<float>(rec, std::size_t(H * N * d));
  for (std::int64_t h = 0; h < H; ++h) {
    const auto ref = cache.reconstruct_keys(h);
    const auto& hd = cache.head(h);
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < d; ++j) {
        double mag = 0;
        for (std::int64_t i = 0; i < r; ++i) mag += std::fabs(double(hd.codes_k(t, i)) * double(hd.uk(j, i)));
        const double c = ref(t, j), x = gr[std::size_t((h * N + t) * d + j)];
        INFO("head " << h << " token " << t << " dim " << j << " cpu " << c << " gpu " << x);
        REQUIRE(std::fabs(x - c) <= double(r + 2) * kU32 * mag + 1e-30);
      }
  }
  // Deterministic: same bits again.
  kc::project(kc::DeviceKeysView<T>(dk.as<T>(), H, N, d, L.hs, L.ts), bases,
              kc::DeviceMutKeysView<float>(codes.as<float>(), H, N, r, N * r, r));
  const auto g2 = download<float>(codes, std::size_t(H * N * r));
  REQUIRE(std::memcmp(g.data(), g2.data(), g.size() * sizeof(float)) == 0);
}
}  // namespace

TEST_CASE("cuda ojakv: projection and reconstruction match OjaHybridCache", "[cuda][gpu]") {
  compare_projection<float>(3, 700, 64, 16, hf(3, 700, 64));
  compare_projection<half>(2, 500, 128, 32, hf(2, 500, 128));
  compare_projection<bfloat16>(2, 300, 128, 32, token_major(2, 300, 128));
  compare_projection<half>(2, 200, 40, 40, hf(2, 200, 40));  // full rank, odd head_dim
  compare_projection<float>(1, 50, 256, 64, hf(1, 50, 256));
}

// ================================================================ GPU: residual score and selection

namespace {
template <class T>
void compare_residual(std::int64_t H, std::int64_t G, std::int64_t w, std::int64_t N, std::int64_t d,
                      const std::vector<std::int64_t>& ranks, const Layout& L) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " d " << d << " layout " << L.name << " N " << N);
  const auto q = random_queries(H * G * w * d, unsigned(d + N));
  const auto bases = random_bases(H, d, ranks, 5);
  const auto host = lowrank_keys<T>(H, N, d, L, unsigned(3 * d), true);
  const kc::OjaResidual s(q.data(), H * G, w, d, bases);
  const auto cpu = s.score(kvscore::KeysView<T>(host.data(), H, N, d, L.hs, L.ts));
  std::vector<float> replay;
  std::vector<double> scale;
  device_formula(host, L, H, N, d, q, H * G, w, bases, replay, scale);
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<T> keys(dk.as<T>(), H, N, d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys)), out(std::size_t(H * N) * sizeof(float));
  const kc::DeviceScoresView sv(out.as<float>(), H, N);
  kc::score(s, keys, sv, {ws.get(), ws.bytes()});
  kc::synchronize();
  const auto g = download<float>(out, std::size_t(H * N));
  check_residual(cpu.values(), g, scale, H, N, d, s.max_rank(), G * w);
  kc::score(s, keys, sv, {ws.get(), ws.bytes()});
  const auto again = download<float>(out, std::size_t(H * N));
  REQUIRE(std::memcmp(g.data(), again.data(), g.size() * sizeof(float)) == 0);

  // The selection it feeds: identical positions when no pair near the cut is within tolerance.
  const std::int64_t k = N / 4;
  for (std::int64_t h = 0; h < H; ++h) {
    if (bases[std::size_t(h)].cols() == d) {  // full rank: residual 0 by definition, on both sides exactly
      for (std::int64_t t = 0; t < N; ++t) {
        const float c = cpu(h, t);
        INFO("full-rank head " << h << " token " << t);
        REQUIRE((c == 0.f || c == kvscore::kInvalidScore));
        REQUIRE(g[std::size_t(h * N + t)] == c);
      }
      continue;  // all ties: the tie rule (lower position) decides, on both sides
    }
    std::vector<float> v(cpu.values().begin() + h * N, cpu.values().begin() + (h + 1) * N);
    std::sort(v.begin(), v.end(), std::greater<float>());
    INFO("head " << h << " cut " << v[std::size_t(k - 1)] << " / " << v[std::size_t(k)]);
    REQUIRE(double(v[std::size_t(k - 1)]) - double(v[std::size_t(k)]) > 1e-5 * std::fabs(double(v[std::size_t(k)])));
  }
  const kvscore::Selection ref = kvscore::select(kvscore::ConstScoresView(cpu.values().data(), H, N),
                                                 kvscore::Budget::per_head(k));
  const kvscore::Selection got = kc::select(sv, kvscore::Budget::per_head(k));
  REQUIRE(got.offsets == ref.offsets);
  REQUIRE(got.positions == ref.positions);
}
}  // namespace

TEST_CASE("cuda ojakv: residual scores match OjaResidual and select the same tokens", "[cuda][gpu]") {
  compare_residual<float>(2, 2, 16, 1100, 64, {8, 16}, hf(2, 1100, 64));
  compare_residual<half>(2, 4, 32, 900, 128, {32}, hf(2, 900, 128));
  compare_residual<bfloat16>(3, 1, 8, 600, 128, {32, 4, 128}, token_major(3, 600, 128));  // 128 = d: issue 30
  compare_residual<float>(2, 2, 8, 400, 64, {64, 63}, hf(2, 400, 64));  // full rank beside d - 1
  compare_residual<half>(2, 2, 16, 500, 40, {10, 40}, hf(2, 500, 40));
  compare_residual<float>(1, 8, 64, 300, 256, {64}, hf(1, 300, 256));  // d = 256: 32-token tiles in 82 KB of shared memory (opt-in above 48 KB)
  compare_residual<float>(2, 1, 40, 40, 32, {8}, hf(2, 40, 32));       // window = tokens: every query partial
}

// ================================================================ GPU: batched Oja update

namespace {
/// CPU pooled covariance of head h (oja::PooledCovariance, as OjaBasis::prefill builds it).
template <class T>
kvscore::oja::Mat cpu_covariance(const std::vector<T>& host, const Layout& L, std::int64_t h, std::int64_t N,
                                 std::int64_t d, std::int64_t pool, std::int64_t& valid, std::int64_t& pooled) {
  kvscore::oja::PooledCovariance pc(d, pool);
  std::vector<double> row(static_cast<std::size_t>(d));
  for (std::int64_t t = 0; t < N; ++t) {
    const bool ok = kvscore::oja::widen_row(host.data() + h * L.hs + t * L.ts, d, row.data());
    pc.add(t, row.data(), ok);
  }
  kvscore::oja::Mat c = pc.finish();
  valid = pc.valid;
  pooled = pc.pooled;
  return c;
}

void check_basis(const MatrixXd& cpu, const MatrixXd& gpu) {
  // Same covariance up to fp64 summation order; prefill's early stop (step <= 1e-7) may differ
  // by one step between the two, which moves U by at most ~1e-7.
  INFO("max |U_gpu - U_cpu| = " << (gpu - cpu).cwiseAbs().maxCoeff());
  REQUIRE(kvscore::subspace_overlap(cpu, gpu) >= 1.0 - 1e-10);
  REQUIRE((gpu - cpu).cwiseAbs().maxCoeff() <= 1e-6);
}
}  // namespace

TEST_CASE("cuda ojakv: pooled covariance matches oja::PooledCovariance", "[cuda][gpu]") {
  for (std::int64_t pool : {1, 4, 7}) {
    const std::int64_t H = 3, N = 2003, d = 64;
    INFO("pool " << pool);
    const Layout L = hf(H, N, d);
    auto host = lowrank_keys<half>(H, N, d, L, unsigned(pool), true);
    for (std::int64_t t = 0; t < N; ++t) host[std::size_t(2 * L.hs + t * L.ts)] = kvscore::from_float<half>(kNaN);
    const kc::DeviceBuffer dk = upload(host);
    const kc::DeviceKeysView<half> rows(dk.as<half>(), H, N, d, L.hs, L.ts);
    kc::DeviceBuffer ws(kc::covariance_workspace_bytes(rows, pool));
    const kc::PooledCovariances g = kc::pooled_covariances(rows, pool, {ws.get(), ws.bytes()});
    for (std::int64_t h = 0; h < H; ++h) {
      std::int64_t valid = 0, pooled = 0;
      const auto c = cpu_covariance(host, L, h, N, d, pool, valid, pooled);
      REQUIRE(g.valid[std::size_t(h)] == valid);
      REQUIRE(g.pooled[std::size_t(h)] == pooled);
      if (h == 2) {
        REQUIRE(valid == 0);
        REQUIRE(g.cov[2].cwiseAbs().maxCoeff() == 0.0);
        continue;
      }
      // |Σ x_a x_b| sums of m terms in two orders: <= (m + 2)·u·Σ|x_a x_b|/m <= (m + 2)·u·√(C_aa C_bb).
      for (std::int64_t a = 0; a < d; ++a)
        for (std::int64_t b = 0; b < d; ++b) {
          const double tol = double(pooled + 2) * kU64 * std::sqrt(c(a, a) * c(b, b)) + 1e-300;
          INFO("head " << h << " (" << a << ", " << b << ") cpu " << c(a, b) << " gpu " << g.cov[std::size_t(h)](a, b));
          REQUIRE(std::fabs(g.cov[std::size_t(h)](a, b) - c(a, b)) <= tol);
          REQUIRE(g.cov[std::size_t(h)](a, b) == g.cov[std::size_t(h)](b, a));  // exactly symmetric
        }
    }
  }
}

TEST_CASE("cuda ojakv: prefill and decode updates match OjaBasis", "[cuda][gpu]") {
  for (std::int64_t d : {64, 128}) {
    const std::int64_t H = 2, N = 3000, r = d / 4;
    INFO("d " << d);
    const Layout L = hf(H, N, d);
    const auto host = lowrank_keys<bfloat16>(H, N, d, L, unsigned(d), true);
    std::vector<kvscore::OjaBasis> cpu, gpu;
    for (std::int64_t h = 0; h < H; ++h) {
      cpu.push_back(kvscore::OjaBasis::random(d, r, std::uint64_t(40 + h)));
      gpu.push_back(kvscore::OjaBasis::random(d, r, std::uint64_t(40 + h)));
    }
    const kvscore::KeysView<bfloat16> kv(host.data(), H, N, d, L.hs, L.ts);
    const kc::DeviceBuffer dk = upload(host);
    const kc::DeviceKeysView<bfloat16> rows(dk.as<bfloat16>(), H, N, d, L.hs, L.ts);
    kc::DeviceBuffer ws(kc::covariance_workspace_bytes(rows, 4));
    const auto upd = kc::prefill(gpu, rows, {ws.get(), ws.bytes()});
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t valid = cpu[std::size_t(h)].prefill(kv, h);
      REQUIRE(upd[std::size_t(h)].valid == valid);
      check_basis(cpu[std::size_t(h)].basis(), gpu[std::size_t(h)].basis());
    }
    // Decode: the next T = 128 rows (a drifted stream), pushed one by one on the CPU.
    const std::int64_t T = 128;
    const auto next = lowrank_keys<bfloat16>(H, T, d, hf(H, T, d), unsigned(d + 1), false);
    for (std::int64_t h = 0; h < H; ++h) {
      bool updated = false;
      for (std::int64_t t = 0; t < T; ++t) updated = cpu[std::size_t(h)].push(next.data() + (h * T + t) * d);
      REQUIRE(updated);
    }
    const kc::DeviceBuffer dn = upload(next);
    const kc::DeviceKeysView<bfloat16> nrows(dn.as<bfloat16>(), H, T, d, T * d, d);
    kc::DeviceBuffer ws2(kc::covariance_workspace_bytes(nrows, 4));
    const auto du = kc::decode_update(gpu, nrows, {ws2.get(), ws2.bytes()});
    for (std::int64_t h = 0; h < H; ++h) {
      REQUIRE(du[std::size_t(h)].steps == 1);
      REQUIRE(du[std::size_t(h)].valid == T);
      check_basis(cpu[std::size_t(h)].basis(), gpu[std::size_t(h)].basis());
    }
  }
}

TEST_CASE("cuda ojakv: projector prefill updates both bases like OjaProjector::prefill", "[cuda][gpu]") {
  const std::int64_t H = 2, N = 1000, d = 64;
  const Layout L = hf(H, N, d);
  const auto k = lowrank_keys<half>(H, N, d, L, 1, false), v = lowrank_keys<half>(H, N, d, L, 2, false);
  std::vector<kvscore::OjaProjector> cpu, gpu;
  for (std::int64_t h = 0; h < H; ++h) {
    cpu.push_back(kvscore::OjaProjector::random(d, 16, 8, std::uint64_t(h)));
    gpu.push_back(kvscore::OjaProjector::random(d, 16, 8, std::uint64_t(h)));
  }
  const kc::DeviceBuffer dk = upload(k), dv = upload(v);
  const kc::DeviceKeysView<half> keys(dk.as<half>(), H, N, d, L.hs, L.ts), values(dv.as<half>(), H, N, d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::covariance_workspace_bytes(keys, 4));
  kc::prefill(gpu, keys, values, {ws.get(), ws.bytes()});
  for (std::int64_t h = 0; h < H; ++h) {
    cpu[std::size_t(h)].prefill(kvscore::KeysView<half>(k.data(), H, N, d, L.hs, L.ts),
                                kvscore::KeysView<half>(v.data(), H, N, d, L.hs, L.ts), h);
    check_basis(cpu[std::size_t(h)].key().basis(), gpu[std::size_t(h)].key().basis());
    check_basis(cpu[std::size_t(h)].value().basis(), gpu[std::size_t(h)].value().basis());
  }
}

TEST_CASE("cuda ojakv: host memory and small workspaces are rejected", "[cuda][gpu]") {
  const std::int64_t H = 2, N = 64, d = 32;
  std::vector<float> host(std::size_t(H * N * d), 1.f);
  const auto q = random_queries(H * 8 * d, 1);
  const kc::OjaResidual s(q.data(), H, 8, d, random_bases(H, d, {8}, 1));
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  const kc::DeviceKeysView<float> hk(host.data(), H, N, d, N * d, d);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, hk));
  REQUIRE_THROWS_WITH(kc::score(s, hk, kc::DeviceScoresView(out.as<float>(), H, N), {ws.get(), ws.bytes()}),
                      Contains("keys is not device memory"));
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<float> keys(dk.as<float>(), H, N, d, N * d, d);
  kc::DeviceBuffer small(kc::score_workspace_bytes(s, keys) - 1);
  REQUIRE_THROWS_WITH(kc::score(s, keys, kc::DeviceScoresView(out.as<float>(), H, N), {small.get(), small.bytes()}),
                      Contains("smaller than the"));
  kc::DeviceBuffer cws(kc::covariance_workspace_bytes(keys, 4) - 1), cov(std::size_t(H * d * d) * sizeof(double));
  REQUIRE_THROWS_WITH(kc::pooled_covariance_into(keys, 4, {cws.get(), cws.bytes()}, cov.as<double>()),
                      Contains("smaller than the"));
}
