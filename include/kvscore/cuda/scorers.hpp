// kvscore/cuda/scorers.hpp — the CPU scorer policies (KNorm, KeyDiff, ManifoldL2,
// WindowedManifoldL2, QFilter, SnapKV) run on device memory, all heads of a layer per call;
// DeviceSnapKV takes SnapKV's window queries from device memory.
//
//   kvscore::ManifoldL2 l2;
//   auto keys = kvscore::cuda::DeviceKeysView<kvscore::half>::hf(d_layer, 0, 1, 8, n, 128);
//   kvscore::cuda::DeviceBuffer ws(kvscore::cuda::score_workspace_bytes(l2, keys));   // once
//   kvscore::cuda::score(l2, keys, kvscore::cuda::DeviceScoresView(d_scores, 8, n), {ws.get(), ws.bytes()}, stream);
//
// Same formulas, validity rule (-inf for keys with a non-finite squared norm), window rule and
// argument checks as the CPU path (the policy's own check() runs first; std::invalid_argument).
// fp32 scores, fp32 row accumulation, fp64 centroids / softmax sums; bit-identical across runs.
// Asynchronous on `stream`; no allocation: query the workspace once (0 bytes for KNorm).
// Needs the compiled library kvscore::cuda (CMake -DKVSCORE_CUDA=ON). See docs/reference/cuda.md.
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include <vector>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"
#include "kvscore/scorers/keydiff.hpp"
#include "kvscore/scorers/knorm.hpp"
#include "kvscore/scorers/manifold_l2.hpp"
#include "kvscore/scorers/qfilter.hpp"
#include "kvscore/scorers/snapkv.hpp"
#include "kvscore/scorers/windowed_manifold_l2.hpp"

namespace kvscore::cuda {

namespace detail {

template <class T>
void check_scores(const DeviceKeysView<T>& keys, const DeviceScoresView& out, const char* who) {
  if (out.heads() != keys.heads() || out.tokens() != keys.tokens())
    kvscore::detail::throw_invalid(std::string(who) + ": scores shape (" + std::to_string(out.heads()) + ", " +
                                   std::to_string(out.tokens()) + ") does not match keys (" +
                                   std::to_string(keys.heads()) + ", " + std::to_string(keys.tokens()) + ")");
}

inline std::int64_t window_of(const KNorm&) noexcept { return 0; }
inline std::int64_t window_of(const KeyDiff&) noexcept { return 0; }
inline std::int64_t window_of(const ManifoldL2&) noexcept { return 0; }
inline std::int64_t window_of(const WindowedManifoldL2& s) noexcept { return s.window; }
inline std::int64_t window_of(const QFilter&) noexcept { return 0; }
template <class S>
bool merge_tail_of(const S&) noexcept { return false; }
inline bool merge_tail_of(const WindowedManifoldL2& s) noexcept { return s.tail == WindowTail::merge; }
inline Geometric kind_of(const KNorm&) noexcept { return Geometric::knorm; }
inline Geometric kind_of(const KeyDiff&) noexcept { return Geometric::keydiff; }
inline Geometric kind_of(const ManifoldL2&) noexcept { return Geometric::l2; }
inline Geometric kind_of(const WindowedManifoldL2&) noexcept { return Geometric::l2; }
inline Geometric kind_of(const QFilter&) noexcept { return Geometric::qfilter; }
inline const float* filters_of(const QFilter& s) noexcept { return s.filters().data(); }
template <class S>
const float* filters_of(const S&) noexcept { return nullptr; }

template <class S>
concept GeometricScorer = requires(const S& s) { kind_of(s); };

}  // namespace detail

/// Workspace bytes of score(s, keys, ...) (depends on the shape only; 0 for KNorm).
template <detail::GeometricScorer S, class T>
std::size_t score_workspace_bytes(const S& s, const DeviceKeysView<T>& keys) {
  s.check(keys);
  return detail::geometric_workspace_bytes(detail::kind_of(s), keys.heads(), keys.tokens(), keys.head_dim(),
                                           detail::window_of(s), detail::merge_tail_of(s));
}

/// Scores every head of `keys` into `out` (device memory) with the policy `s`.
template <detail::GeometricScorer S, class T>
void score(const S& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  detail::check_scores(keys, out, S::name);
  s.check(keys);
  detail::score_geometric(detail::kind_of(s), detail::keys_arg(keys), detail::scores_arg(out), detail::window_of(s),
                          detail::merge_tail_of(s), detail::filters_of(s), ws, stream);
}

/// Bytes of score()'s device workspace for SnapKV `s` on `keys` (SnapKV's checks first).
template <class T>
std::size_t score_workspace_bytes(const SnapKV& s, const DeviceKeysView<T>& keys) {
  s.check(keys);
  return detail::snapkv_workspace_bytes(keys.heads(), keys.tokens(), keys.head_dim(), s.q_heads(), s.window());
}

/// SnapKV on device keys; the queries (host, held by `s`) are copied into the workspace. Both
/// placements: in_cache (the causal window, the CPU default) and after_cache (no mask, all pooled).
template <class T>
void score(const SnapKV& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  detail::check_scores(keys, out, SnapKV::name);
  s.check(keys);
  // q/√d rounded once, the CPU SnapKV's own (no per-call host pass over the queries).
  detail::SnapKVArg a;
  a.host_scaled = s.scaled_queries().data();
  a.q_heads = s.q_heads();
  a.window = s.window();
  a.kernel_size = s.kernel_size;
  a.after_cache = s.placement == QueryPlacement::after_cache;
  detail::score_snapkv(detail::keys_arg(keys), detail::scores_arg(out), a, ws, stream);
}

/// SnapKV whose window queries are already in device memory (a model's query states on the GPU):
/// the scores of a kvscore::SnapKV built from the same queries on the host, with no copy to the host.
///
///   kc::DeviceSnapKV snap;
///   snap.queries = {d_q, kvscore::dtype::f16, /*batch*/ 1, /*q_heads*/ 32, /*n*/ 64, 128, 0, 64 * 128, 128, 1};
///   kc::score(snap, keys, scores, ws, stream);     // then select with recent = snap.protected_recent()
///
/// `queries` is [batch][q_heads][n][head_dim] with element strides; the last min(window, n) are
/// used, q/√d rounded as the CPU rounds it (on the device). The keys' heads are batch × kv_heads
/// (batch rows flattened; each row's query heads go with that row's KV heads, GQA as the CPU's).
/// Argument checks are SnapKV's (its messages) and run before any CUDA call. Unlike the host
/// constructor, the queries' values are not checked (that would read them back): a non-finite
/// query gives logits the kernels drop (NaN) or clamp (+inf), so check them first if they may be.
struct DeviceSnapKV {
  detail::QueriesArg queries;  ///< [batch][q_heads][n][head_dim] device queries, any dtype and element strides
  std::int64_t window = kDefaultSnapKVWindow;  ///< queries used: the last min(window, n)
  std::int64_t kernel_size = kDefaultSnapKVKernel;  ///< SnapKV's pooling kernel, odd
  QueryPlacement placement = QueryPlacement::in_cache;  ///< in the cache (the causal window, protected) or after it
  std::int64_t group = 0;  ///< q_heads / kv_heads if given (0: from the keys), as SnapKV's

