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
// key window, no sort; kvscore/simd/radix.hpp), 4*N bytes of scratch per thread (AdaKV:
// 8*H*N bytes). Kernels: AVX-512, AVX2 or portable C++, chosen at run time (SelectKernels).
// select_into() writes into caller memory and does not allocate: query
// select_workspace_bytes() and select_total() first. See docs/select.md.
// Errors: std::invalid_argument with a message naming the offending values.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "kvscore/core/parallel.hpp"
#include "kvscore/simd/radix.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// How the budget of a layer is spread over its heads.
enum class Alloc {
  per_head,  ///< every head keeps the same number of tokens
  adakv,     ///< AdaKV: per-head safeguard + one global top-k over all heads (ragged)
};

/// An integer token budget, per head or per layer.
class Budget {
 public:
  enum class Kind { per_head, per_layer };

  /// Each head keeps n tokens (layer budget n * heads).
  static constexpr Budget per_head(std::int64_t n) noexcept { return Budget(Kind::per_head, n); }
  /// The layer keeps `total` tokens over all its heads.
  static constexpr Budget per_layer(std::int64_t total) noexcept { return Budget(Kind::per_layer, total); }

  constexpr Kind kind() const noexcept { return kind_; }
  constexpr std::int64_t count() const noexcept { return count_; }

 private:
  constexpr Budget(Kind k, std::int64_t c) noexcept : kind_(k), count_(c) {}
  Kind kind_;
  std::int64_t count_;
};

/// Options of select(). Every field is validated; a bad value throws std::invalid_argument.
struct SelectOptions {
  std::int64_t sinks = 0;   ///< first positions always kept (attention sinks), >= 0
  std::int64_t recent = 0;  ///< last positions always kept (recent window), >= 0
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
  std::int64_t heads = 0, tokens = 0;
  Alloc alloc = Alloc::per_head;
  std::int64_t per_head = 0;     ///< Alloc::per_head: tokens kept per head
  std::int64_t layer = 0;        ///< total kept (both allocs)
  std::int64_t sink_end = 0;     ///< protected prefix [0, sink_end)
  std::int64_t recent_begin = 0; ///< protected suffix [recent_begin, tokens), recent_begin >= sink_end
  std::int64_t protect = 0;      ///< protected tokens per head
  std::int64_t guaranteed = 0;   ///< AdaKV: max(safeguard, protect) kept per head before the global step
  bool normalize = false;        ///< AdaKV: the global step ranks z-scores
};

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

/// z-normalisation constants of one head over its finite scores: mean and population std
/// from double sums in eight interleaved lanes (lane = position % 8), combined as
/// ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)); std 0 (or no finite score) gives
/// inv_std = 0, i.e. every finite score normalises to 0.
inline void znorm_params(const Passes<float>& P, const float* x, std::int64_t n, double* mean,
                         double* inv_std) noexcept {
  auto combine = [](const double* l) { return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7])); };
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t c = 0;
  P.lane_sums(x, n, false, 0.0, lanes, &c);
  const double mu = c > 0 ? combine(lanes) / double(c) : 0.0;
  double sq[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t c2 = 0;
  P.lane_sums(x, n, true, mu, sq, &c2);
  const double sd = c > 0 ? std::sqrt(combine(sq) / double(c)) : 0.0;
  *mean = mu;
  *inv_std = sd > 0 ? 1.0 / sd : 0.0;
}

/// f(h, tid) for every head on `threads` threads (static schedule; tid indexes the per-thread
/// workspace).
template <class F>
void parallel_heads(std::int64_t heads, int threads, F&& f) {
  kvscore::detail::parallel_for_tid(
      heads, threads, [](int) { return 0; }, [&](int, std::int64_t h, int tid) { f(h, tid); });
}

inline void run_per_head(const Plan& p, const ConstScoresView& in, const SelectOptions& opt, std::uint32_t* const* cand,
                         std::int64_t* offsets, std::int64_t* positions) {
  const Passes<float>& P = passes<float>(opt.kernels);
  const std::int64_t n = p.per_head, N = p.tokens, s0 = p.sink_end, e0 = p.recent_begin;
  for (std::int64_t h = 0; h <= p.heads; ++h) offsets[h] = h * n;
  if (n == 0) return;
  parallel_heads(p.heads, p.threads, [&](std::int64_t h, int tid) {
    const float* x = in.head(h);
    std::int64_t* out = positions + h * n;
    std::int64_t j = 0;
    for (std::int64_t t = 0; t < s0; ++t) out[j++] = t;
    const std::int64_t L = e0 - s0, m = n - p.protect;
    if (m == L) {
      for (std::int64_t t = s0; t < e0; ++t) out[j++] = t;
    } else if (m > 0) {
      const Threshold th = find_threshold(P, x + s0, L, m, cand[tid]);
      j += P.collect(x + s0, L, th, s0, out + j, m);
    }
    for (std::int64_t t = e0; t < N; ++t) out[j++] = t;
  });
}

