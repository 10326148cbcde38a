// kvscore/ojakv/cache.hpp — OjaKV's hybrid store (ojakv.txt §3): per KV head, codes
// K~ = K U_k, V~ = V U_v for most tokens and full rows for the tokens the residual rule keeps;
// reconstruction K^ = K~ U_k^T, reference attention, memory accounting, and append() during
// generation (blocks of T tokens: basis update, rebase, the residual rule on the block, codes
// in the new basis). The projectors and the residual scorer are in kvscore/ojakv/ojakv.hpp; the
// decisions are in docs/methods/ojakv.md.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <Eigen/Dense>

#include "kvscore/detail/compiled.hpp"
#include "kvscore/ojakv/ojakv.hpp"
#include "kvscore/core/selection.hpp"
#include "kvscore/core/view.hpp"
#include "kvscore/simd/dispatch.hpp"

namespace kvscore {

// ------------------------------------------------------------------ hybrid cache

/// Bytes of one KV head under OjaKV vs full rank (ojakv.txt A.4.2, extended to the hybrid
/// store): low-rank tokens (r_k + r_v)·b, full-rank tokens 2d·b + a 4-byte position, plus the
/// two bases d·(r_k + r_v)·b. Full rank: 2d·b per token.
struct OjaMemory {
  std::int64_t full_bytes = 0;    ///< tokens · 2d · b
  std::int64_t hybrid_bytes = 0;  ///< as above
  double ratio = 0;               ///< hybrid / full (0 when the cache is empty)
};

/// The bytes of one KV head of `tokens` tokens, `full_rank_tokens` of them at full rank, with bases of ranks rank_k
/// and rank_v, at `bytes_per_scalar` bytes per element (std::invalid_argument for a bad value).
inline OjaMemory ojakv_memory(std::int64_t tokens, std::int64_t full_rank_tokens, std::int64_t head_dim,
                              std::int64_t rank_k, std::int64_t rank_v, std::int64_t bytes_per_scalar) {
  const char* who = "kvscore::ojakv_memory";
  if (tokens < 0) detail::throw_invalid(std::string(who) + ": tokens must be >= 0 (got " + std::to_string(tokens) + ")");
  if (full_rank_tokens < 0 || full_rank_tokens > tokens)
    detail::throw_invalid(std::string(who) + ": full-rank tokens " + std::to_string(full_rank_tokens) +
                          " out of range [0, " + std::to_string(tokens) + "]");
  oja::check_rank(who, head_dim, rank_k);
  oja::check_rank(who, head_dim, rank_v);
  if (bytes_per_scalar < 1)
    detail::throw_invalid(std::string(who) + ": bytes_per_scalar must be >= 1 (got " + std::to_string(bytes_per_scalar) + ")");
  OjaMemory m;
  const std::int64_t b = bytes_per_scalar;
  m.full_bytes = tokens * 2 * head_dim * b;
  m.hybrid_bytes = (tokens - full_rank_tokens) * (rank_k + rank_v) * b + full_rank_tokens * (2 * head_dim * b + 4) +
                   head_dim * (rank_k + rank_v) * b;
  m.ratio = m.full_bytes > 0 ? double(m.hybrid_bytes) / double(m.full_bytes) : 0.0;
  return m;
}

/// Decode-time policy of OjaHybridCache::append (docs/methods/ojakv.md "Decode").
struct OjaDecodeOptions {
  /// Share of every closed block kept at full rank: budget_from_ratio(block, fraction) tokens
  /// (nearest integer, at least 1 when > 0), the top of the block's residual scores.
  double full_rank_fraction = 0.1;
  /// true: every (k, v) goes into the projectors and each block closes with their update and a
  /// rebase (OjaKV); false: the bases stay as built (the frozen / StaticPCA baseline).
  bool adapt = true;

