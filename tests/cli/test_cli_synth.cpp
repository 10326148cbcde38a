// Tests of `kvscore synth` (run as a process, KVSCORE_CLI_PATH): its files equal the
// library's kvscore::synth::generate bit for bit, repeat runs give the same bytes, and bad
// input gives exit code 2 and one "kvscore: " line. (main() is in test_cli.cpp.)
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include <kvscore/core/dtype.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/synth.hpp>

#include "cli_harness.hpp"

namespace {

namespace npy = kvscore::npy;
namespace synth = kvscore::synth;

const cli_test::ScratchDir& synth_dir() { static const cli_test::ScratchDir d("synth"); return d; }
cli_test::Result synth_cli(const std::string& args) { return cli_test::run(synth_dir(), args); }

}  // namespace

TEST_CASE("cli synth: files equal the library's data, same bytes on every run", "[cli][synth]") {
  const std::string out = synth_dir().file("drift");
  const std::string args = "synth --kind drift --out " + out + " --kv-heads 2 --group 3 --tokens 300 --head-dim 32 "
                           "--queries 5 --segment 100 --seed 9";
  cli_test::Result r = synth_cli(args);
  INFO(r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.err.empty());
  CHECK(r.out.find("drift") != std::string::npos);
  synth::Spec s{.kind = synth::Kind::drift, .kv_heads = 2, .group = 3, .tokens = 300, .head_dim = 32, .queries = 5,
                .segment = 100, .seed = 9};
  const synth::Data D = synth::generate(s);
  const npy::Array K = npy::load(out + "/K.npy"), V = npy::load(out + "/V.npy"), Q = npy::load(out + "/Q.npy");
  CHECK(K.descr == "<f4");
  CHECK(K.shape == std::vector<std::int64_t>{2, 300, 32});
  CHECK(V.shape == std::vector<std::int64_t>{2, 300, 32});
  CHECK(Q.shape == std::vector<std::int64_t>{6, 5, 32});
  CHECK(std::memcmp(K.as<float>(), D.keys.data(), D.keys.size() * 4) == 0);
  CHECK(std::memcmp(V.as<float>(), D.values.data(), D.values.size() * 4) == 0);
  CHECK(std::memcmp(Q.as<float>(), D.queries.data(), D.queries.size() * 4) == 0);
  const std::string json = cli_test::slurp(out + "/planted.json");
  CHECK(json.find("\"kind\": \"drift\"") != std::string::npos);
  std::string local = "\"local\": [[";
  for (std::size_t i = 0; i < D.planted_at("local", 0, 0).size(); ++i)
    local += (i ? ", " : "") + std::to_string(D.planted_at("local", 0, 0)[i]);
  CHECK(json.find(local + "]") != std::string::npos);

  const std::string k1 = cli_test::slurp(out + "/K.npy");
  REQUIRE(synth_cli(args).rc == 0);
  CHECK(cli_test::slurp(out + "/K.npy") == k1);
  cli_test::check_no_temporaries(synth_dir());
}

TEST_CASE("cli synth: multi-layer shapes and float16 output", "[cli][synth]") {
  const std::string out = synth_dir().file("ml");
  REQUIRE(synth_cli("synth --kind sinks --out " + out + " --layers 2 --kv-heads 1 --tokens 64 --head-dim 16 "
                    "--queries 2 --segment 32 --dtype f16").rc == 0);
  const npy::Array K = npy::load(out + "/K.npy"), Q = npy::load(out + "/Q.npy");
  CHECK(K.descr == "<f2");
  CHECK(K.shape == std::vector<std::int64_t>{2, 1, 64, 16});
  CHECK(Q.shape == std::vector<std::int64_t>{2, 2, 2, 16});
  synth::Spec s{.kind = synth::Kind::sinks, .layers = 2, .kv_heads = 1, .tokens = 64, .head_dim = 16, .queries = 2,
                .segment = 32};
  const synth::Data D = synth::generate(s);
  bool same = true;
  for (std::size_t i = 0; i < D.keys.size(); ++i)
    same = same && K.as<kvscore::half>()[i].bits == kvscore::from_float<kvscore::half>(D.keys[i]).bits;
  CHECK(same);
}

TEST_CASE("cli synth: bad input", "[cli][synth]") {
  const std::string out = synth_dir().file("bad");
  cli_test::check_error(synth_cli("synth --kind needles --out " + out), "unknown kind 'needles'");
  cli_test::check_error(synth_cli("synth --kind mixed"), "--out");
  cli_test::check_error(synth_cli("synth --out " + out), "--kind");
  cli_test::check_error(synth_cli("synth --kind mixed --out " + out + " --tokens 10"), "--tokens");
  cli_test::check_error(synth_cli("synth --kind mixed --out " + out + " --head-dim 8"), "--head-dim");
  cli_test::check_error(synth_cli("synth --kind mixed --out " + out + " --dtype f8"), "'f8'");
  cli_test::check_error(synth_cli("synth --kind mixed --out " + out + " --tokens 100 --segment 200"),
                        "--segment 200 exceeds --tokens 100");
  cli_test::check_error(synth_cli("synth --kind mixed --out /proc/kvscore_no/such --tokens 64 --segment 64"),
                        "/proc/kvscore_no/such");
  CHECK(!std::filesystem::exists(out + "/K.npy"));
}
