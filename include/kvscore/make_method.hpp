// kvscore/make_method.hpp — the registry's constructors for every kind of method of
// kvscore/methods.hpp, by any of its spellings:
//
//   make_scorer(name, ScorerArgs)              scorer, query_scorer -> AnyScorer (make_scorer.hpp)
//   make_selection_rule(name, SelectionRuleArgs)  selection_rule   -> StreamingLLM
//   make_retriever<T>(name, head_dim, RetrieverArgs)  retriever     -> ParisKVCache<T> (one KV head)
//   make_hybrid(name, keys, values, HybridArgs)  hybrid             -> HybridBuild (OjaKV: store,
//                                                                      projectors, full-rank tokens)
//
// The evaluator builds every method but its reference (oracle) here, by kind, so a new method
// of an existing kind needs its kMethods entry and one case in its constructor; the
// static_assert at the bottom fails while an entry of kMethods has no constructor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/methods.hpp"
#include "kvscore/ojakv/ojakv.hpp"
#include "kvscore/pariskv/cache.hpp"
#include "kvscore/make_scorer.hpp"
#include "kvscore/select.hpp"
#include "kvscore/streaming_llm.hpp"

namespace kvscore {

namespace detail {
[[noreturn]] inline void wrong_kind(const char* who, std::string_view spelling, const MethodInfo& m, MethodKind want) {
  throw std::invalid_argument(std::string("kvscore::") + who + ": method '" + std::string(spelling) + "' is a " +
                              std::string(kind_name(m.kind)) + ", not a " + std::string(kind_name(want)) + " (" +
                              std::string(kind_name(want)) + "s: " +
                              method_list([want](const MethodInfo& x) { return x.kind == want; }) + ")");
}
}  // namespace detail

// ------------------------------------------------------------------ selection rules

/// The arguments of make_selection_rule().
struct SelectionRuleArgs {
  std::int64_t sinks = kDefaultSinks;  ///< streaming_llm: attention sinks
};

/// True when the selection-rule constructor knows registry name `name` (constexpr: see the
/// static_assert at the bottom).
constexpr bool builds_selection_rule(std::string_view name) noexcept { return name == "streaming_llm"; }

/// The selection rule a registry spelling names (streaming_llm); std::invalid_argument for another kind or an
/// unknown name.
inline StreamingLLM make_selection_rule(std::string_view spelling, const SelectionRuleArgs& a = {}) {
  const MethodInfo& m = method_info(spelling);
  if (!builds_selection_rule(m.name))
    detail::wrong_kind("make_selection_rule", spelling, m, MethodKind::selection_rule);
  return StreamingLLM{a.sinks};
}

// ------------------------------------------------------------------ retrievers

/// The zones of a ParisKV retriever with a fixed budget of n positions per query: S = min(4, n)
/// sinks, a local window of L = min(256, (n − S)/2), and n − S − L retrieved (kDefaultSinks,
/// kDefaultParisKVLocal).
struct ParisKVZones {
  std::int64_t sinks = 0;  ///< sinks kept per query
  std::int64_t local = 0;  ///< local window per query
};
/// The zones for a budget of n positions per query (see ParisKVZones).
inline ParisKVZones pariskv_zones(std::int64_t n) noexcept {
  ParisKVZones z;
  z.sinks = std::min(kDefaultSinks, n);
  z.local = std::min(kDefaultParisKVLocal, (n - z.sinks) / 2);
  return z;
}

/// The arguments of make_retriever().
struct RetrieverArgs {
  /// Positions each query attends. 0: the decode-time defaults (ParisKVCacheConfig{}: S = 4,
  /// L = 256, U = 128, k = 100, dense while short). n > 0: exactly min(n, cache) positions per
  /// query, never dense, every token beyond the local window indexed at once (U = 1):
  /// `pariskv` splits n by pariskv_zones(n), `pariskv_flat` retrieves all n (no zones).
  std::int64_t budget = 0;
  ParisKVConfig index{};    ///< the index (m, seed, centring)
  ParisKVSearch search{};   ///< β, ρ, exact rerank (k comes from the budget when budget > 0)
};

/// True when the retriever constructor knows registry name `name`.
constexpr bool builds_retriever(std::string_view name) noexcept { return name == "pariskv" || name == "pariskv_flat"; }

/// The configuration make_retriever gives ParisKVCache for a registry name and arguments.
inline ParisKVCacheConfig retriever_config(std::string_view spelling, const RetrieverArgs& a) {
  const MethodInfo& m = method_info(spelling);
  if (!builds_retriever(m.name)) detail::wrong_kind("make_retriever", spelling, m, MethodKind::retriever);
  if (a.budget < 0)
    throw std::invalid_argument("kvscore::make_retriever: budget must be >= 0 (got " + std::to_string(a.budget) + ")");
  ParisKVCacheConfig c;
  c.index = a.index;
  c.search = a.search;
  const bool flat = m.name == "pariskv_flat";
  if (flat) c.sinks = c.local = 0;
  if (a.budget > 0) {
    const ParisKVZones z = flat ? ParisKVZones{} : pariskv_zones(a.budget);
    c.sinks = z.sinks;
    c.local = z.local;
    c.search.k = a.budget - z.sinks - z.local;
    c.update_interval = 1;
    c.dense_fallback = false;
  } else if (flat) {
    c.update_interval = 1;  // the whole cache is the retrieval zone
    c.dense_fallback = false;
  }
  return c;
}

/// One KV head's retriever (the Retriever contract): append keys and values, then select(q) or
/// attend(q, out, ws) per query.
template <class T>
ParisKVCache<T> make_retriever(std::string_view spelling, std::int64_t head_dim, const RetrieverArgs& a = {}) {
  return ParisKVCache<T>(head_dim, retriever_config(spelling, a));
}

// ------------------------------------------------------------------ hybrid stores

/// The arguments of make_hybrid().
struct HybridArgs {
  std::int64_t budget = 0;  ///< full-rank tokens per head (n), >= 0
  std::int64_t rank = 0;    ///< key and value basis rank; 0 = max(1, head_dim / 4)
  std::uint64_t seed = 0;   ///< head h's projector starts from seed + h (OjaProjector::random)
  /// The residual rule's window: [q_heads][n_queries][head_dim] fp32 (GQA groups contiguous).
  const float* queries = nullptr;
  std::int64_t q_heads = 0;    ///< query heads of `queries`
  std::int64_t n_queries = 0;  ///< queries per head of `queries`
  QueryPlacement placement = QueryPlacement::in_cache;  ///< where the window queries sit relative to the cache
  int threads = 0;  ///< threads (0 = OpenMP's default); the result is the same for any value
  /// Protection and allocation of the full-rank selection. The in-cache window is not added
  /// to `recent` here: set it when the window's tokens must stay full rank.
  SelectOptions select{};
};

/// A hybrid method built on one layer: the store, the projectors its decode-time append
/// adapts, and the tokens kept at full rank.
struct HybridBuild {
  std::vector<OjaProjector> projectors;  ///< one per KV head, for OjaHybridCache::append
  Selection full_rank;  ///< the tokens each head keeps at full rank
  OjaHybridCache cache;  ///< the store: full-rank tokens and codes
};

/// True when the hybrid constructor knows registry name `name`.
constexpr bool builds_hybrid(std::string_view name) noexcept { return name == "ojakv"; }

/// OjaKV on a layer: per KV head a projector (seeded random start, prefill on the keys and
/// values), the `budget` tokens of largest query-weighted residual kept at full rank through
/// the selector, every other token as codes in the bases.
template <class KView, class VView>
HybridBuild make_hybrid(std::string_view spelling, const KView& keys, const VView& values, const HybridArgs& a) {
  const MethodInfo& m = method_info(spelling);
  if (!builds_hybrid(m.name)) detail::wrong_kind("make_hybrid", spelling, m, MethodKind::hybrid);
  if (a.queries == nullptr)
    throw std::invalid_argument("kvscore::make_hybrid: method 'ojakv' needs queries (HybridArgs::queries is null)");
  const std::int64_t H = keys.heads(), d = keys.head_dim();
  const std::int64_t r = a.rank > 0 ? a.rank : std::max<std::int64_t>(1, d / 4);
  HybridBuild b;
  std::vector<Eigen::MatrixXd> bases;
  b.projectors.reserve(std::size_t(H));
  for (std::int64_t h = 0; h < H; ++h) {
    b.projectors.push_back(OjaProjector::random(d, r, r, a.seed + std::uint64_t(h)));
    b.projectors.back().prefill(keys, values, h);
    bases.push_back(b.projectors.back().key().basis());
  }
  OjaResidual res(a.queries, a.q_heads, a.n_queries, d, std::move(bases));
  res.num_threads = a.threads;
  res.placement = a.placement;
  b.full_rank = kvscore::select(res.score(keys), Budget::per_head(a.budget), a.select);
  b.cache = OjaHybridCache::build(b.projectors, keys, values, b.full_rank);
  return b;
}

// ------------------------------------------------------------------ the registry is complete

namespace detail {
constexpr bool every_method_has_a_constructor() {
  for (const MethodInfo& m : kMethods) {
    const bool ok = m.kind == MethodKind::reference ||  // the evaluator's own ceiling, not built here
                    is_scorer(m) ||  // make_scorer.hpp ties its scorers to kMethods with its own static_assert
                    (m.kind == MethodKind::selection_rule && builds_selection_rule(m.name)) ||
                    (m.kind == MethodKind::retriever && builds_retriever(m.name)) ||
                    (m.kind == MethodKind::hybrid && builds_hybrid(m.name));
    if (!ok) return false;
  }
  return true;
}
static_assert(every_method_has_a_constructor(),
              "an entry of kMethods has no constructor in kvscore/make_method.hpp (or is of another kind)");
}  // namespace detail

}  // namespace kvscore
