// cuda/bench/bench_cuda_ojakv.cpp — GPU benchmarks of OjaKV (kvscore/cuda/ojakv.hpp): projection,
// reconstruction, the residual score and the pooled covariance; fp16 keys, d = 128, r = 32.
//
// Counters as bench_cuda.cpp: bytes_per_second (bytes each call must move) and
// bandwidth_fraction = that rate / the device-to-device copy rate of a buffer of the key
// footprint. The residual and the covariance are compute-bound (fp64, G·w·(d + r) and d² FMAs
// per token / pooled row): they also report flops_per_second (FMA = 2 flops).
#include <benchmark/benchmark.h>

#include "bench_util.hpp"

#include <kvscore/cuda/ojakv.hpp>

#include <cstdint>
#include <vector>

namespace {

constexpr std::int64_t kDim = 128, kRank = 32;

std::vector<Eigen::MatrixXd> bench_bases(std::int64_t H) {
  std::vector<Eigen::MatrixXd> b;
  for (std::int64_t h = 0; h < H; ++h) b.push_back(kvscore::oja::random_orthonormal(kDim, kRank, std::uint64_t(h + 1)));
  return b;
}

void counters(benchmark::State& st, double bytes, double key_bytes, double flops) {
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bandwidth_fraction"] = benchmark::Counter(bytes / copy_bytes_per_second(std::size_t(key_bytes)),
                                                         benchmark::Counter::kIsIterationInvariantRate);
  if (flops > 0) st.counters["flops_per_second"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

/// codes = K U (range(0) = N tokens, range(1) = heads).
void BM_cuda_oja_project(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1);
  const kc::DeviceBuffer& k = device_keys(H, N, kDim);
  const kc::DeviceKeysView<kvscore::half> keys(k.as<kvscore::half>(), H, N, kDim, N * kDim, kDim);
  const std::vector<float> ub = kc::pack_bases(bench_bases(H));
  kc::DeviceBuffer u(ub.size() * sizeof(float)), codes(std::size_t(H * N * kRank) * sizeof(float));
  kc::copy_to_device(u.get(), ub.data(), ub.size() * sizeof(float));
  const kc::DeviceBasesView bases(u.as<float>(), H, kDim, kRank);
  const kc::DeviceMutKeysView<float> cv(codes.as<float>(), H, N, kRank, N * kRank, kRank);
  kc::project(keys, bases, cv);
  for (auto _ : st) st.SetIterationTime(gpu_seconds([&] { kc::project(keys, bases, cv); }));
  const double key_bytes = double(H * N * kDim) * 2.0;
  counters(st, key_bytes + double(H * N * kRank) * 4.0, key_bytes, 2.0 * double(H * N * kDim * kRank));
  st.SetItemsProcessed(st.iterations() * H * N);
}

/// K^ = codes Uᵀ (fp32 codes in, fp32 rows out).
void BM_cuda_oja_reconstruct(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1);
  const std::vector<float> ub = kc::pack_bases(bench_bases(H));
  kc::DeviceBuffer u(ub.size() * sizeof(float)), codes(std::size_t(H * N * kRank) * sizeof(float)),
      out(std::size_t(H * N * kDim) * sizeof(float));
  kc::copy_to_device(u.get(), ub.data(), ub.size() * sizeof(float));
  CHECK(cudaMemset(codes.get(), 0, codes.bytes()));
  const kc::DeviceBasesView bases(u.as<float>(), H, kDim, kRank);
  const kc::DeviceKeysView<float> cv(codes.as<float>(), H, N, kRank, N * kRank, kRank);
  const kc::DeviceMutKeysView<float> ov(out.as<float>(), H, N, kDim, N * kDim, kDim);
  kc::reconstruct(cv, bases, ov);
  for (auto _ : st) st.SetIterationTime(gpu_seconds([&] { kc::reconstruct(cv, bases, ov); }));
  const double out_bytes = double(H * N * kDim) * 4.0;
  counters(st, double(H * N * kRank) * 4.0 + out_bytes, out_bytes, 2.0 * double(H * N * kDim * kRank));
  st.SetItemsProcessed(st.iterations() * H * N);
}

/// Residual score: GQA group 4, window 32 (128 queries per KV head).
void BM_cuda_oja_residual(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1), G = 4, w = 32;
  const kc::DeviceBuffer& k = device_keys(H, N, kDim);
  const kc::DeviceKeysView<kvscore::half> keys(k.as<kvscore::half>(), H, N, kDim, N * kDim, kDim);
  const std::vector<float> q(std::size_t(H * G * w * kDim), 0.05f);
  const kc::OjaResidual s(q.data(), H * G, w, kDim, bench_bases(H));
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys)), out(std::size_t(H * N) * sizeof(float));
  const kc::DeviceScoresView sv(out.as<float>(), H, N);
  kc::score(s, keys, sv, {ws.get(), ws.bytes()});
  for (auto _ : st) st.SetIterationTime(gpu_seconds([&] { kc::score(s, keys, sv, {ws.get(), ws.bytes()}); }));
  const double key_bytes = double(H * N * kDim) * 2.0;
  const double fma = double(H * N) * (double(kDim * kRank) + double(G * w * (kDim + kRank)));
  counters(st, key_bytes + double(H * N) * 4.0, key_bytes, 2.0 * fma);
  st.SetItemsProcessed(st.iterations() * H * N);
}

/// Pooled covariance (pool 4) on the device: the O(N d²) part of a prefill update.
void BM_cuda_oja_covariance(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1), pool = 4;
  const kc::DeviceBuffer& k = device_keys(H, N, kDim);
  const kc::DeviceKeysView<kvscore::half> keys(k.as<kvscore::half>(), H, N, kDim, N * kDim, kDim);
  kc::DeviceBuffer ws(kc::covariance_workspace_bytes(keys, pool)), cov(std::size_t(H * kDim * kDim) * sizeof(double));
  kc::pooled_covariance_into(keys, pool, {ws.get(), ws.bytes()}, cov.as<double>());
  for (auto _ : st)
    st.SetIterationTime(gpu_seconds([&] { kc::pooled_covariance_into(keys, pool, {ws.get(), ws.bytes()}, cov.as<double>()); }));
  const double key_bytes = double(H * N * kDim) * 2.0;
  counters(st, key_bytes, key_bytes, 2.0 * double(H * ((N + pool - 1) / pool) * kDim * kDim));
  st.SetItemsProcessed(st.iterations() * H * N);
}

void oja_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t N : {std::int64_t(1) << 16, std::int64_t(1) << 20}) b->Args({N, 8});
  b->ArgNames({"N", "heads"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_cuda_oja_project)->Apply(oja_args);
BENCHMARK(BM_cuda_oja_reconstruct)->Apply(oja_args);
BENCHMARK(BM_cuda_oja_residual)->Apply(oja_args);
BENCHMARK(BM_cuda_oja_covariance)->Apply(oja_args);

}  // namespace
