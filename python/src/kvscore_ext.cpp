// python/src/kvscore_ext.cpp — the nanobind module kvscore._kvscore (docs/reference/python.md).
//
// Arrays arrive as nb::ndarray (numpy through the buffer protocol, torch through DLPack) and
// are read in place: a KeysView is built from the array's own strides, so any layout the
// view can express is scored without a copy, and any other layout (an inner stride != 1,
// negative or overlapping strides) is a ValueError naming the stride. Results are new numpy
// arrays; kvscore/__init__.py turns them into torch tensors (zero-copy) when the input was
// one. Every heavy call releases the GIL.
//
// One bind_* function per area (registry, scorers, selection and compaction, evaluator and
// synthetic data, ParisKV, OjaKV, ISA); the array checks, their messages and the translation
// of errors into Python exceptions are in arrays.hpp, shared with kvscore._kvscore_cuda
// (kvscore_cuda_ext.cpp), so that both give the same errors. Every method and every default comes from the C++
// registry (kvscore/methods.hpp, make_scorer.hpp, make_method.hpp) and the option structs:
// python/tests/test_tree.py checks that this file and python/kvscore write none of their own.
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
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "arrays.hpp"
#include "kvscore/eval/evaluate.hpp"
#include "kvscore/eval/report.hpp"
#include "kvscore/joint.hpp"
#include "kvscore/kvscore.hpp"
#include "kvscore/methods.hpp"
#include "kvscore/synth.hpp"
#include "kvscore/version.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using namespace kvscore::py;  // the array checks and messages shared with kvscore._kvscore_cuda (arrays.hpp)

/// f(KeysView<T>) over keys [H, N, D] / [1, H, N, D] in place, for the array's dtype.
template <class A, class F>
auto with_keys(const A& a, const std::string& what, F&& f) {
  const HND s = keys_shape(a, what, kKeysNeedUnitStride);
  const void* p = a.data();
  return kvscore::visit_dtype(dtype_of(a, what), [&]<class T>(std::type_identity<T>) {
    return f(kvscore::KeysView<T>(static_cast<const T*>(p), s.H, s.N, s.D, s.hs, s.ts));
  });
}

/// Mutable form (compaction).
template <class F>
auto with_mut_keys(const Mut& a, const std::string& what, F&& f) {
  const HND s = keys_shape(a, what, kCompactNeedsUnitStride);
  void* p = a.data();
  return kvscore::visit_dtype(dtype_of(a, what), [&]<class T>(std::type_identity<T>) {
    return f(kvscore::MutKeysView<T>(static_cast<T*>(p), s.H, s.N, s.D, s.hs, s.ts));
  });
}

/// One query [head_dim] of a decode-time cache, as fp32.
std::vector<float> cache_query(const Any& query, std::int64_t head_dim, const std::string& who) {
  std::vector<float> q = f32_copy(query, who + ": query [head_dim]", 1);
  if (std::int64_t(q.size()) != head_dim)
    bad(who + ": query has " + std::to_string(q.size()) + " elements, head_dim is " + std::to_string(head_dim));
  return q;
}

// ------------------------------------------------------------------ arrays out

nb::object scores_out(const kvscore::Scores& s) {
  std::vector<float> v(s.values());  // Scores keeps its vector private; one copy of the fp32 result
  return nb::cast(to_numpy(std::move(v), {std::size_t(s.heads()), std::size_t(s.tokens())}));
}

/// A per-head selection as int64 [heads, n] (every head keeps n) or a list of 1-D arrays.
nb::object selection_out(kvscore::Selection&& s, bool dense) {
  if (dense) {
    const auto H = std::size_t(s.heads), n = std::size_t(s.heads > 0 ? s.kept(0) : 0);
    return nb::cast(to_numpy(std::move(s.positions), {H, n}));
  }
  nb::list out;
  for (std::int64_t h = 0; h < s.heads; ++h) {
    auto span = s.head(h);
    out.append(to_numpy(std::vector<std::int64_t>(span.begin(), span.end()), {span.size()}));
  }
  return out;
}

// ------------------------------------------------------------------ registry

// Alloc, BudgetRounding, WindowTail, QueryPlacement, ProtoKV's Psi, eval's Protocol and
// MixMetric by name: the library's to_string / parse_* (kvscore/core/names.hpp).

/// A dict of (name, value) pairs.
template <class... V>
nb::dict fields(std::pair<const char*, V>... kv) {
  nb::dict d;
  ((d[kv.first] = kv.second), ...);
  return d;
}

