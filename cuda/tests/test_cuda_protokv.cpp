// cuda/tests/test_cuda_protokv.cpp — ProtoKV on the GPU (kvscore/cuda/protokv.hpp) against the CPU ProtoKV.
//
// [gpu]: every piece (validity, q̄·k, S, candidates, buckets, σ, PDT chunks, prototypes, the
// assignment, ψ, the cluster order) and the final integer scores equal the CPU's on planted data
// with margins: K position blocks around K directions plus 32 outliers (the SAT candidates) placed
// so that the PDT chunks are exactly the blocks; keys on a grid and integer queries, so q̄·k is
// exact in fp32 in any summation order. On random keys the fraction of identical assignments is
// reported. [cuda][host]: argument errors, thrown before any CUDA call.
#include "cuda_harness.hpp"

#include <kvscore/cuda/protokv.hpp>
#include <kvscore/cuda/select.hpp>
#include <kvscore/scorers/protokv.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using kvscore::bfloat16;
using kvscore::half;
using Catch::Matchers::Contains;


/// Planted keys [H][N][d] (logical), every value a multiple of `quantum` below 8 in magnitude.
std::vector<float> planted_keys(std::int64_t H, std::int64_t N, std::int64_t d, std::int64_t K, float quantum,
                                unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_real_distribution<float> scale(0.6f, 1.4f);
  auto unit = [&] {
    std::vector<float> v(static_cast<std::size_t>(d));
    double s = 0;
    for (auto& x : v) x = nd(rng), s += double(x) * x;
    for (auto& x : v) x = float(x / std::sqrt(s));
    return v;
  };
  const std::int64_t B = N / K, per_block = 32 / K;  // 32 outliers = the default sat_candidates
  std::vector<float> k(std::size_t(H * N * d));
  for (std::int64_t h = 0; h < H; ++h) {
    std::vector<std::vector<float>> centers, outliers;
    for (std::int64_t c = 0; c < K; ++c) centers.push_back(unit());
    for (int g = 0; g < 4; ++g) outliers.push_back(unit());
    for (std::int64_t t = 0; t < N; ++t) {
      const std::int64_t blk = std::min(t / B, K - 1), in = t - blk * B;
      const std::vector<float>* dir = &centers[std::size_t(blk)];
      for (std::int64_t o = 0; o < per_block; ++o)  // outliers well inside the block, >= kappa apart
        if (in == (2 * o + 1) * B / (2 * per_block)) dir = &outliers[std::size_t((blk * per_block + o) % 4)];
      const float s = scale(rng);
      for (std::int64_t j = 0; j < d; ++j) {
        const float x = s * (3.f * (*dir)[std::size_t(j)] + 0.2f * nd(rng));
        const float q = std::round(x / quantum) * quantum;
        k[std::size_t((h * N + t) * d + j)] = std::max(-8.f + quantum, std::min(8.f - quantum, q));
      }
    }
  }
  return k;
}

/// Integer queries in {-1, 0, 1}: q̄ is integer, so q̄·k is exact in fp32 for grid keys.
std::vector<float> int_queries(std::int64_t q_heads, std::int64_t window, std::int64_t d, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> u(-1, 1);
  std::vector<float> q(std::size_t(q_heads * window * d));
  for (auto& x : q) x = float(u(rng));
  return q;
}

template <class T>
std::vector<T> lay_out(const std::vector<float>& logical, std::int64_t H, std::int64_t N, std::int64_t d,
                       const Layout& L) {
  std::vector<T> v(std::size_t(L.elems), kvscore::from_float<T>(0.f));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t j = 0; j < d; ++j)
        v[std::size_t(h * L.hs + t * L.ts + j)] = kvscore::from_float<T>(logical[std::size_t((h * N + t) * d + j)]);
  return v;
}

struct Case {
  std::int64_t H, N, d, K;
};

template <class T>
float quantum_of() {
  return std::is_same_v<T, bfloat16> ? 1.f / 32 : 1.f / 256;
}

kvscore::ProtoKV make_proto(const std::vector<float>& q, const Case& c, std::int64_t window) {
  kvscore::ProtoKV p(q.data(), 2 * c.H, window, c.d);
  p.chunks = c.K;
  p.num_threads = 1;
  return p;
}

