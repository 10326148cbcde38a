// tools/cmd_retrieve.cpp — `kvscore retrieve`: ParisKV top-k retrieval for every query.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <system_error>
#include <vector>

#include <unistd.h>

#include <kvscore/io/npy.hpp>
#include <kvscore/pariskv/pariskv.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const char* const kRetrieveUsage =
    "usage: kvscore retrieve --keys K.npy --queries Q.npy --topk K --out I.npy [options]\n"
    "\n"
    "ParisKV retrieval (docs/methods/pariskv.md): one index per KV head over all its keys, then for\n"
    "every query the top-K positions by estimated inner product <k, q>, ascending per row.\n"
    "Without --rerank-exact this is the paper's pipeline (collision votes, then RSQ-IP rerank\n"
    "of the candidates from 4-bit codes) on keys centred by their mean.\n"
    "\n"
    "  --keys K.npy        keys [kv_heads, tokens, head_dim]: '<f4' float32, '<f2' float16, or\n"
    "                      '<u2' (bfloat16 bit patterns)\n"
    "  --queries Q.npy     queries [q_heads, n_queries, head_dim], '<f4'; q_heads = kv_heads x G\n"
    "  --topk K            positions per query, 1 <= K <= tokens\n"
    "  --out I.npy         int64 [q_heads, n_queries, K], each row ascending ([.., S + K + L] with zones)\n"
    "  --group G           GQA group size, must equal q_heads / kv_heads (default: that); the G\n"
    "                      query heads of a KV head are searched once with their mean query and\n"
    "                      all G rows get that result\n"
    "  --beta B            candidate ratio in (0, 1] (default: by length, 0.5 .. 0.1)\n"
    "  --rho R             collision ratio in (0, 1] (default: by length, 0.5 .. 0.2)\n"
    "  --rerank-exact K2   rescore the best K2 >= K RSQ-IP candidates exactly with the keys\n"
    "                      (default: off; 3K is a good choice)\n"
    "  --sinks S           zones (docs/methods/pariskv.md, decode-time cache): every row also holds the\n"
    "  --local L           first S and the last L positions, and the top K are retrieved from\n"
    "                      the tokens between them (index over [S, tokens - L)); rows are\n"
    "                      S + K + L long. Default 0 and 0: no zones\n"
    "  --threads N         threads over heads (default 0 = OpenMP default); results do not depend on it\n"
    "  -h, --help          this help\n";

const std::vector<FlagSpec> kRetrieveFlags = {
    {"--keys", true}, {"--queries", true}, {"--topk", true},         {"--out", true},
    {"--group", true}, {"--beta", true},   {"--rerank-exact", true}, {"--rho", true},
    {"--threads", true}, {"--sinks", true}, {"--local", true},
};

namespace {

double parse_ratio(const std::string& text, const std::string& flag) {
  const double v = parse_double(text, "retrieve: " + flag);
  if (!(v > 0 && v <= 1)) throw UsageError("retrieve: " + flag + " must be in (0, 1] (got " + text + ")");
  return v;
}

void save_i64_atomic(const std::string& path, const std::vector<std::int64_t>& shape, const std::int64_t* data) {
  const std::string tmp = path + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
  try {
    npy::save<std::int64_t>(tmp, shape, data);
  } catch (...) {
    std::remove(tmp.c_str());
    throw;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw std::invalid_argument(path + ": cannot write the output (rename failed)");
  }
}

/// Retrieval from the tokens [S, N − L) of every head; each row is then 0..S−1, the K retrieved
/// positions, N−L..N−1 (ascending, as the zones do not overlap).
template <class T>
std::vector<std::int64_t> run(const npy::Array& keys, const npy::Array& q, std::int64_t group, const ParisKVSearch& opt,
                              int threads, std::int64_t S, std::int64_t L) {
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2], M = N - S - L;
  if (S + L > 0) {  // the index sees only the middle: check every key here, by its own position
    const T* k = keys.as<T>();
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < N; ++t) {
        float sq = 0.f;
        for (std::int64_t j = 0; j < d; ++j) {
          const float v = to_float(k[(h * N + t) * d + j]);
          if (!std::isfinite(v))
            throw std::invalid_argument("retrieve: head " + std::to_string(h) + ", key " + std::to_string(t) +
                                        " has a non-finite value " + std::to_string(v) + " at element " + std::to_string(j));
          sq += v * v;
        }
        if (!std::isfinite(sq))
          throw std::invalid_argument("retrieve: head " + std::to_string(h) + ", key " + std::to_string(t) +
                                      " has a squared norm that overflows fp32");
      }
  }
  const KeysView<T> view(keys.as<T>() + S * d, H, M, d, std::max<std::int64_t>(N, 1) * d, d);
  const std::vector<std::int64_t> mid =
      pariskv_retrieve(view, q.as<float>(), q.shape[0], q.shape[1], group, opt, ParisKVConfig{}, threads);
  if (S == 0 && L == 0) return mid;
  const std::int64_t rows = q.shape[0] * q.shape[1], K = opt.k;
  std::vector<std::int64_t> out;
  out.reserve(std::size_t(rows * (S + K + L)));
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t t = 0; t < S; ++t) out.push_back(t);
    for (std::int64_t i = 0; i < K; ++i) out.push_back(S + mid[std::size_t(r * K + i)]);
    for (std::int64_t t = N - L; t < N; ++t) out.push_back(t);
  }
  return out;
}

}  // namespace

