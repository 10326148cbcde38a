// OjaKV during generation (OjaHybridCache::append / commit, docs/methods/ojakv.md "Decode"): every
// block checked against a brute-force fp64 simulation (bases from the same projectors, the
// residual rule from its definition, codes rebased basis by basis), a 64K-token generation on
// drifting synthetic keys against the frozen basis (output error, memory per token against the
// accounting formula), RoPE-rotated keys, element types and error paths.
#include <catch2/catch.hpp>

#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/select.hpp>
#include <kvscore/synth.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "test_support.hpp"

namespace {

using Catch::Matchers::Contains;
using kvscore::KeysView;
using kvscore::OjaDecodeOptions;
using kvscore::OjaHybridCache;
using kvscore::OjaOptions;
using kvscore::OjaProjector;
using Mat = Eigen::MatrixXd;

KeysView<float> heads_view(const std::vector<float>& v, std::int64_t H, std::int64_t n, std::int64_t d,
                           std::int64_t cap) {
  return KeysView<float>(v.data(), H, n, d, cap * d, d);
}

// The 64K-step generations below run in optimised builds only (CI's test step). The Debug
// sanitizer build is about 40x slower on Eigen's loops, where each would take many minutes; the
// code they run (append, block close, rebase, reconstruction) is the code the brute-force test
// (below) runs there in full.
}  // namespace

#if defined(NDEBUG)
namespace {

constexpr std::int64_t kSteps = 65536;

/// Eigen's products on one thread for a generation run, restored after it. Each product is small
/// (a block's rebase, a reconstruction, a checkpoint's probes), and with two OpenMP threads on a
/// busy 2-core machine the threads spent their time waiting for each other: a run took over 200 s
/// under ctest -j2, 13 s on one thread, with the same results (every printed digit).
struct SerialEigen {
  const int before = Eigen::nbThreads();
  SerialEigen() { Eigen::setNbThreads(1); }
  ~SerialEigen() { Eigen::setNbThreads(before); }
  SerialEigen(const SerialEigen&) = delete;
  SerialEigen& operator=(const SerialEigen&) = delete;
};

/// Attention of the probes Q [m][d] over rows [0, n) of one head, all probes at once: fp32
/// logits (an Eigen GEMM), softmax and outputs in fp64; column i is probe i's output [d].
Eigen::MatrixXd exact_attention(const float* K, const float* V, std::int64_t n, std::int64_t d, const Eigen::MatrixXf& Q) {
  using Rows = Eigen::Map<const kvscore::oja::RowMajorF>;
  const Eigen::MatrixXf z = Rows(K, n, d) * Q.transpose();  // [n][m]
  Eigen::MatrixXd p = z.cast<double>() / std::sqrt(double(d));
  for (Eigen::Index i = 0; i < p.cols(); ++i) {
    p.col(i) = (p.col(i).array() - p.col(i).maxCoeff()).exp();
    p.col(i) /= p.col(i).sum();
  }
  const Eigen::MatrixXd v = Rows(V, n, d).cast<double>();
  return v.transpose() * p;
}

double rel_error(const Eigen::VectorXd& a, const Eigen::VectorXd& b) { return (a - b).norm() / b.norm(); }

}  // namespace

