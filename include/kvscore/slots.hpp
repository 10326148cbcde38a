// kvscore/slots.hpp — applying a Selection to slot caches (llama.cpp cells, SGLang slots)
// without moving data: the engine frees the evicted slots itself.
//
//  - evicted_ranges(): the positions NOT kept, as maximal half-open ranges [p0, p1) in ascending
//    order, ready for llama.cpp's llama_memory_seq_rm(mem, seq, p0, p1).
//  - union_heads() / shared_selection(): seq_rm (and SGLang's slot free) removes a token for every
//    head and every layer, so per-head selections must first be merged into one keep list.
//  - evicted_position_ranges(): llama.cpp cells are slots, not positions; with the cell -> pos
//    table of the scored cells, the ranges are given in position space.
//  - partition_slots(): SGLang's req_to_token row split into the kept slots (the new row) and the
//    slots to free.
// See docs/reference/compaction.md for what to call per engine.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/detail/selection_check.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// Half-open range of positions [begin, end).
struct PositionRange {
  std::int64_t begin = 0;  ///< first position of the range
  std::int64_t end = 0;  ///< one past the last position
  constexpr std::int64_t size() const noexcept { return end - begin; }  ///< positions in the range
  friend constexpr bool operator==(const PositionRange&, const PositionRange&) = default;
};

namespace detail {

inline std::vector<PositionRange> complement_ranges(std::span<const std::int64_t> kept, std::int64_t tokens) {
  std::vector<PositionRange> out;
  std::int64_t next = 0;  // first position not yet accounted for
  for (const std::int64_t p : kept) {
    if (p > next) out.push_back({next, p});
    next = p + 1;
  }
  if (next < tokens) out.push_back({next, tokens});
  return out;
}

}  // namespace detail

/// The positions of [0, tokens) not in `kept` (strictly ascending), as maximal ranges, ascending.
/// Empty kept -> {[0, tokens)} (or nothing when tokens == 0); kept = all -> {}.
inline std::vector<PositionRange> evicted_ranges(std::span<const std::int64_t> kept, std::int64_t tokens) {
  detail::require_ascending(kept, tokens, "kvscore::evicted_ranges");
  return detail::complement_ranges(kept, tokens);
}

/// Evicted ranges of head h of a selection.
inline std::vector<PositionRange> evicted_ranges(const Selection& sel, std::int64_t h) {
  detail::require_valid_selection(sel, -1, -1, "kvscore::evicted_ranges");
  if (h < 0 || h >= sel.heads)
    detail::throw_invalid("kvscore::evicted_ranges: head " + std::to_string(h) + " out of range [0, " +
                          std::to_string(sel.heads) + ")");
  return detail::complement_ranges(sel.head(h), sel.tokens);
}

/// Union of the kept positions of every head: one sequence-level keep list, ascending. A token
/// survives if any head keeps it (so the union can be larger than the per-head budget).
inline std::vector<std::int64_t> union_heads(const Selection& sel) {
  detail::require_valid_selection(sel, -1, -1, "kvscore::union_heads");
  std::vector<char> keep(std::size_t(sel.tokens), 0);
  for (const std::int64_t p : sel.positions) keep[std::size_t(p)] = 1;
  std::vector<std::int64_t> out;
  for (std::int64_t t = 0; t < sel.tokens; ++t)
    if (keep[std::size_t(t)]) out.push_back(t);
  return out;
}

/// Union over several selections of the same sequence (e.g. one per layer: llama.cpp's seq_rm
/// removes a cell from every layer). All must have the same `tokens`.
inline std::vector<std::int64_t> union_heads(std::span<const Selection> selections) {
  if (selections.empty()) return {};
  const std::int64_t tokens = selections.front().tokens;
  std::vector<char> keep(std::size_t(std::max<std::int64_t>(tokens, 0)), 0);
  for (std::size_t s = 0; s < selections.size(); ++s) {
    const Selection& sel = selections[s];
    if (sel.tokens != tokens)
      detail::throw_invalid("kvscore::union_heads: selection " + std::to_string(s) + " has " +
                            std::to_string(sel.tokens) + " tokens, selection 0 has " + std::to_string(tokens));
    detail::require_valid_selection(sel, -1, tokens, "kvscore::union_heads");
    for (const std::int64_t p : sel.positions) keep[std::size_t(p)] = 1;
  }
  std::vector<std::int64_t> out;
  for (std::int64_t t = 0; t < tokens; ++t)
    if (keep[std::size_t(t)]) out.push_back(t);
  return out;
}

/// A selection in which every one of `heads` heads keeps the same positions (strictly ascending,
/// in [0, tokens)) — e.g. union_heads(sel), to compact a cache whose heads must stay aligned.
inline Selection broadcast_selection(std::span<const std::int64_t> kept, std::int64_t heads, std::int64_t tokens) {
  detail::require_ascending(kept, tokens, "kvscore::broadcast_selection");
  if (heads < 0)
    detail::throw_invalid("kvscore::broadcast_selection: heads must be >= 0 (got " + std::to_string(heads) + ")");
  Selection out;
  out.heads = heads;
  out.tokens = tokens;
  out.offsets.resize(std::size_t(heads) + 1);
  out.positions.reserve(std::size_t(heads) * kept.size());
  for (std::int64_t h = 0; h < heads; ++h) {
    out.offsets[std::size_t(h)] = std::int64_t(out.positions.size());
    out.positions.insert(out.positions.end(), kept.begin(), kept.end());
  }
  out.offsets[std::size_t(heads)] = std::int64_t(out.positions.size());
  return out;
}

