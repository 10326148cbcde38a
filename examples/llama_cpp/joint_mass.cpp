// examples/llama_cpp/joint_mass.cpp — which joint aggregation keeps the most attention mass on a
// real model (docs/reference/joint.md). For each text: the first N tokens are the context, prefilled with
// their post-RoPE keys (and the last `window` queries, for query scorers) captured; the next W
// tokens are then decoded as one batch with the full cache and their post-RoPE queries captured.
// A[l][h][t] = sum over the W queries and the query heads of KV head h of softmax over the N
// context keys of q.k / sqrt(d). For every method and keep fraction, the kept positions of
//   per_head   select() per layer (every head its own set: what an engine with per-head
//              lengths could do; the upper reference)
//   max / mean / vote   select_joint() (one set for all heads and layers: what llama.cpp can do)
//   streaming  sinks + the most recent tokens (StreamingLLM, no scores)
// keep the attention-mass recall sum_{(l,h,t) kept} A / (L * q_heads * W) (1 = everything).
//
//   joint_mass --model M.gguf --prompt-file a.txt --prompt-file b.txt [--tokens 2048] [--queries 64]
//              [--methods knorm,keydiff,manifold_l2,snapkv] [--keep 0.1,0.25,0.5] [--sinks 4] [--recent 64]
#include <kvscore/joint.hpp>
#include <kvscore/make_scorer.hpp>
#include <kvscore/select.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "capture.hpp"
#include "util.hpp"

namespace {

using namespace kvscore_llama;

struct Args {
  std::string model;
  std::vector<std::string> files;
  std::vector<std::string> methods{"knorm", "keydiff", "manifold_l2", "snapkv"};
  std::vector<double> keep{0.1, 0.25, 0.5};
  std::int64_t tokens = 2048, queries = 64, sinks = 4, recent = 64, window = 64;
  int threads = 0;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) out.push_back(x);
  return out;
}