namespace {


struct DriftErrors {
  // mean relative attention error per KV head, probes aimed at the last 1K tokens / anywhere
  std::vector<double> adapted, frozen, adapted_any, frozen_any;
  // key RER (||K − K^||² / ||K||²) at the end over the first / last 4K tokens, mean over heads
  double rer_first_adapted = 0, rer_first_frozen = 0, rer_last_adapted = 0, rer_last_frozen = 0;
};

/// kvscore synth drift: topic centres move every 256 tokens inside a 9-dim subspace (the mean
/// direction and 8 topic directions) plus isotropic noise. 4 KV heads, d = 64, ranks 12 + 12.
/// Values are the keys of further synth heads (synth's own values are isotropic noise, which no
/// basis can learn; drifting structured values exercise U_v as the keys exercise U_k). With
/// `shift`, every stream switches after a quarter of the decode steps to another synth head
/// (another subspace: a change of task). A 4K prompt (prefill update + residual selection of
/// 10%), then kSteps decode steps whose query is the new token's own key, adapted and frozen from
/// the same start. Every kSteps/8 steps 32 probes per head (half aimed at the last 1K tokens,
/// half anywhere: 0.25·k_target + noise, attention spread over the target's topic) are compared
/// with exact attention over the whole cache (attention over the reconstruction, which equals
/// OjaHybridCache::attention: test_ojakv.cpp). With `rope` keys are rotated by their position
/// first: the cache takes post-RoPE rows as an engine holds them.
DriftErrors drift_run(bool shift, bool rope) {
  const SerialEigen serial;
  const std::int64_t H = 4, d = 64, r = 12, prefill = 4096, steps = kSteps, N = prefill + steps, w = 32;
  const std::int64_t switch_at = shift ? prefill + steps / 4 : N;
  constexpr int kProbes = 32;
  // the same synth heads for every run (generated once: a quarter of a run's time)
  static const kvscore::synth::Data data = test_support::drift_head(N, d, 7, 4 * H);
  std::vector<float> K(static_cast<std::size_t>(H * N * d)), V(K.size());  // [H][N][d]
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t) {
      const std::int64_t src = (t < switch_at ? 2 * h : 2 * h + 1) * N + t;
      std::copy_n(data.keys.data() + src * d, d, K.data() + (h * N + t) * d);
      std::copy_n(data.keys.data() + (2 * H * N + src) * d, d, V.data() + (h * N + t) * d);
    }
  if (rope)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < N; ++t) test_support::rope_rotate(K.data() + (h * N + t) * d, d, t);
  const auto keys = heads_view(K, H, prefill, d, N), values = heads_view(V, H, prefill, d, N);
  std::vector<OjaProjector> proj;
  std::vector<Eigen::MatrixXd> uk;
  std::vector<float> window(static_cast<std::size_t>(H * w * d));
  for (std::int64_t h = 0; h < H; ++h) {
    proj.push_back(OjaProjector::random(d, r, r, 11 + std::uint64_t(h)));
    proj.back().prefill(keys, values, h);
    uk.push_back(proj.back().key().basis());
    std::copy_n(K.data() + (h * N + prefill - w) * d, w * d, window.data() + h * w * d);
  }
  const kvscore::OjaResidual rule(window.data(), H, w, d, uk);
  const kvscore::Selection full =
      kvscore::select(rule.score(keys), kvscore::Budget::per_head(kvscore::budget_from_ratio(prefill, 0.1)));
  OjaHybridCache adapted = OjaHybridCache::build(proj, keys, values, full);
  OjaHybridCache frozen = adapted;
  std::vector<OjaProjector> frozen_proj = proj;
  OjaDecodeOptions on, off;
  off.adapt = false;
  kvscore::detail::SplitMix64 rng(3);
  DriftErrors out;
  for (auto* x : {&out.adapted, &out.frozen, &out.adapted_any, &out.frozen_any}) x->assign(std::size_t(H), 0.0);
  std::vector<float> k(static_cast<std::size_t>(H * d)), v(k.size());
  for (std::int64_t n = prefill; n < N; ++n) {
    for (std::int64_t h = 0; h < H; ++h) {
      std::copy_n(K.data() + (h * N + n) * d, d, k.data() + h * d);
      std::copy_n(V.data() + (h * N + n) * d, d, v.data() + h * d);
    }
    adapted.append(proj, k.data(), v.data(), k.data(), H, on);
    frozen.append(frozen_proj, k.data(), v.data(), k.data(), H, off);
    if ((n + 1 - prefill) % (steps / 8) != 0) continue;
    for (std::int64_t h = 0; h < H; ++h) {
      const auto ka = adapted.reconstruct_keys(h), va = adapted.reconstruct_values(h);
      const auto kf = frozen.reconstruct_keys(h), vf = frozen.reconstruct_values(h);
      const float* kh = K.data() + h * N * d;
      const float* vh = V.data() + h * N * d;
      Eigen::MatrixXf probes(kProbes, d);
      for (int qi = 0; qi < kProbes; ++qi) {
        const std::int64_t lo = qi % 2 == 0 ? n + 1 - 1024 : 0;
        const std::int64_t target = lo + std::int64_t(rng.next() % std::uint64_t(n + 1 - lo));
        for (std::int64_t j = 0; j < d; ++j)
          probes(qi, Eigen::Index(j)) = 0.25f * kh[target * d + j] + float(0.5 * (rng.uniform_nonzero() - 0.5));
      }
      const Eigen::MatrixXd truth = exact_attention(kh, vh, n + 1, d, probes);
      const Eigen::MatrixXd oa = exact_attention(ka.data(), va.data(), n + 1, d, probes);
      const Eigen::MatrixXd of = exact_attention(kf.data(), vf.data(), n + 1, d, probes);
      for (int qi = 0; qi < kProbes; ++qi) {
        const bool recent = qi % 2 == 0;
        (recent ? out.adapted : out.adapted_any)[std::size_t(h)] += rel_error(oa.col(qi), truth.col(qi));
        (recent ? out.frozen : out.frozen_any)[std::size_t(h)] += rel_error(of.col(qi), truth.col(qi));
      }
    }
  }
  for (auto* x : {&out.adapted, &out.frozen, &out.adapted_any, &out.frozen_any})
    for (double& e : *x) e /= double(8 * kProbes / 2);
  for (std::int64_t h = 0; h < H; ++h) {
    const auto ka = adapted.reconstruct_keys(h), kf = frozen.reconstruct_keys(h);
    auto rer = [&](const kvscore::oja::RowMajorF& kh, std::int64_t a, std::int64_t b) {
      double e = 0, t = 0;
      for (std::int64_t i = a; i < b; ++i)
        for (std::int64_t j = 0; j < d; ++j) {
          const double x = K[std::size_t((h * N + i) * d + j)];
          e += (kh(i, j) - x) * (kh(i, j) - x);
          t += x * x;
        }
      return e / t / double(H);
    };
    out.rer_first_adapted += rer(ka, 0, 4096);
    out.rer_first_frozen += rer(kf, 0, 4096);
    out.rer_last_adapted += rer(ka, N - 4096, N);
    out.rer_last_frozen += rer(kf, N - 4096, N);
  }
  REQUIRE(adapted.tokens() == N);
  REQUIRE(proj[0].key().decode_updates() == steps / 128);
  return out;
}