int cmd_retrieve(const Args& args) {
  const std::string kp = args.required("--keys"), qp = args.required("--queries"), out = args.required("--out");
  args.required("--topk");
  const std::int64_t topk = args.get_int("--topk", 0, 1, INT64_MAX);
  ParisKVSearch opt;
  opt.k = topk;
  if (args.has("--beta")) opt.beta = parse_ratio(args.get("--beta", ""), "--beta");
  if (args.has("--rho")) opt.rho = parse_ratio(args.get("--rho", ""), "--rho");
  opt.rerank_exact = args.get_int("--rerank-exact", 0, 1, INT64_MAX);
  if (args.has("--rerank-exact") && opt.rerank_exact < topk)
    throw UsageError("retrieve: --rerank-exact " + std::to_string(opt.rerank_exact) + " must be >= --topk " +
                     std::to_string(topk));
  const int threads = int(args.get_int("--threads", 0, 0, kMaxThreads));

  const npy::Array keys = npy::load(kp);
  if (keys.shape.size() != 3)
    throw std::invalid_argument(kp + ": keys must have shape [kv_heads, tokens, head_dim], got " +
                                std::to_string(keys.shape.size()) + " dimensions");
  const dtype key_dtype = npy::element_dtype(keys, kp + ": keys");
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2];
  if (H < 1 || d < 1 || d > kMaxHeadDim)
    throw std::invalid_argument(kp + ": keys [" + std::to_string(H) + ", " + std::to_string(N) + ", " +
                                std::to_string(d) + "] need kv_heads >= 1 and head_dim in [1, " +
                                std::to_string(kMaxHeadDim) + "]");
  const std::int64_t S = args.get_int("--sinks", 0, 0, INT64_MAX), L = args.get_int("--local", 0, 0, INT64_MAX);
  if (S > N || L > N - S)
    throw std::invalid_argument("retrieve: --sinks " + std::to_string(S) + " + --local " + std::to_string(L) +
                                " exceed the " + std::to_string(N) + " tokens of " + kp);
  if (topk > N - S - L)
    throw std::invalid_argument("retrieve: --topk " + std::to_string(topk) + " exceeds the " +
                                std::to_string(N - S - L) + " tokens of " + kp +
                                (S + L > 0 ? " between the zones (tokens - sinks - local)" : ""));
  const npy::Array q = npy::load(qp);
  if (q.shape.size() != 3)
    throw std::invalid_argument(qp + ": queries must have shape [q_heads, n_queries, head_dim], got " +
                                std::to_string(q.shape.size()) + " dimensions");
  if (q.descr != npy::descr_of<float>())
    throw std::invalid_argument(qp + ": queries dtype '" + q.descr + "' not supported (expected '<f4' float32)");
  const std::int64_t Hq = q.shape[0], nq = q.shape[1];
  if (q.shape[2] != d)
    throw std::invalid_argument("retrieve: queries " + qp + " have head_dim " + std::to_string(q.shape[2]) +
                                ", keys " + kp + " have " + std::to_string(d));
  if (Hq < 1 || Hq % H != 0)
    throw std::invalid_argument("retrieve: the " + std::to_string(Hq) + " query heads of " + qp +
                                " are not a positive multiple of the " + std::to_string(H) + " KV heads of " + kp);
  const std::int64_t G = Hq / H;
  const std::int64_t group = args.get_int("--group", G, 1, INT64_MAX);
  if (group != G)
    throw std::invalid_argument("retrieve: --group " + std::to_string(group) + " does not match q_heads / kv_heads = " +
                                std::to_string(Hq) + " / " + std::to_string(H) + " = " + std::to_string(G));

  std::vector<std::int64_t> idx;
  idx = visit_dtype(key_dtype, [&]<class T>(std::type_identity<T>) { return run<T>(keys, q, G, opt, threads, S, L); });
  save_i64_atomic(out, {Hq, nq, S + topk + L}, idx.data());
  return kExitOk;
}

KVSCORE_CLI_COMMAND(retrieve, "retrieve", "ParisKV top-k retrieval of every query (positions per query)", cmd_retrieve,
                    kRetrieveFlags, kRetrieveUsage);

}  // namespace kvscore::cli
