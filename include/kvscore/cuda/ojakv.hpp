// kvscore/cuda/ojakv.hpp — OjaKV (kvscore/ojakv/ojakv.hpp) on device memory: projection and
// reconstruction of a layer, the full-rank token score (OjaResidual) and the batched Oja update.
//
//   namespace kc = kvscore::cuda;
//   std::vector<float> ub = kc::pack_key_bases(projectors);                  // [H][d][r] fp32
//   kc::copy_to_device(d_u, ub.data(), ub.size() * 4);
//   kc::project(keys, kc::DeviceBasesView(d_u, H, d, r), kc::DeviceMutKeysView<float>(d_codes, H, n, r, n * r, r), stream);
//
//   kc::OjaResidual res(queries, q_heads, window, d, key_bases);           // also a kvscore::OjaResidual
//   kc::DeviceBuffer ws(kc::score_workspace_bytes(res, keys));              // once
//   kc::score(res, keys, kc::DeviceScoresView(d_scores, H, n), {ws.get(), ws.bytes()}, stream);
//   kc::select_into(kc::DeviceScoresView(d_scores, H, n), budget, opt, ...);  // full-rank tokens
//
//   kc::DeviceBuffer cws(kc::covariance_workspace_bytes(keys, opt.pool));
//   kc::prefill(bases, keys, {cws.get(), cws.bytes()}, stream);            // std::vector<OjaBasis>
//
// Numerics: projection and reconstruction read fp32 bases and accumulate in fp64, then round
// to fp32 (the CPU rounds an fp32 GEMM: the GPU is the more accurate of the two). The residual
// score is computed in fp64 as q·k − (Uᵀq)·(Uᵀk) with the CPU's fp64 bases, its validity rule
// (fp64 squared norm of the widened row finite and <= FLT_MAX: −inf otherwise) and its window
// rule. The pooled covariance C = XᵀX/m is fp64 on the device (pooled rows bit-identical to the
// CPU's, the sum in a fixed order); the Oja steps and the Householder QR run on the host with
// the CPU's own oja::oja_steps (U is d × r: tiny; docs/reference/cuda_ojakv.md says why). Every result is
// bit-identical across runs (no floating atomics).
// Errors: std::invalid_argument naming the value, before any launch; CUDA failures throw
// kvscore::cuda::Error. Asynchronous on `stream` except pooled_covariances / prefill /
// decode_update, which copy C back to the host (they synchronise the stream).
// Needs the compiled library kvscore::cuda (CMake -DKVSCORE_CUDA=ON). See docs/reference/cuda_ojakv.md.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/kernels.hpp"

// ---------------------------------------------------------------- raw entry points (cuda/src/ojakv.cu)

namespace kvscore::cuda::detail {

/// codes[h][t][i] = Σ_j k[h][t][j] · U[h][j][i] (fp64 accumulation, fp32 out). U: [H][d][r] fp32.
void oja_project(const KeysArg& keys, const float* bases, std::int64_t rank, float* codes, std::int64_t codes_hs,
                 std::int64_t codes_ts, stream_t stream);
/// out[h][t][j] = Σ_i c[h][t][i] · U[h][j][i] (fp64 accumulation, fp32 out); codes are fp32.
void oja_reconstruct(const KeysArg& codes, const float* bases, std::int64_t head_dim, float* out, std::int64_t out_hs,
                     std::int64_t out_ts, stream_t stream);

std::size_t oja_residual_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                         std::int64_t rank, std::int64_t q_heads, std::int64_t window) noexcept;
/// host_bases [H][d][rank] fp64 (zero-padded columns), host_aug [q_heads][window][d + rank] fp64
/// = [q, Uᵀq]; both copied into the workspace.
void oja_residual_score(const KeysArg& keys, const ScoresArg& out, const double* host_bases, const double* host_aug,
                        std::int64_t rank, std::int64_t q_heads, std::int64_t window, Workspace ws, stream_t stream);

std::size_t oja_covariance_workspace_bytes(std::int64_t heads, std::int64_t tokens, std::int64_t head_dim,
                                           std::int64_t pool) noexcept;
