// kvscore/cuda/pariskv_kernels.hpp — the raw entry points of the GPU ParisKV index (internal:
// use kvscore/cuda/pariskv.hpp, which validates every argument). No CUDA or CPU-index headers,
// so cuda/src/pariskv.cu includes it without the CPU kernels' intrinsics.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"

namespace kvscore::cuda {

namespace detail {

/// The device state of a layer index (type-erased for the .cu; owned by cuda::ParisKV).
struct ParisKVState {
  std::int64_t heads = 0, d = 0, P = 0, m = 0, B = 0, nc = 0, pc = 0, cb = 0;
  std::int64_t n = 0, cap = 0;
  bool center = true, has_mu = false;
  float tau[7] = {}, value[16] = {};
  const float* signs = nullptr;  ///< [P] device: rotation signs / √P
  std::uint8_t* ids = nullptr;   ///< [heads][B][cap]
  std::uint8_t* codes = nullptr; ///< [heads][cap][cb]
  float* w = nullptr;            ///< [heads][cap][B]
  std::int32_t* pop = nullptr;   ///< [heads][B][nc]
  float* mu = nullptr;           ///< [heads][d]
};

/// Workspace of pariskv_append for n new keys per head.
std::size_t pariskv_append_workspace_bytes(const ParisKVState& s, std::int64_t n) noexcept;
/// Validates the batch: throws std::invalid_argument naming head, key and element (synchronous).
void pariskv_validate(const ParisKVState& s, const KeysArg& keys, Workspace ws, stream_t stream);
/// Sets μ on the first append (when s.center), encodes a validated batch into positions
/// [s.n, s.n + n) and advances s.n. The caller grows the buffers first; synchronous.
void pariskv_encode(ParisKVState& s, const KeysArg& keys, stream_t stream);

struct ParisKVSearchArgs {
  std::int64_t q_heads = 0, n_queries = 0, k = 0, C = 0;
  std::int64_t collided = 0;  ///< ⌈ρN⌉
};
std::size_t pariskv_search_workspace_bytes(const ParisKVState& s, const ParisKVSearchArgs& a, std::int64_t tokens) noexcept;
/// Stage I and II for queries [q_heads][n_queries][d] (device fp32); positions/scores
/// [q_heads][n_queries][k] (device). `collisions` (optional, device, [rows][n] int32): Stage I
/// scores for tests. Synchronises at the end; invalid queries throw std::invalid_argument.
void pariskv_search(const ParisKVState& s, const ParisKVSearchArgs& a, const float* queries, std::int64_t* positions,
                    float* scores, std::int32_t* collisions, Workspace ws, stream_t stream);

}  // namespace detail

}  // namespace kvscore::cuda
