// examples/llama_cpp/sparse.hpp — block-sparse decode inside llama.cpp (kvscore_llama --attend F):
// in each decode step, per layer, the cells that layer's query attends are chosen by
// kvscore::CellBlockSelector (kvscore/block_sparse/cells.hpp) and every other visible cell is set
// to -INFINITY in the KQ mask, which the CPU flash-attention kernel skips (ggml-cpu/ops.cpp,
// ggml_compute_forward_flash_attn_ext_f16_one_chunk: `if (mv == -INFINITY) continue;`: no K dot
// product, no V row read for that cell).
//
// All of it happens in cb_eval (ggml_backend_sched_eval_callback). The scheduler asks the callback
// about every node of the graph in order (ask = true) and computes the graph up to each node the
// callback wants, then hands it over (ask = false): so a node the callback is asked about is not
// computed yet, and every node before the last one it wanted is. Per ubatch:
//
//   ask ROPE "Qcur-0"            its src[1] is the positions input (inp_pos): the ubatch's positions
//   ask SET_ROWS into cache_k_l0 its src[1] is the cells the ubatch writes (attn_inp_k_idxs): the
//                                cell -> position map, and the selector's write() (their blocks in flight)
//   ROPE "Qcur-<l>" (observed)   layer l's post-RoPE query, copied out (a quantised K cache is rotated
//                                by llama.cpp, Q too, by a MUL_MAT after the ROPE: that one is observed
//                                and its output taken instead)
//   ask FLASH_ATTN_EXT of layer l (the layer: its K's cache tensor cache_k_l<l>): Q (src[0]) is
//                                computed, the mask (src[3], an input: one [n_kv, n_tokens] f16 tensor
//                                for all layers) is set; the cells are chosen from the cache K
//                                (src[1]'s tensor) and the mask's row is rewritten from the step's
//                                original row plus this layer's choice: layer l-1's attention has run
//                                (it precedes Qcur-l), layer l's has not
//                                At layer 0 the map is checked against the mask's row: a cell the map
//                                holds and the mask hides was removed (llama_memory_seq_rm: --keep's
//                                eviction, a question dropped; its block is stale), a visible cell the
//                                map lacks is an error (a state load moved the cells: only a load into
//                                a fresh context before the first step is followed, `preloaded`)
//   FLASH_ATTN_EXT (observed with --check-attend): the mask read back as the kernel saw it, against
//                                kvscore::cell_block_reference from the copied query and the cache keys
//
// Prompt batches (more than one token), the `dense_next` one-token ubatches and sequences under
// dense_below visible cells decode densely (the mask untouched). One sequence, one stream, no SWA.
#pragma once

#include <kvscore/block_sparse/cells.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "ggml-backend.h"
#include "ggml.h"

namespace kvscore_llama {

struct SparseDecode {
  // what is asked
  double attend = 1.0;
  std::int64_t dense_below = 1024;
  kvscore::BlockSparseOptions opt;
  bool check = false;  ///< observe each FA node and compare its mask with the reference
  /// The positions of cells 0, 1, ... after a state load this callback did not see (--load-session's
  /// into a fresh context); checked against the mask at the first step, as any cell
  std::vector<std::int32_t> preloaded;
  /// This many of the next one-token ubatches decode densely: after --load-session the prompt's last
  /// token is decoded again for its logits, and as a token of the prompt it attends as a prompt batch does
  std::int64_t dense_next = 0;
  std::int64_t n_layer = 0, q_heads = 0, kv_heads = 0, head_dim = 0;

  // state
  std::unique_ptr<kvscore::CellBlockSelector> sel;
  std::vector<std::int32_t> cell_pos;       ///< [kv_size] the position a cell holds (-1: none)
  std::vector<std::int32_t> ubatch_pos;     ///< this ubatch's positions
  std::vector<std::int64_t> ubatch_cells;   ///< and the cells they are written to
  std::vector<const ggml_tensor*> q_src;    ///< per layer: the tensor holding this ubatch's query
  std::vector<std::vector<float>> q;        ///< per layer: its copy [q_heads][head_dim]
  std::vector<std::uint16_t> mask_row;      ///< this ubatch's original mask row (f16 bits), saved at layer 0
  std::vector<std::uint8_t> chosen;         ///< [kv_size] the latest layer's choice
  std::vector<std::vector<std::uint8_t>> chosen_by_layer;  ///< --check-attend: each layer's choice this step
  bool decode = false;                      ///< this ubatch is one token
  bool sparse_now = false;                  ///< and decodes sparsely
  std::string error;                        ///< the first inconsistency (the callback aborts the compute)

