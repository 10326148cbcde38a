// python/src/arrays.hpp — what both Python modules, kvscore._kvscore (kvscore_ext.cpp) and
// kvscore._kvscore_cuda (kvscore_cuda_ext.cpp), check and say about the arrays they are given:
// dtypes, shapes, strides and their messages, the scorer arguments (kvscore::ScorerArgs and
// make_scorer's queries / filters), results as numpy arrays, and C++ exceptions as Python ones.
// One copy, so that a CUDA tensor and a CPU array with the same fault get the same error.
// Array checks are templates over the nb::ndarray type (host or device memory: they read only
// the shape, strides and dtype); gathers that read elements take host arrays (Any).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/core/dtype.hpp"
#include "kvscore/make_scorer.hpp"
#include "kvscore/select.hpp"

namespace nb = nanobind;

namespace kvscore::py {

using namespace nb::literals;

/// A read-only host array (numpy through the buffer protocol, a CPU torch tensor through DLPack).
using Any = nb::ndarray<nb::ro, nb::device::cpu>;
/// A writable host array.
using Mut = nb::ndarray<nb::device::cpu>;

// ------------------------------------------------------------------ errors

/// A wrong kind of argument (not a wrong value): TypeError in Python (translate_errors).
struct ArgTypeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

[[noreturn]] inline void bad(const std::string& what) { throw std::invalid_argument(what); }

// ------------------------------------------------------------------ arrays in

using DT = kvscore::dtype;

/// "float64", "int32", "bool", ... for a DLPack dtype (messages).
inline std::string dtype_name(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  std::string s;
  switch (C(t.code)) {
    case C::Int: s = "int"; break;
    case C::UInt: s = "uint"; break;
    case C::Float: s = "float"; break;
    case C::Bfloat: s = "bfloat"; break;
    case C::Complex: s = "complex"; break;
    case C::Bool: return "bool";
    default: s = "DLPack code " + std::to_string(t.code) + " "; break;
  }
  s += std::to_string(t.bits);
  if (t.lanes != 1) s += " x" + std::to_string(t.lanes);
  return s;
}

template <class A>
DT dtype_of(const A& a, const std::string& what) {
  const nb::dlpack::dtype t = a.dtype();
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 32) return DT::f32;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Float) && t.bits == 16) return DT::f16;
  if (t.lanes == 1 && t.code == std::uint8_t(nb::dlpack::dtype_code::Bfloat) && t.bits == 16) return DT::bf16;
  bad(what + ": dtype " + dtype_name(t) + " must be float32, float16 or bfloat16");
}

inline std::size_t element_size(DT dt) { return dt == DT::f32 ? 4 : 2; }

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

/// A [heads, tokens, head_dim] view's shape and element strides, read from a 3-D or [1, ...] 4-D
/// array. An empty array (no heads or no tokens) has no rows to read, and numpy 2 reports zero
/// strides for it: its strides are then C order's, so empty caches are valid (docs/contributing/robustness.md).
struct HND {
  std::int64_t H = 0, N = 0, D = 0, hs = 0, ts = 0;
};
template <class A>
HND keys_shape(const A& a, const std::string& what, const char* needs) {
  const std::size_t o = hnd_offset(a, what, "[heads, tokens, head_dim]");
  check_strides_nonneg(a, what);
  HND s{std::int64_t(a.shape(o)), std::int64_t(a.shape(o + 1)), std::int64_t(a.shape(o + 2)), 0, 0};
  if (s.H == 0 || s.N == 0) {
    s.ts = s.D;
    s.hs = s.N * s.D;
    return s;
  }
  if (s.D > 1 && a.stride(o + 2) != 1)
    bad(what + ": head_dim stride is " + std::to_string(a.stride(o + 2)) + " elements; " + needs);
  s.hs = a.stride(o);
  s.ts = a.stride(o + 1);
  return s;
}

