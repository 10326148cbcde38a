// cuda/bench/bench_cuda.cpp — GPU benchmarks of kvscore::cuda (Google Benchmark, manual time
// from CUDA events).
//
// Every case reports bytes_per_second (bytes it must move: key reads × passes + scores written;
// top-k: one read of the scores + positions written) and bandwidth_fraction = that rate divided
// by the rate of a device-to-device cudaMemcpyAsync (read + write bytes) of a buffer of the same
// footprint, measured in the same process (best of 10). Goal (issue 7): >= 0.8 for the scorers.
// Without a CUDA device the binary says so and exits 0.
//
//   kvscore_cuda_bench --benchmark_filter=topk --benchmark_format=json   (cuda/bench/torch_peer.py uses this)
#include <benchmark/benchmark.h>

#include "bench_util.hpp"

#include <kvscore/cuda/scorers.hpp>
#include <kvscore/cuda/select.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <tuple>
#include <vector>

namespace {

template <class S>
void run_scorer(benchmark::State& st, const S& s, int passes) {
  const std::int64_t N = st.range(0), H = st.range(1), d = 128;
  const kc::DeviceBuffer& k = device_keys(H, N, d);
  const kc::DeviceKeysView<kvscore::half> keys(k.as<kvscore::half>(), H, N, d, N * d, d);
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  kc::DeviceBuffer ws(kc::score_workspace_bytes(s, keys));
  const kc::DeviceScoresView sv(out.as<float>(), H, N);
  kc::score(s, keys, sv, {ws.get(), ws.bytes()});  // warm-up
  for (auto _ : st) st.SetIterationTime(gpu_seconds([&] { kc::score(s, keys, sv, {ws.get(), ws.bytes()}); }));
  const double key_bytes = double(H * N * d) * 2.0;
  const double bytes = passes * key_bytes + double(H * N) * 4.0;
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bandwidth_fraction"] =
      benchmark::Counter(bytes / copy_bytes_per_second(std::size_t(key_bytes)), benchmark::Counter::kIsIterationInvariantRate);
  st.SetItemsProcessed(st.iterations() * H * N);
}

void BM_cuda_knorm(benchmark::State& st) { run_scorer(st, kvscore::KNorm{}, kvscore::KNorm::passes); }
void BM_cuda_keydiff(benchmark::State& st) { run_scorer(st, kvscore::KeyDiff{}, kvscore::KeyDiff::passes); }
void BM_cuda_l2(benchmark::State& st) { run_scorer(st, kvscore::ManifoldL2{}, kvscore::ManifoldL2::passes); }
void BM_cuda_windowed_l2(benchmark::State& st) {
  run_scorer(st, kvscore::WindowedManifoldL2{}, kvscore::WindowedManifoldL2::passes);
}
void BM_cuda_qfilter(benchmark::State& st) {
  const std::int64_t H = st.range(1);
  run_scorer(st, kvscore::QFilter(std::vector<float>(std::size_t(H * 128), 0.1f), H, 128), kvscore::QFilter::passes);
}
void BM_cuda_snapkv(benchmark::State& st) {  // window 64, GQA group 4
  const std::int64_t H = st.range(1);
  std::vector<float> q(std::size_t(H * 4 * 64 * 128), 0.05f);
  run_scorer(st, kvscore::SnapKV(q.data(), H * 4, 64, 128), kvscore::SnapKV::passes);
}

void scorer_args(benchmark::internal::Benchmark* b) {
  for (std::int64_t N : {std::int64_t(1) << 16, std::int64_t(1) << 20})
    for (std::int64_t H : {8, 32}) b->Args({N, H});
  b->ArgNames({"N", "heads"})->UseManualTime()->Unit(benchmark::kMicrosecond);
}
BENCHMARK(BM_cuda_knorm)->Apply(scorer_args);
BENCHMARK(BM_cuda_keydiff)->Apply(scorer_args);
BENCHMARK(BM_cuda_l2)->Apply(scorer_args);
BENCHMARK(BM_cuda_windowed_l2)->Apply(scorer_args);
BENCHMARK(BM_cuda_qfilter)->Apply(scorer_args);
BENCHMARK(BM_cuda_snapkv)->Apply(scorer_args);

/// Batched top-k: rows x N random fp32 scores, k = N / range(2); range(3) = TopkPath.
void BM_cuda_topk(benchmark::State& st) {
  const std::int64_t R = st.range(0), N = st.range(1), k = N / st.range(2);
  const auto path = kc::TopkPath(st.range(3));
  kc::DeviceBuffer s(std::size_t(R * N) * sizeof(float));
  kvbench::fill_normal_f32(s.as<float>(), std::size_t(R * N), 2);  // N(0, 1) scores, drawn on the device
  const kc::DeviceScoresView sv(s.as<float>(), R, N);
  kc::DeviceBuffer ws(kc::topk_workspace_bytes(sv, k, path));
  kc::DeviceBuffer out(std::size_t(R * k) * sizeof(std::int64_t));
  kc::topk_into(sv, k, {ws.get(), ws.bytes()}, out.as<std::int64_t>(), nullptr, path);
  for (auto _ : st)
    st.SetIterationTime(gpu_seconds([&] { kc::topk_into(sv, k, {ws.get(), ws.bytes()}, out.as<std::int64_t>(), nullptr, path); }));
  const double bytes = double(R * N) * 4.0 + double(R * k) * 8.0;
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bandwidth_fraction"] = benchmark::Counter(bytes / copy_bytes_per_second(std::size_t(R * N) * 4),
                                                         benchmark::Counter::kIsIterationInvariantRate);
  st.SetItemsProcessed(st.iterations() * R * N);
}
BENCHMARK(BM_cuda_topk)
    ->ArgNames({"rows", "N", "N_over_k", "path"})
    ->Args({256, 1 << 16, 10, 0})
    ->Args({256, 1 << 16, 2, 0})
    ->Args({32, 1 << 20, 10, 0})
    ->Args({32, 1 << 20, 2, 0})
    ->Args({32, 1 << 20, 10, 1})
    ->Args({32, 1 << 20, 10, 2})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
