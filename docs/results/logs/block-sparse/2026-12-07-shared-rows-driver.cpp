// Needs 2026-12-07-shared-rows.patch applied (Int4Row, int4_scores_rows, Int4Scorer::score_rows); built as the planner driver.
// int4 block scoring of R rows that share a prefix: each row alone (Int4Scorer::score per row, the
// selector before score_rows) against all rows at once (score_rows), Llama-3.2-3B-shaped summaries
// (28 layers, 8 KV heads, 24 query heads, head_dim 128, 32-token blocks), best of the iterations.
// args: rows shared_blocks own_blocks iterations threads
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include "kvscore/block_sparse/score_int4.hpp"
using namespace kvscore;
int main(int argc, char** argv) {
  const std::int64_t R = argc > 1 ? atoi(argv[1]) : 4, SH = argc > 2 ? atoi(argv[2]) : 384, OWN = argc > 3 ? atoi(argv[3]) : 128;
  const int iters = argc > 4 ? atoi(argv[4]) : 5, T = argc > 5 ? atoi(argv[5]) : 2;
  const std::int64_t L = 28, KH = 8, QH = 24, D = 128, BS = 32, NB = SH + R * OWN;
  BlockSparseOptions o;
  detail::Int4Scorer sc(o, L, D, BS);
  const std::int64_t F = sc.summary_floats(), CB = sc.code_bytes();
  std::mt19937 g(1);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<std::vector<float>> sums(L, std::vector<float>(NB * KH * F));
  std::vector<std::vector<std::uint8_t>> codes(L, std::vector<std::uint8_t>(NB * KH * CB));
  for (auto& s : sums) for (auto& x : s) x = u(g);
  for (auto& s : codes) for (auto& x : s) x = std::uint8_t(g());
  // each row: the shared blocks, then its own; shuffled physical ids
  std::vector<std::int64_t> perm(NB);
  for (std::int64_t i = 0; i < NB; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), g);
  std::vector<std::vector<std::int64_t>> ids(R);
  for (std::int64_t r = 0; r < R; ++r) {
    for (std::int64_t b = 0; b < SH; ++b) ids[r].push_back(perm[b]);
    for (std::int64_t b = 0; b < OWN; ++b) ids[r].push_back(perm[SH + r * OWN + b]);
  }
  const std::int64_t C = SH + OWN;
  std::vector<std::vector<float>> q(R, std::vector<float>(QH * D));
  for (auto& v : q) for (auto& x : v) x = u(g);
  std::vector<std::vector<float>> alone(R), together(R);
  double ta = 1e9, tt = 1e9;
  for (int it = 0; it < iters; ++it) {
    auto t0 = std::chrono::steady_clock::now();
    for (std::int64_t l = 0; l < L; ++l)
      for (std::int64_t r = 0; r < R; ++r) {
        detail::Int4Row row{q[r].data(), ids[r].data(), C, 0, &alone[r]};
        detail::int4_scores_rows(std::span<const detail::Int4Row>(&row, 1), QH, KH, D, BS,
                                 detail::Int4Reader{sums[l].data(), codes[l].data(), KH, D, CB}, T);
      }
    auto t1 = std::chrono::steady_clock::now();
    for (std::int64_t l = 0; l < L; ++l) {
      std::vector<detail::RowScores> rs;
      for (std::int64_t r = 0; r < R; ++r) rs.push_back({q[r].data(), ids[r].data(), C, 8, &together[r]});
      sc.score_rows(rs, QH, KH, sums[l].data(), codes[l].data(), T);
    }
    auto t2 = std::chrono::steady_clock::now();
    ta = std::min(ta, std::chrono::duration<double, std::milli>(t1 - t0).count());
    tt = std::min(tt, std::chrono::duration<double, std::milli>(t2 - t1).count());
  }
  bool same = true;
  for (std::int64_t r = 0; r < R; ++r) same = same && alone[r] == together[r];
  const double unique = double(NB * KH * (3 * D * 4 + CB)) * L / 1e6, per_row = double(R * C * KH * (3 * D * 4 + CB)) * L / 1e6;
  std::printf("%s, %d threads, rows %ld (%ld shared + %ld own blocks): alone %.1f ms/step (%.0f MB of summaries), "
              "together %.1f ms/step (%.0f MB), %.2fx, scores identical: %s\n",
              simd::active_table().name, T, R, SH, OWN, ta, per_row, tt, unique, ta / tt, same ? "yes" : "NO");
}
