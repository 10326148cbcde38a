// python/src/kvscore_cuda_ext.cpp — the nanobind module kvscore._kvscore_cuda (docs/reference/python.md,
// "CUDA tensors"): kvscore::cuda behind kvscore's Python functions for tensors in GPU memory.
//
// Built only when asked (KVSCORE_CUDA=1 pip install .), in its own nanobind domain, over the
// static CUDA runtime: it imports on a machine with no driver, and status() says why it cannot
// run there. Arrays arrive through DLPack (torch CUDA tensors) and are read in place, with the
// checks and messages of kvscore._kvscore (arrays.hpp) and the library's own argument checks,
// all before any CUDA call. Nothing here allocates device memory: every output and every
// workspace is an array the caller passes (kvscore/_cuda.py takes them from torch's caching
// allocator), sized by the *_workspace_bytes / select_plan queries, which make no CUDA call.
// Launches go to the stream the caller names (torch's current stream of the tensor's device)
// under a kvscore::cuda::DeviceGuard for the tensor's device; the GIL is released around them.
//
// Batched forms (`batched=True`, the presses): keys [batch, heads, tokens, head_dim]. When the
// batch stride is heads x head stride (an HF cache) the rows are one view of batch x heads heads
// and each scorer runs one launch sequence for the whole batch; otherwise row by row.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "kvscore/cuda/compact.hpp"
#include "kvscore/cuda/device.hpp"
#include "kvscore/cuda/protokv.hpp"
#include "kvscore/cuda/scorers.hpp"
#include "kvscore/cuda/select.hpp"
#include "kvscore/version.hpp"

namespace nb = nanobind;
using namespace nb::literals;
namespace kc = kvscore::cuda;

namespace {

using namespace kvscore::py;  // the array checks and messages of kvscore._kvscore (arrays.hpp)

/// Any array (device checked below); `In` read-only, `Out` written.
using In = nb::ndarray<nb::ro>;
using Out = nb::ndarray<>;

// ------------------------------------------------------------------ devices and streams

template <class A>
int cuda_device_of(const A& a, const std::string& what) {
  const int t = a.device_type();
  if (t != nb::device::cuda::value && t != nb::device::cuda_managed::value)
    bad(what + ": expected an array in CUDA memory (DLPack device type " + std::to_string(t) +
        "); kvscore's CPU functions take host arrays");
  return a.device_id();
}

/// The device every array of one call is on (the first one's); a ValueError naming any other.
struct Launch {
  int device = 0;
  kc::stream_t stream = nullptr;
  template <class A>
  void same(const A& a, const std::string& what) const {
    const int d = cuda_device_of(a, what);
    if (d != device)
      bad(what + " is on cuda:" + std::to_string(d) + " but the keys are on cuda:" + std::to_string(device));
  }
};
template <class A>
Launch launch_on(const A& first, const std::string& what, std::uintptr_t stream) {
  return {cuda_device_of(first, what), reinterpret_cast<kc::stream_t>(stream)};
}

/// The caller's workspace array (uint8, contiguous, 1-D), on the launch's device.
kc::Workspace workspace_of(const Out& ws, const Launch& l) {
  if (ws.ndim() != 1) bad("workspace: expected a 1-D uint8 array");
  if (ws.shape(0) > 0) l.same(ws, "workspace");
  return {ws.data(), std::size_t(ws.shape(0)) * (std::size_t(ws.dtype().bits) / 8)};
}

/// A caller's fp32 output of `rows` x `cols`, row-contiguous (scores).
float* f32_out(const Out& a, std::int64_t rows, std::int64_t cols, const Launch& l, const std::string& what) {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < a.ndim(); ++i) n *= std::int64_t(a.shape(i));
  if (dtype_of(a, what) != DT::f32 || n != rows * cols)
    bad(what + ": expected float32 with " + std::to_string(rows) + " x " + std::to_string(cols) + " elements");
  std::int64_t expect = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect) bad(what + ": must be C-contiguous");
    expect *= std::int64_t(a.shape(i));
  }
  if (n > 0) l.same(a, what);
  return static_cast<float*>(a.data());
}

