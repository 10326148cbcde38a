// kvscore/cuda/select.hpp — kvscore::select and a batched top-k on device scores.
//
// Same Budget / SelectOptions, same validation (kvscore::plan_selection runs first), same total
// order and tie rule as kvscore/select.hpp: higher score first; equal scores lower position
// first; NaN below every number (-inf included); -0.0 == +0.0; in AdaKV's global step equal
// scores lower position first, then lower head. Output: CSR offsets[heads + 1] and positions
// (int64, ascending per head) in device memory — what kvscore::cuda::compact() takes.
//
// SelectOptions::normalize (AdaKV z-scores) gives the CPU's positions bit for bit: each head's
// mean and standard deviation are the CPU's eight interleaved fp64 sums, in its order.
// opt.num_threads and opt.kernels are CPU settings and are ignored here. select_batch_into runs
// `batch` layers (an engine's batch rows) in one call: AdaKV's global step per layer.
//
//   std::size_t bytes = kvscore::cuda::select_workspace_bytes(scores, budget, opt);   // once
//   kvscore::cuda::select_into(scores, budget, opt, {ws, bytes}, d_offsets, d_positions, capacity, stream);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"
#include "kvscore/select.hpp"
#include "kvscore/core/selection.hpp"

namespace kvscore::cuda {

using detail::TopkPath;

namespace detail {

inline SelectPlan plan_of(const DeviceScoresView& s, Budget budget, const SelectOptions& opt, TopkPath path,
                          std::int64_t batch = 1) {
  if (batch < 1 || s.heads() % batch != 0)
    kvscore::detail::throw_invalid("kvscore::cuda::select: " + std::to_string(s.heads()) +
                                   " score rows are not batch " + std::to_string(batch) + " x heads");
  // the CPU's plan and validation (opt.num_threads and opt.kernels: validated, then ignored)
  const SelectionPlan p = plan_selection(s.heads() / batch, s.tokens(), budget, opt);
  SelectPlan g;
  g.batch = batch;
  g.normalize = p.normalize;
  g.heads = p.heads;
  g.tokens = p.tokens;
  g.score_head_stride = s.head_stride();
  g.adakv = p.alloc == Alloc::adakv;
  g.per_head = p.per_head;
  g.layer = p.layer;
  g.sink_end = p.sink_end;
  g.recent_begin = p.recent_begin;
  g.protect = p.protect;
  g.guaranteed = p.guaranteed;
  g.path = path;
  return g;
}

}  // namespace detail

/// Tokens select_into() writes in total (= kvscore::select_total).
inline std::int64_t select_total(const DeviceScoresView& scores, Budget budget, const SelectOptions& opt = {}) {
  return detail::plan_of(scores, budget, opt, TopkPath::automatic).layer;
}

/// Device workspace bytes select_into() needs for these arguments.
inline std::size_t select_workspace_bytes(const DeviceScoresView& scores, Budget budget,
                                          const SelectOptions& opt = {}, TopkPath path = TopkPath::automatic) {
  return detail::select_workspace_bytes(detail::plan_of(scores, budget, opt, path));
}

/// Asynchronous selection into device memory: offsets[heads + 1] and positions[select_total()].
/// Returns the number of positions (known on the host, no synchronisation).
inline std::int64_t select_into(const DeviceScoresView& scores, Budget budget, const SelectOptions& opt, Workspace ws,
                                std::int64_t* offsets, std::int64_t* positions, std::size_t positions_capacity,
                                stream_t stream = nullptr, TopkPath path = TopkPath::automatic) {
  const detail::SelectPlan p = detail::plan_of(scores, budget, opt, path);
  const std::string who = "kvscore::cuda::select_into: ";
  if (offsets == nullptr) kvscore::detail::throw_invalid(who + "offsets is null (needs heads + 1 entries)");
  if (positions_capacity < std::size_t(p.layer))
    kvscore::detail::throw_invalid(who + "positions capacity " + std::to_string(positions_capacity) +
                                   " is smaller than the " + std::to_string(p.layer) +
                                   " positions selected (see select_total)");
  if (positions == nullptr && p.layer > 0) kvscore::detail::throw_invalid(who + "positions is null");
  detail::select_into(scores.data(), p, ws, offsets, positions, stream);
  return p.layer;
}

/// Tokens select_batch_into() writes in total: batch x select_total of one layer.
inline std::int64_t select_batch_total(const DeviceScoresView& scores, std::int64_t batch, Budget budget,
                                       const SelectOptions& opt = {}) {
  return batch * detail::plan_of(scores, budget, opt, TopkPath::automatic, batch).layer;
}

/// Bytes of select_batch_into()'s device workspace.
inline std::size_t select_batch_workspace_bytes(const DeviceScoresView& scores, std::int64_t batch, Budget budget,
                                                const SelectOptions& opt = {}, TopkPath path = TopkPath::automatic) {
  return detail::select_workspace_bytes(detail::plan_of(scores, budget, opt, path, batch));
}

/// `batch` layers at once: rows b*heads .. b*heads+heads-1 of `scores` (heads = rows / batch) are
/// layer b, selected as select_into selects one layer (per-head, or AdaKV's global step within
/// the layer); offsets[batch*heads + 1] and positions[select_batch_total()] are one CSR over all
/// rows. Returns the number of positions (known on the host, no synchronisation).
inline std::int64_t select_batch_into(const DeviceScoresView& scores, std::int64_t batch, Budget budget,
                                      const SelectOptions& opt, Workspace ws, std::int64_t* offsets,
                                      std::int64_t* positions, std::size_t positions_capacity,
                                      stream_t stream = nullptr, TopkPath path = TopkPath::automatic) {
  const detail::SelectPlan p = detail::plan_of(scores, budget, opt, path, batch);
  const std::string who = "kvscore::cuda::select_batch_into: ";
  const std::int64_t total = batch * p.layer;
  if (offsets == nullptr) kvscore::detail::throw_invalid(who + "offsets is null (needs rows + 1 entries)");
  if (positions_capacity < std::size_t(total))
    kvscore::detail::throw_invalid(who + "positions capacity " + std::to_string(positions_capacity) +
                                   " is smaller than the " + std::to_string(total) +
                                   " positions selected (see select_batch_total)");
  if (positions == nullptr && total > 0) kvscore::detail::throw_invalid(who + "positions is null");
  detail::select_into(scores.data(), p, ws, offsets, positions, stream);
  return total;
}

/// Convenience: allocates, selects, waits for `stream` and returns the host Selection.
inline Selection select(const DeviceScoresView& scores, Budget budget, const SelectOptions& opt = {},
                        stream_t stream = nullptr, TopkPath path = TopkPath::automatic) {
  const detail::SelectPlan p = detail::plan_of(scores, budget, opt, path);
  DeviceBuffer ws(detail::select_workspace_bytes(p));
  DeviceBuffer off(std::size_t(p.heads + 1) * sizeof(std::int64_t));
  DeviceBuffer pos(std::size_t(p.layer > 0 ? p.layer : 1) * sizeof(std::int64_t));
  detail::select_into(scores.data(), p, {ws.get(), ws.bytes()}, off.as<std::int64_t>(), pos.as<std::int64_t>(),
                      stream);
  synchronize(stream);
  Selection s;
  s.heads = p.heads;
  s.tokens = p.tokens;
  s.offsets.assign(std::size_t(p.heads + 1), 0);
  s.positions.resize(std::size_t(p.layer));
  copy_to_host(s.offsets.data(), off.get(), s.offsets.size() * sizeof(std::int64_t));
  copy_to_host(s.positions.data(), pos.get(), s.positions.size() * sizeof(std::int64_t));
  return s;
}

/// Batched top-k: the k best positions of every row of `rows` ([rows][n] device scores), in
/// ascending position order, into positions[rows][k] (device). = select(rows, per_head(k)).
inline std::size_t topk_workspace_bytes(const DeviceScoresView& rows, std::int64_t k,
                                        TopkPath path = TopkPath::automatic) {
  return select_workspace_bytes(rows, Budget::per_head(k), {}, path);
}
/// The k best positions of every row of `rows`, ascending, into positions[rows][k] (device); workspace:
/// topk_workspace_bytes().
inline void topk_into(const DeviceScoresView& rows, std::int64_t k, Workspace ws, std::int64_t* positions,
                      stream_t stream = nullptr, TopkPath path = TopkPath::automatic) {
  const detail::SelectPlan p = detail::plan_of(rows, Budget::per_head(k), {}, path);
  if (positions == nullptr && p.layer > 0) kvscore::detail::throw_invalid("kvscore::cuda::topk_into: positions is null");
  detail::select_into(rows.data(), p, ws, nullptr, positions, stream);
}

}  // namespace kvscore::cuda
