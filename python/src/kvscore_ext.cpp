// python/src/kvscore_ext.cpp — the nanobind module kvscore._kvscore (docs/python.md).
//
// Arrays arrive as nb::ndarray (numpy through the buffer protocol, torch through DLPack) and
// are read in place: a KeysView is built from the array's own strides, so any layout the
// view can express is scored without a copy, and any other layout (an inner stride != 1,
// negative or overlapping strides) is a ValueError naming the stride. Results are new numpy
// arrays; kvscore/__init__.py turns them into torch tensors (zero-copy) when the input was
// one. Every heavy call releases the GIL; C++ std::invalid_argument becomes ValueError
// (nanobind's translation), so the message is the C++ one.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "kvscore/eval/evaluate.hpp"
#include "kvscore/eval/report.hpp"
#include "kvscore/kvscore.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/synth.hpp"
#include "kvscore/version.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Any = nb::ndarray<nb::ro, nb::device::cpu>;
using Mut = nb::ndarray<nb::device::cpu>;
using NpF32 = nb::ndarray<nb::numpy, float>;
using NpI64 = nb::ndarray<nb::numpy, std::int64_t>;

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument(what); }

enum class DT { f32, f16, bf16 };

template <class A>
DT dtype_of(const A& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return DT::f32;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return DT::f16;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DT::bf16;
  bad(what + ": dtype (DLPack code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
      " bits) must be float32, float16 or bfloat16");
}

/// A new numpy array owning `v` (moved; no copy of the data).
template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::vector<std::size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner);
}

/// Dimensions [heads, tokens, dim] of a 3-D array or a 4-D one with batch 1; the offset of the
/// first of them.
template <class A>
std::size_t hnd_offset(const A& a, const std::string& what, const char* names) {
  if (a.ndim() == 3) return 0;
  if (a.ndim() == 4) {
    if (a.shape(0) != 1)
      bad(what + ": batch " + std::to_string(a.shape(0)) + " must be 1 (score one sequence at a time: " + what +
          "[b])");
    return 1;
  }
  bad(what + ": expected " + names + " or [1, " + std::string(names + 1) + " (got " + std::to_string(a.ndim()) +
      " dimensions)");
}

template <class A>
void check_strides_nonneg(const A& a, const std::string& what) {
  for (std::size_t i = 0; i < a.ndim(); ++i)
    if (a.stride(i) < 0)
      bad(what + ": stride " + std::to_string(a.stride(i)) + " of dimension " + std::to_string(i) +
          " is negative; kvscore reads arrays in place and needs non-negative strides");
}

/// f(KeysView<T>) over keys [H, N, D] / [1, H, N, D] in place, for the array's dtype.
template <class A, class F>
auto with_keys(const A& a, const std::string& what, F&& f) {
  const std::size_t o = hnd_offset(a, what, "[heads, tokens, head_dim]");
  check_strides_nonneg(a, what);
  const auto H = std::int64_t(a.shape(o)), N = std::int64_t(a.shape(o + 1)), D = std::int64_t(a.shape(o + 2));
  if (D > 1 && a.stride(o + 2) != 1)
    bad(what + ": head_dim stride is " + std::to_string(a.stride(o + 2)) +
        " elements; kvscore reads each key row in place and needs stride 1 (no silent copy: pass a tensor "
        "whose last dimension is contiguous, e.g. .contiguous())");
  const std::int64_t hs = a.stride(o), ts = a.stride(o + 1);
  const void* p = a.data();
  switch (dtype_of(a, what)) {
    case DT::f32: return f(kvscore::KeysView<float>(static_cast<const float*>(p), H, N, D, hs, ts));
    case DT::f16: return f(kvscore::KeysView<kvscore::half>(static_cast<const kvscore::half*>(p), H, N, D, hs, ts));
    default: return f(kvscore::KeysView<kvscore::bfloat16>(static_cast<const kvscore::bfloat16*>(p), H, N, D, hs, ts));
  }
}

/// Mutable form (compaction).
template <class F>
auto with_mut_keys(const Mut& a, const std::string& what, F&& f) {
  const std::size_t o = hnd_offset(a, what, "[heads, tokens, head_dim]");
  check_strides_nonneg(a, what);
  const auto H = std::int64_t(a.shape(o)), N = std::int64_t(a.shape(o + 1)), D = std::int64_t(a.shape(o + 2));
  if (D > 1 && a.stride(o + 2) != 1)
    bad(what + ": head_dim stride is " + std::to_string(a.stride(o + 2)) + " elements; compaction needs stride 1");
  const std::int64_t hs = a.stride(o), ts = a.stride(o + 1);
  void* p = a.data();
  switch (dtype_of(a, what)) {
    case DT::f32: return f(kvscore::MutKeysView<float>(static_cast<float*>(p), H, N, D, hs, ts));
    case DT::f16: return f(kvscore::MutKeysView<kvscore::half>(static_cast<kvscore::half*>(p), H, N, D, hs, ts));
    default: return f(kvscore::MutKeysView<kvscore::bfloat16>(static_cast<kvscore::bfloat16*>(p), H, N, D, hs, ts));
  }
}

/// The element at `e` (any alignment) of dtype dt, widened to fp32.
float element_as_float(const unsigned char* e, DT dt) {
  if (dt == DT::f32) {
    float x;
    std::memcpy(&x, e, 4);
    return x;
  }
  std::uint16_t bits;
  std::memcpy(&bits, e, 2);
  return dt == DT::f16 ? kvscore::half_bits_to_float(bits) : kvscore::bf16_bits_to_float(bits);
}

