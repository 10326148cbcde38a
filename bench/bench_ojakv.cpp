// OjaKV (include/kvscore/ojakv/ojakv.hpp): the prefill update and the decode update of one head,
// against exact recomputation measured in the same process (thread CPU time):
//
//   ojakv/prefill/N<n>/d<d>/r<r>/p<pool>  counters: speedup_vs_svd (BDCSVD of the same N x d
//       keys, thin V), speedup_vs_eig (eigen-decomposition of the unpooled covariance, the
//       cheapest exact route), rer_excess (RER of the Oja basis minus the SVD optimum, on the
//       same keys), steps (Oja steps taken), bytes_per_second / bandwidth_fraction
//   ojakv/decode/T<T>/d<d>/r<r>            one iteration = T pushes (one update); counters:
//       speedup_vs_svd_recompute (an exact SVD of the N = 32768-token history every T tokens,
//       per token, over ours per token), tokens_per_second
//   ojakv/cache/N<n>                       generation with the hybrid store: one KV head,
//       d = 128, r_k = r_v = 32, T = 128, 10% of each block at full rank, a cache of n tokens
//       (the keys of kvbench::keys, values likewise). One iteration = T appends, i.e. one block
//       with its close (Oja update, rebase of every code, residual rule, encoding). Counters:
//       speedup_vs_full    one exact attention step over the same n fp32 rows (Eigen GEMV logits,
//                          softmax, value sum) / the time per appended token (append only: the
//                          store's attention is the reference path, next counter)
//       attention_vs_full  OjaHybridCache::attention (the fp64 reference path, which reconstructs
//                          every row) / the same exact step: > 1 means slower
//       bytes_per_token    memory(h, 2) / tokens (fp16 store), full_bytes_per_token 2·d·2
//   ojakv/project/<dtype>/N<n>/d<d>/r<r>   the kernel table's project (codes = K U, the store's
//       encoding) over n rows of the given type with the active table. Counters:
//       speedup_vs_eigen   an Eigen fp32 GEMM of the same product (the same rows, already widened to fp32,
//                          RowMajor n×d times d×r, compiled with this build's flags, one thread),
//                          measured in the same run / ours; max_abs_vs_eigen the largest difference
//       bytes_per_second / bandwidth_fraction   rows + basis + codes per call
#include <cmath>
#include <cstdint>
#include <ctime>
#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/select.hpp>

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

struct CacheSetup {
  std::vector<float> keys, values;  // [n + extra][d]
  std::unique_ptr<kvscore::OjaHybridCache> cache;
  std::vector<kvscore::OjaProjector> proj;
  std::int64_t n = 0, row = 0;
};

void BM_cache(benchmark::State& state, std::int64_t n) {
  const std::int64_t d = 128, r = 32, T = 128;
  static std::map<std::int64_t, std::unique_ptr<CacheSetup>> all;
  auto& slot = all[n];
  if (!slot) {
    slot = std::make_unique<CacheSetup>();
    CacheSetup& S = *slot;
    S.n = n;
    const std::int64_t total = n + 64 * T;  // room for the timed appends
    S.keys = kvbench::keys<float>(total, d);
    S.values = kvbench::keys<float>(total, d);
    std::rotate(S.values.begin(), S.values.begin() + 7 * d, S.values.end());  // not the keys themselves
    const kvscore::KeysView<float> kv(S.keys.data(), 1, n, d, total * d, d), vv(S.values.data(), 1, n, d, total * d, d);
    S.proj.push_back(kvscore::OjaProjector::random(d, r, r, 5));
    S.proj[0].prefill(kv, vv, 0);
    const kvscore::OjaResidual rule(S.keys.data() + (n - 32) * d, 1, 32, d, {S.proj[0].key().basis()});
    S.cache = std::make_unique<kvscore::OjaHybridCache>(kvscore::OjaHybridCache::build(
        S.proj, kv, vv, kvscore::select(rule.score(kv), kvscore::Budget::per_head(kvscore::budget_from_ratio(n, 0.1)))));
    S.row = n;
  }
  CacheSetup& S = *slot;
  const std::int64_t total = std::int64_t(S.keys.size()) / d;
  const float* q = S.keys.data() + (S.n / 2) * d;
  auto full_step = [&] {  // exact attention over the first n rows
    using Rows = Eigen::Map<const kvscore::oja::RowMajorF>;
    const Eigen::VectorXf z = Rows(S.keys.data(), S.n, d) * Eigen::Map<const Eigen::VectorXf>(q, d) / std::sqrt(float(d));
    const Eigen::VectorXf p = (z.array() - z.maxCoeff()).exp();
    const Eigen::VectorXf o = Rows(S.values.data(), S.n, d).transpose() * p / p.sum();
    benchmark::DoNotOptimize(o.data());
  };
  const double full_s = seconds_per_call(full_step);
  const double ref_s = seconds_per_call([&] { benchmark::DoNotOptimize(S.cache->attention(0, q).data()); });
  double cpu = 0;
  std::int64_t appended = 0;
  for (auto _ : state) {
    if (S.row + T > total) {
      state.SkipWithError("ojakv/cache: out of prepared rows");
      break;
    }
    const double t0 = thread_seconds();
    for (std::int64_t i = 0; i < T; ++i, ++S.row) {
      const float* k = S.keys.data() + S.row * d;
      S.cache->append(S.proj, k, S.values.data() + S.row * d, k, 1);
    }
    cpu += thread_seconds() - t0;
    appended += T;
  }
  if (appended == 0) return;
  const double per_token = cpu / double(appended);
  const kvscore::OjaMemory m = S.cache->memory(0, 2);
  state.SetItemsProcessed(appended);
  state.counters["speedup_vs_full"] = benchmark::Counter(full_s / per_token);
  state.counters["attention_vs_full"] = benchmark::Counter(ref_s / full_s);
  state.counters["us_per_token"] = benchmark::Counter(per_token * 1e6);
  state.counters["bytes_per_token"] = benchmark::Counter(double(m.hybrid_bytes) / double(S.cache->tokens()));
  state.counters["full_bytes_per_token"] = benchmark::Counter(double(2 * d * 2));
}

