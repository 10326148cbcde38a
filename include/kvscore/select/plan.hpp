// kvscore/select/plan.hpp — select()'s arguments checked and worked out once: the plan
// (what is kept, from the budget and the protection), its threads and its workspace layout
// (the API is kvscore/select.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kvscore/select/options.hpp"
#include "kvscore/select/radix.hpp"

namespace kvscore {

namespace detail::sel {

inline int default_threads() noexcept {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

constexpr std::size_t align64(std::size_t b) noexcept { return (b + 63) & ~std::size_t(63); }

/// Layers with fewer scores run serially unless num_threads asks for threads explicitly.
inline constexpr std::int64_t kParallelMinScores = std::int64_t(1) << 16;

/// The CPU's plan: the selection plan, its threads and its workspace.
struct Plan : SelectionPlan {
  int threads = 1;               ///< wanted (capped at heads)
  // workspace layout
  std::size_t per_thread = 0, fixed = 0;
  std::size_t bytes(int t) const noexcept { return 64 + fixed + per_thread * std::size_t(t); }
};

inline constexpr const char* kWho = "kvscore::select: ";

}  // namespace detail::sel

inline SelectionPlan plan_selection(std::int64_t heads, std::int64_t tokens, Budget budget, const SelectOptions& opt) {
  using detail::throw_invalid, detail::checked_mul, detail::num;
  const std::string who = detail::sel::kWho;
  if (heads < 0 || tokens < 0)
    throw_invalid(who + "negative shape (" + std::to_string(heads) + ", " + std::to_string(tokens) + ")");
  if (budget.count() < 0)
    throw_invalid(who + "budget must be >= 0 (got " + std::to_string(budget.count()) + ")");
  if (opt.sinks < 0) throw_invalid(who + "sinks must be >= 0 (got " + std::to_string(opt.sinks) + ")");
  if (opt.recent < 0) throw_invalid(who + "recent must be >= 0 (got " + std::to_string(opt.recent) + ")");
  if (!(opt.alpha >= 0.0 && opt.alpha <= 1.0)) throw_invalid(who + "alpha must be in [0, 1] (got " + num(opt.alpha) + ")");
  if (opt.num_threads < 0)
    throw_invalid(who + "num_threads must be >= 0 (got " + std::to_string(opt.num_threads) + ")");
  if (opt.alloc != Alloc::per_head && opt.alloc != Alloc::adakv) throw_invalid(who + "unknown Alloc value");
  if (!select_kernels_supported(opt.kernels))
    throw_invalid(who + "kernels '" + select_kernels_name(opt.kernels) + "' are not supported on this CPU");

  SelectionPlan p;
  p.heads = heads;
  p.tokens = tokens;
  p.alloc = opt.alloc;
  p.normalize = opt.normalize && opt.alloc == Alloc::adakv;
  p.sink_end = std::min(opt.sinks, tokens);
  p.recent_begin = std::max(p.sink_end, tokens - std::min(opt.recent, tokens));
  p.protect = p.sink_end + (tokens - p.recent_begin);
  const std::string prot = "sinks " + std::to_string(opt.sinks) + " and recent " + std::to_string(opt.recent) +
                           " protect " + std::to_string(p.protect) + " tokens per head (clipped to the " +
                           std::to_string(tokens) + " tokens of the cache, overlap counted once)";

  if (budget.kind() == Budget::Kind::per_head && budget.count() > tokens)
    throw_invalid(who + "budget of " + std::to_string(budget.count()) + " tokens per head exceeds the " +
                  std::to_string(tokens) + " tokens of the cache (k > N)");

  if (opt.alloc == Alloc::per_head) {
    std::int64_t n = budget.count();
    if (budget.kind() == Budget::Kind::per_layer) {
      if (heads == 0 ? budget.count() != 0 : budget.count() % heads != 0)
        throw_invalid(who + "per-layer budget " + std::to_string(budget.count()) + " is not a multiple of the " +
                      std::to_string(heads) + " heads (Alloc::per_head keeps the same count in every head; " +
                      "Alloc::adakv allows ragged heads)");
      n = heads == 0 ? 0 : budget.count() / heads;
      if (n > tokens)
        throw_invalid(who + "per-layer budget " + std::to_string(budget.count()) + " = " + std::to_string(n) +
                      " tokens per head exceeds the " + std::to_string(tokens) + " tokens of the cache (k > N)");
    }
    if (p.protect > n)
      throw_invalid(who + prot + ", more than the budget of " + std::to_string(n) + " tokens per head");
    p.per_head = n;
    p.layer = checked_mul(n, heads, "kvscore::select");
  } else {
    const std::int64_t cells = checked_mul(heads, tokens, "kvscore::select");
    const std::int64_t B = budget.kind() == Budget::Kind::per_head ? checked_mul(budget.count(), heads, "kvscore::select")
                                                                   : budget.count();
    if (B > cells)
      throw_invalid(who + "layer budget " + std::to_string(B) + " exceeds heads " + std::to_string(heads) +
                    " x tokens " + std::to_string(tokens) + " = " + std::to_string(cells) + " (k > N)");
    if (heads > 0 && checked_mul(p.protect, heads, "kvscore::select") > B)
      throw_invalid(who + prot + "; " + std::to_string(p.protect) + " x " + std::to_string(heads) + " heads = " +
                    std::to_string(p.protect * heads) + " exceeds the layer budget of " + std::to_string(B));
    p.layer = B;
    if (heads > 0) {
      const auto safeguard = static_cast<std::int64_t>(std::floor(opt.alpha * double(B) / double(heads)));
      p.guaranteed = std::max(std::min(safeguard, tokens), p.protect);
    }
  }

  return p;
}

namespace detail::sel {

inline Plan make_plan(std::int64_t heads, std::int64_t tokens, Budget budget, const SelectOptions& opt) {
  const std::string who = kWho;
  Plan p;
  static_cast<SelectionPlan&>(p) = plan_selection(heads, tokens, budget, opt);
  // Default thread count: small layers stay serial (a parallel region costs more than it saves).
  std::int64_t cells = 0;
  const bool small = !__builtin_mul_overflow(heads, tokens, &cells) && cells < kParallelMinScores;
  const int want = opt.num_threads > 0 ? opt.num_threads : small ? 1 : default_threads();
  p.threads = int(std::max<std::int64_t>(1, std::min<std::int64_t>(heads, want)));
  // Workspace: 4 bytes per key, sizes checked against overflow.
  auto bytes = [&](std::int64_t a, std::int64_t b, std::int64_t c) {
    std::int64_t r;
    if (__builtin_mul_overflow(a, b, &r) || __builtin_mul_overflow(r, c, &r) || r > (std::int64_t(1) << 62))
      throw_invalid(who + "workspace size overflows (heads " + std::to_string(heads) + ", tokens " +
                    std::to_string(tokens) + ")");
    return align64(std::size_t(r));
  };
  if (p.alloc == Alloc::per_head) {
    p.per_thread = std::max<std::size_t>(bytes(tokens, 1, 4), 64);  // candidate buffer
    p.fixed = 0;
  } else {
    // keys of the global step + scratch keys (per-thread candidate buffers, the global
    // candidate buffer, tie counts) + three per-head counters; threads need nothing more.
    p.per_thread = 64;
    p.fixed = 2 * bytes(heads, tokens, 4) + 3 * bytes(heads, 1, 8);
  }
  return p;
}

}  // namespace detail::sel

}  // namespace kvscore