double mean(const std::vector<double>& x) { return std::accumulate(x.begin(), x.end(), 0.0) / double(x.size()); }

std::string report(const DriftErrors& e) {
  std::string per_head;
  for (std::size_t h = 0; h < e.adapted.size(); ++h) per_head += " " + std::to_string(e.adapted[h] / e.frozen[h]);
  return "relative attention error, probes of the last 1K tokens: adapted " + std::to_string(mean(e.adapted)) +
         ", frozen " + std::to_string(mean(e.frozen)) + ", ratio " + std::to_string(mean(e.adapted) / mean(e.frozen)) +
         " (per head" + per_head + "); probes anywhere: adapted " + std::to_string(mean(e.adapted_any)) + ", frozen " +
         std::to_string(mean(e.frozen_any)) + ", ratio " + std::to_string(mean(e.adapted_any) / mean(e.frozen_any)) +
         "; key RER first 4K adapted " + std::to_string(e.rer_first_adapted) + " frozen " +
         std::to_string(e.rer_first_frozen) + ", last 4K adapted " + std::to_string(e.rer_last_adapted) + " frozen " +
         std::to_string(e.rer_last_frozen);
}

}  // namespace

TEST_CASE("ojakv decode: 64K drifting decode steps, adapted vs frozen basis", "[ojakv][decode][drift]") {
  const DriftErrors e = drift_run(false, false);
  WARN("ojakv decode, " << kSteps << " steps of synth drift: " << report(e));
  CHECK(mean(e.adapted) <= mean(e.frozen));
  CHECK(mean(e.adapted_any) <= mean(e.frozen_any));
  CHECK(e.rer_last_adapted <= e.rer_last_frozen);
}

TEST_CASE("ojakv decode: a task shift - new tokens gain, rebased old ones lose", "[ojakv][decode][drift]") {
  // The adapted basis follows the new subspace; every rebase projects the older codes onto it,
  // so the prompt's tokens lose what the new basis does not span (docs/methods/ojakv.md "Decode").
  const DriftErrors e = drift_run(true, false);
  WARN("ojakv decode, " << kSteps << " steps, task shift after " << kSteps / 4 << ": " << report(e));
  CHECK(e.rer_last_adapted < 0.6 * e.rer_last_frozen);  // 0.02x at 64K steps, 0.5x at 16K (still converging)
  CHECK(e.rer_first_adapted > 5 * e.rer_first_frozen);
}

