// python/src/bind_vllm.cpp — the paged and block-joint part of kvscore._kvscore that the vLLM
// plugin (python/kvscore/vllm, docs/guides/vllm.md) calls: vLLM CPU's key cache read in place
// (kvscore::TransposedPagedKeysView, or AmxPagedKeysView for the `amx` ISA: every function that
// reads a cache takes the layer's `isa`), scored by any scorer of the registry on every layer, the
// per-rank partial of the joint block scores (kvscore::joint_partial) and the one decision
// made from all ranks' partials (combine_partials, block_scores, select_blocks); also
// select_joint_blocks on plain score arrays; and block-sparse decode, PagedBlockSelector: a thin
// wrapper of kvscore::BlockSparsePlanner (kvscore/block_sparse/planner.hpp) that converts the
// arrays, releases the GIL and calls it. Registered by kvscore_ext.cpp (bind_vllm). Defaults come
// from kvscore::BlockJointOptions and kvscore::BlockSparseOptions; errors are
// std::invalid_argument (ValueError).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "kvscore/block_sparse.hpp"
#include "kvscore/core/parallel.hpp"
#include "kvscore/joint.hpp"
#include "kvscore/make_scorer.hpp"
#include "kvscore/paged.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using kvscore::py::Any;
using kvscore::py::bad;
using kvscore::py::DT;
using kvscore::py::to_numpy;

/// The element type of a vLLM cache: arrays.hpp's dtype_of, naming fp8 (vLLM's quantised caches).
DT dtype_of(const Any& a, const std::string& what) {
  try {
    return kvscore::py::dtype_of(a, what);
  } catch (const std::invalid_argument& e) {
    bad(std::string(e.what()) + " (vLLM's fp8 KV caches are not read)");
  }
}

void require_c_contiguous(const Any& a, const std::string& what) {
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect)
      bad(what + ": must be C-contiguous (stride " + std::to_string(a.stride(i)) + " of dimension " +
          std::to_string(i) + ", expected " + std::to_string(expect) + ")");
    expect *= std::int64_t(a.shape(i));
  }
}

/// A 1-D int32 or int64 block table, copied to int64 (a few hundred entries).
std::vector<std::int64_t> block_ids_of(const Any& a, const std::string& what) {
  if (a.ndim() != 1) bad(what + ": expected 1 dimension (got " + std::to_string(a.ndim()) + ")");
  const nb::dlpack::dtype t = a.dtype();
  if (t.code != std::uint8_t(nb::dlpack::dtype_code::Int) || (t.bits != 32 && t.bits != 64))
    bad(what + ": must be int32 or int64");
  std::vector<std::int64_t> ids(a.shape(0));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const auto* base = static_cast<const unsigned char*>(a.data()) + std::int64_t(i) * a.stride(0) * (t.bits / 8);
    ids[i] = t.bits == 32 ? std::int64_t(*reinterpret_cast<const std::int32_t*>(base))
                          : *reinterpret_cast<const std::int64_t*>(base);
  }
  return ids;
}

/// One layer of vLLM CPU's cache: [num_blocks, kv_heads, block_size, 2 * head_dim], C order, its
/// keys in the layout its CPU attention ISA writes.
struct Layer {
  DT dt = DT::f32;
  kvscore::VllmCpuKeyLayout keys = kvscore::VllmCpuKeyLayout::transposed;
  const void* data = nullptr;
  std::int64_t blocks = 0, heads = 0, block_size = 0, head_dim = 0;
};

template <class F>
auto with_view(const Layer& L, const kvscore::BlockTable& t, F&& f) {
  return kvscore::visit_dtype(L.dt, [&]<class T>(std::type_identity<T>) {
    return kvscore::visit_vllm_cpu_keys(L.keys, static_cast<const T*>(L.data), L.heads, L.head_dim, t, f);
  });
}

