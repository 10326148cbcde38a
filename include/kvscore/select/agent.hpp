// kvscore/select/agent.hpp — select()'s work on a plan: the per-head and AdaKV runs over the
// radix passes, in the caller's workspace (internal; the API is kvscore/select.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "kvscore/core/parallel.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/select/plan.hpp"
#include "kvscore/select/radix.hpp"

namespace kvscore::detail::sel {

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

/// Runs plan `p` (made for these scores and `opt`) in the caller's workspace: the checks of
/// select_into's buffers, then the per-head or AdaKV run.
inline std::int64_t run_plan(Plan p, const ConstScoresView& in, const SelectOptions& opt, void* workspace,
                             std::size_t workspace_bytes, std::int64_t* offsets_out, std::int64_t* positions_out,
                             std::size_t positions_capacity) {
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

/// select(): the plan made once, the workspace it needs, then run_plan.
inline Selection select_impl(const ConstScoresView& in, Budget budget, const SelectOptions& opt) {
  const Plan p = make_plan(in.heads(), in.tokens(), budget, opt);
  const std::size_t bytes = p.bytes(p.threads);
  const auto ws = std::make_unique_for_overwrite<std::byte[]>(bytes);
  Selection s;
  s.heads = in.heads();
  s.tokens = in.tokens();
  s.offsets.assign(std::size_t(in.heads() + 1), 0);
  s.positions.resize(std::size_t(p.layer));
  run_plan(p, in, opt, ws.get(), bytes, s.offsets.data(), s.positions.data(), s.positions.size());
  return s;
}

inline std::int64_t select_into_impl(const ConstScoresView& in, Budget budget, const SelectOptions& opt, void* workspace,
                                     std::size_t workspace_bytes, std::int64_t* offsets_out,
                                     std::int64_t* positions_out, std::size_t positions_capacity) {
  return run_plan(make_plan(in.heads(), in.tokens(), budget, opt), in, opt, workspace, workspace_bytes, offsets_out,
                  positions_out, positions_capacity);
}

}  // namespace kvscore::detail::sel
