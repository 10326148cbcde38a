// ProtoKV scoring against SnapKV scoring on the same keys and window queries (one head,
// one thread, d = 128, window 64), both timed as thread CPU time per call in the same
// process, so other processes on a shared machine do not skew the ratio.
//
//   protokv/<dtype>/d128/w64/N<tokens>           counters: ratio_vs_snapkv (ProtoKV time /
//                                                SnapKV time; < 1 = faster), tokens_per_second,
//                                                bytes_per_second, bandwidth_fraction
//   protokv-P20/<dtype>/d128/w64/N<tokens>       the same with 16 PDT chunks instead of 496:
//                                                the nearest-prototype GEMM nearly vanishes, so
//                                                the difference to the row above is its cost
#include <ctime>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.hpp"
#include "kvscore/scorers/protokv.hpp"
#include "kvscore/scorers/snapkv.hpp"

namespace {

constexpr std::int64_t kD = 128, kW = 64;

double pk_thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

const std::vector<float>& pk_queries() {
  static const std::vector<float> q = [] {
    std::mt19937_64 g(4242);
    std::normal_distribution<float> nd(0.f, 0.3f);
    std::vector<float> v(std::size_t(kW * kD));
    for (float& x : v) x = nd(g);
    return v;
  }();
  return q;
}

/// Thread CPU seconds per SnapKV call on these keys: mean over >= 3 calls and >= 0.3 s,
/// measured once per case in this process.
template <class T>
double snapkv_seconds(const kvscore::KeysView<T>& view) {
  static std::map<std::int64_t, double> cache;
  if (auto it = cache.find(view.tokens()); it != cache.end()) return it->second;
  kvscore::SnapKV snap(pk_queries().data(), 1, kW, kD);
  snap.num_threads = 1;
  kvscore::Scores out(1, view.tokens());
  snap.score(view, out.view());  // warm-up
  const double t0 = pk_thread_seconds();
  int reps = 0;
  do {
    snap.score(view, out.view());
    benchmark::DoNotOptimize(out.data());
  } while (++reps < 3 || pk_thread_seconds() - t0 < 0.3);
  return cache[view.tokens()] = (pk_thread_seconds() - t0) / reps;
}

template <class T>
void BM_protokv(benchmark::State& state, std::int64_t chunks) {
  const std::int64_t n = state.range(0);
  const auto& k = kvbench::keys<T>(n, kD);
  const kvscore::KeysView<T> view(k.data(), 1, n, kD, n * kD, kD);
  kvscore::ProtoKV pk(pk_queries().data(), 1, kW, kD);
  pk.num_threads = 1;
  pk.chunks = chunks;
  kvscore::Scores out(1, n);
  pk.score(view, out.view());  // warm-up
  const double snap = snapkv_seconds(view);
  const double t0 = pk_thread_seconds();
  for (auto _ : state) {
    pk.score(view, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double iters = double(state.iterations());
  const double cpu = (pk_thread_seconds() - t0) / iters;
  state.counters["ratio_vs_snapkv"] = benchmark::Counter(cpu / snap);
  state.counters["snapkv_us"] = benchmark::Counter(snap * 1e6);
  state.counters["tokens_per_second"] = benchmark::Counter(double(n) * iters, benchmark::Counter::kIsRate);
  const std::size_t key_bytes = std::size_t(n * kD) * sizeof(T);
  kvbench::report_bandwidth(state, key_bytes * std::size_t(kvscore::ProtoKV::passes), key_bytes);
}

template <class T>
void pk_register(const char* dname) {
  for (std::int64_t n : {std::int64_t(4096), std::int64_t(32768)}) {
    for (std::int64_t chunks : {kvscore::ProtoKV::kDefaultChunks, std::int64_t(16)}) {
      const std::string name = std::string(chunks == 16 ? "protokv-P20/" : "protokv/") + dname + "/d128/w64/N" +
                               std::to_string(n);
      benchmark::RegisterBenchmark(name.c_str(), [chunks](benchmark::State& s) { BM_protokv<T>(s, chunks); })
          ->Arg(n)
          ->Unit(benchmark::kMillisecond);
    }
  }
}

const int pk_registered = [] {
  pk_register<kvscore::half>("fp16");
  pk_register<float>("fp32");
  return 0;
}();

}  // namespace
