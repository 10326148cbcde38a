// fuzz_pariskv — ParisKV encode (append, in batches) + search on arbitrary keys and queries.
// Invariants: an append with a NaN/Inf key or an fp32-overflowing squared norm throws and
// leaves size() unchanged (atomic), a valid one grows size() by n; search returns exactly k
// strictly ascending positions < size() with finite scores and candidates in [k, size()];
// with rerank_exact the scores equal the fp32-exact inner products (1e-3 relative);
// collision scores are identical between the portable and AVX-512 kernel sets and lie in
// [0, 6B]; bad k / beta / rho / rerank are rejected with std::invalid_argument.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/pariskv/pariskv.hpp"

namespace {

using i64 = std::int64_t;

template <class T>
void run(FuzzedDataProvider& fdp) {
  static const i64 dims[] = {1, 2, 3, 8, 15, 16, 31, 32, 48, 64, 100, 128};
  const i64 d = dims[fdp.ConsumeIntegralInRange<std::size_t>(0, sizeof dims / sizeof dims[0] - 1)];
  kvscore::ParisKVConfig cfg;
  cfg.m = i64(1) << fdp.ConsumeIntegralInRange<int>(0, 5);  // 1..32: 1 and 32 are invalid
  cfg.center = fdp.ConsumeBool();
  cfg.seed = fdp.ConsumeIntegral<std::uint64_t>();
  std::unique_ptr<kvscore::ParisKV> idx;
  try {
    idx = std::make_unique<kvscore::ParisKV>(d, cfg);
  } catch (const std::invalid_argument&) {
    const i64 P = i64(std::bit_ceil(std::uint64_t(d)));
    FZ_CHECK(cfg.m < 2 || cfg.m > 16 || P % cfg.m != 0, "valid m rejected");
    return;
  }
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  std::vector<T> all;  // keys accepted so far, [n][d]
  const int batches = fdp.ConsumeIntegralInRange<int>(1, 3);
  for (int b = 0; b < batches; ++b) {
    const i64 n = fdp.ConsumeIntegralInRange<i64>(0, 120);
    std::vector<T> rows = fz::values<T>(fdp, std::size_t(n * d), mode);
    bool bad = false, surely_bad = false;
    for (i64 i = 0; i < n; ++i) {
      const fz::Validity v = fz::validity(rows.data() + i * d, d);
      bad |= v != fz::Validity::valid;
      surely_bad |= v == fz::Validity::invalid;
    }
    const i64 before = idx->size();
    try {
      idx->append(rows.data(), n, d);
      FZ_CHECK(!surely_bad, "a key with NaN/Inf or an overflowing norm was accepted");
      FZ_CHECK(idx->size() == before + n, "size after append");
      all.insert(all.end(), rows.begin(), rows.end());
    } catch (const std::invalid_argument&) {
      FZ_CHECK(bad, "valid keys rejected");
      FZ_CHECK(idx->size() == before, "rejected append changed the index");
    }
  }
  const i64 N = idx->size();
  std::vector<float> q = fz::values<float>(fdp, std::size_t(d), fdp.ConsumeIntegralInRange<int>(1, 2));
  // The query follows the key rule: NaN/Inf or an fp32-overflowing squared norm is rejected
  // (near the overflow boundary either answer is right: summation order).
  const fz::Validity qv = fz::validity(q.data(), d);
  const bool qbad = qv != fz::Validity::valid, qsurely_bad = qv == fz::Validity::invalid;
  kvscore::ParisKVSearch opt;
  opt.k = fdp.ConsumeBool() ? std::min<i64>(N, fdp.ConsumeIntegralInRange<i64>(0, 100)) : fdp.ConsumeIntegralInRange<i64>(-2, N + 2);
  opt.beta = fdp.ConsumeBool() ? 0.0 : fdp.ConsumeFloatingPointInRange<double>(-0.5, 1.5);
  opt.rho = fdp.ConsumeBool() ? 0.0 : fdp.ConsumeFloatingPointInRange<double>(-0.5, 1.5);
  opt.rerank_exact = fdp.ConsumeBool() ? 0 : fdp.ConsumeIntegralInRange<i64>(0, N + 2);
  opt.kernels = kvscore::pariskv::Kernels::portable;
  const bool opt_bad = opt.k < 0 || opt.k > N || (opt.beta != 0 && !(opt.beta > 0 && opt.beta <= 1)) ||
                       (opt.rho != 0 && !(opt.rho > 0 && opt.rho <= 1)) || (opt.rerank_exact != 0 && opt.rerank_exact < opt.k);
  kvscore::ParisKV::Workspace ws;
  kvscore::ParisKVResult r;
  try {
    idx->search<T>(q.data(), opt, all.data(), d, ws, r);
  } catch (const std::invalid_argument& e) {
    FZ_CHECK(opt_bad || qbad, std::string("valid search rejected: ") + e.what());
    return;
  }
  FZ_CHECK(!opt_bad && !qsurely_bad, "bad search options / query accepted");
  FZ_CHECK(i64(r.positions.size()) == opt.k && r.scores.size() == r.positions.size(), "result size != k");
  bool qzero = true;  // k = 0 or a zero query: no Stage I (candidates 0 / k)
  for (float x : q) qzero &= x == 0.f;
  FZ_CHECK(N == 0 || opt.k == 0 || qzero || (r.candidates >= std::min(N, std::max(opt.k, opt.rerank_exact)) && r.candidates <= N),
           "candidates " + std::to_string(r.candidates));
  for (std::size_t i = 0; i < r.positions.size(); ++i) {
    FZ_CHECK(r.positions[i] >= 0 && r.positions[i] < N, "position out of range");
    if (i > 0) FZ_CHECK(r.positions[i] > r.positions[i - 1], "positions not strictly ascending");
    FZ_CHECK(std::isfinite(r.scores[i]), "non-finite score");
    if (qzero) FZ_CHECK(r.positions[i] == i64(i) && r.scores[i] == 0.f, "zero query: not the first k with score 0");
    if (opt.rerank_exact > 0) {
      double dot = 0, mag = 0;
      for (i64 j = 0; j < d; ++j) {
        const double a = kvscore::to_float(all[std::size_t(r.positions[i] * d + j)]) * double(q[std::size_t(j)]);
        dot += a;
        mag += std::abs(a);
      }
      FZ_CHECK(std::abs(r.scores[i] - dot) <= 1e-3 * mag + 1e-30, "reranked score != exact dot");
    }
  }
  // Stage I collision scores: integers, identical on every kernel set, in [0, 6B].
  if (N > 0) {
    const double rho = opt.rho == 0 ? 0.5 : opt.rho;
    const auto c0 = idx->collision_scores(q.data(), rho, kvscore::pariskv::Kernels::portable);
    for (std::int32_t c : c0) FZ_CHECK(c >= 0 && c <= 6 * idx->subspaces(), "collision score out of range");
    if (kvscore::pariskv::detail::avx2_ok()) {
      const auto c1 = idx->collision_scores(q.data(), rho, kvscore::pariskv::Kernels::avx2);
      FZ_CHECK(c0 == c1, "collision scores differ between the portable and avx2 kernel sets");
    }
    if (kvscore::pariskv::detail::avx512_ok()) {
      const auto c1 = idx->collision_scores(q.data(), rho, kvscore::pariskv::Kernels::avx512);
      FZ_CHECK(c0 == c1, "collision scores differ between the portable and avx512 kernel sets");
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
