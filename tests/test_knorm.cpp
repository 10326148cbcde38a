// KNorm (score = -‖k‖, kvscore/scorers/knorm.hpp; docs/methods/knorm.md): a closed form, the score
// scales with its key and no other row moves. The numpy fixtures are in test_golden.cpp; zero,
// NaN/Inf rows, empty caches and determinism across scorers in test_scorer_properties.cpp.
#include <catch2/catch.hpp>

#include <kvscore/scorers/knorm.hpp>

#include <cstdint>

#include "test_support.hpp"

namespace {

using namespace test_support;  // Cache, random_cache, run, close, ...

}  // namespace

TEST_CASE("KNorm scales with the key", "[properties][knorm]") {
  const Cache c = random_cache(11, 2, 20, 24, 1.f);
  const Scores base = run(kvscore::KNorm{}, c);
  for (float k : {3.f, 0.25f, 17.5f}) {
    const Scores r = run_scaled_row(kvscore::KNorm{}, c, 1, 5, k);
    CAPTURE(k);
    CHECK(r(1, 5) == Approx(double(k) * base(1, 5)).epsilon(1e-6));
    for (std::int64_t h = 0; h < c.heads; ++h)
      for (std::int64_t t = 0; t < c.tokens; ++t)
        if (!(h == 1 && t == 5)) CHECK(r(h, t) == base(h, t));  // per-row score: others untouched
  }
}
