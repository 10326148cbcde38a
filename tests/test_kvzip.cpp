// KVzip (include/kvscore/scorers/kvzip.hpp, docs/methods/kvzip.md): the scorer of attention received
// against a float64 brute-force reference of the definition (every placement, aggregate, span,
// sinks and weights; fp32/fp16/bf16 keys; every kernel table), chunking over queries and
// threads (bit-identical), closed forms, SnapKV's mean as a peer, invalid rows and the errors.
// python/tests/test_kvzip.py checks the same scorer against kvpress's own KVzipPress (torch).
//
// Tolerance: as SnapKV's (tests/test_snapkv.cpp): a probability is exp(l − m)/s with fp32
// logits l = q̃·k, so |δp|/p <= 3(d+2)u·L + a few u (L: the largest Σ_j|q_j k_j|/√d); the max
// and the mean keep that relative bound.
#include <catch2/catch.hpp>

#include <kvscore/kvscore.hpp>

#include "test_support.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

using kvscore::KVzip;
using kvscore::KVzipSpan;
using kvscore::QueryAggregate;
using kvscore::QueryPlacement;
using Catch::Matchers::Contains;
using namespace test_support;

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

// The Debug sanitizer build (CI's ASan step) runs a thinned grid of the chunking and attend_span
// tests below: every parameter value still appears, every code path runs under the sanitizers, and
// the full cross product (~150 s of CPU there, at -O0) runs in the optimised builds.
#if defined(NDEBUG)
constexpr bool kFullGrid = true;
#else
constexpr bool kFullGrid = false;
#endif

/// Keys as doubles [H][N][d] (rounded through T first, as the scorer reads them).
template <class T>
std::vector<double> widen(const std::vector<float>& v) {
  std::vector<double> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = double(kvscore::to_float(kvscore::from_float<T>(v[i])));
  return out;
}

struct RefIn {
  std::int64_t H = 0, Nc = 0, m = 0, d = 0, Hq = 0;
  std::vector<double> cache, own;  // [H][Nc][d], [H][m][d] (own may be empty: after the cache)
  std::vector<float> q;            // [Hq][m][d]
  std::int64_t b = 0, e = 0, s = 0;
  std::vector<float> qw, kw;       // [m], [Hq][e - b] (empty: 1)
  QueryAggregate agg = QueryAggregate::max;
  bool score_own = false;
};

bool valid_row(const double* r, std::int64_t d) {
  double s = 0;
  for (std::int64_t j = 0; j < d; ++j) {
    if (!std::isfinite(r[j])) return false;
    s += r[j] * r[j];
  }
  return s <= double(std::numeric_limits<float>::max());
}