/// The defaults of the option structs the Python signatures use, by struct and field.
nb::dict struct_defaults() {
  using P = std::pair<const char*, nb::object>;
  auto f = [](const char* k, auto v) { return P{k, nb::cast(v)}; };
  nb::dict d;
  const kvscore::SelectOptions sel;
  d["SelectOptions"] = fields(f("sinks", sel.sinks), f("recent", sel.recent), f("alloc", to_string(sel.alloc)),
                              f("alpha", sel.alpha), f("normalize", sel.normalize), f("threads", sel.num_threads));
  const kvscore::CompactOptions co;
  d["CompactOptions"] = fields(f("tail", co.tail == kvscore::CompactTail::zero ? "zero" : "keep"));
  const kvscore::eval::EvalOptions ev;
  d["EvalOptions"] = fields(f("keep", ev.keep), f("rounding", to_string(ev.rounding)),
                            f("mix_metric", to_string(ev.mix_metric)));
  const kvscore::eval::MethodOptions mo;
  d["MethodOptions"] = fields(f("window", mo.window), f("window_tail", to_string(mo.window_tail)),
                              f("placement", kvscore::to_string(mo.placement)),
                              f("streaming_sinks", mo.streaming_sinks), f("protocol", to_string(mo.protocol)));
  const kvscore::synth::Spec sp;
  d["synth.Spec"] = fields(f("kind", kvscore::synth::kind_name(sp.kind)), f("layers", sp.layers),
                           f("kv_heads", sp.kv_heads), f("group", sp.group), f("tokens", sp.tokens),
                           f("head_dim", sp.head_dim), f("queries", sp.queries), f("segment", sp.segment),
                           f("seed", sp.seed));
  const kvscore::ParisKVConfig pc;
  d["ParisKVConfig"] = fields(f("m", pc.m), f("seed", pc.seed), f("center", pc.center));
  const kvscore::ParisKVSearch ps;
  d["ParisKVSearch"] = fields(f("k", ps.k), f("beta", ps.beta), f("rho", ps.rho), f("rerank_exact", ps.rerank_exact));
  const kvscore::ParisKVCacheConfig cc;
  d["ParisKVCacheConfig"] = fields(f("sinks", cc.sinks), f("local", cc.local), f("update_interval", cc.update_interval),
                                   f("dense_min", cc.dense_min), f("k", cc.search.k),
                                   f("rerank_exact", cc.search.rerank_exact));
  const kvscore::BlockSparseOptions bs;
  d["BlockSparseOptions"] = fields(f("score", kvscore::to_string(bs.score)), f("sinks", bs.sinks), f("local", bs.local),
                                   f("scale", bs.scale), f("prefilter", bs.prefilter),
                                   f("group", kvscore::to_string(bs.group)), f("refresh", bs.refresh),
                                   f("threads", bs.num_threads), f("probe", bs.probe));
  return d;
}

void bind_registry(nb::module_& m) {
  m.def(
      "methods",
      [] {
        nb::list out;
        for (const kvscore::MethodInfo& x : kvscore::kMethods) {
          auto strings = [](std::string_view list) {
            std::vector<std::string> v;
            for (std::string_view a : kvscore::split_list(list)) v.emplace_back(a);
            return v;
          };
          nb::dict d;
          d["name"] = std::string(x.name);
          d["cli"] = std::string(x.cli);
          d["aliases"] = strings(x.aliases);
          d["kind"] = std::string(kvscore::kind_name(x.kind));
          d["cls"] = std::string(x.cls);
          d["header"] = std::string(x.header);
          d["doc"] = std::string(x.doc);
          d["summary"] = std::string(x.summary);
          d["options"] = strings(x.options);
          out.append(d);
        }
        return out;
      },
      "kvscore/methods.hpp's kMethods, the one list of methods: a list of dicts (name, cli, aliases, kind, cls,\n"
      "header, doc, summary, options).");
  m.def(
      "method_names", [] { return kvscore::eval::resolve_methods("all"); },
      "The evaluator's `--methods all`, in report order.");

  // The defaults every method shares with a front end (kvscore/methods.hpp), under their C++ names.
  m.attr("kDefaultWindow") = kvscore::kDefaultWindow;
  m.attr("kDefaultSnapKVWindow") = kvscore::kDefaultSnapKVWindow;
  m.attr("kDefaultSnapKVKernel") = kvscore::kDefaultSnapKVKernel;
  m.attr("kDefaultProtoKVKappa") = kvscore::kDefaultProtoKVKappa;
  m.attr("kDefaultProtoKVSatCandidates") = kvscore::kDefaultProtoKVSatCandidates;
  m.attr("kDefaultProtoKVLshBits") = kvscore::kDefaultProtoKVLshBits;
  m.attr("kDefaultProtoKVChunks") = kvscore::kDefaultProtoKVChunks;
  m.attr("kDefaultSinks") = kvscore::kDefaultSinks;
  m.attr("kDefaultParisKVLocal") = kvscore::kDefaultParisKVLocal;
  m.attr("kDefaultKVzipChunk") = kvscore::kDefaultKVzipChunk;
  m.attr("kDefaultKVzipRepeat") = kvscore::kDefaultKVzipRepeat;
  m.attr("kKVzipPromptFirst") = std::string(kvscore::kKVzipPromptFirst);
  m.attr("kKVzipPromptNext") = std::string(kvscore::kKVzipPromptNext);
  m.attr("struct_defaults") = struct_defaults();

  // Selection rules (make_method.hpp): StreamingLLM.
  nb::class_<kvscore::StreamingLLM>(m, "StreamingLLM", "kvscore::StreamingLLM: sinks + the most recent tokens.")
      .def_rw("sinks", &kvscore::StreamingLLM::sinks)
      .def(
          "select",
          [](const kvscore::StreamingLLM& r, std::int64_t heads, std::int64_t tokens, std::int64_t budget) {
            return selection_out(r.select(heads, tokens, kvscore::Budget::per_head(budget)), true);
          },
          "heads"_a, "tokens"_a, "budget"_a,
          "int64 [heads, budget]: [0, min(sinks, tokens)) and the last budget - min(sinks, tokens) positions;\n"
          "ValueError when the sinks exceed the budget or the budget the tokens.");
  m.def(
      "make_selection_rule",
      [](const std::string& name, std::int64_t sinks) {
        kvscore::SelectionRuleArgs a;
        a.sinks = sinks;
        return kvscore::make_selection_rule(name, a);
      },
      "name"_a, "sinks"_a = kvscore::SelectionRuleArgs{}.sinks,
      "kvscore::make_selection_rule: the selection rule a registry spelling names.");
}