/// Queries [q_heads, n, d] (or [1, q_heads, n, d]), any dtype and strides, gathered to fp32 C
/// order: the scorers that take queries keep their own copy (as the C++ constructors do). Only
/// the last `last` queries (0 = all) are taken.
struct Queries {
  std::vector<float> data;
  std::int64_t heads = 0, n = 0, dim = 0;
};
Queries gather_queries(const Any& q, const std::string& what, std::int64_t last = 0) {
  const std::size_t o = hnd_offset(q, what, "[q_heads, queries, head_dim]");
  check_strides_nonneg(q, what);
  Queries r;
  r.heads = std::int64_t(q.shape(o));
  const auto n_all = std::int64_t(q.shape(o + 1));
  r.dim = std::int64_t(q.shape(o + 2));
  if (last < 0) bad(what + ": window " + std::to_string(last) + " must be >= 0");
  r.n = (last == 0 || last > n_all) ? n_all : last;
  const std::int64_t first = n_all - r.n;
  r.data.resize(std::size_t(r.heads * r.n * r.dim));
  const DT dt = dtype_of(q, what);
  const auto* base = static_cast<const unsigned char*>(q.data());
  const std::size_t es = dt == DT::f32 ? 4 : 2;
  for (std::int64_t h = 0; h < r.heads; ++h)
    for (std::int64_t i = 0; i < r.n; ++i)
      for (std::int64_t j = 0; j < r.dim; ++j) {
        const std::int64_t off = h * q.stride(o) + (first + i) * q.stride(o + 1) + j * q.stride(o + 2);
        const unsigned char* e = base + off * std::int64_t(es);
        r.data[std::size_t((h * r.n + i) * r.dim + j)] = element_as_float(e, dt);
      }
  return r;
}

/// fp32 2-D [rows, cols] read in place (token stride 1), e.g. scores or filters.
struct F32Rows {
  const float* data;
  std::int64_t rows, cols, row_stride;
};
F32Rows f32_rows(const Any& a, const std::string& what) {
  if (a.ndim() != 2) bad(what + ": expected 2 dimensions (got " + std::to_string(a.ndim()) + ")");
  if (dtype_of(a, what) != DT::f32) bad(what + ": must be float32 (kvscore's scores are fp32)");
  check_strides_nonneg(a, what);
  const auto R = std::int64_t(a.shape(0)), C = std::int64_t(a.shape(1));
  if (C > 1 && a.stride(1) != 1)
    bad(what + ": stride " + std::to_string(a.stride(1)) + " of the last dimension must be 1 (no silent copy)");
  return {static_cast<const float*>(a.data()), R, C, R > 1 ? std::int64_t(a.stride(0)) : C};
}

nb::object scores_out(kvscore::Scores&& s) {
  const auto H = std::size_t(s.heads()), N = std::size_t(s.tokens());
  std::vector<float> v(s.values());  // Scores keeps its vector private; one copy of the fp32 result
  return nb::cast(to_numpy(std::move(v), {H, N}));
}

/// Scores a view with scorer `sc` with the GIL released.
template <class Scorer>
nb::object score_any(const Scorer& sc, const Any& keys) {
  kvscore::Scores s = with_keys(keys, "keys", [&](const auto& view) {
    nb::gil_scoped_release unlocked;
    return sc.score(view);
  });
  return scores_out(std::move(s));
}

kvscore::Alloc parse_alloc(const std::string& a) {
  if (a == "per_head" || a == "per-head") return kvscore::Alloc::per_head;
  if (a == "adakv") return kvscore::Alloc::adakv;
  bad("alloc '" + a + "' must be 'per_head' or 'adakv'");
}

/// Selection from an int64 [heads, n] array (dense) or a list of 1-D int64 arrays (ragged).
kvscore::Selection selection_from(nb::handle sel, std::int64_t tokens) {
  kvscore::Selection s;
  s.tokens = tokens;
  auto add_row = [&](const nb::ndarray<nb::ro, nb::device::cpu, std::int64_t>& row, const std::int64_t* p,
                     std::int64_t n, std::int64_t stride) {
    (void)row;
    for (std::int64_t i = 0; i < n; ++i) s.positions.push_back(p[i * stride]);
    s.offsets.push_back(std::int64_t(s.positions.size()));
  };
  nb::ndarray<nb::ro, nb::device::cpu, std::int64_t> arr;
  if (nb::try_cast(sel, arr) && arr.ndim() == 2) {
    s.heads = std::int64_t(arr.shape(0));
    const auto n = std::int64_t(arr.shape(1));
    for (std::int64_t h = 0; h < s.heads; ++h)
      add_row(arr, arr.data() + h * arr.stride(0), n, arr.stride(1));
    return s;
  }
  if (nb::isinstance<nb::list>(sel) || nb::isinstance<nb::tuple>(sel)) {
    for (nb::handle item : sel) {
      nb::ndarray<nb::ro, nb::device::cpu, std::int64_t> row;
      if (!nb::try_cast(item, row) || row.ndim() != 1)
        bad("selection: every entry of the list must be a 1-D int64 array of kept positions");
      add_row(row, row.data(), std::int64_t(row.shape(0)), row.stride(0));
      ++s.heads;
    }
    return s;
  }
  bad("selection: expected an int64 array [heads, kept] or a list of 1-D int64 arrays (one per head)");
}