/// The definition in float64: out[h][t] for the span (and the own rows, after the cache's Nc
/// rows, when score_own); NaN where not written. Also returns L (the tolerance's scale).
std::vector<double> reference(const RefIn& in, double* L) {
  const std::int64_t H = in.H, G = in.Hq / in.H, d = in.d, m = in.m, nb = in.e - in.b;
  const bool has_own = !in.own.empty();
  std::vector<double> out(std::size_t(H * (in.Nc + m)), std::nan(""));
  *L = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    // the key set of query i: sinks, span, own rows [0, i]
    std::vector<const double*> rows;
    for (std::int64_t t = 0; t < in.s; ++t) rows.push_back(&in.cache[std::size_t((h * in.Nc + t) * d)]);
    for (std::int64_t t = in.b; t < in.e; ++t) rows.push_back(&in.cache[std::size_t((h * in.Nc + t) * d)]);
    const std::int64_t nc = std::int64_t(rows.size());
    if (has_own)
      for (std::int64_t i = 0; i < m; ++i) rows.push_back(&in.own[std::size_t((h * m + i) * d)]);
    std::vector<double> acc(rows.size(), 0.0);
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t i = 0; i < m; ++i) {
        const float* q = &in.q[std::size_t(((h * G + g) * m + i) * d)];
        const std::int64_t ni = has_own ? nc + i + 1 : nc;
        std::vector<double> l(std::size_t(ni), -INFINITY);
        double mx = -INFINITY;
        for (std::int64_t t = 0; t < ni; ++t) {
          if (!valid_row(rows[std::size_t(t)], d)) continue;
          double x = 0, a = 0;
          for (std::int64_t j = 0; j < d; ++j) {
            x += double(q[j]) * rows[std::size_t(t)][j];
            a += std::fabs(double(q[j]) * rows[std::size_t(t)][j]);
          }
          l[std::size_t(t)] = x / std::sqrt(double(d));
          *L = std::max(*L, a / std::sqrt(double(d)));
          mx = std::max(mx, l[std::size_t(t)]);
        }
        if (mx == -INFINITY) continue;
        double z = 0;
        for (double x : l) z += std::exp(x - mx);
        const double alpha = in.qw.empty() ? 1.0 : double(in.qw[std::size_t(i)]);
        for (std::int64_t t = 0; t < ni; ++t) {
          double p = std::exp(l[std::size_t(t)] - mx) / z * alpha;
          if (t >= in.s && t < nc && !in.kw.empty()) p *= double(in.kw[std::size_t((h * G + g) * nb + t - in.s)]);
          acc[std::size_t(t)] = in.agg == QueryAggregate::max ? std::max(acc[std::size_t(t)], p) : acc[std::size_t(t)] + p;
        }
      }
    const double scale = in.agg == QueryAggregate::max ? 1.0 : 1.0 / double(G * m);
    auto put = [&](std::int64_t t_out, std::int64_t r) {
      out[std::size_t(h * (in.Nc + m) + t_out)] =
          valid_row(rows[std::size_t(r)], d) ? acc[std::size_t(r)] * scale : -INFINITY;
    };
    for (std::int64_t t = in.b; t < in.e; ++t) put(t, in.s + t - in.b);
    if (in.score_own)
      for (std::int64_t i = 0; i < m; ++i) put(in.Nc + i, nc + i);
  }
  return out;
}

/// |got − want| within the bound, for every written entry; -inf matches -inf.
void check_close(const float* got, const double* want, std::int64_t n, double L, std::int64_t d) {
  const double tol = (3.0 * double(d + 2) * L + 16.0) * kU;
  for (std::int64_t t = 0; t < n; ++t) {
    if (std::isnan(want[t])) continue;
    INFO("entry " << t << ": got " << got[t] << ", want " << want[t]);
    if (std::isinf(want[t])) {
      CHECK(got[t] == -std::numeric_limits<float>::infinity());
      continue;
    }
    CHECK(std::fabs(double(got[t]) - want[t]) <= tol * want[t] + 1e-30);
  }
}

struct Case {
  std::int64_t H, G, Nc, m, d;
};

}  // namespace

TEMPLATE_TEST_CASE("KVzip score(keys) matches the float64 reference: in-cache and after-cache, max and mean, GQA",
                   "[kvzip]", float, half, bfloat16) {
  const Case cases[] = {{1, 1, 40, 7, 8}, {2, 2, 97, 16, 33}, {2, 4, 130, 24, 64}, {3, 3, 70, 9, 64}};
  std::uint32_t seed = 11;
  for (const Case& c : cases)
    for (const auto* table : kernel_tables())
      for (QueryAggregate agg : kvscore::kQueryAggregates)
        for (QueryPlacement pl : kvscore::kQueryPlacements) {
          INFO("H " << c.H << " G " << c.G << " N " << c.Nc << " m " << c.m << " d " << c.d << " table "
                    << (table ? table->name : "active") << " " << kvscore::to_string(agg) << " "
                    << kvscore::to_string(pl));
          const bool in_cache = pl == QueryPlacement::in_cache;
          const std::int64_t N = c.Nc + (in_cache ? c.m : 0);
          const Cache k = random_cache(seed++, c.H, N, c.d, 0.3f);
          const std::vector<float> q = randn(std::size_t(c.H * c.G * c.m * c.d), seed++, 1.5f);
          KVzip z(q.data(), c.H * c.G, c.m, c.d);
          z.isa = table;
          z.aggregate = agg;
          z.placement = pl;
          const kvscore::Scores got = run<TestType>(z, k);
          CHECK(z.protected_recent() == (in_cache ? c.m : 0));

          // reference: cache rows [0, P), own rows [P, N) (in-cache), span = the cache rows
          RefIn in;
          in.H = c.H, in.Nc = N - (in_cache ? c.m : 0), in.m = c.m, in.d = c.d, in.Hq = c.H * c.G, in.q = q;
          const std::vector<double> all = widen<TestType>(k.v);
          for (std::int64_t h = 0; h < c.H; ++h) {
            in.cache.insert(in.cache.end(), all.begin() + h * N * c.d, all.begin() + (h * N + in.Nc) * c.d);
            if (in_cache) in.own.insert(in.own.end(), all.begin() + (h * N + in.Nc) * c.d, all.begin() + (h + 1) * N * c.d);
          }
          in.b = 0, in.e = in.Nc, in.agg = agg, in.score_own = in_cache;
          double L = 0;
          const std::vector<double> want = reference(in, &L);
          for (std::int64_t h = 0; h < c.H; ++h)
            check_close(got.head(h), want.data() + h * (in.Nc + c.m), N, L, c.d);
        }
}

