// The one-off driver behind results/vllm.md#the-avx512vnni-table-and-the-passs-bytes: detail::int4_scores
// over SmolLM2-shaped summaries (args: layers rows iterations; defaults 30 8 7), best of the iterations.
// g++ -std=c++20 -O3 -DNDEBUG -DKVSCORE_COMPILED=1 -DKVSCORE_RUNTIME_DISPATCH=1 -Iinclude -I/usr/include/eigen3 \
//   THIS.cpp build/libkvscore_dispatch.a -fopenmp -o int4mb && KVSCORE_ISA=avx512vnni ./int4mb
#include <chrono>
#include <cstdio>
#include <random>
#include <cstdlib>
#include "kvscore/block_sparse/score_int4.hpp"
using namespace kvscore;
int main(int argc, char** argv) {
  const std::int64_t L = argc > 1 ? atoi(argv[1]) : 30, R = argc > 2 ? atoi(argv[2]) : 8, NB = 240, KH = 3, QH = 9, D = 64, BS = 32;
  const std::int64_t F = 3 * D, CB = detail::int4_code_bytes(D, BS);
  std::mt19937 g(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<std::vector<float>> sums(L, std::vector<float>(R * NB * KH * F));
  std::vector<std::vector<std::uint8_t>> codes(L, std::vector<std::uint8_t>(R * NB * KH * CB));
  for (auto& s : sums) for (auto& x : s) x = u(g);
  for (auto& s : codes) for (auto& x : s) x = std::uint8_t(g());
  std::vector<float> q(QH * D);
  for (auto& x : q) x = u(g);
  detail::BlockChoiceScratch w;
  w.cand.resize(NB - 4);
  for (std::int64_t c = 0; c < NB - 4; ++c) w.cand[c] = c + 2;
  double best = 1e9; float chk = 0;
  for (int it = 0; it < (argc > 3 ? atoi(argv[3]) : 7); ++it) {
    auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t r = 0; r < R; ++r) {
        const float* S = sums[l].data(); const std::uint8_t* C = codes[l].data();
        detail::int4_scores(q.data(), QH, KH, D, BS, 0, [&](std::int64_t c, std::int64_t h) {
          const std::int64_t p = r * NB + w.cand[c];
          const float* a = S + (p * KH + h) * F;
          return std::tuple<const float*, const float*, const float*, const std::uint8_t*>{a, a + 2 * D, a + D, C + (p * KH + h) * CB};
        }, w, 1);
        chk += w.score[5];
      }
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (ms < best) best = ms;
  }
  std::printf("%s: %.4f ms per step (best of 7), chk %g\n", simd::active_table().name, best, chk);
}