/// cov [H][d][d] fp64 (device), valid [H] and pooled [H] (device, may be null).
void oja_covariance(const KeysArg& rows, std::int64_t pool, Workspace ws, double* cov, std::int64_t* valid,
                    std::int64_t* pooled, stream_t stream);

}  // namespace kvscore::cuda::detail

// cuda/src/ojakv.cu defines this macro to see the declarations above without Eigen (nvcc).
#ifndef KVSCORE_CUDA_OJAKV_DECLARATIONS_ONLY

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include <Eigen/Dense>

#include "kvscore/ojakv/ojakv.hpp"

namespace kvscore::cuda {

namespace detail {
/// `what` ("codes", "output") must be (heads, tokens, last), `last` named `last_name`.
template <class View>
void require_shape(const std::string& what, const View& v, const char* last_name, std::int64_t heads,
                   std::int64_t tokens, std::int64_t last) {
  if (v.heads() != heads || v.tokens() != tokens || v.head_dim() != last)
    kvscore::detail::throw_invalid(what + " shape (" + std::to_string(v.heads()) + ", " + std::to_string(v.tokens()) +
                                   ", " + std::to_string(v.head_dim()) + ") is not (heads, tokens, " + last_name +
                                   ") = (" + std::to_string(heads) + ", " + std::to_string(tokens) + ", " +
                                   std::to_string(last) + ")");
}

/// The bases' (heads, dim) must equal the other operand's: "bases are (.. heads, rank ..), codes (..)".
inline void require_bases_match(const std::string& who, const char* dim_name, std::int64_t bh, std::int64_t bd,
                                const char* other, std::int64_t oh, std::int64_t od) {
  if (bh != oh || bd != od)
    kvscore::detail::throw_invalid(who + "bases are (" + std::to_string(bh) + " heads, " + dim_name + " " +
                                   std::to_string(bd) + "), " + other + " (" + std::to_string(oh) + " heads, " +
                                   dim_name + " " + std::to_string(od) + ")");
}

inline void check_pool(std::int64_t pool, const char* who) {
  if (pool < 1) kvscore::detail::throw_invalid(std::string(who) + ": pool must be >= 1 (got " + std::to_string(pool) + ")");
}

}  // namespace detail

// ---------------------------------------------------------------- bases on the device

/// Per-head fp32 bases on the device, [heads][head_dim][rank] row-major (U_h(j, i) at
/// data[(h*head_dim + j)*rank + i]); pack_bases() writes that layout on the host.
class DeviceBasesView {
 public:
  static constexpr MemorySpace space = MemorySpace::device;  ///< the memory the bases live in
  DeviceBasesView() = default;
  /// `heads` bases of head_dim x rank at `data` (device memory); std::invalid_argument for a bad shape.
  DeviceBasesView(const float* data, std::int64_t heads, std::int64_t head_dim, std::int64_t rank)
      : data_(data), heads_(heads), d_(head_dim), r_(rank) {
    const char* who = "kvscore::cuda::DeviceBasesView";
    if (heads < 0) kvscore::detail::throw_invalid(std::string(who) + ": heads must be >= 0 (got " + std::to_string(heads) + ")");
    oja::check_rank(who, head_dim, rank);
    if (data == nullptr && heads > 0) kvscore::detail::throw_invalid(std::string(who) + ": data is null");
  }
  const float* data() const noexcept { return data_; }  ///< the first element (device memory)
  std::int64_t heads() const noexcept { return heads_; }  ///< heads (one basis each)
  std::int64_t head_dim() const noexcept { return d_; }  ///< d, rows of each basis
  std::int64_t rank() const noexcept { return r_; }  ///< r, columns of each basis

