// kvscore/cuda/scorers.hpp — the CPU scorer policies (KNorm, KeyDiff, ManifoldL2,
// WindowedManifoldL2, QFilter, SnapKV) run on device memory, all heads of a layer per call.
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
// Needs the compiled library kvscore::cuda (CMake -DKVSCORE_CUDA=ON). See docs/cuda.md.
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

/// The GPU SnapKV has the in-cache causal window only.
inline void snapkv_check_placement(const SnapKV& s) {
  if (s.placement != QueryPlacement::in_cache)
    kvscore::detail::throw_invalid("kvscore::cuda::score(SnapKV): placement = QueryPlacement::after_cache runs on "
                                   "the CPU only (the GPU kernel has the in-cache causal window)");
}

template <class T>
std::size_t score_workspace_bytes(const SnapKV& s, const DeviceKeysView<T>& keys) {
  snapkv_check_placement(s);
  s.check(keys);
  return detail::snapkv_workspace_bytes(keys.heads(), keys.tokens(), keys.head_dim(), s.q_heads(), s.window());
}

/// SnapKV on device keys; the queries (host, held by `s`) are copied into the workspace.
template <class T>
void score(const SnapKV& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  detail::check_scores(keys, out, SnapKV::name);
  snapkv_check_placement(s);
  s.check(keys);
  // q/√d rounded once, the CPU SnapKV's own (no per-call host pass over the queries).
  detail::score_snapkv(detail::keys_arg(keys), detail::scores_arg(out), s.scaled_queries().data(), s.q_heads(),
                       s.window(), s.kernel_size, ws, stream);
}

}  // namespace kvscore::cuda
