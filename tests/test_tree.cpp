// The source tree against what its docs say about it: the floors of include/kvscore
// (docs/design/architecture.md, "The floors") worked out from the #include lines; the front ends
// name no method and write no default of their own (both come from kvscore/methods.hpp and the
// library's option structs).
#include <catch2/catch.hpp>

#include <kvscore/methods.hpp>
#include <kvscore/version.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const fs::path kRoot = fs::path(KVSCORE_TEST_DATA_DIR) / ".." / "..";

std::string read(const fs::path& p) {
  std::ifstream f(p);
  REQUIRE(f.good());
  return std::string(std::istreambuf_iterator<char>(f), {});
}

/// The text between `<!-- name: begin -->` and `<!-- name: end -->` of a doc page.
std::string marked_block(const std::string& doc, const std::string& name) {
  const std::string b = "<!-- " + name + ": begin -->", e = "<!-- " + name + ": end -->";
  const std::size_t i = doc.find(b), j = doc.find(e);
  REQUIRE(i != std::string::npos);
  REQUIRE(j != std::string::npos);
  REQUIRE(i < j);
  return doc.substr(i + b.size(), j - i - b.size());
}

/// A room of include/kvscore: its top-level header, or the folder a header lies in.
std::string room_of(const std::string& rel) {
  const std::size_t s = rel.find('/');
  return s == std::string::npos ? rel : rel.substr(0, s + 1);
}

using Graph = std::map<std::string, std::set<std::string>>;  // room -> the other rooms it includes

Graph include_graph() {
  const fs::path inc = kRoot / "include" / "kvscore";
  const std::regex include_line(R"(^\s*#\s*include\s*[<"]kvscore/([^">]+)[">])");
  Graph g;
  for (const auto& e : fs::recursive_directory_iterator(inc)) {
    if (!e.is_regular_file() || e.path().extension() != ".hpp") continue;
    const std::string room = room_of(fs::relative(e.path(), inc).generic_string());
    g[room];
    std::istringstream lines(read(e.path()));
    std::smatch m;
    for (std::string line; std::getline(lines, line);)
      if (std::regex_search(line, m, include_line) && room_of(m[1].str()) != room) g[room].insert(room_of(m[1].str()));
  }
  return g;
}

/// floor(room) = 1 + the highest floor among the rooms it includes (1 for none); a loop fails.
std::map<std::string, int> floors_of(const Graph& g) {
  std::map<std::string, int> floor;
  std::set<std::string> open;
  std::function<int(const std::string&)> visit = [&](const std::string& r) -> int {
    if (const auto it = floor.find(r); it != floor.end()) return it->second;
    INFO("include loop through " << r);
    REQUIRE(open.insert(r).second);
    int f = 1;
    for (const std::string& d : g.at(r)) f = std::max(f, 1 + visit(d));
    open.erase(r);
    return floor[r] = f;
  };
  for (const auto& [r, deps] : g) visit(r);
  return floor;
}

/// The rooms named in a line of the doc: `name/` or `name.hpp`, outside parentheses.
std::set<std::string> rooms_in(std::string text) {
  text = std::regex_replace(text, std::regex(R"(\([^)]*\))"), " ");
  std::set<std::string> out;
  const std::regex room(R"(([A-Za-z_][A-Za-z0-9_]*(?:/|\.hpp)))");
  for (std::sregex_iterator it(text.begin(), text.end(), room), end; it != end; ++it) out.insert((*it)[1].str());
  return out;
}

/// One line per room, for readable failures.
std::string text(const std::map<std::string, int>& floors) {
  std::string s;
  for (const auto& [r, f] : floors) s += "floor " + std::to_string(f) + " " + r + "\n";
  return s;
}
std::string text(const Graph& g) {
  std::string s;
  for (const auto& [r, deps] : g) {
    s += r + " ->";
    for (const std::string& d : deps) s += " " + d;
    s += "\n";
  }
  return s;
}

}  // namespace

