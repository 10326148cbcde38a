// fuzz_protokv — ProtoKV on arbitrary keys (NaN, Inf, huge, zero, duplicated) and parameters
// (kappa, sat_candidates, lsh_bits, chunks, bandwidth, psi, GQA group).
// Invariants: bad parameters are rejected with std::invalid_argument (own predicate); on
// success, per head, keys with a NaN/Inf element score -inf, no NaN, and the other scores
// are exactly the integers 1..M (a permutation, M = number of finite scores), on every kernel
// table; 1 vs 2 threads give bit-identical scores on each table; when keys and queries are
// exact dyadic rationals, every table agrees with scalar on validity and q̄·k (not on the
// scores: see the comment in run()).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/scorers/protokv.hpp"

namespace {

using i64 = std::int64_t;

template <class View>
void check_ranks(const View& view, const kvscore::Scores& sc, i64 H, i64 N, i64 d, const std::string& who) {
  for (i64 h = 0; h < H; ++h) {
    std::vector<float> fin;
    for (i64 t = 0; t < N; ++t) {
      const float x = sc(h, t);
      FZ_CHECK(!std::isnan(x), who + ": NaN score");
      double sq;
      bool nonfinite;
      fz::row_stats(view.row(h, t), d, &sq, &nonfinite);
      if (nonfinite) FZ_CHECK(x == kvscore::kInvalidScore, who + ": NaN/Inf key not -inf");
      if (x != kvscore::kInvalidScore) fin.push_back(x);
    }
    std::sort(fin.begin(), fin.end());
    for (std::size_t i = 0; i < fin.size(); ++i)
      FZ_CHECK(fin[i] == float(i + 1), who + ": finite scores are not the ranks 1..M");
  }
}

template <class T>
void run(FuzzedDataProvider& fdp) {
  const i64 H = fdp.ConsumeIntegralInRange<i64>(1, 2), N = fdp.ConsumeIntegralInRange<i64>(1, 120);
  const i64 d = fdp.ConsumeIntegralInRange<i64>(1, 40), G = fdp.ConsumeIntegralInRange<i64>(1, 2);
  const i64 w = fdp.ConsumeIntegralInRange<i64>(1, 6);
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  std::vector<T> keys = fz::values<T>(fdp, std::size_t(H * N * d), mode);
  if (fdp.ConsumeBool() && N > 2)  // duplicated keys: ties everywhere
    for (i64 t = 1; t < N; t += 2) std::copy_n(keys.begin() + (t - 1) * d, d, keys.begin() + t * d);
  const kvscore::KeysView<T> view(keys.data(), H, N, d, N * d, d);
  const int qmode = fdp.ConsumeIntegralInRange<int>(1, 2);
  std::vector<float> q = fz::values<float>(fdp, std::size_t(H * G * w * d), qmode);
  bool qbad = false;
  for (float x : q) qbad |= !std::isfinite(x);
  std::unique_ptr<kvscore::ProtoKV> p;
  try {
    p = std::make_unique<kvscore::ProtoKV>(q.data(), H * G, w, d);
  } catch (const std::invalid_argument&) {
    FZ_CHECK(qbad, "finite queries rejected");
    return;
  }
  FZ_CHECK(!qbad, "non-finite query accepted");
  p->kappa = fdp.ConsumeIntegralInRange<i64>(-1, 8);
  p->sat_candidates = fdp.ConsumeIntegralInRange<i64>(-1, N + 1);
  p->lsh_bits = fdp.ConsumeIntegralInRange<int>(-1, 17);
  p->chunks = fdp.ConsumeIntegralInRange<i64>(-1, 2 * N);
  switch (fdp.ConsumeIntegralInRange<int>(0, 3)) {
    case 0: p->bandwidth = 0; break;
    case 1: p->bandwidth = fz::value(fdp, 3); break;
    default: p->bandwidth = fdp.ConsumeFloatingPointInRange<double>(0, 4); break;
  }
  p->psi = fdp.ConsumeBool() ? kvscore::ProtoKV::Psi::sum : kvscore::ProtoKV::Psi::mean;
  p->seed = fdp.ConsumeIntegral<std::uint64_t>();
  const bool bad = w > N || p->kappa < 1 || p->sat_candidates < 0 || p->sat_candidates > N || p->lsh_bits < 0 ||
                   p->lsh_bits > 16 || p->chunks < 0 || (p->chunks == 0 && p->sat_candidates == 0) ||
                   !(p->bandwidth >= 0) || !std::isfinite(p->bandwidth);
  const auto tables = kvscore::simd::available_tables();
  kvscore::Scores ref(H, N);
  p->num_threads = 1;
  p->isa = tables[0];
  try {
    p->score(view, ref.view());
  } catch (const std::invalid_argument& e) {
    FZ_CHECK(bad, std::string("valid parameters rejected: ") + e.what());
    return;
  }
  FZ_CHECK(!bad, "invalid parameters accepted");
  // Per table: the structural invariants, and 1 vs 2 threads bit-identical. Tables are NOT
  // compared bit for bit: the neighbourhood similarity S is a dot of fp32 *unit* rows, never
  // exact, so a last-bit difference (FMA vs mul+add) can reorder the SAT candidates and move
  // tokens between clusters even when every key and query is a small dyadic rational.
  // What must agree across tables when every input is a multiple of 1/16 in [-8, 8]
  // (d <= 40, so q̄·k and ‖k‖² are exact in fp32): the validity mask and q̄·k.
  const bool exact = mode == 1 && qmode == 1;
  std::vector<kvscore::ProtoKVHead> ref_heads;
  for (const auto* tb : tables) {
    const std::string who = std::string("table ") + tb->name;
    p->isa = tb;
    p->num_threads = 1;
    const kvscore::Scores s1 = tb == tables[0] ? ref : p->score(view);
    check_ranks(view, s1, H, N, d, who);
    p->num_threads = 2;
    const kvscore::Scores s2 = p->score(view);
    FZ_CHECK(std::memcmp(s1.data(), s2.data(), std::size_t(H * N) * 4) == 0, who + ": 2 threads differ from 1");
    if (!exact) continue;
    for (i64 h = 0; h < H; ++h) {
      const kvscore::ProtoKVHead a = p->analyze(view, h);
      if (tb == tables[0]) {
        ref_heads.push_back(a);
        continue;
      }
      const kvscore::ProtoKVHead& r = ref_heads[std::size_t(h)];
      FZ_CHECK(a.valid == r.valid, who + ": validity differs from scalar");
      FZ_CHECK(std::memcmp(a.qk.data(), r.qk.data(), std::size_t(N) * 4) == 0, who + ": exact q̄·k differs from scalar");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  switch (fdp.ConsumeIntegralInRange<int>(0, 2)) {
    case 0: run<float>(fdp); break;
    case 1: run<kvscore::half>(fdp); break;
    default: run<kvscore::bfloat16>(fdp); break;
  }
  return 0;
}
