// kvscore/eval/inputs.hpp — the evaluator's inputs as a front end holds them: whole fp32 tensors
// K, V, Q (and the leak-free protocol's window and calibration queries), checked against each
// other once and cut into one LayerInput per layer. `kvscore eval` (tools/cmd_eval.cpp) and
// Python's kvscore.evaluate (python/src/kvscore_ext.cpp) both call layer_inputs().
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvscore/eval/methods.hpp"

namespace kvscore::eval {

/// One input tensor: fp32, C order, [heads, n, dim] (one layer) or [layers, heads, n, dim].
struct EvalTensor {
  const float* data = nullptr;      ///< null: absent (the window and calibration queries only)
  std::vector<std::int64_t> shape;  ///< [heads, n, dim] or [layers, heads, n, dim]
  std::string name;                 ///< what errors call it: a path, or the argument's name
};

/// K [.., kv_heads, tokens, d], V [.., kv_heads, tokens, dv], Q [.., q_heads, n_q, d]; the
/// optional window queries W and calibration queries C are shaped like Q (n_w, n_c >= 1).
struct EvalInputs {
  EvalTensor keys;     ///< K
  EvalTensor values;   ///< V
  EvalTensor queries;  ///< Q, the evaluation queries
  EvalTensor window;   ///< W, the cache's last-window queries (leak-free; optional)
  EvalTensor calib;    ///< C, calibration queries from other text (optional)
};

namespace detail {
inline std::string shape_text(const std::vector<std::int64_t>& s) {
  std::string o = "[";
  for (std::size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}
}  // namespace detail

/// Checks the shapes of `in` against each other (std::invalid_argument naming the tensor and
/// both shapes) and returns one LayerInput per layer, pointing into the tensors.
inline std::vector<LayerInput> layer_inputs(const EvalInputs& in) {
  using detail::shape_text;
  const EvalTensor &K = in.keys, &V = in.values, &Q = in.queries, &W = in.window, &C = in.calib;
  const std::size_t rank = K.shape.size();
  if (rank != 3 && rank != 4)
    throw std::invalid_argument(K.name + ": keys must be [kv_heads, tokens, d] or [layers, kv_heads, tokens, d], got " +
                                shape_text(K.shape));
  if (V.shape.size() != rank)
    throw std::invalid_argument(V.name + ": values " + shape_text(V.shape) + " must have the rank of keys " +
                                shape_text(K.shape));
  if (Q.shape.size() != rank)
    throw std::invalid_argument(Q.name + ": queries " + shape_text(Q.shape) + " must have the rank of keys " +
                                shape_text(K.shape) + " (" +
                                (rank == 3 ? "[q_heads, n_q, d]" : "[layers, q_heads, n_q, d]") + ")");
  const std::size_t o = rank - 3;  // offset of the per-layer dims
  const std::int64_t L = rank == 4 ? K.shape[0] : 1, H = K.shape[o], N = K.shape[o + 1], d = K.shape[o + 2];
  const std::int64_t dv = V.shape[o + 2], Hq = Q.shape[o], nq = Q.shape[o + 1];
  if (L < 1 || H < 1 || N < 1 || d < 1)
    throw std::invalid_argument(K.name + ": keys " + shape_text(K.shape) + " must have no empty dimension");
  if ((rank == 4 && V.shape[0] != L) || V.shape[o] != H || V.shape[o + 1] != N || dv < 1)
    throw std::invalid_argument(V.name + ": values " + shape_text(V.shape) + " do not match keys " +
                                shape_text(K.shape) + " (same layers, kv_heads and tokens; dv >= 1)");
  if ((rank == 4 && Q.shape[0] != L) || Q.shape[o + 2] != d || nq < 1)
    throw std::invalid_argument(Q.name + ": queries " + shape_text(Q.shape) + " do not match keys " +
                                shape_text(K.shape) + " (same layers and head_dim, n_q >= 1)");
  if (Hq < 1 || Hq % H != 0)
    throw std::invalid_argument(Q.name + ": q_heads " + std::to_string(Hq) + " is not a multiple of the " +
                                std::to_string(H) + " kv_heads of " + K.name);
  // window or calibration queries: Q's rank, layers, query heads and head_dim
  const auto like_q = [&](const EvalTensor& t, const char* what) -> std::int64_t {
    if (t.data == nullptr) return 0;
    if (t.shape.size() != rank || (rank == 4 && t.shape[0] != Q.shape[0]) || t.shape[o] != Q.shape[o] ||
        t.shape[o + 2] != Q.shape[o + 2] || t.shape[o + 1] < 1)
      throw std::invalid_argument(t.name + ": " + what + " " + shape_text(t.shape) + " do not match queries " +
                                  shape_text(Q.shape) + " of " + Q.name +
                                  " (same layers, q_heads and head_dim; n >= 1)");
    return t.shape[o + 1];
  };
  const std::int64_t nw = like_q(W, "window queries"), nc = like_q(C, "calibration queries");
  if (nw > N)
    throw std::invalid_argument(W.name + ": " + std::to_string(nw) + " window queries, but they are the cache's last "
                                "positions and the cache has " + std::to_string(N) + " tokens");
  std::vector<LayerInput> layers;
  for (std::int64_t l = 0; l < L; ++l) {
    LayerInput li{K.data + l * H * N * d, V.data + l * H * N * dv, Q.data + l * Hq * nq * d, H, N, d, dv, Hq, nq};
    if (nw > 0) li.window_queries = W.data + l * Hq * nw * d, li.n_window = nw;
    if (nc > 0) li.calib_queries = C.data + l * Hq * nc * d, li.n_calib = nc;
    layers.push_back(li);
  }
  return layers;
}

}  // namespace kvscore::eval
