// cuda/tests/test_cuda_errors.cpp — CUDA error hygiene (docs/reference/cuda.md, "Errors"): a failed kvscore
// call leaves no pending error behind, a kvscore launch check reports only its own launch, and an
// error the caller left pending is reported as the caller's and left pending, never taken.
//
// The first GPU run failed here: a test provoked a failed allocation, kvscore threw without taking
// the error, and the next test's first healthy launch reported the stale "out of memory" as its own.
// So the [gpu] case runs a failed allocation and then every kind of kvscore launch, in one process.
#include "cuda_harness.hpp"

#include <cuda_runtime.h>

#include <kvscore/cuda/compact.hpp>
#include <kvscore/cuda/ojakv.hpp>
#include <kvscore/cuda/pariskv.hpp>
#include <kvscore/cuda/protokv.hpp>
#include <kvscore/cuda/scorers.hpp>
#include <kvscore/cuda/select.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::Contains;
using kvscore::half;

constexpr std::int64_t H = 2, N = 512, d = 64;

/// A kvscore allocation that must fail (2^60 bytes).
void failed_kvscore_allocation() { REQUIRE_THROWS_AS(kc::DeviceBuffer(std::size_t(1) << 60), kc::Error); }

std::vector<float> normal(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

std::vector<half> half_keys(unsigned seed) {
  const std::vector<float> f = normal(std::size_t(H * N * d), seed);
  std::vector<half> k(f.size());
  for (std::size_t i = 0; i < f.size(); ++i) k[i] = kvscore::from_float<half>(f[i]);
  return k;
}

/// Runs `launch`, synchronises, and requires that nothing is left pending.
template <class F>
void clean(const char* what, F&& launch) {
  INFO(what);
  REQUIRE_NOTHROW(launch());
  REQUIRE_NOTHROW(kc::synchronize());
  REQUIRE(cudaPeekAtLastError() == cudaSuccess);
}

template <class S>
void score_once(const S& s, const kc::DeviceKeysView<half>& keys, float* out) {
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys));
  kc::score(s, keys, kc::DeviceScoresView(out, H, N), {ws.get(), ws.bytes()});
}

}  // namespace

TEST_CASE("cuda errors: without a usable driver an entry point says so, not 'pending'", "[cuda][host]") {
  if (kc::device_count() > 0) return;  // the [gpu] cases below cover a machine with a device
  // No driver or no device: every CUDA call returns the runtime's initialisation error, even the
  // peek at the last error; it must not be blamed on an earlier call of the caller's.
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));
  const kc::DeviceKeysView<float> keys(fake, 2, 10, 8, 80, 8);
  try {
    kc::score(kvscore::KNorm{}, keys, kc::DeviceScoresView(fake, 2, 10));
    FAIL("kvscore::cuda::score ran without a usable CUDA runtime");
  } catch (const kc::Error& e) {
    REQUIRE(e.code() != 0);
    REQUIRE_THAT(e.what(), Contains("kvscore::cuda::score: CUDA is not usable in this process: cudaGetDevice"));
    REQUIRE_THAT(e.what(), !Contains("pending"));
  }
}

TEST_CASE("cuda errors: a failed kvscore allocation leaves no pending CUDA error", "[cuda][gpu]") {
  (void)cudaGetLastError();
  failed_kvscore_allocation();
  REQUIRE(cudaPeekAtLastError() == cudaSuccess);
  REQUIRE(cudaGetLastError() == cudaSuccess);
}