TEST_CASE("ojakv decode: RoPE-rotated drifting keys (post-RoPE inputs)", "[ojakv][decode][drift]") {
  // RoPE turns every pair of dimensions at its own speed, so post-RoPE keys have no fixed
  // 12-dim subspace: both bases lose about half the key energy and the output error is the same
  // within a few percent (reported). What adapting still buys: the basis follows the rotation,
  // so the newest keys are represented better than by the prompt's basis.
  const DriftErrors e = drift_run(false, true);
  WARN("ojakv decode, " << kSteps << " RoPE-rotated steps of synth drift: " << report(e));
  CHECK(e.rer_last_adapted < e.rer_last_frozen);
  CHECK(e.rer_last_frozen > 0.3);  // the rotation really costs the low-rank basis
}

TEST_CASE("ojakv decode: memory per token equals the accounting formula to 1% (d 128, ranks 32 + 32)",
          "[ojakv][decode][drift]") {
  // Llama-like head: d = 128, r_k = r_v = 32 (4x per side), fp32 store, 10% full rank.
  const SerialEigen serial;
  const std::int64_t d = 128, r = 32, prompt = 4096, steps = kSteps, N = prompt + steps;
  const kvscore::synth::Data data = test_support::drift_head(N, d, 21);
  const std::vector<float>& K = data.keys;
  const std::vector<float>& V = data.values;
  std::vector<OjaProjector> proj{OjaProjector::random(d, r, r, 4)};
  const auto keys = heads_view(K, 1, prompt, d, N), values = heads_view(V, 1, prompt, d, N);
  proj[0].prefill(keys, values, 0);
  const kvscore::OjaResidual rule(K.data() + (prompt - 32) * d, 1, 32, d, {proj[0].key().basis()});
  const std::int64_t keep0 = kvscore::budget_from_ratio(prompt, 0.1);
  OjaHybridCache cache = OjaHybridCache::build(proj, keys, values,
                                               kvscore::select(rule.score(keys), kvscore::Budget::per_head(keep0)));
  for (std::int64_t n = prompt; n < N; ++n) cache.append(proj, K.data() + n * d, V.data() + n * d, K.data() + n * d, 1);
  REQUIRE(cache.pending() == 0);  // whole blocks (the open one: the brute-force test's identity)
  const auto& hd = cache.head(0);
  const std::int64_t nf = std::int64_t(hd.full_pos.size()), n = cache.tokens(), open = cache.pending();
  CHECK(nf == keep0 + steps / 128 * kvscore::budget_from_ratio(128, 0.1));
  const kvscore::OjaMemory m = cache.memory(0, 4);
  CHECK(m.hybrid_bytes == (n - nf - open) * 2 * r * 4 + (nf + open) * (2 * d * 4 + 4) + d * 2 * r * 4);
  const std::int64_t stored = cache.stored_bytes(0);
  // what the store holds beyond the formula: 2 flag bytes per committed token, 8-byte (not
  // 4-byte) positions, and per open token its query (d floats) and one flag instead of a position
  CHECK(stored == m.hybrid_bytes + 2 * (n - open) + 4 * nf + open * (d * 4 + 1 - 4));
  const double per_token = double(stored) / double(n), formula = double(m.hybrid_bytes) / double(n);
  WARN("ojakv decode memory after " << n << " tokens: " << per_token << " B/token stored, formula " << formula
       << " (ratio " << per_token / formula << "), full rank " << double(2 * d * 4) << " B/token");
  CHECK(std::abs(per_token / formula - 1) < 0.01);
}

#endif  // NDEBUG

namespace {

/// The fp64 reference of the decode store: every token's reconstruction from its definition.
struct RefStore {
  std::int64_t d;
  std::vector<Mat> bases;              // U_k after every basis change (index = epoch)
  std::vector<std::int64_t> epoch_of;  // per token: epoch it was encoded in, -1 = full rank
  std::vector<std::vector<double>> keys;

