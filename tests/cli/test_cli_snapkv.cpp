// Tests of `kvscore score --method snapkv` (run as a process, KVSCORE_CLI_PATH): the scores
// equal the library's kvscore::SnapKV bit for bit, and every bad input gives exit code 2
// and exactly one "kvscore: " line on stderr. (main() is in test_cli.cpp.)
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <kvscore/kvscore.hpp>

#include "cli_harness.hpp"

namespace fs = std::filesystem;
namespace npy = kvscore::npy;

namespace {
namespace snapkv_cli {

using cli_test::Result;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("snapkv"); return d; }
std::string path(const std::string& name) { return dir().file(name); }
std::string slurp(const std::string& p) { return cli_test::slurp(p); }
Result cli(const std::string& args) { return cli_test::run(dir(), args); }

using cli_test::randn;

constexpr std::int64_t H = 2, T = 40, D = 16, G = 2, W = 8;

using Inputs = cli_test::KeyQueryInputs;

const Inputs& inputs() {
  static const Inputs in = cli_test::write_key_query_inputs(dir(), H, T, D, G, W, 11, 12);
  return in;
}

template <class E>
kvscore::Scores expected(const std::vector<E>& keys, const kvscore::simd::KernelTable* isa = nullptr) {
  kvscore::SnapKV s(inputs().q.data(), H * G, W, D, G);
  s.isa = isa;
  return s.score(kvscore::KeysView<E>(keys.data(), H, T, D, T * D, D));
}

using cli_test::check_scores;

template <class E>
void check_ok(const std::string& keys_file, const std::vector<E>& keys) {
  const std::string out = path("scores.npy");
  const std::string base = "score --method snapkv --keys " + path(keys_file) + " --queries " + path("q.npy") +
                           " --out " + out;
  for (const char* extra : {"", " --group 2", " --window 8", " --group=2 --window=8 --threads 1", " --threads 3"}) {
    INFO(keys_file << ":" << extra);
    fs::remove(out);
    const Result r = cli(base + extra);
    CHECK(r.rc == 0);
    CHECK(r.err.empty());
    CHECK(r.out.empty());
    REQUIRE(fs::exists(out));
    check_scores(out, expected(keys));
  }
}

void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad_out.npy"});
}

}  // namespace snapkv_cli
}  // namespace

using namespace snapkv_cli;

TEST_CASE("cli snapkv: scores equal the library's (float32, float16, bfloat16 keys)", "[cli][snapkv]") {
  check_ok("k32.npy", inputs().k32);
  check_ok("k16.npy", inputs().k16);
  check_ok("kbf.npy", inputs().kbf);
  // The invalid row scores -inf through the CLI too.
  const npy::Array a = npy::load(path("scores.npy"));
  CHECK(a.to_vector<float>()[std::size_t(1 * T + 9)] == -std::numeric_limits<float>::infinity());
}

TEST_CASE("cli snapkv: --isa scalar matches the scalar table", "[cli][snapkv]") {
  const Inputs& in = inputs();
  const Result r = cli("score --isa scalar --method snapkv --keys " + path("k16.npy") + " --queries " + path("q.npy") +
                       " --out " + path("s_scalar.npy"));
  REQUIRE(r.rc == 0);
  check_scores(path("s_scalar.npy"), expected(in.k16, &kvscore::simd::scalar_table()));
}

TEST_CASE("cli snapkv: window = tokens is accepted", "[cli][snapkv]") {
  const std::vector<float> k = randn(std::size_t(1 * 5 * 4), 21), q = randn(std::size_t(2 * 5 * 4), 22);
  npy::save<float>(path("k5.npy"), {1, 5, 4}, k.data());
  npy::save<float>(path("q5.npy"), {2, 5, 4}, q.data());
  const Result r = cli("score --method snapkv --keys " + path("k5.npy") + " --queries " + path("q5.npy") + " --out " +
                       path("s5.npy"));
  REQUIRE(r.rc == 0);
  kvscore::SnapKV s(q.data(), 2, 5, 4);
  check_scores(path("s5.npy"), s.score(kvscore::KeysView<float>(k.data(), 1, 5, 4, 20, 4)));
}

TEST_CASE("cli snapkv: --query-placement after-cache scores as the library's after_cache mode, w > tokens "
          "accepted",
          "[cli][snapkv][placement]") {
  const std::vector<float> k = randn(std::size_t(1 * 5 * 4), 31), q = randn(std::size_t(2 * 7 * 4), 32);
  npy::save<float>(path("ka.npy"), {1, 5, 4}, k.data());
  npy::save<float>(path("qa.npy"), {2, 7, 4}, q.data());
  const std::string base = "score --method snapkv --keys " + path("ka.npy") + " --queries " + path("qa.npy");
  const Result r = cli(base + " --query-placement after-cache --out " + path("sa.npy"));
  REQUIRE(r.rc == 0);
  kvscore::SnapKV s(q.data(), 2, 7, 4);
  s.placement = kvscore::QueryPlacement::after_cache;
  check_scores(path("sa.npy"), s.score(kvscore::KeysView<float>(k.data(), 1, 5, 4, 20, 4)));
  check_bad(base + " --out " + path("bad_out.npy"), "more than the 5 tokens");  // in-cache (the default)
  check_bad(base + " --query-placement inside --out " + path("bad_out.npy"), "'inside'");
  check_bad("score --method knorm --keys " + path("ka.npy") + " --query-placement after-cache --out " +
                path("bad_out.npy"),
            "--query-placement applies only to --method snapkv, protokv or kvzip");
}

