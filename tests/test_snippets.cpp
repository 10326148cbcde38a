// The code the documentation shows, compiled and run (CUB's habit): every C++ example of README.md,
// docs/**/*.md and the header comments is a region of this file,
//   // [snippet NAME]
//   ...
//   // [snippet end]
// and tests/test_tree.cpp checks that each copy (`<!-- snippet NAME -->` before a ```cpp block in
// a doc page; `// [snippet NAME]` before the `//   ` example lines of a header) equals its region
// line for line. So an example that no longer compiles, or that drifted from its region, fails
// the build or the tests. Each test case sets up the names its region uses, then checks what it
// computed.
#include <catch2/catch.hpp>

#include <kvscore/compact.hpp>
#include <kvscore/kvscore.hpp>
#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/paged.hpp>
#include <kvscore/select.hpp>
#include <kvscore/synth.hpp>

#include <cstdint>
#include <numeric>
#include <vector>

#include "test_support.hpp"

namespace {

using test_support::convert_to;
using test_support::randn;

/// Keys [kv_heads][tokens][head_dim] with some structure (a shared direction), as T.
template <class T>
std::vector<T> layer(std::int64_t kv_heads, std::int64_t tokens, std::int64_t head_dim, std::uint32_t seed) {
  std::vector<float> v = randn(std::size_t(kv_heads * tokens * head_dim), seed);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] += 0.5f * float(i % std::size_t(head_dim) < 4);
  return convert_to<T>(v);
}

}  // namespace

TEST_CASE("snippet quickstart (README): score an HF layer, select 512 per head", "[snippets]") {
  const std::int64_t batch = 2, kv_heads = 4, seq = 1000, head_dim = 64;
  const std::vector<kvscore::half> cache = layer<kvscore::half>(batch * kv_heads, seq, head_dim, 1);
  const kvscore::half* layer_ptr = cache.data();
  // [snippet quickstart]
  // one layer of an HF cache: kvscore::half keys[batch][kv_heads][seq][head_dim], read in place
  auto keys = kvscore::KeysView<kvscore::half>::hf(layer_ptr, /*batch_index*/ 0, batch, kv_heads, seq, head_dim);
  kvscore::Scores s = kvscore::ManifoldL2{}.score(keys);  // fp32 [kv_heads][seq], higher = keep

  kvscore::SelectOptions opt;                             // keep 512 tokens per head,
  opt.sinks = 4;                                          // the first 4 always
  opt.recent = 64;                                        // and the last 64
  kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(512), opt);  // ascending per head
  // then kvscore::compact gathers the kept rows of K and V in place
  // [snippet end]
  REQUIRE(sel.heads == kv_heads);
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    const auto p = sel.head(h);
    REQUIRE(p.size() == 512);
    CHECK(p[0] == 0);
    CHECK(p[3] == 3);
    CHECK(p.back() == seq - 1);
  }
}

TEST_CASE("snippet select (docs/reference/select.md, select.hpp): per-head and AdaKV budgets", "[snippets]") {
  const std::vector<float> k = layer<float>(4, 300, 32, 2);
  const kvscore::KeysView<float> keys(k.data(), 4, 300, 32, 300 * 32, 32);
  // [snippet select]
  kvscore::Scores s = kvscore::KNorm{}.score(keys);                    // [H][N]
  std::int64_t n = kvscore::budget_from_ratio(s.tokens(), 0.25);      // keep 25 % per head

  kvscore::Selection a = kvscore::select(s, kvscore::Budget::per_head(n));   // top-n per head

  kvscore::SelectOptions o;
  o.sinks = 4;                      // always keep the first 4 tokens ...
  o.recent = 64;                    // ... and the last 64 (inside the budget)
  o.alloc = kvscore::Alloc::adakv;  // ragged heads: safeguard + one global top-k
  o.normalize = true;               // z-normalise each head before the global step
  kvscore::Selection b = kvscore::select(s, kvscore::Budget::per_head(n), o);   // layer keeps n*H
  std::int64_t kept = 0;
  for (std::int64_t h = 0; h < b.heads; ++h)
    for (std::int64_t t : b.head(h)) kept += t >= 0;  // keep token t of head h
  // [snippet end]
  CHECK(n == 75);
  CHECK(a.total() == 4 * 75);
  CHECK(kept == 4 * 75);

  const kvscore::Scores& scores = s;
  // [snippet select-header]
  kvscore::Selection top = kvscore::select(scores, kvscore::Budget::per_head(n));   // top-n per head
  kvscore::SelectOptions p;
  p.sinks = 4, p.recent = 64, p.alloc = kvscore::Alloc::adakv;                      // AdaKV, protected
  kvscore::Selection ragged = kvscore::select(scores, kvscore::Budget::per_head(n), p);  // ragged heads
  // [snippet end]
  CHECK(top.positions == a.positions);
  CHECK(ragged.total() == 4 * 75);
}

TEST_CASE("snippet scorers-by-name (docs/reference/scorers.md, make_scorer.hpp): a scorer from the registry", "[snippets]") {
  const std::vector<float> k = layer<float>(8, 600, 128, 3);
  const kvscore::KeysView<float> keys(k.data(), 8, 600, 128, 600 * 128, 128);
  const std::vector<float> queries = randn(std::size_t(32 * 64 * 128), 4);
  const float* q = queries.data();
  // [snippet scorers-by-name]
  kvscore::ScorerArgs a;                       // each scorer reads its fields, ignores the rest
  a.queries = q; a.q_heads = 32; a.n_queries = 64; a.head_dim = 128;  // snapkv, protokv
  const kvscore::AnyScorer s = kvscore::make_scorer("snapkv", a);
  kvscore::SelectOptions so;
  so.recent = s.protected_recent();
  const kvscore::Selection kept = kvscore::select(s.score(keys), kvscore::Budget::per_head(512), so);
  // [snippet end]
  CHECK(kept.total() == 8 * 512);
  CHECK(kept.head(0).back() == 599);  // the window is protected

  const kvscore::Budget budget = kvscore::Budget::per_head(100);
  using namespace kvscore;
  // [snippet make-scorer-header]
  ScorerArgs args;  args.queries = q;  args.q_heads = 32;  args.n_queries = 64;  args.head_dim = 128;
  const AnyScorer snap = make_scorer("snapkv", args);      // any spelling kMethods accepts
  Scores scores = snap.score(keys);                         // fp32, fp16 or bf16 keys
  Selection top = select(scores, budget, {.recent = snap.protected_recent()});
  // [snippet end]
  CHECK(top.total() == 8 * 100);
}

