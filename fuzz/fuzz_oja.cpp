// fuzz_oja — OjaKV: prefill and decode (push / flush) updates of an OjaBasis, and the
// OjaResidual scorer, on arbitrary keys (NaN, Inf, huge, denormal, all-invalid, rank-deficient).
// Invariants: the basis stays finite and orthonormal (max |U^T U - I| <= 1e-6) after every
// update; prefill returns the number of valid rows (fp32 squared norm finite) and leaves U
// unchanged when there is none; push returns true exactly every `period` calls; OjaResidual
// gives no NaN, -inf for keys with a NaN/Inf element, >= 0 otherwise, and identical scores
// on 1 and 2 threads.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/ojakv/ojakv.hpp"

namespace {

using i64 = std::int64_t;

void check_basis(const kvscore::OjaBasis& b, const char* when) {
  FZ_CHECK(b.basis().allFinite(), std::string("basis not finite after ") + when);
  const double e = kvscore::oja::orthonormality_error(b.basis());
  FZ_CHECK(e <= 1e-6, std::string("basis not orthonormal after ") + when + ": " + std::to_string(e));
}

template <class T>
void run(FuzzedDataProvider& fdp) {
  const i64 d = fdp.ConsumeIntegralInRange<i64>(1, 40), r = fdp.ConsumeIntegralInRange<i64>(1, d);
  const i64 H = fdp.ConsumeIntegralInRange<i64>(1, 2), N = fdp.ConsumeIntegralInRange<i64>(1, 150);
  kvscore::OjaOptions opt;
  opt.pool = fdp.ConsumeIntegralInRange<i64>(1, 8);
  opt.period = fdp.ConsumeIntegralInRange<i64>(1, 40);
  opt.prefill_iterations = fdp.ConsumeIntegralInRange<int>(1, 8);
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  std::vector<T> keys = fz::values<T>(fdp, std::size_t(H * N * d), mode);
  const kvscore::KeysView<T> view(keys.data(), H, N, d, N * d, d);
  kvscore::OjaBasis b = kvscore::OjaBasis::random(d, r, fdp.ConsumeIntegral<std::uint64_t>(), opt);
  check_basis(b, "random start");
  const i64 h = fdp.ConsumeIntegralInRange<i64>(0, H - 1);
  i64 valid = 0, unsure = 0;
  for (i64 t = 0; t < N; ++t) {
    const fz::Validity v = fz::validity(view.row(h, t), d);
    valid += v == fz::Validity::valid;
    unsure += v == fz::Validity::unsure;
  }
  const Eigen::MatrixXd u0 = b.basis();
  const i64 used = b.prefill(view, h);
  FZ_CHECK(used >= valid && used <= valid + unsure, "prefill used " + std::to_string(used) + " rows, valid " +
                                                        std::to_string(valid));
  if (used == 0) FZ_CHECK(b.basis() == u0, "prefill without valid rows changed U");
  check_basis(b, "prefill");
  // Decode: push rows of the view; an update every `period` pushes.
  const i64 pushes = fdp.ConsumeIntegralInRange<i64>(0, 2 * N);
  for (i64 i = 0; i < pushes; ++i) {
    const bool upd = b.push(view.row(h, i % N));
    FZ_CHECK(upd == ((i + 1) % opt.period == 0), "push updated at the wrong time");
    if (upd) check_basis(b, "decode update");
  }
  if (b.buffered() > 0) {
    b.flush();
    check_basis(b, "flush");
  } else {
    bool threw = false;
    try {
      b.flush();
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    FZ_CHECK(threw, "flush of an empty buffer did not throw");
  }
  // OjaResidual with per-head bases and a small query window.
  const i64 w = fdp.ConsumeIntegralInRange<i64>(1, std::min<i64>(N, 8));
  std::vector<float> q = fz::values<float>(fdp, std::size_t(H * w * d), 2);
  bool qbad = false;
  for (float x : q) qbad |= !std::isfinite(x);
  std::vector<Eigen::MatrixXd> bases(std::size_t(H), b.basis());
  try {
    kvscore::OjaResidual res(q.data(), H, w, d, bases);
    res.num_threads = 1;
    kvscore::Scores s1(H, N), s2(H, N);
    res.score(view, s1.view());
    res.num_threads = 2;
    res.score(view, s2.view());
    FZ_CHECK(s1.values() == s2.values() || std::memcmp(s1.data(), s2.data(), std::size_t(H * N) * 4) == 0,
             "OjaResidual: 1 vs 2 threads differ");
    for (i64 hh = 0; hh < H; ++hh)
      for (i64 t = 0; t < N; ++t) {
        const float x = s1(hh, t);
        FZ_CHECK(!std::isnan(x), "OjaResidual NaN score");
        double sq;
        bool nonfinite;
        fz::row_stats(view.row(hh, t), d, &sq, &nonfinite);
        if (nonfinite) FZ_CHECK(x == kvscore::kInvalidScore, "OjaResidual: NaN/Inf key not -inf");
        else if (x != kvscore::kInvalidScore) FZ_CHECK(x >= 0.f, "OjaResidual negative score");
      }
  } catch (const std::invalid_argument& e) {
    FZ_CHECK(qbad, std::string("OjaResidual rejected finite queries: ") + e.what());
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