template <class T>
void compare_pieces(const Case& c, const Layout& L, kvscore::ProtoKV::Psi psi) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " layout " << L.name << " H " << c.H << " N " << c.N
                << " d " << c.d << " K " << c.K);
  const std::vector<float> logical = planted_keys(c.H, c.N, c.d, c.K, quantum_of<T>(), unsigned(c.N + c.d));
  const std::vector<float> q = int_queries(2 * c.H, 2, c.d, 7);
  kvscore::ProtoKV p = make_proto(q, c, 2);
  p.psi = psi;
  const std::vector<T> host = lay_out<T>(logical, c.H, c.N, c.d, L);
  const kvscore::KeysView<T> ck(host.data(), c.H, c.N, c.d, L.hs, L.ts);
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<T> gk(dk.as<T>(), c.H, c.N, c.d, L.hs, L.ts);
  for (std::int64_t h = 0; h < c.H; ++h) {
    INFO("head " << h);
    const kvscore::ProtoKVHead a = p.analyze(ck, h), g = kc::analyze(p, gk, h);
    REQUIRE(g.valid == a.valid);
    REQUIRE(g.qk == a.qk);  // exact by construction (grid keys, integer q̄)
    for (std::size_t t = 0; t < a.similarity.size(); ++t) REQUIRE(std::fabs(g.similarity[t] - a.similarity[t]) <= 1e-5);
    REQUIRE(g.candidates == a.candidates);
    REQUIRE(g.candidate_bucket == a.candidate_bucket);
    REQUIRE(std::fabs(g.bandwidth - a.bandwidth) <= 1e-6 * a.bandwidth);
    REQUIRE(g.pdt_prototypes == a.pdt_prototypes);
    REQUIRE(g.sat_prototypes == a.sat_prototypes);
    REQUIRE(g.sat_bucket_id == a.sat_bucket_id);
    REQUIRE(g.chunk_begin == a.chunk_begin);
    REQUIRE(g.prototypes.size() == a.prototypes.size());
    for (std::size_t i = 0; i < a.prototypes.size(); ++i) REQUIRE(std::fabs(g.prototypes[i] - a.prototypes[i]) <= 1e-5f);
    REQUIRE(g.cluster == a.cluster);
    REQUIRE(g.cluster_size == a.cluster_size);
    REQUIRE(g.psi == a.psi);  // same q̄·k, same fp64 order
    REQUIRE(g.cluster_order == a.cluster_order);
  }
}

template <class T>
void compare_scores(const Case& c, const Layout& L, kvscore::ProtoKV::Psi psi) {
  INFO("dtype " << kvscore::dtype_name(kvscore::dtype_of<T>()) << " layout " << L.name << " N " << c.N);
  const std::vector<float> logical = planted_keys(c.H, c.N, c.d, c.K, quantum_of<T>(), unsigned(c.N * 3 + c.d));
  const std::vector<float> q = int_queries(2 * c.H, 4, c.d, 11);
  kvscore::ProtoKV p = make_proto(q, c, 4);
  p.psi = psi;
  const std::vector<T> host = lay_out<T>(logical, c.H, c.N, c.d, L);
  const kvscore::Scores cpu = p.score(kvscore::KeysView<T>(host.data(), c.H, c.N, c.d, L.hs, L.ts));
  const kc::DeviceBuffer dk = upload(host);
  const kc::DeviceKeysView<T> gk(dk.as<T>(), c.H, c.N, c.d, L.hs, L.ts);
  kc::DeviceBuffer ws(kc::score_workspace_bytes(p, gk));
  kc::DeviceBuffer out(std::size_t(c.H * c.N) * sizeof(float));
  const kc::DeviceScoresView sv(out.as<float>(), c.H, c.N);
  kc::score(p, gk, sv, {ws.get(), ws.bytes()});
  kc::synchronize();
  const std::vector<float> gpu = download<float>(out, std::size_t(c.H * c.N));
  REQUIRE(std::memcmp(gpu.data(), cpu.values().data(), gpu.size() * sizeof(float)) == 0);

  // Deterministic: a second run, same bits.
  kc::score(p, gk, sv, {ws.get(), ws.bytes()});
  kc::synchronize();
  const std::vector<float> again = download<float>(out, std::size_t(c.H * c.N));
  REQUIRE(std::memcmp(gpu.data(), again.data(), gpu.size() * sizeof(float)) == 0);

  // Composes with the selector exactly as on the CPU.
  for (const auto alloc : {kvscore::Alloc::per_head, kvscore::Alloc::adakv}) {
    kvscore::SelectOptions o;
    o.sinks = 4;
    o.recent = p.protected_recent();
    o.alloc = alloc;
    const kvscore::Budget b = kvscore::Budget::per_head(c.N / 4);
    const kvscore::Selection sc = kvscore::select(cpu, b, o);
    const kvscore::Selection sg = kc::select(sv, b, o);
    REQUIRE(sg.offsets == sc.offsets);
    REQUIRE(sg.positions == sc.positions);
  }
}

}  // namespace

// ================================================================ GPU (skipped without a device)

TEST_CASE("cuda protokv: every piece equals the CPU analyze on planted clusters", "[cuda][gpu][protokv]") {
  const Case small{2, 2048, 64, 8}, wide{2, 4096, 128, 16};
  for (const Case& c : {small, wide}) {
    compare_pieces<float>(c, hf(c.H, c.N, c.d), kvscore::ProtoKV::Psi::sum);
    compare_pieces<half>(c, token_major(c.H, c.N, c.d), kvscore::ProtoKV::Psi::sum);
    compare_pieces<bfloat16>(c, hf(c.H, c.N, c.d), kvscore::ProtoKV::Psi::mean);
  }
}