TEST_CASE("snippet compaction (docs/reference/compaction.md): select, then gather K and V in place", "[snippets]") {
  const std::int64_t batch = 2, kv_heads = 2, seq = 100, head_dim = 16, capacity = 128, b = 1, n = 40;
  std::vector<kvscore::half> k_buf = layer<kvscore::half>(batch * kv_heads, capacity, head_dim, 5);
  std::vector<kvscore::half> v_buf = layer<kvscore::half>(batch * kv_heads, capacity, head_dim, 6);
  const std::vector<kvscore::half> v_before = v_buf;
  kvscore::half* k_layer = k_buf.data();
  kvscore::half* v_layer = v_buf.data();
  // [snippet compaction]
  // writable views of one layer's K and V (same constructors and checks as KeysView)
  auto k = kvscore::MutKeysView<kvscore::half>::hf(k_layer, b, batch, kv_heads, seq, head_dim, capacity);
  auto v = kvscore::MutKeysView<kvscore::half>::hf(v_layer, b, batch, kv_heads, seq, head_dim, capacity);

  kvscore::Scores s = kvscore::ManifoldL2{}.score(k.view());          // k.view(): the read-only KeysView
  kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(n));
  std::vector<std::int64_t> len = kvscore::compact(k, v, sel);         // len[h] = sel.kept(h)
  // [snippet end]
  REQUIRE(len == std::vector<std::int64_t>{n, n});
  for (std::int64_t h = 0; h < kv_heads; ++h)  // row i of head h now holds the i-th kept row
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t t = sel.head(h)[std::size_t(i)];
      const std::size_t at = std::size_t(((b * kv_heads + h) * capacity) * head_dim);
      CHECK(v_buf[at + std::size_t(i * head_dim)].bits == v_before[at + std::size_t(t * head_dim)].bits);
    }
}

TEST_CASE("snippet paged (docs/reference/paged.md): score a vLLM block pool, its slots, compact it", "[snippets]") {
  const std::int64_t kv_heads = 2, head_dim = 16, block_size = 16, num_blocks = 12, seq_len = 70, n = 32, h = 1;
  std::vector<kvscore::half> k_buf = layer<kvscore::half>(num_blocks * block_size, kv_heads, head_dim, 7);
  std::vector<kvscore::half> v_buf = layer<kvscore::half>(num_blocks * block_size, kv_heads, head_dim, 8);
  kvscore::half* k_pool = k_buf.data();
  kvscore::half* v_pool = v_buf.data();
  const std::vector<std::int32_t> block_table_row = {7, 2, 9, 0, 5};
  // [snippet paged-view]
  // vLLM: pool [num_blocks, block_size, kv_heads, head_dim] (NHD), int32 block table row
  kvscore::BlockTable bt(block_table_row, block_size, num_blocks, seq_len);
  auto keys = kvscore::PagedKeysView<kvscore::half>::nhd(k_pool, kv_heads, head_dim, bt);
  kvscore::Scores s = kvscore::ManifoldL2{}.score(keys);   // every scorer reads paged views
  // [snippet end]
  CHECK(s.tokens() == seq_len);
  const kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(n));
  // [snippet paged-slots]
  kvscore::PhysicalSlots ps = kvscore::physical_slots(keys, sel);  // or physical_slots(table, sel)
  for (kvscore::PhysicalSlot s : ps.head(h)) { /* s.block, s.offset */ CHECK(s.offset < block_size); }
  std::vector<std::int64_t> m = ps.slot_mapping(h);                 // vLLM flat slots: block*block_size + offset
  // [snippet end]
  const std::int64_t t0 = sel.head(h)[0];
  CHECK(m[0] == block_table_row[std::size_t(t0 / block_size)] * block_size + t0 % block_size);
  // [snippet paged-compact]
  auto k = kvscore::MutPagedKeysView<kvscore::half>::nhd(k_pool, kv_heads, head_dim, bt);
  auto v = kvscore::MutPagedKeysView<kvscore::half>::nhd(v_pool, kv_heads, head_dim, bt);
  kvscore::Selection kept = kvscore::select(kvscore::ManifoldL2{}.score(k.view()), kvscore::Budget::per_head(n));
  kvscore::CompactOptions o;
  o.require_equal_lengths = true;                       // vLLM: one length per sequence
  auto len = kvscore::compact(k, v, kept, o);           // logical rows [0, n) now hold the kept rows
  std::int64_t keep_blocks = kvscore::blocks_for(n, block_size);
  // engine: free block_table[keep_blocks .. old count), set the sequence length to n
  // [snippet end]
  CHECK(len == std::vector<std::int64_t>{n, n});
  CHECK(keep_blocks == 2);
  CHECK(kept.positions == sel.positions);
}

TEST_CASE("snippet paged-vllm-cpu (docs/reference/paged.md): vLLM CPU's transposed keys scored in place", "[snippets]") {
  const std::int64_t kv_heads = 3, head_dim = 16, block_size = 32, num_blocks = 6, tokens = 70;
  // keys[h][t][j], written into vLLM CPU's layer [num_blocks][kv_heads][block_size][2 * head_dim]
  // with the keys of each (block, head) transposed, at the blocks of the table
  const std::vector<float> flat = layer<float>(kv_heads, tokens, head_dim, 9);
  const std::vector<std::int32_t> ids = {4, 1, 3};
  std::vector<float> pool(std::size_t(num_blocks * kv_heads * block_size * 2 * head_dim), 0.f);
  for (std::int64_t h = 0; h < kv_heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t j = 0; j < head_dim; ++j)
        pool[std::size_t((ids[std::size_t(t / block_size)] * kv_heads + h) * 2 * block_size * head_dim +
                         j * block_size + t % block_size)] = flat[std::size_t((h * tokens + t) * head_dim + j)];
  const float* kv_cache_layer = pool.data();
  std::span<const std::int32_t> block_ids(ids);
  // [snippet paged-vllm-cpu]
  kvscore::BlockTable t(block_ids, block_size, num_blocks, tokens);
  auto keys = kvscore::TransposedPagedKeysView<float>::vllm_cpu(kv_cache_layer, kv_heads, head_dim, t);
  kvscore::Scores s = kvscore::KeyDiff{}.score(keys);      // any scorer: a KeyCacheView
  // [snippet end]
  const kvscore::Scores ref = kvscore::KeyDiff{}.score(kvscore::KeysView<float>::hf(flat.data(), 0, 1, kv_heads, tokens, head_dim));
  REQUIRE(s.values().size() == ref.values().size());
  for (std::size_t i = 0; i < s.values().size(); ++i) CHECK(s.values()[i] == Approx(ref.values()[i]).epsilon(1e-5));
}

