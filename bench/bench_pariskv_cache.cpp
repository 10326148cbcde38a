// ParisKV's decode-time cache (include/kvscore/pariskv/cache.hpp): one decode step = append one
// token (key, value) + attend one query, one KV head, d = 128, fp16 K/V, the default zones
// (4 sinks, local 256, updates every 128 tokens, top-100 retrieved with an exact rerank of 300:
// the keys are resident), one thread.
//
//   pariskv-cache/decode/N<tokens>   counters:
//     speedup_vs_full      full attention over the same fp16 cache in the same run (exact logits
//                          with the active table's SIMD dot over every key, softmax with its exp,
//                          the value sum over fp16 rows converted in blocks) / one decode step
//     speedup_vs_kv_scan   against reading every key and every value once with the SIMD dot
//                          kernel (two passes over fp16 rows): a lower bound on the time of
//                          any exact attention, which must read both
//     speedup_vs_key_scan  against the key pass alone
//     recall_at_100        of the retrieved part, against the exact top-100 of the retrieval zone
//     bytes_per_token      cache memory (K, V, index) / tokens; index_bytes_per_token the index alone
// Times are thread CPU time of interleaved calls (scan, full, ParisKV, scan, ...), as in bench_pariskv.
//
// Data: keys near a 16-dim subspace whose mean drifts with position (a topic offset per 4096
// tokens plus a slow linear drift), a norm spread, noise; each query is the sum of 8 keys of
// the retrieval zone plus noise.
#include <algorithm>
#include <cmath>
#include <ctime>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "kvscore/pariskv/cache.hpp"