TEMPLATE_TEST_CASE("KVzip score_span matches the float64 reference: sinks, a span, own rows, KVzip+ weights",
                   "[kvzip]", float, half, bfloat16) {
  const std::int64_t H = 2, G = 3, Nc = 150, m = 40, d = 64;
  const Cache cache = random_cache(3, H, Nc, d, 0.2f);
  const Cache own = random_cache(4, H, m, d, 0.2f);
  const std::vector<float> q = randn(std::size_t(H * G * m * d), 5, 1.5f);
  const std::vector<float> qw = [&] {
    std::vector<float> w = randn(std::size_t(m), 6);
    for (float& x : w) x = 0.5f + std::fabs(x);
    return w;
  }();
  const std::vector<TestType> cdata = cache.as<TestType>(), odata = own.as<TestType>();
  const auto cv = view_of(cdata, cache);
  const auto ov = view_of(odata, own);
  struct Span {
    std::int64_t b, e, sinks;
    bool weights;
  };
  for (const Span sp : {Span{0, 150, 4, false}, Span{20, 90, 4, false}, Span{20, 90, 4, true}, Span{2, 60, 4, true},
                        Span{90, 150, 0, false}, Span{50, 50, 4, false}})
    for (QueryAggregate agg : kvscore::kQueryAggregates) {
      INFO("span [" << sp.b << ", " << sp.e << ") sinks " << sp.sinks << " weights " << sp.weights << " "
                    << kvscore::to_string(agg));
      std::vector<float> kw(std::size_t(H * G * (sp.e - sp.b)));
      for (std::size_t i = 0; i < kw.size(); ++i) kw[i] = 0.25f + float(i % 13) * 0.1f;
      KVzip z(q.data(), H * G, m, d);
      z.aggregate = agg;
      KVzipSpan span{sp.b, sp.e, sp.sinks, sp.weights ? qw.data() : nullptr, sp.weights ? kw.data() : nullptr};
      kvscore::Scores got(H, Nc);
      std::fill(got.data(), got.data() + H * Nc, 7.0f);  // untouched outside the span
      z.score_span(cv, ov, span, got.view());

      RefIn in;
      in.H = H, in.Nc = Nc, in.m = m, in.d = d, in.Hq = H * G, in.q = q;
      in.cache = widen<TestType>(cache.v), in.own = widen<TestType>(own.v);
      in.b = sp.b, in.e = sp.e, in.s = std::min(sp.sinks, sp.b), in.agg = agg;
      if (sp.weights) in.qw = qw, in.kw = kw;
      double L = 0;
      const std::vector<double> want = reference(in, &L);
      for (std::int64_t h = 0; h < H; ++h) {
        check_close(got.head(h), want.data() + h * (Nc + m), Nc, L, d);
        for (std::int64_t t = 0; t < Nc; ++t)
          if (t < sp.b || t >= sp.e) CHECK(got.head(h)[t] == 7.0f);
      }
    }
}