// ------------------------------------------------------------------ scorers

void bind_scorers(nb::module_& m) {
  bind_scorer_args(m);

  using S = kvscore::AnyScorer;
  nb::class_<S>(m, "AnyScorer", "kvscore::AnyScorer: any scorer of the registry (make_scorer).")
      .def_prop_rw(
          "num_threads", [](S& s) { return s.options().num_threads; },
          [](S& s, int n) { s.options().num_threads = n; })
      .def_prop_ro("protected_recent", &S::protected_recent)
      .def_prop_ro("filters",
                   [](const S& s) {
                     const kvscore::QFilter* q = s.get<kvscore::QFilter>();
                     if (q == nullptr) bad(std::string("filters: scorer '") + s.name() + "' has no filters");
                     std::vector<float> f = q->filters();
                     return nb::cast(to_numpy(std::move(f), {std::size_t(q->kv_heads()), std::size_t(q->head_dim())}));
                   })
      .def(
          "score",
          [](const S& sc, const Any& keys) {
            kvscore::Scores s = with_keys(keys, "keys", [&](const auto& view) {
              nb::gil_scoped_release unlocked;
              return sc.score(view);
            });
            return scores_out(s);
          },
          "keys"_a, "float32 [heads, tokens] scores of keys [heads, tokens, head_dim] (or [1, ...]), read in place.");

  m.def(
      "make_scorer",
      [](const std::string& name, const kvscore::ScorerArgs& args, nb::handle queries, std::int64_t last,
         nb::handle filters) { return scorer_from(name, args, queries, last, filters); },
      "name"_a, "args"_a, "queries"_a = nb::none(), "last"_a = 0, "filters"_a = nb::none(),
      "kvscore::make_scorer(name, args): queries [q_heads, n, head_dim] (the last `last`, 0 = all) and\n"
      "filters [kv_heads, head_dim] are copied to fp32.");

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
      "queries"_a, "kv_heads"_a, "Q-Filters calibration: float32 [kv_heads, head_dim] in kvscore's convention.");
  m.def(
      "load_qfilters",
      [](const std::string& path, std::int64_t layer, const std::string& conv) {
        kvscore::FilterConvention c;
        if (conv.empty()) c = kvscore::QFilter::file_convention(path);
        else if (conv == "published") c = kvscore::FilterConvention::published;
        else if (conv == "kvscore") c = kvscore::FilterConvention::kvscore;
        else bad("convention '" + conv + "' must be 'published' or 'kvscore'");
        const kvscore::QFilter q = kvscore::QFilter::load(path, layer, c);
        std::vector<float> f = q.filters();
        return to_numpy(std::move(f), {std::size_t(q.kv_heads()), std::size_t(q.head_dim())});
      },
      "path"_a, "layer"_a, "convention"_a = "",
      "One layer's Q-Filters from a file (.npy: kvscore's convention, .safetensors: the published one unless\n"
      "`convention`), as float32 [kv_heads, head_dim] in kvscore's convention.");
}

// ------------------------------------------------------------------ selection and compaction

