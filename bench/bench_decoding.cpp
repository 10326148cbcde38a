// DecodingCompressor (include/kvscore/decoding.hpp): a generating cache kept at `target` tokens
// by K-norm, one KV head, d = 128, fp16, interval 512 (kvpress's compression_interval), one
// thread. One decode step = append one token; every 512th step also scores, selects and compacts
// the target + 512 held rows.
//
//   decoding/knorm/N<target>   counters:
//     speedup_vs_full        one exact attention step over the held cache (kvbench::FullAttention:
//                            SIMD logits, softmax, value sum over the target..target+512 fp16 rows)
//                            / the compressor's cost per decode step (its overhead on top of the
//                            attention the engine runs anyway)
//     compress_vs_full       one compression (score + select + compact of target + 512 rows) / the
//                            same exact attention step
//     bytes_per_token        memory_bytes() / tokens held after a compression (K, V at capacity,
//                            positions); full_bytes_per_token 2·d·2 for the rows alone
// Times are thread CPU time; an attention step is timed every 64 decode steps, interleaved.
#include <cstdint>
#include <string>
#include <vector>

#include <kvscore/decoding.hpp>

#include "bench_common.hpp"

namespace {

using kvbench::thread_seconds;
constexpr std::int64_t kDim = 128, kInterval = 512;

void BM_knorm(benchmark::State& state, std::int64_t target) {
  const std::int64_t total = target + 16 * kInterval;  // the prefill, then 15 intervals of decode
  const std::vector<float>& f = kvbench::keys<float>(total, kDim);
  std::vector<kvscore::half> k(f.size()), v(f.size());
  kvscore::convert(f.data(), k.data(), f.size());
  for (std::size_t i = 0; i < f.size(); ++i) v[i] = kvscore::from_float<kvscore::half>(f[(i + 7 * kDim) % f.size()]);
  const std::vector<float> q(f.begin() + (total / 2) * kDim, f.begin() + (total / 2 + 1) * kDim);
  kvbench::FullAttention full;
  double t_full = 0, t_ours = 0, t_compress = 0;
  std::int64_t steps = 0, compressions = 0, held = 0, samples = 0;
  std::size_t bytes = 0;
  for (auto _ : state) {
    kvscore::DecodingCompressor<kvscore::half, kvscore::KNorm> dc(1, kDim, kvscore::KNorm{},
                                                                   {.target = target, .interval = kInterval});
    dc.append(k.data(), v.data(), target + kInterval - 1);  // one below the first compression
    for (std::int64_t t = target + kInterval - 1; t < total; ++t) {
      if (t % 64 == 0) {  // a sample of attention steps, interleaved with the decode steps
        const double a = thread_seconds();
        full.run(dc.key_view().data(), dc.value_view().data(), dc.length(), kDim, q.data());
        t_full += thread_seconds() - a;
        ++samples;
      }
      const double b = thread_seconds();
      const std::int64_t before = dc.compressions();
      dc.append(k.data() + t * kDim, v.data() + t * kDim, 1);
      const double c = thread_seconds();
      t_ours += c - b;
      if (dc.compressions() > before) {
        t_compress += c - b;
        ++compressions;
      }
      ++steps;
    }
    held = dc.length();
    bytes = dc.memory_bytes();
    benchmark::DoNotOptimize(full.out.data());
  }
  const double per_full = t_full / double(samples);
  state.SetItemsProcessed(steps);
  state.counters["speedup_vs_full"] = benchmark::Counter(per_full / (t_ours / double(steps)));
  state.counters["compress_vs_full"] = benchmark::Counter(t_compress / double(compressions) / per_full);
  state.counters["bytes_per_token"] = benchmark::Counter(double(bytes) / double(held));
  state.counters["full_bytes_per_token"] = benchmark::Counter(double(2 * kDim * 2));
}

const int registered = [] {
  for (std::int64_t n : {32768, 131072, 1048576})
    benchmark::RegisterBenchmark(("decoding/knorm/N" + std::to_string(n)).c_str(),
                                 [n](benchmark::State& s) { BM_knorm(s, n); })
        ->Iterations(1)
        ->Unit(benchmark::kMillisecond);
  return 0;
}();

}  // namespace
