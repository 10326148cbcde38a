// kvscore/cuda/pariskv.hpp — ParisKV retrieval (kvscore/pariskv/pariskv.hpp) on the GPU: one index for
// all KV heads of a layer, built by batched appends of device keys, searched for a batch of
// queries of every head with one launch per stage.
//
//   kvscore::cuda::ParisKV index(kv_heads, head_dim);              // m = 8, the CPU's seed and codebook
//   index.append(kvscore::cuda::DeviceKeysView<kvscore::half>::hf(d_k, 0, 1, kv_heads, n, head_dim));
//   kvscore::ParisKVSearch opt;                                     // k = 100, length-adaptive β, ρ
//   kvscore::cuda::DeviceBuffer ws(index.search_workspace_bytes(q_heads, 1, opt, max_tokens));  // once
//   index.search(d_queries, q_heads, 1, opt, d_positions, d_scores, {ws.get(), ws.bytes()}, stream);
//
// Same encoding and search as the CPU index, kernel by kernel (docs/reference/cuda_pariskv.md):
//   append   validate (NaN/Inf/fp32 norm overflow: std::invalid_argument naming head, key and
//            element; the batch is rejected whole), the frozen key mean μ of the first append
//            (fp64, token order), then one thread per key: centring, rotation (fp32 butterflies),
//            sign ids, 4-bit codes and weights in the CPU's fp64/fp32 operation order, cluster
//            populations by integer atomics. The encoding is bit-identical to the CPU's.
//   search   per (query, subspace) the tier table: the 2^m pattern costs summed in sorted
//            order (fp32, as the CPU), a block-wide sort by (cost, id), a prefix sum of the
//            populations; per key the collision score S (table lookups, uint16) with a fused
//            histogram; the threshold T, need_eq from the histogram; an ordered compaction of
//            the C = ⌈βN⌉ best keys (ties: lower position) by chunk counts + prefix scan; the
//            RSQ-IP estimate of every candidate in fp32 in the CPU portable kernel's order;
//            the top k by kvscore::cuda::topk_into (ties: lower position); ⟨μ, q⟩ added in fp64.
// Positions and scores equal the CPU index searched with pariskv::Kernels::portable (the AVX-512
// set may differ in the last bits of an estimate); exact ties in ⟨q̃_b, s⟩ go by pattern id on
// both.
//
// GPU limits (std::invalid_argument): m ≤ 8 (one byte per id; m = 16 stays on the CPU), padded
// head_dim ≤ 512, rerank_exact = 0 (the exact rerank needs the keys; the CPU index has it).
// GQA: q_heads = kv_heads · G; query head qh searches KV head qh / G on its own (the CPU's
// pariskv_retrieve with group = 1).
// append() synchronises (it validates the batch on the device first); search() is launched
// asynchronously and synchronises once at the end to check the queries' validity flag.
// Needs the compiled library kvscore::cuda (CMake -DKVSCORE_CUDA=ON).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"
#include "kvscore/cuda/pariskv_kernels.hpp"
#include "kvscore/pariskv/pariskv.hpp"