template <class T>
void BM_project(benchmark::State& state) {
  const std::int64_t n = state.range(0), d = state.range(1), r = state.range(2);
  const std::vector<T>& rows = kvbench::keys<T>(n, d);
  std::vector<float> rows32(rows.size());  // the same values, widened: Eigen's input (not timed)
  for (std::size_t i = 0; i < rows.size(); ++i) rows32[i] = kvscore::to_float(rows[i]);
  const Eigen::MatrixXf u = kvscore::OjaBasis::random(d, r, 9).basis_f32();  // d x r column-major = r rows of d
  const auto& project = kvscore::simd::active_table().ops<T>().project;
  std::vector<float> codes(std::size_t(n * r));
  kvscore::oja::RowMajorF eig(n, r);
  const Eigen::Map<const kvscore::oja::RowMajorF> x(rows32.data(), n, d);
  const int eigen_threads = Eigen::nbThreads();
  Eigen::setNbThreads(1);  // one thread, as the kernel (thread CPU time would miss Eigen's OpenMP workers)
  const double eigen_s = seconds_per_call([&] {
    eig.noalias() = x * u;
    benchmark::DoNotOptimize(eig.data());
  });
  Eigen::setNbThreads(eigen_threads);
  const double t0 = thread_seconds();
  for (auto _ : state) {
    project(rows.data(), n, d, d, u.data(), r, codes.data());
    benchmark::DoNotOptimize(codes.data());
  }
  const double per_call = (thread_seconds() - t0) / double(state.iterations());
  const std::size_t bytes = std::size_t(n * d) * sizeof(T) + std::size_t((d + n) * r) * sizeof(float);
  kvbench::report_bandwidth(state, bytes, bytes);
  state.counters["speedup_vs_eigen"] = benchmark::Counter(eigen_s / per_call);
  state.counters["max_abs_vs_eigen"] =
      benchmark::Counter(double((Eigen::Map<const kvscore::oja::RowMajorF>(codes.data(), n, r) - eig).cwiseAbs().maxCoeff()));
}

const int registered = [] {
  benchmark::RegisterBenchmark("ojakv/project/f32/N65536/d128/r32", BM_project<float>)
      ->Args({65536, 128, 32})
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("ojakv/project/f16/N65536/d128/r32", BM_project<kvscore::half>)
      ->Args({65536, 128, 32})
      ->Unit(benchmark::kMillisecond);
  for (std::int64_t p : {1, 4}) {
    const std::string name = "ojakv/prefill/N32768/d128/r64/p" + std::to_string(p);
    benchmark::RegisterBenchmark(name.c_str(), BM_prefill)->Args({32768, 128, 64, p})->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("ojakv/decode/T128/d128/r64", BM_decode)->Args({128, 128, 64})->Unit(benchmark::kMicrosecond);
  for (std::int64_t n : {32768, 131072, 1048576})
    benchmark::RegisterBenchmark(("ojakv/cache/N" + std::to_string(n)).c_str(),
                                 [n](benchmark::State& s) { BM_cache(s, n); })
        ->Iterations(16)
        ->Unit(benchmark::kMillisecond);
  return 0;
}();

}  // namespace