TEST_CASE("snippet pariskv (docs/methods/pariskv.md, pariskv.hpp): the index, a retriever, the decode cache", "[snippets]") {
  const std::int64_t head_dim = 64, n_prefill = 600, row_stride = head_dim, N = 900, n = 128, max_tokens = 1000;
  const std::vector<kvscore::half> k_all = layer<kvscore::half>(1, max_tokens, head_dim, 9);
  const std::vector<kvscore::half> v_all = layer<kvscore::half>(1, max_tokens, head_dim, 10);
  const std::vector<float> query = randn(std::size_t(head_dim), 11);
  const kvscore::half* keys_of_head = k_all.data();
  const float* q = query.data();
  // [snippet pariskv-index]
  kvscore::ParisKV index(head_dim);                       // m = 8, fixed seed, converged codebook
  index.append(keys_of_head, n_prefill, row_stride);      // fp32 / fp16 / bf16 rows, or append(view, h)
  // ... decoding: index.append(new_keys, n_new, row_stride) with any number of keys at a time
  kvscore::ParisKV::Workspace ws;                         // one per thread, reused (no hot-path allocation)
  kvscore::ParisKVResult r;
  kvscore::ParisKVSearch opt;                             // k = 100, length-adaptive beta/rho
  index.search(q, opt, ws, r);                            // the paper's pipeline
  opt.rerank_exact = 300;                                 // keys resident: rescore the best 3k exactly
  index.search(q, opt, keys_of_head, row_stride, ws, r);
  // r.positions: ascending; r.scores[i]: estimated (or, with rerank_exact, exact) <k, q>
  // [snippet end]
  REQUIRE(r.positions.size() == 100);
  CHECK(std::is_sorted(r.positions.begin(), r.positions.end()));
  {
    const std::int64_t n = n_prefill;
    // [snippet pariskv-header]
    kvscore::ParisKV index(head_dim);              // m = 8, fixed seed, converged Lloyd–Max codebook
    index.append(keys_of_head, n, row_stride);     // prefill, then any number of decoded keys at a time
    kvscore::ParisKVResult r = index.search(q);    // top-100 positions (ascending) + estimated scores
    // [snippet end]
    CHECK(r.positions.size() == 100);
  }

  const kvscore::half* keys = k_all.data();
  const kvscore::half* values = v_all.data();
  {
    // [snippet pariskv-retriever]
    kvscore::RetrieverArgs a;
    a.budget = n;  // positions per query: exactly min(n, N), never dense
    kvscore::ParisKVCache<kvscore::half> r = kvscore::make_retriever<kvscore::half>("pariskv", head_dim, a);
    r.append(keys, values, N);  // U = 1: every token beyond the local window is indexed now
    const std::vector<std::int64_t> pos = r.select(q);
    // [snippet end]
    CHECK(std::int64_t(pos.size()) == n);
  }

  const kvscore::half* prompt_k = keys;
  const kvscore::half* prompt_v = values;
  const std::int64_t prompt_len = 800, steps = max_tokens - prompt_len;
  std::vector<float> out(static_cast<std::size_t>(head_dim));
  kvscore::ParisKVCache<kvscore::half>::Workspace cws;
  std::int64_t step = 0;
  // [snippet pariskv-cache]
  kvscore::ParisKVCache<kvscore::half> cache(head_dim);  // the defaults below
  cache.reserve(max_tokens);                             // appends never move the cache
  cache.append(prompt_k, prompt_v, prompt_len);          // prefill: indexes [S, N − L) at once
  for (; step < steps; ++step) {                         // one decode step
    const kvscore::half *k = keys + (prompt_len + step) * head_dim, *v = values + (prompt_len + step) * head_dim;
    cache.append(k, v);                                  // every U steps: U tokens leave local
    cache.attend(q, out.data(), cws);                    // softmax(q·k/√d)·v over select(q)
  }
  // [snippet end]
  CHECK(cache.size() == max_tokens);
  CHECK(std::isfinite(out[0]));
  {
    const kvscore::half *k = keys + prompt_len * head_dim, *v = values + prompt_len * head_dim;
    // [snippet pariskv-cache-header]
    kvscore::ParisKVCache<kvscore::half> cache(head_dim);   // S = 4, L = 256, U = 128, k = 100
    cache.append(prompt_k, prompt_v, prompt_len);           // prefill
    cache.append(k, v); cache.attend(q, out.data(), cws);   // one decode step
    // [snippet end]
    CHECK(cache.size() == prompt_len + 1);
  }
}