  // what was done
  std::int64_t steps = 0, decode_steps = 0, sparse_steps = 0, layer_calls = 0, attended = 0, visible = 0;
  std::int64_t checked = 0, check_mismatch = 0;
  double select_ms = 0;
  std::string k_type;  ///< the K cache's type, as the selector read it

  void start(std::int64_t layers, std::int64_t qh, std::int64_t kvh, std::int64_t d) {
    n_layer = layers;
    q_heads = qh;
    kv_heads = kvh;
    head_dim = d;
    q_src.assign(std::size_t(layers), nullptr);
    q.assign(std::size_t(layers), std::vector<float>(std::size_t(qh * d)));
    chosen_by_layer.assign(std::size_t(layers), {});
  }

  static int layer_of(const char* name, const char* prefix) {
    const std::size_t n = std::strlen(prefix);
    if (std::strncmp(name, prefix, n) != 0 || name[n] < '0' || name[n] > '9') return -1;
    char* end = nullptr;
    const long l = std::strtol(name + n, &end, 10);
    return *end == '\0' ? int(l) : -1;
  }
  static const ggml_tensor* root(const ggml_tensor* t) { return t->view_src ? t->view_src : t; }

  bool fail(const std::string& e) {
    if (error.empty()) error = e;
    return false;
  }

  /// The ask phase: whether to observe `t` (and the work done when asked about it).
  bool ask(ggml_tensor* t) {
    if (!error.empty()) return false;
    if (t->op == GGML_OP_ROPE) {
      const int l = layer_of(t->name, "Qcur-");
      if (l < 0 || l >= n_layer) return false;
      if (l == 0) begin_ubatch(t->src[1]);
      if (!decode) return false;
      q_src[std::size_t(l)] = t;
      return true;
    }
    if (t->op == GGML_OP_SET_ROWS && t->src[2] && std::strcmp(t->src[2]->name, "cache_k_l0") == 0) {
      written(t);
      return false;
    }
    if (t->op == GGML_OP_MUL_MAT && decode) {  // llama.cpp's rotation of Q for a quantised K cache
      for (int i = 0; i < 2; ++i) {
        const ggml_tensor* s = t->src[i] ? root(t->src[i]) : nullptr;
        for (std::int64_t l = 0; s && l < n_layer; ++l)
          if (q_src[std::size_t(l)] == s && s->op == GGML_OP_ROPE) {
            q_src[std::size_t(l)] = t;
            return true;
          }
      }
      return false;
    }
    if (t->op == GGML_OP_FLASH_ATTN_EXT && decode) {
      attention(t);
      return check && sparse_now;
    }
    return false;
  }

  /// The compute phase of an observed tensor.
  bool observed(ggml_tensor* t) {
    if (!error.empty()) return false;
    if (t->op == GGML_OP_FLASH_ATTN_EXT) return verify(t);
    for (std::int64_t l = 0; l < n_layer; ++l)
      if (q_src[std::size_t(l)] == t) {
        if (t->type != GGML_TYPE_F32 || ggml_nelements(t) != q_heads * head_dim || !ggml_is_contiguous(t))
          return fail(std::string("the query of layer ") + std::to_string(l) + " (" + t->name + ") is not " +
                      std::to_string(q_heads * head_dim) + " contiguous f32 values");
        ggml_backend_tensor_get(t, q[std::size_t(l)].data(), 0, std::size_t(q_heads * head_dim) * 4);
      }
    return true;
  }

