// Shared pieces of the benchmark suite: synthetic keys, the read-bandwidth baseline
// measured in the same run, the counters every case reports, and the scorer cases
// (score/<method>/..., registered by bench_<method>.cpp with register_score).
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <string>
#include <type_traits>
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

/// One scorer over one head of keys<T>(n, d), one thread. bytes_per_second counts key bytes
/// x Scorer::passes over the keys.
template <class Scorer, class T>
void BM_score(benchmark::State& state, Scorer scorer) {
  const std::int64_t n = state.range(0), d = state.range(1);
  const auto& k = keys<T>(n, d);
  scorer.num_threads = 1;
  const auto view = kvscore::KeysView<T>(k.data(), 1, n, d, n * d, d);
  kvscore::Scores out(1, n);
  for (auto _ : state) {
    scorer.score(view, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const std::size_t key_bytes = std::size_t(n * d) * sizeof(T);
  report_bandwidth(state, key_bytes * std::size_t(Scorer::passes), key_bytes);
}

/// Registers score/<S::name>/<dname>/d<d>/N<n> (d in {64, 128}, n in {4096, 65536, 2^20}) for
/// the scorer `make(d)` returns; S::name is the scorer's registry spelling (test_contract ties
/// it to kvscore/methods.hpp).
template <class T, class Make>
void register_score_dtype(const char* dname, const Make& make) {
  for (std::int64_t d : {64, 128}) {
    for (std::int64_t n : {std::int64_t(4096), std::int64_t(65536), std::int64_t(1) << 20}) {
      const auto scorer = make(d);
      using S = std::remove_cvref_t<decltype(scorer)>;
      const std::string name = std::string("score/") + S::name + "/" + dname + "/d" + std::to_string(d) + "/N" +
                               std::to_string(n);
      benchmark::RegisterBenchmark(name.c_str(), [scorer](benchmark::State& s) {
        BM_score<S, T>(s, scorer);
      })->Args({n, d})->Unit(benchmark::kMicrosecond);
    }
  }
}

/// The scorer cases of one method for fp32, fp16 and bf16 keys. Returns 0, for a namespace-scope
/// `const int registered = kvbench::register_score(...)` in each bench_<method>.cpp.
template <class Make>
int register_score(const Make& make) {
  register_score_dtype<float>("fp32", make);
  register_score_dtype<kvscore::half>("fp16", make);
  register_score_dtype<kvscore::bfloat16>("bf16", make);
  return 0;
}

}  // namespace kvbench