Args parse(int argc, char** argv) {
  Args a;
  auto value = [&](int& i) -> std::string {
    if (i + 1 >= argc) throw Usage(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--model") a.model = value(i);
    else if (f == "--prompt-file") a.files.push_back(value(i));
    else if (f == "--methods") a.methods = split(value(i));
    else if (f == "--keep") {
      a.keep.clear();
      for (const auto& k : split(value(i))) a.keep.push_back(parse_double(f, k));
    } else if (f == "--tokens") a.tokens = parse_int(f, value(i));
    else if (f == "--queries") a.queries = parse_int(f, value(i));
    else if (f == "--sinks") a.sinks = parse_int(f, value(i));
    else if (f == "--recent") a.recent = parse_int(f, value(i));
    else if (f == "--window") a.window = parse_int(f, value(i));
    else if (f == "--threads") a.threads = int(parse_int(f, value(i)));
    else throw Usage("unknown option '" + f + "'");
  }
  if (a.model.empty() || a.files.empty()) throw Usage("--model and at least one --prompt-file are required");
  if (a.tokens < 2 || a.queries < 1 || a.window < 1 || a.sinks < 0 || a.recent < 0 || a.threads < 0)
    throw Usage("--tokens >= 2, --queries >= 1, --window >= 1, --sinks/--recent/--threads >= 0");
  if (a.threads == 0) a.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  return a;
}

struct Text {
  std::int64_t N = 0;
  std::vector<std::vector<float>> keys, window_q;  // context keys, last-window context queries
  std::vector<double> A;                            // [L][Hkv][N] attention mass of the W queries
};

Text run_text(llama_model* model, const Args& a, const std::vector<llama_token>& all, std::int64_t L,
              std::int64_t Hq, std::int64_t Hkv, std::int64_t D) {
  Text t;
  const std::int64_t W = a.queries;
  t.N = std::min<std::int64_t>(a.tokens, std::int64_t(all.size()) - W);
  if (t.N < 2) throw Usage("a prompt file has fewer than --queries + 2 tokens");
  const std::int64_t N = t.N, win = std::min(a.window, N);
  Capture cap;
  llama_context_params p = llama_context_default_params();
  p.n_ctx = std::uint32_t(N + W + 16);
  p.n_batch = std::uint32_t(std::max(N, W));
  p.n_ubatch = std::uint32_t(std::min<std::int64_t>(512, std::max(N, W)));
  p.n_seq_max = 1;
  p.n_threads = p.n_threads_batch = a.threads;
  p.no_perf = true;
  p.cb_eval = &Capture::callback;
  p.cb_eval_user_data = &cap;
  llama_context* ctx = llama_init_from_model(model, p);
  if (!ctx) throw std::runtime_error("llama_init_from_model failed");
  std::vector<llama_token> ctx_tok(all.begin(), all.begin() + N), cont(all.begin() + N, all.begin() + N + W);
  cap.start(L, Hkv, Hq, D, N, win);
  if (llama_decode(ctx, llama_batch_get_one(ctx_tok.data(), std::int32_t(N))) != 0)
    throw std::runtime_error("llama_decode failed on the context");
  if (!cap.complete()) throw std::runtime_error("capture incomplete: " + cap.error);
  t.keys = std::move(cap.keys);
  t.window_q = std::move(cap.queries);
  cap.start(L, Hkv, Hq, D, W, W);  // the continuation: its queries (it sees the full context)
  if (llama_decode(ctx, llama_batch_get_one(cont.data(), std::int32_t(W))) != 0)
    throw std::runtime_error("llama_decode failed on the continuation");
  cap.active = false;
  if (!cap.complete()) throw std::runtime_error("capture incomplete: " + cap.error);
  llama_free(ctx);

  // A[l][h][t]: softmax over the context keys for every (layer, query head, query), in double.
  const std::int64_t group = Hq / Hkv;
  t.A.assign(std::size_t(L * Hkv * N), 0.0);
  const double scale = 1.0 / std::sqrt(double(D));
#pragma omp parallel for schedule(dynamic) num_threads(a.threads)
  for (std::int64_t l = 0; l < L; ++l) {
    std::vector<double> s(static_cast<std::size_t>(N));
    for (std::int64_t g = 0; g < Hq; ++g) {
      const std::int64_t h = g / group;
      for (std::int64_t i = 0; i < W; ++i) {
        const float* q = cap.queries[std::size_t(l)].data() + (g * W + i) * D;
        double mx = -1e300;
        for (std::int64_t k = 0; k < N; ++k) {
          const float* key = t.keys[std::size_t(l)].data() + (k * Hkv + h) * D;
          double dot = 0;
          for (std::int64_t j = 0; j < D; ++j) dot += double(q[j]) * double(key[j]);
          s[std::size_t(k)] = dot * scale;
          mx = std::max(mx, s[std::size_t(k)]);
        }
        double z = 0;
        for (std::int64_t k = 0; k < N; ++k) z += (s[std::size_t(k)] = std::exp(s[std::size_t(k)] - mx));
        double* out = t.A.data() + (l * Hkv + h) * N;
        for (std::int64_t k = 0; k < N; ++k) out[k] += s[std::size_t(k)] / z;
      }
    }
  }
  return t;
}

int run(const Args& a) {
  quiet_logs(false);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(a.model.c_str(), mp);
  if (!model) throw Usage("cannot load model '" + a.model + "'");
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const std::int64_t L = llama_model_n_layer(model), Hq = llama_model_n_head(model),
                     Hkv = llama_model_n_head_kv(model), D = llama_model_n_embd(model) / Hq;
  const std::vector<std::string> cols{"per_head", "max", "mean", "vote", "streaming"};
  // recall[method][keep][col] summed over texts
  std::map<std::string, std::map<double, std::map<std::string, double>>> recall;
  for (const std::string& file : a.files) {
    const auto toks = tokenize(vocab, read_file(file), 0);
    const Text t = run_text(model, a, toks, L, Hq, Hkv, D);
    const std::int64_t N = t.N;
    const double total = double(L * Hq * a.queries);
    auto mass_joint = [&](const std::vector<std::int64_t>& kept) {
      double m = 0;
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < Hkv; ++h)
          for (const std::int64_t p : kept) m += t.A[std::size_t((l * Hkv + h) * N + p)];
      return m / total;
    };
    std::printf("%s: %lld context tokens, %lld continuation queries\n", file.c_str(), (long long)N,
                (long long)a.queries);
    for (const std::string& method : a.methods) {
      const kvscore::MethodInfo& info = kvscore::method_info(method);
      const bool needs_q = info.kind == kvscore::MethodKind::query_scorer || info.name == "qfilter";
      const std::int64_t win = std::min(a.window, N);
      std::vector<kvscore::Scores> scores;
      std::int64_t protected_recent = 0;
      for (std::int64_t l = 0; l < L; ++l) {
        kvscore::ScorerArgs sa;
        sa.threads = a.threads;
        sa.kv_heads = Hkv;
        if (needs_q) {
          sa.queries = t.window_q[std::size_t(l)].data();
          sa.q_heads = Hq;
          sa.n_queries = win;
          sa.head_dim = D;
        }
        const kvscore::AnyScorer sc = kvscore::make_scorer(info.name, sa);
        protected_recent = sc.protected_recent();
        scores.push_back(sc.score(kvscore::KeysView<float>::token_major(t.keys[std::size_t(l)].data(), N, Hkv, D)));
      }
      for (const double keep : a.keep) {
        const std::int64_t budget = kvscore::budget_from_ratio(N, keep);
        const std::int64_t recent = std::max(a.recent, protected_recent);
        auto& r = recall[std::string(info.name)][keep];
        kvscore::SelectOptions so;
        so.sinks = a.sinks;
        so.recent = recent;
        double ph = 0;
        for (std::int64_t l = 0; l < L; ++l) {
          const kvscore::Selection s = kvscore::select(scores[std::size_t(l)], kvscore::Budget::per_head(budget), so);
          for (std::int64_t h = 0; h < Hkv; ++h)
            for (const std::int64_t p : s.head(h)) ph += t.A[std::size_t((l * Hkv + h) * N + p)];
        }
        r["per_head"] += ph / total;
        for (auto agg : {kvscore::JointAggregate::max, kvscore::JointAggregate::mean, kvscore::JointAggregate::vote}) {
          kvscore::JointOptions jo;
          jo.sinks = a.sinks;
          jo.recent = recent;
          jo.aggregate = agg;
          jo.num_threads = a.threads;
          r[std::string(kvscore::joint_aggregate_name(agg))] += mass_joint(kvscore::select_joint(scores, budget, jo));
        }
        std::vector<std::int64_t> stream;
        for (std::int64_t p = 0; p < N; ++p)
          if (p < a.sinks || p >= N - (budget - std::min(a.sinks, budget))) stream.push_back(p);
        r["streaming"] += mass_joint(stream);
      }
    }
  }
  const double nf = double(a.files.size());
  std::printf("\nattention-mass recall, mean over %zu texts (sinks %lld, recent %lld; query scorers protect their "
              "window)\n\n| method | keep | per_head | joint max | joint mean | joint vote | streaming |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
              a.files.size(), (long long)a.sinks, (long long)a.recent);
  std::map<std::string, double> wins;
  for (const std::string& method : a.methods) {
    const std::string name(kvscore::method_info(method).name);
    for (const double keep : a.keep) {
      auto& r = recall[name][keep];
      std::printf("| %s | %.2f |", name.c_str(), keep);
      for (const auto& c : cols) std::printf(" %.4f |", r[c] / nf);
      std::printf("\n");
      for (const char* c : {"max", "mean", "vote"}) wins[c] += r[c] / nf;
    }
  }
  std::printf("\nsum over methods and keeps: max %.4f, mean %.4f, vote %.4f\n", wins["max"], wins["mean"],
              wins["vote"]);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const Usage& e) {
    std::fprintf(stderr, "joint_mass: %s\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "joint_mass: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "joint_mass: error: %s\n", e.what());
    return 1;
  }
}
