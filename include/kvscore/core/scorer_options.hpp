// kvscore/core/scorer_options.hpp — what every scorer takes besides its keys: the execution
// options (threads, kernel table) and, for a query-aware scorer, where its queries sit. Ground
// floor: the method contract (kvscore/contract.hpp), the registry's constructors and the front
// ends read these without including a scorer.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "kvscore/core/names.hpp"

namespace kvscore {

namespace simd {
struct KernelTable;  // kvscore/simd/table.hpp
}

/// Where the window queries of a query-aware scorer (SnapKV, ProtoKV, OjaResidual) sit
/// relative to the keys they score (docs/reference/scorers.md):
///   in_cache     the queries are those of the cache's last `window` positions (prefill
///                compression, kvpress's convention): query i of w sits at position N - w + i and
///                sees t <= N - w + i (causal); the window is protected (`protected_recent()` = w).
///   after_cache  the queries come after every cached token (a decode step, or a dump's held-out
///                queries): every query sees every key, nothing is masked, nothing is protected
///                beyond the caller's own `recent`, and the window may exceed the cache.
enum class QueryPlacement { in_cache, after_cache };

/// Every QueryPlacement, in order (parse_query_placement reads these).
inline constexpr QueryPlacement kQueryPlacements[] = {QueryPlacement::in_cache, QueryPlacement::after_cache};

/// "in_cache" or "after_cache".
inline const char* to_string(QueryPlacement p) noexcept {
  return p == QueryPlacement::in_cache ? "in_cache" : "after_cache";
}

/// "in_cache" / "after_cache" (C++, Python) or "in-cache" / "after-cache" (the CLI's spelling).
inline QueryPlacement parse_query_placement(std::string_view s) {
  return detail::parse_enum(s, kQueryPlacements, "query placement");
}

/// How a scorer of attention received (KVzip) reduces the probabilities a key receives from
/// the queries (and the query heads of its GQA group) to one score:
///   max   the largest probability any query gives it (KVzip: a key matters if one query of the
///         reconstruction needs it);
///   mean  the mean over every query and head of the group (SnapKV's reduction, unpooled).
enum class QueryAggregate { max, mean };

/// Every QueryAggregate, in order (parse_query_aggregate reads these).
inline constexpr QueryAggregate kQueryAggregates[] = {QueryAggregate::max, QueryAggregate::mean};

/// "max" or "mean".
inline const char* to_string(QueryAggregate a) noexcept { return a == QueryAggregate::max ? "max" : "mean"; }

/// "max" or "mean"; anything else is std::invalid_argument naming it.
inline QueryAggregate parse_query_aggregate(std::string_view s) {
  return detail::parse_enum(s, kQueryAggregates, "query aggregate");
}

/// Execution options common to every scorer.
struct ScorerOptions {
  /// Threads over heads; 0 = OpenMP's default, 1 = serial. Results are bit-identical for any value.
  int num_threads = 0;
  /// Kernel table; nullptr = simd::active_table().
  const simd::KernelTable* isa = nullptr;
};

}  // namespace kvscore