TEST_CASE("tree: docs/design/architecture.md's floors are the include graph's", "[tree]") {
  const Graph g = include_graph();
  const std::map<std::string, int> floor = floors_of(g);
  const std::string doc = read(kRoot / "docs" / "design" / "architecture.md");

  // the picture: "floor N   room room ..."
  std::map<std::string, int> drawn;
  std::istringstream lines(marked_block(doc, "floors"));
  const std::regex floor_line(R"(^floor\s+(\d+)\s+(.*)$)");
  std::smatch m;
  for (std::string line; std::getline(lines, line);)
    if (std::regex_match(line, m, floor_line))
      for (const std::string& r : rooms_in(m[2].str())) drawn[r] = std::stoi(m[1].str());
  CHECK(text(drawn) == text(floor));
  CHECK(std::max_element(floor.begin(), floor.end(), [](auto& a, auto& b) { return a.second < b.second; })->second <= 7);

  // the table: "| `room` | what | `dep` `dep` ... |"
  Graph table;
  std::istringstream rows(marked_block(doc, "arrows"));
  const std::regex row(R"(^\|\s*`([^`]+)`\s*\|[^|]*\|([^|]*)\|\s*$)");
  for (std::string line; std::getline(rows, line);)
    if (std::regex_match(line, m, row)) {
      std::set<std::string>& deps = table[m[1].str()];
      const std::string cell = m[2].str();
      const std::regex tick("`([^`]+)`");
      for (std::sregex_iterator it(cell.begin(), cell.end(), tick), end; it != end; ++it) deps.insert((*it)[1].str());
    }
  CHECK(text(table) == text(g));
}

namespace {

/// Every "..." string literal of a C++ source, with its line (comments skipped).
std::vector<std::pair<int, std::string>> string_literals(const std::string& src) {
  std::vector<std::pair<int, std::string>> out;
  int line = 1;
  for (std::size_t i = 0; i < src.size(); ++i) {
    const char c = src[i];
    if (c == '\n') ++line;
    else if (c == '/' && i + 1 < src.size() && src[i + 1] == '/') {
      while (i < src.size() && src[i] != '\n') ++i;
      ++line;
    } else if (c == '/' && i + 1 < src.size() && src[i + 1] == '*') {
      for (i += 2; i + 1 < src.size() && !(src[i] == '*' && src[i + 1] == '/'); ++i) line += src[i] == '\n';
      ++i;
    } else if (c == '\'') {
      for (++i; i < src.size() && src[i] != '\''; ++i) i += src[i] == '\\';
    } else if (c == '"') {
      std::string lit;
      for (++i; i < src.size() && src[i] != '"'; ++i) {
        if (src[i] == '\\') lit += src[i++];
        lit += src[i];
      }
      out.emplace_back(line, lit);
    }
  }
  return out;
}

/// The front ends' C++: the CLI and the evaluator.
std::vector<fs::path> front_end_sources() {
  std::vector<fs::path> files;
  for (const fs::path dir : {kRoot / "tools", kRoot / "include" / "kvscore" / "eval"})
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".cpp" || e.path().extension() == ".hpp") files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

/// What a front end must not write: a spelling of a method of kvscore/methods.hpp as a word of
/// a string literal ("docs/methods/ojakv.md" is a path, not a name), a default other than 0 or 1 in
/// --help ("default 4096") or as a flag's fallback (get_int("--window", 4096, ...)).
struct Findings {
  std::vector<std::string> names, defaults;
};

Findings scan(const std::string& src) {
  static const std::regex name = [] {
    std::string alternatives;
    for (const kvscore::MethodInfo& m : kvscore::kMethods) {
      std::vector<std::string_view> s = kvscore::split_list(m.aliases);
      s.push_back(m.name);
      s.push_back(m.cli);
      for (std::string_view x : s) alternatives += (alternatives.empty() ? "" : "|") + std::string(x);
    }
    return std::regex("(^|[^A-Za-z0-9_./-])(" + alternatives + R"()(?![A-Za-z0-9_/-]|\.[a-z]))");
  }();
  static const std::regex help_default(R"(default ([0-9][0-9.,]*))");
  static const std::regex fallback(R"re(get(_int)?\("--[a-z-]+",\s*"?([0-9][0-9.]*))re");
  const auto allowed = [](const std::string& v) { return v == "0" || v == "1"; };
  Findings f;
  for (const auto& [line, lit] : string_literals(src)) {
    for (std::sregex_iterator it(lit.begin(), lit.end(), name), end; it != end; ++it)
      f.names.push_back(std::to_string(line) + ": " + (*it)[2].str() + " in \"" + lit + "\"");
    for (std::sregex_iterator it(lit.begin(), lit.end(), help_default), end; it != end; ++it)
      if (!allowed((*it)[1].str())) f.defaults.push_back(std::to_string(line) + ": \"" + lit + "\"");
  }
  for (std::sregex_iterator it(src.begin(), src.end(), fallback), end; it != end; ++it)
    if (!allowed((*it)[2].str())) f.defaults.push_back(it->str());
  return f;
}

}  // namespace

TEST_CASE("tree: the CLI and the evaluator name no method and write no default", "[tree]") {
  const std::vector<fs::path> files = front_end_sources();
  CHECK(files.size() > 10);
  for (const fs::path& file : files) {
    INFO(file.filename().string());
    const Findings f = scan(read(file));
    CHECK(f.names == std::vector<std::string>{});
    CHECK(f.defaults == std::vector<std::string>{});
  }
}