/// Selection from an int64 [heads, n] array (dense) or a list of 1-D int64 arrays (ragged).
kvscore::Selection selection_from(nb::handle sel, std::int64_t tokens) {
  using I64 = nb::ndarray<nb::ro, nb::device::cpu, std::int64_t>;
  kvscore::Selection s;
  s.tokens = tokens;
  auto add_row = [&](const std::int64_t* p, std::int64_t n, std::int64_t stride) {
    for (std::int64_t i = 0; i < n; ++i) s.positions.push_back(p[i * stride]);
    s.offsets.push_back(std::int64_t(s.positions.size()));
  };
  I64 arr;
  if (nb::try_cast(sel, arr) && arr.ndim() == 2) {
    s.heads = std::int64_t(arr.shape(0));
    const auto n = std::int64_t(arr.shape(1));
    for (std::int64_t h = 0; h < s.heads; ++h) add_row(arr.data() + h * arr.stride(0), n, arr.stride(1));
    return s;
  }
  if (nb::isinstance<nb::list>(sel) || nb::isinstance<nb::tuple>(sel)) {
    for (nb::handle item : sel) {
      I64 row;
      if (!nb::try_cast(item, row) || row.ndim() != 1)
        bad("selection: every entry of the list must be a 1-D int64 array of kept positions");
      add_row(row.data(), std::int64_t(row.shape(0)), row.stride(0));
      ++s.heads;
    }
    return s;
  }
  bad("selection: expected an int64 array [heads, kept] or a list of 1-D int64 arrays (one per head)");
}

void bind_select(nb::module_& m) {
  m.def(
      "budget_from_ratio",
      [](std::int64_t tokens, double keep, const std::string& rounding) {
        return kvscore::budget_from_ratio(tokens, keep, kvscore::parse_budget_rounding(rounding));
      },
      "tokens"_a, "keep_ratio"_a, "rounding"_a = to_string(kvscore::BudgetRounding::nearest),
      "Tokens kept per head for a keep ratio: the nearest integer, or 'floor' (the papers' and kvpress's\n"
      "floor((1 - compression_ratio) * tokens)); at least 1 for a non-empty cache.");
  const kvscore::SelectOptions def;
  m.def(
      "select",
      [](const Any& scores, std::int64_t budget, std::int64_t sinks, std::int64_t recent, const std::string& alloc,
         double alpha, bool normalize, int threads) -> nb::object {
        const F32Rows r = f32_rows(scores, "scores [heads, tokens]");
        const kvscore::SelectOptions o = select_options(sinks, recent, alloc, alpha, normalize, threads);
        kvscore::Selection s;
        {
          nb::gil_scoped_release unlocked;
          s = kvscore::select(kvscore::ConstScoresView(r.data, r.rows, r.cols, r.row_stride),
                              kvscore::Budget::per_head(budget), o);
        }
        return selection_out(std::move(s), o.alloc == kvscore::Alloc::per_head);
      },
      "scores"_a, "budget"_a, nb::kw_only(), "sinks"_a = def.sinks, "recent"_a = def.recent,
      "alloc"_a = to_string(def.alloc), "alpha"_a = def.alpha, "normalize"_a = def.normalize,
      "threads"_a = def.num_threads, "kvscore::select over float32 scores [heads, tokens], read in place.");

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
      "keys"_a, "values"_a, "selection"_a, nb::kw_only(),
      "tail"_a = kvscore::CompactOptions{}.tail == kvscore::CompactTail::zero ? "zero" : "keep",
      "require_equal_lengths"_a = true,
      "kvscore::compact in place; the kept length of each head.");
}

// ------------------------------------------------------------------ evaluator, synthetic data

/// A C-contiguous float32 [layers, heads, n, d] array, read in place.
const float* c_f32_4d(const Any& a, const char* what) {
  if (a.ndim() != 4) bad(std::string(what) + ": expected 4 dimensions [layers, heads, n, d]");
  if (dtype_of(a, what) != DT::f32) bad(std::string(what) + ": must be float32");
  std::int64_t expect = 1;
  for (std::size_t i = 4; i-- > 0;) {
    if (a.shape(i) > 1 && a.stride(i) != expect) bad(std::string(what) + ": must be C-contiguous");
    expect *= std::int64_t(a.shape(i));
  }
  return static_cast<const float*>(a.data());
}

/// kvscore.select_joint (kvscore/joint.hpp): layers = one fp32 [heads, tokens] array per layer,
/// read in place; returns int64 [kept] ascending.
void bind_joint(nb::module_& m) {
  const kvscore::JointOptions def{};
  m.def(
      "select_joint",
      [](const std::vector<Any>& layers, std::int64_t budget, std::int64_t sinks, std::int64_t recent,
         const std::string& aggregate, int threads) {
        kvscore::JointOptions o;
        o.sinks = sinks;
        o.recent = recent;
        o.aggregate = kvscore::parse_joint_aggregate(aggregate);
        o.num_threads = threads;
        std::vector<kvscore::ConstScoresView> views;
        for (std::size_t l = 0; l < layers.size(); ++l) {
          const F32Rows r = f32_rows(layers[l], "scores[" + std::to_string(l) + "] [heads, tokens]");
          views.emplace_back(r.data, r.rows, r.cols, r.row_stride);
        }
        std::vector<std::int64_t> kept;
        {
          nb::gil_scoped_release unlocked;
          kept = kvscore::select_joint(views, budget, o);
        }
        const std::size_t n = kept.size();
        return to_numpy(std::move(kept), {n});
      },
      "layers"_a, "budget"_a, nb::kw_only(), "sinks"_a = def.sinks, "recent"_a = def.recent,
      "aggregate"_a = std::string(kvscore::joint_aggregate_name(def.aggregate)), "threads"_a = def.num_threads,
      "kvscore::select_joint: one keep list, int64 [budget] ascending, for every row of every layer.");
}