TEST_CASE("snippet pariskv-layer-header and ojakv-layer-header: a layer's decode caches", "[snippets]") {
  const std::int64_t batch = 2, kv_heads = 2, q_heads = 6, head_dim = 16, prompt_len = 300, n = prompt_len, w = 8;
  const std::vector<float> K = layer<float>(batch * kv_heads, prompt_len + 1, head_dim, 21);
  const std::vector<float> V = layer<float>(batch * kv_heads, prompt_len + 1, head_dim, 22);
  const std::vector<float> Q = layer<float>(batch * q_heads, w, head_dim, 23);
  // HF layout [batch][heads][tokens][head_dim]: element strides of the batch, head and token axes
  const kvscore::LayerStrides ks{kv_heads * (prompt_len + 1) * head_dim, (prompt_len + 1) * head_dim, head_dim};
  const kvscore::LayerStrides vs = ks, qs{q_heads * w * head_dim, w * head_dim, head_dim}, ws = qs;
  const float *prompt_k = K.data(), *prompt_v = V.data(), *last_q = Q.data(), *q = Q.data();
  const float *k = K.data() + prompt_len * head_dim, *v = V.data() + prompt_len * head_dim;
  std::vector<float> out(std::size_t(batch * q_heads * w * head_dim));
  {
    kvscore::ParisKVCacheConfig cfg;
    cfg.sinks = 4;
    cfg.local = 16;
    cfg.search.k = 20;
    cfg.update_interval = 1;
    cfg.dense_fallback = false;
    // [snippet pariskv-layer-header]
    kvscore::ParisKVLayerCache<float> layer(batch, kv_heads, head_dim, cfg);  // cfg: zones, k, exact or index
    layer.append(prompt_k, prompt_v, prompt_len, ks, vs);  // prefill: [batch][kv_heads][n][head_dim], any strides
    layer.forward(k, v, q, q_heads, 1, ks, vs, qs, out.data(), qs);  // one decode step, every query head
    // [snippet end]
    CHECK(layer.size() == prompt_len + 1);
    CHECK(layer.positions(1, 5).size() == 4 + 20 + 16);
  }
  {
    kvscore::OjaLayerConfig cfg;
    cfg.rank_k = cfg.rank_v = 4;
    cfg.anchors = 30;
    cfg.window = w;
    // [snippet ojakv-layer-header]
    kvscore::OjaLayerCache layer(batch, kv_heads, head_dim, cfg);  // ranks, anchors, sinks, window
    layer.prefill(prompt_k, prompt_v, n, ks, vs, last_q, q_heads, w, ws);  // bases, anchors, codes
    layer.forward(k, v, q, q_heads, 1, ks, vs, qs, out.data(), qs);  // one decode step, every query head
    // [snippet end]
    CHECK(layer.size() == prompt_len + 1);
    CHECK(layer.store(1).head(0).full_pos.size() == 30);
    CHECK(std::isfinite(out[0]));
  }
}

TEST_CASE("snippet decoding (docs/reference/decoding.md, decoding.hpp): a cache kept at its target size", "[snippets]") {
  const std::int64_t kv_heads = 2, head_dim = 16, n = 1500, h = 1;
  const std::vector<kvscore::half> prompt_k = layer<kvscore::half>(kv_heads, n, head_dim, 12);
  const std::vector<kvscore::half> prompt_v = layer<kvscore::half>(kv_heads, n, head_dim, 13);
  const kvscore::half* k = prompt_k.data();
  const kvscore::half* v = prompt_v.data();
  // [snippet decoding]
  kvscore::DecodingOptions o;
  o.target = 1024;      // tokens per KV head after a compression (kvpress target_size)
  o.interval = 256;     // appended tokens between compressions (kvpress compression_interval)
  o.select.sinks = 4;   // protected like a prefill compression: sinks, recent
  kvscore::DecodingCompressor<kvscore::half, kvscore::KNorm> dc(kv_heads, head_dim, kvscore::KNorm{}, o);
  dc.append(k, v, n);   // [kv_heads][n][head_dim] keys and values: a prefill, or one decode step
  auto held = dc.key_view();        // the held keys (KeysView), dc.value_view() the values
  auto original = dc.positions(h);  // the original position of each held row of head h, ascending
  // [snippet end]
  CHECK(held.tokens() == 1244);  // 1280 reached: compressed to 1024, then the last 220 appended
  CHECK(std::is_sorted(original.begin(), original.end()));

  const std::vector<kvscore::half> step = layer<kvscore::half>(kv_heads, 1, head_dim, 14);
  k = step.data(), v = step.data();
  // [snippet decoding-header]
  kvscore::DecodingCompressor<kvscore::half, kvscore::KNorm> gen(kv_heads, head_dim, kvscore::KNorm{},
                                                                 {.target = 1024, .interval = 256});
  gen.append(k, v, 1);                        // per decode step: [kv_heads][1][head_dim] keys and values
  auto kept = gen.key_view(); auto pos = gen.positions(h);  // the kept cache, each row's original position
  // [snippet end]
  CHECK(kept.tokens() == 1);
  CHECK(pos.size() == 1);
}

TEST_CASE("snippet ojakv (docs/methods/ojakv.md): projectors, anchors, the hybrid store, generation", "[snippets]") {
  const int kv_heads = 2;
  const std::int64_t d = 128, q_heads = 4, tokens = 300, h = 1;
  const std::vector<float> kbuf = layer<float>(kv_heads, tokens, d, 15), vbuf = layer<float>(kv_heads, tokens, d, 16);
  const kvscore::KeysView<float> keys(kbuf.data(), kv_heads, tokens, d, tokens * d, d);
  const kvscore::KeysView<float> values(vbuf.data(), kv_heads, tokens, d, tokens * d, d);
  const std::vector<float> window = randn(std::size_t(q_heads * 32 * d), 17), qv = randn(std::size_t(q_heads * d), 18);
  const float* window_queries = window.data();
  const float* q = qv.data();
  const std::vector<float> new_k = randn(std::size_t(kv_heads * d), 19), new_v = randn(std::size_t(kv_heads * d), 20);
  const float *k_new = new_k.data(), *v_new = new_v.data(), *q_new = qv.data();
  // [snippet ojakv]
  // One projector per KV head: a seeded random start, or calibration (OjaProjector::calibrate).
  std::vector<kvscore::OjaProjector> proj;
  for (int h = 0; h < kv_heads; ++h) proj.push_back(kvscore::OjaProjector::random(d, /*r_k*/ 64, /*r_v*/ 64, /*seed*/ h));

  // Prefill: pool, run Oja's batch rule, QR (keys/values: KeysView<float|half|bfloat16>, any layout).
  for (int h = 0; h < kv_heads; ++h) proj[h].prefill(keys, values, h);

  // Full-rank anchors: residual score e_t, then the generic selector (budgets, sinks, recent, AdaKV).
  std::vector<Eigen::MatrixXd> uk;
  for (auto& p : proj) uk.push_back(p.key().basis());
  kvscore::OjaResidual residual(window_queries, q_heads, /*w*/ 32, d, uk);
  kvscore::SelectOptions o;  o.sinks = 4;
  kvscore::Selection full = kvscore::select(residual.score(keys), kvscore::Budget::per_head(256), o);

  // The hybrid store: codes for most tokens, full rows for `full`.
  auto cache = kvscore::OjaHybridCache::build(proj, keys, values, full);
  auto khat = cache.reconstruct_keys(h);               // K̂ = K̃ U_kᵀ, anchors exact
  cache.rebase(h, proj[h]);                            // after a decode update: codes in the new bases
  std::vector<double> out = cache.attention(h, q);     // softmax(q K̂ᵀ/√d) V̂, reference path
  kvscore::OjaMemory m = cache.memory(h, /*bytes per scalar*/ 2);

  // Generation: one call per decoded token (k, v: [kv_heads][d]; q: the step's [q_heads][d]).
  // Every T tokens: Oja update + QR, rebase of every code, the residual rule on the block.
  cache.append(proj, k_new, v_new, q_new, q_heads);    // OjaDecodeOptions: full_rank_fraction, adapt
  cache.commit(proj);                                  // close a partial block (end of generation)
  // [snippet end]
  CHECK(khat.rows() == tokens);
  CHECK(out.size() == std::size_t(d));
  CHECK(m.full_bytes == tokens * 2 * d * 2);  // keys and values at 2 bytes per scalar
  CHECK(cache.tokens() == tokens + 1);
}

