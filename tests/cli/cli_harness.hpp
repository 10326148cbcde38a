// tests/cli/cli_harness.hpp — what every test of the `kvscore` tool shares: a scratch
// directory per suite and process, running the tool as a process (KVSCORE_CLI_PATH), and
// the error contract (exit 2, empty stdout, exactly one "kvscore: " line on stderr).
//
// In a test file:
//   const cli_test::ScratchDir& dir() { static const cli_test::ScratchDir d("select"); return d; }
//   cli_test::Result r = cli_test::run(dir(), "select --scores " + dir().file("s.npy") + " ...");
//   cli_test::check_error(r, "needle");
#pragma once

#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include <kvscore/core/dtype.hpp>
#include <kvscore/core/view.hpp>
#include <kvscore/io/npy.hpp>

#ifndef KVSCORE_CLI_PATH
#error "KVSCORE_CLI_PATH (path of the kvscore binary) must be defined by the build"
#endif

namespace cli_test {

namespace fs = std::filesystem;

/// A scratch directory for one suite in this process, removed at exit.
struct ScratchDir {
  fs::path path;
  explicit ScratchDir(const std::string& suite)
      : path(fs::temp_directory_path() /
             ("kvscore_test_cli_" + suite + "_" + std::to_string(static_cast<long long>(::getpid())))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::string file(const std::string& name) const { return (path / name).string(); }
};

inline std::string slurp(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

struct Result {
  int rc = -1;
  std::string out, err;
};

/// Runs `kvscore <args>` through /bin/sh; args are shell words (scratch paths need no quoting).
/// A crash or a signal fails the test: the tool must always exit.
inline Result run(const ScratchDir& dir, const std::string& args) {
  const std::string out = dir.file("stdout.txt"), err = dir.file("stderr.txt");
  const std::string cmd = std::string("'") + KVSCORE_CLI_PATH + "' " + args + " >'" + out + "' 2>'" + err + "'";
  const int status = std::system(cmd.c_str());
  Result r;
  REQUIRE(status != -1);
  REQUIRE(WIFEXITED(status));
  r.rc = WEXITSTATUS(status);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

/// The error contract: exit 2, nothing on stdout, exactly one line on stderr that starts
/// with "kvscore: " and contains `needle`.
inline void check_error(const Result& r, const std::string& needle) {
  INFO("stderr: " << r.err);
  CHECK(r.rc == 2);
  CHECK(r.out.empty());
  REQUIRE(!r.err.empty());
  CHECK(r.err.rfind("kvscore: ", 0) == 0);
  CHECK(r.err.back() == '\n');
  CHECK(r.err.find('\n') == r.err.size() - 1);
  CHECK(r.err.find(needle) != std::string::npos);
}

/// No temporary output (atomic writes go through "<name>.tmp-*") left in the directory.
inline void check_no_temporaries(const ScratchDir& dir) {
  for (const auto& e : fs::directory_iterator(dir.path))
    CHECK(e.path().filename().string().find(".tmp-") == std::string::npos);
}

/// `args` fails by the error contract, writes none of the scratch files `outputs` and leaves no
/// temporary behind.
inline void check_bad_run(const ScratchDir& dir, const std::string& args, const std::string& needle,
                          std::initializer_list<const char*> outputs) {
  INFO("kvscore " << args);
  for (const char* o : outputs) fs::remove(dir.file(o));
  check_error(run(dir, args), needle);
  for (const char* o : outputs) CHECK(!fs::exists(dir.file(o)));
  check_no_temporaries(dir);
}

/// A '<f4' scores file equals the library's scores bit for bit (the CLI and the tests use the
/// same kernel tables).
inline void check_scores(const std::string& file, const kvscore::Scores& want) {
  const kvscore::npy::Array a = kvscore::npy::load(file);
  CHECK(a.descr == "<f4");
  REQUIRE(a.shape == std::vector<std::int64_t>{want.heads(), want.tokens()});
  const std::vector<float> got = a.to_vector<float>();
  REQUIRE(got.size() == want.values().size());
  for (std::size_t i = 0; i < got.size(); ++i)
    if (std::memcmp(&got[i], &want.values()[i], sizeof(float)) != 0) {
      FAIL_CHECK("score " << i << ": cli " << got[i] << " vs library " << want.values()[i]);
      break;
    }
}

/// n normal(0, sigma) floats from a seeded mt19937 (test data only; not platform-pinned).
inline std::vector<float> randn(std::size_t n, unsigned seed, float sigma = 1.f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

/// Keys [H, T, D] (one invalid row: a NaN in head 1, token 9) in fp32/fp16/bf16 and window
/// queries [H*G, W, D], written to k32.npy, k16.npy, kbf.npy and q.npy in `dir` — the inputs
/// of the query-based scorers' CLI tests.
struct KeyQueryInputs {
  std::vector<float> k32, q;
  std::vector<kvscore::half> k16;
  std::vector<kvscore::bfloat16> kbf;
};

inline KeyQueryInputs write_key_query_inputs(const ScratchDir& dir, std::int64_t H, std::int64_t T, std::int64_t D,
                                             std::int64_t G, std::int64_t W, unsigned key_seed, unsigned query_seed) {
  namespace npy = kvscore::npy;
  KeyQueryInputs x;
  x.k32 = randn(std::size_t(H * T * D), key_seed);
  x.k32[std::size_t((1 * T + 9) * D + 2)] = std::numeric_limits<float>::quiet_NaN();  // an invalid row
  x.q = randn(std::size_t(H * G * W * D), query_seed, 1.5f);
  x.k16.resize(x.k32.size());
  x.kbf.resize(x.k32.size());
  kvscore::convert(x.k32.data(), x.k16.data(), x.k32.size());
  kvscore::convert(x.k32.data(), x.kbf.data(), x.k32.size());
  npy::save<float>(dir.file("k32.npy"), {H, T, D}, x.k32.data());
  npy::save<kvscore::half>(dir.file("k16.npy"), {H, T, D}, x.k16.data());
  npy::save<kvscore::bfloat16>(dir.file("kbf.npy"), {H, T, D}, x.kbf.data());
  npy::save<float>(dir.file("q.npy"), {H * G, W, D}, x.q.data());
  return x;
}

}  // namespace cli_test
