// Tests of `kvscore retrieve` and `kvscore pariskv-codebook` (run as a process,
// KVSCORE_CLI_PATH): the outputs equal the library's kvscore::pariskv_retrieve / lloyd_max, the
// codebook matches the reference numbers, and every bad input gives exit code 2 and exactly
// one "kvscore: " line on stderr with no output left behind.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <kvscore/io/npy.hpp>
#include <kvscore/pariskv/pariskv.hpp>

#include "cli_harness.hpp"

namespace {

namespace fs = std::filesystem;
namespace npy = kvscore::npy;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("pariskv"); return d; }
std::string path(const std::string& name) { return dir().file(name); }
cli_test::Result cli(const std::string& args) { return cli_test::run(dir(), args); }

constexpr std::int64_t H = 2, N = 700, D = 32, HQ = 4, NQ = 3;

std::vector<float> normal(std::size_t n, std::uint64_t seed) {
  kvscore::pariskv::SplitMix64 g(seed);
  std::vector<float> v(n);
  for (auto& x : v) {
    const double a = double(g.next() >> 11) * 0x1.0p-53, b = double(g.next() >> 11) * 0x1.0p-53;
    x = float(std::sqrt(-2.0 * std::log(a + 1e-300)) * std::cos(6.283185307179586 * b));
  }
  return v;
}

const std::vector<float>& keys() {
  static const std::vector<float> k = [] {
    auto v = normal(std::size_t(H * N * D), 1);
    npy::save<float>(path("k.npy"), {H, N, D}, v.data());
    std::vector<kvscore::half> h(v.size());
    kvscore::convert(v.data(), h.data(), v.size());
    npy::save<kvscore::half>(path("k16.npy"), {H, N, D}, h.data());
    return v;
  }();
  return k;
}
const std::vector<float>& queries() {
  static const std::vector<float> q = [] {
    auto v = normal(std::size_t(HQ * NQ * D), 2);
    npy::save<float>(path("q.npy"), {HQ, NQ, D}, v.data());
    return v;
  }();
  return q;
}

void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad.npy"});
}

}  // namespace

TEST_CASE("cli pariskv: retrieve equals the library", "[cli][pariskv]") {
  keys();
  queries();
  for (const char* kf : {"k.npy", "k16.npy"}) {
    for (int rerank : {0, 30}) {
      INFO(kf << " rerank " << rerank);
      std::string args = std::string("retrieve --keys ") + path(kf) + " --queries " + path("q.npy") +
                         " --topk 10 --out " + path("i.npy");
      if (rerank) args += " --rerank-exact " + std::to_string(rerank);
      const cli_test::Result r = cli(args);
      INFO(r.err);
      REQUIRE(r.rc == 0);
      const npy::Array out = npy::load(path("i.npy"));
      REQUIRE(out.descr == "<i8");
      REQUIRE(out.shape == std::vector<std::int64_t>{HQ, NQ, 10});
      kvscore::ParisKVSearch o;
      o.k = 10;
      o.rerank_exact = rerank;
      std::vector<std::int64_t> want;
      if (std::string(kf) == "k.npy") {
        want = kvscore::pariskv_retrieve(kvscore::KeysView<float>(keys().data(), H, N, D, N * D, D), queries().data(),
                                         HQ, NQ, HQ / H, o);
      } else {
        std::vector<kvscore::half> h(keys().size());
        kvscore::convert(keys().data(), h.data(), h.size());
        want = kvscore::pariskv_retrieve(kvscore::KeysView<kvscore::half>(h.data(), H, N, D, N * D, D), queries().data(),
                                         HQ, NQ, HQ / H, o);
      }
      const std::int64_t* got = out.as<std::int64_t>();
      CHECK(std::vector<std::int64_t>(got, got + HQ * NQ * 10) == want);
      for (std::int64_t row = 0; row < HQ * NQ; ++row)
        for (int i = 1; i < 10; ++i) CHECK(got[row * 10 + i - 1] < got[row * 10 + i]);
    }
  }
  // --group equal to the GQA size and --threads do not change the result
  REQUIRE(cli("retrieve --keys " + path("k.npy") + " --queries " + path("q.npy") + " --topk 10 --out " + path("a.npy")).rc == 0);
  REQUIRE(cli("retrieve --keys " + path("k.npy") + " --queries " + path("q.npy") + " --topk 10 --group 2 --threads 1 --out " +
              path("b.npy")).rc == 0);
  CHECK(cli_test::slurp(path("a.npy")) == cli_test::slurp(path("b.npy")));
  // explicit beta = rho = 1 and a full exact rerank: the exact top-k of the group's mean query
  REQUIRE(cli("retrieve --keys " + path("k.npy") + " --queries " + path("q.npy") +
              " --topk 5 --beta 1 --rho 1 --rerank-exact 700 --out " + path("e.npy")).rc == 0);
  const npy::Array e = npy::load(path("e.npy"));
  for (std::int64_t hq = 0; hq < HQ; ++hq)
    for (std::int64_t qi = 0; qi < NQ; ++qi) {
      const std::int64_t h = hq / 2, g0 = h * 2;
      std::vector<std::pair<double, std::int64_t>> s;
      for (std::int64_t t = 0; t < N; ++t) {
        double v = 0;
        for (std::int64_t j = 0; j < D; ++j) {
          const float qm = float((double(queries()[std::size_t((g0 * NQ + qi) * D + j)]) +
                                  double(queries()[std::size_t(((g0 + 1) * NQ + qi) * D + j)])) / 2);
          v += double(keys()[std::size_t((h * N + t) * D + j)]) * qm;
        }
        s.emplace_back(-v, t);
      }
      std::sort(s.begin(), s.end());
      std::vector<std::int64_t> top;
      for (int i = 0; i < 5; ++i) top.push_back(s[std::size_t(i)].second);
      std::sort(top.begin(), top.end());
      const std::int64_t* row = e.as<std::int64_t>() + (hq * NQ + qi) * 5;
      CHECK(std::vector<std::int64_t>(row, row + 5) == top);
    }
}