TEST_CASE("cli kvzip: scores equal the library's KVzip (max and mean, in and after the cache)", "[cli][kvzip]") {
  const Inputs& in = inputs();
  const std::string out = path("zip.npy");
  const std::string base = "score --method kvzip --keys " + path("k16.npy") + " --queries " + path("q.npy") + " --out " + out;
  for (const char* agg : {"", "max", "mean"})
    for (const char* pl : {"in-cache", "after-cache"}) {
      INFO(agg << " " << pl);
      fs::remove(out);
      const Result r = cli(base + (*agg ? std::string(" --query-aggregate ") + agg : std::string()) +
                           " --query-placement " + pl);
      REQUIRE(r.rc == 0);
      kvscore::KVzip z(in.q.data(), H * G, W, D);
      z.aggregate = std::string(agg) == "mean" ? kvscore::QueryAggregate::mean : kvscore::QueryAggregate::max;
      z.placement = std::string(pl) == "in-cache" ? kvscore::QueryPlacement::in_cache : kvscore::QueryPlacement::after_cache;
      check_scores(out, z.score(kvscore::KeysView<kvscore::half>(in.k16.data(), H, T, D, T * D, D)));
    }
  check_bad(base + " --query-aggregate median", "--query-aggregate: 'median' (expected max or mean)");
  check_bad("score --method snapkv --keys " + path("k16.npy") + " --queries " + path("q.npy") + " --out " +
                path("bad_out.npy") + " --query-aggregate max",
            "--query-aggregate applies only to --method kvzip");
}

TEST_CASE("cli snapkv: help lists the method and its flags", "[cli][snapkv]") {
  const Result r = cli("score --help");
  CHECK(r.rc == 0);
  CHECK(r.out.find("snapkv") != std::string::npos);
  CHECK(r.out.find("--queries Q.npy") != std::string::npos);
  CHECK(r.out.find("--group G") != std::string::npos);
}

TEST_CASE("cli snapkv: bad input gives exit 2 and one line", "[cli][snapkv]") {
  const Inputs& in = inputs();
  const std::string k = path("k32.npy"), q = path("q.npy"), out = path("bad_out.npy");
  const std::string base = "score --method snapkv --keys " + k + " --out " + out;
  {
    npy::save<float>(path("q_2d.npy"), {H * G * W, D}, in.q.data());
    std::vector<double> q64(in.q.begin(), in.q.end());
    npy::save<double>(path("q_f8.npy"), {H * G, W, D}, q64.data());
    std::vector<float> qn = in.q;
    qn[std::size_t((3 * W + 5) * D + 7)] = std::numeric_limits<float>::infinity();
    npy::save<float>(path("q_inf.npy"), {H * G, W, D}, qn.data());
    npy::save<float>(path("q_dim.npy"), {H * G, 2 * W, D / 2}, in.q.data());  // head_dim 8 != 16
    npy::save<float>(path("q_heads.npy"), {3, W, D}, randn(std::size_t(3 * W * D), 5).data());
    npy::save<float>(path("q_long.npy"), {H * G, 64, D}, randn(std::size_t(H * G * 64 * D), 6).data());
    npy::save<float>(path("q_empty.npy"), {H * G, 0, D}, in.q.data());
    const std::string whole = slurp(q);
    std::ofstream(path("q_trunc.npy"), std::ios::binary) << whole.substr(0, whole.size() - 4);
  }
  SECTION("command line") {
    check_bad(base, "missing required flag --queries");
    check_bad("score --method knorm --keys " + k + " --out " + out + " --queries " + q,
              "--queries applies only to --method snapkv");
    check_bad("score --method l2 --keys " + k + " --out " + out + " --group 2", "--group applies only to --method snapkv");
    check_bad("score --method knorm --keys " + k + " --out " + out + " --window 8",
              "--window applies only to --method windowed-l2, snapkv, protokv or kvzip");
    check_bad(base + " --queries " + q + " --group 0", "--group must be > 0 (got 0)");
    check_bad(base + " --queries " + q + " --group two", "--group: 'two' is not an integer");
    check_bad(base + " --queries " + q + " --window 0", "--window must be > 0 (got 0)");
    check_bad(base + " --queries " + q + " --queries " + q, "--queries given more than once");
    check_bad(base + " --queries " + q + " --filters " + q, "--filters applies only to --method qfilter");
  }
  SECTION("values that do not match") {
    check_bad(base + " --queries " + q + " --window 4", "--window 4 does not match the 8 queries per head of " + q);
    check_bad(base + " --queries " + q + " --group 4", "--group 4 does not match q_heads / heads = 4 / 2 = 2");
    check_bad(base + " --queries " + path("q_dim.npy"), "have head_dim 8 but keys " + k + " have head_dim 16");
    check_bad(base + " --queries " + path("q_heads.npy"), "q_heads 3 is not a multiple of the 2 heads of keys");
    check_bad(base + " --queries " + path("q_long.npy"), "hold 64 queries per head, more than the 40 tokens");
  }
  SECTION("queries file") {
    check_bad(base + " --queries " + path("missing.npy"), "missing.npy: cannot open");
    check_bad(base + " --queries " + path("q_trunc.npy"), "q_trunc.npy: truncated");
    check_bad(base + " --queries " + path("q_2d.npy"), "q_2d.npy: queries must have shape [q_heads, window, head_dim], got 2 dimensions");
    check_bad(base + " --queries " + path("q_f8.npy"), "q_f8.npy: queries dtype '<f8' not supported");
    check_bad(base + " --queries " + path("q_inf.npy"), "q_inf.npy: kvscore::SnapKV: query value inf at [head 3, query 5, dim 7] is not finite");
    check_bad(base + " --queries " + path("q_empty.npy"), "q_empty.npy: queries [4, 0, 16] need");
  }
  SECTION("keys file") {
    check_bad("score --method snapkv --queries " + q + " --out " + out + " --keys " + path("nokeys.npy"),
              "nokeys.npy: cannot open");
  }
}