  /// Throws std::invalid_argument (naming `who`) for a fraction outside [0, 1].
  void validate(const char* who) const {
    if (!(full_rank_fraction >= 0 && full_rank_fraction <= 1))
      detail::throw_invalid(std::string(who) + ": full_rank_fraction must be in [0, 1] (got " +
                            oja::num(full_rank_fraction) + ")");
  }
};

/// The OjaKV store of one layer: per head, fp32 codes K~ = K U_k, V~ = V U_v of the low-rank
/// tokens and the full rows of the selected tokens (`full_rank`, e.g. select() on OjaResidual
/// scores). The bases are copied (fp32) at build time.
///
/// Generation (append): decoded tokens form blocks of T = the projectors' period. While a block
/// is open its rows are held at full rank (they are the paper's buffer B_k, B_v, needed for the
/// update anyway) together with the step queries. When it closes: the projectors update (Oja
/// step + QR), every stored code is rebased into the new bases, the block's residual scores
/// e_t (OjaResidual, the block's queries as the causal window) choose which of its tokens stay
/// at full rank, and the rest become codes in the new bases. Head's arrays describe the closed
/// (committed) tokens; the open block is counted by tokens(), pending(), memory(),
/// reconstruct_*() and attention().
class OjaHybridCache {
 public:
  /// One KV head's store: the bases, the codes of the low-rank tokens, the full rows of the others.
  struct Head {
    Eigen::MatrixXf uk;  ///< U_k, d x r_k
    Eigen::MatrixXf uv;  ///< U_v, d x r_v
    oja::RowMajorF codes_k;  ///< K~ of the low-rank tokens, [tokens][r_k]
    oja::RowMajorF codes_v;  ///< V~ of the low-rank tokens, [tokens][r_v]
    oja::RowMajorF full_k;  ///< keys of the full-rank tokens, [tokens][d]
    oja::RowMajorF full_v;  ///< values of the full-rank tokens, [tokens][d]
    std::vector<std::int64_t> full_pos;     ///< ascending positions stored at full rank
    std::vector<unsigned char> is_full;     ///< per token
    std::vector<unsigned char> valid;       ///< per token: key and value rows valid
  };

  /// The store of one layer from its projectors (one per KV head), keys and values ([heads][tokens][d]) and the
  /// tokens kept at full rank; std::invalid_argument for shapes that do not agree.
  template <KeyCacheView KView, KeyCacheView VView>
  static OjaHybridCache build(const std::vector<OjaProjector>& proj, const KView& keys, const VView& values,
                              const Selection& full_rank) {
    const std::string who = "kvscore::OjaHybridCache::build: ";
    const std::int64_t H = keys.heads(), N = keys.tokens(), d = keys.head_dim();
    if (values.heads() != H || values.tokens() != N || values.head_dim() != d)
      detail::throw_invalid(who + "values (" + std::to_string(values.heads()) + ", " + std::to_string(values.tokens()) +
                            ", " + std::to_string(values.head_dim()) + ") do not match keys (" + std::to_string(H) +
                            ", " + std::to_string(N) + ", " + std::to_string(d) + ")");
    if (std::int64_t(proj.size()) != H)
      detail::throw_invalid(who + std::to_string(proj.size()) + " projectors for " + std::to_string(H) + " heads");
    if (N == 0) detail::throw_invalid(who + "empty cache (0 tokens)");
    if (full_rank.heads != H || full_rank.tokens != N || std::int64_t(full_rank.offsets.size()) != H + 1)
      detail::throw_invalid(who + "selection is for (" + std::to_string(full_rank.heads) + " heads, " +
                            std::to_string(full_rank.tokens) + " tokens), the cache is (" + std::to_string(H) + ", " +
                            std::to_string(N) + ")");
    OjaHybridCache c;
    c.tokens_ = N;
    c.dim_ = d;
    c.heads_.resize(std::size_t(H));
    c.pend_.resize(std::size_t(H));
    for (std::int64_t h = 0; h < H; ++h) {
      const OjaProjector& p = proj[std::size_t(h)];
      if (p.head_dim() != d)
        detail::throw_invalid(who + "projector " + std::to_string(h) + " has head_dim " + std::to_string(p.head_dim()) +
                              ", keys " + std::to_string(d));
      Head& hd = c.heads_[std::size_t(h)];
      hd.uk = p.key().basis_f32();
      hd.uv = p.value().basis_f32();
      hd.is_full.assign(std::size_t(N), 0);
      std::int64_t prev = -1;
      for (std::int64_t t : full_rank.head(h)) {
        if (t <= prev || t >= N)
          detail::throw_invalid(who + "head " + std::to_string(h) + ": full-rank position " + std::to_string(t) +
                                " is out of range or not ascending");
        hd.is_full[std::size_t(t)] = 1;
        hd.full_pos.push_back(t);
        prev = t;
      }
      const std::int64_t nf = std::int64_t(hd.full_pos.size());
      oja::RowMajorF k = rows_f32(keys, h, N, d), v = rows_f32(values, h, N, d);
      hd.valid.assign(std::size_t(N), 1);
      for (std::int64_t t = 0; t < N; ++t) {
        double sk = 0, sv = 0;
        for (std::int64_t j = 0; j < d; ++j) {
          sk += double(k(t, j)) * k(t, j);
          sv += double(v(t, j)) * v(t, j);
        }
        hd.valid[std::size_t(t)] = oja::row_ok(sk) && oja::row_ok(sv) ? 1 : 0;
      }
      oja::RowMajorF lk(N - nf, d), lv(N - nf, d);
      hd.full_k.resize(nf, d);
      hd.full_v.resize(nf, d);
      for (std::int64_t t = 0, a = 0, b = 0; t < N; ++t) {
        if (hd.is_full[std::size_t(t)]) {
          hd.full_k.row(a) = k.row(t);
          hd.full_v.row(a++) = v.row(t);
        } else {
          lk.row(b) = k.row(t);
          lv.row(b++) = v.row(t);
        }
      }
      const simd::KernelTable& kt = simd::active_table();
      encode(kt, lk.data(), N - nf, hd.uk, hd.codes_k);  // the table's project kernel, fp32 accumulation
      encode(kt, lv.data(), N - nf, hd.uv, hd.codes_v);
    }
    return c;
  }