/// `isa`: the layer's CPU attention ISA (vLLM's layer.isa; "vec", "vec16", "amx", ...). The
/// layout's own requirements (amx: block_size a multiple of 16) are checked here.
Layer vllm_layer(const Any& a, const std::string& what, const std::string& isa) {
  if (a.ndim() != 4)
    bad(what + ": expected vLLM CPU's [num_blocks, kv_heads, block_size, 2 * head_dim] (got " +
        std::to_string(a.ndim()) + " dimensions)");
  Layer L;
  L.dt = dtype_of(a, what);
  require_c_contiguous(a, what);
  if (a.shape(3) % 2 != 0) bad(what + ": last dimension " + std::to_string(a.shape(3)) + " must be 2 * head_dim");
  L.data = a.data();
  L.blocks = std::int64_t(a.shape(0));
  L.heads = std::int64_t(a.shape(1));
  L.block_size = std::int64_t(a.shape(2));
  L.head_dim = std::int64_t(a.shape(3)) / 2;
  try {
    L.keys = kvscore::vllm_cpu_key_layout(isa, L.dt);
    static const std::vector<std::int64_t> none;
    with_view(L, kvscore::BlockTable(std::span<const std::int64_t>(none), L.block_size, L.blocks, 0),
              [](const auto&) { return 0; });
  } catch (const std::invalid_argument& e) {
    bad(what + ": " + e.what());
  }
  return L;
}

nb::tuple partial_out(kvscore::JointPartial&& p) {
  const std::size_t n = std::size_t(p.tokens);
  return nb::make_tuple(to_numpy(std::move(p.max), {n}), to_numpy(std::move(p.sum), {n}),
                        to_numpy(std::move(p.count), {n}));
}

template <class T>
std::vector<T> vector_of(nb::handle h, const std::string& what) {
  nb::ndarray<nb::ro, nb::device::cpu, T, nb::ndim<1>> a;
  if (!nb::try_cast(h, a)) bad(what + ": expected a 1-D " + (sizeof(T) == 4 ? "float32" : "float64/int64") + " array");
  std::vector<T> v(a.shape(0));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = a(i);
  return v;
}

/// A partial back from Python: (max float32 [T], sum float64 [T], count int64 [T]).
kvscore::JointPartial partial_in(nb::handle h, const std::string& what) {
  nb::tuple t;
  if (!nb::try_cast(h, t) || t.size() != 3) bad(what + ": expected a (max, sum, count) tuple of joint_partial");
  kvscore::JointPartial p;
  p.max = vector_of<float>(t[0], what + "[0] max");
  p.sum = vector_of<double>(t[1], what + "[1] sum");
  p.count = vector_of<std::int64_t>(t[2], what + "[2] count");
  p.tokens = std::int64_t(p.max.size());
  return p;
}

/// fp32 [heads, tokens] score arrays (C order), one per layer.
std::vector<kvscore::ConstScoresView> score_views(const std::vector<Any>& layers) {
  std::vector<kvscore::ConstScoresView> v;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const std::string what = "scores[" + std::to_string(l) + "] [heads, tokens]";
    const Any& a = layers[l];
    if (a.ndim() != 2) bad(what + ": expected 2 dimensions (got " + std::to_string(a.ndim()) + ")");
    if (dtype_of(a, what) != DT::f32) bad(what + ": must be float32 (kvscore's scores are fp32)");
    require_c_contiguous(a, what);
    v.emplace_back(static_cast<const float*>(a.data()), std::int64_t(a.shape(0)),
                   std::int64_t(a.shape(1)), std::int64_t(a.shape(1)));
  }
  return v;
}

kvscore::BlockJointOptions block_options(std::int64_t sinks, std::int64_t recent, const std::string& aggregate,
                                         const std::string& block_aggregate, int threads) {
  kvscore::BlockJointOptions o;
  o.sinks = sinks;
  o.recent = recent;
  o.aggregate = kvscore::parse_joint_aggregate(aggregate);
  o.block_aggregate = kvscore::parse_block_aggregate(block_aggregate);
  o.num_threads = threads;
  return o;
}

