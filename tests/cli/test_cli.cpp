// Tests of the `kvscore` command-line tool: it is run as a process (KVSCORE_CLI_PATH)
// on .npy files written here; its scores must equal the library's bit for bit, and
// every bad input must give exit code 2 and exactly one "kvscore: " line on stderr.
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

using cli_test::Result;

const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("score"); return d; }
const std::filesystem::path& tmp() { return dir().path; }
std::string path(const std::string& name) { return dir().file(name); }
std::string slurp(const std::string& p) { return cli_test::slurp(p); }
cli_test::Result cli(const std::string& args) { return cli_test::run(dir(), args); }

using cli_test::randn;

constexpr std::int64_t H = 3, T = 37, D = 16, LAYERS = 2;

struct Inputs {
  std::vector<float> k32;
  std::vector<kvscore::half> k16;
  std::vector<kvscore::bfloat16> kbf;
  std::vector<float> filters;  // [LAYERS][H][D]
};

const Inputs& inputs() {
  static const Inputs in = [] {
    Inputs x;
    x.k32 = randn(std::size_t(H * T * D), 1);
    for (std::size_t i = 0; i < x.k32.size(); ++i) x.k32[i] += 0.5f * float(i % 7);  // off-centre
    x.k16.resize(x.k32.size());
    x.kbf.resize(x.k32.size());
    kvscore::convert(x.k32.data(), x.k16.data(), x.k32.size());
    kvscore::convert(x.k32.data(), x.kbf.data(), x.k32.size());
    x.filters = randn(std::size_t(LAYERS * H * D), 2);
    npy::save<float>(path("k32.npy"), {H, T, D}, x.k32.data());
    npy::save<kvscore::half>(path("k16.npy"), {H, T, D}, x.k16.data());
    npy::save<kvscore::bfloat16>(path("kbf.npy"), {H, T, D}, x.kbf.data());
    npy::save<float>(path("filters.npy"), {LAYERS, H, D}, x.filters.data());
    return x;
  }();
  return in;
}

template <class E, class Scorer>
kvscore::Scores expected(const Scorer& s, const std::vector<E>& keys) {
  return s.score(kvscore::KeysView<E>(keys.data(), H, T, D, T * D, D));
}

using cli_test::check_scores;

template <class E>
void check_all_methods(const std::string& keys_file, const std::vector<E>& keys) {
  const std::string out = path("scores.npy");
  const std::string base = "score --keys " + path(keys_file) + " --out " + out;
  struct Case {
    std::string flags;
    kvscore::Scores want;
  };
  const std::vector<float>& f = inputs().filters;
  const std::vector<Case> cases = {
      {"--method knorm", expected(kvscore::KNorm{}, keys)},
      {"--method keydiff", expected(kvscore::KeyDiff{}, keys)},
      {"--method l2", expected(kvscore::ManifoldL2{}, keys)},
      {"--method windowed-l2", expected(kvscore::WindowedManifoldL2{}, keys)},
      // the registry's other spellings (kvscore/methods.hpp) name the same scorers
      {"--method manifold_l2", expected(kvscore::ManifoldL2{}, keys)},
      {"--method manifoldkv", expected(kvscore::ManifoldL2{}, keys)},
      {"--method windowed_manifold_l2 --window 10", expected(kvscore::WindowedManifoldL2{10}, keys)},
      {"--method windowed-l2 --window 10", expected(kvscore::WindowedManifoldL2{10}, keys)},
      {"--method=windowed-l2 --window=16 --threads 1", expected(kvscore::WindowedManifoldL2{16}, keys)},
      {"--method windowed-l2 --window 10 --window-tail merge",
       expected(kvscore::WindowedManifoldL2(10, kvscore::WindowTail::merge), keys)},
      {"--method windowed-l2 --window 10 --window-tail own", expected(kvscore::WindowedManifoldL2(10), keys)},
      {"--method qfilter --filters " + path("filters.npy"),
       expected(kvscore::QFilter(std::vector<float>(f.begin(), f.begin() + H * D), H, D), keys)},
      {"--method qfilter --layer 1 --filters " + path("filters.npy"),
       expected(kvscore::QFilter(std::vector<float>(f.begin() + H * D, f.end()), H, D), keys)},
  };
  for (const Case& c : cases) {
    INFO(keys_file << ": " << c.flags);
    fs::remove(out);
    const Result r = cli(base + " " + c.flags);
    CHECK(r.rc == 0);
    CHECK(r.err.empty());
    CHECK(r.out.empty());
    REQUIRE(fs::exists(out));
    check_scores(out, c.want);
  }
}

