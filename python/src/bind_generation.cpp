// python/src/bind_generation.cpp — the layer-level decode caches of kvscore.generation
// (docs/guides/generation.md): ParisKVLayerCache<T> (ParisKV or exact top-k retrieval with zones) and
// OjaLayerCache (OjaKV's hybrid store), one object per attention layer, one call per layer per
// forward. Tensors arrive as 4-D [batch, heads, tokens, head_dim] arrays with any strides whose
// head_dim stride is 1 (a model's key_states / query_states are transposed views: read in
// place); outputs are written into a caller's float32 array. The GIL is released around work.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/ojakv/layer.hpp"
#include "kvscore/pariskv/layer.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using In = nb::ndarray<nb::ro, nb::device::cpu>;
using Out = nb::ndarray<float, nb::device::cpu>;

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument(what); }

template <class A>
kvscore::dtype elem_of(const A& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return kvscore::dtype::f32;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return kvscore::dtype::f16;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return kvscore::dtype::bf16;
  fail(what + ": dtype must be float32, float16 or bfloat16 (DLPack code " + std::to_string(t.code) + ", " +
       std::to_string(t.bits) + " bits)");
}

/// The strides of a [batch, heads, tokens, head_dim] array, checked against the expected sizes
/// (-1: any).
template <class A>
kvscore::LayerStrides layer_strides(const A& a, const std::string& what, std::int64_t batch, std::int64_t heads,
                                    std::int64_t tokens, std::int64_t d) {
  if (a.ndim() != 4) fail(what + ": expected [batch, heads, tokens, head_dim] (got " + std::to_string(a.ndim()) + " dimensions)");
  const std::int64_t want[4] = {batch, heads, tokens, d};
  const char* names[4] = {"batch", "heads", "tokens", "head_dim"};
  for (int i = 0; i < 4; ++i)
    if (want[i] >= 0 && std::int64_t(a.shape(std::size_t(i))) != want[i])
      fail(what + ": " + names[i] + " " + std::to_string(a.shape(std::size_t(i))) + ", expected " + std::to_string(want[i]));
  for (int i = 0; i < 4; ++i)
    if (a.stride(std::size_t(i)) < 0)
      fail(what + ": stride " + std::to_string(a.stride(std::size_t(i))) + " of dimension " + std::to_string(i) +
           " is negative (arrays are read in place)");
  if (a.shape(3) > 1 && a.stride(3) != 1)
    fail(what + ": head_dim stride is " + std::to_string(a.stride(3)) + " elements; it must be 1 (read in place)");
  return {a.stride(0), a.stride(1), a.stride(2)};
}

/// The arguments of a layer cache's forward (keys, values [batch, kv_heads, n, d] in the keys'
/// dtype, float32 queries [batch, q_heads, n, d], float32 out of the queries' shape), checked
/// against the cache's sizes.
struct ForwardArgs {
  kvscore::dtype elem;
  std::int64_t n, q_heads;
  kvscore::LayerStrides ks, vs, qs, os;
};

template <class C>
ForwardArgs forward_args(const C& c, const In& keys, const In& values, const In& queries, const Out& out,
                         const std::string& who) {
  ForwardArgs a{};
  a.elem = elem_of(keys, who + ": keys");
  if (elem_of(values, who + ": values") != a.elem) fail(who + ": keys and values must have the same dtype");
  if (elem_of(queries, who + ": queries") != kvscore::dtype::f32) fail(who + ": queries must be float32");
  a.ks = layer_strides(keys, who + ": keys", c.batch(), c.kv_heads(), -1, c.head_dim());
  a.n = std::int64_t(keys.shape(2));
  a.vs = layer_strides(values, who + ": values", c.batch(), c.kv_heads(), a.n, c.head_dim());
  a.qs = layer_strides(queries, who + ": queries", c.batch(), -1, a.n, c.head_dim());
  a.q_heads = std::int64_t(queries.shape(1));
  a.os = layer_strides(out, who + ": out", c.batch(), a.q_heads, a.n, c.head_dim());
  return a;
}

