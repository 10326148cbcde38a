// kvscore/compact.hpp — apply a Selection to a cache: gather each head's kept rows of K and V
// to the front of that head, in place, preserving their order.
//
// After compact(), row i of head h holds what row sel.head(h)[i] held before, for i < kept(h);
// the rows [kept(h), tokens) are the head's tail: left as they were (CompactTail::keep, the
// default; stale data) or zero-filled (CompactTail::zero). Nothing outside the view is touched
// (a static HF cache's rows past `seq` stay as they are). The new length of each head,
// kept(h), is returned (or written to caller memory).
//
// In place is safe because kept positions ascend: the row written (index i) is never after the
// row read (sel.head(h)[i] >= i), and every row read later lies after every row written so far.
// Overlapping ranges (runs of adjacent rows) are moved with memmove.
//
// Heads may keep different counts. Per layout (docs/reference/compaction.md):
//   HF [batch, kv_heads, seq, head_dim]: each head's rows are contiguous; head h is valid up to
//     kept(h). An engine with one sequence length (HF DynamicCache) needs equal counts, or
//     max(kept) plus a per-head attention mask over the tails.
//   token-major [tokens, kv_heads, head_dim]: rows of all heads are interleaved per token, so a
//     token row t < max(kept) can hold valid rows for some heads and tail rows for others. Same
//     rule: per-head lengths are returned; an engine that has one length per sequence must use
//     equal counts (Budget::per_head, or `require_equal_lengths` to enforce it), or mask the tails.
//     Zero-filled tails are not a mask: a zero key still gets logit 0 and takes softmax mass.
//   paged (MutPagedKeysView): the sequence's logical rows are compacted; blocks past
//     blocks_for(max(kept), block_size) can then be freed. The blocks must be distinct and not
//     shared with another sequence (prefix caching): see docs/reference/paged.md.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/detail/selection_check.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/paged.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// A writable cache view compact() accepts: shape, and a writable row pointer per (head, token),
/// distinct tokens of a head at disjoint memory. MutKeysView and MutPagedKeysView model it.
template <class C>
concept MutableCacheView = CacheShape<C> && requires(const C& c, std::int64_t i) {
  { c.row(i, i) } -> std::same_as<typename C::value_type*>;
};

/// What happens to the rows [kept(h), tokens) of each head.
enum class CompactTail {
  keep,  ///< left as they were (stale rows; the cheapest)
  zero,  ///< zero-filled (+0.0 in every dtype)
};

/// Options of compact(). Every field is validated; a bad value throws std::invalid_argument.
struct CompactOptions {
  CompactTail tail = CompactTail::keep;  ///< rows past each head's kept count: kept as they were, or zero-filled
  /// Throw std::invalid_argument (before touching the cache) if heads keep different counts:
  /// for engines with one length per sequence (token-major slot caches, vLLM, HF DynamicCache).
  bool require_equal_lengths = false;
  /// Threads over heads (OpenMP); 0 = OpenMP's default for caches of at least 1 MiB and serial
  /// below (thread start-up costs more than it saves there), 1 = serial. Results do not depend on it.
  int num_threads = 0;
};

namespace detail {

template <class C>
bool rows_contiguous(const C&) noexcept { return false; }
/// Rows of one head are adjacent (HF layout): runs of kept rows move with one memmove.
template <class T>
bool rows_contiguous(const MutKeysView<T>& v) noexcept {
  return v.token_stride() == v.head_dim() || v.tokens() <= 1;
}

template <class C>
void check_compactable(const C&, const char*) {}
template <class T>
void check_compactable(const MutPagedKeysView<T>& v, const char* who) {
  const std::int64_t i = v.table().first_repeated_block();
  if (i >= 0)
    throw_invalid(std::string(who) + ": block_table[" + std::to_string(i) + "] = " +
                  std::to_string(v.table().block(i)) +
                  " repeats an earlier block of the sequence; compacting in place needs distinct blocks");
}

/// Gathers rows keep[0..n) of head h to rows [0, n), then handles the tail.
template <class C>
void compact_head(const C& c, std::int64_t h, std::span<const std::int64_t> keep, CompactTail tail,
                  bool contiguous) noexcept {
  using T = typename C::value_type;
  const std::int64_t n = std::int64_t(keep.size()), tokens = c.tokens();
  const std::size_t row_bytes = std::size_t(c.head_dim()) * sizeof(T);
  std::int64_t i = 0;
  while (i < n && keep[std::size_t(i)] == i) ++i;  // rows already in place
  // From here keep[i] > i for every i: source and destination rows differ.
  if (contiguous) {
    while (i < n) {  // maximal runs of adjacent kept rows; source and destination may overlap
      std::int64_t j = i + 1;
      while (j < n && keep[std::size_t(j)] == keep[std::size_t(j - 1)] + 1) ++j;
      std::memmove(c.row(h, i), c.row(h, keep[std::size_t(i)]), std::size_t(j - i) * row_bytes);
      i = j;
    }
  } else {
    for (; i < n; ++i) std::memcpy(c.row(h, i), c.row(h, keep[std::size_t(i)]), row_bytes);
  }
  if (tail == CompactTail::zero && n < tokens) {
    if (contiguous) {
      std::memset(static_cast<void*>(c.row(h, n)), 0, std::size_t(tokens - n) * row_bytes);
    } else {
      for (std::int64_t t = n; t < tokens; ++t) std::memset(static_cast<void*>(c.row(h, t)), 0, row_bytes);
    }
  }
}

template <class C>
void check_lengths(const C& cache, const Selection& sel, std::span<std::int64_t> new_lengths,
                   const CompactOptions& opts, const char* who) {
  if (std::int64_t(new_lengths.size()) != cache.heads())
    throw_invalid(std::string(who) + ": new_lengths has " + std::to_string(new_lengths.size()) +
                  " entries, expected one per head (" + std::to_string(cache.heads()) + ")");
  if (opts.require_equal_lengths)
    for (std::int64_t h = 1; h < sel.heads; ++h)
      if (sel.kept(h) != sel.kept(0))
        throw_invalid(std::string(who) + ": require_equal_lengths, but head " + std::to_string(h) + " keeps " +
                      std::to_string(sel.kept(h)) + " rows and head 0 keeps " + std::to_string(sel.kept(0)));
}

template <class C>
void compact_unchecked(const C& cache, const Selection& sel, const CompactOptions& opts) {
  if (cache.heads() == 0 || cache.tokens() == 0) return;
  const bool contiguous = rows_contiguous(cache);
  constexpr std::int64_t kParallelMinBytes = std::int64_t(1) << 20;
  const double bytes = double(cache.heads()) * double(cache.tokens()) * double(cache.head_dim()) *
                       double(sizeof(typename C::value_type));
  const int threads = (opts.num_threads == 0 && bytes < double(kParallelMinBytes)) ? 1 : opts.num_threads;
  parallel_for(cache.heads(), threads, [&](std::int64_t h) {
    compact_head(cache, h, sel.head(h), opts.tail, contiguous);
  });
}

}  // namespace detail