/// broadcast_selection(union_heads(sel), sel.heads, sel.tokens): every head keeps the union.
inline Selection shared_selection(const Selection& sel) {
  const std::vector<std::int64_t> u = union_heads(sel);
  return broadcast_selection(u, sel.heads, sel.tokens);
}

namespace detail {

template <class I>
std::vector<PositionRange> evicted_position_ranges_impl(std::span<const std::int64_t> kept_cells,
                                                        std::span<const I> cell_pos) {
  constexpr const char* who = "kvscore::evicted_position_ranges";
  require_ascending(kept_cells, std::int64_t(cell_pos.size()), who);
  // (position, kept) for every cell of the sequence, in position order
  std::vector<std::pair<std::int64_t, bool>> cells;
  cells.reserve(cell_pos.size());
  std::size_t k = 0;
  for (std::size_t c = 0; c < cell_pos.size(); ++c) {
    const bool kept = k < kept_cells.size() && kept_cells[k] == std::int64_t(c);
    if (kept) ++k;
    if (cell_pos[c] >= 0) cells.emplace_back(std::int64_t(cell_pos[c]), kept);
  }
  std::sort(cells.begin(), cells.end());
  for (std::size_t i = 1; i < cells.size(); ++i)
    if (cells[i].first == cells[i - 1].first)
      throw_invalid(std::string(who) + ": position " + std::to_string(cells[i].first) +
                    " appears in two cells of the sequence");
  std::vector<PositionRange> out;
  for (std::size_t i = 0; i < cells.size();) {
    if (cells[i].second) {
      ++i;
      continue;
    }
    std::size_t j = i;
    while (j + 1 < cells.size() && !cells[j + 1].second) ++j;
    out.push_back({cells[i].first, cells[j].first + 1});
    i = j + 1;
  }
  return out;
}

}  // namespace detail

/// llama.cpp: cells are slots, not positions. `cell_pos[c]` is the position of scored cell c in
/// the sequence, or < 0 when the cell is empty or belongs to another sequence (such cells are
/// ignored, kept or not). `kept_cells` are the kept cell indices (strictly ascending, e.g.
/// union_heads(sel) over a view of the cells). Returns the minimal list of ranges [p0, p1), in
/// ascending position order, whose seq_rm removes exactly the sequence's cells not kept: each
/// range spans a maximal group of evicted positions with no kept position between them.
inline std::vector<PositionRange> evicted_position_ranges(std::span<const std::int64_t> kept_cells,
                                                          std::span<const std::int32_t> cell_pos) {
  return detail::evicted_position_ranges_impl(kept_cells, cell_pos);
}
/// \overload
inline std::vector<PositionRange> evicted_position_ranges(std::span<const std::int64_t> kept_cells,
                                                          std::span<const std::int64_t> cell_pos) {
  return detail::evicted_position_ranges_impl(kept_cells, cell_pos);
}

/// A slot table split by a keep list (SGLang): `kept` is the new table (kept positions' slots,
/// in position order), `freed` the slots to hand back to the allocator (in position order).
template <class I>
struct SlotPartition {
  std::vector<I> kept;  ///< the slots of the kept positions, in position order
  std::vector<I> freed;  ///< the slots to free, in position order
};

namespace detail {
template <class I>
SlotPartition<I> partition_slots_impl(std::span<const I> slot_table, std::span<const std::int64_t> kept) {
  require_ascending(kept, std::int64_t(slot_table.size()), "kvscore::partition_slots");
  SlotPartition<I> out;
  out.kept.reserve(kept.size());
  out.freed.reserve(slot_table.size() - kept.size());
  std::size_t k = 0;
  for (std::size_t t = 0; t < slot_table.size(); ++t) {
    if (k < kept.size() && kept[k] == std::int64_t(t)) {
      out.kept.push_back(slot_table[t]);
      ++k;
    } else {
      out.freed.push_back(slot_table[t]);
    }
  }
  return out;
}
}  // namespace detail

/// `slot_table[t]` = slot of position t of the request (SGLang req_to_token row, length = tokens);
/// `kept` strictly ascending positions (a sequence-level keep list: union_heads()).
inline SlotPartition<std::int32_t> partition_slots(std::span<const std::int32_t> slot_table,
                                                   std::span<const std::int64_t> kept) {
  return detail::partition_slots_impl(slot_table, kept);
}
/// \overload
inline SlotPartition<std::int64_t> partition_slots(std::span<const std::int64_t> slot_table,
                                                   std::span<const std::int64_t> kept) {
  return detail::partition_slots_impl(slot_table, kept);
}

}  // namespace kvscore
