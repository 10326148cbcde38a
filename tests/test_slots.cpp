// Slot caches (llama.cpp, SGLang): evicted ranges vs a brute-force reference, unions of heads,
// cell -> position mapping for seq_rm, slot-table partition; error paths.
#include <catch2/catch.hpp>

#include "test_support.hpp"

#include <kvscore/slots.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using kvscore::PositionRange;
using kvscore::Selection;

using test_support::error_of;

std::vector<std::int64_t> random_keep(std::int64_t tokens, std::mt19937_64& rng) {
  const int mode = int(rng() % 5);
  std::vector<std::int64_t> keep;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const bool k = mode == 0 ? false : mode == 1 ? true : mode == 2 ? (t % 2 == 0) : (rng() % 3 != 0);
    if (k) keep.push_back(t);
  }
  return keep;
}

/// Brute force: walk every position, open a range at an evicted one, close it at a kept one.
std::vector<PositionRange> brute_evicted(const std::vector<std::int64_t>& keep, std::int64_t tokens) {
  std::vector<bool> kept(static_cast<std::size_t>(tokens), false);
  for (const auto p : keep) kept[std::size_t(p)] = true;
  std::vector<PositionRange> out;
  bool open = false;
  for (std::int64_t t = 0; t < tokens; ++t) {
    if (!kept[std::size_t(t)] && !open) {
      out.push_back({t, t + 1});
      open = true;
    } else if (!kept[std::size_t(t)]) {
      out.back().end = t + 1;
    } else {
      open = false;
    }
  }
  return out;
}

Selection selection_of(const std::vector<std::vector<std::int64_t>>& heads, std::int64_t tokens) {
  Selection s;
  s.heads = std::int64_t(heads.size());
  s.tokens = tokens;
  for (const auto& h : heads) {
    s.positions.insert(s.positions.end(), h.begin(), h.end());
    s.offsets.push_back(std::int64_t(s.positions.size()));
  }
  return s;
}

}  // namespace

TEST_CASE("evicted ranges: random keep lists vs brute force - empty, full, alternating", "[slots]") {
  std::mt19937_64 rng(31);
  for (int iter = 0; iter < 2000; ++iter) {
    const std::int64_t N = std::int64_t(rng() % 50);
    const auto keep = random_keep(N, rng);
    const auto got = kvscore::evicted_ranges(keep, N);
    REQUIRE(got == brute_evicted(keep, N));
    // maximal: ranges are non-empty, ascending, separated by at least one kept position
    for (std::size_t i = 0; i < got.size(); ++i) {
      REQUIRE(got[i].size() > 0);
      if (i > 0) REQUIRE(got[i].begin > got[i - 1].end);
    }
  }
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{}, 7) == std::vector<PositionRange>{{0, 7}});
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{}, 0).empty());
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{0, 1, 2, 3}, 4).empty());
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{0, 2, 4}, 6) ==
          std::vector<PositionRange>{{1, 2}, {3, 4}, {5, 6}});
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{1, 3}, 5) ==
          std::vector<PositionRange>{{0, 1}, {2, 3}, {4, 5}});
  REQUIRE(kvscore::evicted_ranges(std::vector<std::int64_t>{2, 3, 4}, 9) ==
          std::vector<PositionRange>{{0, 2}, {5, 9}});
}

