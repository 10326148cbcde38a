// StreamingLLM (sinks + the most recent tokens per head, kvscore/streaming_llm.hpp; docs/reference/select.md,
// "StreamingLLM"): the kept positions, equality with select() under the same protection and
// with the per-layer form, and the error messages. The selector itself is tested in test_select.cpp.
#include <catch2/catch.hpp>

#include <kvscore/select.hpp>
#include <kvscore/streaming_llm.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "test_support.hpp"

namespace {

using kvscore::Budget;
using kvscore::Scores;
using kvscore::Selection;

using test_support::check_valid;
using test_support::diff;

}  // namespace

TEST_CASE("StreamingLLM: sinks + recent, equal to select with protection", "[select][streaming][streaming_llm]") {
  const Selection s = kvscore::streaming_llm(2, 10, Budget::per_head(6));
  CHECK(s.offsets == std::vector<std::int64_t>{0, 6, 12});
  CHECK(s.positions == std::vector<std::int64_t>{0, 1, 2, 3, 8, 9, 0, 1, 2, 3, 8, 9});
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (std::int64_t N : {1, 3, 4, 9, 100}) {
    Scores sc(3, N);
    for (std::int64_t i = 0; i < 3 * N; ++i) sc.data()[i] = nd(rng);
    for (std::int64_t sinks : {0, 1, 4, 200}) {
      for (std::int64_t n = std::min(sinks, N); n <= N; ++n) {
        const kvscore::StreamingLLM cfg{sinks};
        INFO("N " << N << " sinks " << sinks << " n " << n);
        const Selection a = cfg.select(3, N, Budget::per_head(n));
        check_valid(a);
        CHECK(diff(a, kvscore::select(sc, Budget::per_head(n), cfg.options(N, n))) == "");
        CHECK(diff(a, kvscore::streaming_llm(3, N, Budget::per_layer(3 * n), sinks)) == "");
      }
    }
  }
  CHECK_THROWS_WITH(kvscore::streaming_llm(2, 10, Budget::per_head(3)), Catch::Contains("sinks 4 exceed the budget of 3"));
  CHECK_THROWS_WITH(kvscore::streaming_llm(2, 10, Budget::per_head(11)), Catch::Contains("budget of 11 tokens per head exceeds the 10 tokens"));
  CHECK_THROWS_WITH(kvscore::streaming_llm(2, 10, Budget::per_head(5), -1), Catch::Contains("sinks must be >= 0 (got -1)"));
  CHECK_THROWS_WITH(kvscore::streaming_llm(2, 10, Budget::per_layer(5)), Catch::Contains("per-layer budget 5 is not a multiple of the 2 heads"));
  CHECK_THROWS_WITH(kvscore::streaming_llm(2, 10, Budget::per_head(-2)), Catch::Contains("budget must be >= 0 (got -2)"));
  CHECK_THROWS_WITH(kvscore::streaming_llm(-2, 10, Budget::per_head(2)), Catch::Contains("negative shape (-2, 10)"));
  // sinks beyond a short cache are clipped: 3 tokens, 4 sinks, keep 3
  CHECK(kvscore::streaming_llm(1, 3, Budget::per_head(3)).positions == std::vector<std::int64_t>{0, 1, 2});
}
