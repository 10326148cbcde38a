// Score -> select -> compact one layer of a Hugging Face static fp16 cache
// [batch, kv_heads, capacity, head_dim] (seq tokens filled) for one batch row, in place.
// Checks that every head's first n rows of K and V are the original rows at the kept
// positions and that the other batch row is untouched. Exit 0 only if every check passes.
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include <kvscore/compact.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/select.hpp>

int main() {
  using kvscore::half;
  const std::int64_t batch = 2, kv_heads = 8, seq = 1000, capacity = 1024, head_dim = 128, b = 1;
  const std::int64_t keep = 256;  // per head

  std::vector<half> k(std::size_t(batch * kv_heads * capacity * head_dim));
  std::vector<half> v(k.size());
  std::mt19937 rng(7);
  std::normal_distribution<float> g(0.f, 1.f);
  for (auto& x : k) x = kvscore::from_float<half>(g(rng) + 0.5f);
  for (auto& x : v) x = kvscore::from_float<half>(g(rng));
  const std::vector<half> k0 = k, v0 = v;

  // views of batch row b (the first `seq` of `capacity` rows of each head)
  const auto kv = kvscore::MutKeysView<half>::hf(k.data(), b, batch, kv_heads, seq, head_dim, capacity);
  const auto vv = kvscore::MutKeysView<half>::hf(v.data(), b, batch, kv_heads, seq, head_dim, capacity);

  const kvscore::Scores scores = kvscore::ManifoldL2{}.score(kv.view());
  kvscore::SelectOptions opts;
  opts.sinks = 4;    // attention sinks and the recent window are always kept
  opts.recent = 32;
  const kvscore::Selection sel = kvscore::select(scores, kvscore::Budget::per_head(keep), opts);

  kvscore::CompactOptions copts;
  copts.require_equal_lengths = true;  // HF caches have one length per layer
  const std::vector<std::int64_t> len = kvscore::compact(kv, vv, sel, copts);

  bool ok = true;
  auto at = [&](std::int64_t bb, std::int64_t h, std::int64_t t) {
    return std::size_t(((bb * kv_heads + h) * capacity + t) * head_dim);
  };
  const std::size_t row_bytes = std::size_t(head_dim) * sizeof(half);
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    ok = ok && len[std::size_t(h)] == keep;
    const auto pos = sel.head(h);
    for (std::size_t i = 0; i < pos.size(); ++i) {
      ok = ok && std::memcmp(&k[at(b, h, std::int64_t(i))], &k0[at(b, h, pos[i])], row_bytes) == 0;
      ok = ok && std::memcmp(&v[at(b, h, std::int64_t(i))], &v0[at(b, h, pos[i])], row_bytes) == 0;
    }
    ok = ok && pos.size() >= 4 && pos[0] == 0 && pos[3] == 3 && pos.back() == seq - 1;  // sinks and recent kept
  }
  // batch row 0 is not part of the view: untouched
  ok = ok && std::memcmp(k.data(), k0.data(), std::size_t(kv_heads * capacity) * row_bytes) == 0;
  ok = ok && std::memcmp(v.data(), v0.data(), std::size_t(kv_heads * capacity) * row_bytes) == 0;

  const double saved = double((seq - keep) * kv_heads * head_dim * 2) * sizeof(half);  // K and V
  std::printf("HF fp16 [%lld, %lld, %lld/%lld, %lld], batch row %lld: kept %lld of %lld tokens per head; "
              "new length %lld; %.1f KiB of K+V freed in this layer (%.0f%%)\n",
              (long long)batch, (long long)kv_heads, (long long)seq, (long long)capacity, (long long)head_dim,
              (long long)b, (long long)keep, (long long)seq, (long long)len[0], saved / 1024.0,
              100.0 * double(seq - keep) / double(seq));
  std::printf("%s\n", ok ? "kept rows match the original rows at the kept positions" : "MISMATCH");
  return ok ? 0 : 1;
}