TEST_CASE("snippet protokv and snapkv (docs/methods/protokv.md, docs/methods/snapkv.md): query-aware scores", "[snippets]") {
  const std::int64_t kv_heads = 2, q_heads = 4, head_dim = 32, tokens = 1500;
  const std::vector<float> kbuf = layer<float>(kv_heads, tokens, head_dim, 21);
  const kvscore::KeysView<float> keys(kbuf.data(), kv_heads, tokens, head_dim, tokens * head_dim, head_dim);
  const std::vector<float> q = randn(std::size_t(q_heads * 64 * head_dim), 22);
  const float* queries = q.data();
  {
    // [snippet protokv]
    // queries: post-RoPE queries of the last w prompt positions, fp32 [q_heads][w][head_dim]
    kvscore::ProtoKV pk(queries, q_heads, /*window*/ 64, head_dim /*, group = q_heads / kv_heads */);
    pk.seed = 1;                                       // RFF-LSH seed (reproducible on every platform)
    kvscore::Scores s = pk.score(keys);                // any KeysView / paged view, fp32/fp16/bf16
    kvscore::SelectOptions o;
    o.sinks = 4;
    o.recent = pk.protected_recent();                  // = w: the window is kept, by a mask
    kvscore::Selection kept = kvscore::select(s, kvscore::Budget::per_head(1024), o);
    // or o.alloc = kvscore::Alloc::adakv; then compaction (docs/reference/compaction.md) as for any scorer
    // [snippet end]
    CHECK(kept.total() == kv_heads * 1024);
    CHECK(kept.head(0).back() == tokens - 1);
  }
  // [snippet snapkv]
  // queries: the post-RoPE queries of the last w prompt positions, fp32 [q_heads][w][head_dim]
  kvscore::SnapKV snap(queries, q_heads, /*window*/ 64, head_dim /*, group = q_heads / kv_heads */);
  kvscore::Scores s = snap.score(keys);               // keys: KeysView<float|half|bfloat16>, any layout
  kvscore::SelectOptions o;
  o.recent = snap.protected_recent();                 // = w: the window is kept, by a mask
  kvscore::Selection kept = kvscore::select(s, kvscore::Budget::per_head(1024), o);
  // [snippet end]
  CHECK(kept.total() == kv_heads * 1024);
  CHECK(kept.head(1).back() == tokens - 1);
}

TEST_CASE("snippet kvzip (docs/methods/kvzip.md): two reconstruction passes fill one score array, one top-k keeps",
          "[snippets]") {
  const std::int64_t kv_heads = 2, q_heads = 6, head_dim = 32, n = 300, budget = 2 * 100;
  const std::vector<float> kbuf = layer<float>(kv_heads, n, head_dim, 31);
  const kvscore::KeysView<float> cache_keys(kbuf.data(), kv_heads, n, head_dim, n * head_dim, head_dim);
  struct Pass {
    std::int64_t begin, end, m;
    std::vector<float> q, k;
    const float* queries;
    kvscore::KeysView<float> keys;
  };
  std::vector<Pass> passes;
  for (auto [b, e] : {std::pair<std::int64_t, std::int64_t>{4, 150}, {150, n}}) {
    Pass p{b, e, e - b + 10, randn(std::size_t(q_heads * (e - b + 10) * head_dim), std::uint32_t(b)),
           layer<float>(kv_heads, e - b + 10, head_dim, std::uint32_t(e)), nullptr, {}};
    passes.push_back(std::move(p));
  }
  for (Pass& p : passes) {
    p.queries = p.q.data();
    p.keys = kvscore::KeysView<float>(p.k.data(), kv_heads, p.m, head_dim, p.m * head_dim, head_dim);
  }
  // [snippet kvzip]
  // each reconstruction pass: its post-RoPE queries [q_heads][m][head_dim] and its own keys (m rows)
  kvscore::Scores s(kv_heads, n);                      // one score array, filled span by span
  for (const Pass& p : passes) {
    kvscore::KVzip zip(p.queries, q_heads, p.m, head_dim);
    zip.score_span(cache_keys, p.keys, kvscore::KVzipSpan{p.begin, p.end, /*sinks*/ 4}, s.view());
  }
  kvscore::SelectOptions o;
  o.sinks = 4;
  o.alloc = kvscore::Alloc::adakv;                     // kvpress: one top-k over the heads (and layers),
  o.alpha = 0;                                         // no per-head safeguard
  kvscore::Selection kept = kvscore::select(s, kvscore::Budget::per_layer(budget), o);
  // [snippet end]
  CHECK(kept.total() == budget);
  for (std::int64_t h = 0; h < kv_heads; ++h) {
    CHECK(s.head(h)[3] == 0.f);  // before the first span: not scored
    CHECK(s.head(h)[4] > 0.f);
    CHECK(kept.head(h)[0] == 0);  // the sinks are kept
  }
}

