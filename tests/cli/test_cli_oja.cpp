// Tests of `kvscore oja` (run as a process, KVSCORE_CLI_PATH): U.npy equals the library's
// OjaBasis after the same prefill, the printed RER/SO equal values recomputed here, a planted
// subspace is found, and every bad input gives exit code 2 and one "kvscore: " line.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <kvscore/io/npy.hpp>
#include <kvscore/ojakv/ojakv.hpp>

#include "cli_harness.hpp"

namespace {

namespace npy = kvscore::npy;
using Mat = Eigen::MatrixXd;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("oja"); return d; }
std::string path(const std::string& name) { return dir().file(name); }
cli_test::Result cli(const std::string& args) { return cli_test::run(dir(), args); }

constexpr std::int64_t H = 2, N = 600, D = 16, R = 3;

/// Per head: rows from a planted rank-3 subspace (its basis written as ref.npy) + small noise.
struct Data {
  std::vector<float> keys, values, ref;
};

const Data& data() {
  static const Data d = [] {
    Data x;
    kvscore::oja::SplitMix64 g(2024);
    x.keys.resize(std::size_t(H * N * D));
    x.values.resize(x.keys.size());
    x.ref.resize(std::size_t(H * D * R));
    for (std::int64_t h = 0; h < H; ++h) {
      const Mat b = kvscore::oja::random_orthonormal(D, R, 100 + std::uint64_t(h));
      for (std::int64_t i = 0; i < D; ++i)
        for (std::int64_t j = 0; j < R; ++j) x.ref[std::size_t((h * D + i) * R + j)] = float(b(i, j));
      for (std::int64_t t = 0; t < N; ++t) {
        Eigen::VectorXd z(R);
        for (std::int64_t j = 0; j < R; ++j) z(j) = g.gaussian() * double(3 - j);
        const Eigen::VectorXd k = b * z;
        for (std::int64_t i = 0; i < D; ++i) {
          x.keys[std::size_t((h * N + t) * D + i)] = float(k(i) + 0.02 * g.gaussian());
          x.values[std::size_t((h * N + t) * D + i)] = float(g.gaussian());
        }
      }
    }
    npy::save<float>(path("k.npy"), {H, N, D}, x.keys.data());
    npy::save<float>(path("v.npy"), {H, N, D}, x.values.data());
    npy::save<float>(path("ref.npy"), {H, D, R}, x.ref.data());
    return x;
  }();
  return d;
}

double value_of(const std::string& out, const std::string& key) {
  const std::size_t at = out.find(key + "=");
  REQUIRE(at != std::string::npos);
  return std::strtod(out.c_str() + at + key.size() + 1, nullptr);
}

void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad.npy"});
}

}  // namespace

TEST_CASE("cli oja: the basis equals the library's prefill, RER and SO as recomputed", "[cli][ojakv]") {
  const Data& x = data();
  const cli_test::Result r = cli("oja --keys " + path("k.npy") + " --rank 3 --reference " + path("ref.npy") +
                                 " --out-basis " + path("u.npy"));
  INFO(r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.out.find('\n') == r.out.size() - 1);  // one line
  const npy::Array u = npy::load(path("u.npy"));
  REQUIRE(u.descr == "<f4");
  REQUIRE(u.shape == std::vector<std::int64_t>{H, D, R});
  double num = 0, den = 0, so = 0;
  for (std::int64_t h = 0; h < H; ++h) {
    kvscore::OjaBasis b = kvscore::OjaBasis::random(D, R, std::uint64_t(h));  // documented seed = head
    b.prefill(kvscore::KeysView<float>(x.keys.data(), H, N, D, N * D, D), h);
    for (std::int64_t i = 0; i < D; ++i)
      for (std::int64_t j = 0; j < R; ++j) CHECK(u.as<float>()[(h * D + i) * R + j] == float(b.basis()(i, j)));
    Mat kh(N, D), ref(D, R);
    for (std::int64_t t = 0; t < N; ++t)
      for (std::int64_t i = 0; i < D; ++i) kh(t, i) = x.keys[std::size_t((h * N + t) * D + i)];
    for (std::int64_t i = 0; i < D; ++i)
      for (std::int64_t j = 0; j < R; ++j) ref(i, j) = x.ref[std::size_t((h * D + i) * R + j)];
    num += (kh - kh * b.basis() * b.basis().transpose()).squaredNorm();
    den += kh.squaredNorm();
    so += kvscore::subspace_overlap(b.basis(), ref) / H;
  }
  CHECK(value_of(r.out, "rer") == Approx(num / den).epsilon(1e-6));
  CHECK(value_of(r.out, "so") == Approx(so).epsilon(1e-6));
  CHECK(value_of(r.out, "so") > 0.99);  // the planted subspace is found
  CHECK(value_of(r.out, "rer") < 1e-3);
}