  /// K^ row of token t: U_now (U_nowᵀ U_{now-1}) ... (U_{e+1}ᵀ U_e) U_eᵀ k, or k at full rank.
  std::vector<double> khat(std::int64_t t) const {
    const std::int64_t e = epoch_of[std::size_t(t)];
    const Eigen::Map<const Eigen::VectorXd> k(keys[std::size_t(t)].data(), d);
    if (e < 0) return keys[std::size_t(t)];
    Eigen::VectorXd c = bases[std::size_t(e)].transpose() * k;
    for (std::size_t b = std::size_t(e) + 1; b < bases.size(); ++b) c = bases[b].transpose() * (bases[b - 1] * c);
    const Eigen::VectorXd x = bases.back() * c;
    return std::vector<double>(x.data(), x.data() + d);
  }
};

}  // namespace

TEST_CASE("ojakv decode: every block equals a brute-force fp64 simulation (GQA, commit)", "[ojakv][decode]") {
  const std::int64_t H = 2, G = 2, d = 16, r = 4, T = 8, prompt = 20, appends = 43;
  const double frac = 0.3;
  OjaOptions oo;
  oo.period = T;
  oo.pool = 2;
  kvscore::detail::SplitMix64 g(5);
  auto draw = [&](std::int64_t n) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (auto& v : x) v = float(2 * g.uniform_nonzero() - 1);
    return x;
  };
  const std::vector<float> pk = draw(H * prompt * d), pv = draw(H * prompt * d);
  std::vector<OjaProjector> proj;
  for (std::int64_t h = 0; h < H; ++h) proj.push_back(OjaProjector::random(d, r, r + 1, 20 + std::uint64_t(h), oo));
  OjaHybridCache cache = OjaHybridCache::build(proj, heads_view(pk, H, prompt, d, prompt),
                                               heads_view(pv, H, prompt, d, prompt), kvscore::Selection::none(H, prompt));
  std::vector<OjaProjector> ref_proj = proj;
  std::vector<RefStore> ref(static_cast<std::size_t>(H));
  for (std::int64_t h = 0; h < H; ++h) {
    RefStore& R = ref[std::size_t(h)];
    R.d = d;
    R.bases.push_back(proj[std::size_t(h)].key().basis_f32().cast<double>());
    for (std::int64_t t = 0; t < prompt; ++t) {
      R.epoch_of.push_back(0);
      R.keys.emplace_back(pk.begin() + (h * prompt + t) * d, pk.begin() + (h * prompt + t + 1) * d);
    }
  }
  std::vector<std::vector<float>> block_q(static_cast<std::size_t>(H));  // [i][g][d] per head
  std::int64_t open = 0, blocks = 0;
  auto close = [&]() {  // the reference of one block close
    for (std::int64_t h = 0; h < H; ++h) {
      RefStore& R = ref[std::size_t(h)];
      R.bases.push_back(ref_proj[std::size_t(h)].key().basis_f32().cast<double>());
      const Mat& u = R.bases.back();
      const std::int64_t t0 = std::int64_t(R.keys.size()) - open;
      std::vector<std::pair<double, std::int64_t>> e;  // (score, i)
      for (std::int64_t i = 0; i < open; ++i) {
        const Eigen::Map<const Eigen::VectorXd> k(R.keys[std::size_t(t0 + i)].data(), d);
        const Eigen::VectorXd res = k - u * (u.transpose() * k);
        double acc = 0;
        for (std::int64_t j = i; j < open; ++j)
          for (std::int64_t gg = 0; gg < G; ++gg) {
            const float* q = block_q[std::size_t(h)].data() + (j * G + gg) * d;
            double z = 0;
            for (std::int64_t c = 0; c < d; ++c) z += double(q[c]) * res(c);
            acc += std::abs(z);
          }
        e.emplace_back(acc / double(G * (open - i)) / std::sqrt(double(d)), i);
      }
      std::sort(e.begin(), e.end(), [](auto& a, auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; });
      const std::int64_t keep = std::max<std::int64_t>(1, std::llround(frac * double(open)));
      const std::int64_t epoch = std::int64_t(R.bases.size()) - 1;
      for (std::int64_t i = 0; i < open; ++i) R.epoch_of[std::size_t(t0 + i)] = epoch;
      for (std::int64_t m = 0; m < keep; ++m) R.epoch_of[std::size_t(t0 + e[std::size_t(m)].second)] = -1;
      block_q[std::size_t(h)].clear();
    }
    open = 0;
    ++blocks;
  };
  auto compare = [&]() {
    REQUIRE(cache.tokens() == std::int64_t(ref[0].keys.size()));
    for (std::int64_t h = 0; h < H; ++h) {
      const auto khat = cache.reconstruct_keys(h);
      const auto& hd = cache.head(h);
      std::vector<std::int64_t> full_expect;
      for (std::int64_t t = 0; t < cache.committed(); ++t)
        if (ref[std::size_t(h)].epoch_of[std::size_t(t)] < 0) full_expect.push_back(t);
      CHECK(hd.full_pos == full_expect);
      double worst = 0;
      for (std::int64_t t = 0; t < cache.tokens(); ++t) {
        const std::vector<double> x = t < cache.committed() ? ref[std::size_t(h)].khat(t) : ref[std::size_t(h)].keys[std::size_t(t)];
        for (std::int64_t j = 0; j < d; ++j) worst = std::max(worst, std::abs(double(khat(t, j)) - x[std::size_t(j)]));
      }
      CHECK(worst < 2e-5);
      // the projectors the cache updated are the reference's
      CHECK((proj[std::size_t(h)].key().basis() - ref_proj[std::size_t(h)].key().basis()).cwiseAbs().maxCoeff() == 0);
    }
  };
  OjaDecodeOptions opt;
  opt.full_rank_fraction = frac;
  for (std::int64_t s = 0; s < appends; ++s) {
    const std::vector<float> k = draw(H * d), v = draw(H * d), q = draw(H * G * d);
    cache.append(proj, k.data(), v.data(), q.data(), H * G, opt);
    ++open;
    for (std::int64_t h = 0; h < H; ++h) {
      ref[std::size_t(h)].keys.emplace_back(k.begin() + h * d, k.begin() + (h + 1) * d);
      ref[std::size_t(h)].epoch_of.push_back(-1);  // held at full rank while the block is open
      block_q[std::size_t(h)].insert(block_q[std::size_t(h)].end(), q.begin() + h * G * d, q.begin() + (h + 1) * G * d);
      ref_proj[std::size_t(h)].push(k.data() + h * d, v.data() + h * d);
    }
    if (open == T) close();
    CHECK(cache.pending() == open);
    compare();
  }
  REQUIRE(blocks == appends / T);
  // commit: the partial block closes with a flush of the projectors
  for (auto& p : ref_proj) {
    p.key().flush();
    p.value().flush();
  }
  close();
  cache.commit(proj, opt);
  CHECK(cache.pending() == 0);
  CHECK(cache.committed() == prompt + appends);
  compare();
  cache.commit(proj, opt);  // nothing open: no-op
  CHECK(cache.committed() == prompt + appends);
  // memory: the formula with the open block counted as full rank; stored bytes = formula + bookkeeping
  for (std::int64_t h = 0; h < H; ++h) {
    const auto& hd = cache.head(h);
    const std::int64_t nf = std::int64_t(hd.full_pos.size()), n = cache.tokens();
    const kvscore::OjaMemory m = cache.memory(h, 4);
    CHECK(m.hybrid_bytes == (n - nf) * (r + r + 1) * 4 + nf * (2 * d * 4 + 4) + d * (2 * r + 1) * 4);
    CHECK(cache.stored_bytes(h) == m.hybrid_bytes + 2 * n + 4 * nf);  // flags + 8-byte positions
  }
}

