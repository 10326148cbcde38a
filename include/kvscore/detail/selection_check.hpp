// kvscore/detail/selection_check.hpp — validation of a Selection against the cache it will
// be applied to (compact, paged slots, evicted ranges). Throws std::invalid_argument naming
// the offending value; never modifies anything.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore::detail {

/// Checks that `sel` is well formed (CSR offsets, positions ascending and in [0, sel.tokens))
/// and, for heads/tokens >= 0, that its shape is (heads, tokens). `who` prefixes the message.
inline void require_valid_selection(const Selection& sel, std::int64_t heads, std::int64_t tokens, const char* who) {
  const std::string ctx(who);
  if (heads >= 0 && sel.heads != heads)
    throw_invalid(ctx + ": selection has " + std::to_string(sel.heads) + " heads but the cache has " +
                  std::to_string(heads));
  if (tokens >= 0 && sel.tokens != tokens)
    throw_invalid(ctx + ": selection was made over " + std::to_string(sel.tokens) + " tokens but the cache has " +
                  std::to_string(tokens));
  if (sel.heads < 0 || sel.tokens < 0)
    throw_invalid(ctx + ": selection has a negative shape (" + std::to_string(sel.heads) + ", " +
                  std::to_string(sel.tokens) + ")");
  if (sel.offsets.size() != std::size_t(sel.heads) + 1)
    throw_invalid(ctx + ": selection.offsets has " + std::to_string(sel.offsets.size()) +
                  " entries, expected heads + 1 = " + std::to_string(sel.heads + 1));
  if (sel.offsets[0] != 0)
    throw_invalid(ctx + ": selection.offsets[0] = " + std::to_string(sel.offsets[0]) + ", expected 0");
  if (sel.offsets.back() != std::int64_t(sel.positions.size()))
    throw_invalid(ctx + ": selection.offsets[" + std::to_string(sel.heads) + "] = " +
                  std::to_string(sel.offsets.back()) + " but positions has " +
                  std::to_string(sel.positions.size()) + " entries");
  for (std::int64_t h = 0; h < sel.heads; ++h) {  // offsets first: positions are indexed through them
    const std::int64_t b = sel.offsets[std::size_t(h)], e = sel.offsets[std::size_t(h + 1)];
    if (e < b)
      throw_invalid(ctx + ": selection.offsets decrease at head " + std::to_string(h) + " (" + std::to_string(b) +
                    " > " + std::to_string(e) + ")");
  }
  for (std::int64_t h = 0; h < sel.heads; ++h) {
    const std::int64_t b = sel.offsets[std::size_t(h)], e = sel.offsets[std::size_t(h + 1)];
    if (e - b > sel.tokens)
      throw_invalid(ctx + ": head " + std::to_string(h) + " keeps " + std::to_string(e - b) +
                    " positions but there are only " + std::to_string(sel.tokens) + " tokens");
    std::int64_t prev = -1;
    for (std::int64_t i = b; i < e; ++i) {
      const std::int64_t p = sel.positions[std::size_t(i)];
      if (p < 0 || p >= sel.tokens)
        throw_invalid(ctx + ": head " + std::to_string(h) + ": position " + std::to_string(p) +
                      " out of range [0, " + std::to_string(sel.tokens) + ")");
      if (p <= prev)
        throw_invalid(ctx + ": head " + std::to_string(h) + ": positions must be strictly ascending (" +
                      std::to_string(p) + " after " + std::to_string(prev) + ")");
      prev = p;
    }
  }
}

/// One head's kept positions: each in [0, tokens), strictly ascending (slots, the evaluator).
inline void require_ascending(std::span<const std::int64_t> kept, std::int64_t tokens, const char* who) {
  if (tokens < 0) throw_invalid(std::string(who) + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  std::int64_t prev = -1;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const std::int64_t p = kept[i];
    if (p < 0 || p >= tokens)
      throw_invalid(std::string(who) + ": kept position " + std::to_string(p) + " (kept[" + std::to_string(i) +
                    "] = " + std::to_string(p) + ") out of range [0, " + std::to_string(tokens) + ")");
    if (p <= prev)
      throw_invalid(std::string(who) + ": kept positions must be strictly ascending (" + std::to_string(p) +
                    " after " + std::to_string(prev) + ")");
    prev = p;
  }
}

}  // namespace kvscore::detail
