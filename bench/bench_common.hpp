// Shared pieces of the benchmark suite: synthetic keys, the read-bandwidth baseline
// measured in the same run, and the counters every case reports.
#pragma once

#include <benchmark/benchmark.h>

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

}  // namespace kvbench