/// int64 output of n entries, contiguous.
std::int64_t* i64_out(const Out& a, std::int64_t n, const Launch& l, const std::string& what) {
  const auto t = a.dtype();
  if (a.ndim() != 1 || t.code != std::uint8_t(nb::dlpack::dtype_code::Int) || t.bits != 64 ||
      std::int64_t(a.shape(0)) < n || (a.shape(0) > 1 && a.stride(0) != 1))
    bad(what + ": expected a contiguous 1-D int64 array of at least " + std::to_string(n) + " entries");
  if (a.shape(0) > 0) l.same(a, what);
  return static_cast<std::int64_t*>(a.data());
}

// ------------------------------------------------------------------ keys

/// Keys [heads, tokens, head_dim] or [1, ...] (batched: [batch, heads, tokens, head_dim], any
/// batch) as one device view per call: `rows` views of batch-row keys, or one view of batch x
/// heads heads when the batch stride allows.
struct DeviceKeys {
  std::int64_t batch = 1, H = 0, N = 0, D = 0, hs = 0, ts = 0, bs = 0;
  bool flat = true;  ///< one view of batch x heads heads
  DT dt = DT::f32;
  const void* data = nullptr;
  /// Views per launch sequence and the heads of each.
  std::int64_t views() const { return flat ? 1 : batch; }
  std::int64_t view_heads() const { return flat ? batch * H : H; }
};

template <class A>
DeviceKeys device_keys(const A& a, const std::string& what, bool batched, const char* needs) {
  DeviceKeys k;
  if (batched && a.ndim() == 4) {
    k.batch = std::int64_t(a.shape(0));
    check_strides_nonneg(a, what);
    HND s{std::int64_t(a.shape(1)), std::int64_t(a.shape(2)), std::int64_t(a.shape(3)), 0, 0};
    if (k.batch > 0 && s.H > 0 && s.N > 0) {
      if (s.D > 1 && a.stride(3) != 1)
        bad(what + ": head_dim stride is " + std::to_string(a.stride(3)) + " elements; " + needs);
      s.hs = a.stride(1);
      s.ts = a.stride(2);
      k.bs = a.stride(0);
    } else {
      s.ts = s.D;
      s.hs = s.N * s.D;
      k.bs = s.H * s.hs;
    }
    k.H = s.H, k.N = s.N, k.D = s.D, k.hs = s.hs, k.ts = s.ts;
    k.flat = k.batch <= 1 || k.bs == k.H * k.hs;
  } else {
    const HND s = keys_shape(a, what, needs);
    k.H = s.H, k.N = s.N, k.D = s.D, k.hs = s.hs, k.ts = s.ts, k.bs = s.H * s.hs;
  }
  k.dt = dtype_of(a, what);
  k.data = a.data();
  return k;
}

/// f(DeviceKeysView<T>, view index) for each view of the keys (mutable: DeviceMutKeysView<T>).
template <bool Mutable = false, class F>
void for_each_view(const DeviceKeys& k, F&& f) {
  kvscore::visit_dtype(k.dt, [&]<class T>(std::type_identity<T>) {
    for (std::int64_t v = 0; v < k.views(); ++v) {
      T* p = const_cast<T*>(static_cast<const T*>(k.data)) + v * k.bs;
      if constexpr (Mutable) f(kc::DeviceMutKeysView<T>(p, k.view_heads(), k.N, k.D, k.hs, k.ts), v);
      else f(kc::DeviceKeysView<T>(p, k.view_heads(), k.N, k.D, k.hs, k.ts), v);
    }
  });
}

// ------------------------------------------------------------------ scorers

/// A registry scorer on device keys: the CPU policy (its options, host queries or filters) run
/// by kvscore::cuda::score.
struct Scorer {
  kvscore::AnyScorer s;

  template <class T>
  std::size_t bytes(const kc::DeviceKeysView<T>& v) const {
    if (const auto* p = s.get<kvscore::SnapKV>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::ProtoKV>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::KNorm>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::KeyDiff>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::ManifoldL2>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::WindowedManifoldL2>()) return kc::score_workspace_bytes(*p, v);
    if (const auto* p = s.get<kvscore::QFilter>()) return kc::score_workspace_bytes(*p, v);
    bad(std::string("scorer '") + s.name() + "' has no CUDA path");
  }
  template <class T>
  void run(const kc::DeviceKeysView<T>& v, const kc::DeviceScoresView& out, kc::Workspace ws,
           kc::stream_t st) const {
    if (const auto* p = s.get<kvscore::SnapKV>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::ProtoKV>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::KNorm>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::KeyDiff>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::ManifoldL2>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::WindowedManifoldL2>()) return kc::score(*p, v, out, ws, st);
    if (const auto* p = s.get<kvscore::QFilter>()) return kc::score(*p, v, out, ws, st);
    bad(std::string("scorer '") + s.name() + "' has no CUDA path");
  }
};

