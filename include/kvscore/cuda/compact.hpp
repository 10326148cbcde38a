// kvscore/cuda/compact.hpp — kvscore::compact on device caches: gather each head's kept rows of
// K (and V) to the front of that head, in place, preserving their order (compact.hpp's rules:
// row i of head h holds what row positions[h][i] held; the tail is kept or zero-filled).
//
// Two forms of the selection:
//  * DeviceSelection — CSR offsets/positions already in device memory, as select_into() writes
//    them. Trusted (positions ascending, distinct and < tokens, as the selector guarantees):
//    they are not read back. require_equal_lengths reads the offsets back (synchronises).
//  * a host kvscore::Selection — validated like the CPU compact(), then copied into the
//    caller's workspace (compact_workspace_bytes) on `stream`.
// No allocation; asynchronous on `stream`. One CTA per head (see docs/reference/cuda.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvscore/compact.hpp"
#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"
#include "kvscore/detail/selection_check.hpp"
#include "kvscore/core/selection.hpp"

namespace kvscore::cuda {

/// A selection in device memory: head h keeps positions[offsets[h] .. offsets[h+1]).
struct DeviceSelection {
  std::int64_t heads = 0;   ///< heads of the scored cache
  std::int64_t tokens = 0;  ///< tokens of the scored cache
  const std::int64_t* offsets = nullptr;    ///< heads + 1 entries (device)
  const std::int64_t* positions = nullptr;  ///< offsets[heads] entries (device)
};

namespace detail {

template <class C>
void check_device_selection(const C& cache, const DeviceSelection& sel, const CompactOptions& opts, const char* who) {
  if (sel.heads != cache.heads() || sel.tokens != cache.tokens())
    kvscore::detail::throw_invalid(std::string(who) + ": selection is for (" + std::to_string(sel.heads) +
                                   " heads, " + std::to_string(sel.tokens) + " tokens) but the cache has (" +
                                   std::to_string(cache.heads()) + " heads, " + std::to_string(cache.tokens()) +
                                   " tokens)");
  if (sel.offsets == nullptr && sel.heads > 0) kvscore::detail::throw_invalid(std::string(who) + ": offsets is null");
  if (opts.tail != CompactTail::keep && opts.tail != CompactTail::zero)
    kvscore::detail::throw_invalid(std::string(who) + ": unknown CompactTail value");
  if (opts.require_equal_lengths && sel.heads > 1) {
    std::vector<std::int64_t> off(std::size_t(sel.heads + 1));
    copy_to_host(off.data(), sel.offsets, off.size() * sizeof(std::int64_t));
    for (std::int64_t h = 1; h < sel.heads; ++h)
      if (off[std::size_t(h + 1)] - off[std::size_t(h)] != off[1] - off[0])
        kvscore::detail::throw_invalid(std::string(who) + ": require_equal_lengths, but head " + std::to_string(h) +
                                       " keeps " + std::to_string(off[std::size_t(h + 1)] - off[std::size_t(h)]) +
                                       " rows and head 0 keeps " + std::to_string(off[1] - off[0]));
  }
}

template <class T>
void compact_raw(const DeviceMutKeysView<T>& c, const DeviceSelection& sel, const CompactOptions& opts,
                 stream_t stream) {
  compact(c.data(), dtype_of<T>(), c.heads(), c.tokens(), c.head_dim(), c.head_stride(), c.token_stride(),
          sel.offsets, sel.positions, opts.tail == CompactTail::zero, stream);
}

}  // namespace detail

/// Compacts one device cache tensor in place with a device selection.
template <class T>
void compact(const DeviceMutKeysView<T>& cache, const DeviceSelection& sel, const CompactOptions& opts = {},
             stream_t stream = nullptr) {
  detail::check_device_selection(cache, sel, opts, "kvscore::cuda::compact");
  detail::compact_raw(cache, sel, opts, stream);
}

/// Compacts K and V (same heads and tokens, different memory) with one device selection.
template <class T, class U>
void compact(const DeviceMutKeysView<T>& keys, const DeviceMutKeysView<U>& values, const DeviceSelection& sel,
             const CompactOptions& opts = {}, stream_t stream = nullptr) {
  constexpr const char* who = "kvscore::cuda::compact";
  if (keys.heads() != values.heads() || keys.tokens() != values.tokens())
    kvscore::detail::throw_invalid(std::string(who) + ": keys (" + std::to_string(keys.heads()) + " heads, " +
                                   std::to_string(keys.tokens()) + " tokens) and values (" +
                                   std::to_string(values.heads()) + " heads, " + std::to_string(values.tokens()) +
                                   " tokens) differ");
  if (keys.heads() > 0 && keys.tokens() > 0 &&
      static_cast<const void*>(keys.data()) == static_cast<const void*>(values.data()))
    kvscore::detail::throw_invalid(std::string(who) + ": keys and values are the same memory");
  detail::check_device_selection(keys, sel, opts, who);
  detail::compact_raw(keys, sel, opts, stream);
  detail::compact_raw(values, sel, opts, stream);
}

/// Bytes of check_selection()'s device workspace.
inline std::size_t selection_check_workspace_bytes() noexcept { return detail::selection_check_workspace_bytes(); }
/// Checks a DeviceSelection from outside kvscore (a caller's tensors, not select_into's output)
/// with the CPU compact()'s rules and messages before it is trusted: offsets read back, positions
/// checked on the device; synchronises `stream`. `positions_size`: the entries the positions
/// buffer holds (offsets[heads] must equal it). Workspace: selection_check_workspace_bytes().
/// Returns the offsets (read back to the host).
inline std::vector<std::int64_t> check_selection(const DeviceSelection& sel, std::int64_t positions_size, Workspace ws,
                                                 stream_t stream = nullptr, const char* who = "kvscore::cuda::compact") {
  return detail::check_selection(sel.heads, sel.tokens, sel.offsets, sel.positions, positions_size, ws, stream, who);
}

/// Workspace bytes of the host-Selection overloads (the selection is copied there).
inline std::size_t compact_workspace_bytes(const Selection& sel) noexcept {
  return (std::size_t(sel.heads + 1) + sel.positions.size()) * sizeof(std::int64_t) + 64;
}

namespace detail {
inline DeviceSelection upload(const Selection& sel, Workspace ws, stream_t stream, const char* who) {
  const std::size_t need = compact_workspace_bytes(sel);
  if (ws.data == nullptr || ws.bytes < need)
    kvscore::detail::throw_invalid(std::string(who) + ": workspace of " + std::to_string(ws.bytes) +
                                   " bytes is smaller than the " + std::to_string(need) +
                                   " bytes needed (see compact_workspace_bytes)");
  auto* base = static_cast<std::byte*>(ws.data);
  base += (64 - reinterpret_cast<std::uintptr_t>(base) % 64) % 64;
  auto* off = reinterpret_cast<std::int64_t*>(base);
  std::int64_t* pos = off + (sel.heads + 1);
  copy_to_device_async(off, sel.offsets.data(), std::size_t(sel.heads + 1) * sizeof(std::int64_t), stream);
  copy_to_device_async(pos, sel.positions.data(), sel.positions.size() * sizeof(std::int64_t), stream);
  return {sel.heads, sel.tokens, off, pos};
}
/// A host Selection validated against (heads, tokens) and its equal-length rule checked on the
/// host (then switched off in `o`), uploaded to the workspace.
inline DeviceSelection upload_checked(const Selection& sel, std::int64_t heads, std::int64_t tokens, CompactOptions& o,
                                      Workspace ws, stream_t stream) {
  constexpr const char* who = "kvscore::cuda::compact";
  kvscore::detail::require_valid_selection(sel, heads, tokens, who);
  if (o.require_equal_lengths)
    for (std::int64_t h = 1; h < sel.heads; ++h)
      if (sel.kept(h) != sel.kept(0))
        kvscore::detail::throw_invalid(std::string(who) + ": require_equal_lengths, but head " + std::to_string(h) +
                                       " keeps " + std::to_string(sel.kept(h)) + " rows and head 0 keeps " +
                                       std::to_string(sel.kept(0)));
  o.require_equal_lengths = false;
  return upload(sel, ws, stream, who);
}

}  // namespace detail

/// Compacts one device cache tensor in place with a host Selection (validated first).
template <class T>
void compact(const DeviceMutKeysView<T>& cache, const Selection& sel, Workspace ws, const CompactOptions& opts = {},
             stream_t stream = nullptr) {
  CompactOptions o = opts;
  const DeviceSelection d = detail::upload_checked(sel, cache.heads(), cache.tokens(), o, ws, stream);
  compact(cache, d, o, stream);
}

/// Compacts K and V in place with a host Selection (validated first).
template <class T, class U>
void compact(const DeviceMutKeysView<T>& keys, const DeviceMutKeysView<U>& values, const Selection& sel, Workspace ws,
             const CompactOptions& opts = {}, stream_t stream = nullptr) {
  CompactOptions o = opts;
  const DeviceSelection d = detail::upload_checked(sel, keys.heads(), keys.tokens(), o, ws, stream);
  compact(keys, values, d, o, stream);
}

}  // namespace kvscore::cuda
