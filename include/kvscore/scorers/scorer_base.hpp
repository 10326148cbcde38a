// kvscore/scorers/scorer_base.hpp — what every scorer shares: the call shape,
// shape checks, the parallel loop over heads, and the treatment of invalid rows.
//
// Invalid rows: a key whose fp32 squared norm is not finite (a NaN or Inf element,
// or a magnitude above ~1.8e19) scores -inf — ranked below every finite key — and is
// left out of every centroid. A NaN score is never produced.
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/core/parallel.hpp"
#include "kvscore/core/scorer_options.hpp"
#include "kvscore/simd/dispatch.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// The score of an invalid key (a non-finite value anywhere in it): below every finite score, so it is evicted
/// first.
inline constexpr float kInvalidScore = -std::numeric_limits<float>::infinity();

namespace detail {

/// Tokens per chunk of the second pass: its scratch stays in L1.
inline constexpr std::int64_t kChunkTokens = 512;

template <class View>
void check_scores_shape(const View& keys, const ScoresView& out, const char* who) {
  if (out.heads() != keys.heads() || out.tokens() != keys.tokens())
    throw_invalid(std::string(who) + ": scores shape (" + std::to_string(out.heads()) + ", " +
                  std::to_string(out.tokens()) + ") does not match keys (" + std::to_string(keys.heads()) + ", " +
                  std::to_string(keys.tokens()) + ")");
}

/// f(h) for every head, in parallel (detail::parallel_for: an exception of f is rethrown
/// after the region, never across it).
template <class F>
void for_each_head(std::int64_t heads, int num_threads, F&& f) {
  parallel_for(heads, num_threads, f);
}

inline bool finite(float x) noexcept { return std::isfinite(x); }

/// f(first_row, t0, n, stride) over the part of head h's runs that lies in tokens [b, e).
template <class View, class F>
void for_each_run_in(const View& keys, std::int64_t h, std::int64_t b, std::int64_t e, F&& f) {
  keys.for_each_run(h, [&](const typename View::value_type* first, std::int64_t t0, std::int64_t n,
                           std::int64_t stride) {
    const std::int64_t lo = std::max(b, t0), hi = std::min(e, t0 + n);
    if (lo < hi) f(first + (lo - t0) * stride, lo, hi - lo, stride);
  });
}

}  // namespace detail

/// What a scorer needs from a view of keys: element type, shape, and the runs of rows
/// of each head (KeysView, PagedKeysView, or an engine's own view type).
template <class V>
concept KeyCacheView = CacheShape<V> && requires(const V& v, std::int64_t h) {
  v.for_each_run(h, [](const typename V::value_type*, std::int64_t, std::int64_t, std::int64_t) {});
};