namespace kvscore::cuda {


/// ParisKV's index of every KV head of a layer on the GPU (see the top of this file): append() encodes keys on the
/// device, search() returns each query's top k; the same positions as the CPU index (kvscore::ParisKV) on the same
/// keys.
class ParisKV {
 public:
  /// kv_heads indexes of head_dim; the configuration (m, seed, codebook, centring) of the CPU
  /// index, whose constructor validates it. m > 8 or a padded head_dim > 512 are rejected.
  ParisKV(std::int64_t kv_heads, std::int64_t head_dim, const ParisKVConfig& cfg = {})
      : cpu_(head_dim, cfg) {
    const std::string who = "kvscore::cuda::ParisKV";
    if (kv_heads < 1 || kv_heads > 65535)
      kvscore::detail::throw_invalid(who + ": kv_heads must be in [1, 65535] (got " + std::to_string(kv_heads) + ")");
    if (cpu_.m() > 8)
      kvscore::detail::throw_invalid(who + ": m " + std::to_string(cpu_.m()) +
                                     " is not supported on the GPU path (m <= 8; m = 16 runs on the CPU index)");
    if (cpu_.padded_dim() > 512)
      kvscore::detail::throw_invalid(who + ": padded head_dim " + std::to_string(cpu_.padded_dim()) +
                                     " is not supported on the GPU path (at most 512)");
    s_.heads = kv_heads;
    s_.d = head_dim;
    s_.P = cpu_.padded_dim();
    s_.m = cpu_.m();
    s_.B = cpu_.subspaces();
    s_.nc = std::int64_t(1) << s_.m;
    s_.pc = (s_.P + 31) / 32 * 32;
    s_.cb = s_.pc / 2;
    s_.center = cfg.center;
    const pariskv::Codebook& cbk = cpu_.codebook();
    for (int t = 0; t < 7; ++t) s_.tau[t] = float(cbk.thresholds[std::size_t(t)]);
    for (int t = 0; t < 8; ++t) {
      s_.value[t] = float(cbk.centres[std::size_t(t)]);
      s_.value[t + 8] = -float(cbk.centres[std::size_t(t)]);
    }
    const std::vector<float>& sg = cpu_.rotation().scaled_signs();
    signs_ = DeviceBuffer(sg.size() * sizeof(float));
    copy_to_device(signs_.get(), sg.data(), sg.size() * sizeof(float));
    s_.signs = signs_.as<float>();
    pop_ = DeviceBuffer(std::size_t(s_.heads * s_.B * s_.nc) * sizeof(std::int32_t));
    zero_async(pop_.get(), pop_.bytes());
    s_.pop = pop_.as<std::int32_t>();
    mu_ = DeviceBuffer(std::size_t(s_.heads * s_.d) * sizeof(float));
    s_.mu = mu_.as<float>();
    synchronize();
  }

  std::int64_t kv_heads() const noexcept { return s_.heads; }  ///< KV heads indexed
  std::int64_t head_dim() const noexcept { return s_.d; }  ///< dimensions of a key
  std::int64_t padded_dim() const noexcept { return s_.P; }  ///< P, head_dim padded to a power of two
  std::int64_t m() const noexcept { return s_.m; }  ///< m, dimensions per subspace (at most 8 here)
  std::int64_t subspaces() const noexcept { return s_.B; }  ///< B, subspaces (P / m)
  /// Keys per head.
  std::int64_t size() const noexcept { return s_.n; }
  /// Keys per head the device buffers hold before they grow.
  std::int64_t capacity() const noexcept { return s_.cap; }
  /// The CPU index's configuration it was built with.
  const ParisKVConfig& config() const noexcept { return cpu_.config(); }
  /// Device bytes held by the index (ids, codes, weights at capacity; populations, μ, signs).
  std::size_t memory_bytes() const noexcept {
    return ids_.bytes() + codes_.bytes() + w_.bytes() + pop_.bytes() + mu_.bytes() + signs_.bytes();
  }

  /// Fixes μ ([kv_heads][head_dim] host floats, finite) before the first append; needs centring on.
  void set_center(const float* host_mu) {
    const std::string who = "kvscore::cuda::ParisKV::set_center";
    if (!s_.center) kvscore::detail::throw_invalid(who + ": centering is off in this index's config");
    if (s_.n > 0) kvscore::detail::throw_invalid(who + ": the index already holds " + std::to_string(s_.n) + " keys");
    if (host_mu == nullptr) kvscore::detail::throw_invalid(who + ": mu is null");
    for (std::int64_t i = 0; i < s_.heads * s_.d; ++i)
      if (!std::isfinite(host_mu[i]))
        kvscore::detail::throw_invalid(who + ": mu value " + std::to_string(host_mu[i]) + " of head " +
                                       std::to_string(i / s_.d) + " at element " + std::to_string(i % s_.d) +
                                       " is not finite");
    copy_to_device(mu_.get(), host_mu, std::size_t(s_.heads * s_.d) * sizeof(float));
    s_.has_mu = true;
  }