namespace {

using kvbench::thread_seconds;

constexpr std::int64_t kDim = 128, kQueries = 8, kTop = 100;

struct Setup {
  std::vector<kvscore::half> keys, values;  // [N + steps][d]
  std::vector<std::vector<float>> queries;
  std::unique_ptr<kvscore::ParisKVCache<kvscore::half>> cache;
  std::int64_t n = 0;
};

constexpr std::uint64_t kSeed = 0xCAC4E;

Setup& setup(std::int64_t n) {
  static std::map<std::int64_t, std::unique_ptr<Setup>> all;
  auto& slot = all[n];
  if (slot) return *slot;
  slot = std::make_unique<Setup>();
  Setup& S = *slot;
  S.n = n;
  const std::int64_t extra = 4096, total = n + extra, d = kDim, r = 16;  // room for the timed appends
  kvscore::pariskv::SplitMix64 rng(kSeed + std::uint64_t(n));
  auto u = [&] { return double(rng.next() >> 11) * 0x1.0p-53; };
  auto g = [&] { return std::sqrt(-2.0 * std::log(u() + 1e-300)) * std::cos(6.283185307179586 * u()); };
  std::vector<double> A(static_cast<std::size_t>(d * r)), mu(static_cast<std::size_t>(d)), drift(static_cast<std::size_t>(d)),
      topic(static_cast<std::size_t>(d));
  for (auto& x : A) x = g() / std::sqrt(double(r));
  for (auto& x : mu) x = 4.0 * g() / std::sqrt(double(d));
  for (auto& x : drift) x = 2.0 * g() / std::sqrt(double(d));
  std::vector<float> row(static_cast<std::size_t>(d));
  S.keys.resize(std::size_t(total * d));
  S.values.resize(std::size_t(total * d));
  for (std::int64_t i = 0; i < total; ++i) {
    if (i % 4096 == 0)
      for (auto& x : topic) x = 1.5 * g() / std::sqrt(double(d));
    double z[16];
    for (auto& v : z) v = g();
    const double sc = 1.0 + 0.5 * u(), pos = double(i) / double(total);
    for (std::int64_t j = 0; j < d; ++j) {
      double v = mu[std::size_t(j)] + pos * drift[std::size_t(j)] + topic[std::size_t(j)];
      for (std::int64_t l = 0; l < r; ++l) v += A[std::size_t(j * r + l)] * z[l];
      row[std::size_t(j)] = float((v + 0.3 * g()) * sc);
    }
    kvscore::convert(row.data(), S.keys.data() + i * d, std::size_t(d));
    for (auto& x : row) x = float(g());
    kvscore::convert(row.data(), S.values.data() + i * d, std::size_t(d));
  }
  kvscore::ParisKVCacheConfig cfg;
  cfg.search.rerank_exact = 3 * kTop;
  S.cache = std::make_unique<kvscore::ParisKVCache<kvscore::half>>(d, cfg);
  S.cache->reserve(total);
  S.cache->append(S.keys.data(), S.values.data(), n);
  const std::int64_t s0 = S.cache->retrieval_begin(), e0 = S.cache->local_begin();
  for (std::int64_t qi = 0; qi < kQueries; ++qi) {
    std::vector<float> q(static_cast<std::size_t>(d), 0.f);
    for (int p = 0; p < 8; ++p) {
      const std::int64_t t = s0 + std::int64_t(u() * double(e0 - s0));
      for (std::int64_t j = 0; j < d; ++j) q[std::size_t(j)] += kvscore::to_float(S.keys[std::size_t(t * d + j)]);
    }
    for (auto& x : q) x = x / 8.f + float(0.5 * g());
    S.queries.push_back(std::move(q));
  }
  return S;
}

void BM_decode(benchmark::State& state, std::int64_t n) {
  Setup& S = setup(n);
  auto& cache = *S.cache;
  kvscore::ParisKVCache<kvscore::half>::Workspace ws;
  std::vector<float> out(static_cast<std::size_t>(kDim));
  // quality on the prefilled cache: recall of the retrieved part
  double rec = 0;
  kvbench::FullAttention full;
  for (const auto& q : S.queries) {
    cache.attend(q.data(), out.data(), ws);
    const std::int64_t s0 = cache.retrieval_begin(), e0 = cache.local_begin();
    std::vector<std::pair<double, std::int64_t>> sc;
    for (std::int64_t t = s0; t < e0; ++t) {
      double v = 0;
      for (std::int64_t j = 0; j < kDim; ++j) v += double(kvscore::to_float(S.keys[std::size_t(t * kDim + j)])) * q[std::size_t(j)];
      sc.push_back({-v, t});
    }
    std::partial_sort(sc.begin(), sc.begin() + kTop, sc.end());
    std::set<std::int64_t> truth;
    for (std::int64_t i = 0; i < kTop; ++i) truth.insert(sc[std::size_t(i)].second);
    std::int64_t hit = 0;
    for (std::int64_t i = 0; i < kTop; ++i) hit += std::int64_t(truth.count(ws.positions[std::size_t(s0 + i)]));
    rec += double(hit) / double(kTop) / double(kQueries);
  }
  // the timed step: append the next token, attend; the cache grows by one token per step
  const std::int64_t limit = std::int64_t(S.keys.size()) / kDim;
  std::size_t qi = 0;
  for (auto _ : state) {
    const std::int64_t t = cache.size();
    if (t >= limit) {
      state.SkipWithError("out of prepared tokens");
      break;
    }
    cache.append(S.keys.data() + t * kDim, S.values.data() + t * kDim);
    cache.attend(S.queries[qi].data(), out.data(), ws);
    qi = (qi + 1) % S.queries.size();
    benchmark::DoNotOptimize(out.data());
  }
  // interleaved ratio (full, step, full, ...): both sides see the same machine load
  double t_full = 0, t_ours = 0;
  full.key_seconds = full.kv_seconds = 0;
  int reps = 0;
  for (int rep = 0; rep < (n > 500000 ? 1 : 3); ++rep)
    for (const auto& q : S.queries) {
      const std::int64_t t = cache.size();
      if (t >= limit) break;
      full.scan(S.keys.data(), S.values.data(), t, kDim, q.data());
      const double a = thread_seconds();
      full.run(S.keys.data(), S.values.data(), t, kDim, q.data());
      const double b = thread_seconds();
      cache.append(S.keys.data() + t * kDim, S.values.data() + t * kDim);
      cache.attend(q.data(), out.data(), ws);
      t_full += b - a;
      t_ours += thread_seconds() - b;
      ++reps;
    }
  state.counters["speedup_vs_full"] = benchmark::Counter(t_full / t_ours);
  state.counters["speedup_vs_kv_scan"] = benchmark::Counter(full.kv_seconds / t_ours);
  state.counters["speedup_vs_key_scan"] = benchmark::Counter(full.key_seconds / t_ours);
  state.counters["recall_at_100"] = benchmark::Counter(rec);
  state.counters["bytes_per_token"] = benchmark::Counter(double(cache.memory_bytes()) / double(cache.size()));
  state.counters["index_bytes_per_token"] =
      benchmark::Counter(double(cache.index().memory_bytes()) / double(std::max<std::int64_t>(1, cache.indexed())));
  (void)reps;
}

const int registered = [] {
  for (std::int64_t n : {std::int64_t(32768), std::int64_t(131072), std::int64_t(1048576)})
    benchmark::RegisterBenchmark(("pariskv-cache/decode/N" + std::to_string(n)).c_str(),
                                 [n](benchmark::State& s) { BM_decode(s, n); })
        ->Unit(benchmark::kMicrosecond)
        ->Iterations(n > 500000 ? 64 : 256);
  return 0;
}();

}  // namespace