TEST_CASE("tree: the front-end scan finds a method name and a written default", "[tree]") {
  const std::string src =
      "// \"knorm\" in a comment\n"
      "const char* a = \"use snapkv, l2 or windowed-l2.\"; /* \"l2\" */ char c = '\"';\n"
      "auto b = \"docs/methods/ojakv.md, ojakv.txt, the L2 norm, --kl2, pariskv-codebook \\\" x (default 0)\";\n"
      "auto w = args.get_int(\"--window\", 4096, 1, 9); auto t = args.get_int(\"--threads\", 0, 0, 9);\n"
      "auto u = \"(default 4096, > 0)\";\n";
  const auto lits = string_literals(src);
  REQUIRE(lits.size() == 5);
  CHECK(lits[0] == std::pair<int, std::string>{2, "use snapkv, l2 or windowed-l2."});
  CHECK(lits[1].first == 3);
  const Findings f = scan(src);
  CHECK(f.names == std::vector<std::string>{"2: snapkv in \"use snapkv, l2 or windowed-l2.\"",
                                            "2: l2 in \"use snapkv, l2 or windowed-l2.\"",
                                            "2: windowed-l2 in \"use snapkv, l2 or windowed-l2.\""});
  CHECK(f.defaults == std::vector<std::string>{"5: \"(default 4096, > 0)\"", "get_int(\"--window\", 4096"});
}