/// kvscore::BlockSparseOptions from the Python names (an unknown score or group: ValueError).
kvscore::BlockSparseOptions sparse_options(const std::string& score, std::int64_t sinks, std::int64_t local, float scale,
                                           std::int64_t prefilter, const std::string& group, std::int64_t refresh,
                                           int threads, bool probe) {
  kvscore::BlockSparseOptions o;
  o.score = kvscore::parse_block_score(score);
  o.sinks = sinks;
  o.local = local;
  o.scale = scale;
  o.prefilter = prefilter;
  o.group = kvscore::parse_query_group(group);
  o.refresh = refresh;
  o.num_threads = threads;
  o.probe = probe;
  return o;
}

/// A 2-D int32 block table [rows, max_blocks] with unit stride along its rows.
template <class A>
kvscore::BlockTableRows table32(const A& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (a.ndim() != 2 || t.code != std::uint8_t(nb::dlpack::dtype_code::Int) || t.bits != 32 || t.lanes != 1)
    bad(what + ": expected a 2-D int32 block table (vLLM's)");
  if (a.shape(1) > 1 && a.stride(1) != 1) bad(what + ": its rows must be contiguous (stride " + std::to_string(a.stride(1)) + ")");
  return {static_cast<const std::int32_t*>(a.data()), std::int64_t(a.shape(0)), std::int64_t(a.shape(1)),
          std::int64_t(a.shape(0) > 1 ? a.stride(0) : a.shape(1))};
}

kvscore::KeyCache key_cache(const Layer& L) {
  return {L.dt, kvscore::key_cache_layout(L.keys), L.data, L.blocks, L.heads, L.block_size, L.head_dim};
}

/// A layer's queries [num_tokens, q_heads, head_dim] (any float dtype and strides).
kvscore::QueryTensor query_tensor(const Any& q, std::int64_t head_dim) {
  if (q.ndim() != 3 || std::int64_t(q.shape(2)) != head_dim)
    bad("query: expected [num_tokens, q_heads, " + std::to_string(head_dim) + "] (got " + std::to_string(q.ndim()) +
        " dimensions)");
  kvscore::QueryTensor t;
  t.dt = dtype_of(q, "query");
  t.data = q.data();
  t.tokens = std::int64_t(q.shape(0));
  t.heads = std::int64_t(q.shape(1));
  t.head_dim = std::int64_t(q.shape(2));
  for (std::size_t i = 0; i < 3; ++i) t.stride[i] = std::int64_t(q.stride(i));
  return t;
}

/// kvscore::BlockSparsePlanner over vLLM CPU's caches (the block-sparse decode of kvscore.vllm):
/// the arrays converted, the GIL released, the planner called. What the binding adds: the Python
/// objects the planner reads (the caches, a step's src and dst) are held as long as it reads them,
/// and a layer's registered cache is recognised by identity, so that select_planned converts only
/// the layer's query (inside a forward each conversion of a torch tensor costs ~7 us with its
/// caches cold: docs/reference/block_sparse.md).
class VllmBlockSelector {
 public:
  VllmBlockSelector(std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads, std::int64_t head_dim,
                    std::int64_t block_size, const kvscore::BlockSparseOptions& o, std::string isa)
      : planner_(layers, num_blocks, kv_heads, head_dim, block_size, o), isa_(std::move(isa)) {}

  kvscore::PagedBlockSelector& get() noexcept { return planner_.selector(); }

  void begin_step(const Any& slots, const Any& live) {
    const std::vector<std::int64_t> s = block_ids_of(slots, "slot_mapping");
    const std::vector<std::int64_t> l = block_ids_of(live, "live");
    src_ref_ = {};
    dst_ref_ = {};
    nb::gil_scoped_release unlocked;
    planner_.begin_step(s, l);
  }

  void register_caches(const nb::list& caches) {
    if (std::int64_t(caches.size()) != planner_.selector().layers())
      bad("caches: " + std::to_string(caches.size()) + " given, the selector has " +
          std::to_string(planner_.selector().layers()) + " layers");
    std::vector<nb::object> objs;
    std::vector<kvscore::KeyCache> layers;
    for (std::size_t l = 0; l < caches.size(); ++l) {
      const std::string what = "caches[" + std::to_string(l) + "]";
      Any a;
      if (!nb::try_cast(caches[l], a)) bad(what + ": expected a CPU array");
      layers.push_back(key_cache(vllm_layer(a, what, isa_)));
      objs.push_back(nb::borrow(caches[l]));
    }
    planner_.register_caches(std::move(layers));
    cache_objs_ = std::move(objs);
  }

