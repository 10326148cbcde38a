// Score -> select -> compact a token-major bf16 cache [tokens, kv_heads, head_dim]
// (SGLang's slot pool row layout, llama.cpp's K cells), in two ways:
//   1. move the data: every head keeps n rows (Budget::per_head), compacted in place;
//   2. llama.cpp: no data movement: union the heads' keep lists and print the seq_rm ranges.
// Exit 0 only if every check passes.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <kvscore/compact.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/select.hpp>
#include <kvscore/slots.hpp>

int main() {
  using kvscore::bfloat16;
  const std::int64_t tokens = 600, kv_heads = 4, head_dim = 64, keep = 150;

  std::vector<bfloat16> k(std::size_t(tokens * kv_heads * head_dim)), v(k.size());
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.f, 1.f);
  for (auto& x : k) x = kvscore::from_float<bfloat16>(g(rng) + 1.0f);
  for (auto& x : v) x = kvscore::from_float<bfloat16>(g(rng));
  const std::vector<bfloat16> k0 = k, v0 = v;

  const auto kv = kvscore::MutKeysView<bfloat16>::token_major(k.data(), tokens, kv_heads, head_dim);
  const auto vv = kvscore::MutKeysView<bfloat16>::token_major(v.data(), tokens, kv_heads, head_dim);
  const kvscore::Scores scores = kvscore::ManifoldL2{}.score(kv.view());
  const kvscore::Selection sel = kvscore::select(scores, kvscore::Budget::per_head(keep));

  // 2 (computed first, from the same selection): llama.cpp removes a cell for every head and
  // layer, so the sequence keeps the union of the heads' positions.
  const std::vector<std::int64_t> kept_union = kvscore::union_heads(sel);
  const auto ranges = kvscore::evicted_ranges(kept_union, tokens);
  std::int64_t evicted = 0;
  for (const auto& r : ranges) evicted += r.size();
  bool ok = evicted + std::int64_t(kept_union.size()) == tokens;
  std::printf("llama.cpp path: union of %lld heads keeps %zu of %lld cells; %zu seq_rm ranges, e.g. [%lld, %lld)\n",
              (long long)kv_heads, kept_union.size(), (long long)tokens, ranges.size(),
              ranges.empty() ? 0LL : (long long)ranges[0].begin, ranges.empty() ? 0LL : (long long)ranges[0].end);

  // 1: compact in place. Heads keep different positions but the same count, so token rows
  // [0, keep) are valid for every head and the cache length becomes `keep`.
  kvscore::CompactOptions opts;
  opts.require_equal_lengths = true;
  opts.tail = kvscore::CompactTail::zero;
  const std::vector<std::int64_t> len = kvscore::compact(kv, vv, sel, opts);

  const std::size_t row_bytes = std::size_t(head_dim) * sizeof(bfloat16);
  auto at = [&](std::int64_t t, std::int64_t h) { return std::size_t((t * kv_heads + h) * head_dim); };
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    ok = ok && len[std::size_t(h)] == keep;
    const auto pos = sel.head(h);
    for (std::size_t i = 0; i < pos.size(); ++i) {
      ok = ok && std::memcmp(&k[at(std::int64_t(i), h)], &k0[at(pos[i], h)], row_bytes) == 0;
      ok = ok && std::memcmp(&v[at(std::int64_t(i), h)], &v0[at(pos[i], h)], row_bytes) == 0;
    }
    for (std::int64_t t = keep; t < tokens; ++t)  // tails zero-filled
      for (std::int64_t j = 0; j < head_dim; ++j) ok = ok && k[at(t, h) + std::size_t(j)].bits == 0;
  }
  const double saved = double((tokens - keep) * kv_heads * head_dim * 2) * sizeof(bfloat16);
  std::printf("token-major bf16 [%lld, %lld, %lld]: kept %lld tokens per head, %.1f KiB of K+V freed (%.0f%%)\n",
              (long long)tokens, (long long)kv_heads, (long long)head_dim, (long long)keep, saved / 1024.0,
              100.0 * double(tokens - keep) / double(tokens));
  std::printf("%s\n", ok ? "kept rows match the original rows at the kept positions" : "MISMATCH");
  return ok ? 0 : 1;
}