TEST_CASE("evicted ranges of each head of a selection - union of heads and layers", "[slots]") {
  std::mt19937_64 rng(32);
  for (int iter = 0; iter < 300; ++iter) {
    const std::int64_t N = std::int64_t(rng() % 40), H = 1 + std::int64_t(rng() % 5);
    std::vector<std::vector<std::int64_t>> heads;
    std::set<std::int64_t> all;
    for (std::int64_t h = 0; h < H; ++h) {
      heads.push_back(random_keep(N, rng));
      all.insert(heads.back().begin(), heads.back().end());
    }
    const Selection s = selection_of(heads, N);
    for (std::int64_t h = 0; h < H; ++h) REQUIRE(kvscore::evicted_ranges(s, h) == brute_evicted(heads[std::size_t(h)], N));
    const auto u = kvscore::union_heads(s);
    REQUIRE(u == std::vector<std::int64_t>(all.begin(), all.end()));
    const Selection shared = kvscore::shared_selection(s);
    REQUIRE(shared.heads == H);
    REQUIRE(shared.tokens == N);
    for (std::int64_t h = 0; h < H; ++h) {
      const auto row = shared.head(h);
      REQUIRE(std::vector<std::int64_t>(row.begin(), row.end()) == u);
    }
    // several layers: union over all of them
    const Selection other = selection_of({random_keep(N, rng)}, N);
    std::set<std::int64_t> both = all;
    both.insert(other.positions.begin(), other.positions.end());
    const std::vector<Selection> layers{s, other};
    REQUIRE(kvscore::union_heads(std::span<const Selection>(layers)) == std::vector<std::int64_t>(both.begin(), both.end()));
  }
  REQUIRE(kvscore::union_heads(std::span<const Selection>()).empty());
}

TEST_CASE("llama.cpp: evicted position ranges from kept cells and the cell -> pos table", "[slots]") {
  std::mt19937_64 rng(33);
  for (int iter = 0; iter < 1000; ++iter) {
    const std::int64_t cells = std::int64_t(rng() % 40);
    // some cells belong to the sequence (distinct positions, in any order), others are empty (-1)
    std::vector<std::int64_t> pos_pool(static_cast<std::size_t>(2 * cells + 1));
    std::iota(pos_pool.begin(), pos_pool.end(), 0);
    std::shuffle(pos_pool.begin(), pos_pool.end(), rng);
    std::vector<std::int32_t> cell_pos(static_cast<std::size_t>(cells));
    for (std::int64_t c = 0; c < cells; ++c) cell_pos[std::size_t(c)] = rng() % 4 == 0 ? -1 : std::int32_t(pos_pool[std::size_t(c)]);
    const auto kept_cells = random_keep(cells, rng);
    const auto ranges = kvscore::evicted_position_ranges(kept_cells, cell_pos);
    const std::vector<std::int64_t> cell_pos64(cell_pos.begin(), cell_pos.end());
    REQUIRE(kvscore::evicted_position_ranges(kept_cells, cell_pos64) == ranges);

    // brute force over position space: status of every position 0..2*cells
    std::vector<int> status(pos_pool.size(), 0);  // 0 none, 1 kept, 2 evicted
    for (std::int64_t c = 0; c < cells; ++c) {
      if (cell_pos[std::size_t(c)] < 0) continue;
      const bool kept = std::binary_search(kept_cells.begin(), kept_cells.end(), c);
      status[std::size_t(cell_pos[std::size_t(c)])] = kept ? 1 : 2;
    }
    std::vector<PositionRange> expect;
    bool open = false;
    for (std::int64_t p = 0; p < std::int64_t(status.size()); ++p) {
      if (status[std::size_t(p)] == 2) {
        if (open) expect.back().end = p + 1;
        else expect.push_back({p, p + 1});
        open = true;
      } else if (status[std::size_t(p)] == 1) {
        open = false;
      }
    }
    REQUIRE(ranges == expect);
    // applying them as seq_rm removes exactly the evicted cells of the sequence
    for (std::int64_t c = 0; c < cells; ++c) {
      const std::int32_t p = cell_pos[std::size_t(c)];
      if (p < 0) continue;
      const bool removed = std::any_of(ranges.begin(), ranges.end(), [&](const PositionRange& r) { return p >= r.begin && p < r.end; });
      REQUIRE(removed == !std::binary_search(kept_cells.begin(), kept_cells.end(), c));
    }
  }
  // cells are slots: cell order is not position order
  const std::vector<std::int32_t> cell_pos{3, 0, -1, 1, 2, 5, 4};
  const std::vector<std::int64_t> kept{1, 4};  // positions 0 and 2
  REQUIRE(kvscore::evicted_position_ranges(kept, cell_pos) == std::vector<PositionRange>{{1, 2}, {3, 6}});
  const std::vector<std::int32_t> dup{3, 0, 3};
  CHECK_THAT(error_of([&] { kvscore::evicted_position_ranges(std::vector<std::int64_t>{1}, dup); }),
             Catch::Contains("position 3") && Catch::Contains("two cells"));
}