TEMPLATE_TEST_CASE("KVzip: chunking over queries and threads give bit-identical scores, and paged views equal "
                   "dense ones",
                   "[kvzip]", float, half, bfloat16) {
  const std::int64_t H = 3, G = 3, N = 300, m = 45, d = 64;
  const Cache k = random_cache(21, H, N, d, 0.4f);
  const Cache own = random_cache(22, H, m, d, 0.4f);
  const std::vector<float> q = randn(std::size_t(H * G * m * d), 23, 2.0f);
  const std::vector<TestType> kd = k.as<TestType>(), od = own.as<TestType>();
  const std::vector<TestType> blocks = to_blocks(kd, H, N, d, 16);
  const BlockView<TestType> paged{blocks.data(), H, N, d, 16};
  for (QueryAggregate agg : kvscore::kQueryAggregates) {
    auto make = [&](std::int64_t block, int threads) {
      KVzip z(q.data(), H * G, m, d);
      z.aggregate = agg;
      z.query_block = block;
      z.num_threads = threads;
      return z;
    };
    const KVzip ref = make(m, 1);  // one block: unchunked
    const kvscore::Scores a = ref.score(view_of(kd, k));
    kvscore::Scores sa(H, N);
    ref.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{30, 250, 4}, sa.view());
    int nth = 0;
    for (std::int64_t block : {1, 2, 7, 16, 0, 200})
      for (int threads : {1, 2, 3}) {
        // thinned: each (aggregate, block) with one thread count, the three in turn
        if (!kFullGrid && threads != 1 + (nth++ / 3 + int(agg)) % 3) continue;
        INFO(kvscore::to_string(agg) << " query_block " << block << " threads " << threads);
        const KVzip z = make(block, threads);
        const kvscore::Scores b = z.score(view_of(kd, k));
        CHECK(std::memcmp(a.data(), b.data(), a.values().size() * sizeof(float)) == 0);
        const kvscore::Scores c = z.score(paged);
        CHECK(std::memcmp(a.data(), c.data(), a.values().size() * sizeof(float)) == 0);
        kvscore::Scores sb(H, N), sc(H, N);
        z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{30, 250, 4}, sb.view());
        z.score_span(paged, view_of(od, own), KVzipSpan{30, 250, 4}, sc.view());
        CHECK(std::memcmp(sa.data() + 0, sb.data(), sa.values().size() * sizeof(float)) == 0);
        CHECK(std::memcmp(sa.data() + 0, sc.data(), sa.values().size() * sizeof(float)) == 0);
      }
  }
}

/// The pass's causal attention in float64: out[i][hq][u] = Σ_t softmax_t(q·k_t/√d) v_t[u] over the
/// cache's Nc rows and the own rows [0, i] (invalid key rows left out).
std::vector<double> attention_reference(const std::vector<double>& cache, const std::vector<double>& own,
                                        const std::vector<double>& vals, const std::vector<double>& own_vals,
                                        const std::vector<float>& q, std::int64_t H, std::int64_t G, std::int64_t Nc,
                                        std::int64_t m, std::int64_t d, std::int64_t dv) {
  std::vector<double> out(std::size_t(m * H * G * dv), 0.0);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t g = 0; g < G; ++g)
      for (std::int64_t i = 0; i < m; ++i) {
        const float* qi = &q[std::size_t(((h * G + g) * m + i) * d)];
        std::vector<const double*> k, v;
        for (std::int64_t t = 0; t < Nc; ++t)
          k.push_back(&cache[std::size_t((h * Nc + t) * d)]), v.push_back(&vals[std::size_t((h * Nc + t) * dv)]);
        for (std::int64_t t = 0; t <= i; ++t)
          k.push_back(&own[std::size_t((h * m + t) * d)]), v.push_back(&own_vals[std::size_t((h * m + t) * dv)]);
        std::vector<double> l(k.size(), -INFINITY);
        double mx = -INFINITY, z = 0;
        for (std::size_t t = 0; t < k.size(); ++t) {
          if (!valid_row(k[t], d)) continue;
          double x = 0;
          for (std::int64_t j = 0; j < d; ++j) x += double(qi[j]) * k[t][j];
          l[t] = x / std::sqrt(double(d));
          mx = std::max(mx, l[t]);
        }
        for (double x : l) z += std::exp(x - mx);
        double* o = &out[std::size_t((i * H * G + h * G + g) * dv)];
        for (std::size_t t = 0; t < k.size(); ++t)
          if (l[t] > -INFINITY)
            for (std::int64_t u = 0; u < dv; ++u) o[u] += std::exp(l[t] - mx) / z * v[t][u];
      }
  return out;
}

