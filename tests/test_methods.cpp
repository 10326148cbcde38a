// The method registry (include/kvscore/methods.hpp): every spelling finds its entry, the
// evaluator's built-ins are the registry in its order, each entry's header and doc page exist
// and the doc page names the method. (The scorer types are tied to it in test_contract.cpp,
// the CLI in tests/cli/test_cli.cpp, Python in python/tests/test_core.py.)
#include <catch2/catch.hpp>

#include <kvscore/eval/methods.hpp>
#include <kvscore/methods.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <vector>

namespace {

using Catch::Matchers::Contains;
namespace fs = std::filesystem;

const fs::path kRoot = fs::path(KVSCORE_TEST_DATA_DIR) / ".." / "..";

std::vector<std::string> spellings(const kvscore::MethodInfo& m) {
  std::vector<std::string> s{std::string(m.name), std::string(m.cli)};
  for (std::string_view a : kvscore::split_list(m.aliases)) s.emplace_back(a);
  return s;
}

std::string read(const fs::path& p) {
  std::ifstream f(p);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

}  // namespace

TEST_CASE("methods: every spelling finds its entry, and no other", "[methods]") {
  std::set<std::string> seen;
  for (const kvscore::MethodInfo& m : kvscore::kMethods) {
    INFO(m.name);
    CHECK(!m.summary.empty());
    for (const std::string& s : spellings(m)) {
      INFO(s);
      CHECK(kvscore::find_method_info(s) == &m);
      CHECK(&kvscore::method_info(s) == &m);
      if (s != m.name && s != m.cli) CHECK(seen.insert(s).second);  // an alias names one method
    }
    CHECK(seen.insert(std::string(m.name)).second);
    if (m.cli != m.name) CHECK(seen.insert(std::string(m.cli)).second);
  }
  CHECK(kvscore::find_method_info("") == nullptr);
  CHECK(kvscore::find_method_info("L2") == nullptr);  // spellings are exact
  CHECK(kvscore::find_method_info("l2,knorm") == nullptr);
  CHECK_THROWS_WITH(kvscore::method_info("nope"), Contains("unknown method 'nope'") && Contains("windowed-l2") &&
                                                      Contains("ojakv"));
}

TEST_CASE("methods: the evaluator's built-ins are the registry, in order, under the CLI spelling", "[methods]") {
  const std::vector<kvscore::eval::Method> b = kvscore::eval::builtin_methods();
  REQUIRE(b.size() == kvscore::kMethods.size());
  for (std::size_t i = 0; i < b.size(); ++i) {
    const kvscore::MethodInfo& m = kvscore::kMethods[i];
    INFO(m.name);
    CHECK(b[i].name == m.cli);
    CHECK(b[i].summary == m.summary);
    // every spelling reaches the same evaluator entry
    for (const std::string& s : spellings(m)) CHECK(kvscore::eval::find_method(s).name == m.cli);
  }
  CHECK(!kvscore::eval::builtin_run("not_a_method"));
  // one method under two spellings is listed twice; a built-in's alias cannot be registered
  CHECK_THROWS_WITH(kvscore::eval::resolve_methods("l2,manifold_l2"),
                    Contains("'manifold_l2' is listed twice (it is 'l2')"));
  CHECK(kvscore::eval::resolve_methods("manifoldkv,windowed_manifold_l2") ==
        std::vector<std::string>{"manifoldkv", "windowed_manifold_l2"});
  CHECK_THROWS_WITH(kvscore::eval::register_method({"manifoldkv", "dup", kvscore::eval::oracle_method}),
                    Contains("'manifoldkv' is already registered"));
}

TEST_CASE("methods: each entry's header and doc page exist, and the page names the method", "[methods]") {
  for (const kvscore::MethodInfo& m : kvscore::kMethods) {
    INFO(m.name << ": include/" << m.header << ", docs/" << m.doc);
    CHECK(fs::exists(kRoot / "include" / m.header));
    REQUIRE(fs::exists(kRoot / "docs" / m.doc));
    const std::string doc = read(kRoot / "docs" / m.doc);
    CHECK(doc.find(std::string(m.cli)) != std::string::npos);
    if (!m.cls.empty()) {
      CHECK(doc.find(std::string(m.cls)) != std::string::npos);
      CHECK(read(kRoot / "include" / m.header).find(" " + std::string(m.cls)) != std::string::npos);
    }
  }
}
