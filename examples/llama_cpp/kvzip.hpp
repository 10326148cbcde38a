// examples/llama_cpp/kvzip.hpp — KVzip inside llama.cpp (docs/methods/kvzip.md): after a context is
// prefilled, the model reconstructs it from its own cache, in passes of at most `chunk` context
// tokens, each pass = the reconstruction prompt + the chat template's suffix + the chunk, decoded
// after the context (positions N, N+1, ...) as kvpress's KVzipPress builds it. cb_eval captures
// each pass's post-RoPE queries and keys (capture.hpp), kvscore::KVzip::score_span scores the
// chunk by the attention it receives from them (the softmax over the sinks, the chunk and the
// pass's own tokens), and llama_memory_seq_rm drops the pass's tokens before the next one, so the
// cache ends as the prefill left it, with one score per (layer, KV head, context token).
#pragma once

#include <kvscore/io/npy.hpp>
#include <kvscore/methods.hpp>
#include <kvscore/scorers/kvzip.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "capture.hpp"
#include "util.hpp"

namespace kvscore_llama {

/// Context tokens per pass by default here: 512, not kvpress's 2048. llama.cpp computes the pass's
/// attention inside ggml, so the scores recompute its logits (the press fuses them instead), and
/// that cost grows with the chunk while the passes' forward does not: one ~1,060-token chunk
/// 6.5 % of the passes' forward, 512-token chunks 3.2 % (docs/results/kvzip.md#what-it-costs).
inline constexpr std::int64_t kLlamaKVzipChunk = 512;

struct KVzipOptions {
  std::int64_t chunk = kLlamaKVzipChunk;             ///< context tokens per pass
  std::int64_t prefix = 0;                           ///< leading context tokens not reconstructed (chat template)
  std::string suffix = "\n";                         ///< text between the prompt and the chunk (kvpress: the
                                                     ///< template's end of the user turn; "\n" without one)
  std::int64_t sinks = kvscore::kDefaultSinks;       ///< cache rows in every pass's softmax (kvpress's n_sink)
  int threads = 1;
  std::string dump;  ///< directory: every pass's keys, queries and span as .npy (the replay test reads them)
};

/// One pass: the context rows [begin, end) it scores and its tokens.
struct KVzipPass {
  std::int64_t begin = 0, end = 0;
  std::vector<llama_token> tokens;
};

/// text → tokens without BOS, special tokens parsed (the template's suffix holds some).
inline std::vector<llama_token> tokenize_plain(const llama_vocab* vocab, std::string_view text) {
  std::vector<llama_token> t(text.size() + 8);
  int n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), t.data(), std::int32_t(t.size()), false, true);
  if (n < 0) {
    t.resize(std::size_t(-n));
    n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), t.data(), std::int32_t(t.size()), false, true);
  }
  if (n < 0) throw std::runtime_error("llama_tokenize failed");
  t.resize(std::size_t(n));
  return t;
}

/// kvpress KVzipPress.prepare: chunks of the context after `prefix`, the first pass prompted with
/// kKVzipPromptFirst, the others with kKVzipPromptNext + the previous chunk's last
/// kDefaultKVzipRepeat tokens; then the suffix and the chunk.
inline std::vector<KVzipPass> kvzip_passes(const llama_vocab* vocab, const std::vector<llama_token>& context,
                                           const KVzipOptions& o) {
  const auto n = std::int64_t(context.size());
  if (o.chunk < 1) throw Usage("--chunk must be >= 1 (got " + std::to_string(o.chunk) + ")");
  if (o.prefix < 0 || o.prefix >= n)
    throw Usage("--kvzip-prefix " + std::to_string(o.prefix) + " leaves nothing of the " + std::to_string(n) +
                "-token prompt to reconstruct");
  const std::vector<llama_token> first = tokenize_plain(vocab, kvscore::kKVzipPromptFirst),
                                 next = tokenize_plain(vocab, kvscore::kKVzipPromptNext),
                                 suffix = tokenize_plain(vocab, o.suffix);
  std::vector<KVzipPass> out;
  for (std::int64_t b = o.prefix; b < n; b += o.chunk) {
    const std::int64_t e = std::min(n, b + o.chunk);
    KVzipPass p{b, e, b == o.prefix ? first : next};
    if (b > o.prefix)  // "... starting with" + the previous chunk's last tokens
      p.tokens.insert(p.tokens.end(), context.begin() + std::max(o.prefix, b - kvscore::kDefaultKVzipRepeat),
                      context.begin() + b);
    p.tokens.insert(p.tokens.end(), suffix.begin(), suffix.end());
    p.tokens.insert(p.tokens.end(), context.begin() + b, context.begin() + e);
    out.push_back(std::move(p));
  }
  return out;
}