 private:
  const float* data_ = nullptr;
  std::int64_t heads_ = 0, d_ = 0, r_ = 0;
};

/// [H][d][r] fp32 (= OjaBasis::basis_f32 of each head); every basis must be d × r.
inline std::vector<float> pack_bases(const std::vector<Eigen::MatrixXd>& bases) {
  const char* who = "kvscore::cuda::pack_bases";
  if (bases.empty()) kvscore::detail::throw_invalid(std::string(who) + ": no bases (0 heads)");
  const Eigen::Index d = bases[0].rows(), r = bases[0].cols();
  oja::check_rank(who, d, r);
  std::vector<float> out(std::size_t(bases.size()) * std::size_t(d * r));
  for (std::size_t h = 0; h < bases.size(); ++h) {
    if (bases[h].rows() != d || bases[h].cols() != r)
      kvscore::detail::throw_invalid(std::string(who) + ": basis " + std::to_string(h) + " is " +
                                     std::to_string(bases[h].rows()) + " x " + std::to_string(bases[h].cols()) +
                                     ", basis 0 is " + std::to_string(d) + " x " + std::to_string(r));
    const Eigen::MatrixXf f = bases[h].cast<float>();
    for (Eigen::Index j = 0; j < d; ++j)
      for (Eigen::Index i = 0; i < r; ++i) out[h * std::size_t(d * r) + std::size_t(j * r + i)] = f(j, i);
  }
  return out;
}
/// The key bases of `p` (one projector per head) in DeviceBasesView's layout, on the host.
inline std::vector<float> pack_key_bases(const std::vector<OjaProjector>& p) {
  std::vector<Eigen::MatrixXd> b;
  for (const auto& x : p) b.push_back(x.key().basis());
  return pack_bases(b);
}
/// The value bases of `p` in DeviceBasesView's layout, on the host.
inline std::vector<float> pack_value_bases(const std::vector<OjaProjector>& p) {
  std::vector<Eigen::MatrixXd> b;
  for (const auto& x : p) b.push_back(x.value().basis());
  return pack_bases(b);
}

// ---------------------------------------------------------------- projection / reconstruction

/// codes = K U per head (all heads, one launch): codes is [heads][tokens][rank] fp32 (any strides).
template <class T>
void project(const DeviceKeysView<T>& keys, const DeviceBasesView& bases, const DeviceMutKeysView<float>& codes,
             stream_t stream = nullptr) {
  const std::string who = "kvscore::cuda::project: ";
  detail::require_bases_match(who, "head_dim", bases.heads(), bases.head_dim(), "keys", keys.heads(), keys.head_dim());
  detail::require_shape(who + "codes", codes, "rank", keys.heads(), keys.tokens(), bases.rank());
  detail::oja_project(detail::keys_arg(keys), bases.data(), bases.rank(), codes.data(), codes.head_stride(),
                      codes.token_stride(), stream);
}

/// K^ = codes Uᵀ per head: out is [heads][tokens][head_dim] fp32 (any strides).
inline void reconstruct(const DeviceKeysView<float>& codes, const DeviceBasesView& bases,
                        const DeviceMutKeysView<float>& out, stream_t stream = nullptr) {
  const std::string who = "kvscore::cuda::reconstruct: ";
  detail::require_bases_match(who, "rank", bases.heads(), bases.rank(), "codes", codes.heads(), codes.head_dim());
  detail::require_shape(who + "output", out, "head_dim", codes.heads(), codes.tokens(), bases.head_dim());
  detail::oja_reconstruct(detail::keys_arg(codes), bases.data(), bases.head_dim(), out.data(), out.head_stride(),
                          out.token_stride(), stream);
}

// ---------------------------------------------------------------- full-rank score

/// kvscore::OjaResidual (same constructor, same CPU score()) that also scores device keys
/// through kc::score. Keeps fp64 copies of the bases (zero-padded to the largest rank) and of
/// [q, Uᵀq] per query, copied into the workspace at every call.
class OjaResidual : public kvscore::OjaResidual {
 public:
  /// kvscore::OjaResidual's constructor (the same checks), plus the device copies.
  OjaResidual(const float* queries, std::int64_t q_heads, std::int64_t window, std::int64_t head_dim,
              std::vector<Eigen::MatrixXd> bases)
      : kvscore::OjaResidual(queries, q_heads, window, head_dim, bases) {  // validates first (copy of bases)
    const std::int64_t H = std::int64_t(bases.size()), d = head_dim, G = q_heads / H;
    for (const auto& u : bases) rank_ = std::max<std::int64_t>(rank_, u.cols());
    const std::int64_t L = d + rank_;
    u_.assign(std::size_t(H * d * rank_), 0.0);
    aug_.assign(std::size_t(q_heads * window * L), 0.0);
    q_heads_ = q_heads;
    heads_ = H;
    dim_ = d;
    for (std::int64_t h = 0; h < H; ++h) {
      const Eigen::MatrixXd& u = bases[std::size_t(h)];
      for (std::int64_t j = 0; j < d; ++j)
        for (std::int64_t i = 0; i < u.cols(); ++i) u_[std::size_t((h * d + j) * rank_ + i)] = u(j, i);
      if (u.cols() == d) continue;  // full rank: residual 0 by definition (kvscore::OjaResidual); zero rows give 0
      for (std::int64_t row = h * G * window; row < (h + 1) * G * window; ++row) {
        Eigen::VectorXd q(d);
        for (std::int64_t j = 0; j < d; ++j) q(j) = double(queries[row * d + j]);
        const Eigen::VectorXd p = u.transpose() * q;  // Uᵀq: the part of q the codes can see
        double* a = aug_.data() + row * L;
        for (std::int64_t j = 0; j < d; ++j) a[j] = q(j);
        for (std::int64_t i = 0; i < p.size(); ++i) a[d + i] = p(i);
      }
    }
  }
  /// kvscore::OjaResidual::check's rules and messages for device keys (the CPU one needs a KeyCacheView).
  template <class T>
  void check(const DeviceKeysView<T>& keys) const {
    const std::string who = "kvscore::OjaResidual: ";
    if (keys.heads() != heads_)
      kvscore::detail::throw_invalid(who + "keys have " + std::to_string(keys.heads()) + " heads but there are " +
                                     std::to_string(heads_) + " bases");
    if (keys.head_dim() != dim_)
      kvscore::detail::throw_invalid(who + "keys have head_dim " + std::to_string(keys.head_dim()) + ", queries " +
                                     std::to_string(dim_));
    if (placement != QueryPlacement::in_cache)
      kvscore::detail::throw_invalid(who + "placement = QueryPlacement::after_cache runs on the CPU only (the GPU "
                                     "kernel has the in-cache causal window)");
    if (window() > keys.tokens())
      kvscore::detail::throw_invalid(who + "window " + std::to_string(window()) + " > tokens " +
                                     std::to_string(keys.tokens()) +
                                     " (the window's queries sit at the last positions of the cache)");
  }
  using kvscore::OjaResidual::check;

