// Selector cases: kvscore::select_into on one head, one thread, caller workspace (no
// allocation in the timed loop), against std::nth_element on an index array followed by
// std::sort of the kept positions (same ranking rule, same result), timed on the same data
// in the same process (both as thread CPU time per call, so other processes on a shared
// machine do not skew the ratio).
//
//   select/<entropy>/N<tokens>/k<pct>          counters: speedup_vs_nth_element,
//                                              scores_per_second, bytes_per_second
//   select/baseline-nth_element/<entropy>/...  the baseline itself (scores_per_second)
//   select/kernels-<avx2|portable>/random/...  the same with a forced kernel set
//   select/adakv/H8/<entropy>/N<tokens>/k<pct> AdaKV over 8 heads, one thread
//
// Entropy axis: random (normal), few (16 distinct values), equal (all equal).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "bench_common.hpp"
#include "kvscore/select.hpp"

namespace {

enum class Entropy { random, few, equal };
const char* entropy_name(Entropy e) { return e == Entropy::random ? "random" : e == Entropy::few ? "few" : "equal"; }

/// Deterministic scores [heads][tokens], cached.
const std::vector<float>& scores(Entropy e, std::int64_t heads, std::int64_t n) {
  static std::map<std::tuple<int, std::int64_t, std::int64_t>, std::vector<float>> cache;
  auto& v = cache[{int(e), heads, n}];
  if (!v.empty()) return v;
  v.resize(std::size_t(heads * n));
  std::mt19937_64 rng(std::uint64_t(n * 7 + int(e) + heads * 1000003));
  std::normal_distribution<float> nd;
  for (auto& x : v) {
    switch (e) {
      case Entropy::random: x = nd(rng); break;
      case Entropy::few: x = float(rng() % 16) * 0.125f; break;
      case Entropy::equal: x = 0.5f; break;
    }
  }
  return v;
}

/// The baseline: nth_element on an index array, then sort of the kept positions.
void nth_element_select(const float* s, std::int64_t n, std::int64_t k, std::vector<std::int64_t>& idx) {
  idx.resize(std::size_t(n));
  std::iota(idx.begin(), idx.end(), std::int64_t(0));
  auto better = [s](std::int64_t a, std::int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
  if (k > 0 && k < n) std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), better);
  std::sort(idx.begin(), idx.begin() + k);
}

/// CPU time of this thread, in seconds (robust to other processes on a shared machine).
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// Thread CPU seconds per call of the baseline: the mean over >= 3 calls and >= 0.3 s,
/// measured once per case in this process (the same measure as the selector's counter).
double baseline_seconds(Entropy e, std::int64_t n, std::int64_t k) {
  static std::map<std::tuple<int, std::int64_t, std::int64_t>, double> cache;
  const auto key = std::make_tuple(int(e), n, k);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const std::vector<float>& s = scores(e, 1, n);
  std::vector<std::int64_t> idx;
  nth_element_select(s.data(), n, k, idx);  // warm-up
  const double t0 = thread_seconds();
  int reps = 0;
  do {
    nth_element_select(s.data(), n, k, idx);
    benchmark::DoNotOptimize(idx.data());
  } while (++reps < 3 || thread_seconds() - t0 < 0.3);
  return cache[key] = (thread_seconds() - t0) / reps;
}

void BM_select(benchmark::State& state, Entropy e, std::int64_t n, std::int64_t k,
               kvscore::SelectKernels kernels = kvscore::SelectKernels::best) {
  if (!kvscore::select_kernels_supported(kernels)) {
    state.SkipWithError("kernel set not supported on this CPU");
    return;
  }
  const std::vector<float>& s = scores(e, 1, n);
  kvscore::SelectOptions opt;
  opt.num_threads = 1;
  opt.kernels = kernels;
  const kvscore::Budget budget = kvscore::Budget::per_head(k);
  const std::size_t ws_bytes = kvscore::select_workspace_bytes(1, n, budget, opt);
  std::vector<unsigned char> ws(ws_bytes);
  std::vector<std::int64_t> offsets(2), positions(static_cast<std::size_t>(k));
  const kvscore::ConstScoresView view(s.data(), 1, n);
  // The result must be the baseline's (same ranking rule).
  kvscore::select_into(view, budget, opt, ws.data(), ws.size(), offsets.data(), positions.data(), positions.size());
  std::vector<std::int64_t> idx;
  nth_element_select(s.data(), n, k, idx);
  if (!std::equal(positions.begin(), positions.end(), idx.begin())) {
    state.SkipWithError("select_into and the nth_element baseline disagree");
    return;
  }
  const double baseline = baseline_seconds(e, n, k);  // measured before the timed loop
  const double t0 = thread_seconds();
  for (auto _ : state) {
    kvscore::select_into(view, budget, opt, ws.data(), ws.size(), offsets.data(), positions.data(), positions.size());
    benchmark::DoNotOptimize(positions.data());
    benchmark::ClobberMemory();
  }
  const double cpu = thread_seconds() - t0;
  const double iters = double(state.iterations());
  state.SetBytesProcessed(std::int64_t(double(n) * sizeof(float) * iters));
  state.counters["scores_per_second"] = benchmark::Counter(double(n) * iters, benchmark::Counter::kIsRate);
  // baseline CPU seconds per call / ours (a plain ratio, not a rate)
  state.counters["speedup_vs_nth_element"] = benchmark::Counter(baseline * iters / cpu);
}

