// fuzz_select — kvscore::select / select_into on arbitrary scores (NaN, ±Inf, ±0, denormals,
// ties), budgets (per head / per layer, 0, N, > N, arbitrary int64), protection (sinks,
// recent, overlapping, > budget), Alloc::per_head / adakv (alpha incl. NaN and out of range,
// normalize), 1..3 threads and every supported kernel set.
// Invariants: rejects exactly the documented bad arguments (own predicate) with
// std::invalid_argument; otherwise CSR offsets are consistent, positions strictly ascending
// and < tokens, every protected position is kept, the total equals select_total(), and the
// kept set equals an independent reference (sort by the documented total order: score desc,
// NaN lowest, -0 == +0, position asc; AdaKV: safeguard by raw score, then one global top-k,
// ties lower position then lower head). With normalize the global step is not recomputed;
// the safeguard and the counts are still checked. All kernel sets / thread counts / the
// select_into path give identical results.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "fuzz_common.hpp"
#include "kvscore/select.hpp"

namespace {

using i64 = std::int64_t;

/// Order-preserving key of the documented ranking: NaN lowest, -0 == +0.
std::uint32_t rank_key(float x) {
  if (std::isnan(x)) return 0;
  if (x == 0.f) x = 0.f;
  std::uint32_t b;
  std::memcpy(&b, &x, 4);
  return (b & 0x80000000u) ? ~b + 1 : (b | 0x80000000u) + 1;  // +1: keep 0 for NaN
}

bool expect_error(i64 H, i64 N, kvscore::Budget b, const kvscore::SelectOptions& o) {
  if (b.count() < 0 || o.sinks < 0 || o.recent < 0 || !(o.alpha >= 0 && o.alpha <= 1)) return true;
  if (b.kind() == kvscore::Budget::Kind::per_head && b.count() > N) return true;
  const i64 s0 = std::min(o.sinks, N), e0 = std::max(s0, N - std::min(o.recent, N)), p = s0 + (N - e0);
  if (o.alloc == kvscore::Alloc::per_head) {
    i64 n = b.count();
    if (b.kind() == kvscore::Budget::Kind::per_layer) {
      if (H == 0 ? n != 0 : n % H != 0) return true;
      n = H == 0 ? 0 : n / H;
      if (n > N) return true;
    }
    return p > n;
  }
  __int128 B = b.kind() == kvscore::Budget::Kind::per_head ? __int128(b.count()) * H : b.count();
  if (B > __int128(H) * N) return true;
  return H > 0 && __int128(p) * H > B;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const i64 H = fdp.ConsumeIntegralInRange<i64>(0, 6), N = fdp.ConsumeIntegralInRange<i64>(0, 300);
  auto count = [&](i64 hi) -> i64 {
    switch (fdp.ConsumeIntegralInRange<int>(0, 9)) {
      case 0: return fdp.ConsumeIntegral<i64>();
      case 1: return hi;
      case 2: return hi + 1;
      case 3: return 0;
      default: return fdp.ConsumeIntegralInRange<i64>(0, std::max<i64>(hi, 0));
    }
  };
  kvscore::SelectOptions o;
  o.alloc = fdp.ConsumeBool() ? kvscore::Alloc::adakv : kvscore::Alloc::per_head;
  const bool per_layer = fdp.ConsumeBool();
  const kvscore::Budget budget = per_layer ? kvscore::Budget::per_layer(count(H * N)) : kvscore::Budget::per_head(count(N));
  o.sinks = fdp.ConsumeBool() ? 0 : count(N / 2 + 1);
  o.recent = fdp.ConsumeBool() ? 0 : count(N / 2 + 1);
  switch (fdp.ConsumeIntegralInRange<int>(0, 5)) {
    case 0: o.alpha = fdp.ConsumeFloatingPoint<double>(); break;
    case 1: o.alpha = std::numeric_limits<double>::quiet_NaN(); break;
    case 2: o.alpha = 1.0; break;
    case 3: o.alpha = 0.0; break;
    default: o.alpha = fdp.ConsumeProbability<double>(); break;
  }
  o.normalize = fdp.ConsumeBool();
  const int mode = fdp.ConsumeIntegralInRange<int>(0, 3);
  // Few distinct values make ties common (mode 1: small integers / 16).
  std::vector<float> sc = fz::values<float>(fdp, std::size_t(H * N), mode);
  const kvscore::ScoresView sv(H * N > 0 ? sc.data() : nullptr, H, N);

  const bool bad = expect_error(H, N, budget, o);
  kvscore::Selection s;
  try {
    o.num_threads = 1;
    o.kernels = kvscore::SelectKernels::portable;
    s = kvscore::select(sv, budget, o);
  } catch (const std::invalid_argument& e) {
    FZ_CHECK(bad, std::string("valid arguments rejected: ") + e.what());
    return 0;
  }
  FZ_CHECK(!bad, "invalid arguments accepted");
  const i64 total = kvscore::select_total(H, N, budget, o);
  FZ_CHECK(s.heads == H && s.tokens == N && i64(s.offsets.size()) == H + 1 && s.offsets[0] == 0, "CSR shape");
  FZ_CHECK(s.total() == total && i64(s.positions.size()) == total, "total != select_total");
  const i64 s0 = std::min(o.sinks, N), e0 = std::max(s0, N - std::min(o.recent, N)), p = s0 + (N - e0);
  const bool ada = o.alloc == kvscore::Alloc::adakv;
  i64 g = 0;  // AdaKV: guaranteed per head
  if (ada && H > 0) {
    const auto sg = static_cast<i64>(std::floor(o.alpha * double(total) / double(H)));
    g = std::max(std::min(sg, N), p);
  }
  // Reference: per head, protected + top (n - p) / (g - p) unprotected by the total order.
  std::vector<std::vector<char>> kept(std::size_t(H), std::vector<char>(std::size_t(N), 0));
  std::vector<std::tuple<std::uint32_t, i64, i64>> rest;  // AdaKV global step: (key, -pos, -head)
  for (i64 h = 0; h < H; ++h) {
    const float* x = sc.data() + h * N;
    std::vector<i64> u;
    for (i64 t = 0; t < N; ++t) {
      if (t < s0 || t >= e0) kept[h][t] = 1;
      else u.push_back(t);
    }
    std::stable_sort(u.begin(), u.end(), [&](i64 a, i64 b) { return rank_key(x[a]) > rank_key(x[b]); });
    const i64 m = ada ? g - p : total / std::max<i64>(H, 1) - p;
    for (i64 i = 0; i < i64(u.size()); ++i) {
      if (i < m) kept[h][u[i]] = 1;
      else if (ada) rest.emplace_back(rank_key(x[u[i]]), -u[i], -h);
    }
  }
  const i64 fill = ada ? total - H * g : 0;
  FZ_CHECK(fill >= 0 && fill <= i64(rest.size()), "AdaKV fill out of range");
  // Check the head counts and positions.
  for (i64 h = 0; h < H; ++h) {
    const auto pos = s.head(h);
    FZ_CHECK(s.offsets[h + 1] >= s.offsets[h], "offsets not monotone");
    if (!ada) FZ_CHECK(i64(pos.size()) == total / H, "per-head count");
    else FZ_CHECK(i64(pos.size()) >= g, "AdaKV head below its guarantee");
    for (std::size_t i = 0; i < pos.size(); ++i) {
      FZ_CHECK(pos[i] >= 0 && pos[i] < N, "position out of range");
      if (i > 0) FZ_CHECK(pos[i] > pos[i - 1], "positions not strictly ascending");
    }
    std::vector<char> got(std::size_t(N), 0);
    for (i64 t : pos) got[t] = 1;
    for (i64 t = 0; t < N; ++t)
      if (kept[h][t]) FZ_CHECK(got[t], "protected / safeguarded / top position " + std::to_string(t) + " of head " +
                                           std::to_string(h) + " missing");
    if (!ada) FZ_CHECK(got == kept[h], "per-head selection differs from the reference");
  }
  if (ada && !o.normalize) {
    std::sort(rest.begin(), rest.end(), std::greater<>());
    for (i64 i = 0; i < fill; ++i) kept[-std::get<2>(rest[i])][-std::get<1>(rest[i])] = 1;
    for (i64 h = 0; h < H; ++h) {
      std::vector<char> got(std::size_t(N), 0);
      for (i64 t : s.head(h)) got[t] = 1;
      FZ_CHECK(got == kept[h], "AdaKV selection of head " + std::to_string(h) + " differs from the reference");
    }
  }
  // Every kernel set, thread count and the no-allocation path agree.
  for (auto k : {kvscore::SelectKernels::portable, kvscore::SelectKernels::avx2, kvscore::SelectKernels::avx512,
                 kvscore::SelectKernels::best}) {
    if (!kvscore::select_kernels_supported(k)) continue;
    for (int th : {1, 2, 3}) {
      o.kernels = k;
      o.num_threads = th;
      const kvscore::Selection t = kvscore::select(sv, budget, o);
      FZ_CHECK(t.offsets == s.offsets && t.positions == s.positions,
               "kernels " + std::string(kvscore::select_kernels_name(k)) + " threads " + std::to_string(th) + " differ");
    }
    std::vector<unsigned char> ws(kvscore::select_workspace_bytes(H, N, budget, o) + 7);
    std::vector<i64> off(static_cast<std::size_t>(H + 1)), pos(static_cast<std::size_t>(total));
    const i64 w = kvscore::select_into(sv, budget, o, ws.data() + 7, ws.size() - 7, off.data(), pos.data(), pos.size());
    FZ_CHECK(w == total && off == s.offsets && pos == s.positions, "select_into differs");
  }
  return 0;
}
