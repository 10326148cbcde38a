// kvscore/cuda/kernels.hpp — the raw entry points of the compiled library kvscore::cuda
// (internal: use kvscore/cuda/scorers.hpp, select.hpp and compact.hpp, which validate every
// argument with the CPU path's own checks before calling these).
//
// Plain C++ (no CUDA headers), so the public headers compile anywhere; the definitions are in
// cuda/src/*.cu. Every function here is asynchronous on `stream` unless it says otherwise, never
// allocates, and throws kvscore::cuda::Error on a CUDA failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvscore/cuda/device.hpp"
#include "kvscore/core/dtype.hpp"

namespace kvscore::cuda::detail {

/// A key tensor in device memory, type-erased (the public views are checked before).
struct KeysArg {
  const void* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t heads = 0, tokens = 0, head_dim = 0, head_stride = 0, token_stride = 0;
};

template <class T>
KeysArg keys_arg(const DeviceKeysView<T>& v) noexcept {
  return {v.data(), dtype_of<T>(), v.heads(), v.tokens(), v.head_dim(), v.head_stride(), v.token_stride()};
}

struct ScoresArg {
  float* data = nullptr;
  std::int64_t heads = 0, tokens = 0, head_stride = 0;
};

inline ScoresArg scores_arg(const DeviceScoresView& s) noexcept {
  return {s.data(), s.heads(), s.tokens(), s.head_stride()};
}

// ---------------------------------------------------------------- geometric scorers

enum class Geometric { knorm, keydiff, l2, qfilter };

/// Workspace of score_geometric; `window` = 0 for one centroid per head (ManifoldL2, KeyDiff);
/// `merge_tail`: WindowTail::merge (a final window shorter than W/2 joins the one before it).
std::size_t geometric_workspace_bytes(Geometric kind, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                      std::int64_t window, bool merge_tail) noexcept;
/// All heads of a layer; `host_filters` [heads][head_dim] (QFilter only) is copied into the workspace.
void score_geometric(Geometric kind, const KeysArg& keys, const ScoresArg& out, std::int64_t window, bool merge_tail,
                     const float* host_filters, Workspace ws, stream_t stream);

// ---------------------------------------------------------------- SnapKV

/// Queries in device memory, [batch][heads][n][head_dim] with element strides (any layout, any
/// of the three dtypes); the last `window` of the n are used. batch x heads query heads in all.
struct QueriesArg {
  const void* data = nullptr;
  dtype type = dtype::f32;
  std::int64_t batch = 1, heads = 0, n = 0, head_dim = 0;
  std::int64_t batch_stride = 0, head_stride = 0, query_stride = 0, dim_stride = 1;
};

/// SnapKV's queries and options: either the host q/√d rounded to fp32 ([q_heads][window][head_dim],
/// as the CPU SnapKV holds them, copied into the workspace) or device queries, scaled on the
/// device the same way (float(double(q) * inv_sqrt_d), the CPU's rounding).
struct SnapKVArg {
  const float* host_scaled = nullptr;
  QueriesArg device;                  ///< used when host_scaled is null
  double inv_sqrt_d = 0;              ///< 1 / sqrt(double(head_dim)), for device queries
  std::int64_t q_heads = 0, window = 0, kernel_size = 1;
  bool after_cache = false;           ///< QueryPlacement::after_cache: no causal window, all pooled
};

std::size_t snapkv_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                   std::int64_t q_heads, std::int64_t window) noexcept;
/// All keys.heads KV heads (batch rows flattened into heads: query head g of KV head h is
/// h * q_heads / keys.heads + g, the same rule per row).
void score_snapkv(const KeysArg& keys, const ScoresArg& out, const SnapKVArg& q, Workspace ws, stream_t stream);

// ---------------------------------------------------------------- top-k and selection

/// Which top-k kernels run. Every path gives the same positions.
enum class TopkPath { automatic, one_cta_per_row, multi_cta_per_row };

/// A validated selection plan (from kvscore::plan_selection, the CPU's own).
struct SelectPlan {
  std::int64_t heads = 0, tokens = 0, score_head_stride = 0;
  /// Independent layers of `heads` rows each (batch rows): rows b*heads .. b*heads+heads-1 of the
  /// scores; offsets and positions are one CSR over all batch x heads rows.
  std::int64_t batch = 1;
  bool adakv = false;
  bool normalize = false;        ///< AdaKV: the global step ranks z-scores (SelectOptions::normalize)
  std::int64_t per_head = 0;     ///< per-head allocation: kept per head
  std::int64_t layer = 0;        ///< total kept
  std::int64_t sink_end = 0, recent_begin = 0, protect = 0;
  std::int64_t guaranteed = 0;   ///< AdaKV: max(safeguard, protect)
  TopkPath path = TopkPath::automatic;
};

std::size_t select_workspace_bytes(const SelectPlan& p) noexcept;
/// Writes offsets[batch * heads + 1] and positions[batch * layer] (device memory, CSR, ascending per head).
void select_into(const float* scores, const SelectPlan& p, Workspace ws, std::int64_t* offsets,
                 std::int64_t* positions, stream_t stream);

// ---------------------------------------------------------------- compaction

/// In-place gather of every head's kept rows (CSR offsets/positions in device memory, kept
/// positions ascending and < tokens, as select_into writes them); tails zeroed if `zero_tail`.
void compact(void* data, dtype type, std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
             std::int64_t head_stride, std::int64_t token_stride, const std::int64_t* offsets,
             const std::int64_t* positions, bool zero_tail, stream_t stream);

/// Checks a device CSR selection with the CPU compact()'s rules and messages (offsets from 0,
/// non-decreasing, offsets[heads] == positions_size, no head keeping more than `tokens`; each
/// head's positions strictly ascending in [0, tokens)): the offsets are read back, the positions
/// checked by a kernel on `stream`, which is then synchronised; std::invalid_argument names the
/// first offending entry. Returns the offsets read back.
std::size_t selection_check_workspace_bytes() noexcept;
std::vector<std::int64_t> check_selection(std::int64_t heads, std::int64_t tokens, const std::int64_t* offsets,
                                          const std::int64_t* positions, std::int64_t positions_size, Workspace ws,
                                          stream_t stream, const char* who);

}  // namespace kvscore::cuda::detail