void BM_baseline(benchmark::State& state, Entropy e, std::int64_t n, std::int64_t k) {
  const std::vector<float>& s = scores(e, 1, n);
  std::vector<std::int64_t> idx;
  for (auto _ : state) {
    nth_element_select(s.data(), n, k, idx);
    benchmark::DoNotOptimize(idx.data());
  }
  const double iters = double(state.iterations());
  state.SetBytesProcessed(std::int64_t(double(n) * sizeof(float) * iters));
  state.counters["scores_per_second"] = benchmark::Counter(double(n) * iters, benchmark::Counter::kIsRate);
}

void BM_adakv(benchmark::State& state, Entropy e, std::int64_t heads, std::int64_t n, std::int64_t k) {
  const std::vector<float>& s = scores(e, heads, n);
  kvscore::SelectOptions opt;
  opt.num_threads = 1;
  opt.alloc = kvscore::Alloc::adakv;
  opt.sinks = 4;
  opt.recent = 64;
  const kvscore::Budget budget = kvscore::Budget::per_head(k);
  std::vector<unsigned char> ws(kvscore::select_workspace_bytes(heads, n, budget, opt));
  std::vector<std::int64_t> offsets(std::size_t(heads + 1)), positions(std::size_t(k * heads));
  const kvscore::ConstScoresView view(s.data(), heads, n);
  for (auto _ : state) {
    kvscore::select_into(view, budget, opt, ws.data(), ws.size(), offsets.data(), positions.data(), positions.size());
    benchmark::DoNotOptimize(positions.data());
    benchmark::ClobberMemory();
  }
  const double iters = double(state.iterations());
  state.SetBytesProcessed(std::int64_t(double(heads * n) * sizeof(float) * iters));
  state.counters["scores_per_second"] = benchmark::Counter(double(heads * n) * iters, benchmark::Counter::kIsRate);
}

std::string case_name(const char* prefix, Entropy e, std::int64_t n, int pct) {
  return std::string(prefix) + entropy_name(e) + "/N" + std::to_string(n) + "/k" + std::to_string(pct) + "pct";
}

const int registered = [] {
  for (std::int64_t n : {std::int64_t(65536), std::int64_t(1) << 20}) {
    for (Entropy e : {Entropy::random, Entropy::few, Entropy::equal}) {
      for (int pct : {10, 50}) {
        const std::int64_t k = n * pct / 100;
        benchmark::RegisterBenchmark(case_name("select/", e, n, pct).c_str(),
                                     [=](benchmark::State& s) { BM_select(s, e, n, k); })
            ->Unit(benchmark::kMicrosecond);
        benchmark::RegisterBenchmark(case_name("select/baseline-nth_element/", e, n, pct).c_str(),
                                     [=](benchmark::State& s) { BM_baseline(s, e, n, k); })
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  // The other kernel sets on random scores (CPUs without AVX-512 use them).
  for (auto kernels : {kvscore::SelectKernels::avx2, kvscore::SelectKernels::portable}) {
    for (std::int64_t n : {std::int64_t(65536), std::int64_t(1) << 20}) {
      for (int pct : {10, 50}) {
        const std::int64_t k = n * pct / 100;
        const std::string prefix = std::string("select/kernels-") + kvscore::select_kernels_name(kernels) + "/";
        benchmark::RegisterBenchmark(case_name(prefix.c_str(), Entropy::random, n, pct).c_str(),
                                     [=](benchmark::State& s) { BM_select(s, Entropy::random, n, k, kernels); })
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
  for (Entropy e : {Entropy::random, Entropy::few}) {
    const std::int64_t heads = 8, n = 65536, k = n / 10;
    benchmark::RegisterBenchmark(case_name("select/adakv/H8/", e, n, 10).c_str(),
                                 [=](benchmark::State& s) { BM_adakv(s, e, heads, n, k); })
        ->Unit(benchmark::kMicrosecond);
  }
  return 0;
}();

}  // namespace
