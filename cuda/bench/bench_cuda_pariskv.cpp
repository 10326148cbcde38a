// cuda/bench/bench_cuda_pariskv.cpp — a ParisKV decode step on the GPU against an exact dense
// scan of the same fp16 keys on the same GPU, in the same run (issue 8).
//
// BM_cuda_pariskv_search/N/kv_heads: one query per KV head, k = 100, default (β, ρ) for N.
//   time            one search (all heads, one launch per stage, ending in a sync)
//   exact_us        the exact step: ⟨k_t, q⟩ for every key (kvscore::cuda QFilter with the
//                   queries as filters, fp32 accumulation) + kvscore::cuda top-k, 100 per head
//   speedup_vs_exact = exact time / search time (both from CUDA events, same iterations)
//   recall_at_100   |search ∩ exact| / 100, mean over heads and queries
//   bytes_per_second  the index bytes a search must touch: B id bytes + 2·(2-byte score) per key
//                   and row, codes + weights of the C candidates (random gathers)
// Keys: a shared offset plus anisotropic channels plus a planted low-rank part that queries
// align with (keys of real models are like this; iid Gaussian keys have no top-100 to find),
// drawn on the device.
// BM_cuda_pariskv_append: encoding throughput of a prefill (bytes of fp16 keys read).
#include "bench_util.hpp"

#include <kvscore/cuda/pariskv.hpp>
#include <kvscore/cuda/scorers.hpp>
#include <kvscore/cuda/select.hpp>
#include <kvscore/core/splitmix.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <random>
#include <vector>

namespace {

struct Data {
  std::vector<float> queries;  // [H][d]
  kc::DeviceBuffer dkeys, dq;  // keys [H][N][d] fp16, drawn on the device
};

/// Structured keys and queries per (N, H), generated once: the per-head offsets, scales and planted
/// basis on the host (splitmix64, small), the N·H·d key elements on the device (bench_fill.hpp).
const Data& data(std::int64_t N, std::int64_t H, std::int64_t d) {
  static std::map<std::pair<std::int64_t, std::int64_t>, Data> cache;
  auto key = std::make_pair(N, H);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  Data& D = cache[key];
  kvscore::detail::SplitMix64 rng(0x5eedull + std::uint64_t(N) * 31 + std::uint64_t(H));
  auto unif = [&]() { return float(rng.next() >> 40) * 0x1.0p-24f; };
  auto gauss = [&]() { return (unif() + unif() + unif() + unif() - 2.f) * 1.7320508f; };  // about N(0, 1)
  constexpr int kRank = 8;
  std::vector<float> off(std::size_t(H * d)), scale(std::size_t(H * d)), basis(std::size_t(H * kRank * d));
  for (auto& x : off) x = 1.5f * gauss();
  for (auto& x : scale) x = 0.2f + 0.5f * std::fabs(gauss());
  for (auto& x : basis) x = gauss();
  D.queries.resize(std::size_t(H * d));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t j = 0; j < d; ++j) {  // a query in the planted subspace, plus noise
      float v = 0.3f * gauss();
      for (int r = 0; r < kRank; ++r) v += basis[std::size_t((h * kRank + r) * d + j)] * (r % 2 == 0 ? 1.f : -0.5f);
      D.queries[std::size_t(h * d + j)] = v;
    }
  auto upload = [](const std::vector<float>& v) {
    kc::DeviceBuffer b(v.size() * sizeof(float));
    kc::copy_to_device(b.get(), v.data(), v.size() * sizeof(float));
    return b;
  };
  const kc::DeviceBuffer doff = upload(off), dscale = upload(scale), dbasis = upload(basis);
  D.dkeys = kc::DeviceBuffer(std::size_t(H * N * d) * sizeof(kvscore::half));
  kvbench::fill_structured_f16(D.dkeys.get(), H, N, d, doff.as<float>(), dscale.as<float>(), dbasis.as<float>(), kRank,
                               0x5eedull + std::uint64_t(N));
  D.dq = upload(D.queries);
  return D;
}