TEST_CASE("SGLang: partition a request's slot table into kept and freed slots", "[slots]") {
  std::mt19937_64 rng(34);
  for (int iter = 0; iter < 300; ++iter) {
    const std::int64_t N = std::int64_t(rng() % 40);
    std::vector<std::int32_t> table(static_cast<std::size_t>(N));
    for (auto& s : table) s = std::int32_t(rng() % 100000);
    const auto keep = random_keep(N, rng);
    const auto part = kvscore::partition_slots(table, keep);
    std::vector<std::int32_t> ek, ef;
    for (std::int64_t t = 0; t < N; ++t)
      (std::binary_search(keep.begin(), keep.end(), t) ? ek : ef).push_back(table[std::size_t(t)]);
    REQUIRE(part.kept == ek);
    REQUIRE(part.freed == ef);
    const std::vector<std::int64_t> table64(table.begin(), table.end());
    const auto part64 = kvscore::partition_slots(table64, keep);
    REQUIRE(part64.kept == std::vector<std::int64_t>(ek.begin(), ek.end()));
    REQUIRE(part64.freed == std::vector<std::int64_t>(ef.begin(), ef.end()));
  }
}

TEST_CASE("slots: bad inputs throw std::invalid_argument naming the value", "[slots][errors]") {
  const std::vector<std::int64_t> desc{3, 2}, out{1, 9}, neg{-1};
  CHECK_THAT(error_of([&] { kvscore::evicted_ranges(desc, 5); }), Catch::Contains("2 after 3"));
  CHECK_THAT(error_of([&] { kvscore::evicted_ranges(out, 5); }), Catch::Contains("kept[1] = 9") && Catch::Contains("[0, 5)"));
  CHECK_THAT(error_of([&] { kvscore::evicted_ranges(neg, 5); }), Catch::Contains("-1"));
  CHECK_THAT(error_of([&] { kvscore::evicted_ranges(std::vector<std::int64_t>{}, -3); }), Catch::Contains("-3"));
  const Selection s = selection_of({{0, 1}, {2}}, 4);
  CHECK_THAT(error_of([&] { kvscore::evicted_ranges(s, 2); }), Catch::Contains("head 2") && Catch::Contains("[0, 2)"));
  Selection bad = s;
  bad.positions[2] = 4;
  CHECK_THAT(error_of([&] { kvscore::union_heads(bad); }), Catch::Contains("position 4"));
  const std::vector<Selection> layers{s, selection_of({{0}}, 5)};
  CHECK_THAT(error_of([&] { kvscore::union_heads(std::span<const Selection>(layers)); }),
             Catch::Contains("selection 1 has 5 tokens"));
  CHECK_THAT(error_of([&] { kvscore::broadcast_selection(out, 2, 5); }), Catch::Contains("9"));
  CHECK_THAT(error_of([&] { kvscore::broadcast_selection(std::vector<std::int64_t>{1}, -2, 5); }), Catch::Contains("-2"));
  const std::vector<std::int32_t> table{7, 8, 9};
  CHECK_THAT(error_of([&] { kvscore::partition_slots(table, std::vector<std::int64_t>{3}); }),
             Catch::Contains("kept[0] = 3") && Catch::Contains("[0, 3)"));
  const std::vector<std::int32_t> cell_pos{0, 1};
  CHECK_THAT(error_of([&] { kvscore::evicted_position_ranges(std::vector<std::int64_t>{2}, cell_pos); }),
             Catch::Contains("kept[0] = 2"));
}