std::vector<float> f32_copy(const Any& a, const std::string& what, std::size_t ndim) {
  if (a.ndim() != ndim) bad(what + ": expected " + std::to_string(ndim) + " dimensions (got " + std::to_string(a.ndim()) + ")");
  std::vector<float> out;
  const DT dt = dtype_of(a, what);
  check_strides_nonneg(a, what);
  std::size_t total = 1;
  for (std::size_t i = 0; i < ndim; ++i) total *= a.shape(i);
  out.resize(total);
  const auto* base = static_cast<const unsigned char*>(a.data());
  const std::size_t es = dt == DT::f32 ? 4 : 2;
  std::vector<std::size_t> idx(ndim, 0);
  for (std::size_t flat = 0; flat < total; ++flat) {
    std::int64_t off = 0;
    for (std::size_t i = 0; i < ndim; ++i) off += std::int64_t(idx[i]) * a.stride(i);
    const unsigned char* e = base + off * std::int64_t(es);
    out[flat] = element_as_float(e, dt);
    for (std::size_t i = ndim; i-- > 0;) {
      if (++idx[i] < a.shape(i)) break;
      idx[i] = 0;
    }
  }
  return out;
}

/// An OjaKV basis U [d, r] as a new float32 numpy array (C order).
nb::object basis_out(const kvscore::OjaBasis& b) {
  const Eigen::MatrixXf u = b.basis_f32();
  std::vector<float> v(std::size_t(u.size()));
  for (Eigen::Index i = 0; i < u.rows(); ++i)
    for (Eigen::Index j = 0; j < u.cols(); ++j) v[std::size_t(i * u.cols() + j)] = u(i, j);
  return nb::cast(to_numpy(std::move(v), {std::size_t(u.rows()), std::size_t(u.cols())}));
}


/// One query [head_dim] of a decode-time cache, as fp32.
std::vector<float> cache_query(const Any& query, std::int64_t head_dim, const std::string& who) {
  std::vector<float> q = f32_copy(query, who + ": query [head_dim]", 1);
  if (std::int64_t(q.size()) != head_dim)
    bad(who + ": query has " + std::to_string(q.size()) + " elements, head_dim is " + std::to_string(head_dim));
  return q;
}

/// ParisKVCache<T> for one storage type: rows arrive as 2-D [n, head_dim] arrays of that type,
/// row-contiguous (an engine's own layout), read in place; queries are copied to fp32.
template <class T>
void bind_pariskv_cache(nb::module_& m, const char* name, DT dt) {
  using C = kvscore::ParisKVCache<T>;
  const kvscore::ParisKVCacheConfig def;
  nb::class_<C>(m, name)
      .def("__init__",
           [](C* self, std::int64_t head_dim, std::int64_t sinks, std::int64_t local, std::int64_t update_interval,
              std::int64_t dense_min, std::int64_t k, std::int64_t rerank_exact) {
             kvscore::ParisKVCacheConfig c;
             c.sinks = sinks;
             c.local = local;
             c.update_interval = update_interval;
             c.dense_min = dense_min;
             c.search.k = k;
             c.search.rerank_exact = rerank_exact;
             new (self) C(head_dim, c);
           },
           "head_dim"_a, "sinks"_a = def.sinks, "local"_a = def.local, "update_interval"_a = def.update_interval,
           "dense_min"_a = def.dense_min, "k"_a = def.search.k, "rerank_exact"_a = def.search.rerank_exact)
      .def_prop_ro("size", &C::size)
      .def_prop_ro("head_dim", &C::head_dim)
      .def_prop_ro("indexed", &C::indexed)
      .def_prop_ro("retrieval_begin", &C::retrieval_begin)
      .def_prop_ro("local_begin", &C::local_begin)
      .def_prop_ro("memory_bytes", &C::memory_bytes)
      .def(
          "append",
          [dt](C& c, const Any& keys, const Any& values) {
            const std::string who = "ParisKVCache.append";
            for (const Any* a : {&keys, &values}) {
              const char* what = a == &keys ? "keys" : "values";
              if (a->ndim() != 2) bad(who + ": " + what + " must be 2-D [n, head_dim] (got " + std::to_string(a->ndim()) + " dimensions)");
              if (dtype_of(*a, who) != dt) bad(who + ": " + what + " must have the cache's dtype");
              if (std::int64_t(a->shape(1)) != c.head_dim())
                bad(who + ": " + what + " have head_dim " + std::to_string(a->shape(1)) + ", the cache " + std::to_string(c.head_dim()));
              if (a->shape(0) > 1 && (a->stride(1) != 1 || a->stride(0) != std::int64_t(a->shape(1))))
                bad(who + ": " + what + " rows must be contiguous (strides [head_dim, 1]; no silent copy)");
            }
            if (keys.shape(0) != values.shape(0))
              bad(who + ": " + std::to_string(keys.shape(0)) + " keys but " + std::to_string(values.shape(0)) + " values");
            const T* k = static_cast<const T*>(keys.data());
            const T* v = static_cast<const T*>(values.data());
            nb::gil_scoped_release unlocked;
            c.append(k, v, std::int64_t(keys.shape(0)));
          },
          "keys"_a, "values"_a)
      .def(
          "select",
          [](const C& c, const Any& query) {
            const std::vector<float> q = cache_query(query, c.head_dim(), "ParisKVCache.select");
            std::vector<std::int64_t> pos;
            {
              nb::gil_scoped_release unlocked;
              pos = c.select(q.data());
            }
            const std::size_t n = pos.size();
            return to_numpy(std::move(pos), {n});
          },
          "query"_a)
      .def(
          "attend",
          [](const C& c, const Any& query) {
            const std::vector<float> q = cache_query(query, c.head_dim(), "ParisKVCache.attend");
            std::vector<float> out(q.size());
            typename C::Workspace ws;
            {
              nb::gil_scoped_release unlocked;
              c.attend(q.data(), out.data(), ws);
            }
            const std::size_t n = ws.positions.size(), d = out.size();
            return nb::make_tuple(to_numpy(std::move(out), {d}), to_numpy(std::move(ws.positions), {n}));
          },
          "query"_a);
}
}  // namespace