TEMPLATE_TEST_CASE("KVzip attend_span: score_span's scores to 1e-5 and the pass's causal attention of a "
                   "float64 reference, for any chunking, thread count, invalid key and a row max far outside the span",
                   "[kvzip]", float, half, bfloat16) {
  // dv: two panels of 16 and a partial one; m: three of attend_span's tasks (64, 64, 12 queries)
  const std::int64_t H = 2, G = 3, Nc = 150, m = 140, d = 64, dv = 40;
  Cache cache = random_cache(31, H, Nc, d, 0.3f);
  const Cache own = random_cache(32, H, m, d, 0.3f);
  const Cache vals = random_cache(33, H, Nc, dv, 1.0f), own_vals = random_cache(34, H, m, dv, 1.0f);
  const std::vector<float> q = randn(std::size_t(H * G * m * d), 35, 1.5f);
  std::vector<float> qw(static_cast<std::size_t>(m));
  for (std::size_t i = 0; i < qw.size(); ++i) qw[i] = 0.5f + float(i % 7) * 0.1f;
  for (int variant : {0, 1, 2}) {
    INFO("variant " << variant);
    if (variant == 1) cache.row(1, 70)[3] = std::numeric_limits<float>::quiet_NaN();  // a key of the span
    // a cache row along head 0's first queries: for them the row's max lies far (> kRescaleLimit) above
    // the span [20, 90)'s and its sinks', where the scores take score_head's own exp instead of E's
    if (variant == 2)
      for (std::int64_t j = 0; j < d; ++j) cache.row(0, 120)[j] = 2.0f * (q[std::size_t(j)] + q[std::size_t(d + j)]);
    const std::vector<TestType> cd = cache.as<TestType>(), od = own.as<TestType>(), vd = vals.as<TestType>(),
                                ovd = own_vals.as<TestType>();
    const std::vector<double> want = attention_reference(widen<TestType>(cache.v), widen<TestType>(own.v),
                                                         widen<TestType>(vals.v), widen<TestType>(own_vals.v), q, H,
                                                         G, Nc, m, d, dv);
    int combo = 0;
    for (const KVzipSpan base : {KVzipSpan{0, 150, 4}, KVzipSpan{20, 90, 4}, KVzipSpan{90, 150, 0}})
      for (QueryAggregate agg : kvscore::kQueryAggregates)
        for (std::int64_t block : {0, 7}) {
          // thinned: one (aggregate, block) of four per span and variant, in turn
          if (!kFullGrid && (combo++ + variant) % 4 != 0) continue;
          std::vector<float> serial_scores, serial_attn;  // threads = 1's
          for (int threads : {1, 2}) {
            INFO("span [" << base.begin << ", " << base.end << ") "
                            << kvscore::to_string(agg) << " query_block " << block << " threads " << threads);
            std::vector<float> kw(std::size_t(H * G * (base.end - base.begin)));
            for (std::size_t i = 0; i < kw.size(); ++i) kw[i] = 0.25f + float(i % 13) * 0.1f;
            const KVzipSpan span{base.begin, base.end, base.sinks, qw.data(), kw.data()};
            KVzip z(q.data(), H * G, m, d);
            z.aggregate = agg;
            z.query_block = block;
            z.num_threads = threads;
            kvscore::Scores a(H, Nc), b(H, Nc);
            std::fill(a.data(), a.data() + H * Nc, 7.0f);
            std::fill(b.data(), b.data() + H * Nc, 7.0f);
            z.score_span(view_of(cd, cache), view_of(od, own), span, a.view());
            std::vector<float> attn(std::size_t(m * H * G * dv), -1.0f);
            z.attend_span(view_of(cd, cache), view_of(od, own), view_of(vd, vals), view_of(ovd, own_vals), span,
                          b.view(), attn.data());
            // the same logits; the subset's softmax from the attention's exponentials (exp(l - row max)
            // instead of exp(l - subset max): a few ulp of the exponent, ~1e-6 of a score)
            double worst_score = 0;
            for (std::size_t i = 0; i < a.values().size(); ++i)
              if (a.data()[i] != b.data()[i])
                worst_score = std::max(worst_score, std::fabs(double(a.data()[i]) - b.data()[i]) /
                                                        std::max(std::fabs(double(a.data()[i])), 1e-30));
            CHECK(worst_score <= 1e-5);
            // fp32 logits (relative error ~ d·u·L, L ~ 10 here) and fp32 sums of <= 190 terms of values ~N(0, 2):
            // 1e-4 is ~10x what they reach; a row masked wrong or a value dimension lost is off by > 1e-2
            double worst = 0;
            for (std::size_t i = 0; i < attn.size(); ++i)
              worst = std::max(worst, std::fabs(double(attn[i]) - want[i]) / (1.0 + std::fabs(want[i])));
            CHECK(worst <= 1e-4);
            // the same bits on any thread count (fixed tasks, partials combined in order)
            if (threads == 1) {
              serial_scores = b.values(), serial_attn = attn;
            } else {
              CHECK(std::memcmp(serial_scores.data(), b.data(), serial_scores.size() * sizeof(float)) == 0);
              CHECK(std::memcmp(serial_attn.data(), attn.data(), attn.size() * sizeof(float)) == 0);
            }
          }
        }
  }
}