/// Exit 2, nothing on stdout, exactly one line on stderr starting "kvscore: " and
/// containing `needle`; no output file left behind.
void check_bad(const std::string& args, const std::string& needle) {
  cli_test::check_bad_run(dir(), args, needle, {"bad_out.npy"});
}

}  // namespace

TEST_CASE("cli: scores equal the library's (float32 keys)", "[cli]") {
  check_all_methods("k32.npy", inputs().k32);
}

TEST_CASE("cli: scores equal the library's (float16 keys)", "[cli]") {
  check_all_methods("k16.npy", inputs().k16);
}

TEST_CASE("cli: scores equal the library's (bfloat16 keys as <u2)", "[cli]") {
  check_all_methods("kbf.npy", inputs().kbf);
}

TEST_CASE("cli: --isa scalar matches the scalar table", "[cli]") {
  const Inputs& in = inputs();
  kvscore::ManifoldL2 s;
  s.isa = &kvscore::simd::scalar_table();
  const Result r = cli("score --isa scalar --method l2 --keys " + path("k32.npy") + " --out " + path("s_scalar.npy"));
  REQUIRE(r.rc == 0);
  check_scores(path("s_scalar.npy"), expected(s, in.k32));
}

TEST_CASE("cli: empty and degenerate shapes", "[cli]") {
  const std::vector<float> none;
  npy::save<float>(path("k_empty.npy"), {2, 0, 8}, none.data());
  Result r = cli("score --method l2 --keys " + path("k_empty.npy") + " --out " + path("s_empty.npy"));
  REQUIRE(r.rc == 0);
  npy::Array a = npy::load(path("s_empty.npy"));
  CHECK(a.descr == "<f4");
  CHECK(a.shape == std::vector<std::int64_t>{2, 0});

  const std::vector<float> one = {3.f, 4.f};
  npy::save<float>(path("k_one.npy"), {1, 1, 2}, one.data());
  r = cli("score --method knorm --keys " + path("k_one.npy") + " --out " + path("s_one.npy"));
  REQUIRE(r.rc == 0);
  CHECK(npy::load(path("s_one.npy")).to_vector<float>() == std::vector<float>{-5.f});
}

TEST_CASE("cli: help and version", "[cli]") {
  for (const char* args : {"--help", "-h", "help"}) {
    INFO(args);
    const Result r = cli(args);
    CHECK(r.rc == 0);
    CHECK(r.out.find("usage: kvscore") != std::string::npos);
    CHECK(r.out.find("score") != std::string::npos);
    CHECK(r.err.empty());
  }
  for (const char* args : {"score --help", "score -h", "score --method nonsense --help"}) {
    INFO(args);
    const Result r = cli(args);
    CHECK(r.rc == 0);
    CHECK(r.out.find("usage: kvscore score") != std::string::npos);
    CHECK(r.out.find("--window") != std::string::npos);
    CHECK(r.err.empty());
  }
  const Result v = cli("version");
  CHECK(v.rc == 0);
  CHECK(v.err.empty());
  CHECK(v.out.find(std::string("kvscore ") + kvscore::version_string + "\n") == 0);
  CHECK(v.out.find(std::string("isa: ") + kvscore::simd::active_table().name + "\n") != std::string::npos);
  CHECK(cli("--version").out == v.out);
  CHECK(cli("version --help").rc == 0);
}

