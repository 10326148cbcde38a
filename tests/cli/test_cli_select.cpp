// Tests of `kvscore select` (run as a process, KVSCORE_CLI_PATH): the outputs equal the
// library's kvscore::select, and every bad input gives exit code 2 and exactly one
// "kvscore: " line on stderr. (main() is in test_cli.cpp.)
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
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

#include <kvscore/io/npy.hpp>
#include <kvscore/select.hpp>

#include "cli_harness.hpp"

namespace fs = std::filesystem;
namespace npy = kvscore::npy;

namespace {

using cli_test::Result;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("select"); return d; }
std::string path(const std::string& name) { return dir().file(name); }
std::string slurp(const std::string& p) { return cli_test::slurp(p); }
Result cli(const std::string& args) { return cli_test::run(dir(), args); }

constexpr std::int64_t H = 3, N = 29;

const kvscore::Scores& scores() {
  static const kvscore::Scores s = [] {
    kvscore::Scores x(H, N);
    std::mt19937 rng(17);
    std::uniform_int_distribution<int> few(0, 6);
    for (std::int64_t i = 0; i < H * N; ++i) x.data()[i] = float(few(rng)) * 0.5f;  // many ties
    x.data()[4] = std::numeric_limits<float>::quiet_NaN();
    x.data()[N + 7] = -std::numeric_limits<float>::infinity();
    npy::save<float>(path("s.npy"), {H, N}, x.data());
    return x;
  }();
  return s;
}

/// Exit 2, empty stdout, one "kvscore: " line containing `needle`, no output written.
void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad.npy", "bad.offsets.npy"});
}

}  // namespace

TEST_CASE("cli select: per-head output equals the library", "[cli][select]") {
  const kvscore::Scores& s = scores();
  struct Case {
    std::string flags;
    std::int64_t keep, sinks, recent;
  };
  for (const Case& c : {Case{"--keep 5", 5, 0, 0}, Case{"--keep 0", 0, 0, 0}, Case{"--keep 29", 29, 0, 0},
                        Case{"--keep=9 --sinks 2 --recent 3", 9, 2, 3}, Case{"--keep 5 --sinks 5", 5, 5, 0},
                        Case{"--keep 12 --alloc per-head --recent 3", 12, 0, 3}}) {
    INFO(c.flags);
    const std::string out = path("i.npy");
    fs::remove(out);
    const Result r = cli("select --scores " + path("s.npy") + " --out " + out + " " + c.flags);
    INFO(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.out.empty());
    CHECK(r.err.empty());
    kvscore::SelectOptions o;
    o.sinks = c.sinks;
    o.recent = c.recent;
    const kvscore::Selection want = kvscore::select(s, kvscore::Budget::per_head(c.keep), o);
    const npy::Array a = npy::load(out);
    CHECK(a.descr == "<i8");
    CHECK(a.shape == std::vector<std::int64_t>{H, c.keep});
    CHECK(a.to_vector<std::int64_t>() == want.positions);
    CHECK(!fs::exists(path("i.offsets.npy")));
  }
}

TEST_CASE("cli select: adakv writes positions and CSR offsets", "[cli][select]") {
  const kvscore::Scores& s = scores();
  struct Case {
    std::string flags;
    std::int64_t keep, sinks, recent;
    double alpha;
    bool normalize;
  };
  for (const Case& c : {Case{"--keep 6", 6, 0, 0, 0.2, false}, Case{"--keep 6 --alpha 0.5", 6, 0, 0, 0.5, false},
                        Case{"--keep 7 --alpha=0 --normalize --sinks 1 --recent 2", 7, 1, 2, 0.0, true},
                        Case{"--keep 29 --alpha 1", 29, 0, 0, 1.0, false}, Case{"--keep 0", 0, 0, 0, 0.2, false},
                        Case{"--keep 4 --alpha 1e-1 --normalize", 4, 0, 0, 0.1, true}}) {
    INFO(c.flags);
    const std::string out = path("ada.npy"), off = path("ada.offsets.npy");
    fs::remove(out);
    fs::remove(off);
    const Result r = cli("select --alloc adakv --scores " + path("s.npy") + " --out " + out + " " + c.flags);
    INFO(r.err);
    REQUIRE(r.rc == 0);
    CHECK(r.err.empty());
    kvscore::SelectOptions o;
    o.alloc = kvscore::Alloc::adakv;
    o.sinks = c.sinks;
    o.recent = c.recent;
    o.alpha = c.alpha;
    o.normalize = c.normalize;
    const kvscore::Selection want = kvscore::select(s, kvscore::Budget::per_head(c.keep), o);
    const npy::Array p = npy::load(out), q = npy::load(off);
    CHECK(p.descr == "<i8");
    CHECK(q.descr == "<i8");
    CHECK(p.shape == std::vector<std::int64_t>{H * c.keep});
    CHECK(q.shape == std::vector<std::int64_t>{H + 1});
    CHECK(p.to_vector<std::int64_t>() == want.positions);
    CHECK(q.to_vector<std::int64_t>() == want.offsets);
  }
  // --out without a .npy suffix: the offsets file name is appended.
  const Result r = cli("select --alloc adakv --keep 3 --scores " + path("s.npy") + " --out " + path("plain"));
  CHECK(r.rc == 0);
  CHECK(fs::exists(path("plain")));
  CHECK(fs::exists(path("plain.offsets.npy")));
}