TEST_CASE("snippet manifoldkv and integration (docs/methods/manifoldkv.md, docs/guides/integration.md)", "[snippets]") {
  const std::int64_t N = 400;
  const std::vector<float> kbuf = layer<float>(2, N, 32, 23);
  const kvscore::KeysView<float> view(kbuf.data(), 2, N, 32, N * 32, 32);
  {
    const auto& keys = view;
    // [snippet manifoldkv]
    kvscore::SelectOptions o;  o.alloc = kvscore::Alloc::adakv;  o.alpha = 0.2;   // no sinks, no recent
    const auto n = kvscore::budget_from_ratio(N, 1 - 0.2, kvscore::BudgetRounding::floor);
    auto sel = kvscore::select(kvscore::ManifoldL2{}.score(keys), kvscore::Budget::per_head(n), o);
    // [snippet end]
    CHECK(n == 320);
    CHECK(sel.total() == 2 * 320);
  }
  // [snippet integration]
  auto keys = view;                                   // one of the views above
  kvscore::ManifoldL2 scorer;                         // or the method kvscore eval picked
  kvscore::Scores s = scorer.score(keys);             // fp32 [kv_heads][tokens], higher = keep
  kvscore::SelectOptions opt;
  opt.sinks = 4;                                      // the protection you evaluated with
  opt.recent = 32;
  kvscore::Selection sel = kvscore::select(s, kvscore::Budget::per_head(kvscore::budget_from_ratio(s.tokens(), 0.25)), opt);
  // sel.head(h): kept positions of head h, ascending
  // [snippet end]
  CHECK(sel.total() == 2 * 100);
}

TEST_CASE("snippet streaming-llm and synth (streaming_llm.hpp, synth.hpp)", "[snippets]") {
  const std::int64_t heads = 2, tokens = 100, n = 20;
  using namespace kvscore;
  // [snippet streaming-llm-header]
  Selection a = kvscore::streaming_llm(heads, tokens, Budget::per_head(n));              // 4 sinks
  Selection b = kvscore::StreamingLLM{/*sinks*/ 8}.select(heads, tokens, Budget::per_head(n));
  // [snippet end]
  CHECK(a.head(0)[3] == 3);
  CHECK(a.head(0)[4] == tokens - (n - 4));
  CHECK(b.head(1)[8] == tokens - (n - 8));

  // [snippet synth-header]
  kvscore::synth::Spec spec;                 // kind mixed, 1 layer, 4 KV heads, G = 2, 2048 tokens, d = 64
  spec.kind = kvscore::synth::Kind::drift;
  kvscore::synth::Data data = kvscore::synth::generate(spec);
  // data.keys / data.values [layers][kv_heads][tokens][d], data.queries [layers][q_heads][queries][d]
  // data.planted: positions of the planted tokens per (layer, kv head)
  // [snippet end]
  CHECK(data.keys.size() == std::size_t(4 * 2048 * 64));
}

TEST_CASE("snippet joint (docs/reference/joint.md, joint.hpp): one keep list for every head and layer", "[snippets]") {
  const int n_layer = 3;
  const std::int64_t kv_heads = 2, tokens = 300, head_dim = 32, budget = 120;
  std::vector<std::vector<float>> cache;
  for (int l = 0; l < n_layer; ++l) cache.push_back(layer<float>(kv_heads, tokens, head_dim, 40u + std::uint32_t(l)));
  auto keys_of_layer = [&](int l) {
    return kvscore::KeysView<float>(cache[std::size_t(l)].data(), kv_heads, tokens, head_dim, tokens * head_dim, head_dim);
  };
  kvscore::KNorm scorer;
  std::vector<std::pair<std::int64_t, std::int64_t>> removed;  // what an engine would remove
  auto remove_positions = [&](std::int64_t begin, std::int64_t end) { removed.emplace_back(begin, end); };
  // [snippet joint]
  std::vector<kvscore::Scores> per_layer;                  // [kv_heads][tokens] each, any scorer
  for (int l = 0; l < n_layer; ++l) per_layer.push_back(scorer.score(keys_of_layer(l)));

  kvscore::JointOptions o;
  o.sinks = 4;                                             // always kept, inside the budget
  o.recent = 64;
  // o.aggregate = kvscore::JointAggregate::max;           // the default (measured below)
  std::vector<std::int64_t> keep = kvscore::select_joint(per_layer, budget, o);   // ascending
  for (auto r : kvscore::evicted_ranges(keep, tokens))     // llama.cpp: llama_memory_seq_rm(mem, seq, r.begin, r.end)
    remove_positions(r.begin, r.end);
  // [snippet end]
  REQUIRE(std::int64_t(keep.size()) == budget);
  CHECK(keep.front() == 0);
  CHECK(keep.back() == tokens - 1);
  std::int64_t gone = 0;
  for (const auto& [b, e] : removed) gone += e - b;
  CHECK(gone == tokens - budget);
  // [snippet joint-header]
  kvscore::JointOptions opt;  opt.sinks = 4;  opt.recent = 64;   // aggregate: max by default
  std::vector<std::int64_t> kept = kvscore::select_joint(per_layer, 100, opt);   // ascending
  // [snippet end]
  CHECK(kept.size() == 100);
}

TEST_CASE("snippet: block-sparse decode over a paged cache (block_sparse.hpp)", "[snippets]") {
  const std::int64_t layers = 2, num_blocks = 16, kv_heads = 2, head_dim = 64, block_size = 32, q_heads = 6;
  const std::vector<float> pool = randn(std::size_t(num_blocks * kv_heads * block_size * 2 * head_dim), 1);
  std::vector<std::int64_t> written_slots(std::size_t(num_blocks * block_size));
  std::iota(written_slots.begin(), written_slots.end(), 0);
  const std::vector<std::int32_t> table{3, 7, 1, 0, 12, 9, 4, 5, 2, 11};
  const std::vector<std::int64_t> first_blocks{3};
  const std::vector<float> q = randn(std::size_t(q_heads * head_dim), 2);
  std::vector<std::int32_t> out(5);
  const std::vector<kvscore::BlockSparseRow> rows{{table, 300, q.data(), 5, out.data()}};
  const std::vector<std::int32_t> none;
  const auto keys = kvscore::TransposedPagedKeysView<float>::vllm_cpu(
      pool.data(), kv_heads, head_dim, kvscore::BlockTable(std::span<const std::int32_t>(none), block_size, num_blocks, 0));
  const std::int64_t layer = 1;
  // [snippet block-sparse]
  kvscore::BlockSparseOptions opt;                 // int4 codes, 4 sinks, 64 local tokens
  kvscore::PagedBlockSelector sel(layers, num_blocks, kv_heads, head_dim, block_size, opt);
  sel.begin_step(written_slots, first_blocks);     // once per step: the slots written since
  sel.select(layer, keys, q_heads, rows);          // per layer: every rows[i].out is filled
  // [snippet end]
  // 300 tokens: blocks 0 (sinks), 7-9 (the last 64 tokens) and one chosen of 1-6: 5 attended
  CHECK(out[0] == 3);
  CHECK(out[2] == 5);
  CHECK(out[3] == 2);
  CHECK(out[4] == 11);
  CHECK(std::find(table.begin() + 1, table.begin() + 7, out[1]) != table.begin() + 7);
}