  void plan(const Any& token_index, const Any& src, const Any& rows, const Any& tokens, const Any& attend,
            const nb::ndarray<std::int32_t, nb::ndim<2>, nb::device::cpu>& dst, const std::optional<Any>& seqs) {
    const kvscore::BlockTableRows S = table32(src, "src");
    if (dst.shape(1) > 1 && dst.stride(1) != 1) bad("dst: its rows must be contiguous");
    const kvscore::MutableBlockTableRows D{dst.data(), std::int64_t(dst.shape(0)), std::int64_t(dst.shape(1)),
                                           dst.shape(0) > 1 ? std::int64_t(dst.stride(0)) : std::int64_t(dst.shape(1))};
    planner_.plan(block_ids_of(token_index, "token_index"), S, block_ids_of(rows, "rows"), block_ids_of(tokens, "tokens"),
                  block_ids_of(attend, "attend"), D,
                  seqs ? block_ids_of(*seqs, "seqs") : std::vector<std::int64_t>{});
    src_ref_ = src;  // src and dst live as long as the plan
    dst_ref_ = dst;
  }

  std::int64_t select_planned(std::int64_t layer, nb::handle kv_cache, const Any& query) {
    const bool known = layer >= 0 && std::size_t(layer) < cache_objs_.size() && kv_cache.is(cache_objs_[std::size_t(layer)]);
    const kvscore::QueryTensor q = query_tensor(query, planner_.selector().head_dim());
    if (known) {
      nb::gil_scoped_release unlocked;
      return planner_.select_planned(layer, q);
    }
    Any a;
    if (!nb::try_cast(kv_cache, a)) bad("kv_cache: expected a CPU array");
    const kvscore::KeyCache c = key_cache(vllm_layer(a, "kv_cache", isa_));
    nb::gil_scoped_release unlocked;
    return planner_.select_planned(layer, c, q);
  }

  nb::ndarray<nb::numpy, std::uint8_t> select(std::int64_t layer, const Any& kv_cache, const Any& query,
                                              const Any& token_index, const Any& src, const Any& rows,
                                              const Any& tokens, const Any& attend,
                                              const nb::ndarray<std::int32_t, nb::ndim<2>, nb::device::cpu>& dst) {
    const kvscore::KeyCache c = key_cache(vllm_layer(kv_cache, "kv_cache", isa_));
    plan(token_index, src, rows, tokens, attend, dst, std::nullopt);
    const kvscore::QueryTensor q = query_tensor(query, planner_.selector().head_dim());
    {
      nb::gil_scoped_release unlocked;
      planner_.select_planned(layer, c, q);
    }
    return fresh();
  }

  nb::ndarray<nb::numpy, std::uint8_t> fresh() const {
    const std::span<const std::uint8_t> f = planner_.fresh();
    std::vector<std::uint8_t> v(f.begin(), f.end());
    const std::size_t n = v.size();
    return to_numpy(std::move(v), {n});
  }

 private:
  kvscore::BlockSparsePlanner planner_;
  std::string isa_;  // every layer's CPU attention ISA (one backend per engine)
  std::vector<nb::object> cache_objs_;
  Any src_ref_;
  nb::ndarray<std::int32_t, nb::ndim<2>, nb::device::cpu> dst_ref_;
};

}  // namespace