TEST_CASE("cuda errors: after a failed allocation every kind of kvscore launch reports only its own errors",
          "[cuda][gpu]") {
  failed_kvscore_allocation();

  const std::vector<half> host = half_keys(1);
  const kc::DeviceBuffer dk = upload(host), dv = upload(half_keys(2));
  const kc::DeviceKeysView<half> keys(dk.as<half>(), H, N, d, N * d, d);
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  const std::vector<float> queries = normal(std::size_t(2 * H * 16 * d), 3);

  clean("knorm", [&] { score_once(kvscore::KNorm{}, keys, out.as<float>()); });
  clean("keydiff", [&] { score_once(kvscore::KeyDiff{}, keys, out.as<float>()); });
  clean("manifold_l2", [&] { score_once(kvscore::ManifoldL2{}, keys, out.as<float>()); });
  clean("windowed_manifold_l2", [&] { score_once(kvscore::WindowedManifoldL2(128), keys, out.as<float>()); });
  clean("qfilter", [&] { score_once(kvscore::QFilter(normal(std::size_t(H * d), 4), H, d), keys, out.as<float>()); });
  clean("snapkv", [&] { score_once(kvscore::SnapKV(queries.data(), 2 * H, 16, d), keys, out.as<float>()); });
  clean("protokv", [&] {
    kvscore::ProtoKV p(queries.data(), 2 * H, 16, d);
    p.psi = kvscore::ProtoKV::Psi::sum;  // the GPU path has sum and mean (attention runs on the CPU)
    score_once(p, keys, out.as<float>());
  });
  const std::vector<Eigen::MatrixXd> bases = {kvscore::oja::random_orthonormal(d, 8, 5),
                                              kvscore::oja::random_orthonormal(d, 8, 6)};
  clean("ojakv residual", [&] { score_once(kc::OjaResidual(queries.data(), 2 * H, 16, d, bases), keys, out.as<float>()); });

  const kc::DeviceScoresView sv(out.as<float>(), H, N);
  for (const kc::TopkPath path : {kc::TopkPath::one_cta_per_row, kc::TopkPath::multi_cta_per_row}) {
    kc::DeviceBuffer ws(kc::topk_workspace_bytes(sv, 50, path)), pos(std::size_t(H * 50) * sizeof(std::int64_t));
    clean("top-k", [&] { kc::topk_into(sv, 50, {ws.get(), ws.bytes()}, pos.as<std::int64_t>(), nullptr, path); });
  }
  kvscore::SelectOptions adakv;
  adakv.alloc = kvscore::Alloc::adakv;
  kvscore::Selection sel;
  clean("AdaKV select", [&] { sel = kc::select(sv, kvscore::Budget::per_layer(H * N / 4), adakv); });
  clean("compaction", [&] {
    kc::DeviceBuffer ws(kc::compact_workspace_bytes(sel));
    kc::compact(kc::DeviceMutKeysView<half>(const_cast<half*>(dk.as<half>()), H, N, d, N * d, d),
                kc::DeviceMutKeysView<half>(const_cast<half*>(dv.as<half>()), H, N, d, N * d, d), sel,
                {ws.get(), ws.bytes()});
  });

  const kc::DeviceBuffer fresh = upload(host);
  const kc::DeviceKeysView<half> fk(fresh.as<half>(), H, N, d, N * d, d);
  kc::ParisKV index(H, d);
  clean("ParisKV append", [&] { index.append(fk); });
  const kc::DeviceBuffer dq = upload(normal(std::size_t(H * d), 7));
  kvscore::ParisKVSearch opt;
  opt.k = 20;
  kc::DeviceBuffer ws(index.search_workspace_bytes(H, 1, opt));
  kc::DeviceBuffer pos(std::size_t(H * opt.k) * sizeof(std::int64_t)), sc(std::size_t(H * opt.k) * sizeof(float));
  clean("ParisKV search", [&] {
    index.search(dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()});
  });

  const std::vector<float> ub = kc::pack_bases(bases);
  const kc::DeviceBuffer du = upload(ub);
  const kc::DeviceBasesView bv(du.as<float>(), H, d, 8);
  kc::DeviceBuffer codes(std::size_t(H * N * 8) * sizeof(float)), rec(std::size_t(H * N * d) * sizeof(float));
  clean("OjaKV project", [&] { kc::project(fk, bv, kc::DeviceMutKeysView<float>(codes.as<float>(), H, N, 8, N * 8, 8)); });
  clean("OjaKV reconstruct", [&] {
    kc::reconstruct(kc::DeviceKeysView<float>(codes.as<float>(), H, N, 8, N * 8, 8), bv,
                    kc::DeviceMutKeysView<float>(rec.as<float>(), H, N, d, N * d, d));
  });
  clean("OjaKV covariance", [&] {
    kc::DeviceBuffer cws(kc::covariance_workspace_bytes(fk, 4)), cov(std::size_t(H * d * d) * sizeof(double));
    kc::pooled_covariance_into(fk, 4, {cws.get(), cws.bytes()}, cov.as<double>());
  });
}

TEST_CASE("cuda errors: an error the caller left pending is reported as the caller's and left pending",
          "[cuda][gpu]") {
  const kc::DeviceBuffer dk = upload(half_keys(9));
  const kc::DeviceKeysView<half> keys(dk.as<half>(), H, N, d, N * d, d);
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, std::size_t(1) << 60) == cudaErrorMemoryAllocation);  // the caller's own failure
  try {
    score_once(kvscore::KNorm{}, keys, out.as<float>());
    FAIL("kvscore launched over a pending error");
  } catch (const kc::Error& e) {
    REQUIRE(e.code() == int(cudaErrorMemoryAllocation));
    REQUIRE_THAT(e.what(), Contains("already pending before this call") && Contains("cudaErrorMemoryAllocation") &&
                               Contains("kvscore::cuda::score"));
  }
  REQUIRE(cudaGetLastError() == cudaErrorMemoryAllocation);  // still the caller's to take
  clean("knorm once the caller took it", [&] { score_once(kvscore::KNorm{}, keys, out.as<float>()); });
}