TEMPLATE_TEST_CASE("ojakv decode: half and bfloat16 rows are widened like float ones", "[ojakv][decode]", kvscore::half,
                   kvscore::bfloat16) {
  const std::int64_t d = 8, r = 2, T = 4;
  OjaOptions oo;
  oo.period = T;
  std::vector<OjaProjector> p16{OjaProjector::random(d, r, r, 3, oo)}, p32 = p16;
  std::vector<float> k0(static_cast<std::size_t>(6 * d));
  kvscore::detail::SplitMix64 g(2);
  for (auto& x : k0) x = kvscore::to_float(kvscore::from_float<TestType>(float(g.uniform_nonzero() - 0.5)));
  OjaHybridCache a = OjaHybridCache::build(p32, heads_view(k0, 1, 6, d, 6), heads_view(k0, 1, 6, d, 6), kvscore::Selection::none(1, 6));
  OjaHybridCache b = a;
  for (int s = 0; s < 10; ++s) {
    std::vector<float> k(static_cast<std::size_t>(d)), q(static_cast<std::size_t>(d));
    for (auto& x : k) x = kvscore::to_float(kvscore::from_float<TestType>(float(g.uniform_nonzero() - 0.5)));
    for (auto& x : q) x = float(g.uniform_nonzero());
    std::vector<TestType> k16(k.size());
    for (std::size_t j = 0; j < k.size(); ++j) k16[j] = kvscore::from_float<TestType>(k[j]);
    a.append(p32, k.data(), k.data(), q.data(), 1);
    b.append(p16, k16.data(), k16.data(), q.data(), 1);
  }
  CHECK(a.reconstruct_keys(0) == b.reconstruct_keys(0));
  CHECK(a.head(0).full_pos == b.head(0).full_pos);
}