  /// The largest rank of the bases (the others zero-padded to it).
  std::int64_t max_rank() const noexcept { return rank_; }
  std::int64_t q_heads() const noexcept { return q_heads_; }  ///< query heads of the window queries
  /// The bases in fp64, zero-padded to max_rank(), as the kernels read them.
  const std::vector<double>& device_bases() const noexcept { return u_; }
  /// [q, Uᵀq] per query, fp64, as the kernels read them.
  const std::vector<double>& augmented_queries() const noexcept { return aug_; }

 private:
  std::vector<double> u_, aug_;
  std::int64_t rank_ = 0, q_heads_ = 0, heads_ = 0, dim_ = 0;
};

/// Bytes of score()'s device workspace for `s` on `keys` (OjaResidual's checks first).
template <class T>
std::size_t score_workspace_bytes(const OjaResidual& s, const DeviceKeysView<T>& keys) {
  s.check(keys);
  return detail::oja_residual_workspace_bytes(keys.heads(), keys.tokens(), keys.head_dim(), s.max_rank(), s.q_heads(),
                                              s.window());
}

/// e_t for every head of `keys` into `out` (device), −inf for invalid keys; compose with select_into.
template <class T>
void score(const OjaResidual& s, const DeviceKeysView<T>& keys, const DeviceScoresView& out, Workspace ws = {},
           stream_t stream = nullptr) {
  if (out.heads() != keys.heads() || out.tokens() != keys.tokens())
    kvscore::detail::throw_invalid(std::string(OjaResidual::name) + ": scores shape (" + std::to_string(out.heads()) +
                                   ", " + std::to_string(out.tokens()) + ") does not match keys (" +
                                   std::to_string(keys.heads()) + ", " + std::to_string(keys.tokens()) + ")");
  s.check(keys);
  detail::oja_residual_score(detail::keys_arg(keys), detail::scores_arg(out), s.device_bases().data(),
                             s.augmented_queries().data(), s.max_rank(), s.q_heads(), s.window(), ws, stream);
}

// ---------------------------------------------------------------- batched Oja update

/// Workspace of the pooled covariance of every head of `rows` (pool = OjaOptions::pool).
template <class T>
std::size_t covariance_workspace_bytes(const DeviceKeysView<T>& rows, std::int64_t pool) {
  detail::check_pool(pool, "kvscore::cuda::covariance_workspace_bytes");
  return detail::oja_covariance_workspace_bytes(rows.heads(), rows.tokens(), rows.head_dim(), pool);
}

/// Asynchronous: cov [heads][d][d] fp64 = X_hᵀX_h / m_h (pooled rows as oja::PooledCovariance;
/// zero for a head without a valid row), valid [heads] and pooled [heads] rows (device; may be null).
template <class T>
void pooled_covariance_into(const DeviceKeysView<T>& rows, std::int64_t pool, Workspace ws, double* cov,
                            std::int64_t* valid = nullptr, std::int64_t* pooled = nullptr, stream_t stream = nullptr) {
  const char* who = "kvscore::cuda::pooled_covariance_into";
  detail::check_pool(pool, who);
  if (rows.tokens() == 0) kvscore::detail::throw_invalid(std::string(who) + ": no rows (0 tokens)");
  if (cov == nullptr && rows.heads() > 0) kvscore::detail::throw_invalid(std::string(who) + ": cov is null");
  detail::oja_covariance(detail::keys_arg(rows), pool, ws, cov, valid, pooled, stream);
}

/// Host copies of the covariances of every head (synchronises `stream`).
struct PooledCovariances {
  std::vector<Eigen::MatrixXd> cov;  ///< one d x d covariance per head
  std::vector<std::int64_t> valid;   ///< valid rows per head
  std::vector<std::int64_t> pooled;  ///< pooled rows per head
};

/// The pooled covariances of every head of `rows` (pool rows per window), copied to the host; synchronises
/// `stream`.
template <class T>
PooledCovariances pooled_covariances(const DeviceKeysView<T>& rows, std::int64_t pool, Workspace ws,
                                     stream_t stream = nullptr) {
  const char* who = "kvscore::cuda::pooled_covariances";
  detail::check_pool(pool, who);
  if (rows.tokens() == 0) kvscore::detail::throw_invalid(std::string(who) + ": no rows (0 tokens)");
  const std::int64_t H = rows.heads(), d = rows.head_dim();
  PooledCovariances r;
  if (H == 0) return r;
  DeviceBuffer c(std::size_t(H * d * d) * sizeof(double)), v(std::size_t(2 * H) * sizeof(std::int64_t));
  pooled_covariance_into(rows, pool, ws, c.as<double>(), v.as<std::int64_t>(), v.as<std::int64_t>() + H, stream);
  synchronize(stream);
  std::vector<double> host(std::size_t(H * d * d));
  std::vector<std::int64_t> counts(std::size_t(2 * H));
  copy_to_host(host.data(), c.get(), host.size() * sizeof(double));
  copy_to_host(counts.data(), v.get(), counts.size() * sizeof(std::int64_t));
  for (std::int64_t h = 0; h < H; ++h) {
    r.cov.push_back(Eigen::Map<const Eigen::MatrixXd>(host.data() + h * d * d, d, d));  // symmetric: layout-free
    r.valid.push_back(counts[std::size_t(h)]);
    r.pooled.push_back(counts[std::size_t(H + h)]);
  }
  return r;
}

/// What one head's update did: valid rows used, Oja steps taken.
struct OjaUpdate {
  std::int64_t valid = 0;  ///< valid rows the update used
  int steps = 0;  ///< Oja steps taken
};

namespace detail {

enum class OjaPhase { prefill, decode };

inline std::vector<OjaBasis*> pointers(std::vector<OjaBasis>& bases) {
  std::vector<OjaBasis*> p;
  for (auto& b : bases) p.push_back(&b);
  return p;
}

template <class T>
std::vector<OjaUpdate> oja_update(const std::vector<OjaBasis*>& bases, const DeviceKeysView<T>& rows, Workspace ws,
                                  stream_t stream, OjaPhase phase, const char* who) {
  if (std::int64_t(bases.size()) != rows.heads())
    kvscore::detail::throw_invalid(std::string(who) + ": " + std::to_string(bases.size()) + " bases for " +
                                   std::to_string(rows.heads()) + " heads");
  if (rows.tokens() == 0) kvscore::detail::throw_invalid(std::string(who) + ": no rows (0 tokens)");
  std::int64_t pool = 0;
  for (std::size_t h = 0; h < bases.size(); ++h) {
    const OjaBasis& b = *bases[h];
    if (b.head_dim() != rows.head_dim())
      kvscore::detail::throw_invalid(std::string(who) + ": basis " + std::to_string(h) + " has head_dim " +
                                     std::to_string(b.head_dim()) + ", rows " + std::to_string(rows.head_dim()));
    if (b.buffered() != 0)
      kvscore::detail::throw_invalid(std::string(who) + ": basis " + std::to_string(h) + " has " +
                                     std::to_string(b.buffered()) +
                                     " decode rows buffered on the host (flush them first)");
    if (h > 0 && b.options().pool != pool)
      kvscore::detail::throw_invalid(std::string(who) + ": basis " + std::to_string(h) + " pools " +
                                     std::to_string(b.options().pool) + " tokens, basis 0 pools " +
                                     std::to_string(pool) + " (one pooling per call)");
    pool = b.options().pool;
  }
  const PooledCovariances pc = pooled_covariances(rows, pool, ws, stream);
  std::vector<OjaUpdate> out(bases.size());
  for (std::size_t h = 0; h < bases.size(); ++h) {
    OjaBasis& b = *bases[h];
    const OjaOptions o = b.options();
    Eigen::MatrixXd u = b.basis();
    out[h].steps = phase == OjaPhase::prefill
                       ? oja::oja_steps(u, pc.cov[h], o.eta_prefill, o.prefill_iterations, o.tolerance)
                       : oja::oja_steps(u, pc.cov[h], o.eta_decode, o.decode_iterations, 0.0);
    out[h].valid = pc.valid[h];
    b = OjaBasis(std::move(u), o);
  }
  return out;
}

}  // namespace detail

/// OjaBasis::prefill of every head of `rows` (basis h <- head h), covariance on the device,
/// steps and QR on the host. Synchronises `stream`. Bases must share OjaOptions::pool and have
/// nothing buffered; decode_updates() and last_steps() restart (the steps are returned).
template <class T>
std::vector<OjaUpdate> prefill(std::vector<OjaBasis>& bases, const DeviceKeysView<T>& rows, Workspace ws,
                               stream_t stream = nullptr) {
  return detail::oja_update(detail::pointers(bases), rows, ws, stream, detail::OjaPhase::prefill,
                            "kvscore::cuda::prefill");
}

/// The decode update of OjaBasis::push once `period` rows are in: `rows` holds those rows of
/// every head (e.g. the last T tokens of the cache). Same rules as prefill().
template <class T>
std::vector<OjaUpdate> decode_update(std::vector<OjaBasis>& bases, const DeviceKeysView<T>& rows, Workspace ws,
                                     stream_t stream = nullptr) {
  return detail::oja_update(detail::pointers(bases), rows, ws, stream, detail::OjaPhase::decode,
                            "kvscore::cuda::decode_update");
}

/// OjaProjector::prefill of every head: U_k from `keys`, U_v from `values`.
template <class KT, class VT>
void prefill(std::vector<OjaProjector>& proj, const DeviceKeysView<KT>& keys, const DeviceKeysView<VT>& values,
             Workspace ws, stream_t stream = nullptr) {
  std::vector<OjaBasis*> k, v;
  for (auto& p : proj) {
    k.push_back(&p.key());
    v.push_back(&p.value());
  }
  detail::oja_update(k, keys, ws, stream, detail::OjaPhase::prefill, "kvscore::cuda::prefill (keys)");
  detail::oja_update(v, values, ws, stream, detail::OjaPhase::prefill, "kvscore::cuda::prefill (values)");
}

}  // namespace kvscore::cuda

#endif  // KVSCORE_CUDA_OJAKV_DECLARATIONS_ONLY