TEST_CASE("cli select: help lists the flags", "[cli][select]") {
  const Result r = cli("select --help");
  CHECK(r.rc == 0);
  CHECK(r.out.find("usage: kvscore select") != std::string::npos);
  for (const char* f : {"--scores", "--keep", "--sinks", "--recent", "--alloc", "--alpha", "--normalize", "--out"})
    CHECK(r.out.find(f) != std::string::npos);
  CHECK(cli("--help").out.find("select") != std::string::npos);
}

TEST_CASE("cli select: bad input gives exit 2 and one line", "[cli][select]") {
  (void)scores();
  const std::string s = path("s.npy"), out = path("bad.npy");
  const std::string base = "select --scores " + s + " --out " + out;
  {
    const std::vector<double> d(std::size_t(H * N), 1.0);
    npy::save<double>(path("s_f8.npy"), {H, N}, d.data());
    const std::vector<float> f(std::size_t(H * N), 1.f);
    npy::save<float>(path("s_1d.npy"), {H * N}, f.data());
    npy::save<float>(path("s_3d.npy"), {1, H, N}, f.data());
    const std::string whole = slurp(s);
    std::ofstream(path("s_trunc.npy"), std::ios::binary) << whole.substr(0, whole.size() - 4);
  }
  SECTION("command line") {
    check_bad("select", "missing required flag --scores");
    check_bad("select --scores " + s + " --out " + out, "missing required flag --keep");
    check_bad("select --scores " + s + " --keep 3", "missing required flag --out");
    check_bad(base + " --keep 3 --bogus", "unknown flag '--bogus'");
    check_bad(base + " --keep 3 --keep 4", "--keep given more than once");
    check_bad(base + " --keep", "--keep needs a value");
    check_bad(base + " --keep 3 --normalize=1", "--normalize takes no value");
    check_bad(base + " --keep 3 stray", "unexpected argument 'stray'");
  }
  SECTION("numbers") {
    check_bad(base + " --keep -1", "--keep must be >= 0 (got -1)");
    check_bad(base + " --keep x", "--keep: 'x' is not an integer");
    check_bad(base + " --keep 2.5", "'2.5' is not an integer");
    check_bad(base + " --keep 3 --sinks -2", "--sinks must be >= 0 (got -2)");
    check_bad(base + " --keep 3 --recent r", "--recent: 'r' is not an integer");
    check_bad(base + " --keep 3 --alloc adakv --alpha 1.5", "--alpha must be in [0, 1] (got 1.5)");
    check_bad(base + " --keep 3 --alloc adakv --alpha -0.1", "--alpha must be in [0, 1] (got -0.1)");
    check_bad(base + " --keep 3 --alloc adakv --alpha nan", "--alpha: 'nan' is not a number");
    check_bad(base + " --keep 3 --alloc adakv --alpha 0.2x", "--alpha: '0.2x' is not a number");
    check_bad(base + " --keep 3 --alloc adakv --alpha ' 0.2'", "is not a number");
  }
  SECTION("budgets and protection") {
    check_bad(base + " --keep 30", "--keep 30 exceeds the 29 tokens");
    check_bad(base + " --keep 30", "(k > N)");
    check_bad(base + " --keep 30 --alloc adakv", "(k > N)");
    check_bad(base + " --keep 4 --sinks 3 --recent 2", "--sinks 3 and --recent 2 protect 5 tokens per head");
    check_bad(base + " --keep 4 --sinks 3 --recent 2", "more than --keep 4");
    check_bad(base + " --keep 0 --sinks 1", "more than --keep 0");
    check_bad(base + " --keep 5 --recent 40", "protect 29 tokens per head");
    check_bad(base + " --keep 4 --sinks 3 --recent 2 --alloc adakv", "protect 5 tokens per head");
  }
  SECTION("alloc") {
    check_bad(base + " --keep 3 --alloc ada", "unknown alloc 'ada' (expected per-head or adakv)");
    check_bad(base + " --keep 3 --alpha 0.5", "--alpha applies only to --alloc adakv");
    check_bad(base + " --keep 3 --normalize", "--normalize applies only to --alloc adakv");
    check_bad(base + " --keep 3 --alloc per-head --normalize", "--normalize applies only to --alloc adakv");
  }
  SECTION("scores file") {
    check_bad("select --keep 1 --out " + out + " --scores " + path("missing.npy"), "missing.npy: cannot open");
    check_bad("select --keep 1 --out " + out + " --scores " + path("s_f8.npy"), "scores dtype '<f8' not supported");
    check_bad("select --keep 1 --out " + out + " --scores " + path("s_1d.npy"), "got 1 dimensions");
    check_bad("select --keep 1 --out " + out + " --scores " + path("s_3d.npy"), "got 3 dimensions");
    check_bad("select --keep 1 --out " + out + " --scores " + path("s_trunc.npy"), "truncated");
  }
  SECTION("output") {
    check_bad("select --keep 1 --scores " + s + " --out " + path("no/such/dir/i.npy"), "cannot write output");
    check_bad("select --keep 1 --alloc adakv --scores " + s + " --out " + path("no/such/dir/i.npy"), "cannot write output");
  }
}
