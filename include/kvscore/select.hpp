// kvscore/select.hpp — choose which tokens to keep from fp32 scores [heads][tokens].
//
// [snippet select-header: tests/test_snippets.cpp]
//   kvscore::Selection top = kvscore::select(scores, kvscore::Budget::per_head(n));   // top-n per head
//   kvscore::SelectOptions p;
//   p.sinks = 4, p.recent = 64, p.alloc = kvscore::Alloc::adakv;                      // AdaKV, protected
//   kvscore::Selection ragged = kvscore::select(scores, kvscore::Budget::per_head(n), p);  // ragged heads
//
// Result: kvscore::Selection (CSR), kept positions ascending within each head.
//
// Ranking (one total order, the same on every path, thread count and run):
//   higher score first; equal scores -> lower position first; NaN ranks below every number,
//   -inf included (all NaNs are equal to each other); -0.0 == +0.0. In the AdaKV global step,
//   equal (normalised) scores -> lower position first, then lower head first.
//
// Budgets are integer token counts (see budget_from_ratio for ratios):
//   Budget::per_head(n)       every head keeps n (layer budget n*H for Alloc::adakv)
//   Budget::per_layer(total)  the layer keeps `total`; Alloc::per_head needs total % H == 0
// A budget above what the cache holds (n > tokens) is an error, n == tokens keeps every token,
// n == 0 keeps none (valid only without protection).
//
// Protection is a mask, never a sentinel score: the first `sinks` and the last `recent`
// positions of every head (clipped to the cache; overlap counted once) are always kept and
// count inside the budget. More protected tokens than the budget is an error.
//
// Allocation:
//   Alloc::per_head  each head keeps its protected tokens + its top (n - p) other tokens.
//   Alloc::adakv     (Feng et al. 2025) layer budget B; safeguard s = floor(alpha * B / H)
//                    (double arithmetic, in that order); every head keeps its protected tokens
//                    and its top (max(s, p) - p) unprotected tokens, i.e. protected tokens count
//                    towards the safeguard; the remaining B - H*max(s, p) are filled by one
//                    global top-k over all heads' not-yet-kept tokens. With `normalize`, the
//                    global step ranks z-scores: z = float((double(x) - mean) * (1 / std)),
//                    mean and population std over the head's finite scores (double sums in
//                    8 lanes, lane = position % 8; std 0 -> z = 0); +-inf and NaN pass
//                    through. The safeguard always ranks raw scores.
//
// Complexity: O(H*N) time (radix select on the order-preserving bit pattern after a sampled
// key window, no sort; kvscore/select/radix.hpp), 4*N bytes of scratch per thread (AdaKV:
// 8*H*N bytes). Kernels: AVX-512, AVX2 or portable C++, chosen at run time (SelectKernels).
// select_into() writes into caller memory and does not allocate: query
// select_workspace_bytes() and select_total() first. See docs/reference/select.md.
// Errors: std::invalid_argument with a message naming the offending values.
//
// This header is the API; the work is below it (CUB's layering): select/options.hpp (Budget,
// SelectOptions, SelectionPlan), select/plan.hpp (the checks and the plan), select/agent.hpp
// (the runs on a plan), select/radix.hpp over radix_portable / radix_avx2 / radix_avx512.hpp.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/select/agent.hpp"
#include "kvscore/select/options.hpp"
#include "kvscore/select/plan.hpp"

namespace kvscore {

/// Tokens select() keeps in total for these arguments (validates them like select()).
inline std::int64_t select_total(std::int64_t heads, std::int64_t tokens, Budget budget, const SelectOptions& opt = {}) {
  return detail::sel::make_plan(heads, tokens, budget, opt).layer;
}

/// Bytes of workspace select_into() needs for these arguments with opt.num_threads threads
/// (0: omp_get_max_threads() now). A smaller workspace (at least the 1-thread size) runs on
/// fewer threads, with the same result. Validates the arguments like select().
inline std::size_t select_workspace_bytes(std::int64_t heads, std::int64_t tokens, Budget budget,
                                          const SelectOptions& opt = {}) {
  const detail::sel::Plan p = detail::sel::make_plan(heads, tokens, budget, opt);
  return p.bytes(p.threads);
}

/// Selects the tokens to keep from scores [heads][tokens] (see the top of this file). A
/// ScoresView or a Scores converts (Scores::view()).
inline Selection select(const ConstScoresView& scores, Budget budget, const SelectOptions& opt = {}) {
  return detail::sel::select_impl(scores, budget, opt);
}
/// \overload
inline Selection select(const Scores& scores, Budget budget, const SelectOptions& opt = {}) {
  return select(scores.view(), budget, opt);
}

/// No-allocation form: writes offsets_out[heads + 1] and positions_out[select_total(...)]
/// (CSR, ascending positions per head) using the caller's workspace of
/// select_workspace_bytes(...) bytes (any alignment). Returns the number of positions written.
inline std::int64_t select_into(const ConstScoresView& scores, Budget budget, const SelectOptions& opt, void* workspace,
                                std::size_t workspace_bytes, std::int64_t* offsets_out, std::int64_t* positions_out,
                                std::size_t positions_capacity) {
  return detail::sel::select_into_impl(scores, budget, opt, workspace, workspace_bytes, offsets_out, positions_out,
                                       positions_capacity);
}
/// \overload
inline std::int64_t select_into(const Scores& scores, Budget budget, const SelectOptions& opt, void* workspace,
                                std::size_t workspace_bytes, std::int64_t* offsets_out, std::int64_t* positions_out,
                                std::size_t positions_capacity) {
  return select_into(scores.view(), budget, opt, workspace, workspace_bytes, offsets_out, positions_out,
                     positions_capacity);
}

}  // namespace kvscore