  std::int64_t heads() const noexcept { return std::int64_t(heads_.size()); }  ///< KV heads
  /// Every token held: committed + pending.
  std::int64_t tokens() const noexcept { return tokens_ + pending_; }
  /// Tokens described by Head's arrays (prefill + closed blocks).
  std::int64_t committed() const noexcept { return tokens_; }
  /// Tokens of the open decode block (held at full rank until it closes).
  std::int64_t pending() const noexcept { return pending_; }
  std::int64_t head_dim() const noexcept { return dim_; }  ///< dimensions of a key and a value
  /// Head h's committed store (std::out_of_range for a bad h).
  const Head& head(std::int64_t h) const { return heads_.at(std::size_t(h)); }

  /// K^ of head h [tokens][d]: full rows for full-rank tokens, K~ U_k^T for the others.
  oja::RowMajorF reconstruct_keys(std::int64_t h) const { return reconstruct(h, true); }
  /// V^ of head h [tokens][d], as reconstruct_keys.
  oja::RowMajorF reconstruct_values(std::int64_t h) const { return reconstruct(h, false); }

  /// Reference attention of one query over head h: softmax(q K^^T / √d) V^ (d outputs),
  /// logits and sums in fp64, invalid tokens masked out. q: d floats, finite.
  std::vector<double> attention(std::int64_t h, const float* q) const;

  /// Scratch of attend(); one per thread (or per head), reused: no allocation once warm.
  struct AttendWorkspace {
    std::vector<float> qt;     ///< U_kᵀq
    std::vector<float> logit;  ///< one logit per token
    std::vector<float> row;    ///< a decoded row
    std::vector<double> acc_r;  ///< Σ p ṽ, [r_v]
    std::vector<double> acc_d;  ///< Σ p v, [d]
  };