void bind_evaluator(nb::module_& m) {
  m.def(
      "evaluate_json",
      [](const Any& K, const Any& V, const Any& Q, const std::string& methods, const std::vector<double>& keep,
         std::int64_t sinks, std::int64_t recent, const std::string& alloc, double alpha, std::int64_t window,
         const std::string& window_tail, const std::string& rounding, const std::string& placement, int threads,
         const std::optional<Any>& W, const std::optional<Any>& C, const std::string& protocol,
         const std::string& mix_metric) {
        // K, V, Q (and the leak-free protocol's window / calibration queries): 4-D fp32 in C
        // order, checked against each other and cut into layers by the library (kvscore/eval/inputs.hpp)
        const auto tensor = [](const std::optional<Any>& a, const char* what) {
          kvscore::eval::EvalTensor t;
          t.name = what;
          if (!a) return t;
          t.data = c_f32_4d(*a, what);
          for (std::size_t i = 0; i < a->ndim(); ++i) t.shape.push_back(std::int64_t(a->shape(i)));
          return t;
        };
        const std::vector<kvscore::eval::LayerInput> layers = kvscore::eval::layer_inputs(
            {tensor(K, "K"), tensor(V, "V"), tensor(Q, "Q"), tensor(W, "window_queries"), tensor(C, "calib_queries")});
        kvscore::eval::EvalOptions o;
        o.methods = kvscore::eval::resolve_methods(methods);
        o.keep = keep;
        o.method.select.sinks = sinks;
        o.method.select.recent = recent;
        o.method.select.alloc = kvscore::parse_alloc(alloc);
        o.method.select.alpha = alpha;
        o.method.window = window;
        o.method.window_tail = kvscore::parse_window_tail(window_tail);
        o.method.placement = kvscore::parse_query_placement(placement);
        o.rounding = kvscore::parse_budget_rounding(rounding);
        o.method.threads = threads;
        o.threads = threads;
        o.method.protocol = kvscore::eval::parse_protocol(protocol);
        o.mix_metric = kvscore::eval::parse_mix_metric(mix_metric);
        std::string json;
        {
          nb::gil_scoped_release unlocked;
          json = kvscore::eval::to_json(kvscore::eval::evaluate(layers, o));
        }
        return json;
      },
      "K"_a, "V"_a, "Q"_a, "methods"_a, "keep"_a, "sinks"_a, "recent"_a, "alloc"_a, "alpha"_a, "window"_a,
      "window_tail"_a, "budget_rounding"_a, "query_placement"_a, "threads"_a, "window_queries"_a = nb::none(),
      "calib_queries"_a = nb::none(), "protocol"_a = to_string(kvscore::eval::MethodOptions{}.protocol),
      "mix_metric"_a = to_string(kvscore::eval::EvalOptions{}.mix_metric),
      "kvscore::eval::evaluate's report as JSON (`kvscore eval`; window_queries / calib_queries: the leak-free\n"
      "protocol's inputs).");

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
      "kind"_a, "layers"_a, "kv_heads"_a, "group"_a, "tokens"_a, "head_dim"_a, "queries"_a, "segment"_a, "seed"_a,
      "kvscore::synth::generate: {'K', 'V', 'Q', 'planted'}.");
}

// ------------------------------------------------------------------ ParisKV

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
              if (a->ndim() != 2)
                bad(who + ": " + what + " must be 2-D [n, head_dim] (got " + std::to_string(a->ndim()) + " dimensions)");
              if (dtype_of(*a, who) != dt) bad(who + ": " + what + " must have the cache's dtype");
              if (std::int64_t(a->shape(1)) != c.head_dim())
                bad(who + ": " + what + " have head_dim " + std::to_string(a->shape(1)) + ", the cache " +
                    std::to_string(c.head_dim()));
              if (a->shape(0) > 1 && (a->stride(1) != 1 || a->stride(0) != std::int64_t(a->shape(1))))
                bad(who + ": " + what + " rows must be contiguous (strides [head_dim, 1]; no silent copy)");
            }
            if (keys.shape(0) != values.shape(0))
              bad(who + ": " + std::to_string(keys.shape(0)) + " keys but " + std::to_string(values.shape(0)) +
                  " values");
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

