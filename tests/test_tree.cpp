// The source tree against what its docs say about it: the floors of include/kvscore
// (docs/architecture.md, "The floors") worked out from the #include lines.
#include <catch2/catch.hpp>

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

TEST_CASE("tree: docs/architecture.md's floors are the include graph's", "[tree]") {
  const Graph g = include_graph();
  const std::map<std::string, int> floor = floors_of(g);
  const std::string doc = read(kRoot / "docs" / "architecture.md");

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