  void begin_ubatch(const ggml_tensor* pos) {
    if (!pos || pos->type != GGML_TYPE_I32) {
      fail("Qcur-0's positions are not an I32 tensor");
      return;
    }
    const std::int64_t n = pos->ne[0];
    ubatch_pos.resize(std::size_t(n));
    ggml_backend_tensor_get(pos, ubatch_pos.data(), 0, std::size_t(n) * 4);
    ubatch_cells.clear();
    decode = n == 1 && dense_next == 0;
    if (n == 1 && dense_next > 0) --dense_next;
    decode_steps += decode;
    sparse_now = false;
    for (auto& s : q_src) s = nullptr;
    ++steps;
  }

  /// The sequence's cells were packed at the cache's front by a state load (kvscore_llama's repack
  /// after a --keep eviction): cell c now holds positions[c], every other cell is empty, and every
  /// block's summary is stale (made again when next a candidate).
  void repacked(const std::vector<std::int32_t>& positions) {
    if (!sel) {
      preloaded = positions;
      return;
    }
    if (positions.size() > cell_pos.size()) {
      fail("the repacked cells (" + std::to_string(positions.size()) + ") outnumber the cache's " +
           std::to_string(cell_pos.size()));
      return;
    }
    std::fill(cell_pos.begin(), cell_pos.end(), -1);
    std::copy(positions.begin(), positions.end(), cell_pos.begin());
    std::vector<std::int64_t> all(cell_pos.size());
    std::iota(all.begin(), all.end(), std::int64_t(0));
    sel->write(all);  // in flight until the next ubatch's write, stale after it
  }

  void written(const ggml_tensor* t) {
    const ggml_tensor* idx = t->src[1];
    const ggml_tensor* cache = t->src[2];
    if (idx->type != GGML_TYPE_I64 || idx->ne[0] != std::int64_t(ubatch_pos.size()) || cache->ne[2] != 1) {
      fail("cache_k_l0's SET_ROWS: unexpected indices (" + std::to_string(idx->ne[0]) + " for " +
           std::to_string(ubatch_pos.size()) + " positions) or more than one stream");
      return;
    }
    const std::int64_t kv_size = cache->ne[1];
    if (!sel) {
      if (std::int64_t(preloaded.size()) > kv_size) {
        fail("the loaded cells (" + std::to_string(preloaded.size()) + ") outnumber the cache's " + std::to_string(kv_size));
        return;
      }
      sel = std::make_unique<kvscore::CellBlockSelector>(n_layer, kv_size, kv_heads, head_dim, opt);
      cell_pos.assign(std::size_t(kv_size), -1);
      chosen.assign(std::size_t(kv_size), 0);
      std::copy(preloaded.begin(), preloaded.end(), cell_pos.begin());  // no summary yet: made when needed
    }
    ubatch_cells.resize(std::size_t(idx->ne[0]));
    ggml_backend_tensor_get(idx, ubatch_cells.data(), 0, ubatch_cells.size() * 8);
    for (std::size_t i = 0; i < ubatch_cells.size(); ++i) cell_pos[std::size_t(ubatch_cells[i])] = ubatch_pos[i];
    sel->write(ubatch_cells);
  }