TEST_CASE("KVzip attend_span: mismatched values and a null output throw, naming them", "[kvzip][errors]") {
  const std::int64_t H = 1, m = 4, d = 8, Nc = 10;
  const Cache cache = random_cache(41, H, Nc, d), own = random_cache(42, H, m, d);
  const Cache short_vals = random_cache(43, H, Nc - 1, d), vals = random_cache(44, H, Nc, d);
  const std::vector<float> q = randn(std::size_t(H * m * d), 45);
  KVzip z(q.data(), H, m, d);
  kvscore::Scores s(H, Nc);
  std::vector<float> attn(std::size_t(m * H * d));
  CHECK_THROWS_WITH(z.attend_span(view_of(cache.v, cache), view_of(own.v, own), view_of(short_vals.v, short_vals),
                                  view_of(own.v, own), KVzipSpan{0, Nc, 0}, s.view(), attn.data()),
                    Contains("values [1 heads, 9 rows] do not match the keys [1, 10]"));
  CHECK_THROWS_WITH(z.attend_span(view_of(cache.v, cache), view_of(own.v, own), view_of(vals.v, vals),
                                  view_of(vals.v, vals), KVzipSpan{0, Nc, 0}, s.view(), attn.data()),
                    Contains("own values [1 heads, 10 rows] do not match the keys [1, 4]"));
  CHECK_THROWS_WITH(z.attend_span(view_of(cache.v, cache), view_of(own.v, own), view_of(vals.v, vals),
                                  view_of(own.v, own), KVzipSpan{0, Nc, 0}, s.view(), nullptr),
                    Contains("attn_out is null"));
}