  /// Reserves room for `tokens` keys per head (appends grow by doubling otherwise).
  void reserve(std::int64_t tokens) {
    if (tokens > s_.cap) grow(tokens);
  }

  /// Appends every token of `keys` ([kv_heads][n][head_dim], device) at positions size()...
  /// Validates first (a rejected batch changes nothing); returns after the encoding is done.
  template <class T>
  void append(const DeviceKeysView<T>& keys, stream_t stream = nullptr) {
    const std::string who = "kvscore::cuda::ParisKV::append";
    if (keys.heads() != s_.heads || keys.head_dim() != s_.d)
      kvscore::detail::throw_invalid(who + ": keys have " + std::to_string(keys.heads()) + " heads of head_dim " +
                                     std::to_string(keys.head_dim()) + ", the index " + std::to_string(s_.heads) +
                                     " of " + std::to_string(s_.d));
    if (keys.tokens() == 0) return;
    require_device_pointer(keys.data(), "keys");
    const std::size_t bytes = detail::pariskv_append_workspace_bytes(s_, keys.tokens());
    if (append_ws_.bytes() < bytes) append_ws_ = DeviceBuffer(bytes);
    detail::pariskv_validate(s_, detail::keys_arg(keys), {append_ws_.get(), append_ws_.bytes()}, stream);
    const std::int64_t need = s_.n + keys.tokens();  // valid: only now may the index change
    if (need > s_.cap) grow(std::max(need, 2 * s_.cap));
    detail::pariskv_encode(s_, detail::keys_arg(keys), stream);
  }

  /// C = max(⌈βN⌉, k) for these options at the current size (β: opt.beta or the default).
  std::int64_t candidates(const ParisKVSearch& opt) const { return candidates_at(opt, s_.n); }

  /// Workspace bytes of search() for up to `tokens` keys per head (-1: the current size), so
  /// one workspace can serve every decoding step up to that length.
  std::size_t search_workspace_bytes(std::int64_t q_heads, std::int64_t n_queries, const ParisKVSearch& opt,
                                     std::int64_t tokens = -1) const {
    const std::int64_t n = tokens < 0 ? s_.n : tokens;
    if (n < s_.n)
      kvscore::detail::throw_invalid("kvscore::cuda::ParisKV::search_workspace_bytes: tokens " + std::to_string(n) +
                                     " < size() " + std::to_string(s_.n));
    detail::ParisKVSearchArgs a = args(q_heads, n_queries, opt, n, false);
    // C grows with N (β fixed) but the default β steps down: size for the largest C up to n
    for (std::int64_t t : {std::int64_t(4999), std::int64_t(9999), std::int64_t(29999), n}) {
      if (t > n || t < 1) continue;
      a.C = std::max(a.C, candidates_at(opt, t));
    }
    return detail::pariskv_search_workspace_bytes(s_, a, n);
  }

  /// Top-k retrieval for queries [q_heads][n_queries][head_dim] (device fp32): positions
  /// [q_heads][n_queries][k] ascending per row, scores = RSQ-IP estimates of ⟨k_t, q⟩ (device).
  void search(const float* queries, std::int64_t q_heads, std::int64_t n_queries, const ParisKVSearch& opt,
              std::int64_t* positions, float* scores, Workspace ws, stream_t stream = nullptr) const {
    run(queries, q_heads, n_queries, opt, positions, scores, nullptr, ws, stream);
  }

  /// Stage I collision scores S of every key for queries [q_heads][n_queries][head_dim] (device)
  /// and ratio ρ (tests, tools): host [q_heads·n_queries][size()].
  std::vector<std::int32_t> collision_scores(const float* queries, std::int64_t q_heads, std::int64_t n_queries,
                                             double rho) const {
    ParisKVSearch opt;
    opt.k = 0;  // Stage I only: β (the candidate count) plays no part
    opt.rho = rho;
    const std::size_t bytes = search_workspace_bytes(q_heads, n_queries, opt);
    DeviceBuffer ws(bytes);
    DeviceBuffer col(std::size_t(std::max<std::int64_t>(1, q_heads * n_queries * s_.n)) * sizeof(std::int32_t));
    run(queries, q_heads, n_queries, opt, nullptr, nullptr, col.as<std::int32_t>(), {ws.get(), ws.bytes()}, nullptr);
    std::vector<std::int32_t> out(std::size_t(q_heads * n_queries * s_.n));
    copy_to_host(out.data(), col.get(), out.size() * sizeof(std::int32_t));
    return out;
  }