struct KVzipRun {
  std::vector<kvscore::Scores> scores;  ///< [layer] [kv_heads][N]; rows before the first pass: 0
  double forward_ms = 0, score_ms = 0;  ///< the passes' llama_decode (capture included), kvscore's scoring
  std::int64_t passes = 0, tokens = 0;  ///< passes run, tokens decoded in them
};

/// [layers][rows][heads][d] of a capture, as one [layers, rows, heads, d] array (the dumps).
inline void dump_keys(const std::string& path, const std::vector<std::vector<float>>& per_layer, std::int64_t rows,
                      std::int64_t heads, std::int64_t d) {
  std::vector<float> all;
  for (const auto& l : per_layer) all.insert(all.end(), l.begin(), l.end());
  kvscore::npy::save<float>(path, {std::int64_t(per_layer.size()), rows, heads, d}, all.data());
}

/// Runs the passes on a context of N tokens whose keys `context_keys` holds (the prefill's capture;
/// every layer [N][kv_heads][d]); `cap` is the context's cb_eval capture, reused for each pass. The
/// cache is left as the prefill left it.
inline KVzipRun kvzip_score(llama_context* ctx, const llama_vocab* vocab, const std::vector<llama_token>& context,
                            const Capture& context_keys, Capture& cap, const KVzipOptions& o) {
  using Clock = std::chrono::steady_clock;
  const auto N = std::int64_t(context.size());
  const std::int64_t L = context_keys.n_layer, Hkv = context_keys.kv_heads, Hq = context_keys.q_heads,
                     D = context_keys.head_dim;
  const std::vector<KVzipPass> passes = kvzip_passes(vocab, context, o);
  KVzipRun r;
  r.scores.assign(std::size_t(L), kvscore::Scores(Hkv, N));  // zeros
  llama_memory_t mem = llama_get_memory(ctx);
  if (!o.dump.empty()) {
    dump_keys(o.dump + "/context_keys.npy", context_keys.keys, N, Hkv, D);
    std::vector<std::int64_t> spans;
    for (const KVzipPass& p : passes) spans.insert(spans.end(), {p.begin, p.end});
    kvscore::npy::save<std::int64_t>(o.dump + "/spans.npy", {std::int64_t(passes.size()), 2}, spans.data());
  }
  for (std::size_t i = 0; i < passes.size(); ++i) {
    const KVzipPass& p = passes[i];
    const auto m = std::int64_t(p.tokens.size());
    cap.start(L, Hkv, Hq, D, m, m);
    auto t0 = Clock::now();
    std::vector<llama_token> toks = p.tokens;
    if (llama_decode(ctx, llama_batch_get_one(toks.data(), std::int32_t(m))) != 0)
      throw std::runtime_error("llama_decode failed on KVzip pass " + std::to_string(i));
    cap.active = false;
    r.forward_ms += ms_since(t0);
    if (!cap.complete())
      throw std::runtime_error("KVzip pass " + std::to_string(i) + ": the cb_eval capture is incomplete (" +
                               (cap.error.empty() ? std::string("a layer's Kcur/Qcur ROPE tensor was not seen") : cap.error) +
                               ")");
    t0 = Clock::now();
    const kvscore::KVzipSpan span{p.begin, p.end, o.sinks};
    for (std::int64_t l = 0; l < L; ++l) {
      kvscore::KVzip z(cap.queries[std::size_t(l)].data(), Hq, m, D);
      z.num_threads = o.threads;
      z.score_span(kvscore::KeysView<float>::token_major(context_keys.keys[std::size_t(l)].data(), N, Hkv, D),
                   kvscore::KeysView<float>::token_major(cap.keys[std::size_t(l)].data(), m, Hkv, D), span,
                   r.scores[std::size_t(l)].view());
    }
    r.score_ms += ms_since(t0);
    if (!llama_memory_seq_rm(mem, 0, llama_pos(N), -1))
      throw std::runtime_error("llama_memory_seq_rm refused to drop KVzip pass " + std::to_string(i));
    if (!o.dump.empty()) {
      const std::string f = o.dump + "/pass" + std::to_string(i);
      dump_keys(f + "_keys.npy", cap.keys, m, Hkv, D);
      dump_keys(f + "_queries.npy", cap.queries, Hq, m, D);
    }
    ++r.passes;
    r.tokens += m;
  }
  return r;
}

}  // namespace kvscore_llama