void bind_vllm(nb::module_& m) {
  const kvscore::BlockJointOptions def{};
  const std::string agg(kvscore::joint_aggregate_name(def.aggregate));
  const std::string bagg(kvscore::block_aggregate_name(def.block_aggregate));

  m.def("protected_blocks", &kvscore::protected_blocks, "tokens"_a, "block_size"_a, "sinks"_a, "recent"_a,
        "kvscore::protected_blocks: blocks select_blocks always keeps (sinks, recent, a partial last block).");

  m.def(
      "vllm_cpu_key_layout",
      [](const std::string& isa, const Any& kv_cache) {
        const kvscore::VllmCpuKeyLayout l = kvscore::vllm_cpu_key_layout(isa, dtype_of(kv_cache, "kv_cache"));
        return std::string(l == kvscore::VllmCpuKeyLayout::amx ? "amx" : "transposed");
      },
      "isa"_a, "kv_cache"_a,
      "kvscore::vllm_cpu_key_layout: the key layout vLLM CPU's attention ISA `isa` writes into a cache of\n"
      "kv_cache's dtype, \"transposed\" (vec, vec16; neon fp32/fp16) or \"amx\"; ValueError naming any other.");

  m.def(
      "vllm_cpu_keys",
      [](const Any& kv_cache, const Any& block_ids, std::int64_t tokens, const std::string& isa) {
        const Layer L = vllm_layer(kv_cache, "kv_cache", isa);
        const std::vector<std::int64_t> ids = block_ids_of(block_ids, "block_ids");
        const kvscore::BlockTable t(std::span<const std::int64_t>(ids), L.block_size, L.blocks, tokens);
        std::vector<float> out(std::size_t(L.heads * tokens * L.head_dim));
        with_view(L, t, [&](const auto& v) {
          for (std::int64_t h = 0; h < v.heads(); ++h)
            v.for_each_run(h, [&](const auto* rows, std::int64_t t0, std::int64_t n, std::int64_t stride) {
              for (std::int64_t i = 0; i < n; ++i)
                for (std::int64_t j = 0; j < L.head_dim; ++j)
                  out[std::size_t((h * tokens + t0 + i) * L.head_dim + j)] = kvscore::to_float(rows[i * stride + j]);
            });
          return 0;
        });
        return to_numpy(std::move(out), {std::size_t(L.heads), std::size_t(tokens), std::size_t(L.head_dim)});
      },
      "kv_cache"_a, "block_ids"_a, "tokens"_a, nb::kw_only(), "isa"_a = "vec",
      "The keys of one sequence read back from one layer of vLLM CPU's cache, as float32 [kv_heads, tokens, head_dim]\n"
      "(isa: the layer's CPU attention ISA, which fixes the key layout: vec/vec16 transposed, amx AMX-packed).");

  m.def(
      "vllm_cpu_partial",
      [](nb::handle scorer, const std::vector<Any>& kv_caches, const Any& block_ids, std::int64_t tokens,
         int threads, const std::string& isa) {
        if (kv_caches.empty()) bad("kv_caches: no layers");
        // one scorer for every layer, or one per layer (SnapKV: each layer's own window queries)
        std::vector<kvscore::AnyScorer> scorers;
        if (nb::isinstance<nb::list>(scorer) || nb::isinstance<nb::tuple>(scorer)) {
          for (nb::handle h : scorer) scorers.push_back(nb::cast<const kvscore::AnyScorer&>(h));
          if (scorers.size() != kv_caches.size())
            bad("scorer: " + std::to_string(scorers.size()) + " scorers for " + std::to_string(kv_caches.size()) +
                " layers (one, or one per layer)");
        } else {
          scorers.push_back(nb::cast<const kvscore::AnyScorer&>(scorer));
        }
        if (threads < 0) bad("threads must be >= 0 (got " + std::to_string(threads) + ")");
        std::vector<Layer> layers;
        for (std::size_t l = 0; l < kv_caches.size(); ++l)
          layers.push_back(vllm_layer(kv_caches[l], "kv_caches[" + std::to_string(l) + "]", isa));
        const std::vector<std::int64_t> ids = block_ids_of(block_ids, "block_ids");
        std::vector<kvscore::BlockTable> tables;
        for (const Layer& L : layers) tables.emplace_back(std::span<const std::int64_t>(ids), L.block_size, L.blocks, tokens);
        std::vector<kvscore::Scores> scores(layers.size());
        kvscore::BlockJointOptions o;
        o.num_threads = threads;
        kvscore::JointPartial p;
        {
          nb::gil_scoped_release unlocked;
          // layers in parallel; each scorer call serial over its few heads
          for (kvscore::AnyScorer& sc : scorers) sc.options().num_threads = 1;
          kvscore::detail::parallel_for(std::int64_t(layers.size()), threads, [&](std::int64_t l) {
            const kvscore::AnyScorer& sc = scorers[scorers.size() == 1 ? 0 : std::size_t(l)];
            scores[std::size_t(l)] =
                with_view(layers[std::size_t(l)], tables[std::size_t(l)], [&](const auto& v) { return sc.score(v); });
          });
          p = kvscore::joint_partial(scores, o);
        }
        return partial_out(std::move(p));
      },
      "scorer"_a, "kv_caches"_a, "block_ids"_a, "tokens"_a, "threads"_a = def.num_threads, nb::kw_only(),
      "isa"_a = "vec",
      "Scores the first `tokens` keys of one sequence in every layer of vLLM CPU's cache in place (`scorer`: one\n"
      "AnyScorer for every layer, or a list with one per layer; isa: the layers' CPU attention ISA) and returns\n"
      "this rank's joint_partial: (max float32 [T], sum float64 [T], count int64 [T]).");

  m.def(
      "joint_partial",
      [](const std::vector<Any>& layers, int threads) {
        const std::vector<kvscore::ConstScoresView> v = score_views(layers);
        kvscore::BlockJointOptions o;
        o.num_threads = threads;
        kvscore::JointPartial p;
        {
          nb::gil_scoped_release unlocked;
          p = kvscore::joint_partial(std::span<const kvscore::ConstScoresView>(v), o);
        }
        return partial_out(std::move(p));
      },
      "layers"_a, nb::kw_only(), "threads"_a = def.num_threads,
      "kvscore::joint_partial of fp32 [heads, tokens] score arrays: (max, sum, count).");

  m.def(
      "select_blocks_from_partials",
      [](const std::vector<nb::handle>& parts, std::int64_t block_size, std::int64_t budget, std::int64_t sinks,
         std::int64_t recent, const std::string& aggregate, const std::string& block_aggregate) {
        const kvscore::BlockJointOptions o = block_options(sinks, recent, aggregate, block_aggregate, 1);
        std::vector<kvscore::JointPartial> ps;
        for (std::size_t i = 0; i < parts.size(); ++i) ps.push_back(partial_in(parts[i], "partials[" + std::to_string(i) + "]"));
        std::vector<std::int64_t> kept;
        {
          nb::gil_scoped_release unlocked;
          const std::vector<float> J = kvscore::combine_partials(ps, o);
          const std::vector<float> B = kvscore::block_scores(J, block_size, o);
          kept = kvscore::select_blocks(B, std::int64_t(J.size()), block_size, budget, o);
        }
        const std::size_t n = kept.size();
        return to_numpy(std::move(kept), {n});
      },
      "partials"_a, "block_size"_a, "budget"_a, nb::kw_only(), "sinks"_a = def.sinks, "recent"_a = def.recent,
      "aggregate"_a = agg, "block_aggregate"_a = bagg,
      "The kept blocks (int64, ascending) from every rank's partial: combine_partials, block_scores, select_blocks.");

  m.def(
      "select_joint_blocks",
      [](const std::vector<Any>& layers, std::int64_t block_size, std::int64_t budget, std::int64_t sinks,
         std::int64_t recent, const std::string& aggregate, const std::string& block_aggregate, int threads) {
        const kvscore::BlockJointOptions o = block_options(sinks, recent, aggregate, block_aggregate, threads);
        const std::vector<kvscore::ConstScoresView> v = score_views(layers);
        std::vector<std::int64_t> kept;
        {
          nb::gil_scoped_release unlocked;
          kept = kvscore::select_joint_blocks(std::span<const kvscore::ConstScoresView>(v), block_size, budget, o);
        }
        const std::size_t n = kept.size();
        return to_numpy(std::move(kept), {n});
      },
      "layers"_a, "block_size"_a, "budget"_a, nb::kw_only(), "sinks"_a = def.sinks, "recent"_a = def.recent,
      "aggregate"_a = agg, "block_aggregate"_a = bagg, "threads"_a = def.num_threads,
      "kvscore::select_joint_blocks: kept blocks (int64, ascending) for every row of every layer.");

  const kvscore::BlockSparseOptions bso{};
  m.def(
      "attended_blocks",
      [](std::int64_t tokens, std::int64_t block_size, double attend, std::int64_t sinks, std::int64_t local) {
        kvscore::BlockSparseOptions o;
        o.sinks = sinks;
        o.local = local;
        return kvscore::attended_blocks(tokens, block_size, attend, o);
      },
      "tokens"_a, "block_size"_a, "attend"_a, nb::kw_only(), "sinks"_a = bso.sinks, "local"_a = bso.local,
      "kvscore::attended_blocks: the blocks a decode step of `tokens` attends (attend: a fraction in (0, 1] or a\n"
      "whole count of tokens > 1), never fewer than the protected ones; all of them = dense.");

  m.def(
      "block_sparse_reference",
      [](const Any& keys, const Any& query, std::int64_t block_size, std::int64_t attend, const std::string& score,
         std::int64_t sinks, std::int64_t local, float scale, std::int64_t prefilter, const std::string& group) {
        if (keys.ndim() != 3 || dtype_of(keys, "keys") != DT::f32) bad("keys: expected float32 [kv_heads, tokens, head_dim]");
        if (query.ndim() != 2 || dtype_of(query, "query") != DT::f32) bad("query: expected float32 [q_heads, head_dim]");
        require_c_contiguous(keys, "keys");
        require_c_contiguous(query, "query");
        if (query.shape(1) != keys.shape(2)) bad("query: head_dim differs from the keys'");
        const kvscore::BlockSparseOptions o = sparse_options(score, sinks, local, scale, prefilter, group, 1, 1, false);
        std::vector<std::int64_t> out;
        {
          nb::gil_scoped_release unlocked;
          out = kvscore::block_sparse_reference(static_cast<const float*>(keys.data()), std::int64_t(keys.shape(0)),
                                                std::int64_t(keys.shape(1)), std::int64_t(keys.shape(2)), block_size,
                                                static_cast<const float*>(query.data()), std::int64_t(query.shape(0)),
                                                attend, o);
        }
        const std::size_t n = out.size();
        return to_numpy(std::move(out), {n});
      },
      "keys"_a, "query"_a, "block_size"_a, "attend"_a, nb::kw_only(), "score"_a = kvscore::to_string(bso.score),
      "sinks"_a = bso.sinks, "local"_a = bso.local, "scale"_a = bso.scale, "prefilter"_a = bso.prefilter,
      "group"_a = kvscore::to_string(bso.group),
      "kvscore::block_sparse_reference: the logical blocks (int64, ascending) one decode step attends, from a\n"
      "sequence's keys float32 [kv_heads, tokens, head_dim] and query float32 [q_heads, head_dim] alone.");

  // the block scores and the plugin's defaults, read by kvscore.vllm (kvscore::kDefault*; the
  // BlockSparseOptions defaults are struct_defaults["BlockSparseOptions"])
  {
    nb::list scores;
    for (const kvscore::BlockScore s : kvscore::kBlockScores) scores.append(kvscore::to_string(s));
    m.attr("block_scores") = nb::tuple(scores);
    nb::list groups;
    for (const kvscore::QueryGroup g : kvscore::kQueryGroups) groups.append(kvscore::to_string(g));
    m.attr("query_groups") = nb::tuple(groups);
  }
  m.attr("kDefaultDenseBelow") = kvscore::kDefaultDenseBelow;

  m.def(
      "sparse_attend",
      [](std::int64_t tokens, std::int64_t block_size, double attend, std::int64_t dense_below, std::int64_t sinks,
         std::int64_t local) {
        kvscore::BlockSparseOptions o;
        o.sinks = sinks;
        o.local = local;
        return kvscore::sparse_attend(tokens, block_size, attend, dense_below, o);
      },
      "tokens"_a, "block_size"_a, "attend"_a, nb::kw_only(), "dense_below"_a = kvscore::kDefaultDenseBelow,
      "sinks"_a = bso.sinks, "local"_a = bso.local,
      "kvscore::sparse_attend: the blocks a decode row of `tokens` attends, or 0 when it decodes densely (shorter\n"
      "than dense_below, or attending every block anyway).");
  m.def("attended_tokens", &kvscore::attended_tokens, "tokens"_a, "block_size"_a, "attend"_a,
        "kvscore::attended_tokens: the length the attention kernel sees for a row attending `attend` blocks.");

  nb::class_<VllmBlockSelector>(m, "PagedBlockSelector",
                                "kvscore::BlockSparsePlanner (its PagedBlockSelector) over vLLM CPU's caches (kvscore.vllm's sparse decode).")
      .def(
          "__init__",
          [](VllmBlockSelector* self, std::int64_t layers, std::int64_t num_blocks, std::int64_t kv_heads,
             std::int64_t head_dim, std::int64_t block_size, const std::string& score, std::int64_t sinks,
             std::int64_t local, float scale, std::int64_t prefilter, const std::string& group,
             std::int64_t refresh, int threads, bool probe, const std::string& isa) {
            new (self) VllmBlockSelector(layers, num_blocks, kv_heads, head_dim, block_size,
                                         sparse_options(score, sinks, local, scale, prefilter, group, refresh, threads, probe),
                                         isa);
          },
          "layers"_a, "num_blocks"_a, "kv_heads"_a, "head_dim"_a, "block_size"_a, nb::kw_only(),
          "score"_a = kvscore::to_string(bso.score), "sinks"_a = bso.sinks, "local"_a = bso.local, "scale"_a = bso.scale,
          "prefilter"_a = bso.prefilter, "group"_a = kvscore::to_string(bso.group), "refresh"_a = bso.refresh,
          "threads"_a = bso.num_threads, "probe"_a = bso.probe, "isa"_a = "vec",
          "isa: every layer's CPU attention ISA (the key layout its caches are read in: vec/vec16, amx).")
      .def("begin_step", &VllmBlockSelector::begin_step, "slot_mapping"_a, "live"_a,
           "Once per step: the slots written since the last step (their blocks' summaries and indexes go stale) and\n"
           "the key of every sequence in the step (plan's seqs, or without them its first block).")
      .def("select", &VllmBlockSelector::select, "layer"_a, "kv_cache"_a, "query"_a, "token_index"_a, "src"_a, "rows"_a,
           "tokens"_a, "attend"_a, "dst"_a,
           "One layer: the blocks of each decode row (rows of src, compacted) written into the same rows of dst;\n"
           "returns per row 1 when scored this step, 0 when its kept choice stood (refresh > 1).")
      .def("register_caches", &VllmBlockSelector::register_caches, "caches"_a,
           "Every layer's cache, in layer order, once: select_planned reads a registered cache without converting it.")
      .def("plan", &VllmBlockSelector::plan, "token_index"_a, "src"_a, "rows"_a, "tokens"_a, "attend"_a, "dst"_a,
           "seqs"_a = nb::none(),
           "Once per step, after begin_step: the step's decode rows (as select takes them), for every layer's\n"
           "select_planned; src and dst are held until the next begin_step. seqs: each row's sequence key (the\n"
           "keys begin_step's live named; prefix caching: rows may share a first block), or None: its first block.")
      .def("select_planned", &VllmBlockSelector::select_planned, "layer"_a, "kv_cache"_a, "query"_a,
           "One layer of the planned step (select without the per-step arguments); returns how many rows were\n"
           "scored (the others' kept choices stood); `fresh` has the per-row flags.")
      .def_prop_ro("fresh", &VllmBlockSelector::fresh, nb::rv_policy::automatic,  // a new array, not a view
                   "The last select's per row: 1 when scored, 0 when its kept choice stood (refresh > 1).")
      .def_prop_ro("probe", [](VllmBlockSelector& s) { return s.get().probe(); })
      .def_prop_ro("summaries_made", [](VllmBlockSelector& s) { return s.get().summaries_made(); })
      .def_prop_ro("summary_bytes", [](VllmBlockSelector& s) { return s.get().summary_bytes(); })
      .def_prop_ro("indexes", [](VllmBlockSelector& s) { return s.get().indexes(); });
}