namespace detail {

/// `Scores score(keys)` for a scorer that has `score(keys, ScoresView)`: allocates the
/// [heads][tokens] result and fills it. Derived classes bring it in with a using-declaration.
template <class Derived>
struct AllocatingScore {
  template <KeyCacheView View>
  Scores score(const View& keys) const {
    Scores s(keys.heads(), keys.tokens());
    static_cast<const Derived&>(*this).score(keys, s.view());
    return s;
  }
};

/// The constructor checks of a query-window scorer (SnapKV, ProtoKV): queries [q_heads][window]
/// [head_dim] fp32, `group` 0 (derived from the keys) or a divisor of q_heads. `cls` names the
/// class ("kvscore::SnapKV"). Returns q_heads·window·head_dim; the caller checks the values
/// (each names a non-finite one in its own loop).
inline std::int64_t check_query_window(const char* cls, const float* queries, std::int64_t q_heads, std::int64_t window,
                                       std::int64_t head_dim, std::int64_t group) {
  const std::string who = std::string(cls) + ": ";
  if (q_heads <= 0) throw_invalid(who + "q_heads must be > 0 (got " + std::to_string(q_heads) + ")");
  if (window <= 0) throw_invalid(who + "window must be > 0 (got " + std::to_string(window) + ")");
  if (head_dim <= 0 || head_dim > kMaxHeadDim)
    throw_invalid(who + "head_dim must be in [1, " + std::to_string(kMaxHeadDim) + "] (got " + std::to_string(head_dim) +
                  ")");
  if (group < 0 || (group > 0 && q_heads % group != 0))
    throw_invalid(who + "group " + std::to_string(group) + " must be >= 0 and divide q_heads " + std::to_string(q_heads) +
                  " (0 = q_heads / kv_heads of the keys)");
  if (queries == nullptr) throw_invalid(who + "queries is null");
  return checked_mul(checked_mul(q_heads, window, cls), head_dim, cls);
}

/// check_query_window, then the queries copied into `copy` and q/√d rounded once to fp32 into
/// `scaled` (what the scores are computed from); a non-finite value is named by its place.
inline void copy_query_window(const char* cls, const float* queries, std::int64_t q_heads, std::int64_t window,
                              std::int64_t head_dim, std::int64_t group, std::vector<float>& copy,
                              std::vector<float>& scaled) {
  const std::int64_t total = check_query_window(cls, queries, q_heads, window, head_dim, group);
  copy.assign(queries, queries + total);
  scaled.resize(std::size_t(total));
  const double inv_sqrt_d = 1.0 / std::sqrt(double(head_dim));
  for (std::int64_t k = 0; k < total; ++k) {
    const float x = copy[std::size_t(k)];
    if (!std::isfinite(x))
      throw_invalid(std::string(cls) + ": query value " + std::to_string(x) + " at [head " +
                    std::to_string(k / (window * head_dim)) + ", query " + std::to_string((k / head_dim) % window) +
                    ", dim " + std::to_string(k % head_dim) + "] is not finite");
    scaled[std::size_t(k)] = float(double(x) * inv_sqrt_d);
  }
}

/// A query-window scorer's queries against the keys it scores: q_heads a multiple of the
/// keys' heads, the group (if given) q_heads / kv_heads, the same head_dim. `who` ends in ": ".
inline void check_queries_match_keys(const std::string& who, std::int64_t q_heads, std::int64_t group,
                                     std::int64_t head_dim, std::int64_t kv_heads, std::int64_t key_dim) {
  if (kv_heads <= 0 || q_heads % kv_heads != 0)
    throw_invalid(who + "q_heads " + std::to_string(q_heads) + " is not a multiple of the keys' kv_heads " +
                  std::to_string(kv_heads));
  if (group > 0 && group != q_heads / kv_heads)
    throw_invalid(who + "group " + std::to_string(group) + " does not match q_heads / kv_heads = " +
                  std::to_string(q_heads) + " / " + std::to_string(kv_heads) + " = " +
                  std::to_string(q_heads / kv_heads));
  if (key_dim != head_dim)
    throw_invalid(who + "queries have head_dim " + std::to_string(head_dim) + " but keys have head_dim " +
                  std::to_string(key_dim));
}

}  // namespace detail

/// CRTP base: Derived provides `template <class View> void score_head(const simd::KernelTable&,
/// const View& keys, std::int64_t h, float* out) const` (keys already validated).
template <class Derived>
struct ScorerBase : ScorerOptions, detail::AllocatingScore<Derived> {
  using detail::AllocatingScore<Derived>::score;

  /// Scores `keys` into `out` ([heads][tokens]): checks the shapes and the scorer's parameters, then runs
  /// Derived::score_head per head in parallel (the result does not depend on the thread count).
  template <KeyCacheView View>
  void score(const View& keys, ScoresView out) const {
    const Derived& self = static_cast<const Derived&>(*this);
    detail::check_scores_shape(keys, out, Derived::name);
    self.check(keys);
    if (keys.heads() == 0 || keys.tokens() == 0) return;
    const simd::KernelTable& table = isa != nullptr ? *isa : simd::active_table();
    detail::for_each_head(keys.heads(), num_threads,
                          [&](std::int64_t h) { self.score_head(table, keys, h, out.head(h)); });
  }

  /// Extra validation hook (QFilter checks its filters against the keys).
  template <class View>
  void check(const View&) const {}
};

}  // namespace kvscore
