// The one-off driver behind results/vllm.md#the-llama-32-3b-shape-bf16-16k-tokens-batch-4 (the rows scored
// together, tried and not kept): BlockSparsePlanner on a bf16 vLLM-CPU-layout pool of the Llama-3.2-3B shape.
// g++ -std=c++20 -O3 -march=native -DNDEBUG -DKVSCORE_COMPILED=1 -DKVSCORE_RUNTIME_DISPATCH=1 -Iinclude -I/usr/include/eigen3 \
//   THIS.cpp build/libkvscore_dispatch.a -fopenmp -o planner && ./planner 4 16384 12288 20 2
// args: rows tokens shared steps threads
// Switches (results/vllm.md, why the selection is slower inside vLLM than here): FLUSH_MB=64 writes 64 MB of
// other memory after every layer, as the dense layers evict the caches (only the select_planned calls are
// timed then); QBF16=1 passes the queries in bf16 as vLLM does; DESC=1 gives each row its own blocks in
// descending order, SHUFFLE=1 permutes every physical id, as vLLM's free list hands them out. Without them it is the driver as it was. It prints a hash of every chosen id.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include "kvscore/block_sparse.hpp"
#include "kvscore/block_sparse/planner.hpp"
using namespace kvscore;
int main(int argc, char** argv) {
  const std::int64_t R = argc > 1 ? atoi(argv[1]) : 4, N = argc > 2 ? atoi(argv[2]) : 16384, S = argc > 3 ? atoi(argv[3]) : 12288;
  const int steps = argc > 4 ? atoi(argv[4]) : 10, T = argc > 5 ? atoi(argv[5]) : 2;
  const std::int64_t L = 28, KH = 8, QH = 24, D = 128, BS = 32;
  const std::int64_t shared_b = S / BS, own_b = (N + steps + BS - 1) / BS - shared_b + 1;
  const std::int64_t NB = shared_b + R * own_b;
  std::vector<std::vector<bfloat16>> pool(L);
  std::uint64_t x = 88172645463325252ull;
  auto rnd = [&]() { x ^= x << 13; x ^= x >> 7; x ^= x << 17; return float(std::int64_t(x >> 40) - (1 << 23)) / float(1 << 23); };
  for (auto& p : pool) { p.resize(std::size_t(NB * KH * BS * 2 * D)); for (auto& v : p) v = bfloat16(rnd()); }
  std::vector<std::vector<std::int32_t>> tables(R);
  for (std::int64_t r = 0; r < R; ++r) {
    for (std::int64_t b = 0; b < shared_b; ++b) tables[r].push_back(std::int32_t(b));
    for (std::int64_t b = 0; b < own_b; ++b) tables[r].push_back(std::int32_t(shared_b + r * own_b + b));
  }
  if (getenv("SHUFFLE")) {  // physical ids in a random order, as a long-running engine's free list hands them out
    std::vector<std::int32_t> perm(static_cast<std::size_t>(NB));
    for (std::int64_t b = 0; b < NB; ++b) perm[std::size_t(b)] = std::int32_t(b);
    for (std::int64_t b = NB - 1; b > 0; --b) std::swap(perm[std::size_t(b)], perm[std::size_t(x % std::uint64_t(b + 1))]), rnd();
    for (auto& t : tables) for (auto& b : t) b = perm[std::size_t(b)];
  }
  if (getenv("DESC"))  // each row's own blocks in descending order, as vLLM's free list hands back freed blocks
    for (auto& t : tables) std::reverse(t.begin() + shared_b, t.end());
  const std::int64_t cols = std::int64_t(tables[0].size());
  std::vector<std::int32_t> src(std::size_t(R * cols)), dst(std::size_t(R * cols));
  for (std::int64_t r = 0; r < R; ++r) std::copy(tables[r].begin(), tables[r].end(), src.begin() + r * cols);
  BlockSparseOptions o;
  o.num_threads = T;
  BlockSparsePlanner pl(L, NB, KH, D, BS, o);
  std::vector<KeyCache> caches;
  for (auto& p : pool) caches.push_back({dtype::bf16, KeyCacheLayout::vllm_cpu, p.data(), NB, KH, BS, D});
  pl.register_caches(caches);
  std::vector<float> q(std::size_t(R * QH * D)); std::vector<bfloat16> qb(q.size());
  std::vector<std::int64_t> live, rows, ti, tok(R, N), att(R), seqs;
  for (std::int64_t r = 0; r < R; ++r) live.push_back(r), rows.push_back(r), ti.push_back(r), seqs.push_back(r);
  const std::int64_t flush_mb = getenv("FLUSH_MB") ? atoi(getenv("FLUSH_MB")) : 0; const bool flush = flush_mb > 0;
  const bool qbf16 = getenv("QBF16") != nullptr;
  std::vector<float> junk(std::size_t(flush_mb) << 18, 1.f);
  double total = 0; int timed = 0; std::vector<double> all;
  std::uint64_t chosen = 1469598103934665603ull;  // FNV-1a over every step's chosen ids: the same for any order
  for (int s = 0; s <= steps; ++s) {
    std::vector<std::int64_t> slots;
    for (std::int64_t r = 0; r < R; ++r) {
      ++tok[r];
      const std::int64_t pos = tok[r] - 1;
      slots.push_back(std::int64_t(tables[r][std::size_t(pos / BS)]) * BS + pos % BS);
      att[r] = sparse_attend(tok[r], BS, 0.1, kDefaultDenseBelow, o);
    }
    for (auto& v : q) v = rnd();
    if (qbf16) for (std::size_t i = 0; i < q.size(); ++i) qb[i] = bfloat16(q[i]);
    if (s == 1 && getenv("RESUMMARIZE")) {  // every block written: step 1 remakes every summary, pages touched
      for (std::int64_t b = 0; b < NB; ++b) slots.push_back(b * BS);
    }
    double sel_ms = 0;
    auto t0 = std::chrono::steady_clock::now();
    pl.begin_step(slots, live);
    pl.plan(ti, {src.data(), R, cols, cols}, rows, tok, att, {dst.data(), R, cols, cols}, seqs);
    for (std::int64_t l = 0; l < L; ++l) {
      QueryTensor qt = qbf16 ? QueryTensor{dtype::bf16, qb.data(), R, QH, D, {QH * D, D, 1}} : QueryTensor{dtype::f32, q.data(), R, QH, D, {QH * D, D, 1}};
      auto a0 = std::chrono::steady_clock::now();
      pl.select_planned(l, qt);
      sel_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a0).count();
      for (std::int64_t r = 0; r < R; ++r)  // a few hundred ids: no weight in the step's time
        for (std::int64_t i = 0; i < att[r]; ++i) chosen = (chosen ^ std::uint32_t(dst[std::size_t(r * cols + i)])) * 1099511628211ull;
      if (flush) { for (std::size_t i = 0; i < junk.size(); i += 16) junk[i] += 1.f; }
    }
    const double ms = flush ? sel_ms : std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s <= 1) std::printf("step %d: %.1f ms\n", s, ms);
    if (s > 0) total += ms, ++timed, all.push_back(ms);
  }
  std::sort(all.begin(), all.end());
  std::printf("chosen %016llx; ", (unsigned long long)chosen);
  std::printf("median %.1f ms, min %.1f ms; ", all[all.size() / 2], all[0]);
  std::printf("%s, %d threads, %ld rows x %ld tokens (%ld shared), attend %ld blocks: %.1f ms per step (steps 1..%d)\n",
              simd::active_table().name, T, R, N, S, att[0], total / timed, steps);
}
