// Tests of `kvscore eval` (run as a process, KVSCORE_CLI_PATH) on data from `kvscore synth`:
// the JSON numbers equal the library's kvscore::eval::evaluate, the table and the SVG carry
// every result, multi-layer and float16 input work, and bad input gives exit code 2 and one
// "kvscore: " line with no report left behind. (main() is in test_cli.cpp.)
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include <kvscore/eval/evaluate.hpp>
#include <kvscore/eval/report.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/synth.hpp>

#include "cli_harness.hpp"

namespace {

namespace npy = kvscore::npy;
namespace eval = kvscore::eval;
namespace synth = kvscore::synth;

const cli_test::ScratchDir& eval_dir() { static const cli_test::ScratchDir d("eval"); return d; }
cli_test::Result eval_cli(const std::string& args) { return cli_test::run(eval_dir(), args); }

std::size_t eval_count(const std::string& s, const std::string& needle) {
  std::size_t n = 0;
  for (std::size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

/// `kvscore synth` data in eval_dir()/name (once per process).
std::string eval_data(const std::string& name, const std::string& extra) {
  const std::string out = eval_dir().file(name);
  if (!std::filesystem::exists(out + "/K.npy")) {
    const cli_test::Result r = eval_cli("synth --kind mixed --out " + out + " --kv-heads 2 --tokens 256 --head-dim 32 "
                                        "--queries 4 --segment 64 " + extra);
    INFO(r.err);
    REQUIRE(r.rc == 0);
  }
  return out;
}

/// The number after "name": at or after position `at`.
double eval_field(const std::string& json, std::size_t at, const std::string& name) {
  const std::size_t p = json.find("\"" + name + "\": ", at);
  REQUIRE(p != std::string::npos);
  return std::strtod(json.c_str() + p + name.size() + 4, nullptr);
}

std::string eval_inputs(const std::string& d) {
  return "--keys " + d + "/K.npy --values " + d + "/V.npy --queries " + d + "/Q.npy";
}

}  // namespace

TEST_CASE("cli eval: report equals the library's, table and SVG carry every result", "[cli][eval]") {
  const std::string d = eval_data("one", "");
  const std::string rep = eval_dir().file("r.json"), svg = eval_dir().file("r.svg");
  const cli_test::Result r = eval_cli("eval " + eval_inputs(d) + " --methods l2,knorm,windowed-l2,streaming_llm "
                                      "--keep 0.1,0.5 --window 64 --sinks 2 --out " + rep + " --svg " + svg);
  INFO(r.err);
  REQUIRE(r.rc == 0);
  CHECK(r.err.empty());
  // the library on the same data
  synth::Spec s{.kv_heads = 2, .tokens = 256, .head_dim = 32, .queries = 4, .segment = 64};
  const synth::Data D = synth::generate(s);
  const eval::LayerInput in{D.keys.data(), D.values.data(), D.queries.data(), 2, 256, 32, 32, 4, 4};
  eval::EvalOptions o;
  o.methods = {"l2", "knorm", "windowed-l2", "streaming_llm"};
  o.keep = {0.1, 0.5};
  o.method.window = 64;
  o.method.select.sinks = 2;
  const eval::Report lib = eval::evaluate({in}, o);
  const std::string json = cli_test::slurp(rep);
  REQUIRE(lib.results.size() == 8);
  CHECK(eval_count(json, "{\"method\": ") == 8);
  // Same numbers up to rounding (the tool and this test may be compiled with other flags,
  // e.g. FMA contraction, so the last bits of fp64 sums may differ).
  for (const auto& x : lib.results) {
    INFO(x.method << " " << x.keep);
    const std::string head = "{\"method\": \"" + x.method + "\", \"keep\": " + eval::detail::num17(x.keep) +
                             ", \"budget\": " + std::to_string(x.budget) + ", ";
    const std::size_t at = json.find(head);
    REQUIRE(at != std::string::npos);
    CHECK(eval_field(json, at, "attention_mass_recall") == Approx(x.attention_mass_recall).epsilon(1e-12).margin(1e-14));
    CHECK(eval_field(json, at, "output_rel_error") == Approx(x.output_rel_error).epsilon(1e-12).margin(1e-14));
    CHECK(eval_field(json, at, "topk_overlap") == Approx(x.topk_overlap).epsilon(1e-12).margin(1e-14));
    CHECK(eval_field(json, at, "time_ms") >= 0.0);
  }
  CHECK(eval_count(json, "{\"layer\": ") == 16);
  CHECK(eval_count(r.out, "\n") == 2 + 8);
  CHECK(r.out.find("windowed-l2") != std::string::npos);
  const std::string s_svg = cli_test::slurp(svg);
  CHECK(s_svg.rfind("<svg", 0) == 0);
  CHECK(eval_count(s_svg, "<polyline") == 12);
  cli_test::check_no_temporaries(eval_dir());
}

TEST_CASE("cli eval: multi-layer and float16 input - --methods all - adakv", "[cli][eval]") {
  const std::string d = eval_data("ml16", "--layers 2 --dtype f16");
  const std::string rep = eval_dir().file("ml.json");
  const cli_test::Result r =
      eval_cli("eval " + eval_inputs(d) + " --keep 0.25 --alloc adakv --group 2 --out " + rep);
  INFO(r.err);
  REQUIRE(r.rc == 0);
  const std::string json = cli_test::slurp(rep);
  CHECK(json.find("\"layers\": 2") != std::string::npos);
  CHECK(json.find("\"alloc\": \"adakv\"") != std::string::npos);
  for (const auto& m : eval::resolve_methods("all"))
    CHECK(json.find("{\"method\": \"" + m + "\"") != std::string::npos);
  CHECK(eval_count(json, "{\"layer\": 1, ") == 2 * eval::resolve_methods("all").size());
}

TEST_CASE("cli eval: budgets a method cannot meet are listed, not fatal", "[cli][eval]") {
  const std::string d = eval_data("one", "");
  const std::string rep = eval_dir().file("skip.json");
  const cli_test::Result r = eval_cli("eval " + eval_inputs(d) + " --methods l2 --keep 0.05,0.5 --recent 20 --out " + rep);
  REQUIRE(r.rc == 0);
  const std::string json = cli_test::slurp(rep);
  CHECK(eval_count(json, "{\"method\": ") == 2);  // one result + one skipped entry
  CHECK(json.find("\"skipped\": [{\"method\": \"l2\", \"keep\": 0.050000000000000003") != std::string::npos);
  CHECK(r.out.find("skipped l2 at keep 0.05") != std::string::npos);
  // every budget skipped: an error
  cli_test::check_error(eval_cli("eval " + eval_inputs(d) + " --methods l2 --keep 0.05 --recent 20 --out " + rep + "2"),
                        "every method x keep was skipped");
  CHECK(!std::filesystem::exists(rep + "2"));
}

TEST_CASE("cli eval: --query-placement after-cache (default) or in-cache, recorded in the report", "[cli][eval]") {
  const std::string d = eval_data("one", "");
  const std::string after = eval_dir().file("after.json"), in = eval_dir().file("in.json");
  REQUIRE(eval_cli("eval " + eval_inputs(d) + " --methods snapkv --keep 0.1 --out " + after).rc == 0);
  REQUIRE(eval_cli("eval " + eval_inputs(d) + " --methods snapkv --keep 0.1 --query-placement in-cache --out " + in)
              .rc == 0);
  const std::string a = cli_test::slurp(after), b = cli_test::slurp(in);
  CHECK(a.find("\"query_placement\": \"after-cache\"") != std::string::npos);
  CHECK(b.find("\"query_placement\": \"in-cache\"") != std::string::npos);
  auto recall = [](const std::string& json) {
    const std::size_t p = json.find("\"attention_mass_recall\": ");
    return std::stod(json.substr(p + 25));
  };
  CHECK(recall(a) != recall(b));  // the mode changes what SnapKV keeps
  cli_test::check_error(eval_cli("eval " + eval_inputs(d) + " --methods snapkv --query-placement later --out " +
                                 eval_dir().file("bad.json")),
                        "--query-placement: 'later' (expected in-cache or after-cache)");
}

TEST_CASE("cli eval: --budget-rounding floor gives the papers' budgets", "[cli][eval]") {
  const std::string d = eval_data("one", "");
  const std::string near = eval_dir().file("near.json"), flo = eval_dir().file("floor.json");
  REQUIRE(eval_cli("eval " + eval_inputs(d) + " --methods l2 --keep 0.1 --out " + near).rc == 0);
  REQUIRE(eval_cli("eval " + eval_inputs(d) + " --methods l2 --keep 0.1 --budget-rounding floor --out " + flo).rc == 0);
  const std::string a = cli_test::slurp(near), b = cli_test::slurp(flo);
  CHECK(a.find("\"budget_rounding\": \"nearest\"") != std::string::npos);
  CHECK(b.find("\"budget_rounding\": \"floor\"") != std::string::npos);
  auto budget = [](const std::string& json) {
    const std::size_t p = json.find("\"budget\": ");
    return std::stoll(json.substr(p + 10));
  };
  auto tokens = [](const std::string& json) {
    const std::size_t p = json.find("\"tokens\": ");
    return std::stoll(json.substr(p + 10));
  };
  const long long N = tokens(a);
  CHECK(budget(a) == kvscore::budget_from_ratio(N, 0.1));
  CHECK(budget(b) == std::max(1LL, (long long)std::floor(0.1 * double(N))));
  cli_test::check_error(eval_cli("eval " + eval_inputs(d) + " --budget-rounding up --out " + flo + "2"),
                        "--budget-rounding: 'up' (expected nearest or floor)");
}

TEST_CASE("cli eval: bad input", "[cli][eval]") {
  const std::string d = eval_data("one", "");
  const std::string in = eval_inputs(d), rep = eval_dir().file("bad.json");
  const std::string ok = "eval " + in + " --out " + rep;
  cli_test::check_error(eval_cli("eval " + in), "--out");
  cli_test::check_error(eval_cli(ok + " --keep 0"), "--keep: 0 is not in (0, 1]");
  cli_test::check_error(eval_cli(ok + " --keep 0.1,x"), "--keep: 'x' is not a number");
  cli_test::check_error(eval_cli(ok + " --methods l2,foo"), "unknown method 'foo'");
  cli_test::check_error(eval_cli(ok + " --alloc greedy"), "'greedy'");
  cli_test::check_error(eval_cli(ok + " --group 3"), "--group 3 does not match q_heads / kv_heads = 4 / 2 = 2");
  const std::vector<float> q3(3 * 4 * 32, 0.f);
  npy::save<float>(eval_dir().file("q3.npy"), {3, 4, 32}, q3.data());
  cli_test::check_error(eval_cli("eval --keys " + d + "/K.npy --values " + d + "/V.npy --queries " +
                                 eval_dir().file("q3.npy") + " --out " + rep),
                        "q_heads 3 is not a multiple of the 2 kv_heads");
  // wrong ranks, dtypes, shapes, non-finite values
  const std::vector<float> k2(2 * 256, 0.f);
  npy::save<float>(eval_dir().file("k2d.npy"), {2, 256}, k2.data());
  cli_test::check_error(eval_cli("eval --keys " + eval_dir().file("k2d.npy") + " --values " + d + "/V.npy --queries " +
                                 d + "/Q.npy --out " + rep),
                        "keys must be [kv_heads, tokens, d]");
  const std::vector<std::int64_t> ki(2 * 256 * 32, 1);
  npy::save<std::int64_t>(eval_dir().file("ki.npy"), {2, 256, 32}, ki.data());
  cli_test::check_error(eval_cli("eval --keys " + eval_dir().file("ki.npy") + " --values " + d + "/V.npy --queries " +
                                 d + "/Q.npy --out " + rep),
                        "'<i8' not supported");
  const std::vector<float> v(2 * 100 * 32, 0.f);
  npy::save<float>(eval_dir().file("v100.npy"), {2, 100, 32}, v.data());
  cli_test::check_error(eval_cli("eval --keys " + d + "/K.npy --values " + eval_dir().file("v100.npy") + " --queries " +
                                 d + "/Q.npy --out " + rep),
                        "do not match keys [2, 256, 32]");
  npy::Array K = npy::load(d + "/K.npy");
  std::vector<float> kn(K.as<float>(), K.as<float>() + 2 * 256 * 32);
  kn[1000] = std::numeric_limits<float>::quiet_NaN();
  npy::save<float>(eval_dir().file("knan.npy"), {2, 256, 32}, kn.data());
  cli_test::check_error(eval_cli("eval --keys " + eval_dir().file("knan.npy") + " --values " + d + "/V.npy --queries " +
                                 d + "/Q.npy --out " + rep),
                        "flat index 1000 is not finite");
  CHECK(!std::filesystem::exists(rep));
  cli_test::check_no_temporaries(eval_dir());
}

TEST_CASE("cli eval: a leak-free dump (--dump DIR with Qwin.npy, Qcal.npy) - protocols and per_layer_best", "[cli][eval]") {
  // a dump_kv.py --following layout from synth data: K, V, Q as they are, Qwin = the queries
  // of another synth seed (the "window"), Qcal = a third set
  const std::string d = eval_data("one", ""), w = eval_data("win", "--seed 7"), dump = eval_dir().file("dump");
  std::filesystem::create_directories(dump);
  for (const char* f : {"K.npy", "V.npy", "Q.npy"})
    std::filesystem::copy_file(d + "/" + f, dump + "/" + f, std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(w + "/Q.npy", dump + "/Qwin.npy", std::filesystem::copy_options::overwrite_existing);
  const std::string lf = eval_dir().file("lf.json"), sh = eval_dir().file("sh.json"), ex = eval_dir().file("ex.json");
  // without Qcal.npy: leak-free by default, qfilter skipped with the reason
  cli_test::Result r = eval_cli("eval --dump " + dump + " --methods snapkv,qfilter,l2,oracle --keep 0.25 --out " + lf);
  INFO(r.err);
  REQUIRE(r.rc == 0);
  std::string a = cli_test::slurp(lf);
  CHECK(a.find("\"protocol\": \"leak-free\"") != std::string::npos);
  CHECK(a.find("\"window_queries\": 4, \"calib_queries\": 0") != std::string::npos);
  CHECK(a.find("calibrates Q-Filters on other text") != std::string::npos);
  CHECK(r.out.find("protocol leak-free, 4 window queries") != std::string::npos);
  CHECK(a.find("\"per_layer_best\": [\n    {\"keep\": 0.25, \"metric\": \"attention_mass_recall\", \"methods\": [") !=
        std::string::npos);
  // with Qcal.npy qfilter runs; the same files given one by one give the same report
  std::filesystem::copy_file(w + "/Q.npy", dump + "/Qcal.npy", std::filesystem::copy_options::overwrite_existing);
  REQUIRE(eval_cli("eval --dump " + dump + " --methods snapkv,qfilter,l2,oracle --keep 0.25 --out " + lf).rc == 0);
  REQUIRE(eval_cli("eval " + eval_inputs(d) + " --window-queries " + dump + "/Qwin.npy --calib-queries " + dump +
                   "/Qcal.npy --methods snapkv,qfilter,l2,oracle --keep 0.25 --out " + ex).rc == 0);
  a = cli_test::slurp(lf);
  CHECK(a.find("\"skipped\": []") != std::string::npos);
  auto strip_time = [](std::string s) {  // time_ms differs from run to run
    for (std::size_t p = s.find("\"time_ms\": "); p != std::string::npos; p = s.find("\"time_ms\": ", p + 1))
      s.erase(p + 11, s.find(',', p) - p - 11);
    return s;
  };
  CHECK(strip_time(a) == strip_time(cli_test::slurp(ex)));
  // --protocol shared: every method sees Q; the library's numbers
  REQUIRE(eval_cli("eval --dump " + dump + " --methods snapkv,qfilter,l2,oracle --keep 0.25 --protocol shared --out " +
                   sh).rc == 0);
  const std::string b = cli_test::slurp(sh);
  CHECK(b.find("\"protocol\": \"shared\"") != std::string::npos);
  CHECK(b.find("\"window_queries\": 0, \"calib_queries\": 0") != std::string::npos);
  auto recall_of = [](const std::string& json, const std::string& m) {
    const std::size_t p = json.find("{\"method\": \"" + m + "\"");
    return eval_field(json, p, "attention_mass_recall");
  };
  CHECK(recall_of(a, "snapkv") != recall_of(b, "snapkv"));
  CHECK(recall_of(a, "l2") == recall_of(b, "l2"));
  CHECK(recall_of(a, "oracle") == recall_of(b, "oracle"));
  // usage errors
  const std::string ok = " --out " + eval_dir().file("bad.json");
  cli_test::check_error(eval_cli("eval " + eval_inputs(d) + " --protocol leak-free" + ok),
                        "--protocol leak-free needs the cache's last-window queries");
  cli_test::check_error(eval_cli("eval --dump " + dump + " --query-placement in-cache" + ok),
                        "--query-placement is for --protocol shared");
  cli_test::check_error(eval_cli("eval --dump " + dump + " --keys " + d + "/K.npy" + ok), "drop --keys");
  cli_test::check_error(eval_cli("eval --dump " + dump + " --protocol fair" + ok), "--protocol: 'fair'");
  cli_test::check_error(eval_cli("eval --dump " + dump + " --mix-metric best" + ok), "--mix-metric: 'best'");
  const std::vector<float> q(4 * 4 * 16, 0.f);
  npy::save<float>(eval_dir().file("qwin16.npy"), {4, 4, 16}, q.data());
  cli_test::check_error(eval_cli("eval " + eval_inputs(d) + " --window-queries " + eval_dir().file("qwin16.npy") + ok),
                        "window queries [4, 4, 16] do not match queries [4, 4, 32]");
  CHECK(!std::filesystem::exists(eval_dir().file("bad.json")));
}