  /// Layer l's choice, written into the mask before its attention runs.
  void attention(ggml_tensor* t) {
    const ggml_tensor* K = root(t->src[1]);
    ggml_tensor* mask = t->src[3];
    const int l = layer_of(K->name, "cache_k_l");
    if (l < 0 || l >= n_layer || !mask || !sel) {
      fail(std::string("a flash-attention node without a layer's cache K, a mask or a selector (K: ") + K->name + ")");
      return;
    }
    if (mask->type != GGML_TYPE_F16 || mask->ne[1] != 1 || !ggml_backend_buffer_is_host(mask->buffer) ||
        !ggml_backend_buffer_is_host(K->buffer)) {
      fail("layer " + std::to_string(l) + ": the KQ mask is not one f16 row in host memory, or the K cache is not");
      return;
    }
    const std::int64_t n_kv = mask->ne[0];
    auto* row = static_cast<std::uint16_t*>(mask->data);
    if (l == 0) {  // the step's own row; the cell map checked against it (a cell it masks was removed)
      mask_row.assign(row, row + n_kv);
      std::int64_t vis = 0;
      std::vector<std::int64_t> gone;
      for (std::int64_t c = 0; c < std::int64_t(cell_pos.size()); ++c) {
        const bool in_map = cell_pos[std::size_t(c)] >= 0;
        const bool in_mask = c < n_kv && mask_row[std::size_t(c)] != 0xFC00;
        if (in_mask && !in_map) {
          fail("cell " + std::to_string(c) + " is visible in llama.cpp's mask but was never written by a ubatch seen here");
          return;
        }
        if (in_map && !in_mask) {  // llama_memory_seq_rm took it
          cell_pos[std::size_t(c)] = -1;
          gone.push_back(c);
        }
        vis += in_mask;
      }
      if (!gone.empty()) {  // stale blocks; this ubatch's cells stay in flight
        gone.insert(gone.end(), ubatch_cells.begin(), ubatch_cells.end());
        sel->write(gone);
      }
      visible_now = vis;
      sparse_now = vis >= dense_below && (attend <= 1.0 || attend < double(vis));  // attend 1: every cell, rewritten
      if (sparse_now) ++sparse_steps;
    }
    if (!sparse_now) return;
    if (root(t->src[0]) != q_src[std::size_t(l)]) {
      fail("layer " + std::to_string(l) + ": flash attention's Q is not the observed Qcur (an unknown transform)");
      return;
    }
    kvscore::CellKeys keys{cell_type(K), K->data, K->ne[1], kv_heads, head_dim, std::int64_t(K->nb[1])};
    if (!error.empty()) return;
    k_type = kvscore::to_string(keys.type);
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t n;
    try {
      n = sel->select(l, keys, cell_pos, q[std::size_t(l)].data(), q_heads, attend, chosen);
    } catch (const std::exception& e) {
      fail(e.what());
      return;
    }
    for (std::int64_t c = 0; c < n_kv; ++c)
      row[c] = chosen[std::size_t(c)] || mask_row[std::size_t(c)] == 0xFC00 ? mask_row[std::size_t(c)] : std::uint16_t(0xFC00);
    select_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    ++layer_calls;
    attended += n;
    visible += visible_now;
    if (check) chosen_by_layer[std::size_t(l)] = chosen;
  }

  kvscore::CellKeyType cell_type(const ggml_tensor* K) {
    if (K->type == GGML_TYPE_F16) return kvscore::CellKeyType::f16;
    if (K->type == GGML_TYPE_F32) return kvscore::CellKeyType::f32;
    if (K->type == GGML_TYPE_Q8_0) return kvscore::CellKeyType::q8_0;
    fail(std::string("K cache type ") + ggml_type_name(K->type) + " is not f16, f32 or q8_0");
    return kvscore::CellKeyType::f16;
  }

  /// --check-attend: the mask as the kernel read it equals the reference choice from the query and
  /// the cache's keys (every summary made afresh), and the selector's own choice.
  bool verify(ggml_tensor* t) {
    const ggml_tensor* K = root(t->src[1]);
    const int l = layer_of(K->name, "cache_k_l");
    const auto* row = static_cast<const std::uint16_t*>(t->src[3]->data);
    const std::int64_t n_kv = t->src[3]->ne[0];
    std::vector<std::uint8_t> seen(cell_pos.size(), 0);
    for (std::int64_t c = 0; c < n_kv; ++c) seen[std::size_t(c)] = row[c] != 0xFC00;
    const kvscore::CellKeys keys{cell_type(K), K->data, K->ne[1], kv_heads, head_dim, std::int64_t(K->nb[1])};
    const std::vector<std::uint8_t> ref =
        kvscore::cell_block_reference(keys, cell_pos, ubatch_cells, q[std::size_t(l)].data(), q_heads, attend, opt);
    ++checked;
    if (seen != ref || seen != chosen_by_layer[std::size_t(l)]) {
      ++check_mismatch;
      std::int64_t a = 0, b = 0;
      for (std::size_t c = 0; c < seen.size(); ++c) a += seen[c], b += ref[c];
      std::fprintf(stderr, "attend check: layer %d step %lld: the mask attends %lld cells, the reference %lld (they differ)\n",
                   l, (long long)steps, (long long)a, (long long)b);
    }
    return true;
  }

  std::int64_t visible_now = 0;
};

}  // namespace kvscore_llama