  /// Queries used: the last min(window, n).
  std::int64_t used() const noexcept { return window < queries.n ? window : queries.n; }
  /// SnapKV::protected_recent(): the window in the cache, 0 after it.
  std::int64_t protected_recent() const noexcept { return placement == QueryPlacement::in_cache ? used() : 0; }

  /// SnapKV's argument checks and messages, before any CUDA call; std::invalid_argument.
  template <class T>
  void check(const DeviceKeysView<T>& keys) const {
    const std::string who = "kvscore::SnapKV: ";
    const detail::QueriesArg& q = queries;
    if (window < 1) kvscore::detail::throw_invalid(who + "window must be > 0 (got " + std::to_string(window) + ")");
    if (q.batch < 1) kvscore::detail::throw_invalid(who + "batch must be >= 1 (got " + std::to_string(q.batch) + ")");
    // the host constructor's shape checks (the pointer is only compared with null, never read)
    kvscore::detail::check_query_window("kvscore::SnapKV", static_cast<const float*>(q.data), q.heads, used(),
                                        q.head_dim, group);
    if (q.batch_stride < 0 || q.head_stride < 0 || q.query_stride < 0 || q.dim_stride < 0)
      kvscore::detail::throw_invalid(who + "query strides must be >= 0");
    if (keys.heads() % q.batch != 0)
      kvscore::detail::throw_invalid(who + "keys have " + std::to_string(keys.heads()) + " heads, not a multiple of " +
                                     "the queries' batch " + std::to_string(q.batch));
    kvscore::detail::check_queries_match_keys(who, q.heads, group, q.head_dim, keys.heads() / q.batch,
                                              keys.head_dim());
    if (placement == QueryPlacement::in_cache && used() > keys.tokens())
      kvscore::detail::throw_invalid(who + "window " + std::to_string(used()) + " > tokens " +
                                     std::to_string(keys.tokens()) + " (the window's queries sit at the last " +
                                     std::to_string(used()) + " positions of the cache; pass at most N queries, or "
                                     "set placement = QueryPlacement::after_cache for queries that follow the cache)");
    if (kernel_size < 1 || kernel_size % 2 == 0)
      kvscore::detail::throw_invalid(who + "kernel_size must be odd and >= 1 (got " + std::to_string(kernel_size) +
                                     ")");
  }

};

/// Bytes of score()'s device workspace for DeviceSnapKV `s` on `keys` (its checks first).
template <class T>
std::size_t score_workspace_bytes(const DeviceSnapKV& s, const DeviceKeysView<T>& keys) {
  s.check(keys);
  return detail::snapkv_workspace_bytes(keys.heads(), keys.tokens(), keys.head_dim(),
                                        s.queries.batch * s.queries.heads, s.used());
}

/// SnapKV on device keys with device queries: the scores the host SnapKV gives for the same queries.
template <class T>
void score(const DeviceSnapKV& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  detail::check_scores(keys, out, SnapKV::name);
  s.check(keys);
  detail::SnapKVArg a;
  a.device = s.queries;
  a.inv_sqrt_d = 1.0 / std::sqrt(double(s.queries.head_dim));  // SnapKV's constructor's
  a.q_heads = s.queries.batch * s.queries.heads;
  a.window = s.used();
  a.kernel_size = s.kernel_size;
  a.after_cache = s.placement == QueryPlacement::after_cache;
  detail::score_snapkv(detail::keys_arg(keys), detail::scores_arg(out), a, ws, stream);
}

}  // namespace kvscore::cuda