/// Workspace bytes of every view (the largest; views run one after the other on one stream).
template <class Bytes>
std::size_t max_bytes(const DeviceKeys& k, Bytes&& bytes) {
  std::size_t b = 0;
  for_each_view(k, [&](const auto& v, std::int64_t) { b = std::max(b, bytes(v)); });
  return b;
}

/// Scores of every view into `out` [batch * heads, tokens] (row-contiguous), under the device guard.
template <class Run>
void score_views(const DeviceKeys& k, const Out& out, const Out& ws, std::uintptr_t stream, const In& keys_arr,
                 Run&& run) {
  const Launch l = launch_on(keys_arr, "keys", stream);
  float* o = f32_out(out, k.batch * k.H, k.N, l, "scores");
  const kc::Workspace w = workspace_of(ws, l);
  nb::gil_scoped_release unlocked;
  const kc::DeviceGuard guard(l.device);
  for_each_view(k, [&](const auto& v, std::int64_t i) {
    run(v, kc::DeviceScoresView(o + i * k.view_heads() * k.N, v.heads(), v.tokens()), w, l.stream, i);
  });
}

void bind_scorers(nb::module_& m) {
  bind_scorer_args(m);
  nb::class_<Scorer>(m, "Scorer", "A registry scorer (kvscore::make_scorer) run by kvscore::cuda::score.")
      .def_prop_ro("protected_recent", [](const Scorer& s) { return s.s.protected_recent(); })
      .def_prop_ro("name", [](const Scorer& s) { return std::string(s.s.name()); })
      .def(
          "workspace_bytes",
          [](const Scorer& s, const In& keys, bool batched) {
            cuda_device_of(keys, "keys");
            const DeviceKeys k = device_keys(keys, "keys", batched, kKeysNeedUnitStride);
            return max_bytes(k, [&](const auto& v) { return s.bytes(v); });
          },
          "keys"_a, "batched"_a = false,
          "Device workspace bytes score() needs for these keys (checks every argument; no CUDA call).")
      .def(
          "score",
          [](const Scorer& s, const In& keys, const Out& out, const Out& ws, std::uintptr_t stream, bool batched) {
            cuda_device_of(keys, "keys");
            const DeviceKeys k = device_keys(keys, "keys", batched, kKeysNeedUnitStride);
            max_bytes(k, [&](const auto& v) { return s.bytes(v); });  // every check before the first launch
            score_views(k, out, ws, stream, keys,
                        [&](const auto& v, const kc::DeviceScoresView& o, kc::Workspace w, kc::stream_t st,
                            std::int64_t) { s.run(v, o, w, st); });
          },
          "keys"_a, "out"_a, "workspace"_a, "stream"_a, "batched"_a = false,
          "Scores of keys [heads, tokens, head_dim] (or [1, ...]; batched: [batch, ...]) into out (float32,\n"
          "batch x heads x tokens), asynchronously on `stream` (a cudaStream_t as an integer).");

  m.def(
      "make_scorer",
      [](const std::string& name, const kvscore::ScorerArgs& args, nb::handle queries, std::int64_t last,
         nb::handle filters) { return Scorer{scorer_from(name, args, queries, last, filters)}; },
      "name"_a, "args"_a, "queries"_a = nb::none(), "last"_a = 0, "filters"_a = nb::none(),
      "kvscore::make_scorer(name, args) with host queries / filters (as kvscore._kvscore.make_scorer), for\n"
      "device keys.");
}

// ------------------------------------------------------------------ SnapKV with device queries

