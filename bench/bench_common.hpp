// Shared pieces of the benchmark suite: synthetic keys, the read-bandwidth baseline
// measured in the same run, and the counters every case reports.
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <vector>

#include "kvscore/kvscore.hpp"

namespace kvbench {

/// CPU time of the calling thread (s): the benchmarks' interleaved ratios use it, so time spent
/// descheduled on a shared machine counts for neither side.
inline double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Deterministic synthetic keys [tokens][d] (one head): a shared mean direction plus
/// noise, a few large-norm tokens, like real post-RoPE keys. Cached per shape and type.
template <class T>
const std::vector<T>& keys(std::int64_t tokens, std::int64_t d);

/// Bytes per second of the best-of-several `reduce_f32` sweeps over a fresh buffer of
/// `bytes` bytes with the active kernel table; measured once per size, in this process.
double baseline_bytes_per_second(std::size_t bytes);

/// Sets bytes_per_second and bandwidth_fraction (= bytes_per_second / baseline) on `state`.
void report_bandwidth(benchmark::State& state, std::size_t bytes_per_iteration, std::size_t footprint_bytes);

/// Exact attention of q over the first n rows of fp16 [n][d] keys and values with the active
/// kernel table: SIMD logits over every key, softmax with its exp, the value sum over fp16 rows
/// converted in blocks. key_seconds / kv_seconds accumulate thread CPU time of the key pass
/// and of scan(), the read lower bound.
struct FullAttention {
  std::vector<float> logits, e, block, out, scratch;
  double key_seconds = 0, kv_seconds = 0;
  /// The read lower bound: one SIMD dot pass over the keys and one over the values.
  void scan(const kvscore::half* keys, const kvscore::half* values, std::int64_t n, std::int64_t d, const float* q) {
    const auto& dot = kvscore::simd::active_table().ops<kvscore::half>().dot;
    scratch.resize(std::size_t(n));
    const double t0 = thread_seconds();
    dot(keys, n, d, d, q, scratch.data());
    dot(values, n, d, d, q, scratch.data());
    kv_seconds += thread_seconds() - t0;
    benchmark::DoNotOptimize(scratch.data());
  }
  void run(const kvscore::half* keys, const kvscore::half* values, std::int64_t n, std::int64_t d, const float* q) {
    const auto& tb = kvscore::simd::active_table();
    logits.resize(std::size_t(n));
    e.resize(std::size_t(n));
    const double t0 = thread_seconds();
    tb.ops<kvscore::half>().dot(keys, n, d, d, q, logits.data());
    key_seconds += thread_seconds() - t0;
    const float scale = 1.f / std::sqrt(float(d));
    float mx = -INFINITY;
    for (auto& x : logits) mx = std::max(mx, x *= scale);
    tb.exp_shifted(logits.data(), mx, n, e.data());
    out.assign(std::size_t(d), 0.f);
    double z = 0;
    constexpr std::int64_t kBlock = 64;
    block.resize(std::size_t(kBlock * d));
    for (std::int64_t b = 0; b < n; b += kBlock) {
      const std::int64_t m = std::min(kBlock, n - b);
      kvscore::convert(values + b * d, block.data(), std::size_t(m * d));
      for (std::int64_t i = 0; i < m; ++i) {
        const float p = e[std::size_t(b + i)];
        z += p;
        const float* v = block.data() + i * d;
        for (std::int64_t j = 0; j < d; ++j) out[std::size_t(j)] += p * v[j];
      }
    }
    for (auto& x : out) x = float(x / z);
  }
};


}  // namespace kvbench