TEST_CASE("cli: bad input gives exit 2 and one line", "[cli]") {
  (void)inputs();
  const std::string k = path("k32.npy"), f = path("filters.npy"), out = path("bad_out.npy");
  const std::string base = "score --keys " + k + " --out " + out;

  // Extra inputs with something wrong.
  {
    const std::vector<double> d(std::size_t(H * T * D), 1.0);
    npy::save<double>(path("k_f8.npy"), {H, T, D}, d.data());
    const std::vector<std::int64_t> i(std::size_t(H * T * D), 1);
    npy::save<std::int64_t>(path("k_i8.npy"), {H, T, D}, i.data());
    const std::vector<float> flat(std::size_t(H * T * D), 1.f);
    npy::save<float>(path("k_2d.npy"), {H * T, D}, flat.data());
    npy::save<float>(path("k_4d.npy"), {1, H, T, D}, flat.data());
    npy::save<float>(path("k_dim0.npy"), {H, T, 0}, flat.data());
    npy::save<float>(path("k_dim_big.npy"), {1, 1, 5000}, randn(5000, 3).data());
    npy::save(path("k_be.npy"), "<f4", {H, T, D}, flat.data(), flat.size() * 4);
    std::string be = slurp(path("k_be.npy"));
    be.replace(be.find("'<f4'"), 5, "'>f4'");
    std::ofstream(path("k_be.npy"), std::ios::binary) << be;
    const std::string whole = slurp(k);
    std::ofstream(path("k_trunc.npy"), std::ios::binary) << whole.substr(0, whole.size() - 3);
    std::ofstream(path("k_trunc_header.npy"), std::ios::binary) << whole.substr(0, 40);
    std::ofstream(path("k_extra.npy"), std::ios::binary) << whole << "xyz";
    std::ofstream(path("k_text.npy"), std::ios::binary) << "this is not an npy file\n";
    std::ofstream(path("k_emptyfile.npy"), std::ios::binary);
    const std::string fw = slurp(f);
    std::ofstream(path("f_trunc.npy"), std::ios::binary) << fw.substr(0, fw.size() - 1);
    const std::vector<float>& fl = inputs().filters;
    npy::save<float>(path("f_2d.npy"), {LAYERS * H, D}, fl.data());
    npy::save<float>(path("f_dim.npy"), {LAYERS, H * 2, D / 2}, fl.data());     // head_dim 8 != 16
    npy::save<float>(path("f_heads.npy"), {LAYERS * 3, 1, D}, fl.data());       // kv_heads 1 != 3
    std::vector<kvscore::half> fh(fl.size());
    kvscore::convert(fl.data(), fh.data(), fl.size());
    npy::save<kvscore::half>(path("f_f16.npy"), {LAYERS, H, D}, fh.data());
    std::vector<float> fnan = fl;
    fnan[5] = std::numeric_limits<float>::quiet_NaN();
    npy::save<float>(path("f_nan.npy"), {LAYERS, H, D}, fnan.data());
  }

  SECTION("command line") {
    check_bad("", "missing command");
    check_bad("frobnicate", "unknown command 'frobnicate'");
    check_bad("--frob", "unknown command '--frob'");
    check_bad("score", "missing required flag --method");
    check_bad("score --keys " + k + " --out " + out, "missing required flag --method");
    check_bad("score --method l2 --out " + out, "missing required flag --keys");
    check_bad("score --method l2 --keys " + k, "missing required flag --out");
    check_bad(base + " --method l2 --bogus 1", "unknown flag '--bogus'");
    check_bad(base + " --method l2 -x", "unexpected argument '-x'");
    check_bad(base + " --method l2 stray", "unexpected argument 'stray'");
    check_bad(base + " --method", "--method needs a value");
    check_bad("score --method --keys " + k + " --out " + out, "--method needs a value");
    check_bad(base + " --method l2 --method knorm", "--method given more than once");
    check_bad(base + " --method=", "--method has an empty value");
    check_bad(base + " --method nope", "unknown method 'nope'");
    check_bad(base + " --method L2", "unknown method 'L2'");
    check_bad(base + " --method ojakv", "method 'ojakv' is not a scorer");
    check_bad(base + " --method streaming_llm", "is not a scorer (expected knorm, keydiff, l2");
    check_bad("version --verbose", "unknown flag '--verbose'");
  }
  SECTION("numbers") {
    check_bad(base + " --method windowed-l2 --window 0", "--window must be > 0 (got 0)");
    check_bad(base + " --method windowed-l2 --window-tail last", "--window-tail 'last' (expected own or merge)");
    check_bad(base + " --method l2 --window-tail merge", "--window-tail applies only to --method windowed-l2");
    check_bad(base + " --method windowed-l2 --window -5", "--window must be > 0 (got -5)");
    check_bad(base + " --method windowed-l2 --window abc", "'abc' is not an integer");
    check_bad(base + " --method windowed-l2 --window 1.5", "'1.5' is not an integer");
    check_bad(base + " --method windowed-l2 --window 12x", "'12x' is not an integer");
    check_bad(base + " --method windowed-l2 --window ' 12'", "' 12' is not an integer");
    check_bad(base + " --method windowed-l2 --window 99999999999999999999", "out of range");
    check_bad(base + " --method qfilter --filters " + f + " --layer x", "--layer: 'x' is not an integer");
    check_bad(base + " --method qfilter --filters " + f + " --layer -1", "--layer must be >= 0 (got -1)");
    check_bad(base + " --method qfilter --filters " + f + " --layer 2", "layer 2 out of range [0, 2)");
    check_bad(base + " --method l2 --threads many", "'many' is not an integer");
    check_bad(base + " --method l2 --isa avx9000", "unknown or unsupported ISA 'avx9000'");
  }
  SECTION("flags that the method does not use") {
    check_bad(base + " --method knorm --window 8", "--window applies only to --method windowed-l2");
    check_bad(base + " --method l2 --filters " + f, "--filters applies only to --method qfilter");
    check_bad(base + " --method keydiff --layer 1", "--layer applies only to --method qfilter");
  }
  SECTION("keys file") {
    check_bad("score --method l2 --out " + out + " --keys " + path("missing.npy"), "missing.npy: cannot open");
    check_bad("score --method l2 --out " + out + " --keys " + tmp().string(), "");  // a directory
    check_bad("score --method l2 --out " + out + " --keys " + path("k_f8.npy"), "'<f8' not supported");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_i8.npy"), "'<i8' not supported");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_2d.npy"), "got 2 dimensions");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_4d.npy"), "got 4 dimensions");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_dim0.npy"), "head_dim must be in [1, 4096] (got 0)");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_dim_big.npy"), "(got 5000)");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_be.npy"), "big-endian dtype '>f4'");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_trunc.npy"),
              "truncated: expected " + std::to_string(H * T * D * 4) + " data bytes, got " +
                  std::to_string(H * T * D * 4 - 3));
    check_bad("score --method l2 --out " + out + " --keys " + path("k_trunc_header.npy"), "truncated header");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_extra.npy"), "trailing data");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_text.npy"), "bad magic");
    check_bad("score --method l2 --out " + out + " --keys " + path("k_emptyfile.npy"), "bad magic");
    // A hostile file name still gives one line.
    check_bad("score --method l2 --out " + out + " --keys '" + path("new\nline.npy") + "'", "cannot open");
  }
  SECTION("filters file") {
    check_bad(base + " --method qfilter", "missing required flag --filters");
    check_bad(base + " --method qfilter --filters " + path("nofilters.npy"), "nofilters.npy: cannot open");
    check_bad(base + " --method qfilter --filters " + path("f_trunc.npy"), "f_trunc.npy: truncated");
    check_bad(base + " --method qfilter --filters " + path("f_2d.npy"), "f_2d.npy");
    check_bad(base + " --method qfilter --filters " + path("f_dim.npy"), "head_dim 8");
    check_bad(base + " --method qfilter --filters " + path("f_heads.npy"), "kv_heads 1");
    check_bad(base + " --method qfilter --filters " + path("f_heads.npy") + " --layer 5", "kv_heads 1");
    check_bad(base + " --method qfilter --filters " + path("f_f16.npy"), "'<f2'");
    check_bad(base + " --method qfilter --filters " + path("f_nan.npy"), "not finite");
    check_bad(base + " --method qfilter --filters " + k, "(kv_heads 37, head_dim 16)");
  }
  SECTION("output") {
    check_bad("score --method l2 --keys " + k + " --out " + path("no/such/dir/s.npy"), "cannot write output");
    check_bad("score --method l2 --keys " + k + " --out " + tmp().string(), "cannot write output");
  }
}

