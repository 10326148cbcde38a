// fuzz/fuzz_common.hpp — shared helpers of the libFuzzer harnesses (fuzz/README in docs/contributing/robustness.md).
//
// Every harness turns the fuzzer's bytes into arguments with FuzzedDataProvider, calls the
// library, and checks invariants; a broken invariant calls fuzz_fail (abort), an exception
// other than the documented std::invalid_argument / npy::error escapes and aborts too.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "kvscore/core/dtype.hpp"

namespace fz {

[[noreturn]] inline void fuzz_fail(const std::string& what, const char* file, int line) {
  std::fprintf(stderr, "INVARIANT BROKEN at %s:%d: %s\n", file, line, what.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FZ_CHECK(cond, msg)                                                    \
  do {                                                                         \
    if (!(cond)) ::fz::fuzz_fail(std::string(#cond) + " — " + (msg), __FILE__, __LINE__); \
  } while (0)

/// Interesting fp32 values: specials, boundaries of the fp32 squared-norm overflow (~1.8e19),
/// denormals, signed zeros, and fp16/bf16 limits.
inline float special(std::uint8_t i) {
  static const float v[] = {0.f,
                            -0.f,
                            1.f,
                            -1.f,
                            std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::denorm_min(),
                            std::numeric_limits<float>::min(),
                            1.8e19f,
                            -1.9e19f,
                            1e10f,
                            65504.f,
                            3.0e38f,
                            1e-30f,
                            0.5f,
                            2.f};
  return v[i % (sizeof v / sizeof v[0])];
}

/// One fp32 value; `mode` picks the distribution: 0 raw bit patterns, 1 small integers / 16,
/// 2 small values with rare specials, 3 specials only.
inline float value(FuzzedDataProvider& fdp, int mode) {
  switch (mode & 3) {
    case 0: {
      const std::uint32_t b = fdp.ConsumeIntegral<std::uint32_t>();
      float f;
      std::memcpy(&f, &b, 4);
      return f;
    }
    case 1: return float(fdp.ConsumeIntegral<std::int8_t>()) / 16.f;
    case 2: {
      const std::uint8_t s = fdp.ConsumeIntegral<std::uint8_t>();
      if (s >= 248) return special(fdp.ConsumeIntegral<std::uint8_t>());
      return float(std::int8_t(s)) / 8.f + float(fdp.ConsumeIntegral<std::int8_t>()) / 1024.f;
    }
    default: return special(fdp.ConsumeIntegral<std::uint8_t>());
  }
}

/// n values of type T (float, half, bfloat16); T other than float: the fp32 value rounded, or
/// (mode 0) raw 16-bit patterns, which covers fp16/bf16 NaN payloads and denormals.
template <class T>
std::vector<T> values(FuzzedDataProvider& fdp, std::size_t n, int mode) {
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = value(fdp, mode);
    } else {
      if ((mode & 3) == 0) {
        const std::uint16_t b = fdp.ConsumeIntegral<std::uint16_t>();
        std::memcpy(&out[i], &b, 2);
      } else {
        out[i] = kvscore::from_float<T>(value(fdp, mode));
      }
    }
  }
  return out;
}

/// fp32 squared norm in double (no overflow) and whether any element is NaN/Inf.
template <class T>
void row_stats(const T* r, std::int64_t d, double* sq, bool* nonfinite) {
  double s = 0;
  bool bad = false;
  for (std::int64_t j = 0; j < d; ++j) {
    const float v = kvscore::to_float(r[j]);
    if (!std::isfinite(v)) bad = true;
    else s += double(v) * double(v);
  }
  *sq = s;
  *nonfinite = bad;
}

/// Rows whose fp32 squared norm is clearly finite / clearly overflowing (the library's
/// validity rule, scorer_base.hpp); rows near the boundary are "unsure" (summation order).
enum class Validity { valid, invalid, unsure };
template <class T>
Validity validity(const T* r, std::int64_t d) {
  double sq;
  bool bad;
  row_stats(r, d, &sq, &bad);
  const double fmax = double(std::numeric_limits<float>::max());
  if (bad || sq > 2.0 * fmax) return Validity::invalid;
  if (sq < 0.5 * fmax) return Validity::valid;
  return Validity::unsure;
}

}  // namespace fz