inline void run_adakv(const Plan& p, const ConstScoresView& in, const SelectOptions& opt, std::byte* ws, std::int64_t* offsets,
                      std::int64_t* positions) {
  const std::int64_t H = p.heads, N = p.tokens, s0 = p.sink_end, e0 = p.recent_begin, L = e0 - s0;
  offsets[0] = 0;
  if (H == 0) return;
  if (p.layer == 0) {
    for (std::int64_t h = 0; h <= H; ++h) offsets[h] = 0;
    return;
  }
  const Passes<float>& PF = passes<float>(opt.kernels);
  const Passes<std::uint32_t>& PZ = passes<std::uint32_t>(opt.kernels);
  const std::size_t cells4 = align64(std::size_t(H) * std::size_t(N) * 4), h8 = align64(std::size_t(H) * 8);
  std::uint32_t* Z = reinterpret_cast<std::uint32_t*>(ws);              // keys of the global step [H][N]
  std::uint32_t* cand = reinterpret_cast<std::uint32_t*>(ws + cells4);  // H*N scratch keys
  std::int64_t* gt = reinterpret_cast<std::int64_t*>(ws + 2 * cells4);
  std::int64_t* eq = reinterpret_cast<std::int64_t*>(ws + 2 * cells4 + h8);
  std::int64_t* quota = reinterpret_cast<std::int64_t*>(ws + 2 * cells4 + 2 * h8);

  // 1. Per head: the safeguard (top max(s,p)-p unprotected tokens by raw score) and the
  //    keys of the global step; protected and safeguarded tokens get kForcedKey, above
  //    every score, so the global top-B keeps them first. Threads use disjoint N-key slices
  //    of `cand` (threads <= heads).
  const std::int64_t ms = p.guaranteed - p.protect;
  parallel_heads(H, p.threads, [&](std::int64_t h, int tid) {
    const float* x = in.head(h);
    std::uint32_t* z = Z + h * N;
    const Threshold th = find_threshold(PF, x + s0, L, ms, cand + std::int64_t(tid) * N);
    double mean = 0, inv = 0;
    if (p.normalize) znorm_params(PF, x, N, &mean, &inv);
    for (std::int64_t t = 0; t < s0; ++t) z[t] = kForcedKey;
    PF.fill(x + s0, L, th, p.normalize, mean, inv, z + s0);
    for (std::int64_t t = e0; t < N; ++t) z[t] = kForcedKey;
  });

  // 2. One global top-B over all heads' keys (the same radix select, on H*N keys).
  const Threshold th = find_threshold(PZ, Z, H * N, p.layer, cand);

  // 3. Per head: keys above the threshold and keys equal to it. Equal keys are kept lower
  //    position first, then lower head (the flat order of Z is head-major, so the quota of
  //    each head is worked out here).
  parallel_heads(H, p.threads, [&](std::int64_t h, int) {
    gt[h] = 0;
    eq[h] = 0;
    PZ.count(Z + h * N, N, th.key, &gt[h], &eq[h]);
  });
  std::int64_t c_eq = 0;
  for (std::int64_t h = 0; h < H; ++h) c_eq += eq[h];
  for (std::int64_t h = 0; h < H; ++h) quota[h] = th.need_eq >= c_eq ? eq[h] : 0;
  if (th.need_eq > 0 && th.need_eq < c_eq) {
    std::uint32_t* tie_count = cand;  // N counters; cand is free again
    std::memset(tie_count, 0, std::size_t(N) * 4);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::uint32_t* z = Z + h * N;
      for (std::int64_t t = 0; t < N; ++t) tie_count[t] += z[t] == th.key;
    }
    std::int64_t cum = 0, T = 0;
    for (; T < N; ++T) {
      if (cum + tie_count[T] >= th.need_eq) break;
      cum += tie_count[T];
    }
    // every equal key before position T is kept; at T, the lowest heads first
    parallel_heads(H, p.threads, [&](std::int64_t h, int) {
      std::int64_t g = 0, e = 0;
      PZ.count(Z + h * N, T, th.key, &g, &e);
      quota[h] = e;
    });
    std::int64_t r = th.need_eq - cum;
    for (std::int64_t h = 0; h < H && r > 0; ++h)
      if (Z[h * N + T] == th.key) {
        ++quota[h];
        --r;
      }
  }

  // 4. Offsets, then every head's positions in parallel.
  for (std::int64_t h = 0; h < H; ++h) offsets[h + 1] = offsets[h] + gt[h] + quota[h];
  parallel_heads(H, p.threads, [&](std::int64_t h, int) {
    PZ.collect(Z + h * N, N, Threshold{th.key, quota[h]}, 0, positions + offsets[h], gt[h] + quota[h]);
  });
}

}  // namespace detail::sel

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

