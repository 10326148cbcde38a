// kvscore/cuda/protokv.hpp — ProtoKV (kvscore/scorers/protokv.hpp) on device keys, all heads per call.
//
//   kvscore::ProtoKV proto(queries.data(), q_heads, window, 128);        // host queries, as on the CPU
//   auto keys = kvscore::cuda::DeviceKeysView<kvscore::half>::hf(d_layer, 0, 1, 8, n, 128);
//   kvscore::cuda::DeviceBuffer ws(kvscore::cuda::score_workspace_bytes(proto, keys));   // once
//   kvscore::cuda::score(proto, keys, kvscore::cuda::DeviceScoresView(d_scores, 8, n), {ws.get(), ws.bytes()}, stream);
//   // then kvscore::cuda::select_into(scores, budget, opt /* opt.recent >= proto.protected_recent() */, ...)
//
// Same algorithm, parameters, validity rule and integer rank scores as the CPU ProtoKV (its
// check() runs first: std::invalid_argument naming the value, before any CUDA call). On the
// device: unit keys and q̄·k, the neighbourhood similarity S, the SAT candidates (p lowest S),
// their pairwise distances and RFF projections, the prototype sums, the nearest-prototype
// assignment (tiled fp32 GEMM + argmax, ties to the lower prototype index), ψ per cluster and the
// final ranks. On the host: σ (median), the RFF bits, the PDT chunk boundaries and the member
// lists of the prototypes — one stream synchronisation per call (docs/reference/cuda_protokv.md gives the
// bytes copied). Numerics: fp32 dots (other summation order than the CPU's SIMD, so positions
// equal the CPU's except at near-exact ties), fp64 sums where the CPU sums in fp64, in the
// CPU's order; bit-identical across runs. Errors: kvscore::cuda::Error for CUDA failures.
// Needs the compiled library kvscore::cuda (CMake -DKVSCORE_CUDA=ON). See docs/reference/cuda_protokv.md.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"

namespace kvscore::cuda::detail {

/// ProtoKV's parameters, host arrays prepared by the public header.
struct ProtoArg {
  const float* qbar = nullptr;  ///< [heads][head_dim] q̄ of each KV head (the CPU's fp32 rounding)
  const double* W = nullptr;    ///< [heads][lsh_bits][head_dim] RFF directions (detail::proto::rff_params)
  const double* b = nullptr;    ///< [heads][lsh_bits] RFF phases
  std::int64_t kappa = 5, sat_candidates = 32, chunks = 496;
  int lsh_bits = 2;
  double bandwidth = 0;
  bool psi_mean = false;
};

/// What one head computed (kvscore::cuda::analyze); the fields of kvscore::ProtoKVHead without Θ.
struct ProtoTrace {
  std::vector<unsigned char> valid;
  std::vector<double> similarity;
  std::vector<float> qk, norm;
  std::vector<std::int64_t> candidates;
  std::vector<int> candidate_bucket;
  double bandwidth = 0;
  std::int64_t pdt = 0, sat = 0;
  std::vector<int> sat_bucket_id;
  std::vector<std::int64_t> chunk_begin;
  std::vector<float> prototypes;
  std::vector<std::int32_t> cluster;
  std::vector<std::int64_t> cluster_size;
  std::vector<double> psi;
  std::vector<std::int32_t> cluster_order;
};

std::size_t protokv_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                    std::int64_t sat_candidates, int lsh_bits, std::int64_t chunks) noexcept;
/// Synchronises `stream` once (host step); with `trace`, also copies head `trace_head` back.
void score_protokv(const KeysArg& keys, const ScoresArg& out, const ProtoArg& p, Workspace ws, stream_t stream,
                   ProtoTrace* trace, std::int64_t trace_head);

}  // namespace kvscore::cuda::detail

#ifndef KVSCORE_CUDA_PROTOKV_DETAIL_ONLY  // cuda/src/protokv.cu needs the declarations above only (no Eigen in nvcc)

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kvscore/cuda/scorers.hpp"
#include "kvscore/scorers/protokv.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore::cuda {

namespace detail {

/// q̄ of every KV head, [kv_heads][head_dim], exactly as the CPU scorer rounds it.
inline std::vector<float> protokv_qbar(const ProtoKV& s, std::int64_t kv_heads) {
  std::vector<float> qbar;
  qbar.reserve(std::size_t(kv_heads * s.head_dim()));
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    const std::vector<float> one = s.query_sum(h, kv_heads);
    qbar.insert(qbar.end(), one.begin(), one.end());
  }
  return qbar;
}

/// The GPU-only limit (shared-memory rows of the kernels), checked with the CPU's check().
template <class T>
void protokv_check(const ProtoKV& s, const DeviceKeysView<T>& keys) {
  s.check(keys);
  if (s.psi == ProtoKV::Psi::attention)
    kvscore::detail::throw_invalid("kvscore::cuda::score(ProtoKV): psi = Psi::attention runs on the CPU only "
                                   "(the GPU path has sum and mean)");
  if (keys.head_dim() > 256)
    kvscore::detail::throw_invalid("kvscore::cuda::score(ProtoKV): head_dim " + std::to_string(keys.head_dim()) +
                                   " > 256 is not supported on the GPU");
}