TEST_CASE("cuda protokv: scores, selections and determinism equal the CPU", "[cuda][gpu][protokv]") {
  const Case c{4, 2048, 128, 8};
  for (const auto psi : {kvscore::ProtoKV::Psi::sum, kvscore::ProtoKV::Psi::mean}) {
    compare_scores<float>(c, hf(c.H, c.N, c.d), psi);
    compare_scores<float>(c, token_major(c.H, c.N, c.d), psi);
    compare_scores<half>(c, hf(c.H, c.N, c.d), psi);
    compare_scores<half>(c, token_major(c.H, c.N, c.d), psi);
    compare_scores<bfloat16>(c, hf(c.H, c.N, c.d), psi);
    compare_scores<bfloat16>(c, token_major(c.H, c.N, c.d), psi);
  }
}

TEST_CASE("cuda protokv: random keys with the default parameters, fraction of identical assignments",
          "[cuda][gpu][protokv]") {
  const std::int64_t H = 2, N = 4096, d = 128;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> keys(std::size_t(H * N * d)), q(std::size_t(2 * H * 8 * d));
  for (auto& x : keys) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  kvscore::ProtoKV p(q.data(), 2 * H, 8, d);
  p.psi = kvscore::ProtoKV::Psi::sum;  // the GPU path has sum and mean
  p.num_threads = 1;
  const kvscore::KeysView<float> ck(keys.data(), H, N, d, N * d, d);
  const kc::DeviceBuffer dk = upload(keys);
  const kc::DeviceKeysView<float> gk(dk.as<float>(), H, N, d, N * d, d);
  std::int64_t same = 0, total = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    const kvscore::ProtoKVHead a = p.analyze(ck, h), g = kc::analyze(p, gk, h);
    REQUIRE(g.candidates == a.candidates);  // S gaps on random data are far above fp32 rounding
    for (std::size_t t = 0; t < a.cluster.size(); ++t) same += g.cluster[t] == a.cluster[t], ++total;
  }
  const double frac = double(same) / double(total);
  std::printf("cuda protokv: random keys N=%lld d=%lld: %.6f of the assignments equal the CPU's\n", (long long)N,
              (long long)d, frac);
  REQUIRE(frac >= 0.99);
}

// ================================================================ host-side (no GPU needed)

TEST_CASE("cuda protokv: arguments are checked before anything is launched", "[cuda][host][protokv]") {
  float* fake = reinterpret_cast<float*>(std::uintptr_t(4096));  // never dereferenced
  const std::vector<float> q(4 * 2 * 8, 0.5f);
  kvscore::ProtoKV p(q.data(), 4, 2, 8);
  p.sat_candidates = 4;  // the default 32 exceeds these 10 tokens
  const kc::DeviceKeysView<float> keys(fake, 2, 10, 8, 80, 8);
  // The CPU default psi (attention) has no GPU kernel: rejected by name, before any launch.
  REQUIRE_THROWS_WITH(kc::score(p, keys, kc::DeviceScoresView(fake, 2, 10)), Contains("Psi::attention"));
  REQUIRE_THROWS_WITH(kc::analyze(p, keys, 0), Contains("Psi::attention"));
  p.psi = kvscore::ProtoKV::Psi::sum;
  REQUIRE_THROWS_WITH(kc::score(p, keys, kc::DeviceScoresView(fake, 2, 9)),
                      Contains("scores shape (2, 9) does not match keys (2, 10)"));
  const kc::DeviceKeysView<float> three(fake, 3, 10, 8, 80, 8);
  REQUIRE_THROWS_WITH(kc::score(p, three, kc::DeviceScoresView(fake, 3, 10)), Contains("kv_heads 3"));
  const kc::DeviceKeysView<float> short_keys(fake, 2, 1, 8, 8, 8);
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(p, short_keys), Contains("window 2 > tokens 1"));
  const kc::DeviceKeysView<float> d16(fake, 2, 10, 16, 160, 16);
  REQUIRE_THROWS_WITH(kc::score(p, d16, kc::DeviceScoresView(fake, 2, 10)), Contains("head_dim 16"));
  kvscore::ProtoKV bad = p;
  bad.kappa = 0;
  REQUIRE_THROWS_WITH(kc::score(bad, keys, kc::DeviceScoresView(fake, 2, 10)), Contains("kappa must be >= 1 (got 0)"));
  bad = p;
  bad.sat_candidates = 11;
  REQUIRE_THROWS_WITH(kc::score_workspace_bytes(bad, keys), Contains("sat_candidates 11"));
  REQUIRE_THROWS_WITH(kc::analyze(p, keys, 2), Contains("head 2 out of range"));
  const std::vector<float> q512(2 * 2 * 512, 0.5f);
  kvscore::ProtoKV wide(q512.data(), 2, 2, 512);
  wide.sat_candidates = 4;
  wide.psi = kvscore::ProtoKV::Psi::sum;
  const kc::DeviceKeysView<float> k512(fake, 2, 10, 512, 5120, 512);
  REQUIRE_THROWS_WITH(kc::score(wide, k512, kc::DeviceScoresView(fake, 2, 10)), Contains("head_dim 512 > 256"));
}