// ------------------------------------------------------------------ ParisKV

template <class T>
void bind_pariskv_layer(nb::module_& m, const char* name) {
  using C = kvscore::ParisKVLayerCache<T>;
  const kvscore::ParisKVCacheConfig def;
  nb::class_<C>(m, name)
      .def("__init__",
           [](C* self, std::int64_t batch, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t sinks,
              std::int64_t local, std::int64_t update_interval, std::int64_t k, bool exact, double scale, double beta,
              double rho, std::int64_t rerank_exact, std::int64_t dense_below) {
             kvscore::ParisKVCacheConfig c;
             c.sinks = sinks;
             c.local = local;
             c.update_interval = update_interval;
             // dense_below 0: never dense, a fixed budget of sinks + k + the local zone;
             // otherwise dense while N < max(dense_below, sinks + local + 2k)
             if (dense_below < 0) fail("ParisKVLayerCache: dense_below " + std::to_string(dense_below) + " must be >= 0");
             c.dense_fallback = dense_below > 0;
             c.dense_min = dense_below;
             c.search.k = k;
             c.search.beta = beta;
             c.search.rho = rho;
             c.search.rerank_exact = rerank_exact;
             c.retrieval = exact ? kvscore::ParisKVRetrieval::exact : kvscore::ParisKVRetrieval::index;
             c.scale = scale;
             new (self) C(batch, kv_heads, head_dim, c);
           },
           "batch"_a, "kv_heads"_a, "head_dim"_a, "sinks"_a = def.sinks, "local"_a = def.local,
           "update_interval"_a = def.update_interval, "k"_a = def.search.k, "exact"_a = false,
           "scale"_a = def.scale, "beta"_a = def.search.beta, "rho"_a = def.search.rho,
           "rerank_exact"_a = def.search.rerank_exact, "dense_below"_a = 0)
      .def_prop_ro("size", &C::size)
      .def_prop_ro("batch", &C::batch)
      .def_prop_ro("kv_heads", &C::kv_heads)
      .def_prop_ro("head_dim", &C::head_dim)
      .def_prop_ro("memory_bytes", &C::memory_bytes)
      .def_prop_ro("local_begin", [](const C& c) { return c.head(0, 0).local_begin(); })
      .def_prop_ro("indexed", [](const C& c) { return c.head(0, 0).indexed(); })
      .def_prop_ro("dense", [](const C& c) { return c.head(0, 0).dense(); })
      .def_prop_ro("dense_threshold", [](const C& c) { return c.head(0, 0).dense_threshold(); })
      .def_rw("num_threads", &C::num_threads)
      .def(
          "append",
          [](C& c, const In& keys, const In& values) {
            const std::string who = "ParisKVLayerCache.append";
            if (elem_of(keys, who + ": keys") != kvscore::dtype_of<T>() || elem_of(values, who + ": values") != kvscore::dtype_of<T>())
              fail(who + ": keys and values must have the cache's dtype");
            const kvscore::LayerStrides ks = layer_strides(keys, who + ": keys", c.batch(), c.kv_heads(), -1, c.head_dim());
            const std::int64_t n = std::int64_t(keys.shape(2));
            const kvscore::LayerStrides vs = layer_strides(values, who + ": values", c.batch(), c.kv_heads(), n, c.head_dim());
            const T* k = static_cast<const T*>(keys.data());
            const T* v = static_cast<const T*>(values.data());
            nb::gil_scoped_release unlocked;
            c.append(k, v, n, ks, vs);
          },
          "keys"_a, "values"_a, "Appends keys and values [batch, kv_heads, n, head_dim] (the prefill).")
      .def(
          "forward",
          [](C& c, const In& keys, const In& values, const In& queries, Out& out) {
            const std::string who = "ParisKVLayerCache.forward";
            const ForwardArgs a = forward_args(c, keys, values, queries, out, who);
            if (a.elem != kvscore::dtype_of<T>()) fail(who + ": keys and values must have the cache's dtype");
            const T* k = static_cast<const T*>(keys.data());
            const T* v = static_cast<const T*>(values.data());
            const float* q = static_cast<const float*>(queries.data());
            float* o = out.data();
            nb::gil_scoped_release unlocked;
            c.forward(k, v, q, a.q_heads, a.n, a.ks, a.vs, a.qs, o, a.os);
          },
          "keys"_a, "values"_a, "queries"_a, "out"_a,
          "n new tokens: append token i, attend with queries[:, :, i] (float32 [batch, q_heads, n, head_dim]) "
          "into out (float32, the same shape, any strides).")
      .def(
          "positions",
          [](const C& c, std::int64_t b, std::int64_t j) {
            const std::vector<std::int64_t>& p = c.positions(b, j);
            auto* data = new std::int64_t[p.size()];
            std::copy(p.begin(), p.end(), data);
            nb::capsule owner(data, [](void* x) noexcept { delete[] static_cast<std::int64_t*>(x); });
            return nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>(data, {p.size()}, owner);
          },
          "row"_a, "query_head"_a, "The positions query head j of row b attended in the last forward (ascending).")
      .def("crop", &C::crop, "n"_a, "Keeps the first n tokens.");
}