void BM_cuda_pariskv_search(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1), d = 128, k = 100;
  const Data& D = data(N, H, d);
  const kc::DeviceKeysView<kvscore::half> keys(D.dkeys.as<kvscore::half>(), H, N, d, N * d, d);
  kc::ParisKV index(H, d);
  index.append(keys);
  kvscore::ParisKVSearch opt;
  opt.k = k;
  kc::DeviceBuffer ws(index.search_workspace_bytes(H, 1, opt));
  kc::DeviceBuffer pos(std::size_t(H * k) * sizeof(std::int64_t)), sc(std::size_t(H * k) * sizeof(float));
  auto search = [&] {
    index.search(D.dq.as<float>(), H, 1, opt, pos.as<std::int64_t>(), sc.as<float>(), {ws.get(), ws.bytes()});
  };
  // the exact step on the same keys: all inner products, then the top 100 per head
  const kvscore::QFilter exact(D.queries, H, d);
  kc::DeviceBuffer escores(std::size_t(H * N) * sizeof(float));
  const kc::DeviceScoresView ev(escores.as<float>(), H, N);
  kc::DeviceBuffer ews(kc::score_workspace_bytes(exact, keys));
  kc::DeviceBuffer tws(kc::topk_workspace_bytes(ev, k));
  kc::DeviceBuffer epos(std::size_t(H * k) * sizeof(std::int64_t));
  auto exact_step = [&] {
    kc::score(exact, keys, ev, {ews.get(), ews.bytes()});
    kc::topk_into(ev, k, {tws.get(), tws.bytes()}, epos.as<std::int64_t>());
  };
  search();  // warm-up
  exact_step();
  double t_search = 0, t_exact = 0;
  for (auto _ : st) {
    const double ts = gpu_seconds(search);
    st.SetIterationTime(ts);
    t_search += ts;
    t_exact += gpu_seconds(exact_step);
  }
  std::vector<std::int64_t> got(std::size_t(H * k)), want(std::size_t(H * k));
  kc::copy_to_host(got.data(), pos.get(), got.size() * sizeof(std::int64_t));
  kc::copy_to_host(want.data(), epos.get(), want.size() * sizeof(std::int64_t));
  double hits = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const auto g0 = got.begin() + h * k, w0 = want.begin() + h * k;
    std::vector<std::int64_t> both;
    std::set_intersection(g0, g0 + k, w0, w0 + k, std::back_inserter(both));  // both ascending
    hits += double(both.size());
  }
  const std::int64_t C = index.candidates(opt);
  const double bytes = double(H) * (double(N) * double(index.subspaces() + 6) +
                                    double(C) * double(index.padded_dim() / 2 + 4 * index.subspaces() + 8));
  st.counters["speedup_vs_exact"] = t_exact / t_search;
  st.counters["exact_us"] = 1e6 * t_exact / double(st.iterations());
  st.counters["recall_at_100"] = hits / double(H * k);
  st.counters["candidates"] = double(C);
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.SetItemsProcessed(st.iterations() * H * N);
}
BENCHMARK(BM_cuda_pariskv_search)
    ->ArgNames({"N", "kv_heads"})
    ->Args({std::int64_t(1) << 17, 8})
    ->Args({std::int64_t(1) << 20, 8})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

void BM_cuda_pariskv_append(benchmark::State& st) {
  const std::int64_t N = st.range(0), H = st.range(1), d = 128;
  const Data& D = data(N, H, d);
  const kc::DeviceKeysView<kvscore::half> keys(D.dkeys.as<kvscore::half>(), H, N, d, N * d, d);
  for (auto _ : st) {
    kc::ParisKV index(H, d);
    index.reserve(N);
    st.SetIterationTime(gpu_seconds([&] { index.append(keys); }));
  }
  const double bytes = double(H * N * d) * 2.0;
  st.counters["bytes_per_second"] = benchmark::Counter(bytes, benchmark::Counter::kIsIterationInvariantRate);
  st.counters["bandwidth_fraction"] =
      benchmark::Counter(bytes / copy_bytes_per_second(std::size_t(bytes)), benchmark::Counter::kIsIterationInvariantRate);
  st.SetItemsProcessed(st.iterations() * H * N);
}
BENCHMARK(BM_cuda_pariskv_append)
    ->ArgNames({"N", "kv_heads"})
    ->Args({std::int64_t(1) << 17, 8})
    ->UseManualTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