TEST_CASE("cli oja: values, calibration and full-rank tokens", "[cli][ojakv]") {
  const Data& x = data();
  // Calibration rows = the first 100 keys of each head: the start is already the subspace.
  std::vector<float> cal(std::size_t(H * 100 * D));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < 100 * D; ++i) cal[std::size_t(h * 100 * D + i)] = x.keys[std::size_t(h * N * D + i)];
  npy::save<float>(path("cal.npy"), {H, 100, D}, cal.data());
  std::vector<float> q(std::size_t(2 * H * 4 * D));
  kvscore::oja::SplitMix64 g(7);
  for (float& v : q) v = float(g.gaussian());
  npy::save<float>(path("q.npy"), {2 * H, 4, D}, q.data());

  const cli_test::Result plain = cli("oja --keys " + path("k.npy") + " --values " + path("v.npy") +
                                     " --rank 3 --calib " + path("cal.npy") + " --out-basis " + path("u2.npy"));
  INFO(plain.err);
  REQUIRE(plain.rc == 0);
  // Random values have no 3-dim structure: their RER is about 1 - 3/16.
  CHECK(value_of(plain.out, "rer_v") == Approx(1 - 3.0 / 16).margin(0.05));
  const cli_test::Result full = cli("oja --keys " + path("k.npy") + " --rank 3 --calib " + path("cal.npy") +
                                    " --queries " + path("q.npy") + " --full-rank 60 --out-basis " + path("u3.npy"));
  INFO(full.err);
  REQUIRE(full.rc == 0);
  // The same basis; 60 of 600 tokens exact, chosen by largest residual: RER drops.
  CHECK(cli_test::slurp(path("u2.npy")) == cli_test::slurp(path("u3.npy")));
  CHECK(value_of(full.out, "rer") < value_of(plain.out, "rer"));
  CHECK(value_of(full.out, "rer") > 0);
  // --prefill paper: one step at eta 0.10 from the calibrated start, as the library does it
  const cli_test::Result paper = cli("oja --keys " + path("k.npy") + " --rank 3 --calib " + path("cal.npy") +
                                     " --prefill paper --out-basis " + path("u4.npy"));
  INFO(paper.err);
  REQUIRE(paper.rc == 0);
  const npy::Array u4 = npy::load(path("u4.npy"));
  for (std::int64_t h = 0; h < H; ++h) {
    kvscore::OjaBasis b = kvscore::OjaBasis::calibrate({{cal.data() + h * 100 * D, 100}}, D,
                                                       kvscore::oja::RankRule::fixed(3), kvscore::OjaOptions::paper());
    b.prefill(kvscore::KeysView<float>(x.keys.data(), H, N, D, N * D, D), h);
    for (std::int64_t j = 0; j < D; ++j)
      for (std::int64_t c = 0; c < 3; ++c)
        CHECK(u4.as<float>()[(h * D + j) * 3 + c] == float(b.basis()(j, c)));
  }
}

TEST_CASE("cli oja: bad input gives exit 2 and one line", "[cli][ojakv]") {
  data();
  const std::string k = " --keys " + path("k.npy"), out = " --out-basis " + path("bad.npy");
  check_bad("oja" + k + out, "missing required flag --rank");
  check_bad("oja --rank 2" + out, "missing required flag --keys");
  check_bad("oja" + k + " --rank 2", "missing required flag --out-basis");
  check_bad("oja" + k + " --rank 0" + out, "--rank must be > 0 (got 0)");
  check_bad("oja" + k + " --rank 17" + out, "--rank 17 exceeds head_dim 16");
  check_bad("oja" + k + " --rank 2 --prefill paper" + out, "--prefill paper needs --calib");
  check_bad("oja" + k + " --rank 2 --prefill fast" + out, "--prefill must be converged or paper (got 'fast')");
  check_bad("oja" + k + " --rank x" + out, "--rank");
  check_bad("oja" + k + " --rank 2 --full-rank 3" + out, "--full-rank needs --queries");
  check_bad("oja" + k + " --rank 2 --queries " + path("k.npy") + out, "--queries applies only with --full-rank");
  check_bad("oja --keys " + path("missing.npy") + " --rank 2" + out, "missing.npy");
  check_bad("oja" + k + " --rank 2 --reference " + path("k.npy") + out, "is not [2, 16, 2]");
  check_bad("oja" + k + " --rank 2 --values " + path("ref.npy") + out, "values must have the keys' dtype");
  check_bad("oja" + k + " --rank 2 --full-rank 601 --queries " + path("k.npy") + out, "--full-rank 601 exceeds the 600");
  check_bad("oja" + k + " --rank 2 --bogus 1" + out, "unknown flag '--bogus'");
  // Keys of the wrong rank or dtype, NaN calibration rows.
  const std::vector<double> d8(8, 1.0);
  npy::save<double>(path("f8.npy"), {1, 2, 4}, d8.data());
  check_bad("oja --keys " + path("f8.npy") + " --rank 2" + out, "'<f8' not supported");
  const std::vector<float> two(8, 1.f);
  npy::save<float>(path("two.npy"), {2, 4}, two.data());
  check_bad("oja --keys " + path("two.npy") + " --rank 2" + out, "must have shape [heads, tokens, head_dim]");
  std::vector<float> cal(std::size_t(H * 5 * 16), 1.f);
  cal[3] = std::numeric_limits<float>::quiet_NaN();
  npy::save<float>(path("calnan.npy"), {H, 5, 16}, cal.data());
  check_bad("oja" + k + " --rank 2 --calib " + path("calnan.npy") + out, "is not finite");
  const std::vector<float> zeros(std::size_t(1 * 4 * 16), 0.f);
  npy::save<float>(path("zeros.npy"), {1, 4, 16}, zeros.data());
  check_bad("oja --keys " + path("zeros.npy") + " --rank 2" + out, "zero energy");
}