  /// The low-rank attention of one query over head h (ojakv.txt A.4), what a decode step runs:
  /// logits q̃·k̃ for the low-rank tokens (q̃ = U_kᵀq, so (qU_k)K̃ᵀ = qK̂ᵀ), q·k for the full rows
  /// and the open block, softmax with fp64 sums, and out = U_v(Σ p_i ṽ_i) + Σ p_j v_j (d floats).
  /// No reconstruction: O(n·r) per low-rank token instead of O(n·d). scale multiplies q·k (0 =
  /// 1/√d); invalid tokens are masked; with no valid token out is 0. Equal to attention() up to
  /// fp32 rounding (tests/test_ojakv_decode.cpp). q: d finite floats (not re-checked: hot path).
  void attend(std::int64_t h, const float* q, float* out, double scale, AttendWorkspace& ws) const;

  /// Keeps the first n tokens, n in [committed(), tokens()]: drops the newest tokens of the open
  /// block (a question and its answer leaving a generation's cache), and, with opt.adapt, their
  /// rows in the projectors' buffers, so the next update is the one the kept tokens give.
  /// Tokens of closed blocks cannot be dropped (their codes are in the updated basis).
  void crop(std::vector<OjaProjector>& proj, std::int64_t n, const OjaDecodeOptions& opt = {});

  /// After a basis update (OjaProjector::push / flush), re-expresses head h's codes in the
  /// projector's current bases: K~ <- K~ (U_k_old^T U_k_new), the same for V. The new
  /// reconstruction is the projection of the old one onto the new subspace (information outside
  /// the old subspace is gone already); full-rank rows are untouched. Cost O(n r r') per head.
  void rebase(std::int64_t h, const OjaProjector& p);

  /// Memory of head h under this store (ojakv_memory with its ranks and full-rank count; the
  /// open block's tokens are full-rank tokens).
  OjaMemory memory(std::int64_t h, std::int64_t bytes_per_scalar) const {
    const Head& hd = head(h);
    return ojakv_memory(tokens(), std::int64_t(hd.full_pos.size()) + pending_, dim_, hd.uk.cols(), hd.uv.cols(),
                        bytes_per_scalar);
  }

  /// Bytes head h holds now (element counts, not capacities): codes, full rows and bases (fp32),
  /// 8-byte positions, the two per-token flags, and the open block's rows, queries and flags.
  /// memory(h, 4) is the same store counted by the paper's formula (4-byte positions, no flags,
  /// no queries); tests/test_ojakv_decode.cpp compares the two.
  std::int64_t stored_bytes(std::int64_t h) const {
    const Head& hd = head(h);
    const Pending& p = pend_.at(std::size_t(h));
    const auto f = std::int64_t(sizeof(float));
    return f * (hd.codes_k.size() + hd.codes_v.size() + hd.full_k.size() + hd.full_v.size() + hd.uk.size() +
                hd.uv.size()) +
           std::int64_t(sizeof(std::int64_t) * hd.full_pos.size() + hd.is_full.size() + hd.valid.size()) +
           f * std::int64_t(p.k.size() + p.v.size() + p.q.size()) + std::int64_t(p.ok.size());
  }

  /// Decode: appends one token to every head. k, v: [heads][head_dim] (T = float, half or
  /// bfloat16); q: the step's queries [q_heads][head_dim] fp32 (q_heads a multiple of heads,
  /// GQA groups contiguous), the window of the residual rule. `proj` are the projectors the
  /// cache was built from (or any with the same head_dim); with opt.adapt they receive (k, v)
  /// and must have buffered exactly the open block (push decoded tokens through append only).
  /// The block closes after T = proj[h].key().options().period tokens. Every argument is
  /// checked before anything changes.
  template <class T>
  void append(std::vector<OjaProjector>& proj, const T* k, const T* v, const float* q, std::int64_t q_heads,
              const OjaDecodeOptions& opt = {});

  /// Closes the open block now (fewer than T tokens; with opt.adapt the projectors flush()).
  /// No-op when no block is open.
  void commit(std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt = {});

 private:
  template <class View>
  static oja::RowMajorF rows_f32(const View& x, std::int64_t h, std::int64_t n, std::int64_t d) {
    oja::RowMajorF m(n, d);
    x.for_each_run(h, [&](const typename View::value_type* first, std::int64_t t0, std::int64_t len, std::int64_t stride) {
      for (std::int64_t i = 0; i < len; ++i)
        for (std::int64_t j = 0; j < d; ++j) m(t0 + i, j) = to_float(first[i * stride + j]);
    });
    return m;
  }