  /// The encoding of head h copied to the host (tests): ids [N][B], codes [N][P] (4 bits each),
  /// weights [N][B], populations [B][2^m], μ [head_dim] (empty if none).
  struct Encoding {
    std::vector<std::uint32_t> ids;  ///< Stage I centroid ids, [N][B]
    std::vector<std::uint8_t> codes;  ///< 4-bit codes, [N][P] (two per byte)
    std::vector<float> w;  ///< Stage II weights, [N][B]
    std::vector<std::int64_t> pop;  ///< populations, [B][2^m]
    std::vector<float> mu;  ///< μ, [head_dim] (empty when not centring)
  };
  /// Head h's encoding, copied to the host (tests); std::invalid_argument for a bad h.
  Encoding encoding(std::int64_t h) const {
    if (h < 0 || h >= s_.heads)
      kvscore::detail::throw_invalid("kvscore::cuda::ParisKV::encoding: head " + std::to_string(h) +
                                     " out of range [0, " + std::to_string(s_.heads) + ")");
    const std::int64_t N = s_.n, B = s_.B;
    Encoding e;
    std::vector<std::uint8_t> ids(std::size_t(B * s_.cap)), codes(std::size_t(s_.cap * s_.cb));
    std::vector<float> w(std::size_t(s_.cap * B));
    std::vector<std::int32_t> pop(std::size_t(B * s_.nc));
    if (s_.cap > 0) {
      copy_to_host(ids.data(), s_.ids + h * B * s_.cap, ids.size());
      copy_to_host(codes.data(), s_.codes + h * s_.cap * s_.cb, codes.size());
      copy_to_host(w.data(), s_.w + h * s_.cap * B, w.size() * sizeof(float));
    }
    copy_to_host(pop.data(), s_.pop + h * B * s_.nc, pop.size() * sizeof(std::int32_t));
    e.ids.resize(std::size_t(N * B));
    e.codes.resize(std::size_t(N * s_.P));
    e.w.assign(w.begin(), w.begin() + N * B);
    for (std::int64_t i = 0; i < N; ++i) {
      for (std::int64_t b = 0; b < B; ++b) e.ids[std::size_t(i * B + b)] = ids[std::size_t(b * s_.cap + i)];
      for (std::int64_t j = 0; j < s_.P; ++j) {
        const std::uint8_t byte = codes[std::size_t(i * s_.cb + (j / 32) * 16 + (j % 32) % 16)];
        e.codes[std::size_t(i * s_.P + j)] = (j % 32) < 16 ? byte & 15 : byte >> 4;
      }
    }
    e.pop.assign(pop.begin(), pop.end());
    if (s_.has_mu) {
      e.mu.resize(std::size_t(s_.d));
      copy_to_host(e.mu.data(), s_.mu + h * s_.d, e.mu.size() * sizeof(float));
    }
    return e;
  }

 private:
  std::int64_t candidates_at(const ParisKVSearch& opt, std::int64_t n) const {
    return pariskv::candidate_count(opt.beta, n, std::min(n, opt.k));
  }

