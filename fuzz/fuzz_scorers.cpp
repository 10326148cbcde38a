// fuzz_scorers — every CPU scorer (KNorm, KeyDiff, ManifoldL2, WindowedManifoldL2, QFilter,
// SnapKV) on arbitrary fp32/fp16/bf16 bit patterns (NaN, Inf, denormals, huge), strided
// layouts and every kernel table compiled in (scalar, sse2, avx2, avx512 as the CPU allows).
// Invariants, per table: no NaN score; a key with a NaN/Inf element scores -inf; a key whose
// squared norm is clearly finite scores finite (KNorm, KeyDiff, ManifoldL2); KNorm equals
// -sqrt of the double squared norm to 1e-4 relative; every table agrees with the scalar one
// on which keys are -inf (outside the fp32-overflow boundary band) and, for KNorm, to 1e-4;
// 1 and 2 threads give bit-identical scores.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/snapkv.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"

namespace {

using i64 = std::int64_t;

enum Which { kKNorm, kKeyDiff, kManifold, kWindowed, kQFilter, kSnapKV, kCount };
const char* const kNames[] = {"knorm", "keydiff", "manifold-l2", "windowed-l2", "qfilter", "snapkv"};

template <class T>
void run(FuzzedDataProvider& fdp) {
  const i64 H = fdp.ConsumeIntegralInRange<i64>(1, 3);
  const i64 N = fdp.ConsumeIntegralInRange<i64>(1, 160);
  static const i64 dims[] = {1, 2, 3, 7, 8, 15, 16, 17, 31, 33, 64, 65, 96, 127, 128, 129};
  const i64 d = dims[fdp.ConsumeIntegralInRange<std::size_t>(0, sizeof dims / sizeof dims[0] - 1)];
  const i64 pad = fdp.ConsumeIntegralInRange<i64>(0, 3);
  const bool token_major = fdp.ConsumeBool();
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  const Which which = Which(fdp.ConsumeIntegralInRange<int>(0, kCount - 1));
  // layout: head-major [H][N][d+pad] or token-major [N][H][d+pad]
  const i64 row = d + pad;
  const i64 ts = token_major ? H * row : row, hs = token_major ? row : N * row;
  std::vector<T> keys = fz::values<T>(fdp, std::size_t(H * N * row), mode);
  const kvscore::KeysView<T> view(keys.data(), H, N, d, hs, ts);

  // Query-side parameters (finite unless the fuzzer sets a special: then construction throws).
  const i64 G = fdp.ConsumeIntegralInRange<i64>(1, 2), w = fdp.ConsumeIntegralInRange<i64>(1, 4);
  std::vector<float> q = fz::values<float>(fdp, std::size_t(H * G * w * d), fdp.ConsumeIntegralInRange<int>(1, 2));
  std::vector<float> filt = fz::values<float>(fdp, std::size_t(H * d), fdp.ConsumeIntegralInRange<int>(1, 2));
  const i64 window = fdp.ConsumeIntegralInRange<i64>(1, 64);

  auto score = [&](const kvscore::simd::KernelTable* isa, int threads) -> std::vector<float> {
    kvscore::Scores s(H, N);
    auto go = [&](auto scorer) {
      scorer.isa = isa;
      scorer.num_threads = threads;
      scorer.score(view, s.view());
    };
    switch (which) {
      case kKNorm: go(kvscore::KNorm{}); break;
      case kKeyDiff: go(kvscore::KeyDiff{}); break;
      case kManifold: go(kvscore::ManifoldL2{}); break;
      case kWindowed: go(kvscore::WindowedManifoldL2(window)); break;
      case kQFilter: go(kvscore::QFilter(filt, H, d)); break;
      case kSnapKV: go(kvscore::SnapKV(q.data(), H * G, std::min(w, N), d)); break;
      default: break;
    }
    return s.values();
  };

  const auto tables = kvscore::simd::available_tables();
  std::vector<float> ref;
  try {
    ref = score(tables[0], 1);
  } catch (const std::invalid_argument& e) {
    // Only the query side may be rejected: non-finite queries / filters.
    bool bad = false;
    for (float x : (which == kQFilter ? filt : q)) bad |= !std::isfinite(x);
    FZ_CHECK(bad && (which == kQFilter || which == kSnapKV), std::string("unexpected rejection: ") + e.what());
    return;
  }
  std::vector<fz::Validity> val(std::size_t(H * N));
  bool all_small = true;
  for (i64 h = 0; h < H; ++h)
    for (i64 t = 0; t < N; ++t) {
      val[std::size_t(h * N + t)] = fz::validity(view.row(h, t), d);
      all_small &= val[std::size_t(h * N + t)] == fz::Validity::valid;
    }
  for (const kvscore::simd::KernelTable* tb : tables) {
    const std::vector<float> s = tb == tables[0] ? ref : score(tb, 1);
    for (i64 h = 0; h < H; ++h)
      for (i64 t = 0; t < N; ++t) {
        const std::size_t i = std::size_t(h * N + t);
        const std::string where = std::string(kNames[which]) + " table " + tb->name + " h " + std::to_string(h) +
                                  " t " + std::to_string(t) + " score " + std::to_string(s[i]);
        FZ_CHECK(!std::isnan(s[i]), "NaN score: " + where);
        double sq;
        bool nonfinite;
        fz::row_stats(view.row(h, t), d, &sq, &nonfinite);
        if (nonfinite) FZ_CHECK(s[i] == kvscore::kInvalidScore, "key with NaN/Inf not -inf: " + where);
        if (val[i] != fz::Validity::unsure)
          FZ_CHECK((s[i] == kvscore::kInvalidScore) == (ref[i] == kvscore::kInvalidScore) ||
                       (which != kKNorm && !all_small),
                   "-inf differs from scalar: " + where);
        if (val[i] == fz::Validity::invalid && which != kSnapKV)
          FZ_CHECK(s[i] == kvscore::kInvalidScore, "overflowing key not -inf: " + where);
        if (val[i] == fz::Validity::valid && (which == kKNorm || which == kKeyDiff))
          FZ_CHECK(std::isfinite(s[i]), "valid key scored non-finite: " + where);
        if (which == kManifold && all_small)
          FZ_CHECK(std::isfinite(s[i]) || s[i] == INFINITY, "valid key scored -inf: " + where);
        if (which == kKNorm && val[i] == fz::Validity::valid) {
          const double r = -std::sqrt(sq);
          // fp32 squares of |x| < ~1e-19 underflow (denormal or 0): allow that absolute error.
          FZ_CHECK(std::abs(double(s[i]) - r) <= 1e-4 * std::abs(r) + 1e-18 * std::sqrt(double(d)),
                   "KNorm off reference: " + where);
        }
        if (which == kKeyDiff && val[i] == fz::Validity::valid)
          FZ_CHECK(s[i] >= -1.001f && s[i] <= 1.001f, "KeyDiff outside [-1, 1]: " + where);
        if ((which == kManifold || which == kWindowed) && !std::isinf(s[i]))
          FZ_CHECK(s[i] >= 0.f, "negative distance: " + where);
      }
  }
  // Threads: bit-identical.
  const std::vector<float> s2 = score(tables.back(), 2), s1 = score(tables.back(), 1);
  FZ_CHECK(std::memcmp(s1.data(), s2.data(), s1.size() * 4) == 0, std::string(kNames[which]) + ": 1 vs 2 threads differ");
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