NB_MODULE(_kvscore, m) {
  m.doc() = "kvscore C++ core (use the kvscore package; docs/python.md)";
  m.attr("__version__") = kvscore::version_string;

  m.def("isa", [] { return std::string(kvscore::simd::active_table().name); },
        "Name of the SIMD kernel table the scorers use (KVSCORE_ISA pins it).");
  m.def(
      "isas",
      [] {
        std::vector<std::string> names;
        for (const kvscore::simd::KernelTable* t : kvscore::simd::available_tables()) names.emplace_back(t->name);
        return names;
      },
      "Kernel tables this CPU supports, scalar first.");
  m.def("set_isa", [](const std::string& n) { kvscore::simd::set_active_isa(n); }, "name"_a,
        "Pin the kernel table by name (as KVSCORE_ISA).");

  // ---- scorers (query-agnostic)
  nb::class_<kvscore::KNorm>(m, "KNorm")
      .def(nb::init<>())
      .def_rw("num_threads", &kvscore::KNorm::num_threads)
      .def("score", [](const kvscore::KNorm& s, const Any& k) { return score_any(s, k); }, "keys"_a);
  nb::class_<kvscore::KeyDiff>(m, "KeyDiff")
      .def(nb::init<>())
      .def_rw("num_threads", &kvscore::KeyDiff::num_threads)
      .def("score", [](const kvscore::KeyDiff& s, const Any& k) { return score_any(s, k); }, "keys"_a);
  nb::class_<kvscore::ManifoldL2>(m, "ManifoldL2")
      .def(nb::init<>())
      .def_rw("num_threads", &kvscore::ManifoldL2::num_threads)
      .def("score", [](const kvscore::ManifoldL2& s, const Any& k) { return score_any(s, k); }, "keys"_a);
  nb::class_<kvscore::WindowedManifoldL2>(m, "WindowedManifoldL2")
      .def("__init__",
           [](kvscore::WindowedManifoldL2* self, std::int64_t window, const std::string& tail) {
             new (self) kvscore::WindowedManifoldL2(window, kvscore::parse_window_tail(tail));
           },
           "window"_a = 4096, "tail"_a = "merge")
      .def_ro("window", &kvscore::WindowedManifoldL2::window)
      .def_rw("num_threads", &kvscore::WindowedManifoldL2::num_threads)
      .def("score", [](const kvscore::WindowedManifoldL2& s, const Any& k) { return score_any(s, k); }, "keys"_a);

  nb::class_<kvscore::QFilter>(m, "QFilter")
      .def("__init__",
           [](kvscore::QFilter* self, const Any& filters) {
             std::vector<float> f = f32_copy(filters, "filters [kv_heads, head_dim]", 2);
             new (self) kvscore::QFilter(std::move(f), std::int64_t(filters.shape(0)), std::int64_t(filters.shape(1)));
           },
           "filters"_a)
      .def_static("from_published", &kvscore::QFilter::from_published, "path"_a, "layer"_a)
      .def_static(
          "load",
          [](const std::string& path, std::int64_t layer, const std::string& conv) {
            if (conv.empty()) return kvscore::QFilter::load(path, layer, kvscore::QFilter::file_convention(path));
            if (conv == "published") return kvscore::QFilter::load(path, layer, kvscore::FilterConvention::published);
            if (conv == "kvscore") return kvscore::QFilter::load(path, layer, kvscore::FilterConvention::kvscore);
            bad("convention '" + conv + "' must be 'published' or 'kvscore'");
          },
          "path"_a, "layer"_a, "convention"_a = "")
      .def_rw("num_threads", &kvscore::QFilter::num_threads)
      .def_prop_ro("kv_heads", &kvscore::QFilter::kv_heads)
      .def_prop_ro("head_dim", &kvscore::QFilter::head_dim)
      .def_prop_ro("filters",
                   [](const kvscore::QFilter& q) {
                     std::vector<float> f = q.filters();
                     return nb::cast(to_numpy(std::move(f), {std::size_t(q.kv_heads()), std::size_t(q.head_dim())}));
                   })
      .def("score", [](const kvscore::QFilter& s, const Any& k) { return score_any(s, k); }, "keys"_a);

  m.def(
      "calibrate_qfilters",
      [](const Any& queries, std::int64_t kv_heads) {
        Queries q = gather_queries(queries, "queries");
        std::vector<float> f;
        {
          nb::gil_scoped_release unlocked;
          f = kvscore::calibrate_qfilters(q.data.data(), q.heads, q.n, q.dim, kv_heads);
        }
        return to_numpy(std::move(f), {std::size_t(kv_heads), std::size_t(q.dim)});
      },
      "queries"_a, "kv_heads"_a);

  // ---- scorers with queries
  nb::class_<kvscore::SnapKV>(m, "SnapKV")
      .def("__init__",
           [](kvscore::SnapKV* self, const Any& queries, std::int64_t window, std::int64_t kernel,
              const std::string& placement) {
             if (window < 1) bad("SnapKV: window " + std::to_string(window) + " must be >= 1");
             const kvscore::QueryPlacement where = kvscore::parse_query_placement(placement);
             Queries q = gather_queries(queries, "queries", window);
             new (self) kvscore::SnapKV(q.data.data(), q.heads, q.n, q.dim);
             self->kernel_size = kernel;
             self->placement = where;
           },
           "queries"_a, "window"_a = kvscore::SnapKV::kDefaultWindow, "kernel"_a = kvscore::SnapKV::kDefaultKernel,
           nb::kw_only(), "placement"_a = "in_cache")
      .def_rw("num_threads", &kvscore::SnapKV::num_threads)
      .def_prop_ro("window", &kvscore::SnapKV::window)
      .def_ro("kernel", &kvscore::SnapKV::kernel_size)
      .def_prop_ro("protected_recent", &kvscore::SnapKV::protected_recent)
      .def_prop_ro("placement", [](const kvscore::SnapKV& s) -> std::string { return kvscore::to_string(s.placement); })
      .def("score", [](const kvscore::SnapKV& s, const Any& k) { return score_any(s, k); }, "keys"_a);

  nb::class_<kvscore::ProtoKV>(m, "ProtoKV")
      .def("__init__",
           [](kvscore::ProtoKV* self, const Any& queries, std::int64_t window, std::int64_t kappa,
              std::int64_t sat_candidates, int lsh_bits, std::int64_t chunks, double bandwidth, std::uint64_t seed,
              const std::string& psi, const std::string& placement) {
             const kvscore::QueryPlacement where = kvscore::parse_query_placement(placement);
             Queries q = gather_queries(queries, "queries", window);
             new (self) kvscore::ProtoKV(q.data.data(), q.heads, q.n, q.dim);
             self->kappa = kappa;
             self->sat_candidates = sat_candidates;
             self->lsh_bits = lsh_bits;
             self->chunks = chunks;
             self->bandwidth = bandwidth;
             self->seed = seed;
             self->placement = where;
             if (psi == "sum") self->psi = kvscore::ProtoKV::Psi::sum;
             else if (psi == "mean") self->psi = kvscore::ProtoKV::Psi::mean;
             else if (psi == "attention") self->psi = kvscore::ProtoKV::Psi::attention;
             else bad("ProtoKV: psi '" + psi + "' must be 'sum', 'mean' or 'attention'");
           },
           "queries"_a, "window"_a = 0, "kappa"_a = kvscore::ProtoKV::kDefaultKappa,
           "sat_candidates"_a = kvscore::ProtoKV::kDefaultSatCandidates,
           "lsh_bits"_a = kvscore::ProtoKV::kDefaultLshBits, "chunks"_a = kvscore::ProtoKV::kDefaultChunks,
           "bandwidth"_a = 0.0, "seed"_a = 0, "psi"_a = "attention", nb::kw_only(), "placement"_a = "in_cache")
      .def_rw("num_threads", &kvscore::ProtoKV::num_threads)
      .def_prop_ro("window", &kvscore::ProtoKV::window)
      .def_prop_ro("protected_recent", &kvscore::ProtoKV::protected_recent)
      .def_prop_ro("placement", [](const kvscore::ProtoKV& s) -> std::string { return kvscore::to_string(s.placement); })
      .def("score", [](const kvscore::ProtoKV& s, const Any& k) { return score_any(s, k); }, "keys"_a);

  // ---- selection and compaction
  m.def(
      "budget_from_ratio",
      [](std::int64_t tokens, double keep, const std::string& rounding) {
        if (rounding != "nearest" && rounding != "floor")
          bad("budget_from_ratio: rounding '" + rounding + "' must be 'nearest' or 'floor'");
        return kvscore::budget_from_ratio(
            tokens, keep, rounding == "floor" ? kvscore::BudgetRounding::floor : kvscore::BudgetRounding::nearest);
      },
      "tokens"_a, "keep_ratio"_a, "rounding"_a = "nearest");
  m.def(
      "select",
      [](const Any& scores, std::int64_t budget, std::int64_t sinks, std::int64_t recent, const std::string& alloc,
         double alpha, bool normalize, int threads) -> nb::object {
        const F32Rows r = f32_rows(scores, "scores [heads, tokens]");
        kvscore::SelectOptions o;
        o.sinks = sinks;
        o.recent = recent;
        o.alloc = parse_alloc(alloc);
        o.alpha = alpha;
        o.normalize = normalize;
        o.num_threads = threads;
        kvscore::Selection s;
        {
          nb::gil_scoped_release unlocked;
          // select() only reads the scores; ScoresView is the mutable view type it takes.
          kvscore::ScoresView v(const_cast<float*>(r.data), r.rows, r.cols, r.row_stride);
          s = kvscore::select(v, kvscore::Budget::per_head(budget), o);
        }
        if (o.alloc == kvscore::Alloc::per_head) {
          const auto H = std::size_t(s.heads), n = std::size_t(s.heads > 0 ? s.kept(0) : 0);
          return nb::cast(to_numpy(std::move(s.positions), {H, n}));
        }
        nb::list out;
        for (std::int64_t h = 0; h < s.heads; ++h) {
          auto span = s.head(h);
          out.append(to_numpy(std::vector<std::int64_t>(span.begin(), span.end()), {span.size()}));
        }
        return out;
      },
      "scores"_a, "budget"_a, nb::kw_only(), "sinks"_a = 0, "recent"_a = 0, "alloc"_a = "per_head",
      "alpha"_a = 0.2, "normalize"_a = false, "threads"_a = 0);

  m.def(
      "compact",
      [](const Mut& keys, const Mut& values, nb::handle selection, const std::string& tail, bool equal) {
        if (tail != "keep" && tail != "zero") bad("compact: tail '" + tail + "' must be 'keep' or 'zero'");
        kvscore::CompactOptions o;
        o.tail = tail == "zero" ? kvscore::CompactTail::zero : kvscore::CompactTail::keep;
        o.require_equal_lengths = equal;
        return with_mut_keys(keys, "keys", [&](const auto& k) {
          return with_mut_keys(values, "values", [&](const auto& v) {
            kvscore::Selection s = selection_from(selection, k.tokens());
            nb::gil_scoped_release unlocked;
            return kvscore::compact(k, v, s, o);
          });
        });
      },
      "keys"_a, "values"_a, "selection"_a, nb::kw_only(), "tail"_a = "keep", "require_equal_lengths"_a = true);

  // ---- evaluator and synthetic data
  m.def(
      "evaluate_json",
      [](const Any& K, const Any& V, const Any& Q, const std::string& methods, const std::vector<double>& keep,
         std::int64_t sinks, std::int64_t recent, const std::string& alloc, double alpha, std::int64_t window,
         const std::string& window_tail, const std::string& rounding, const std::string& placement, int threads,
         const std::optional<Any>& W, const std::optional<Any>& C, const std::string& protocol,
         const std::string& mix_metric) {
        auto c_f32 = [](const Any& a, const char* what) {
          if (a.ndim() != 4) bad(std::string(what) + ": expected 4 dimensions [layers, heads, n, d]");
          if (dtype_of(a, what) != DT::f32) bad(std::string(what) + ": must be float32");
          std::int64_t expect = 1;
          for (std::size_t i = 4; i-- > 0;) {
            if (a.shape(i) > 1 && a.stride(i) != expect) bad(std::string(what) + ": must be C-contiguous");
            expect *= std::int64_t(a.shape(i));
          }
          return static_cast<const float*>(a.data());
        };
        const float* k = c_f32(K, "K");
        const float* v = c_f32(V, "V");
        const float* q = c_f32(Q, "Q");
        const auto L = std::int64_t(K.shape(0));
        if (std::int64_t(V.shape(0)) != L || std::int64_t(Q.shape(0)) != L)
          bad("evaluate: K, V and Q must have the same number of layers");
        if (V.shape(1) != K.shape(1) || V.shape(2) != K.shape(2))
          bad("evaluate: V must have K's heads and tokens");
        if (Q.shape(3) != K.shape(3)) bad("evaluate: Q's head_dim must equal K's");
        std::vector<kvscore::eval::LayerInput> layers(static_cast<std::size_t>(L));
        const std::int64_t H = K.shape(1), N = K.shape(2), D = K.shape(3), DV = V.shape(3), HQ = Q.shape(1),
                           NQ = Q.shape(2);
        // leak-free protocol: the cache's last-window queries and other text's (both like Q)
        auto like_q = [&](const std::optional<Any>& a, const char* what) -> std::int64_t {
          if (!a) return 0;
          c_f32(*a, what);
          if (std::int64_t(a->shape(0)) != L || a->shape(1) != Q.shape(1) || a->shape(3) != Q.shape(3))
            bad(std::string("evaluate: ") + what + " must have Q's layers, q_heads and head_dim");
          return std::int64_t(a->shape(2));
        };
        const std::int64_t NW = like_q(W, "window_queries"), NC = like_q(C, "calib_queries");
        for (std::int64_t l = 0; l < L; ++l) {
          layers[std::size_t(l)] = {k + l * H * N * D, v + l * H * N * DV, q + l * HQ * NQ * D, H, N, D, DV, HQ, NQ};
          if (W) layers[std::size_t(l)].window_queries = static_cast<const float*>(W->data()) + l * HQ * NW * D;
          if (C) layers[std::size_t(l)].calib_queries = static_cast<const float*>(C->data()) + l * HQ * NC * D;
          layers[std::size_t(l)].n_window = NW;
          layers[std::size_t(l)].n_calib = NC;
        }
        kvscore::eval::EvalOptions o;
        o.methods = kvscore::eval::resolve_methods(methods);
        o.keep = keep;
        o.method.select.sinks = sinks;
        o.method.select.recent = recent;
        o.method.select.alloc = parse_alloc(alloc);
        o.method.select.alpha = alpha;
        o.method.window = window;
        o.method.window_tail = kvscore::parse_window_tail(window_tail);
        o.method.placement = kvscore::parse_query_placement(placement);
        if (rounding != "nearest" && rounding != "floor")
          bad("evaluate: budget_rounding '" + rounding + "' must be 'nearest' or 'floor'");
        o.rounding = rounding == "floor" ? kvscore::BudgetRounding::floor : kvscore::BudgetRounding::nearest;
        o.method.threads = threads;
        o.threads = threads;
        if (protocol != "leak_free" && protocol != "shared")
          bad("evaluate: protocol '" + protocol + "' must be 'leak_free' or 'shared'");
        o.method.protocol = protocol == "leak_free" ? kvscore::eval::Protocol::leak_free : kvscore::eval::Protocol::shared;
        if (mix_metric != "recall" && mix_metric != "error" && mix_metric != "overlap")
          bad("evaluate: mix_metric '" + mix_metric + "' must be 'recall', 'error' or 'overlap'");
        o.mix_metric = mix_metric == "recall" ? kvscore::eval::MixMetric::recall
                       : mix_metric == "error" ? kvscore::eval::MixMetric::output_error
                                               : kvscore::eval::MixMetric::overlap;
        std::string json;
        {
          nb::gil_scoped_release unlocked;
          json = kvscore::eval::to_json(kvscore::eval::evaluate(layers, o));
        }
        return json;
      },
      "K"_a, "V"_a, "Q"_a, "methods"_a, "keep"_a, "sinks"_a, "recent"_a, "alloc"_a, "alpha"_a, "window"_a,
      "window_tail"_a, "budget_rounding"_a, "query_placement"_a, "threads"_a, "window_queries"_a = nb::none(),
      "calib_queries"_a = nb::none(), "protocol"_a = "shared", "mix_metric"_a = "recall");
  // The C++ cost of ManifoldL2 score + per-head select, timed inside C++ (seconds per call, best
  // of `reps`): the baseline python/bench/bench_python.py compares the Python call with.
  m.def(
      "_bench_score_select",
      [](const Any& keys, std::int64_t budget, int reps, int threads) {
        return with_keys(keys, "keys", [&](const auto& v) {
          nb::gil_scoped_release unlocked;
          kvscore::ManifoldL2 sc;
          sc.num_threads = threads;
          kvscore::SelectOptions o;
          o.num_threads = threads;
          double best = 1e300;
          std::int64_t sink = 0;
          for (int r = 0; r < reps; ++r) {
            const auto t0 = std::chrono::steady_clock::now();
            kvscore::Selection sel = kvscore::select(sc.score(v), kvscore::Budget::per_head(budget), o);
            const auto t1 = std::chrono::steady_clock::now();
            sink += sel.total();
            best = std::min(best, std::chrono::duration<double>(t1 - t0).count());
          }
          if (sink < 0) bad("unreachable");
          return best;
        });
      },
      "keys"_a, "budget"_a, "reps"_a, "threads"_a);
  m.def("method_names", [] { return kvscore::eval::resolve_methods("all"); });
  // kvscore/methods.hpp, the one list of methods: Python's METHODS and ALIASES are built from it.
  m.def("methods", [] {
    nb::list out;
    for (const kvscore::MethodInfo& x : kvscore::kMethods) {
      nb::dict d;
      d["name"] = std::string(x.name);
      d["cli"] = std::string(x.cli);
      std::vector<std::string> aliases;
      for (std::string_view a : kvscore::split_list(x.aliases)) aliases.emplace_back(a);
      d["aliases"] = aliases;
      d["kind"] = std::string(kvscore::kind_name(x.kind));
      d["cls"] = std::string(x.cls);
      d["header"] = std::string(x.header);
      d["doc"] = std::string(x.doc);
      d["summary"] = std::string(x.summary);
      out.append(d);
    }
    return out;
  });

  m.def(
      "synth",
      [](const std::string& kind, std::int64_t layers, std::int64_t kv_heads, std::int64_t group, std::int64_t tokens,
         std::int64_t head_dim, std::int64_t queries, std::int64_t segment, std::uint64_t seed) {
        kvscore::synth::Spec s;
        s.kind = kvscore::synth::parse_kind(kind);
        s.layers = layers;
        s.kv_heads = kv_heads;
        s.group = group;
        s.tokens = tokens;
        s.head_dim = head_dim;
        s.queries = queries;
        s.segment = segment;
        s.seed = seed;
        kvscore::synth::Data d;
        {
          nb::gil_scoped_release unlocked;
          d = kvscore::synth::generate(s);
        }
        nb::dict out;
        const auto L = std::size_t(layers), H = std::size_t(kv_heads), N = std::size_t(tokens),
                   D = std::size_t(head_dim);
        out["K"] = to_numpy(std::move(d.keys), {L, H, N, D});
        out["V"] = to_numpy(std::move(d.values), {L, H, N, D});
        out["Q"] = to_numpy(std::move(d.queries), {L, std::size_t(kv_heads * group), std::size_t(queries), D});
        nb::dict planted;
        for (auto& [name, pos] : d.planted) {
          nb::list rows;
          for (auto& p : pos) rows.append(to_numpy(std::move(p), {p.size()}));
          planted[name.c_str()] = rows;
        }
        out["planted"] = planted;
        return out;
      },
      "kind"_a, "layers"_a, "kv_heads"_a, "group"_a, "tokens"_a, "head_dim"_a, "queries"_a, "segment"_a, "seed"_a);

  // ---- ParisKV: one head's retrieval index
  nb::class_<kvscore::ParisKV>(m, "ParisKV")
      .def("__init__",
           [](kvscore::ParisKV* self, std::int64_t head_dim, std::int64_t m_, std::uint64_t seed, bool center) {
             kvscore::ParisKVConfig c;
             c.m = m_;
             c.seed = seed;
             c.center = center;
             new (self) kvscore::ParisKV(head_dim, c);
           },
           "head_dim"_a, "m"_a = 8, "seed"_a = kvscore::pariskv::kDefaultSeed, "center"_a = true)
      .def_prop_ro("size", &kvscore::ParisKV::size)
      .def_prop_ro("head_dim", &kvscore::ParisKV::head_dim)
      .def_prop_ro("memory_bytes", &kvscore::ParisKV::memory_bytes)
      .def(
          "append",
          [](kvscore::ParisKV& idx, const Any& keys) {
            if (keys.ndim() != 2) bad("ParisKV.append: keys must be 2-D [n, head_dim]");
            check_strides_nonneg(keys, "ParisKV.append: keys");
            const auto n = std::int64_t(keys.shape(0)), d = std::int64_t(keys.shape(1));
            if (d != idx.head_dim())
              bad("ParisKV.append: keys have head_dim " + std::to_string(d) + ", the index " +
                  std::to_string(idx.head_dim()));
            if (d > 1 && keys.stride(1) != 1) bad("ParisKV.append: keys: head_dim stride must be 1");
            const std::int64_t rs = n > 1 ? std::int64_t(keys.stride(0)) : d;
            const void* p = keys.data();
            nb::gil_scoped_release unlocked;
            switch (dtype_of(keys, "ParisKV.append: keys")) {
              case DT::f32: idx.append(static_cast<const float*>(p), n, rs); break;
              case DT::f16: idx.append(static_cast<const kvscore::half*>(p), n, rs); break;
              default: idx.append(static_cast<const kvscore::bfloat16*>(p), n, rs); break;
            }
          },
          "keys"_a)
      .def(
          "search",
          [](const kvscore::ParisKV& idx, const Any& queries, std::int64_t k, double beta, double rho) {
            std::vector<float> q = f32_copy(queries, "ParisKV.search: queries [n, head_dim]", 2);
            const auto nq = std::int64_t(queries.shape(0));
            if (std::int64_t(queries.shape(1)) != idx.head_dim())
              bad("ParisKV.search: queries have head_dim " + std::to_string(queries.shape(1)) + ", the index " +
                  std::to_string(idx.head_dim()));
            kvscore::ParisKVSearch o;
            o.k = k;
            o.beta = beta;
            o.rho = rho;
            idx.check_options(o, false, 0);
            std::vector<std::int64_t> pos(std::size_t(nq * k));
            std::vector<float> sc(std::size_t(nq * k));
            {
              nb::gil_scoped_release unlocked;
              kvscore::ParisKV::Workspace ws;
              kvscore::ParisKVResult r;
              for (std::int64_t i = 0; i < nq; ++i) {
                idx.search(q.data() + i * idx.head_dim(), o, ws, r);
                std::copy(r.positions.begin(), r.positions.end(), pos.begin() + i * k);
                std::copy(r.scores.begin(), r.scores.end(), sc.begin() + i * k);
              }
            }
            return nb::make_tuple(to_numpy(std::move(pos), {std::size_t(nq), std::size_t(k)}),
                                  to_numpy(std::move(sc), {std::size_t(nq), std::size_t(k)}));
          },
          "queries"_a, "k"_a = 100, "beta"_a = 0.0, "rho"_a = 0.0);

  // ---- ParisKVCache: one head's decode-time cache (sinks + index + local window)
  bind_pariskv_cache<float>(m, "ParisKVCacheF32", DT::f32);
  bind_pariskv_cache<kvscore::half>(m, "ParisKVCacheF16", DT::f16);
  bind_pariskv_cache<kvscore::bfloat16>(m, "ParisKVCacheBF16", DT::bf16);

  // ---- OjaKV: one head's low-rank key/value projector
  nb::class_<kvscore::OjaProjector>(m, "OjaProjector")
      .def_static(
          "random",
          [](std::int64_t d, std::int64_t rk, std::int64_t rv, std::uint64_t seed) {
            return kvscore::OjaProjector::random(d, rk, rv, seed);
          },
          "head_dim"_a, "key_rank"_a, "value_rank"_a, "seed"_a = 0)
      .def_prop_ro("head_dim", &kvscore::OjaProjector::head_dim)
      .def(
          "prefill",
          [](kvscore::OjaProjector& p, const Any& keys, const Any& values) {
            with_keys(keys, "keys", [&](const auto& k) {
              with_keys(values, "values", [&](const auto& v) {
                if (k.heads() != 1 || v.heads() != 1) bad("OjaProjector.prefill: keys and values must have 1 head");
                nb::gil_scoped_release unlocked;
                p.prefill(k, v, 0);
              });
            });
          },
          "keys"_a, "values"_a)
      .def_prop_ro("key_basis",
                   [](const kvscore::OjaProjector& p) { return basis_out(p.key()); })
      .def_prop_ro("value_basis", [](const kvscore::OjaProjector& p) { return basis_out(p.value()); });
}
