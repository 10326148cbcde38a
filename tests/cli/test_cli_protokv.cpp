// Tests of `kvscore score --method protokv` (run as a process, KVSCORE_CLI_PATH): the scores
// equal the library's kvscore::ProtoKV bit for bit for every flag, and every bad input gives
// exit code 2 and exactly one "kvscore: " line on stderr. (main() is in test_cli.cpp.)
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <kvscore/kvscore.hpp>
#include <kvscore/scorers/protokv.hpp>

#include "cli_harness.hpp"

namespace {
namespace protokv_cli {

namespace fs = std::filesystem;
namespace npy = kvscore::npy;
using cli_test::Result;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("protokv"); return d; }
std::string path(const std::string& name) { return dir().file(name); }
Result cli(const std::string& args) { return cli_test::run(dir(), args); }

using cli_test::randn;

constexpr std::int64_t H = 2, T = 120, D = 16, G = 2, W = 8;

using Inputs = cli_test::KeyQueryInputs;

const Inputs& inputs() {
  static const Inputs in = cli_test::write_key_query_inputs(dir(), H, T, D, G, W, 31, 32);
  return in;
}

struct Params {
  std::uint64_t seed = 0;
  std::int64_t kappa = 5, p = 32, chunks = 496;
  int bits = 2;
  double bandwidth = 0;
  int psi = 2;  // 0 sum, 1 mean, 2 attention (the default)
};

template <class E>
kvscore::Scores expected(const std::vector<E>& keys, const Params& prm) {
  kvscore::ProtoKV pk(inputs().q.data(), H * G, W, D, G);
  pk.seed = prm.seed, pk.kappa = prm.kappa, pk.sat_candidates = prm.p, pk.chunks = prm.chunks;
  pk.lsh_bits = prm.bits, pk.bandwidth = prm.bandwidth;
  pk.psi = prm.psi == 1   ? kvscore::ProtoKV::Psi::mean
           : prm.psi == 2 ? kvscore::ProtoKV::Psi::attention
                          : kvscore::ProtoKV::Psi::sum;
  return pk.score(kvscore::KeysView<E>(keys.data(), H, T, D, T * D, D));
}

using cli_test::check_scores;

template <class E>
void check_ok(const std::string& keys_file, const std::vector<E>& keys) {
  const std::string out = path("scores.npy");
  const std::string base = "score --method protokv --keys " + path(keys_file) + " --queries " + path("q.npy") +
                           " --out " + out;
  struct Run {
    const char* extra;
    Params prm;
  };
  const Run runs[] = {
      {"", {}},
      {" --group 2 --window 8 --threads 1", {}},
      {" --seed 17", {17, 5, 32, 496, 2, 0, 2}},
      {" --seed=3 --kappa 2 --sat-candidates 10 --lsh-bits 3 --chunks 12 --threads 3", {3, 2, 10, 12, 3, 0, 2}},
      {" --bandwidth 0.75 --psi mean --chunks 20", {0, 5, 32, 20, 2, 0.75, 1}},
      {" --psi attention --chunks 20", {0, 5, 32, 20, 2, 0, 2}},
      {" --psi sum --sat-candidates 0", {0, 5, 0, 496, 2, 0, 0}},
  };
  for (const Run& run : runs) {
    INFO(keys_file << ":" << run.extra);
    fs::remove(out);
    const Result r = cli(base + run.extra);
    CHECK(r.rc == 0);
    CHECK(r.err.empty());
    CHECK(r.out.empty());
    REQUIRE(fs::exists(out));
    check_scores(out, expected(keys, run.prm));
  }
}

void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad_out.npy"});
}

}  // namespace protokv_cli
}  // namespace

using namespace protokv_cli;

TEST_CASE("cli protokv: scores equal the library's for every flag (float32, float16, bfloat16 keys)",
          "[cli][protokv]") {
  check_ok("k32.npy", inputs().k32);
  check_ok("k16.npy", inputs().k16);
  check_ok("kbf.npy", inputs().kbf);
  const npy::Array a = npy::load(path("scores.npy"));
  CHECK(a.to_vector<float>()[std::size_t(1 * T + 9)] == -std::numeric_limits<float>::infinity());
}

