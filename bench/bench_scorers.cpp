// One case per scorer x element type x head_dim x tokens (one head, one thread).
// bytes_per_second counts key bytes x passes over the keys.
#include <string>

#include "bench_common.hpp"

namespace {

template <class Scorer, class T>
void BM_score(benchmark::State& state, Scorer scorer) {
  const std::int64_t n = state.range(0), d = state.range(1);
  const auto& k = kvbench::keys<T>(n, d);
  scorer.num_threads = 1;
  const auto view = kvscore::KeysView<T>(k.data(), 1, n, d, n * d, d);
  kvscore::Scores out(1, n);
  for (auto _ : state) {
    scorer.score(view, out.view());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const std::size_t key_bytes = std::size_t(n * d) * sizeof(T);
  kvbench::report_bandwidth(state, key_bytes * std::size_t(Scorer::passes), key_bytes);
}

kvscore::QFilter make_qfilter(std::int64_t d) {
  std::vector<float> f(static_cast<std::size_t>(d));
  for (std::int64_t j = 0; j < d; ++j) f[std::size_t(j)] = (j % 3 == 0 ? 1.f : -0.5f) / float(d);
  return kvscore::QFilter(f, 1, d);
}

template <class T>
void register_dtype(const char* dname) {
  for (std::int64_t d : {64, 128}) {
    for (std::int64_t n : {std::int64_t(4096), std::int64_t(65536), std::int64_t(1) << 20}) {
      // named by the scorer's registry spelling (S::name; test_contract ties it to kvscore/methods.hpp)
      auto reg = [&](auto scorer) {
        const std::string name = std::string("score/") + decltype(scorer)::name + "/" + dname + "/d" + std::to_string(d) + "/N" +
                                 std::to_string(n);
        benchmark::RegisterBenchmark(name.c_str(), [scorer](benchmark::State& s) {
          BM_score<decltype(scorer), T>(s, scorer);
        })->Args({n, d})->Unit(benchmark::kMicrosecond);
      };
      reg(kvscore::KNorm{});
      reg(kvscore::KeyDiff{});
      reg(kvscore::ManifoldL2{});
      reg(kvscore::WindowedManifoldL2{4096});
      reg(make_qfilter(d));
    }
  }
}

const int registered = [] {
  register_dtype<float>("fp32");
  register_dtype<kvscore::half>("fp16");
  register_dtype<kvscore::bfloat16>("bf16");
  return 0;
}();

}  // namespace