  oja::RowMajorF reconstruct(std::int64_t h, bool keys) const;

  /// codes[0, n) <- rows · u through the kernel table (simd::KernelTable f32.project): rows are n
  /// contiguous fp32 rows of u.rows(); u (d × r, column-major) is the r contiguous basis rows the
  /// kernel takes. codes must already hold n rows of u.cols().
  static void encode(const simd::KernelTable& kt, const float* rows, std::int64_t n, const Eigen::MatrixXf& u,
                     float* codes) noexcept {
    kt.f32.project(rows, n, u.rows(), u.rows(), u.data(), u.cols(), codes);
  }
  static void encode(const simd::KernelTable& kt, const float* rows, std::int64_t n, const Eigen::MatrixXf& u,
                     oja::RowMajorF& codes) {
    codes.resize(n, u.cols());
    encode(kt, rows, n, u, codes.data());
  }

  /// The open decode block of one head: rows fp32 [n][d], queries [n][G][d], validity.
  struct Pending {
    std::vector<float> k, v, q;
    std::vector<unsigned char> ok;
    std::int64_t group = 0;  ///< G of the block (fixed while it is open)
  };

  void check_decode(const std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt, const char* who) const;
  void close_block(std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt);

  std::vector<Head> heads_;
  std::vector<Pending> pend_;
  std::int64_t tokens_ = 0, dim_ = 0, pending_ = 0;
};

template <class T>
void OjaHybridCache::append(std::vector<OjaProjector>& proj, const T* k, const T* v, const float* q,
                            std::int64_t q_heads, const OjaDecodeOptions& opt) {
  static_assert(is_element_type_v<T>, "OjaHybridCache::append: T must be float, half or bfloat16");
  const char* who = "kvscore::OjaHybridCache::append";
  const std::string w = std::string(who) + ": ";
  check_decode(proj, opt, who);
  if (k == nullptr || v == nullptr || q == nullptr)
    detail::throw_invalid(w + (k == nullptr ? "k" : v == nullptr ? "v" : "q") + " is null");
  const std::int64_t H = heads(), d = dim_;
  if (q_heads <= 0 || q_heads % H != 0)
    detail::throw_invalid(w + "q_heads " + std::to_string(q_heads) + " is not a positive multiple of the " +
                          std::to_string(H) + " KV heads");
  const std::int64_t G = q_heads / H;
  if (pending_ > 0 && G != pend_[0].group)
    detail::throw_invalid(w + "q_heads " + std::to_string(q_heads) + " changed inside the open block (it had " +
                          std::to_string(pend_[0].group * H) + ")");
  for (std::int64_t i = 0; i < q_heads * d; ++i)
    if (!std::isfinite(q[i]))
      detail::throw_invalid(w + "query value " + oja::num(q[i]) + " at [q head " + std::to_string(i / d) + ", dim " +
                            std::to_string(i % d) + "] is not finite");
  // Everything is checked; from here on nothing throws except allocation.
  for (std::int64_t h = 0; h < H; ++h) {
    Pending& p = pend_[std::size_t(h)];
    p.group = G;
    const T* kr = k + h * d;
    const T* vr = v + h * d;
    double sk = 0, sv = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      const float a = to_float(kr[j]), b = to_float(vr[j]);
      p.k.push_back(a);
      p.v.push_back(b);
      sk += double(a) * a;
      sv += double(b) * b;
    }
    p.ok.push_back(oja::row_ok(sk) && oja::row_ok(sv) ? 1 : 0);
    p.q.insert(p.q.end(), q + h * G * d, q + (h + 1) * G * d);
    if (opt.adapt) proj[std::size_t(h)].push(kr, vr);
  }
  // every basis has the same period (check_decode): it is the block length
  if (++pending_ >= proj[0].key().options().period) close_block(proj, opt);
}

}  // namespace kvscore

#if !defined(KVSCORE_COMPILED)
#include "kvscore/ojakv/cache_impl.hpp"
#endif