TEST_CASE("KVzip: mean aggregation in the cache is SnapKV without pooling", "[kvzip]") {
  const std::int64_t H = 2, G = 4, N = 120, w = 16, d = 32;
  const Cache k = random_cache(31, H, N, d, 0.3f);
  const std::vector<float> q = randn(std::size_t(H * G * w * d), 32, 1.5f);
  KVzip z(q.data(), H * G, w, d);
  z.aggregate = QueryAggregate::mean;
  kvscore::SnapKV snap(q.data(), H * G, w, d);
  snap.kernel_size = 1;
  const kvscore::Scores a = run(z, k), b = run(snap, k);
  CHECK(z.protected_recent() == snap.protected_recent());
  for (std::size_t i = 0; i < a.values().size(); ++i) CHECK(a.values()[i] == Approx(b.values()[i]).epsilon(1e-5));
  // max >= mean, and max >= every single query's probability: so max >= the mean
  z.aggregate = QueryAggregate::max;
  const kvscore::Scores c = run(z, k);
  for (std::size_t i = 0; i < a.values().size(); ++i) CHECK(c.values()[i] >= a.values()[i] * (1 - 1e-6f));
}

TEST_CASE("KVzip closed forms: identical keys give 1/|S_i|, and a key along every query takes the mass", "[kvzip]") {
  const std::int64_t H = 1, G = 2, Nc = 50, m = 10, d = 16;
  Cache cache(H, Nc, d), own(H, m, d);
  for (float& x : cache.v) x = 0.25f;
  for (float& x : own.v) x = 0.25f;
  const std::vector<float> q = randn(std::size_t(H * G * m * d), 41);
  KVzip z(q.data(), H * G, m, d);
  const std::vector<float> cd = cache.v, od = own.v;
  kvscore::Scores s(H, Nc);
  // sinks 4, span [10, 30): query i sees 4 + 20 + i + 1 keys, all equal: p = 1/(25 + i), max at i = 0
  z.score_span(view_of(cd, cache), view_of(od, own), KVzipSpan{10, 30, 4}, s.view());
  for (std::int64_t t = 10; t < 30; ++t) CHECK(s.head(0)[t] == Approx(1.0 / 25).epsilon(1e-6));
  z.aggregate = QueryAggregate::mean;  // mean over i of 1/(25 + i)
  z.score_span(view_of(cd, cache), view_of(od, own), KVzipSpan{10, 30, 4}, s.view());
  double mean = 0;
  for (int i = 0; i < m; ++i) mean += 1.0 / (25 + i) / m;
  for (std::int64_t t = 10; t < 30; ++t) CHECK(s.head(0)[t] == Approx(mean).epsilon(1e-6));

  // one cache key along every query, the rest zero: it takes ~all the mass of each
  const std::vector<float> u = randn(std::size_t(d), 42);
  std::vector<float> qa(std::size_t(H * G * m * d));
  const std::vector<float> noise = randn(qa.size(), 43, 0.05f);
  for (std::size_t i = 0; i < qa.size(); ++i) qa[i] = u[i % std::size_t(d)] + noise[i];
  Cache c2(H, Nc, d), o2(H, m, d);
  for (std::int64_t j = 0; j < d; ++j) c2.row(0, 17)[j] = 10.f * u[std::size_t(j)];
  KVzip mx(qa.data(), H * G, m, d);
  const std::vector<float> c2d = c2.v, o2d = o2.v;
  mx.score_span(view_of(c2d, c2), view_of(o2d, o2), KVzipSpan{0, Nc, 0}, s.view());
  CHECK(s.head(0)[17] > 0.99f);
  for (std::int64_t t = 0; t < Nc; ++t)
    if (t != 17) CHECK(s.head(0)[t] < 1e-6f);
}

