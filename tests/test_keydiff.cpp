// KeyDiff (score = -cos(k, ā), kvscore/scorers/keydiff.hpp; docs/methods/keydiff.md): invariance to a
// positive scale of a key, and tiny keys (subnormal fp32 squared norms) on every SIMD table.
// The numpy fixtures are in test_golden.cpp, the cross-scorer properties in
// test_scorer_properties.cpp, the radial-outlier theorem (KeyDiff vs ManifoldL2) in test_manifoldkv.cpp.
#include <catch2/catch.hpp>

#include <kvscore/scorers/keydiff.hpp>

#include <cmath>
#include <cstdint>

#include "test_support.hpp"

namespace {

using namespace test_support;  // Cache, random_cache, run, close, ...

}  // namespace

TEST_CASE("KeyDiff is invariant to positive scaling of a single key", "[properties][keydiff]") {
  const Cache c = random_cache(12, 2, 30, 20, 1.f);
  const Scores base = run(kvscore::KeyDiff{}, c);
  for (float k : {7.5f, 0.1f, 1000.f}) {
    const Scores r = run_scaled_row(kvscore::KeyDiff{}, c, 0, 9, k);
    CAPTURE(k);
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t t = 0; t < c.tokens; ++t) CHECK(close(r(h, t), base(h, t), 1.0));
  }
  // A negative factor is not a symmetry: the flipped key now points away from the anchor.
  Cache s = c;
  for (std::int64_t j = 0; j < c.dim; ++j) s.row(0, 9)[j] *= -1.f;
  CHECK(run(kvscore::KeyDiff{}, s)(0, 9) != Approx(base(0, 9)).margin(1e-3));
}

TEMPLATE_TEST_CASE("KeyDiff: a tiny key (subnormal fp32 squared norm) keeps its cosine, within [-1, 1]", "[properties][keydiff]",
                   float, bfloat16) {
  // ‖k‖ = 1.4e-22 squares to ~2e-44, a subnormal with ~4 significant bits: the fp32 norm was 1 %
  // off and a lone key scored -1.011 (found by fuzz_scorers). Closed forms: a lone key has
  // cos(k, ā) = 1 exactly; scaling one key by a positive factor leaves every score unchanged.
  INFO(tname<TestType>());
  for (const auto* isa : kvscore::simd::available_tables()) {
    INFO("isa " << isa->name);
    kvscore::KeyDiff kd;
    kd.isa = isa;
    for (std::int64_t d : {1, 3, 16, 64}) {
      Cache lone(1, 1, d);
      for (std::int64_t j = 0; j < d; ++j) lone.row(0, 0)[j] = (j % 2 ? -1.f : 1.f) * 1.36484801e-22f / std::sqrt(float(d));
      CAPTURE(d);
      CHECK(run<TestType>(kd, lone)(0, 0) == Approx(-1.0).margin(1e-6));
    }
    const Cache c = random_cache(12, 2, 30, 20, 1.f);
    const Scores base = run<TestType>(kd, c);
    for (double target : {1e-20, 3e-22, 1e-22, 1e-30}) {  // below 2^-63 = 1.08e-19; 1e-30 squares to 0 in fp32
      Cache s = c;  // a power-of-two factor: the scaled key is exact in fp32 and bf16
      const float f = std::ldexp(1.f, int(std::lround(std::log2(target / norm(c.row(0, 9), c.dim)))));
      for (std::int64_t j = 0; j < c.dim; ++j) s.row(0, 9)[j] *= f;
      const Scores r = run<TestType>(kd, s);
      CAPTURE(target);
      CHECK(r(0, 9) >= -1.f);
      CHECK(r(0, 9) <= 1.f);
      CHECK(close(r(0, 9), base(0, 9), 1.0));  // the cosine of the unscaled key
    }
  }
}