/// Compacts one cache tensor (K or V) in place; writes kept(h) to new_lengths[h] (one entry per head).
/// Throws std::invalid_argument, before writing anything, if the selection does not fit the view.
template <MutableCacheView C>
void compact(const C& cache, const Selection& sel, std::span<std::int64_t> new_lengths,
             const CompactOptions& opts = {}) {
  constexpr const char* who = "kvscore::compact";
  detail::require_valid_selection(sel, cache.heads(), cache.tokens(), who);
  detail::check_lengths(cache, sel, new_lengths, opts, who);
  detail::check_compactable(cache, who);
  detail::compact_unchecked(cache, sel, opts);
  for (std::int64_t h = 0; h < sel.heads; ++h) new_lengths[std::size_t(h)] = sel.kept(h);
}

/// Compacts one cache tensor in place; returns the new length of each head.
template <MutableCacheView C>
std::vector<std::int64_t> compact(const C& cache, const Selection& sel, const CompactOptions& opts = {}) {
  std::vector<std::int64_t> lengths(std::size_t(std::max<std::int64_t>(cache.heads(), 0)));
  compact(cache, sel, std::span<std::int64_t>(lengths), opts);
  return lengths;
}

/// Compacts K and V of the same cache with one selection (their head_dim may differ; heads and
/// tokens must agree). Everything is validated before either tensor is written.
template <MutableCacheView K, MutableCacheView V>
void compact(const K& keys, const V& values, const Selection& sel, std::span<std::int64_t> new_lengths,
             const CompactOptions& opts = {}) {
  constexpr const char* who = "kvscore::compact";
  if (keys.heads() != values.heads() || keys.tokens() != values.tokens())
    detail::throw_invalid(std::string(who) + ": keys (" + std::to_string(keys.heads()) + " heads, " +
                          std::to_string(keys.tokens()) + " tokens) and values (" + std::to_string(values.heads()) +
                          " heads, " + std::to_string(values.tokens()) + " tokens) differ");
  if (keys.heads() > 0 && keys.tokens() > 0 &&
      static_cast<const void*>(keys.row(0, 0)) == static_cast<const void*>(values.row(0, 0)))
    detail::throw_invalid(std::string(who) + ": keys and values are the same memory");
  detail::require_valid_selection(sel, keys.heads(), keys.tokens(), who);
  detail::check_lengths(keys, sel, new_lengths, opts, who);
  detail::check_compactable(keys, who);
  detail::check_compactable(values, who);
  detail::compact_unchecked(keys, sel, opts);
  detail::compact_unchecked(values, sel, opts);
  for (std::int64_t h = 0; h < sel.heads; ++h) new_lengths[std::size_t(h)] = sel.kept(h);
}

/// Compacts K and V in place; returns the new length of each head.
template <MutableCacheView K, MutableCacheView V>
std::vector<std::int64_t> compact(const K& keys, const V& values, const Selection& sel,
                                  const CompactOptions& opts = {}) {
  std::vector<std::int64_t> lengths(std::size_t(std::max<std::int64_t>(keys.heads(), 0)));
  compact(keys, values, sel, std::span<std::int64_t>(lengths), opts);
  return lengths;
}

}  // namespace kvscore
