// cuda/bench/bench_cuda.cpp — GPU benchmarks of kvscore::cuda (Google Benchmark, manual time
// from CUDA events).
//
// Every case reports bytes_per_second (bytes it must move: key reads × passes + scores written;
// top-k: one read of the scores + positions written) and bandwidth_fraction = that rate divided
// by the rate of a device-to-device cudaMemcpyAsync (read + write bytes) of a buffer of the same
// footprint, measured in the same process (best of 10). Goal (issue 7): >= 0.8 for the scorers.
// Without a CUDA device the binary says so and exits 0.
//
//   kvscore_cuda_bench --benchmark_filter=topk --benchmark_format=json   (cuda/bench/torch_topk.py uses this)
#include <benchmark/benchmark.h>

#include <cuda_runtime.h>

#include <kvscore/cuda/scorers.hpp>
#include <kvscore/cuda/select.hpp>

#include <algorithm>
#include <cstdio>
#include <map>
#include <random>
#include <tuple>
#include <vector>

namespace {

namespace kc = kvscore::cuda;

#define CHECK(x)                                                                                          \
  do {                                                                                                    \
    const cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                              \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                                       \
      std::abort();                                                                                       \
    }                                                                                                     \
  } while (0)

/// Seconds of f() on the GPU (CUDA events on the default stream).
template <class F>
double gpu_seconds(F&& f) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  CHECK(cudaEventRecord(a));
  f();
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  return double(ms) * 1e-3;
}

/// Bytes per second (read + write) of a device-to-device copy of `bytes`, best of 10; per size.
double copy_bytes_per_second(std::size_t bytes) {
  static std::map<std::size_t, double> cache;
  if (auto it = cache.find(bytes); it != cache.end()) return it->second;
  kc::DeviceBuffer src(bytes), dst(bytes);
  CHECK(cudaMemset(src.get(), 1, bytes));
  double best = 1e30;
  for (int i = 0; i < 11; ++i) {
    const double s = gpu_seconds([&] { CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice)); });
    if (i > 0) best = std::min(best, s);  // the first is a warm-up
  }
  return cache[bytes] = 2.0 * double(bytes) / best;
}

/// Random fp16 keys [heads][N][128] on the device (HF layout), generated on the host once per shape.
const kc::DeviceBuffer& device_keys(std::int64_t heads, std::int64_t N, std::int64_t d) {
  static std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, kc::DeviceBuffer> cache;
  auto key = std::make_tuple(heads, N, d);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  std::vector<kvscore::half> h(std::size_t(heads * N * d));
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = kvscore::from_float<kvscore::half>(nd(rng));
  kc::DeviceBuffer b(h.size() * sizeof(kvscore::half));
  kc::copy_to_device(b.get(), h.data(), h.size() * sizeof(kvscore::half));
  return cache[key] = std::move(b);
}

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
  b->UseManualTime()->Unit(benchmark::kMicrosecond);
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
  std::vector<float> h(std::size_t(R * N));
  std::mt19937 rng(2);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : h) x = nd(rng);
  kc::DeviceBuffer s(h.size() * sizeof(float));
  kc::copy_to_device(s.get(), h.data(), h.size() * sizeof(float));
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

int main(int argc, char** argv) {
  if (kc::device_count() == 0) {
    std::printf("kvscore_cuda_bench: no CUDA device -- skipping every GPU benchmark\n");
    return 0;
  }
  std::printf("kvscore_cuda_bench: %s\n", kc::device_description().c_str());
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