TEMPLATE_TEST_CASE("KVzip: invalid rows score -inf and take no part in any softmax", "[kvzip]", float, bfloat16) {
  const std::int64_t H = 2, G = 2, N = 60, w = 8, d = 16;
  Cache k = random_cache(51, H, N, d);
  const std::vector<float> q = randn(std::size_t(H * G * w * d), 52);
  const std::vector<std::int64_t> bad = {3, 20, 55};  // 55: inside the window (an own row)
  for (std::int64_t t : bad) k.row(1, t)[2] = kNaN;
  KVzip z(q.data(), H * G, w, d);
  const kvscore::Scores s = run<TestType>(z, k);
  for (std::int64_t t : bad) CHECK(s.head(1)[t] == -kInf);
  // the rest equals the definition, whose softmax leaves the invalid rows out
  RefIn in;
  in.H = H, in.Nc = N - w, in.m = w, in.d = d, in.Hq = H * G, in.q = q, in.b = 0, in.e = N - w, in.score_own = true;
  const std::vector<double> all = widen<TestType>(k.v);
  for (std::int64_t h = 0; h < H; ++h) {
    in.cache.insert(in.cache.end(), all.begin() + h * N * d, all.begin() + (h * N + N - w) * d);
    in.own.insert(in.own.end(), all.begin() + (h * N + N - w) * d, all.begin() + (h + 1) * N * d);
  }
  double L = 0;
  const std::vector<double> want = reference(in, &L);
  for (std::int64_t h = 0; h < H; ++h) check_close(s.head(h), want.data() + h * N, N, L, d);
  for (std::int64_t t = 0; t < N; ++t) CHECK(std::isfinite(s.head(0)[t]));
  // every row invalid: every score -inf, no NaN
  Cache none = k;
  for (float& x : none.v) x = kInf;
  const kvscore::Scores n = run<TestType>(z, none);
  for (float x : n.values()) CHECK(x == -kInf);
}

TEST_CASE("KVzip: bad arguments throw std::invalid_argument naming the values", "[kvzip][errors]") {
  const std::int64_t H = 2, G = 2, N = 30, w = 5, d = 8;
  const Cache k = random_cache(61, H, N, d);
  const Cache own = random_cache(62, H, w, d);
  std::vector<float> q = randn(std::size_t(H * G * w * d), 63);
  CHECK_THROWS_WITH(KVzip(q.data(), H * G, 0, d), Contains("window must be > 0"));
  CHECK_THROWS_WITH(KVzip(nullptr, H * G, w, d), Contains("queries is null"));
  CHECK_THROWS_WITH(KVzip(q.data(), 3, w, d, 2), Contains("group 2 must be >= 0 and divide q_heads 3"));
  std::vector<float> nanq = q;
  nanq[std::size_t(d + 3)] = kNaN;
  CHECK_THROWS_WITH(KVzip(nanq.data(), H * G, w, d), Contains("[head 0, query 1, dim 3] is not finite"));

  KVzip z(q.data(), H * G, w, d);
  z.query_block = -1;
  CHECK_THROWS_WITH(run(z, k), Contains("query_block must be >= 0 (got -1"));
  z.query_block = 0;
  const Cache few = random_cache(64, H, 3, d);
  CHECK_THROWS_WITH(run(z, few), Contains("n_queries 5 > tokens 3"));
  const Cache three = random_cache(65, 3, N, d);
  CHECK_THROWS_WITH(run(z, three), Contains("q_heads 4 is not a multiple of the keys' kv_heads 3"));

  const std::vector<float> kd = k.v, od = own.v;
  kvscore::Scores s(H, N);
  const Cache short_own = random_cache(66, H, w - 1, d);
  const std::vector<float> sod = short_own.v;
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(sod, short_own), KVzipSpan{0, N, 0}, s.view()),
                    Contains("own keys have 4 rows, expected one per query (5)"));
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{10, 31, 0}, s.view()),
                    Contains("span [10, 31) is not inside the cache's 30 rows"));
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{10, 5, 0}, s.view()),
                    Contains("span [10, 5)"));
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{0, N, -1}, s.view()),
                    Contains("sinks must be >= 0 (got -1)"));
  std::vector<float> qw(std::size_t(w), 1.f);
  qw[2] = 0.f;
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{0, N, 0, qw.data()}, s.view()),
                    Contains("query_weights[2] = 0.000000 must be finite and > 0"));
  std::vector<float> kw(std::size_t(H * G * 10), 1.f);
  kw[13] = -1.f;
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{0, 10, 0, nullptr, kw.data()}, s.view()),
                    Contains("key_weights[1][3] = -1.000000 must be finite and >= 0"));
  kvscore::Scores wrong(H, N + 1);
  CHECK_THROWS_WITH(z.score_span(view_of(kd, k), view_of(od, own), KVzipSpan{}, wrong.view()),
                    Contains("does not match keys"));
}
