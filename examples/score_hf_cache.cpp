// Score one layer of a Hugging Face-layout fp16 key cache [batch, kv_heads, seq, head_dim]
// in place with each scorer and keep the top half of tokens per head.
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include <kvscore/kvscore.hpp>

int main() {
  const std::int64_t batch = 1, kv_heads = 8, seq = 1000, head_dim = 128;
  std::vector<kvscore::half> cache(std::size_t(batch * kv_heads * seq * head_dim));
  std::mt19937 rng(1);
  std::normal_distribution<float> g(0.f, 1.f);
  for (auto& x : cache) x = kvscore::from_float<kvscore::half>(g(rng));
  // token 123 of every head is a radial outlier: 10x the typical key
  for (std::int64_t h = 0; h < kv_heads; ++h)
    for (std::int64_t j = 0; j < head_dim; ++j) {
      auto& x = cache[std::size_t((h * seq + 123) * head_dim + j)];
      x = kvscore::from_float<kvscore::half>(10.f * kvscore::to_float(x));
    }

  const auto keys = kvscore::KeysView<kvscore::half>::hf(cache.data(), 0, batch, kv_heads, seq, head_dim);
  const kvscore::Scores scores = kvscore::ManifoldL2{}.score(keys);  // fp32 [kv_heads][seq]

  // keep the top seq/2 per head, in position order (kvscore::select arrives with the selector)
  int ok = 0;
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(seq));
    std::iota(idx.begin(), idx.end(), 0);
    std::nth_element(idx.begin(), idx.begin() + seq / 2, idx.end(),
                     [&](auto a, auto b) { return scores(h, a) > scores(h, b); });
    idx.resize(std::size_t(seq / 2));
    std::sort(idx.begin(), idx.end());
    ok += std::binary_search(idx.begin(), idx.end(), std::int64_t(123));
  }
  std::printf("ISA %s: the outlier token was kept by %d of %lld heads\n", kvscore::simd::active_table().name, ok,
              static_cast<long long>(kv_heads));
  return ok == kv_heads ? 0 : 1;
}