TEST_CASE("cli pariskv: retrieve --sinks --local adds the zones to every row", "[cli][pariskv]") {
  keys();
  queries();
  const std::int64_t S = 4, L = 50, K = 10;
  REQUIRE(cli("retrieve --keys " + path("k.npy") + " --queries " + path("q.npy") +
              " --topk 10 --sinks 4 --local 50 --out " + path("z.npy")).rc == 0);
  const npy::Array out = npy::load(path("z.npy"));
  REQUIRE(out.shape == std::vector<std::int64_t>{HQ, NQ, S + K + L});
  // the middle of each row is the library's retrieval over the keys [S, N - L), shifted by S
  kvscore::ParisKVSearch o;
  o.k = K;
  const auto mid = kvscore::pariskv_retrieve(
      kvscore::KeysView<float>(keys().data() + S * D, H, N - S - L, D, N * D, D), queries().data(), HQ, NQ, HQ / H, o);
  const std::int64_t* got = out.as<std::int64_t>();
  for (std::int64_t r = 0; r < HQ * NQ; ++r) {
    const std::int64_t* row = got + r * (S + K + L);
    for (std::int64_t t = 0; t < S; ++t) CHECK(row[t] == t);
    for (std::int64_t i = 0; i < K; ++i) CHECK(row[S + i] == S + mid[std::size_t(r * K + i)]);
    for (std::int64_t t = 0; t < L; ++t) CHECK(row[S + K + t] == N - L + t);
    for (std::int64_t i = 1; i < S + K + L; ++i) CHECK(row[i - 1] < row[i]);
  }
  const std::string Q = " --queries " + path("q.npy"), O = " --out " + path("bad.npy"), Kf = " --keys " + path("k.npy");
  check_bad("retrieve" + Kf + Q + " --topk 10 --sinks 400 --local 400" + O, "--sinks 400 + --local 400 exceed the 700 tokens");
  check_bad("retrieve" + Kf + Q + " --topk 650 --sinks 4 --local 50" + O, "--topk 650 exceeds the 646 tokens");
  check_bad("retrieve" + Kf + Q + " --topk 10 --local -1" + O, "--local");
  // a NaN in the sink zone is named by its own position
  auto kn = keys();
  kn[std::size_t((1 * N + 2) * D + 7)] = std::numeric_limits<float>::quiet_NaN();
  npy::save<float>(path("kz.npy"), {H, N, D}, kn.data());
  check_bad("retrieve --keys " + path("kz.npy") + Q + " --topk 5 --sinks 4" + O, "head 1, key 2 has a non-finite value nan at element 7");
}

TEST_CASE("cli pariskv: codebook prints thresholds and centres", "[cli][pariskv]") {
  const cli_test::Result r = cli("pariskv-codebook --m 8");
  REQUIRE(r.rc == 0);
  std::istringstream in(r.out);
  std::string l1, l2, l3;
  std::getline(in, l1);
  std::getline(in, l2);
  CHECK(!std::getline(in, l3));
  std::vector<double> t, c;
  {
    std::istringstream a(l1), b(l2);
    for (double x; a >> x;) t.push_back(x);
    for (double x; b >> x;) c.push_back(x);
  }
  REQUIRE(t.size() == 7);
  REQUIRE(c.size() == 8);
  // ../shared/REFERENCE.md converged optimum for m = 8
  const double ct[7] = {0.0853, 0.1716, 0.2603, 0.3528, 0.4516, 0.5612, 0.6921};
  const double cc[8] = {0.0425, 0.1280, 0.2152, 0.3053, 0.4003, 0.5030, 0.6193, 0.7648};
  for (int i = 0; i < 7; ++i) CHECK(std::fabs(t[std::size_t(i)] - ct[i]) <= 0.5e-4 + 1e-6);
  for (int i = 0; i < 8; ++i) CHECK(std::fabs(c[std::size_t(i)] - cc[i]) <= 0.5e-4 + 1e-6);
  // --iterations 100: the public table, to 2e-4
  const cli_test::Result p = cli("pariskv-codebook --m 8 --iterations 100");
  REQUIRE(p.rc == 0);
  std::istringstream pin(p.out);
  double first = 0;
  pin >> first;
  CHECK(std::fabs(first - 0.0843) <= 2e-4);
  // other m: 6-decimal rendering of the library's values
  const cli_test::Result q = cli("pariskv-codebook --m 16");
  REQUIRE(q.rc == 0);
  const auto cb = kvscore::pariskv::lloyd_max(16);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.6f ", cb.thresholds[0]);
  CHECK(q.out.rfind(buf, 0) == 0);
}