/// What keys_shape() says a reader of keys needs when the head_dim stride is not 1 (scoring, compaction).
inline constexpr const char* kKeysNeedUnitStride =
    "kvscore reads each key row in place and needs stride 1 (no silent copy: pass a tensor whose last dimension "
    "is contiguous, e.g. .contiguous())";
inline constexpr const char* kCompactNeedsUnitStride = "compaction needs stride 1";

/// The element at `e` (any alignment) of dtype dt, widened to fp32.
inline float element_as_float(const unsigned char* e, DT dt) {
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
inline Queries gather_queries(const Any& q, const std::string& what, std::int64_t last = 0) {
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
  const auto es = std::int64_t(element_size(dt));
  for (std::int64_t h = 0; h < r.heads; ++h)
    for (std::int64_t i = 0; i < r.n; ++i)
      for (std::int64_t j = 0; j < r.dim; ++j) {
        const std::int64_t off = h * q.stride(o) + (first + i) * q.stride(o + 1) + j * q.stride(o + 2);
        r.data[std::size_t((h * r.n + i) * r.dim + j)] = element_as_float(base + off * es, dt);
      }
  return r;
}

/// fp32 2-D [rows, cols] read in place (token stride 1), e.g. scores; `data` is the array's own
/// pointer (host or device memory).
struct F32Rows {
  const float* data;
  std::int64_t rows, cols, row_stride;
};
template <class A>
F32Rows f32_rows(const A& a, const std::string& what) {
  if (a.ndim() != 2) bad(what + ": expected 2 dimensions (got " + std::to_string(a.ndim()) + ")");
  if (dtype_of(a, what) != DT::f32) bad(what + ": must be float32 (kvscore's scores are fp32)");
  check_strides_nonneg(a, what);
  const auto R = std::int64_t(a.shape(0)), C = std::int64_t(a.shape(1));
  if (R == 0 || C == 0) return {static_cast<const float*>(a.data()), R, C, C};  // empty: strides say nothing
  if (C > 1 && a.stride(1) != 1)
    bad(what + ": stride " + std::to_string(a.stride(1)) + " of the last dimension must be 1 (no silent copy)");
  return {static_cast<const float*>(a.data()), R, C, R > 1 ? std::int64_t(a.stride(0)) : C};
}

/// Any float array of `ndim` dimensions (any dtype kvscore reads, any strides) as fp32, C order.
inline std::vector<float> f32_copy(const Any& a, const std::string& what, std::size_t ndim) {
  if (a.ndim() != ndim)
    bad(what + ": expected " + std::to_string(ndim) + " dimensions (got " + std::to_string(a.ndim()) + ")");
  const DT dt = dtype_of(a, what);
  check_strides_nonneg(a, what);
  std::size_t total = 1;
  for (std::size_t i = 0; i < ndim; ++i) total *= a.shape(i);
  std::vector<float> out(total);
  const auto* base = static_cast<const unsigned char*>(a.data());
  const auto es = std::int64_t(element_size(dt));
  std::vector<std::size_t> idx(ndim, 0);
  for (std::size_t flat = 0; flat < total; ++flat) {
    std::int64_t off = 0;
    for (std::size_t i = 0; i < ndim; ++i) off += std::int64_t(idx[i]) * a.stride(i);
    out[flat] = element_as_float(base + off * es, dt);
    for (std::size_t i = ndim; i-- > 0;) {
      if (++idx[i] < a.shape(i)) break;
      idx[i] = 0;
    }
  }
  return out;
}

// ------------------------------------------------------------------ arrays out

/// A new numpy array owning `v` (moved; no copy of the data).
template <class T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& v, std::vector<std::size_t> shape) {
  auto* owned = new std::vector<T>(std::move(v));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape.size(), shape.data(), owner);
}

// ------------------------------------------------------------------ scorer arguments

