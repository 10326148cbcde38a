// cuda/bench/bench_cuda_protokv.cpp — ProtoKV on the GPU (Google Benchmark, manual time from CUDA
// events around the whole call, its host step and synchronisation included).
//
// fp16 keys [8][N][128] (HF layout), default ProtoKV parameters (κ 5, p 32, r 2, 496 chunks),
// window 64 with GQA group 4. Counters: bytes_per_second (one read of the keys + the scores
// written), ratio_vs_snapkv = ProtoKV time / kvscore::cuda SnapKV time on the same keys, timed in
// the same run (best of 5 SnapKV calls).
//
//   kvscore_cuda_bench --benchmark_filter=protokv
#include <benchmark/benchmark.h>

#include "bench_util.hpp"

#include <kvscore/cuda/protokv.hpp>
#include <kvscore/cuda/scorers.hpp>

#include <algorithm>
#include <vector>

namespace {

void BM_cuda_protokv(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1), d = 128, G = 4, w = 64;
  const kc::DeviceBuffer& k = device_keys(H, N, d);
  const kc::DeviceKeysView<kvscore::half> keys(k.as<kvscore::half>(), H, N, d, N * d, d);
  kc::DeviceBuffer out(std::size_t(H * N) * sizeof(float));
  const kc::DeviceScoresView sv(out.as<float>(), H, N);
  std::vector<float> q(std::size_t(H * G * w * d), 0.05f);
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = float(int(i * 2654435761u % 17) - 8) * 0.01f;

  const kvscore::SnapKV snap(q.data(), H * G, w, d);
  kc::DeviceBuffer sws(kc::score_workspace_bytes(snap, keys));
  kc::score(snap, keys, sv, {sws.get(), sws.bytes()});  // warm-up
  double snap_s = 1e30;
  for (int i = 0; i < 5; ++i)
    snap_s = std::min(snap_s, gpu_seconds([&] { kc::score(snap, keys, sv, {sws.get(), sws.bytes()}); }));

  kvscore::ProtoKV proto(q.data(), H * G, w, d);
  proto.psi = kvscore::ProtoKV::Psi::sum;  // the GPU path has sum and mean (not the CPU's default attention)
  proto.num_threads = 1;
  kc::DeviceBuffer ws(kc::score_workspace_bytes(proto, keys));
  kc::score(proto, keys, sv, {ws.get(), ws.bytes()});  // warm-up
  double total = 0;
  for (auto _ : st) {
    const double s = gpu_seconds([&] { kc::score(proto, keys, sv, {ws.get(), ws.bytes()}); });
    st.SetIterationTime(s);
    total += s;
  }
  const double bytes = double(H * N * d) * 2.0 + double(H * N) * 4.0;
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["ratio_vs_snapkv"] = st.iterations() > 0 ? total / double(st.iterations()) / snap_s : 0.0;
  st.counters["workspace_MiB"] = double(ws.bytes()) / (1024.0 * 1024.0);
  st.SetItemsProcessed(st.iterations() * H * N);
}
BENCHMARK(BM_cuda_protokv)
    ->ArgNames({"N", "heads"})
    ->Args({4096, 8})
    ->Args({32768, 8})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
