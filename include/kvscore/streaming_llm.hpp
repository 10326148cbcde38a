// kvscore/streaming_llm.hpp — StreamingLLM (Xiao et al. 2024) as a selector configuration:
// every head keeps the first `sinks` tokens (attention sinks) and the most recent tokens,
// n per head in total. No scores are needed.
//
// [snippet streaming-llm-header: tests/test_snippets.cpp]
//   Selection a = kvscore::streaming_llm(heads, tokens, Budget::per_head(n));              // 4 sinks
//   Selection b = kvscore::StreamingLLM{/*sinks*/ 8}.select(heads, tokens, Budget::per_head(n));
//
// Definition: s' = min(sinks, tokens); head h keeps [0, s') and the last n - s' positions.
// It is exactly kvscore::select(any scores, Budget::per_head(n), StreamingLLM{sinks}.options(tokens, n)):
// the protected tokens fill the whole budget, so the scores never matter.
// Errors (std::invalid_argument): n > tokens (k > N), s' > n, negative sinks / budget,
// a per-layer budget that is not a multiple of heads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "kvscore/methods.hpp"
#include "kvscore/select.hpp"
#include "kvscore/core/selection.hpp"

namespace kvscore {

/// StreamingLLM (Xiao et al. 2024) as a selection rule: every head keeps the first `sinks` positions and the most
/// recent ones, no scores.
struct StreamingLLM {
  std::int64_t sinks = kDefaultSinks;  ///< attention-sink tokens kept at the start (Xiao et al. use 4)

  /// Tokens kept per head for `budget` over `heads` heads (validated).
  static std::int64_t per_head_budget(std::int64_t heads, Budget budget) {
    const std::string who = "kvscore::StreamingLLM: ";
    if (budget.count() < 0)
      detail::throw_invalid(who + "budget must be >= 0 (got " + std::to_string(budget.count()) + ")");
    if (budget.kind() == Budget::Kind::per_head) return budget.count();
    if (heads == 0 ? budget.count() != 0 : budget.count() % heads != 0)
      detail::throw_invalid(who + "per-layer budget " + std::to_string(budget.count()) +
                            " is not a multiple of the " + std::to_string(heads) + " heads");
    return heads == 0 ? 0 : budget.count() / heads;
  }

  /// The select() options that implement StreamingLLM with n tokens per head.
  SelectOptions options(std::int64_t tokens, std::int64_t n) const {
    const std::string who = "kvscore::StreamingLLM: ";
    if (sinks < 0) detail::throw_invalid(who + "sinks must be >= 0 (got " + std::to_string(sinks) + ")");
    if (n < 0) detail::throw_invalid(who + "budget must be >= 0 (got " + std::to_string(n) + ")");
    if (n > tokens)
      detail::throw_invalid(who + "budget of " + std::to_string(n) + " tokens per head exceeds the " +
                            std::to_string(tokens) + " tokens of the cache (k > N)");
    const std::int64_t s = std::min(sinks, tokens);
    if (s > n)
      detail::throw_invalid(who + "sinks " + std::to_string(sinks) + " exceed the budget of " + std::to_string(n) +
                            " tokens per head");
    SelectOptions o;
    o.sinks = sinks;
    o.recent = n - s;
    return o;
  }

  /// The StreamingLLM selection of a heads x tokens cache.
  Selection select(std::int64_t heads, std::int64_t tokens, Budget budget) const {
    if (heads < 0 || tokens < 0)
      detail::throw_invalid("kvscore::StreamingLLM: negative shape (" + std::to_string(heads) + ", " +
                            std::to_string(tokens) + ")");
    const std::int64_t n = per_head_budget(heads, budget);
    const SelectOptions o = options(tokens, n);
    const std::int64_t s = std::min(o.sinks, tokens);
    Selection sel;
    sel.heads = heads;
    sel.tokens = tokens;
    sel.offsets.resize(std::size_t(heads + 1));
    sel.positions.resize(std::size_t(detail::checked_mul(heads, n, "kvscore::StreamingLLM")));
    for (std::int64_t h = 0; h <= heads; ++h) sel.offsets[std::size_t(h)] = h * n;
    for (std::int64_t h = 0; h < heads; ++h) {
      std::int64_t* out = sel.positions.data() + h * n;
      std::int64_t j = 0;
      for (std::int64_t t = 0; t < s; ++t) out[j++] = t;
      for (std::int64_t t = tokens - o.recent; t < tokens; ++t) out[j++] = t;
    }
    return sel;
  }
};

/// StreamingLLM selection: `sinks` first tokens + the most recent ones, n per head.
inline Selection streaming_llm(std::int64_t heads, std::int64_t tokens, Budget budget, std::int64_t sinks = kDefaultSinks) {
  return StreamingLLM{sinks}.select(heads, tokens, budget);
}

}  // namespace kvscore