  /// Validates the options (the CPU index's rules plus the GPU's) and fills the arguments.
  detail::ParisKVSearchArgs args(std::int64_t q_heads, std::int64_t n_queries, const ParisKVSearch& opt, std::int64_t n,
                                 bool check_k) const {
    const std::string who = "kvscore::cuda::ParisKV::search";
    if (q_heads < 1 || q_heads % s_.heads != 0)
      kvscore::detail::throw_invalid(who + ": query heads " + std::to_string(q_heads) +
                                     " must be a positive multiple of the " + std::to_string(s_.heads) + " KV heads");
    if (n_queries < 0) kvscore::detail::throw_invalid(who + ": n_queries must be >= 0 (got " + std::to_string(n_queries) + ")");
    if (opt.rerank_exact != 0)
      kvscore::detail::throw_invalid(who + ": rerank_exact " + std::to_string(opt.rerank_exact) +
                                     " is not supported on the GPU path (use 0, or the CPU index with the keys)");
    if (check_k && (opt.k < 0 || opt.k > s_.n))
      kvscore::detail::throw_invalid(who + ": k " + std::to_string(opt.k) + " out of range [0, " + std::to_string(s_.n) +
                                     "] (the index holds " + std::to_string(s_.n) + " keys per head)");
    for (const auto& [x, name] : {std::pair{opt.beta, "beta"}, std::pair{opt.rho, "rho"}})
      if (x != 0 && !(x > 0 && x <= 1))
        kvscore::detail::throw_invalid(who + ": " + name + " must be in (0, 1] (got " + std::to_string(x) + ")");
    detail::ParisKVSearchArgs a;
    a.q_heads = q_heads;
    a.n_queries = n_queries;
    a.k = opt.k;
    a.C = n > 0 ? candidates_at(opt, n) : 0;
    const pariskv::Ratios def = pariskv::default_ratios(n);
    a.collided = n > 0 ? pariskv::ratio_count(opt.rho != 0 ? opt.rho : def.rho, n) : 0;
    return a;
  }

  void run(const float* queries, std::int64_t q_heads, std::int64_t n_queries, const ParisKVSearch& opt,
           std::int64_t* positions, float* scores, std::int32_t* collisions, Workspace ws, stream_t stream) const {
    const std::string who = "kvscore::cuda::ParisKV::search";
    const detail::ParisKVSearchArgs a = args(q_heads, n_queries, opt, s_.n, true);
    if (n_queries == 0) return;
    if (queries == nullptr) kvscore::detail::throw_invalid(who + ": queries is null");
    require_device_pointer(queries, "queries");
    if (a.k > 0) {
      if (positions == nullptr || scores == nullptr) kvscore::detail::throw_invalid(who + ": positions or scores is null");
      require_device_pointer(positions, "positions");
      require_device_pointer(scores, "scores");
    }
    detail::pariskv_search(s_, a, queries, positions, scores, collisions, ws, stream);
  }

  void grow(std::int64_t cap) {
    cap = (cap + 63) / 64 * 64;
    const std::int64_t H = s_.heads, B = s_.B;
    DeviceBuffer ids(std::size_t(H * B * cap)), codes(std::size_t(H * cap * s_.cb)),
        w(std::size_t(H * cap * B) * sizeof(float));
    zero_async(ids.get(), ids.bytes());
    zero_async(codes.get(), codes.bytes());
    zero_async(w.get(), w.bytes());
    synchronize();
    if (s_.n > 0)  // rows of the old layout into the new one (the kept part: n keys per row)
      for (std::int64_t r = 0; r < H; ++r) {
        for (std::int64_t b = 0; b < B; ++b)
          copy_device_to_device(ids.as<std::uint8_t>() + (r * B + b) * cap, s_.ids + (r * B + b) * s_.cap,
                                std::size_t(s_.n));
        copy_device_to_device(codes.as<std::uint8_t>() + r * cap * s_.cb, s_.codes + r * s_.cap * s_.cb,
                              std::size_t(s_.n * s_.cb));
        copy_device_to_device(w.as<float>() + r * cap * B, s_.w + r * s_.cap * B, std::size_t(s_.n * B) * sizeof(float));
      }
    synchronize();
    ids_ = std::move(ids);
    codes_ = std::move(codes);
    w_ = std::move(w);
    s_.ids = ids_.as<std::uint8_t>();
    s_.codes = codes_.as<std::uint8_t>();
    s_.w = w_.as<float>();
    s_.cap = cap;
  }

  kvscore::ParisKV cpu_;  // configuration checks, codebook and rotation (never appended to)
  detail::ParisKVState s_;
  DeviceBuffer signs_, ids_, codes_, w_, pop_, mu_, append_ws_;
};

}  // namespace kvscore::cuda