TEST_CASE("cli protokv: the scores select whole clusters (kvscore select --recent w)", "[cli][protokv]") {
  inputs();
  REQUIRE(cli("score --method protokv --keys " + path("k32.npy") + " --queries " + path("q.npy") + " --out " +
              path("s.npy") + " --chunks 10")
              .rc == 0);
  const Result r = cli("select --scores " + path("s.npy") + " --keep 30 --recent 8 --out " + path("kept.npy"));
  CHECK(r.rc == 0);
  CHECK(fs::exists(path("kept.npy")));
}

TEST_CASE("cli protokv: bad input gives exit 2 and one line", "[cli][protokv]") {
  const Inputs& in = inputs();
  const std::string k = path("k32.npy"), q = path("q.npy"), out = path("bad_out.npy");
  const std::string base = "score --method protokv --keys " + k + " --out " + out;
  npy::save<float>(path("q_long.npy"), {H * G, 200, D}, randn(std::size_t(H * G * 200 * D), 6).data());
  npy::save<float>(path("q_heads.npy"), {3, W, D}, randn(std::size_t(3 * W * D), 5).data());
  npy::save<float>(path("q_2d.npy"), {H * G * W, D}, in.q.data());
  std::vector<float> qn = in.q;
  qn[std::size_t((3 * W + 5) * D + 7)] = std::numeric_limits<float>::infinity();
  npy::save<float>(path("q_inf.npy"), {H * G, W, D}, qn.data());
  SECTION("command line") {
    check_bad(base, "missing required flag --queries");
    check_bad(base + " --queries " + q + " --psi median", "--psi must be sum, mean or attention (got 'median')");
    check_bad(base + " --queries " + q + " --seed -1", "--seed must be >= 0 (got -1)");
    check_bad(base + " --queries " + q + " --kappa 0", "--kappa must be > 0 (got 0)");
    check_bad(base + " --queries " + q + " --lsh-bits 17", "--lsh-bits must be in [0, 16] (got 17)");
    check_bad(base + " --queries " + q + " --chunks -1", "--chunks must be >= 0 (got -1)");
    check_bad(base + " --queries " + q + " --bandwidth 0", "--bandwidth must be > 0 (got 0)");
    check_bad(base + " --queries " + q + " --bandwidth nan", "--bandwidth: 'nan' is not a number");
    check_bad(base + " --queries " + q + " --bandwidth 1x", "--bandwidth: '1x' is not a number");
    check_bad(base + " --queries " + q + " --filters " + q, "--filters does not apply to --method protokv");
    check_bad("score --method knorm --keys " + k + " --out " + out + " --seed 3",
              "--seed applies only to --method protokv");
  }
  SECTION("values that do not match") {
    check_bad(base + " --queries " + q + " --sat-candidates 121", "sat_candidates 121 must be in [0, tokens 120]");
    check_bad(base + " --queries " + q + " --chunks 0 --sat-candidates 0", "leave no prototypes");
    check_bad(base + " --queries " + q + " --window 4", "--window 4 does not match the 8 queries per head");
    check_bad(base + " --queries " + q + " --group 4", "--group 4 does not match q_heads / heads = 4 / 2 = 2");
    check_bad(base + " --queries " + path("q_heads.npy"), "q_heads 3 is not a multiple of the 2 heads of keys");
    check_bad(base + " --queries " + path("q_long.npy"), "hold 200 queries per head, more than the 120 tokens");
    check_bad(base + " --queries " + path("q_2d.npy"), "queries must have shape [q_heads, window, head_dim]");
    check_bad(base + " --queries " + path("q_inf.npy"), "query value inf at [head 3, query 5, dim 7] is not finite");
    check_bad(base + " --queries " + path("missing.npy"), "missing.npy: cannot open");
  }
}