/// The Python side of kvscore::ScorerArgs: every scalar option, under the struct's field names
/// (enums as their names); queries and filters are arrays passed to make_scorer.
inline void bind_scorer_args(nb::module_& m) {
  using A = kvscore::ScorerArgs;
  nb::class_<A>(m, "ScorerArgs", "kvscore::ScorerArgs (make_scorer.hpp); its defaults are the registry's.")
      .def(nb::init<>())
      .def_rw("threads", &A::threads)
      .def_rw("window", &A::window)
      .def_prop_rw(
          "window_tail", [](const A& a) -> std::string { return to_string(a.window_tail); },
          [](A& a, const std::string& s) { a.window_tail = kvscore::parse_window_tail(s); })
      .def_rw("group", &A::group)
      .def_prop_rw(
          "placement", [](const A& a) -> std::string { return kvscore::to_string(a.placement); },
          [](A& a, const std::string& s) { a.placement = kvscore::parse_query_placement(s); })
      .def_prop_rw(
          "aggregate", [](const A& a) -> std::string { return kvscore::to_string(a.aggregate); },
          [](A& a, const std::string& s) { a.aggregate = kvscore::parse_query_aggregate(s); })
      .def_rw("kernel_size", &A::kernel_size)
      .def_rw("seed", &A::seed)
      .def_rw("kappa", &A::kappa)
      .def_rw("sat_candidates", &A::sat_candidates)
      .def_rw("lsh_bits", &A::lsh_bits)
      .def_rw("chunks", &A::chunks)
      .def_rw("bandwidth", &A::bandwidth)
      .def_prop_rw(
          "psi", [](const A& a) -> std::string { return kvscore::to_string(a.psi); },
          [](A& a, const std::string& s) { a.psi = kvscore::parse_psi(s); });
}

/// An array argument passed as a handle (optional ones); a TypeError naming it otherwise.
inline Any as_array(nb::handle h, const std::string& what) {
  Any a;
  if (!nb::try_cast(h, a))
    throw ArgTypeError(what + ": expected a numpy array or a CPU torch tensor (got " +
                       std::string(nb::type_name(h.type()).c_str()) + ")");
  return a;
}

/// kvscore::make_scorer(name, args) with the window queries (the last `last`, 0 = all) and the
/// filters of host arrays, gathered to fp32 (the constructors copy what they keep).
inline kvscore::AnyScorer scorer_from(const std::string& name, const kvscore::ScorerArgs& args, nb::handle queries,
                                      std::int64_t last, nb::handle filters) {
  kvscore::ScorerArgs a = args;
  Queries q;
  if (!queries.is_none()) {
    q = gather_queries(as_array(queries, "queries"), "queries", last);
    a.queries = q.data.data();
    a.q_heads = q.heads;
    a.n_queries = q.n;
    a.head_dim = q.dim;
  }
  if (!filters.is_none()) {
    const Any f = as_array(filters, "filters");
    a.filters = f32_copy(f, "filters [kv_heads, head_dim]", 2);
    a.kv_heads = std::int64_t(f.shape(0));
    a.head_dim = std::int64_t(f.shape(1));
  }
  return kvscore::make_scorer(name, a);  // copies what it keeps of the queries
}

/// kvscore::SelectOptions from select()'s keywords (alloc by name: parse_alloc's error for another).
inline kvscore::SelectOptions select_options(std::int64_t sinks, std::int64_t recent, const std::string& alloc,
                                             double alpha, bool normalize, int threads) {
  kvscore::SelectOptions o;
  o.sinks = sinks;
  o.recent = recent;
  o.alloc = kvscore::parse_alloc(alloc);
  o.alpha = alpha;
  o.normalize = normalize;
  o.num_threads = threads;
  return o;
}

// ------------------------------------------------------------------ errors, in one place

/// C++ exceptions as Python ones: a wrong kind of argument is a TypeError, a wrong value
/// (std::invalid_argument and the other logic errors the library throws) a ValueError with the
/// C++ message, which names the value; an allocation failure a MemoryError. Anything else keeps
/// nanobind's translation (std::runtime_error: RuntimeError, e.g. an unreadable file).
inline void translate_errors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const ArgTypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const std::invalid_argument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::domain_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::length_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_SetString(PyExc_MemoryError, "kvscore: out of memory");
  }
}

}  // namespace kvscore::py