TEST_CASE("cli: --filters F.safetensors scores in the authors' published convention", "[cli][qfilter]") {
  // keys [2, 40, 8] against the published fixture (tools/gen_qfilter_published_fixtures.py)
  const std::string st = std::string(KVSCORE_TEST_DATA_DIR) + "/qfilters_published_f16.safetensors";
  std::vector<float> k(2 * 40 * 8);
  for (std::size_t i = 0; i < k.size(); ++i) k[i] = float(int((i * 37 + 11) % 33) - 16) / 8.f;
  npy::save<float>(path("kpub.npy"), {2, 40, 8}, k.data());
  const kvscore::KeysView<float> view(k.data(), 2, 40, 8, 40 * 8, 8);
  const std::string base = "score --method qfilter --keys " + path("kpub.npy") + " --out " + path("spub.npy");
  Result r = cli(base + " --filters " + st + " --layer 2");
  REQUIRE(r.rc == 0);
  check_scores(path("spub.npy"), kvscore::QFilter::from_published(st, 2).score(view));
  r = cli(base + " --filters " + st + " --layer 2 --filters-convention kvscore");
  REQUIRE(r.rc == 0);
  check_scores(path("spub.npy"), kvscore::QFilter::load(st, 2, kvscore::FilterConvention::kvscore).score(view));
  check_bad(base + " --filters " + st + " --filters-convention upside-down",
            "--filters-convention must be published or kvscore (got 'upside-down')");
  check_bad(base + " --filters " + st + " --layer 3", "layer 3 out of range [0, 3)");
  check_bad("score --method l2 --keys " + path("kpub.npy") + " --out " + path("spub.npy") +
                " --filters-convention kvscore",
            "--filters-convention applies only to --method qfilter");
}
