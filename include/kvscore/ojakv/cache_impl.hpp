// kvscore/ojakv/cache_impl.hpp — OjaHybridCache's numerics (attention, rebase,
// reconstruction, block close; the projections go through the simd kernel table): inline in
// header-only use, compiled once into kvscore::dispatch otherwise (kvscore/detail/compiled.hpp).
#pragma once

#include <algorithm>
#include <limits>

#include "kvscore/ojakv/cache.hpp"

namespace kvscore {

KVSCORE_IMPL_INLINE std::vector<double> OjaHybridCache::attention(std::int64_t h, const float* q) const {
    const std::string who = "kvscore::OjaHybridCache::attention: ";
    if (h < 0 || h >= heads())
      detail::throw_invalid(who + "head " + std::to_string(h) + " out of range [0, " + std::to_string(heads()) + ")");
    if (q == nullptr) detail::throw_invalid(who + "query is null");
    for (std::int64_t j = 0; j < dim_; ++j)
      if (!std::isfinite(q[j])) detail::throw_invalid(who + "query value " + oja::num(q[j]) + " at dim " + std::to_string(j) + " is not finite");
    const oja::RowMajorF k = reconstruct_keys(h), v = reconstruct_values(h);
    const Head& hd = heads_[std::size_t(h)];
    const Pending& pd = pend_[std::size_t(h)];
    const std::int64_t n = tokens();
    auto valid = [&](std::int64_t t) { return t < tokens_ ? hd.valid[std::size_t(t)] != 0 : pd.ok[std::size_t(t - tokens_)] != 0; };
    std::vector<double> logit(std::size_t(n), -std::numeric_limits<double>::infinity());
    double mx = -std::numeric_limits<double>::infinity();
    const double s = 1.0 / std::sqrt(double(dim_));
    for (std::int64_t t = 0; t < n; ++t) {
      if (!valid(t)) continue;
      double z = 0;
      for (std::int64_t j = 0; j < dim_; ++j) z += double(q[j]) * double(k(t, j));
      logit[std::size_t(t)] = z * s;
      mx = std::max(mx, z * s);
    }
    std::vector<double> o(std::size_t(dim_), 0.0);
    if (mx == -std::numeric_limits<double>::infinity()) return o;  // no valid token
    double sum = 0;
    for (std::int64_t t = 0; t < n; ++t) {
      if (!valid(t)) continue;
      const double e = std::exp(logit[std::size_t(t)] - mx);
      sum += e;
      for (std::int64_t j = 0; j < dim_; ++j) o[std::size_t(j)] += e * double(v(t, j));
    }
    for (double& x : o) x /= sum;
    return o;
  }

KVSCORE_IMPL_INLINE void OjaHybridCache::attend(std::int64_t h, const float* q, float* out, double scale,
                                                AttendWorkspace& ws) const {
    const Head& hd = head(h);
    const Pending& pd = pend_[std::size_t(h)];
    const std::int64_t d = dim_, rk = hd.uk.cols(), rv = hd.uv.cols();
    const std::int64_t nl = hd.codes_k.rows(), nf = hd.full_k.rows(), np = pending_;
    const simd::KernelTable& kt = simd::active_table();
    const double s = scale > 0 ? scale : 1.0 / std::sqrt(double(d));
    // logits in the store's order: low-rank tokens, full rows, the open block
    ws.qt.resize(std::size_t(rk));
    ws.logit.resize(std::size_t(nl + nf + np));
    kt.f32.project(q, 1, d, d, hd.uk.data(), rk, ws.qt.data());  // q̃ = U_kᵀq
    if (nl > 0) kt.f32.dot(hd.codes_k.data(), nl, rk, rk, ws.qt.data(), ws.logit.data());
    if (nf > 0) kt.f32.dot(hd.full_k.data(), nf, d, d, q, ws.logit.data() + nl);
    if (np > 0) kt.f32.dot(pd.k.data(), np, d, d, q, ws.logit.data() + nl + nf);
    // validity in the same order: walk the committed tokens once (is_full splits them)
    constexpr float kMasked = -std::numeric_limits<float>::infinity();
    for (std::int64_t t = 0, a = 0, b = 0; t < tokens_; ++t) {
      const bool ok = hd.valid[std::size_t(t)] != 0;
      float& l = hd.is_full[std::size_t(t)] ? ws.logit[std::size_t(nl + a++)] : ws.logit[std::size_t(b++)];
      if (!ok) l = kMasked;
    }
    for (std::int64_t i = 0; i < np; ++i)
      if (!pd.ok[std::size_t(i)]) ws.logit[std::size_t(nl + nf + i)] = kMasked;
    double mx = -std::numeric_limits<double>::infinity();
    for (float l : ws.logit)
      if (l != kMasked) mx = std::max(mx, double(l) * s);
    std::fill(out, out + d, 0.f);
    if (mx == -std::numeric_limits<double>::infinity()) return;  // no valid token
    ws.acc_r.assign(std::size_t(rv), 0.0);
    ws.acc_d.assign(std::size_t(d), 0.0);
    double z = 0;
    for (std::int64_t i = 0; i < nl + nf + np; ++i) {
      const float l = ws.logit[std::size_t(i)];
      if (l == kMasked) continue;
      const double p = std::exp(double(l) * s - mx);
      z += p;
      if (i < nl) {
        const float* c = hd.codes_v.data() + i * rv;
        for (std::int64_t j = 0; j < rv; ++j) ws.acc_r[std::size_t(j)] += p * double(c[j]);
      } else {
        const float* v = i < nl + nf ? hd.full_v.data() + (i - nl) * d : pd.v.data() + (i - nl - nf) * d;
        for (std::int64_t j = 0; j < d; ++j) ws.acc_d[std::size_t(j)] += p * double(v[j]);
      }
    }
    // out = (U_v acc_r + acc_d) / z; U_v is d x r column-major
    for (std::int64_t j = 0; j < rv; ++j) {
      const double a = ws.acc_r[std::size_t(j)];
      if (a == 0) continue;
      const float* u = hd.uv.data() + j * d;
      for (std::int64_t x = 0; x < d; ++x) ws.acc_d[std::size_t(x)] += a * double(u[x]);
    }
    for (std::int64_t x = 0; x < d; ++x) out[x] = float(ws.acc_d[std::size_t(x)] / z);
  }

KVSCORE_IMPL_INLINE void OjaHybridCache::crop(std::vector<OjaProjector>& proj, std::int64_t n,
                                              const OjaDecodeOptions& opt) {
    const std::string who = "kvscore::OjaHybridCache::crop: ";
    if (n < tokens_ || n > tokens())
      detail::throw_invalid(who + "n " + std::to_string(n) + " out of range [" + std::to_string(tokens_) + ", " +
                            std::to_string(tokens()) + "] (tokens before " + std::to_string(tokens_) +
                            " are in closed blocks, encoded in the updated basis)");
    check_decode(proj, opt, "kvscore::OjaHybridCache::crop");
    const std::int64_t keep = n - tokens_, d = dim_;
    for (std::size_t h = 0; h < pend_.size(); ++h) {
      Pending& p = pend_[h];
      p.k.resize(std::size_t(keep * d));
      p.v.resize(std::size_t(keep * d));
      p.q.resize(std::size_t(keep * p.group * d));
      p.ok.resize(std::size_t(keep));
      if (keep == 0) p.group = 0;
      if (opt.adapt) {
        proj[h].key().drop_buffered(keep);
        proj[h].value().drop_buffered(keep);
      }
    }
    pending_ = keep;
  }

KVSCORE_IMPL_INLINE void OjaHybridCache::rebase(std::int64_t h, const OjaProjector& p) {
    const std::string who = "kvscore::OjaHybridCache::rebase: ";
    if (h < 0 || h >= heads())
      detail::throw_invalid(who + "head " + std::to_string(h) + " out of range [0, " + std::to_string(heads()) + ")");
    if (p.head_dim() != dim_)
      detail::throw_invalid(who + "projector has head_dim " + std::to_string(p.head_dim()) + ", cache " +
                            std::to_string(dim_));
    Head& hd = heads_[std::size_t(h)];
    // Stays in Eigen, fp64: an r × r' change of basis formed once per block (O(d r r')), not a
    // pass over rows; fp64 keeps it exact to the final fp32 rounding.
    const Eigen::MatrixXd uk = p.key().basis(), uv = p.value().basis();
    const Eigen::MatrixXf mk = (hd.uk.cast<double>().transpose() * uk).cast<float>();  // r x r', fp64 then rounded
    const Eigen::MatrixXf mv = (hd.uv.cast<double>().transpose() * uv).cast<float>();
    hd.codes_k = oja::RowMajorF(hd.codes_k * mk);
    hd.codes_v = oja::RowMajorF(hd.codes_v * mv);
    hd.uk = uk.cast<float>();
    hd.uv = uv.cast<float>();
  }

KVSCORE_IMPL_INLINE oja::RowMajorF OjaHybridCache::reconstruct(std::int64_t h, bool keys) const {
    const Head& hd = head(h);
    const oja::RowMajorF& codes = keys ? hd.codes_k : hd.codes_v;
    const Eigen::MatrixXf& u = keys ? hd.uk : hd.uv;  // d × r column-major: the r basis rows unproject takes
    const oja::RowMajorF& full = keys ? hd.full_k : hd.full_v;
    const simd::KernelTable& kt = simd::active_table();
    const std::int64_t r = u.cols();
    oja::RowMajorF out(tokens(), dim_);
    // Full rows are copied; each run of low-rank tokens is K~ Uᵀ written in place by the table's
    // unproject kernel (out is row-major, so a run of rows is contiguous).
    for (std::int64_t t = 0, a = 0, b = 0; t < tokens_;) {
      if (hd.is_full[std::size_t(t)]) {
        out.row(t++) = full.row(a++);
        continue;
      }
      std::int64_t e = t;
      while (e < tokens_ && !hd.is_full[std::size_t(e)]) ++e;
      kt.unproject(codes.data() + b * r, e - t, r, u.data(), dim_, out.data() + t * dim_);
      b += e - t;
      t = e;
    }
    const std::vector<float>& open = keys ? pend_[std::size_t(h)].k : pend_[std::size_t(h)].v;
    for (std::int64_t i = 0; i < pending_; ++i)
      out.row(tokens_ + i) = Eigen::Map<const Eigen::RowVectorXf>(open.data() + i * dim_, dim_);
    return out;
  }

KVSCORE_IMPL_INLINE void OjaHybridCache::check_decode(const std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt,
                                                      const char* who) const {
    const std::string w = std::string(who) + ": ";
    opt.validate(who);
    if (heads_.empty()) detail::throw_invalid(w + "the cache has no heads");
    if (proj.size() != heads_.size())
      detail::throw_invalid(w + std::to_string(proj.size()) + " projectors for " + std::to_string(heads_.size()) + " heads");
    const std::int64_t T = proj[0].key().options().period;
    for (std::size_t h = 0; h < proj.size(); ++h) {
      const OjaProjector& p = proj[h];
      const std::string ph = "projector " + std::to_string(h);
      if (p.head_dim() != dim_)
        detail::throw_invalid(w + ph + " has head_dim " + std::to_string(p.head_dim()) + ", cache " + std::to_string(dim_));
      if (p.key().options().period != T || p.value().options().period != T)
        detail::throw_invalid(w + ph + " has periods " + std::to_string(p.key().options().period) + "/" +
                              std::to_string(p.value().options().period) + " (key/value), projector 0 has key period " +
                              std::to_string(T) + ": every basis must use the same T (it is the block length)");
      if (opt.adapt && (p.key().buffered() != pending_ || p.value().buffered() != pending_))
        detail::throw_invalid(w + ph + " has " + std::to_string(p.key().buffered()) + "/" +
                              std::to_string(p.value().buffered()) + " buffered rows (key/value) but the open block holds " +
                              std::to_string(pending_) + " tokens (push decoded tokens through append only)");
    }
  }

KVSCORE_IMPL_INLINE void OjaHybridCache::commit(std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt) {
    check_decode(proj, opt, "kvscore::OjaHybridCache::commit");
    if (pending_ == 0) return;
    if (opt.adapt)
      for (auto& p : proj) {
        p.key().flush();
        p.value().flush();
      }
    close_block(proj, opt);
  }

// One block closes: rebase onto the (updated) bases, score the block with the residual rule, keep
// its top share at full rank, encode the rest in the new bases, append both in position order.
KVSCORE_IMPL_INLINE void OjaHybridCache::close_block(std::vector<OjaProjector>& proj, const OjaDecodeOptions& opt) {
    const std::int64_t n = pending_, d = dim_;
    const std::int64_t keep = budget_from_ratio(n, opt.full_rank_fraction);
    for (std::int64_t h = 0; h < heads(); ++h) {
      if (opt.adapt) rebase(h, proj[std::size_t(h)]);
      Head& hd = heads_[std::size_t(h)];
      Pending& p = pend_[std::size_t(h)];
      const std::int64_t G = p.group;
      // OjaResidual wants queries [G][window][d]; the block holds them [n][G][d].
      std::vector<float> qw(static_cast<std::size_t>(G * n * d));
      for (std::int64_t i = 0; i < n; ++i)
        for (std::int64_t g = 0; g < G; ++g)
          std::copy_n(p.q.data() + (i * G + g) * d, d, qw.data() + (g * n + i) * d);
      OjaResidual rule(qw.data(), G, n, d, {hd.uk.cast<double>()});
      rule.num_threads = 1;
      const KeysView<float> block(p.k.data(), 1, n, d, n * d, d);
      Scores e = rule.score(block);
      for (std::int64_t i = 0; i < n; ++i)
        if (!p.ok[std::size_t(i)]) e.view().head(0)[i] = kInvalidScore;  // a bad value row makes the token invalid too
      std::int64_t valid = 0;
      for (unsigned char o : p.ok) valid += o;
      const Selection full = select(e, Budget::per_head(std::min(keep, valid)));
      std::vector<unsigned char> is_full(static_cast<std::size_t>(n), 0);
      for (std::int64_t t : full.head(0)) is_full[std::size_t(t)] = 1;
      const std::int64_t nf = std::int64_t(full.head(0).size()), nl = n - nf;
      const Eigen::Map<const oja::RowMajorF> bk(p.k.data(), n, d), bv(p.v.data(), n, d);
      oja::RowMajorF lk(nl, d), lv(nl, d);
      const std::int64_t f0 = hd.full_k.rows(), c0 = hd.codes_k.rows();
      hd.full_k.conservativeResize(f0 + nf, d);
      hd.full_v.conservativeResize(f0 + nf, d);
      for (std::int64_t i = 0, a = 0, b = 0; i < n; ++i) {
        const std::size_t ui = std::size_t(i);
        if (is_full[ui]) {
          hd.full_k.row(f0 + a) = bk.row(i);
          hd.full_v.row(f0 + a++) = bv.row(i);
          hd.full_pos.push_back(tokens_ + i);
        } else {
          lk.row(b) = bk.row(i);
          lv.row(b++) = bv.row(i);
        }
        hd.is_full.push_back(is_full[ui]);
        hd.valid.push_back(p.ok[ui]);
      }
      hd.codes_k.conservativeResize(c0 + nl, hd.uk.cols());
      hd.codes_v.conservativeResize(c0 + nl, hd.uv.cols());
      const simd::KernelTable& kt = simd::active_table();  // the project kernel, as in build()
      encode(kt, lk.data(), nl, hd.uk, hd.codes_k.data() + c0 * hd.uk.cols());
      encode(kt, lv.data(), nl, hd.uv, hd.codes_v.data() + c0 * hd.uv.cols());
      p = Pending{};
    }
    tokens_ += n;
    pending_ = 0;
  }

}  // namespace kvscore