namespace detail::sel {

inline std::int64_t select_into_impl(const ConstScoresView& in, Budget budget, const SelectOptions& opt, void* workspace,
                                     std::size_t workspace_bytes, std::int64_t* offsets_out,
                                     std::int64_t* positions_out, std::size_t positions_capacity) {
  Plan p = make_plan(in.heads(), in.tokens(), budget, opt);
  const std::string who = "kvscore::select_into: ";
  if (workspace == nullptr) workspace_bytes = 0;
  if (workspace_bytes < p.bytes(1))
    throw_invalid(who + "workspace of " + std::to_string(workspace_bytes) + " bytes is smaller than the " +
                  std::to_string(p.bytes(1)) + " bytes needed (see select_workspace_bytes)");
  if (offsets_out == nullptr) throw_invalid(who + "offsets_out is null (needs heads + 1 entries)");
  if (positions_capacity < std::size_t(p.layer))
    throw_invalid(who + "positions capacity " + std::to_string(positions_capacity) + " is smaller than the " +
                  std::to_string(p.layer) + " positions selected (see select_total)");
  if (positions_out == nullptr && p.layer > 0) throw_invalid(who + "positions_out is null");
  p.threads = int(std::min<std::size_t>(std::size_t(p.threads), (workspace_bytes - 64 - p.fixed) / p.per_thread));

  auto* base = static_cast<std::byte*>(workspace);
  base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
  std::byte* fixed = base;
  std::byte* threads = base + p.fixed;
  constexpr int kMaxThreadsOnStack = 256;
  p.threads = std::min(p.threads, kMaxThreadsOnStack);
  std::uint32_t* cand[kMaxThreadsOnStack];
  for (int t = 0; t < p.threads; ++t) cand[t] = reinterpret_cast<std::uint32_t*>(threads + p.per_thread * std::size_t(t));
  if (p.alloc == Alloc::per_head) run_per_head(p, in, opt, cand, offsets_out, positions_out);
  else run_adakv(p, in, opt, fixed, offsets_out, positions_out);
  return p.layer;
}

inline Selection select_impl(const ConstScoresView& in, Budget budget, const SelectOptions& opt) {
  const Plan p = make_plan(in.heads(), in.tokens(), budget, opt);
  const std::size_t bytes = p.bytes(p.threads);
  const auto ws = std::make_unique_for_overwrite<std::byte[]>(bytes);
  Selection s;
  s.heads = in.heads();
  s.tokens = in.tokens();
  s.offsets.assign(std::size_t(in.heads() + 1), 0);
  s.positions.resize(std::size_t(p.layer));
  select_into_impl(in, budget, opt, ws.get(), bytes, s.offsets.data(), s.positions.data(), s.positions.size());
  return s;
}

}  // namespace detail::sel

/// Selects the tokens to keep from scores [heads][tokens] (see the top of this file). A
/// ScoresView or a Scores converts (Scores::view()).
inline Selection select(const ConstScoresView& scores, Budget budget, const SelectOptions& opt = {}) {
  return detail::sel::select_impl(scores, budget, opt);
}
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
inline std::int64_t select_into(const Scores& scores, Budget budget, const SelectOptions& opt, void* workspace,
                                std::size_t workspace_bytes, std::int64_t* offsets_out, std::int64_t* positions_out,
                                std::size_t positions_capacity) {
  return select_into(scores.view(), budget, opt, workspace, workspace_bytes, offsets_out, positions_out,
                     positions_capacity);
}

}  // namespace kvscore