void bind_pariskv(nb::module_& m) {
  using P = kvscore::ParisKV;
  const kvscore::ParisKVConfig cfg;
  const kvscore::ParisKVSearch srch;
  nb::class_<P>(m, "ParisKV", "kvscore::ParisKV: one KV head's retrieval index.")
      .def("__init__",
           [](P* self, std::int64_t head_dim, std::int64_t m_, std::uint64_t seed, bool center) {
             kvscore::ParisKVConfig c;
             c.m = m_;
             c.seed = seed;
             c.center = center;
             new (self) P(head_dim, c);
           },
           "head_dim"_a, "m"_a = cfg.m, "seed"_a = cfg.seed, "center"_a = cfg.center)
      .def_prop_ro("size", &P::size)
      .def_prop_ro("head_dim", &P::head_dim)
      .def_prop_ro("memory_bytes", &P::memory_bytes)
      .def(
          "append",
          [](P& idx, const Any& keys) {
            if (keys.ndim() != 2) bad("ParisKV.append: keys must be 2-D [n, head_dim]");
            check_strides_nonneg(keys, "ParisKV.append: keys");
            const auto n = std::int64_t(keys.shape(0)), d = std::int64_t(keys.shape(1));
            if (d != idx.head_dim())
              bad("ParisKV.append: keys have head_dim " + std::to_string(d) + ", the index " +
                  std::to_string(idx.head_dim()));
            if (n > 0 && d > 1 && keys.stride(1) != 1) bad("ParisKV.append: keys: head_dim stride must be 1");
            const std::int64_t rs = n > 1 ? std::int64_t(keys.stride(0)) : d;
            const void* p = keys.data();
            const DT dt = dtype_of(keys, "ParisKV.append: keys");
            nb::gil_scoped_release unlocked;
            kvscore::visit_dtype(dt, [&]<class T>(std::type_identity<T>) { idx.append(static_cast<const T*>(p), n, rs); });
          },
          "keys"_a)
      .def(
          "search",
          [](const P& idx, const Any& queries, std::int64_t k, double beta, double rho) {
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
              P::Workspace ws;
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
          "queries"_a, "k"_a = srch.k, "beta"_a = srch.beta, "rho"_a = srch.rho);

  bind_pariskv_cache<float>(m, "ParisKVCacheF32", DT::f32);
  bind_pariskv_cache<kvscore::half>(m, "ParisKVCacheF16", DT::f16);
  bind_pariskv_cache<kvscore::bfloat16>(m, "ParisKVCacheBF16", DT::bf16);
}

// ------------------------------------------------------------------ OjaKV

/// An OjaKV basis U [d, r] as a new float32 numpy array (C order).
nb::object basis_out(const kvscore::OjaBasis& b) {
  const Eigen::MatrixXf u = b.basis_f32();
  std::vector<float> v(std::size_t(u.size()));
  for (Eigen::Index i = 0; i < u.rows(); ++i)
    for (Eigen::Index j = 0; j < u.cols(); ++j) v[std::size_t(i * u.cols() + j)] = u(i, j);
  return nb::cast(to_numpy(std::move(v), {std::size_t(u.rows()), std::size_t(u.cols())}));
}

void bind_ojakv(nb::module_& m) {
  using O = kvscore::OjaProjector;
  nb::class_<O>(m, "OjaProjector", "kvscore::OjaProjector: one head's low-rank key/value bases.")
      .def_static(
          "random",
          [](std::int64_t d, std::int64_t rk, std::int64_t rv, std::uint64_t seed) { return O::random(d, rk, rv, seed); },
          "head_dim"_a, "key_rank"_a, "value_rank"_a, "seed"_a = 0)
      .def_prop_ro("head_dim", &O::head_dim)
      .def(
          "prefill",
          [](O& p, const Any& keys, const Any& values) {
            with_keys(keys, "keys", [&](const auto& k) {
              with_keys(values, "values", [&](const auto& v) {
                if (k.heads() != 1 || v.heads() != 1) bad("OjaProjector.prefill: keys and values must have 1 head");
                nb::gil_scoped_release unlocked;
                p.prefill(k, v, 0);
              });
            });
          },
          "keys"_a, "values"_a)
      .def_prop_ro("key_basis", [](const O& p) { return basis_out(p.key()); })
      .def_prop_ro("value_basis", [](const O& p) { return basis_out(p.value()); });
}

// ------------------------------------------------------------------ ISA

void bind_isa(nb::module_& m) {
  m.def(
      "isa", [] { return std::string(kvscore::simd::active_table().name); },
      "Name of the SIMD kernel table the scorers use (KVSCORE_ISA pins it).");
  m.def(
      "isas",
      [] {
        std::vector<std::string> names;
        for (const kvscore::simd::KernelTable* t : kvscore::simd::available_tables()) names.emplace_back(t->name);
        return names;
      },
      "Kernel tables this CPU supports, scalar first.");
  m.def(
      "set_isa", [](const std::string& n) { kvscore::simd::set_active_isa(n); }, "name"_a,
      "Pin the kernel table by name (as KVSCORE_ISA).");
}

}  // namespace