template <class T>
void protokv_run(const ProtoKV& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws,
                 stream_t stream, ProtoTrace* trace, std::int64_t trace_head) {
  const std::int64_t H = keys.heads(), d = keys.head_dim();
  const std::vector<float> qbar = protokv_qbar(s, H);
  const int r = s.lsh_bits;
  std::vector<double> W(std::size_t(H * r * d)), b(std::size_t(H * r)), Wh, bh;
  for (std::int64_t h = 0; h < H; ++h) {
    kvscore::detail::proto::rff_params(s.seed, h, r, d, Wh, bh);
    std::copy(Wh.begin(), Wh.end(), W.begin() + std::ptrdiff_t(h * r * d));
    std::copy(bh.begin(), bh.end(), b.begin() + std::ptrdiff_t(h * r));
  }
  ProtoArg a;
  a.qbar = qbar.data();
  a.W = W.data();
  a.b = b.data();
  a.kappa = s.kappa;
  a.sat_candidates = s.sat_candidates;
  a.chunks = s.chunks;
  a.lsh_bits = r;
  a.bandwidth = s.bandwidth;
  a.psi_mean = s.psi == ProtoKV::Psi::mean;
  score_protokv(keys_arg(keys), scores_arg(out), a, ws, stream, trace, trace_head);
}

}  // namespace detail

/// Workspace bytes of score(s, keys, ...) (depends on the shape and on sat_candidates, lsh_bits, chunks).
template <class T>
std::size_t score_workspace_bytes(const ProtoKV& s, const DeviceKeysView<T>& keys) {
  detail::protokv_check(s, keys);
  return detail::protokv_workspace_bytes(keys.heads(), keys.tokens(), keys.head_dim(), s.sat_candidates, s.lsh_bits,
                                         s.chunks);
}

/// ProtoKV on device keys: the CPU's integer rank scores (M..1, -inf for invalid keys) into `out`.
/// Synchronises `stream` once in the middle (host step); the rest is asynchronous on it.
template <class T>
void score(const ProtoKV& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  detail::check_scores(keys, out, ProtoKV::name);
  detail::protokv_check(s, keys);
  detail::protokv_run(s, keys, out, ws, stream, nullptr, 0);
}

/// Every intermediate of KV head h computed on the device (= ProtoKV::analyze; Θ from S on the host).
/// Diagnostic: allocates, synchronises, copies back.
template <class T>
ProtoKVHead analyze(const ProtoKV& s, const DeviceKeysView<T>& keys, std::int64_t h, stream_t stream = nullptr) {
  detail::protokv_check(s, keys);
  if (h < 0 || h >= keys.heads())
    kvscore::detail::throw_invalid("kvscore::cuda::analyze(ProtoKV): head " + std::to_string(h) + " out of range [0, " +
                                   std::to_string(keys.heads()) + ")");
  DeviceBuffer ws(score_workspace_bytes(s, keys));
  DeviceBuffer sc(std::size_t(keys.heads() * keys.tokens()) * sizeof(float));
  detail::ProtoTrace t;
  detail::protokv_run(s, keys, DeviceScoresView(sc.as<float>(), keys.heads(), keys.tokens()), {ws.get(), ws.bytes()},
                      stream, &t, h);
  ProtoKVHead a;
  a.tokens = keys.tokens();
  a.head_dim = keys.head_dim();
  a.valid = t.valid;
  a.similarity = t.similarity;
  // Θ as the CPU: mean and sd of S over the eligible keys (valid, non-zero), then for every valid key.
  double mean = 0, var = 0;
  std::int64_t ne = 0;
  for (std::size_t i = 0; i < t.valid.size(); ++i)
    if (t.valid[i] && t.norm[i] > 0.f) mean += t.similarity[i], ++ne;
  if (ne > 0) mean /= double(ne);
  for (std::size_t i = 0; i < t.valid.size(); ++i)
    if (t.valid[i] && t.norm[i] > 0.f) var += (t.similarity[i] - mean) * (t.similarity[i] - mean);
  const double sd = ne > 0 ? std::sqrt(var / double(ne)) : 0.0;
  a.deviation.assign(t.valid.size(), std::numeric_limits<double>::quiet_NaN());
  for (std::size_t i = 0; i < t.valid.size(); ++i)
    if (t.valid[i]) a.deviation[i] = sd > 0 ? (mean - t.similarity[i]) / sd : 0.0;
  a.qk = t.qk;
  a.candidates = t.candidates;
  a.candidate_bucket = t.candidate_bucket;
  a.bandwidth = t.bandwidth;
  a.pdt_prototypes = t.pdt;
  a.sat_prototypes = t.sat;
  a.sat_bucket_id = t.sat_bucket_id;
  a.chunk_begin = t.chunk_begin;
  a.prototypes = t.prototypes;
  a.cluster = t.cluster;
  a.cluster_size = t.cluster_size;
  a.psi = t.psi;
  a.cluster_order = t.cluster_order;
  return a;
}

}  // namespace kvscore::cuda

#endif  // KVSCORE_CUDA_PROTOKV_DETAIL_ONLY
