// examples/llama_cpp/capture.hpp — every layer's post-RoPE keys (and the last queries) of a
// llama.cpp prefill, seen through llama_context_params::cb_eval.
//
// llama.cpp names the graph's tensors "<name>-<layer>". In Llama-style graphs several tensors
// are called "Kcur-<layer>": the K projection [n_embd_k_gqa, n_tokens], its [head_dim, kv_heads,
// n_tokens] reshape, and the RoPE result of the same shape -- the keys that enter the cache. The
// RoPE one is told apart by its op (GGML_OP_ROPE). Only those (and "Qcur-<layer>" ROPE tensors,
// when queries are wanted) are observed: cb_eval answers `ask` with false for every other
// tensor, so the scheduler does not stop for them; while the capture is inactive it observes
// nothing at all.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvscore_llama {

struct Capture {
  bool active = false;
  std::int64_t n_layer = 0, kv_heads = 0, q_heads = 0, head_dim = 0;
  std::int64_t n_tokens = 0;    ///< tokens of the prefill being captured
  std::int64_t q_window = 0;    ///< capture the queries of the last q_window prefill tokens (0: none)
  std::vector<std::vector<float>> keys;     ///< [layer][token][kv_head][head_dim] fp32
  std::vector<std::vector<float>> queries;  ///< [layer][q_head][q_window][head_dim] fp32
  std::vector<std::int64_t> k_rows, q_rows; ///< rows seen so far per layer
  std::string error;                        ///< first inconsistency seen (shape, order)

  void start(std::int64_t layers, std::int64_t kvh, std::int64_t qh, std::int64_t d, std::int64_t tokens,
             std::int64_t window) {
    n_layer = layers;
    kv_heads = kvh;
    q_heads = qh;
    head_dim = d;
    n_tokens = tokens;
    q_window = window;
    keys.assign(std::size_t(layers), std::vector<float>(std::size_t(tokens * kvh * d)));
    queries.assign(std::size_t(layers), std::vector<float>(std::size_t(qh * window * d)));
    k_rows.assign(std::size_t(layers), 0);
    q_rows.assign(std::size_t(layers), 0);
    error.clear();
    active = true;
  }

  /// Every layer got every token (and every wanted query).
  bool complete() const {
    for (std::int64_t l = 0; l < n_layer; ++l)
      if (k_rows[std::size_t(l)] != n_tokens || (q_window > 0 && q_rows[std::size_t(l)] != n_tokens)) return false;
    return error.empty();
  }

  static int layer_of(const char* name, const char* prefix) {
    const std::size_t n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0 || name[n] < '0' || name[n] > '9') return -1;
    char* end = nullptr;
    const long l = std::strtol(name + n, &end, 10);
    return *end == '\0' ? int(l) : -1;
  }

  /// Rows [ne2 tokens] of a [head_dim, heads, tokens] fp32 tensor appended after `rows` rows.
  void take(const ggml_tensor* t, std::int64_t heads, std::int64_t& rows, float* dst_keys, float* dst_q) {
    if (t->type != GGML_TYPE_F32 || t->ne[0] != head_dim || t->ne[1] != heads || t->ne[3] != 1) {
      if (error.empty()) error = std::string("unexpected shape/type of ") + t->name;
      return;
    }
    const std::int64_t n = t->ne[2];
    if (rows + n > n_tokens) {
      if (error.empty()) error = std::string("more rows than prefill tokens in ") + t->name;
      return;
    }
    // A host buffer is read in place; any other backend's tensor is copied out first.
    std::vector<char> tmp;
    const char* base = static_cast<const char*>(t->data);
    if (!ggml_backend_buffer_is_host(t->buffer)) {
      tmp.resize(ggml_nbytes(t));
      ggml_backend_tensor_get(t, tmp.data(), 0, tmp.size());
      base = tmp.data();
    }
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t pos = rows + i;
      for (std::int64_t h = 0; h < heads; ++h) {
        const float* src = reinterpret_cast<const float*>(base + i * t->nb[2] + h * t->nb[1]);  // nb[0] == 4
        if (dst_keys) std::memcpy(dst_keys + (pos * heads + h) * head_dim, src, std::size_t(head_dim) * 4);
        if (dst_q && pos >= n_tokens - q_window)
          std::memcpy(dst_q + (h * q_window + (pos - (n_tokens - q_window))) * head_dim, src,
                      std::size_t(head_dim) * 4);
      }
    }
    rows += n;
  }

  /// The ggml_backend_sched_eval_callback (cb_eval_user_data = this).
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto* c = static_cast<Capture*>(user);
    if (!c->active || t->op != GGML_OP_ROPE) return ask ? false : true;
    const int lk = layer_of(t->name, "Kcur-");
    const int lq = c->q_window > 0 ? layer_of(t->name, "Qcur-") : -1;
    const int l = lk >= 0 ? lk : lq;
    if (l < 0 || l >= c->n_layer) return ask ? false : true;
    if (ask) return true;
    if (lk >= 0) c->take(t, c->kv_heads, c->k_rows[std::size_t(l)], c->keys[std::size_t(l)].data(), nullptr);
    else c->take(t, c->q_heads, c->q_rows[std::size_t(l)], nullptr, c->queries[std::size_t(l)].data());
    return true;
  }
};

}  // namespace kvscore_llama