// ------------------------------------------------------------------ KVzip's reconstruction passes

/// What kvzip_score_span and kvzip_attend_span share, each argument checked in turn (ValueError
/// naming it): the scorer over the pass's queries, the optional weights, the scores view, the span.
struct KVzipPassArgs {
  Queries q;
  kvscore::KVzip z;
  std::vector<float> qw, kw;
  kvscore::ScoresView sv;
  kvscore::KVzipSpan span;

  KVzipPassArgs(const Any& queries, const Mut& out, std::int64_t begin, std::int64_t end, std::int64_t sinks,
                const std::string& aggregate, nb::handle query_weights, nb::handle key_weights, int threads,
                std::int64_t query_block)
      : q(gather_queries(queries, "queries")), z(q.data.data(), q.heads, q.n, q.dim) {
    z.aggregate = kvscore::parse_query_aggregate(aggregate);
    z.num_threads = threads;
    z.query_block = query_block;
    if (!query_weights.is_none()) {
      qw = f32_copy(as_array(query_weights, "query_weights"), "query_weights [n_queries]", 1);
      if (std::int64_t(qw.size()) != q.n)
        bad("query_weights: " + std::to_string(qw.size()) + " values for " + std::to_string(q.n) + " queries");
    }
    if (!key_weights.is_none()) {
      const Any k = as_array(key_weights, "key_weights");
      kw = f32_copy(k, "key_weights [q_heads, end - begin]", 2);
      if (std::int64_t(k.shape(0)) != q.heads)
        bad("key_weights: " + std::to_string(k.shape(0)) + " rows for " + std::to_string(q.heads) + " query heads");
    }
    if (out.ndim() != 2 || dtype_of(out, "out") != DT::f32) bad("out: expected float32 [kv_heads, tokens] scores");
    const auto H = std::int64_t(out.shape(0)), N = std::int64_t(out.shape(1));
    if (N > 1 && out.stride(1) != 1) bad("out: the token stride must be 1");
    sv = kvscore::ScoresView(static_cast<float*>(out.data()), H, N, H > 1 ? std::int64_t(out.stride(0)) : N);
    if (!key_weights.is_none()) {
      const std::int64_t e = end < 0 ? N : end;
      if (std::int64_t(kw.size()) != q.heads * (e - begin))
        bad("key_weights: " + std::to_string(kw.size() / std::size_t(std::max<std::int64_t>(q.heads, 1))) +
            " columns for the span's " + std::to_string(e - begin) + " rows");
    }
    span = kvscore::KVzipSpan{begin, end, sinks, qw.empty() ? nullptr : qw.data(), kw.empty() ? nullptr : kw.data()};
  }
  KVzipPassArgs(const KVzipPassArgs&) = delete;  // span points into qw / kw
  KVzipPassArgs& operator=(const KVzipPassArgs&) = delete;
};