// ------------------------------------------------------------------ OjaKV

void bind_ojakv_layer(nb::module_& m) {
  using C = kvscore::OjaLayerCache;
  const kvscore::OjaLayerConfig def;
  nb::class_<C>(m, "OjaLayerCache")
      .def("__init__",
           [](C* self, std::int64_t batch, std::int64_t kv_heads, std::int64_t head_dim, std::int64_t rank_k,
              std::int64_t rank_v, std::int64_t anchors, std::int64_t sinks, std::int64_t window, std::uint64_t seed,
              double scale, std::int64_t period, std::int64_t pool, double full_rank_fraction, bool adapt) {
             kvscore::OjaLayerConfig c;
             c.rank_k = rank_k;
             c.rank_v = rank_v;
             c.anchors = anchors;
             c.sinks = sinks;
             c.window = window;
             c.seed = seed;
             c.scale = scale;
             c.options.period = period;
             c.options.pool = pool;
             c.decode.full_rank_fraction = full_rank_fraction;
             c.decode.adapt = adapt;
             new (self) C(batch, kv_heads, head_dim, c);
           },
           "batch"_a, "kv_heads"_a, "head_dim"_a, "rank_k"_a = def.rank_k, "rank_v"_a = def.rank_v,
           "anchors"_a = def.anchors, "sinks"_a = def.sinks, "window"_a = def.window, "seed"_a = def.seed,
           "scale"_a = def.scale, "period"_a = def.options.period, "pool"_a = def.options.pool,
           "full_rank_fraction"_a = def.decode.full_rank_fraction, "adapt"_a = def.decode.adapt)
      .def_prop_ro("size", &C::size)
      .def_prop_ro("batch", &C::batch)
      .def_prop_ro("kv_heads", &C::kv_heads)
      .def_prop_ro("head_dim", &C::head_dim)
      .def_prop_ro("rank_k", [](const C& c) { return c.config().rank_k; })
      .def_prop_ro("rank_v", [](const C& c) { return c.config().rank_v; })
      .def_prop_ro("stored_bytes", &C::stored_bytes)
      .def_rw("num_threads", &C::num_threads)
      .def(
          "memory",
          [](const C& c, std::int64_t bytes_per_scalar) {
            const kvscore::OjaMemory x = c.memory(bytes_per_scalar);
            nb::dict d;
            d["full_bytes"] = x.full_bytes;
            d["hybrid_bytes"] = x.hybrid_bytes;
            d["ratio"] = x.ratio;
            return d;
          },
          "bytes_per_scalar"_a, "{'full_bytes', 'hybrid_bytes', 'ratio'}: the paper's formula (docs/methods/ojakv.md).")
      .def(
          "full_rank_positions",
          [](const C& c, std::int64_t b, std::int64_t h) {
            const std::vector<std::int64_t>& p = c.store(b).head(h).full_pos;
            auto* data = new std::int64_t[p.size()];
            std::copy(p.begin(), p.end(), data);
            nb::capsule owner(data, [](void* x) noexcept { delete[] static_cast<std::int64_t*>(x); });
            return nb::ndarray<nb::numpy, std::int64_t, nb::ndim<1>>(data, {p.size()}, owner);
          },
          "row"_a, "kv_head"_a, "Positions held at full rank in closed blocks (ascending).")
      .def(
          "prefill",
          [](C& c, const In& keys, const In& values, const In& queries) {
            const std::string who = "OjaLayerCache.prefill";
            const kvscore::dtype e = elem_of(keys, who + ": keys");
            if (elem_of(values, who + ": values") != e) fail(who + ": keys and values must have the same dtype");
            if (elem_of(queries, who + ": queries") != kvscore::dtype::f32) fail(who + ": queries must be float32");
            const kvscore::LayerStrides ks = layer_strides(keys, who + ": keys", c.batch(), c.kv_heads(), -1, c.head_dim());
            const std::int64_t n = std::int64_t(keys.shape(2));
            const kvscore::LayerStrides vs = layer_strides(values, who + ": values", c.batch(), c.kv_heads(), n, c.head_dim());
            const kvscore::LayerStrides qs = layer_strides(queries, who + ": queries", c.batch(), -1, -1, c.head_dim());
            const std::int64_t q_heads = std::int64_t(queries.shape(1)), w = std::int64_t(queries.shape(2));
            const float* q = static_cast<const float*>(queries.data());
            kvscore::visit_dtype(e, [&]<class T>(std::type_identity<T>) {
              const T* k = static_cast<const T*>(keys.data());
              const T* v = static_cast<const T*>(values.data());
              nb::gil_scoped_release unlocked;
              c.prefill(k, v, n, ks, vs, q, q_heads, w, qs);
            });
          },
          "keys"_a, "values"_a, "queries"_a,
          "The prompt [batch, kv_heads, n, head_dim] and its last w queries (float32 [batch, q_heads, w, head_dim]).")
      .def(
          "forward",
          [](C& c, const In& keys, const In& values, const In& queries, Out& out) {
            const ForwardArgs a = forward_args(c, keys, values, queries, out, "OjaLayerCache.forward");
            const float* q = static_cast<const float*>(queries.data());
            float* o = out.data();
            kvscore::visit_dtype(a.elem, [&]<class T>(std::type_identity<T>) {
              const T* k = static_cast<const T*>(keys.data());
              const T* v = static_cast<const T*>(values.data());
              nb::gil_scoped_release unlocked;
              c.forward(k, v, q, a.q_heads, a.n, a.ks, a.vs, a.qs, o, a.os);
            });
          },
          "keys"_a, "values"_a, "queries"_a, "out"_a, "n new tokens: append token i, attend with queries[:, :, i].")
      .def("crop", &C::crop, "n"_a, "Keeps the first n tokens (only tokens of the open block can go).");
}

}  // namespace

void bind_generation(nb::module_& m) {
  // the defaults kvscore.generation's signatures read (python/tests/test_tree.py: none written in Python)
  const kvscore::OjaLayerConfig oc;
  nb::dict oja;
  oja["window"] = oc.window;
  oja["sinks"] = oc.sinks;
  oja["seed"] = oc.seed;
  oja["period"] = oc.options.period;
  oja["pool"] = oc.options.pool;
  oja["full_rank_fraction"] = oc.decode.full_rank_fraction;
  oja["adapt"] = oc.decode.adapt;
  nb::dict d;
  d["OjaLayerConfig"] = oja;
  m.attr("generation_defaults") = d;
  m.def("retrieval_dense_below", &kvscore::retrieval_dense_below, "head_dim"_a,
        "Cache length below which RetrievalCache attends densely by default (docs/guides/generation.md).");
  bind_pariskv_layer<float>(m, "ParisKVLayerCacheF32");
  bind_pariskv_layer<kvscore::half>(m, "ParisKVLayerCacheF16");
  bind_pariskv_layer<kvscore::bfloat16>(m, "ParisKVLayerCacheBF16");
  bind_ojakv_layer(m);
}