/// Queries [q_heads, n, head_dim] or [1, ...] (batched: [batch, q_heads, n, head_dim]) in device memory.
kc::DeviceSnapKV device_snapkv(const In& q, std::int64_t window, std::int64_t kernel, const std::string& placement,
                               bool batched, std::int64_t batch) {
  cuda_device_of(q, "queries");
  kc::DeviceSnapKV s;
  kc::detail::QueriesArg& a = s.queries;
  std::size_t o = 0;
  if (batched && q.ndim() == 4) {
    a.batch = std::int64_t(q.shape(0));
    if (a.batch != batch)
      bad("queries: batch " + std::to_string(a.batch) + " but the keys have batch " + std::to_string(batch));
    a.batch_stride = q.stride(0);
    o = 1;
  } else {
    o = hnd_offset(q, "queries", "[q_heads, queries, head_dim]");
  }
  check_strides_nonneg(q, "queries");
  a.data = q.data();
  a.type = dtype_of(q, "queries");
  a.heads = std::int64_t(q.shape(o));
  a.n = std::int64_t(q.shape(o + 1));
  a.head_dim = std::int64_t(q.shape(o + 2));
  a.head_stride = q.stride(o);
  a.query_stride = q.stride(o + 1);
  a.dim_stride = q.stride(o + 2);
  s.window = window;
  s.kernel_size = kernel;
  s.placement = kvscore::parse_query_placement(placement);
  return s;
}

void bind_snapkv(nb::module_& m) {
  m.def(
      "snapkv_workspace_bytes",
      [](const In& keys, const In& queries, std::int64_t window, std::int64_t kernel, const std::string& placement,
         bool batched) {
        cuda_device_of(keys, "keys");
        const DeviceKeys k = device_keys(keys, "keys", batched, kKeysNeedUnitStride);
        kc::DeviceSnapKV s = device_snapkv(queries, window, kernel, placement, batched, k.batch);
        return max_bytes(k, [&](const auto& v) {
          kc::DeviceSnapKV one = s;
          if (!k.flat) one.queries.batch = 1;
          return kc::score_workspace_bytes(one, v);
        });
      },
      "keys"_a, "queries"_a, "window"_a, "kernel"_a, "placement"_a, "batched"_a = false,
      "Device workspace bytes of score_snapkv (checks every argument; no CUDA call).");
  m.def(
      "snapkv_protected_recent",
      [](const In& queries, std::int64_t window, std::int64_t kernel, const std::string& placement, bool batched) {
        const std::int64_t b = batched && queries.ndim() == 4 ? std::int64_t(queries.shape(0)) : 1;
        return device_snapkv(queries, window, kernel, placement, batched, b).protected_recent();
      },
      "queries"_a, "window"_a, "kernel"_a, "placement"_a, "batched"_a = false,
      "SnapKV::protected_recent() of these device queries (the window in the cache, 0 after it).");
  m.def(
      "score_snapkv",
      [](const In& keys, const In& queries, std::int64_t window, std::int64_t kernel, const std::string& placement,
         const Out& out, const Out& ws, std::uintptr_t stream, bool batched) {
        cuda_device_of(keys, "keys");
        const DeviceKeys k = device_keys(keys, "keys", batched, kKeysNeedUnitStride);
        const kc::DeviceSnapKV s = device_snapkv(queries, window, kernel, placement, batched, k.batch);
        const auto one = [&](std::int64_t view) {
          kc::DeviceSnapKV r = s;
          if (!k.flat) {  // row by row: that row's queries
            r.queries.batch = 1;
            r.queries.data = static_cast<const unsigned char*>(s.queries.data) +
                             view * s.queries.batch_stride * std::int64_t(element_size(s.queries.type));
          }
          return r;
        };
        max_bytes(k, [&](const auto& v) { return kc::score_workspace_bytes(one(0), v); });
        launch_on(keys, "keys", stream).same(queries, "queries");
        score_views(k, out, ws, stream, keys,
                    [&](const auto& v, const kc::DeviceScoresView& o, kc::Workspace w, kc::stream_t st,
                        std::int64_t view) { kc::score(one(view), v, o, w, st); });
      },
      "keys"_a, "queries"_a, "window"_a, "kernel"_a, "placement"_a, "out"_a, "workspace"_a, "stream"_a,
      "batched"_a = false,
      "SnapKV with its window queries in device memory (kvscore::cuda::DeviceSnapKV) into out.");
}