/// kvscore::KVzip::score_span (docs/methods/kvzip.md): one reconstruction pass scored into `out`.
void bind_kvzip(nb::module_& m) {
  m.def(
      "kvzip_score_span",
      [](const Any& cache, const Any& own, const Any& queries, const Mut& out, std::int64_t begin, std::int64_t end,
         std::int64_t sinks, const std::string& aggregate, nb::handle query_weights, nb::handle key_weights,
         int threads, std::int64_t query_block) {
        KVzipPassArgs p(queries, out, begin, end, sinks, aggregate, query_weights, key_weights, threads, query_block);
        with_keys(cache, "cache", [&](const auto& cv) {
          with_keys(own, "own", [&](const auto& ov) {
            nb::gil_scoped_release unlocked;
            p.z.score_span(cv, ov, p.span, p.sv);
            return 0;
          });
          return 0;
        });
      },
      "cache"_a, "own"_a, "queries"_a, "out"_a, "begin"_a, "end"_a, "sinks"_a, "aggregate"_a = "max",
      "query_weights"_a = nb::none(), "key_weights"_a = nb::none(), "threads"_a = 0, "query_block"_a = 0,
      "kvscore::KVzip::score_span: the attention the cache rows [begin, end) receive from the queries\n"
      "[q_heads, m, head_dim] of one reconstruction pass whose own keys are own [kv_heads, m, head_dim]\n"
      "(causal), over the softmax of sinks + span + own rows; written into out[:, begin:end] (float32\n"
      "[kv_heads, tokens], in place).");

  m.def(
      "kvzip_attend_span",
      [](const Any& cache, const Any& own, const Any& values, const Any& own_values, const Any& queries, const Mut& out,
         const Mut& attn_out, std::int64_t begin, std::int64_t end, std::int64_t sinks, const std::string& aggregate,
         nb::handle query_weights, nb::handle key_weights, int threads, std::int64_t query_block) {
        KVzipPassArgs p(queries, out, begin, end, sinks, aggregate, query_weights, key_weights, threads, query_block);
        const HND c = keys_shape(cache, "cache", kKeysNeedUnitStride), o = keys_shape(own, "own", kKeysNeedUnitStride),
                  v = keys_shape(values, "values", kKeysNeedUnitStride),
                  ov = keys_shape(own_values, "own_values", kKeysNeedUnitStride);
        const DT dt = dtype_of(cache, "cache");
        for (const auto& [a, what] : {std::pair<const Any*, const char*>{&own, "own"}, {&values, "values"},
                                      {&own_values, "own_values"}})
          if (dtype_of(*a, what) != dt) bad(std::string(what) + ": its dtype differs from the cache's (one dtype for all four)");
        if (attn_out.ndim() != 3 || dtype_of(attn_out, "attn_out") != DT::f32 ||
            std::int64_t(attn_out.shape(0)) != p.q.n || std::int64_t(attn_out.shape(1)) != p.q.heads ||
            std::int64_t(attn_out.shape(2)) != v.D)
          bad("attn_out: expected float32 [n_queries, q_heads, head_dim of the values] = [" + std::to_string(p.q.n) + ", " +
              std::to_string(p.q.heads) + ", " + std::to_string(v.D) + "]");
        if (attn_out.stride(2) != 1 || attn_out.stride(1) != std::int64_t(v.D) ||
            attn_out.stride(0) != std::int64_t(p.q.heads * v.D))
          bad("attn_out: must be C-contiguous");
        kvscore::visit_dtype(dt, [&]<class T>(std::type_identity<T>) {
          auto view = [](const Any& a, const HND& s) {
            return kvscore::KeysView<T>(static_cast<const T*>(a.data()), s.H, s.N, s.D, s.hs, s.ts);
          };
          const auto cv = view(cache, c), ovw = view(own, o), vv = view(values, v), ovv = view(own_values, ov);
          nb::gil_scoped_release unlocked;
          p.z.attend_span(cv, ovw, vv, ovv, p.span, p.sv, static_cast<float*>(attn_out.data()));
          return 0;
        });
      },
      "cache"_a, "own"_a, "values"_a, "own_values"_a, "queries"_a, "out"_a, "attn_out"_a, "begin"_a, "end"_a, "sinks"_a,
      "aggregate"_a = "max", "query_weights"_a = nb::none(), "key_weights"_a = nb::none(), "threads"_a = 0,
      "query_block"_a = 0,
      "kvscore::KVzip::attend_span: kvzip_score_span's scores written into out (to ~1e-6 relative), and the pass's\n"
      "attention output, each query's softmax over every cache row and its own rows up to itself times the\n"
      "values (cache/own values [kv_heads, rows, head_dim]), into attn_out (float32 [m, q_heads, head_dim]).");

  m.def(
      "select_total",
      [](const Any& scores, std::int64_t total, std::int64_t sinks, std::int64_t recent, double alpha, int threads) {
        const F32Rows r = f32_rows(scores, "scores [rows, tokens]");
        kvscore::SelectOptions o;
        o.sinks = sinks;
        o.recent = recent;
        o.alloc = kvscore::Alloc::adakv;
        o.alpha = alpha;
        o.num_threads = threads;
        kvscore::Selection s;
        {
          nb::gil_scoped_release unlocked;
          s = kvscore::select(kvscore::ConstScoresView(r.data, r.rows, r.cols, r.row_stride),
                              kvscore::Budget::per_layer(total), o);
        }
        return selection_out(std::move(s), false);
      },
      "scores"_a, "total"_a, nb::kw_only(), "sinks"_a = 0, "recent"_a = 0, "alpha"_a = 0.0, "threads"_a = 0,
      "kvscore::select(scores, Budget::per_layer(total), alloc = adakv): `total` tokens over all rows of\n"
      "float32 [rows, tokens] (KVzip's one top-k over every layer and head: the rows of all layers stacked),\n"
      "every row keeping at least floor(alpha * total / rows) and its sinks / recent; a list of int64 arrays.");
}

void bind_generation(nb::module_& m);  // python/src/bind_generation.cpp
void bind_vllm(nb::module_& m);  // python/src/bind_vllm.cpp

NB_MODULE(_kvscore, m) {
  m.doc() = "kvscore C++ core (use the kvscore package; docs/reference/python.md)";
  m.attr("__version__") = kvscore::version_string;
  nb::register_exception_translator(translate_errors);  // arrays.hpp
  bind_isa(m);
  bind_registry(m);
  bind_scorers(m);
  bind_select(m);
  bind_joint(m);
  bind_evaluator(m);
  bind_pariskv(m);
  bind_ojakv(m);
  bind_kvzip(m);
  bind_generation(m);
  bind_vllm(m);
}