TEST_CASE("ojakv decode: error paths name the offending value and change nothing", "[ojakv][decode]") {
  const std::int64_t H = 2, d = 8, r = 2;
  std::vector<OjaProjector> proj{OjaProjector::random(d, r, r, 1), OjaProjector::random(d, r, r, 2)};
  std::vector<float> x(static_cast<std::size_t>(H * 4 * d), 0.5f);
  OjaHybridCache c = OjaHybridCache::build(proj, heads_view(x, H, 4, d, 4), heads_view(x, H, 4, d, 4), kvscore::Selection::none(H, 4));
  std::vector<float> k(static_cast<std::size_t>(H * d), 0.25f), q(static_cast<std::size_t>(2 * H * d), 1.f);
  auto err = [&](auto f) { return test_support::error_of(f); };
  std::vector<OjaProjector> one{proj[0]};
  CHECK_THAT(err([&] { c.append(one, k.data(), k.data(), q.data(), H); }), Contains("1 projectors for 2 heads"));
  CHECK_THAT(err([&] { c.append(proj, k.data(), k.data(), q.data(), 3); }), Contains("q_heads 3"));
  CHECK_THAT(err([&] { c.append(proj, k.data(), static_cast<const float*>(nullptr), q.data(), 2); }), Contains("v is null"));
  OjaDecodeOptions bad;
  bad.full_rank_fraction = 1.5;
  CHECK_THAT(err([&] { c.append(proj, k.data(), k.data(), q.data(), 2, bad); }), Contains("full_rank_fraction must be in [0, 1] (got 1.5)"));
  q[5] = std::numeric_limits<float>::infinity();
  CHECK_THAT(err([&] { c.append(proj, k.data(), k.data(), q.data(), 2); }), Contains("query value inf at [q head 0, dim 5]"));
  q[5] = 1.f;
  std::vector<OjaProjector> pushed = proj;
  pushed[1].push(k.data(), k.data());
  CHECK_THAT(err([&] { c.append(pushed, k.data(), k.data(), q.data(), 2); }), Contains("projector 1 has 1/1 buffered rows"));
  OjaOptions other;
  other.period = 64;
  std::vector<OjaProjector> mixed{proj[0], OjaProjector::random(d, r, r, 2, other)};
  CHECK_THAT(err([&] { c.append(mixed, k.data(), k.data(), q.data(), 2); }), Contains("same T"));
  CHECK(c.tokens() == 4);
  CHECK(c.pending() == 0);
  c.append(proj, k.data(), k.data(), q.data(), 2);
  CHECK_THAT(err([&] { c.append(proj, k.data(), k.data(), q.data(), 4); }), Contains("changed inside the open block"));
  CHECK(c.tokens() == 5);
  CHECK(proj[0].key().buffered() == 1);
  // an invalid row is held, masked in attention and never kept at full rank
  std::vector<float> nan_k = k;
  nan_k[0] = std::numeric_limits<float>::quiet_NaN();
  c.append(proj, nan_k.data(), k.data(), q.data(), 2);
  OjaDecodeOptions all;
  all.full_rank_fraction = 1.0;
  c.commit(proj, all);
  CHECK(c.head(0).valid.back() == 0);
  CHECK(c.head(0).is_full.back() == 0);
  CHECK(c.head(1).is_full.back() == 1);
  for (double v : c.attention(0, q.data())) CHECK(std::isfinite(v));
}