namespace {

/// One layer's NHD pool [num_blocks][block_size][kv_heads][head_dim] with some structure.
std::vector<float> nhd_pool(std::int64_t num_blocks, std::int64_t block_size, std::int64_t kv_heads,
                            std::int64_t head_dim, std::uint32_t seed) {
  return layer<float>(num_blocks * block_size, kv_heads, head_dim, seed);
}

/// The keys of a sequence as [kv_heads][tokens][head_dim], gathered through its block table.
std::vector<float> gather_keys(const std::vector<float>& pool, std::span<const std::int32_t> table,
                               std::int64_t tokens, std::int64_t block_size, std::int64_t kv_heads,
                               std::int64_t head_dim) {
  std::vector<float> k(std::size_t(kv_heads * tokens * head_dim));
  for (std::int64_t h = 0; h < kv_heads; ++h)
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t j = 0; j < head_dim; ++j)
        k[std::size_t((h * tokens + t) * head_dim + j)] =
            pool[std::size_t(((table[std::size_t(t / block_size)] * block_size + t % block_size) * kv_heads + h) *
                                 head_dim + j)];
  return k;
}

}  // namespace

TEST_CASE("snippet paged-evict and paged-evict-tp (docs/guides/paged-engine.md): whole blocks, holes, TP ranks",
          "[snippets]") {
  const std::int64_t layers = 3, num_blocks = 40, block_size = 16, kv_heads = 4, head_dim = 32, tokens = 300;
  std::vector<std::vector<float>> pools;
  for (std::int64_t l = 0; l < layers; ++l)
    pools.push_back(nhd_pool(num_blocks, block_size, kv_heads, head_dim, 70u + std::uint32_t(l)));
  std::vector<const float*> k_pool;
  for (const auto& p : pools) k_pool.push_back(p.data());
  std::vector<std::int32_t> table(std::size_t(kvscore::blocks_for(tokens, block_size)));
  for (std::size_t i = 0; i < table.size(); ++i) table[i] = std::int32_t((7 * i + 3) % std::size_t(num_blocks));
  std::vector<std::int32_t> free_list;
  auto free_block = [&](std::int32_t id) { free_list.push_back(id); };
  // [snippet paged-evict]
  // after the prefill of one sequence: every layer's keys in its pool, the sequence's block table
  kvscore::BlockTable bt(table, block_size, num_blocks, tokens);
  std::vector<kvscore::Scores> per_layer;
  for (std::int64_t l = 0; l < layers; ++l)
    per_layer.push_back(kvscore::KNorm{}.score(kvscore::PagedKeysView<float>::nhd(k_pool[l], kv_heads, head_dim, bt)));

  kvscore::BlockJointOptions o;
  o.sinks = 4;                                    // the first block always kept
  o.recent = 64;                                  // the blocks of the last 64 positions too
  const std::int64_t nb = kvscore::blocks_for(tokens, block_size);
  std::vector<std::int64_t> kept = kvscore::select_joint_blocks(per_layer, block_size, nb / 2, o);  // logical, ascending

  // holes: nothing moves; attention reads the kept blocks' ids and a length less the evicted tokens
  std::vector<std::int32_t> attend_table;
  for (std::int64_t b : kept) attend_table.push_back(table[std::size_t(b)]);
  const std::int64_t attend_len = tokens - (nb - std::int64_t(kept.size())) * block_size;
  for (std::int64_t b = 0, k = 0; b < nb; ++b)   // the evicted blocks go back to the pool
    if (k < std::int64_t(kept.size()) && kept[std::size_t(k)] == b) ++k;
    else free_block(table[std::size_t(b)]);
  // [snippet end]
  REQUIRE(std::int64_t(kept.size()) == nb / 2);
  CHECK(kept.front() == 0);
  CHECK(kept.back() == nb - 1);  // the partial last block
  CHECK(std::int64_t(free_list.size()) == nb - nb / 2);
  CHECK(attend_len == (std::int64_t(kept.size()) - 1) * block_size + (tokens - (nb - 1) * block_size));
  for (std::int32_t id : free_list) CHECK(std::find(attend_table.begin(), attend_table.end(), id) == attend_table.end());

  // two tensor-parallel ranks, two KV heads each: each scores its own heads of every layer
  std::vector<std::vector<kvscore::Scores>> rank_scores(2);
  for (int r = 0; r < 2; ++r)
    for (std::int64_t l = 0; l < layers; ++l) {
      const kvscore::Scores& all = per_layer[std::size_t(l)];
      kvscore::Scores s(2, tokens);
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t t = 0; t < tokens; ++t) s.view()(h, t) = all(2 * r + h, t);
      rank_scores[std::size_t(r)].push_back(std::move(s));
    }
  std::vector<kvscore::JointPartial> all_partials;
  for (int r = 0; r < 2; ++r) {
    const std::vector<kvscore::Scores>& my_per_layer = rank_scores[std::size_t(r)];
    // [snippet paged-evict-tp]
    // on every rank: its own KV heads of every layer give its partial (max, sum, count per position)
    kvscore::JointPartial mine = kvscore::joint_partial(my_per_layer, o);
    // [snippet end]
    all_partials.push_back(std::move(mine));
  }
  // [snippet paged-evict-tp-combine]
  // in one place (vLLM: the scheduler), every rank's partial: one decision for all ranks
  std::vector<float> J = kvscore::combine_partials(all_partials, o);   // the joint score per position
  std::vector<float> B = kvscore::block_scores(J, block_size, o);      // per block
  std::vector<std::int64_t> kept_tp = kvscore::select_blocks(B, tokens, block_size, nb / 2, o);
  // [snippet end]
  CHECK(kept_tp == kept);  // max over rows: the split does not change the decision (bit for bit)
}