TEST_CASE("tree: every test case is one ctest test (no semicolon, every bracket closed)", "[tree]") {
  // catch_discover_tests (Catch2 2.x) reads the test names as one CMake list, in which ';'
  // separates and an unmatched ']' or '[' stops the separating: the names that follow would
  // become one ctest test. Every TEST_CASE of tests/ and tests/cli/.
  const std::regex test_case(R"re((?:TEMPLATE_)?TEST_CASE\(\s*"((?:[^"\\]|\\.)*)")re");
  int names = 0;
  for (const fs::path dir : {kRoot / "tests", kRoot / "tests" / "cli"})
    for (const auto& e : fs::directory_iterator(dir)) {
      if (e.path().extension() != ".cpp") continue;
      const std::string src = read(e.path());
      for (std::sregex_iterator it(src.begin(), src.end(), test_case), end; it != end; ++it) {
        const std::string name = (*it)[1].str();
        ++names;
        int depth = 0;
        bool ok = name.find(';') == std::string::npos;
        for (const char c : name) {
          depth += c == '[' ? 1 : c == ']' ? -1 : 0;
          ok = ok && depth >= 0;
        }
        INFO(e.path().filename().string() << ": \"" << name << "\"");
        CHECK((ok && depth == 0));
      }
    }
  CHECK(names > 250);
}

namespace {

/// The regions of tests/test_snippets.cpp (`// [snippet NAME]` ... `// [snippet end]`), dedented.
std::map<std::string, std::vector<std::string>> snippet_regions() {
  std::map<std::string, std::vector<std::string>> out;
  std::istringstream lines(read(kRoot / "tests" / "test_snippets.cpp"));
  const std::regex begin(R"(^\s*// \[snippet ([\w-]+)\]\s*$)"), end(R"(^\s*// \[snippet end\]\s*$)");
  std::smatch m;
  std::string name;
  std::vector<std::string> body;
  for (std::string line; std::getline(lines, line);) {
    if (std::regex_match(line, end)) {
      REQUIRE(!name.empty());
      std::size_t indent = std::string::npos;
      for (const std::string& l : body)
        if (l.find_first_not_of(' ') != std::string::npos) indent = std::min(indent, l.find_first_not_of(' '));
      for (std::string& l : body) l = l.size() > indent ? l.substr(indent) : std::string();
      INFO("snippet " << name);
      CHECK(out.emplace(name, body).second);  // one region per name
      name.clear();
    } else if (std::regex_match(line, m, begin)) {
      name = m[1].str();
      body.clear();
    } else if (!name.empty()) {
      body.push_back(line);
    }
  }
  CHECK(name.empty());  // every region ends
  return out;
}

/// A copy of a region found in a doc page or a header.
struct SnippetCopy {
  std::string where, name;
  std::vector<std::string> lines;
};

}  // namespace

TEST_CASE("tree: the C++ examples of README, docs and headers are compiled regions of tests/test_snippets.cpp",
          "[tree][snippets]") {
  const auto regions = snippet_regions();
  const std::string source = read(kRoot / "tests" / "test_snippets.cpp");
  std::vector<SnippetCopy> copies;

  // docs: every ```cpp block is a snippet, or says why not
  std::vector<fs::path> pages{kRoot / "README.md"};
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "docs"))
    if (e.path().extension() == ".md") pages.push_back(e.path());
  std::sort(pages.begin() + 1, pages.end());
  const std::regex marker(R"(^<!-- snippet ([\w-]+): tests/test_snippets\.cpp -->$)"), exempt(R"(^<!-- not a snippet: .+ -->$)");
  for (const fs::path& page : pages) {
    std::vector<std::string> lines;
    std::istringstream in(read(page));
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    for (std::size_t i = 0; i < lines.size(); ++i) {
      if (lines[i].rfind("```cpp", 0) != 0) continue;
      const std::string where = fs::relative(page, kRoot).generic_string() + ":" + std::to_string(i + 1);
      INFO(where);
      std::smatch m;
      const std::string before = i > 0 ? lines[i - 1] : "";
      const bool is_snippet = std::regex_match(before, m, marker);
      CHECK((is_snippet || std::regex_match(before, exempt)));
      std::size_t j = i + 1;
      while (j < lines.size() && lines[j].rfind("```", 0) != 0) ++j;
      if (!is_snippet) continue;
      SnippetCopy c{where, m[1].str(), {}};
      std::size_t k = i + 1;
      for (; k < j && lines[k].rfind("#include ", 0) == 0; ++k)  // the includes the region's file has
        CHECK(source.find("\n" + lines[k] + "\n") != std::string::npos);
      if (k > i + 1 && k < j && lines[k].empty()) ++k;
      c.lines.assign(lines.begin() + std::ptrdiff_t(k), lines.begin() + std::ptrdiff_t(j));
      copies.push_back(c);
    }
  }

  // headers: `// [snippet NAME: tests/test_snippets.cpp]`, then the region as `//   ` lines
  const std::regex header_marker(R"(^// \[snippet ([\w-]+): tests/test_snippets\.cpp\]$)");
  for (const auto& e : fs::recursive_directory_iterator(kRoot / "include" / "kvscore")) {
    if (e.path().extension() != ".hpp") continue;
    std::vector<std::string> lines;
    std::istringstream in(read(e.path()));
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    for (std::size_t i = 0; i < lines.size(); ++i) {
      std::smatch m;
      if (!std::regex_match(lines[i], m, header_marker)) continue;
      SnippetCopy c{e.path().filename().string() + ":" + std::to_string(i + 1), m[1].str(), {}};
      for (std::size_t k = i + 1; k < lines.size() && lines[k].rfind("//   ", 0) == 0; ++k) c.lines.push_back(lines[k].substr(5));
      copies.push_back(c);
    }
  }

  std::set<std::string> used;
  for (const SnippetCopy& c : copies) {
    INFO(c.where << ": snippet " << c.name);
    const auto it = regions.find(c.name);
    REQUIRE(it != regions.end());
    used.insert(c.name);
    std::string want, got;
    for (const std::string& l : it->second) want += l + "\n";
    for (const std::string& l : c.lines) got += l + "\n";
    CHECK(got == want);
  }
  for (const auto& [name, body] : regions) {
    INFO("region " << name << " of tests/test_snippets.cpp is shown nowhere");
    CHECK(used.count(name) == 1);
  }
  CHECK(copies.size() >= regions.size());
}

TEST_CASE("tree: one version: version.hpp, CMake, pyproject.toml and CHANGELOG.md agree", "[tree][version]") {
  const std::string v = kvscore::version_string;
  CHECK(v == std::to_string(KVSCORE_VERSION_MAJOR) + "." + std::to_string(KVSCORE_VERSION_MINOR) + "." +
                 std::to_string(KVSCORE_VERSION_PATCH));
  CHECK(v == KVSCORE_VERSION_STRING);
#ifdef KVSCORE_PROJECT_VERSION
  CHECK(v == KVSCORE_PROJECT_VERSION);  // CMakeLists.txt read it from version.hpp
#endif
  // pyproject.toml takes the package version from the same #define (scikit-build-core's regex provider)
  const std::string py = read(kRoot / "pyproject.toml");
  CHECK(py.find("input = \"include/kvscore/version.hpp\"") != std::string::npos);
  CHECK(py.find("regex = '#define KVSCORE_VERSION_STRING \"(?P<value>[^\"]+)\"'") != std::string::npos);
  // CHANGELOG.md: Keep a Changelog, the newest release first, this version
  const std::string log = read(kRoot / "CHANGELOG.md");
  std::smatch m;
  REQUIRE(std::regex_search(log, m, std::regex(R"(\n## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2}))")));
  CHECK(m[1].str() == v);
  CHECK(log.find("## [Unreleased]") < std::size_t(m.position(0)));
}
