// OjaKV (include/kvscore/ojakv.hpp): the prefill update and the decode update of one head,
// against exact recomputation measured in the same process (thread CPU time):
//
//   ojakv/prefill/N<n>/d<d>/r<r>/p<pool>  counters: speedup_vs_svd (BDCSVD of the same N x d
//       keys, thin V), speedup_vs_eig (eigen-decomposition of the unpooled covariance, the
//       cheapest exact route), rer_excess (RER of the Oja basis minus the SVD optimum, on the
//       same keys), steps (Oja steps taken), bytes_per_second / bandwidth_fraction
//   ojakv/decode/T<T>/d<d>/r<r>            one iteration = T pushes (one update); counters:
//       speedup_vs_svd_recompute (an exact SVD of the N = 32768-token history every T tokens,
//       per token, over ours per token), tokens_per_second
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <kvscore/ojakv.hpp>

#include "bench_common.hpp"

namespace {

using kvbench::thread_seconds;

Eigen::MatrixXd as_matrix(const std::vector<float>& k, std::int64_t n, std::int64_t d) {
  return Eigen::Map<const kvscore::oja::RowMajorF>(k.data(), n, d).cast<double>();
}

/// Thread CPU seconds of f() (one warm call excluded when `warm`), mean over >= 2 calls and >= 0.3 s.
template <class F>
double seconds_per_call(F&& f) {
  const double t0 = thread_seconds();
  int reps = 0;
  do f();
  while (++reps < 2 || thread_seconds() - t0 < 0.3);
  return (thread_seconds() - t0) / reps;
}

struct Exact {
  double svd_s = 0, eig_s = 0, best_rer = 0;
};

const Exact& exact(std::int64_t n, std::int64_t d, std::int64_t r) {
  static std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t>, Exact> cache;
  const auto key = std::make_tuple(n, d, r);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const Eigen::MatrixXd x = as_matrix(kvbench::keys<float>(n, d), n, d);
  Exact e;
  Eigen::MatrixXd v;
  e.svd_s = seconds_per_call([&] {
    // The baseline reads the fp32 keys too: widening is part of its cost, as in ours.
    const Eigen::MatrixXd xx = as_matrix(kvbench::keys<float>(n, d), n, d);
    const Eigen::BDCSVD<Eigen::MatrixXd> svd(xx, Eigen::ComputeThinV);
    v = svd.matrixV().leftCols(r);
    benchmark::DoNotOptimize(v.data());
  });
  e.eig_s = seconds_per_call([&] {
    const Eigen::MatrixXd xx = as_matrix(kvbench::keys<float>(n, d), n, d);
    Eigen::MatrixXd c = Eigen::MatrixXd::Zero(d, d);
    c.selfadjointView<Eigen::Lower>().rankUpdate(xx.transpose());
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> es(Eigen::MatrixXd(c.selfadjointView<Eigen::Lower>()));
    Eigen::MatrixXd u = es.eigenvectors().rightCols(r);
    benchmark::DoNotOptimize(u.data());
  });
  e.best_rer = kvscore::residual_energy_ratio(x, v);
  return cache[key] = e;
}

void BM_prefill(benchmark::State& state) {
  const std::int64_t n = state.range(0), d = state.range(1), r = state.range(2), p = state.range(3);
  const std::vector<float>& k = kvbench::keys<float>(n, d);
  const kvscore::KeysView<float> view(k.data(), 1, n, d, n * d, d);
  kvscore::OjaOptions opt;
  opt.pool = p;
  const kvscore::OjaBasis start = kvscore::OjaBasis::random(d, r, 1, opt);
  const Exact& ex = exact(n, d, r);  // measured before the timed loop
  kvscore::OjaBasis b = start;
  const double t0 = thread_seconds();
  for (auto _ : state) {
    b = start;
    b.prefill(view, 0);
    benchmark::DoNotOptimize(b.basis().data());
  }
  const double cpu = thread_seconds() - t0, iters = double(state.iterations());
  const std::size_t bytes = std::size_t(n * d) * sizeof(float);
  kvbench::report_bandwidth(state, bytes, bytes);
  state.counters["speedup_vs_svd"] = benchmark::Counter(ex.svd_s * iters / cpu);
  state.counters["speedup_vs_eig"] = benchmark::Counter(ex.eig_s * iters / cpu);
  state.counters["rer_excess"] = benchmark::Counter(kvscore::residual_energy_ratio(as_matrix(k, n, d), b.basis()) - ex.best_rer);
  state.counters["steps"] = benchmark::Counter(b.last_steps());
}

void BM_decode(benchmark::State& state) {
  const std::int64_t T = state.range(0), d = state.range(1), r = state.range(2);
  constexpr std::int64_t kHistory = 32768;
  const std::vector<float>& k = kvbench::keys<float>(kHistory, d);
  kvscore::OjaOptions opt;
  opt.period = T;
  kvscore::OjaBasis b = kvscore::OjaBasis::random(d, r, 2, opt);
  const Exact& ex = exact(kHistory, d, r);
  std::int64_t row = 0;
  const double t0 = thread_seconds();
  for (auto _ : state) {
    for (std::int64_t i = 0; i < T; ++i) {
      b.push(k.data() + row * d);
      row = (row + 1) % kHistory;
    }
    benchmark::DoNotOptimize(b.basis().data());
  }
  const double cpu = thread_seconds() - t0, iters = double(state.iterations());
  const double ours_per_token = cpu / (iters * double(T));
  state.SetItemsProcessed(std::int64_t(iters) * T);
  state.counters["tokens_per_second"] = benchmark::Counter(double(T) * iters, benchmark::Counter::kIsRate);
  state.counters["speedup_vs_svd_recompute"] = benchmark::Counter(ex.svd_s / double(T) / ours_per_token);
}

const int registered = [] {
  for (std::int64_t p : {1, 4}) {
    const std::string name = "ojakv/prefill/N32768/d128/r64/p" + std::to_string(p);
    benchmark::RegisterBenchmark(name.c_str(), BM_prefill)->Args({32768, 128, 64, p})->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("ojakv/decode/T128/d128/r64", BM_decode)->Args({128, 128, 64})->Unit(benchmark::kMicrosecond);
  return 0;
}();

}  // namespace