TEST_CASE("snippet block-sparse-loop (docs/guides/block-sparse-decode.md): a whole decode step loop", "[snippets]") {
  const std::int64_t layers = 2, num_blocks = 64, block_size = 16, kv_heads = 2, head_dim = 32, q_heads = 4;
  std::vector<std::vector<float>> pools;
  for (std::int64_t l = 0; l < layers; ++l)
    pools.push_back(nhd_pool(num_blocks, block_size, kv_heads, head_dim, 90u + std::uint32_t(l)));
  std::vector<const float*> k_pool;
  for (const auto& p : pools) k_pool.push_back(p.data());
  struct Seq {
    std::vector<std::int32_t> table;
    std::int64_t tokens;
  };
  std::vector<Seq> seqs(2);  // two sequences of 400 and 330 tokens, growing by one per step
  for (std::int32_t b = 0; b < 30; ++b) seqs[0].table.push_back(b);
  for (std::int32_t b = 30; b < 60; ++b) seqs[1].table.push_back(b);
  seqs[0].tokens = 400;
  seqs[1].tokens = 330;
  std::vector<std::vector<float>> queries;  // [layer][seq] this step's query [q_heads][head_dim]
  for (std::int64_t l = 0; l < layers; ++l)
    for (std::size_t s = 0; s < seqs.size(); ++s)
      queries.push_back(randn(std::size_t(q_heads * head_dim), 100u + std::uint32_t(l * 2) + std::uint32_t(s)));
  auto query = [&](std::int64_t l, std::size_t s) { return queries[std::size_t(l) * seqs.size() + s].data(); };
  std::vector<std::vector<std::vector<std::int32_t>>> attended(static_cast<std::size_t>(layers));  // what attention read
  auto attention = [&](std::int64_t l, std::size_t s, std::span<const std::int32_t> blocks, std::int64_t len) {
    CHECK(len == (std::int64_t(blocks.size()) - 1) * block_size +
                     (seqs[s].tokens - (kvscore::blocks_for(seqs[s].tokens, block_size) - 1) * block_size));
    attended[std::size_t(l)].emplace_back(blocks.begin(), blocks.end());
  };
  const int steps = 3;
  // [snippet block-sparse-loop]
  kvscore::BlockSparseOptions opt;                 // int4 scores, 4 sinks, 64 local tokens, every step scored
  kvscore::PagedBlockSelector sel(layers, num_blocks, kv_heads, head_dim, block_size, opt);
  // the selector reads the pool's data, strides and shape only: a table of 0 tokens views the whole pool
  const kvscore::BlockTable pool_only(std::span<const std::int32_t>{}, block_size, num_blocks, 0);
  std::vector<kvscore::BlockSparseRow> rows(seqs.size());
  std::vector<std::vector<std::int32_t>> chosen(seqs.size());
  for (int step = 0; step < steps; ++step) {
    // the engine appended one token to every sequence and wrote its key to `slots`
    std::vector<std::int64_t> slots, live;
    for (Seq& s : seqs) {
      const std::int64_t t = s.tokens++;           // its position; the last block has room here
      slots.push_back(s.table[std::size_t(t / block_size)] * block_size + t % block_size);
      live.push_back(s.table[0]);                  // a sequence is named by its first block
    }
    sel.begin_step(slots, live);                   // once per step; `live` keeps the running ones' state
    for (std::int64_t l = 0; l < layers; ++l) {
      for (std::size_t s = 0; s < seqs.size(); ++s) {
        const std::int64_t a = kvscore::attended_blocks(seqs[s].tokens, block_size, 0.1, opt);
        chosen[s].resize(std::size_t(a));
        rows[s] = {seqs[s].table, seqs[s].tokens, query(l, s), a, chosen[s].data()};
      }
      sel.select(l, kvscore::PagedKeysView<float>::nhd(k_pool[l], kv_heads, head_dim, pool_only), q_heads, rows);
      for (std::size_t s = 0; s < seqs.size(); ++s) {  // the engine's own paged attention, on fewer blocks
        const std::int64_t nb = kvscore::blocks_for(seqs[s].tokens, block_size);
        const std::int64_t len = (rows[s].attend - 1) * block_size + (seqs[s].tokens - (nb - 1) * block_size);
        attention(l, s, chosen[s], len);
      }
    }
  }
  // [snippet end]
  // every step's choice: the attended count, the protected blocks, ids of the sequence's table in order;
  // the first step (every sequence scored) is the stateless reference's on the same keys and query
  for (std::int64_t l = 0; l < layers; ++l) {
    REQUIRE(attended[std::size_t(l)].size() == std::size_t(steps) * seqs.size());
    for (std::size_t i = 0; i < attended[std::size_t(l)].size(); ++i) {
      const auto& got = attended[std::size_t(l)][i];
      const Seq& s = seqs[i % seqs.size()];
      CHECK(got.front() == s.table[0]);
      std::vector<std::int64_t> logical;
      for (std::int32_t id : got)
        logical.push_back(std::find(s.table.begin(), s.table.end(), id) - s.table.begin());
      CHECK(std::is_sorted(logical.begin(), logical.end()));
      CHECK(logical.back() < std::int64_t(s.table.size()));
    }
    for (std::size_t si = 0; si < seqs.size(); ++si) {
      const std::int64_t tokens0 = seqs[si].tokens - steps + 1;  // the first step's length
      const std::vector<float> k = gather_keys(pools[std::size_t(l)], seqs[si].table, tokens0, block_size, kv_heads, head_dim);
      const std::int64_t a = kvscore::attended_blocks(tokens0, block_size, 0.1, opt);
      const std::vector<std::int64_t> want = kvscore::block_sparse_reference(
          k.data(), kv_heads, tokens0, head_dim, block_size, query(l, si), q_heads, a, opt);
      std::vector<std::int32_t> want_ids;
      for (std::int64_t b : want) want_ids.push_back(seqs[si].table[std::size_t(b)]);
      CHECK(attended[std::size_t(l)][si] == want_ids);
    }
  }
}