TEST_CASE("cli pariskv: bad input is exit 2 with one line", "[cli][pariskv]") {
  keys();
  queries();
  const std::string K = " --keys " + path("k.npy"), Q = " --queries " + path("q.npy"), O = " --out " + path("bad.npy");
  check_bad("retrieve" + Q + " --topk 5" + O, "missing required flag --keys");
  check_bad("retrieve" + K + Q + O, "missing required flag --topk");
  check_bad("retrieve" + K + Q + " --topk 701" + O, "--topk 701 exceeds the 700 tokens");
  check_bad("retrieve" + K + Q + " --topk 0" + O, "--topk must be > 0 (got 0)");
  check_bad("retrieve" + K + Q + " --topk 5 --beta 0" + O, "--beta must be in (0, 1] (got 0)");
  check_bad("retrieve" + K + Q + " --topk 5 --rho 1.5" + O, "--rho must be in (0, 1] (got 1.5)");
  check_bad("retrieve" + K + Q + " --topk 5 --rho abc" + O, "'abc' is not a number");
  check_bad("retrieve" + K + Q + " --topk 5 --rerank-exact 4" + O, "--rerank-exact 4 must be >= --topk 5");
  check_bad("retrieve" + K + Q + " --topk 5 --group 4" + O, "--group 4 does not match q_heads / kv_heads = 4 / 2 = 2");
  check_bad("retrieve" + K + Q + " --topk 5 --bogus 1" + O, "--bogus");
  // shapes and dtypes
  std::vector<float> q3(std::size_t(3 * 2 * D), 0.5f);
  npy::save<float>(path("q3.npy"), {3, 2, D}, q3.data());
  check_bad("retrieve" + K + " --queries " + path("q3.npy") + " --topk 5" + O, "3 query heads");
  std::vector<float> qd(std::size_t(4 * 2 * 16), 0.5f);
  npy::save<float>(path("qd.npy"), {4, 2, 16}, qd.data());
  check_bad("retrieve" + K + " --queries " + path("qd.npy") + " --topk 5" + O, "have head_dim 16");
  std::vector<double> kd(std::size_t(2 * 10 * D), 1.0);
  npy::save<double>(path("kd.npy"), {2, 10, D}, kd.data());
  check_bad("retrieve --keys " + path("kd.npy") + Q + " --topk 5" + O, "keys dtype '<f8' not supported");
  check_bad("retrieve --keys " + path("nope.npy") + Q + " --topk 5" + O, "nope.npy");
  // NaN in a key / a query
  auto kn = keys();
  kn[std::size_t((1 * N + 9) * D + 2)] = std::numeric_limits<float>::quiet_NaN();
  npy::save<float>(path("kn.npy"), {H, N, D}, kn.data());
  check_bad("retrieve --keys " + path("kn.npy") + Q + " --topk 5" + O, "key 9 has a non-finite value nan at element 2");
  auto qn = queries();
  qn[std::size_t((2 * NQ + 1) * D + 3)] = std::numeric_limits<float>::infinity();
  npy::save<float>(path("qn.npy"), {HQ, NQ, D}, qn.data());
  check_bad("retrieve" + K + " --queries " + path("qn.npy") + " --topk 5" + O, "query head 2, query 1 is not finite");
  // a finite query whose fp32 squared norm overflows: exit 2 naming it (it used to pass the
  // serial check and throw inside the OpenMP region: std::terminate)
  auto qo = queries();
  qo[std::size_t((3 * NQ + 0) * D + 5)] = 3e19f;
  npy::save<float>(path("qo.npy"), {HQ, NQ, D}, qo.data());
  check_bad("retrieve" + K + " --queries " + path("qo.npy") + " --topk 5" + O,
            "query head 3, query 0 has a squared norm that overflows fp32");
  // codebook
  check_bad("pariskv-codebook", "missing required flag --m");
  check_bad("pariskv-codebook --m 1", "--m must be in [2, 64] (got 1)");
  check_bad("pariskv-codebook --m 8 --iterations -1", "--iterations must be in");
}