// ------------------------------------------------------------------ selection and compaction

kc::DeviceScoresView scores_view(const In& scores) {
  cuda_device_of(scores, "scores [heads, tokens]");
  const F32Rows r = f32_rows(scores, "scores [heads, tokens]");
  return kc::DeviceScoresView(const_cast<float*>(r.data), r.rows, r.cols, r.row_stride);
}

void bind_select(nb::module_& m) {
  const kvscore::SelectOptions def;
  m.def(
      "select_plan",
      [](const In& scores, std::int64_t budget, std::int64_t sinks, std::int64_t recent, const std::string& alloc,
         double alpha, bool normalize, int threads, std::int64_t batch) {
        const kc::DeviceScoresView v = scores_view(scores);
        const kvscore::SelectOptions o = select_options(sinks, recent, alloc, alpha, normalize, threads);
        const kvscore::Budget b = kvscore::Budget::per_head(budget);
        return nb::make_tuple(kc::select_batch_workspace_bytes(v, batch, b, o), kc::select_batch_total(v, batch, b, o),
                              o.alloc == kvscore::Alloc::per_head);
      },
      "scores"_a, "budget"_a, "sinks"_a = def.sinks, "recent"_a = def.recent, "alloc"_a = to_string(def.alloc),
      "alpha"_a = def.alpha, "normalize"_a = def.normalize, "threads"_a = def.num_threads, "batch"_a = 1,
      "(workspace bytes, positions written, dense: every row keeps the same count) of select for these\n"
      "arguments: every check, no CUDA call.");
  m.def(
      "select",
      [](const In& scores, std::int64_t budget, std::int64_t sinks, std::int64_t recent, const std::string& alloc,
         double alpha, bool normalize, int threads, std::int64_t batch, const Out& offsets, const Out& positions,
         const Out& ws, std::uintptr_t stream) {
        const kc::DeviceScoresView v = scores_view(scores);
        const kvscore::SelectOptions o = select_options(sinks, recent, alloc, alpha, normalize, threads);
        const kvscore::Budget b = kvscore::Budget::per_head(budget);
        const std::int64_t total = kc::select_batch_total(v, batch, b, o);
        const Launch l = launch_on(scores, "scores", stream);
        std::int64_t* off = i64_out(offsets, v.heads() + 1, l, "offsets");
        std::int64_t* pos = i64_out(positions, total, l, "positions");
        const kc::Workspace w = workspace_of(ws, l);
        nb::gil_scoped_release unlocked;
        const kc::DeviceGuard guard(l.device);
        kc::select_batch_into(v, batch, b, o, w, off, pos, std::size_t(positions.shape(0)), l.stream);
      },
      "scores"_a, "budget"_a, "sinks"_a, "recent"_a, "alloc"_a, "alpha"_a, "normalize"_a, "threads"_a, "batch"_a,
      "offsets"_a, "positions"_a, "workspace"_a, "stream"_a,
      "kvscore::cuda::select_batch_into: offsets [rows + 1] and positions (CSR, ascending per row) on the device.");

  m.def(
      "selection_check_workspace_bytes", [] { return kc::selection_check_workspace_bytes(); },
      "Device workspace bytes of compact's selection check.");
  m.def(
      "compact",
      [](const Out& keys, const Out& values, const In& offsets, const In& positions, const std::string& tail,
         bool equal, const Out& ws, std::uintptr_t stream) {
        if (tail != "keep" && tail != "zero") bad("compact: tail '" + tail + "' must be 'keep' or 'zero'");
        constexpr const char* who = "kvscore::compact";  // the CPU's messages
        cuda_device_of(keys, "keys");
        cuda_device_of(values, "values");
        const DeviceKeys k = device_keys(keys, "keys", false, kCompactNeedsUnitStride);
        const DeviceKeys vv = device_keys(values, "values", false, kCompactNeedsUnitStride);
        if (k.H != vv.H || k.N != vv.N)
          bad(std::string(who) + ": keys (" + std::to_string(k.H) + " heads, " + std::to_string(k.N) +
              " tokens) and values (" + std::to_string(vv.H) + " heads, " + std::to_string(vv.N) + " tokens) differ");
        if (k.H > 0 && k.N > 0 && k.data == vv.data) bad(std::string(who) + ": keys and values are the same memory");
        const Launch l = launch_on(keys, "keys", stream);
        l.same(values, "values");
        if (offsets.ndim() != 1 || positions.ndim() != 1 || offsets.dtype() != nb::dtype<std::int64_t>() ||
            positions.dtype() != nb::dtype<std::int64_t>() || (offsets.shape(0) > 1 && offsets.stride(0) != 1) ||
            (positions.shape(0) > 1 && positions.stride(0) != 1))
          bad("selection: expected contiguous 1-D int64 offsets and positions");
        if (std::int64_t(offsets.shape(0)) != k.H + 1)
          bad(std::string(who) + ": selection has " + std::to_string(std::int64_t(offsets.shape(0)) - 1) +
              " heads but the cache has " + std::to_string(k.H));
        l.same(offsets, "selection offsets");
        if (positions.shape(0) > 0) l.same(positions, "selection positions");
        const kc::Workspace w = workspace_of(ws, l);
        const kc::DeviceSelection sel{k.H, k.N, static_cast<const std::int64_t*>(offsets.data()),
                                      static_cast<const std::int64_t*>(positions.data())};
        kvscore::CompactOptions o;
        o.tail = tail == "zero" ? kvscore::CompactTail::zero : kvscore::CompactTail::keep;
        std::vector<std::int64_t> lengths;
        {
          nb::gil_scoped_release unlocked;
          const kc::DeviceGuard guard(l.device);
          // a caller's selection is checked as the CPU checks it (one synchronisation) before it is trusted
          const std::vector<std::int64_t> off =
              kc::check_selection(sel, std::int64_t(positions.shape(0)), w, l.stream, who);
          for (std::int64_t h = 0; h < k.H; ++h) lengths.push_back(off[std::size_t(h + 1)] - off[std::size_t(h)]);
          if (equal)
            for (std::int64_t h = 1; h < k.H; ++h)
              if (lengths[std::size_t(h)] != lengths[0])
                kvscore::detail::throw_invalid(std::string(who) + ": require_equal_lengths, but head " +
                                               std::to_string(h) + " keeps " + std::to_string(lengths[std::size_t(h)]) +
                                               " rows and head 0 keeps " + std::to_string(lengths[0]));
          for_each_view<true>(k, [&](const auto& kview, std::int64_t) {
            for_each_view<true>(vv, [&](const auto& vview, std::int64_t) { kc::compact(kview, vview, sel, o, l.stream); });
          });
        }
        return lengths;
      },
      "keys"_a, "values"_a, "offsets"_a, "positions"_a, "tail"_a, "require_equal_lengths"_a, "workspace"_a,
      "stream"_a,
      "kvscore::cuda::compact in place with a device CSR selection, checked first (the CPU's rules and messages;\n"
      "one synchronisation); the kept length of each head.");
}

