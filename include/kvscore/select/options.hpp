// kvscore/select/options.hpp — what kvscore::select takes besides the scores: the budget,
// the options, the kernel set, and the plan every path works out from them (the API is
// kvscore/select.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvscore/core/names.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// Kernel set of kvscore::select (SelectOptions::kernels). `best` picks AVX-512, then AVX2,
/// then portable C++ from CPUID, no wider than a KVSCORE_ISA pin; the others force one set (for tests and comparisons) and
/// throw std::invalid_argument when this CPU cannot run it. Every set gives the same result.
enum class SelectKernels { best, avx512, avx2, portable };

/// How the budget of a layer is spread over its heads.
enum class Alloc {
  per_head,  ///< every head keeps the same number of tokens
  adakv,     ///< AdaKV: per-head safeguard + one global top-k over all heads (ragged)
};

/// Every Alloc, in order (parse_alloc reads these).
inline constexpr Alloc kAllocs[] = {Alloc::per_head, Alloc::adakv};

/// "per_head" or "adakv".
inline const char* to_string(Alloc a) noexcept { return a == Alloc::adakv ? "adakv" : "per_head"; }

/// "per_head" (the CLI: "per-head") or "adakv"; anything else is std::invalid_argument naming it.
inline Alloc parse_alloc(std::string_view s) { return detail::parse_enum(s, kAllocs, "alloc"); }

/// An integer token budget, per head or per layer.
class Budget {
 public:
  /// How the count is meant: tokens per head, or tokens of the whole layer.
  enum class Kind {
    per_head,   ///< Budget::per_head(n): n tokens in each head
    per_layer,  ///< Budget::per_layer(total): total tokens over the layer's heads
  };

  /// Each head keeps n tokens (layer budget n * heads).
  static constexpr Budget per_head(std::int64_t n) noexcept { return Budget(Kind::per_head, n); }
  /// The layer keeps `total` tokens over all its heads.
  static constexpr Budget per_layer(std::int64_t total) noexcept { return Budget(Kind::per_layer, total); }

  constexpr Kind kind() const noexcept { return kind_; }  ///< per head or per layer
  constexpr std::int64_t count() const noexcept { return count_; }  ///< the count: tokens per head, or of the layer

 private:
  constexpr Budget(Kind k, std::int64_t c) noexcept : kind_(k), count_(c) {}
  Kind kind_;
  std::int64_t count_;
};

/// Options of select(). Every field is validated; a bad value throws std::invalid_argument.
struct SelectOptions {
  std::int64_t sinks = 0;   ///< first positions always kept (attention sinks), >= 0
  std::int64_t recent = 0;  ///< last positions always kept (recent window), >= 0
  /// Alloc::per_head (every head keeps its count) or Alloc::adakv (one budget over the layer's heads).
  Alloc alloc = Alloc::per_head;
  double alpha = 0.2;       ///< AdaKV safeguard fraction, in [0, 1] (checked for every alloc)
  bool normalize = false;   ///< AdaKV: z-normalise each head before the global step
  int num_threads = 0;      ///< threads over heads: 0 = OpenMP default, 1 = serial; same result for any value
  SelectKernels kernels = SelectKernels::best;  ///< kernel set (tests, comparisons); same result
};

/// How budget_from_ratio rounds keep_ratio * tokens.
enum class BudgetRounding {
  nearest,  ///< the nearest integer, halves up (default)
  floor,    ///< ⌊keep_ratio · tokens⌋: the papers' M = ⌊(1−ρ)N⌋ and kvpress's compute_n_kept
};

/// Every BudgetRounding, in order (parse_budget_rounding reads these).
inline constexpr BudgetRounding kBudgetRoundings[] = {BudgetRounding::nearest, BudgetRounding::floor};

/// "nearest" or "floor".
inline const char* to_string(BudgetRounding r) noexcept { return r == BudgetRounding::floor ? "floor" : "nearest"; }

/// "nearest" or "floor"; anything else is std::invalid_argument naming it.
inline BudgetRounding parse_budget_rounding(std::string_view s) {
  return detail::parse_enum(s, kBudgetRoundings, "budget rounding");
}

/// Tokens to keep per head for a keep ratio (fraction of the cache kept, = 1 - kvpress's
/// compression ratio): the integer nearest to the double product keep_ratio * tokens (halves
/// round up, std::llround) or, with BudgetRounding::floor, its floor; then at least 1
/// when tokens > 0 and keep_ratio > 0, never more than tokens. keep_ratio must be in [0, 1]
/// (NaN is an error), tokens >= 0. Examples: (10, 0.1) -> 1, (10, 0.01) -> 1, (10, 0.25) -> 3
/// (2.5 rounds up; floor: 2), (10, 0) -> 0, (0, 0.5) -> 0.
inline std::int64_t budget_from_ratio(std::int64_t tokens, double keep_ratio,
                                      BudgetRounding rounding = BudgetRounding::nearest) {
  if (tokens < 0)
    detail::throw_invalid("kvscore::budget_from_ratio: tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  if (!(keep_ratio >= 0.0 && keep_ratio <= 1.0))
    detail::throw_invalid("kvscore::budget_from_ratio: keep_ratio must be in [0, 1] (got " + detail::num(keep_ratio) +
                          ")");
  if (tokens == 0 || keep_ratio == 0.0) return 0;
  const double x = keep_ratio * double(tokens);
  const std::int64_t n = rounding == BudgetRounding::floor ? std::int64_t(std::floor(x))
                                                           : std::llround(x);  // nearest, halves away from 0
  return std::clamp<std::int64_t>(n, 1, tokens);
}

/// What select() keeps, worked out from its arguments and validated: the one plan of every
/// path, the CPU's and the GPU's (kvscore/cuda/select.hpp). plan_selection() throws
/// std::invalid_argument for the arguments select() rejects, with the same message.
struct SelectionPlan {
  std::int64_t heads = 0;   ///< heads of the scores
  std::int64_t tokens = 0;  ///< tokens of each head
  Alloc alloc = Alloc::per_head;  ///< the allocation of the call
  std::int64_t per_head = 0;     ///< Alloc::per_head: tokens kept per head
  std::int64_t layer = 0;        ///< total kept (both allocs)
  std::int64_t sink_end = 0;     ///< protected prefix [0, sink_end)
  std::int64_t recent_begin = 0; ///< protected suffix [recent_begin, tokens), recent_begin >= sink_end
  std::int64_t protect = 0;      ///< protected tokens per head
  std::int64_t guaranteed = 0;   ///< AdaKV: max(safeguard, protect) kept per head before the global step
  bool normalize = false;        ///< AdaKV: the global step ranks z-scores
};

}  // namespace kvscore
