// kvscore/core/selection.hpp — the result of selecting tokens: for each head, the kept token
// positions in ascending order. Heads may keep different counts (ragged), so the
// positions are stored CSR-style: head h keeps positions[offsets[h] .. offsets[h+1]).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace kvscore {

/// The kept positions of each head, ascending, stored CSR-style: head h keeps the entries
/// offsets[h] to offsets[h + 1] - 1 of `positions`. What select() returns and compact() applies.
struct Selection {
  std::int64_t heads = 0;                  ///< heads of the scored cache
  std::int64_t tokens = 0;                 ///< tokens of the scored cache (positions are < tokens)
  std::vector<std::int64_t> offsets{0};    ///< heads + 1 entries, offsets[0] = 0
  std::vector<std::int64_t> positions;     ///< kept positions, ascending within each head

  /// Positions head h keeps.
  std::int64_t kept(std::int64_t h) const noexcept { return offsets[std::size_t(h + 1)] - offsets[std::size_t(h)]; }
  /// Positions kept over all heads.
  std::int64_t total() const noexcept { return offsets.empty() ? 0 : offsets.back(); }
  /// Head h's kept positions, ascending.
  std::span<const std::int64_t> head(std::int64_t h) const noexcept {
    return {positions.data() + offsets[std::size_t(h)], std::size_t(kept(h))};
  }

  /// Nothing kept in any of `heads` heads of a `tokens`-token cache (e.g. an OjaHybridCache
  /// with no full-rank tokens).
  static Selection none(std::int64_t heads, std::int64_t tokens) {
    Selection s;
    s.heads = heads;
    s.tokens = tokens;
    s.offsets.assign(static_cast<std::size_t>(heads < 0 ? 0 : heads) + 1, 0);
    return s;
  }
};

}  // namespace kvscore