// ------------------------------------------------------------------ status

nb::dict status() {
  const kc::RuntimeStatus s = kc::runtime_status();
  nb::dict d;
  d["available"] = s.reason == "available";
  d["reason"] = s.reason;
  d["message"] = s.message;
  d["driver_version"] = s.driver_version;
  d["runtime_version"] = s.runtime_version;
  d["built_architectures"] = s.built_architectures;
  nb::list devs;
  for (const auto& x : s.devices) {
    nb::dict e;
    e["name"] = x.name;
    e["capability"] = nb::make_tuple(x.major, x.minor);
    e["supported"] = x.supported;
    devs.append(e);
  }
  d["devices"] = devs;
  return d;
}

}  // namespace

NB_MODULE(_kvscore_cuda, m) {
  m.doc() = "kvscore::cuda for CUDA tensors (use the kvscore package; docs/reference/python.md \"CUDA tensors\")";
  m.attr("__version__") = kvscore::version_string;
  nb::register_exception_translator(translate_errors);  // arrays.hpp: the same Python exceptions as _kvscore
  m.def("status", &status,
        "Whether kvscore's CUDA path can run here and why not: a dict (available, reason, message, versions,\n"
        "built_architectures, devices). Asks the driver only (no context is created).");
  bind_scorers(m);
  bind_snapkv(m);
  bind_select(m);
}
