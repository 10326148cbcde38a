// Score -> select -> compact one sequence of a vLLM-style paged fp16 cache
// [num_blocks, block_size, kv_heads, head_dim] (NHD) shared with another sequence.
// The scorer reads the blocks in place (PagedKeysView); the kept rows are gathered to the
// front of the sequence's own blocks, and the blocks past the new length go back to the
// allocator. Checks the kept rows and that the other sequence's blocks are untouched.
// Exit 0 only if every check passes.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include <kvscore/compact.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/paged.hpp>
#include <kvscore/select.hpp>

int main() {
  using kvscore::half;
  const std::int64_t num_blocks = 96, block_size = 16, kv_heads = 4, head_dim = 64;
  const std::int64_t seq_a = 700, seq_b = 300, keep = 200;

  std::vector<half> k(std::size_t(num_blocks * block_size * kv_heads * head_dim)), v(k.size());
  std::mt19937 rng(5);
  std::normal_distribution<float> g(0.f, 1.f);
  for (auto& x : k) x = kvscore::from_float<half>(g(rng) + 0.5f);
  for (auto& x : v) x = kvscore::from_float<half>(g(rng));
  const std::vector<half> k0 = k, v0 = v;

  // the allocator handed out blocks in no particular order; vLLM block tables are int32
  std::vector<std::int32_t> free_blocks(static_cast<std::size_t>(num_blocks));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);
  const std::int64_t nb_a = kvscore::blocks_for(seq_a, block_size), nb_b = kvscore::blocks_for(seq_b, block_size);
  std::vector<std::int32_t> table_a(free_blocks.begin(), free_blocks.begin() + nb_a);
  const std::vector<std::int32_t> table_b(free_blocks.begin() + nb_a, free_blocks.begin() + nb_a + nb_b);

  const kvscore::BlockTable bt(table_a, block_size, num_blocks, seq_a);
  const auto kv = kvscore::MutPagedKeysView<half>::nhd(k.data(), kv_heads, head_dim, bt);
  const auto vv = kvscore::MutPagedKeysView<half>::nhd(v.data(), kv_heads, head_dim, bt);

  const kvscore::Scores scores = kvscore::ManifoldL2{}.score(kv.view());  // reads the blocks in place
  const kvscore::Selection sel = kvscore::select(scores, kvscore::Budget::per_head(keep));
  const kvscore::PhysicalSlots slots = kvscore::physical_slots(kv.view(), sel);  // for an engine-side gather
  const kvscore::PhysicalSlot first = slots.head(0)[0];
  std::printf("head 0 keeps position %lld first: block %lld, offset %lld (vLLM slot %lld)\n",
              (long long)sel.head(0)[0], (long long)first.block, (long long)first.offset,
              (long long)first.linear(block_size));

  kvscore::CompactOptions opts;
  opts.require_equal_lengths = true;  // vLLM has one length per sequence
  const std::vector<std::int64_t> len = kvscore::compact(kv, vv, sel, opts);
  const std::int64_t nb_new = kvscore::blocks_for(len[0], block_size);

  // checks, through an independent index computation
  const std::size_t row_bytes = std::size_t(head_dim) * sizeof(half);
  auto at = [&](std::int64_t h, std::int64_t t) {
    const std::int64_t blk = table_a[std::size_t(t / block_size)];
    return std::size_t(((blk * block_size + t % block_size) * kv_heads + h) * head_dim);
  };
  bool ok = true;
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    ok = ok && len[std::size_t(h)] == keep;
    const auto pos = sel.head(h);
    for (std::size_t i = 0; i < pos.size(); ++i) {
      ok = ok && std::memcmp(&k[at(h, std::int64_t(i))], &k0[at(h, pos[i])], row_bytes) == 0;
      ok = ok && std::memcmp(&v[at(h, std::int64_t(i))], &v0[at(h, pos[i])], row_bytes) == 0;
    }
  }
  const std::size_t block_elems = std::size_t(block_size * kv_heads * head_dim);
  for (const std::int32_t blk : table_b) {  // the other sequence's blocks
    ok = ok && std::memcmp(&k[std::size_t(blk) * block_elems], &k0[std::size_t(blk) * block_elems],
                           block_elems * sizeof(half)) == 0;
    ok = ok && std::memcmp(&v[std::size_t(blk) * block_elems], &v0[std::size_t(blk) * block_elems],
                           block_elems * sizeof(half)) == 0;
  }

  // the engine frees table_a[nb_new..nb_a) and sets the sequence length to len[0]
  const double saved = double((nb_a - nb_new) * std::int64_t(block_elems) * 2) * sizeof(half);
  table_a.resize(std::size_t(nb_new));
  std::printf("paged fp16 NHD (block_size %lld): %lld -> %lld tokens, %lld -> %lld blocks; "
              "%.1f KiB of K+V returned to the allocator\n",
              (long long)block_size, (long long)seq_a, (long long)len[0], (long long)nb_a, (long long)nb_new,
              saved / 1024.0);
  std::printf("%s\n", ok ? "kept rows match the original rows; the other sequence is untouched" : "MISMATCH");
  return ok ? 0 : 1;
}
