// tools/cmd_oja.cpp — `kvscore oja`: OjaKV prefill update of the key basis of every head
// (docs/methods/ojakv.md), written as U.npy; prints RER (and SO against a reference) on one line.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <kvscore/io/npy.hpp>
#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/select.hpp>

#include "cli.hpp"

namespace kvscore::cli {

const char* const kOjaUsage =
    "usage: kvscore oja --keys K.npy --rank R --out-basis U.npy [options]\n"
    "\n"
    "OjaKV prefill: per KV head, a rank-R key basis (seeded random orthonormal start, or the\n"
    "top singular vectors of --calib) updated by Oja's rule on the average-pooled keys (pool 4,\n"
    "up to 32 steps at eta 1.5 relative to lambda1, QR after each). Prints one line:\n"
    "  rer=<RER of the keys> [rer_v=<RER of the values>] [so=<mean SO with --reference>]\n"
    "RER = sum ||k - U U^T k||^2 / sum ||k||^2 over the valid keys of all heads; with\n"
    "--full-rank the selected tokens count as exact (residual 0).\n"
    "\n"
    "  --keys K.npy        keys [heads, tokens, head_dim]: '<f4', '<f2' or '<u2' (bfloat16 bits)\n"
    "  --values V.npy      values, same shape and dtype: the value basis (rank R) is updated too\n"
    "  --rank R            basis rank, 1 <= R <= head_dim\n"
    "  --calib C.npy       '<f4' [heads, n, head_dim] calibration rows (stacked queries and keys);\n"
    "                      without it head h starts from random_orthonormal(d, R, seed = h)\n"
    "  --queries Q.npy     '<f4' [q_heads, w, head_dim]: the last w prompt queries (with --full-rank)\n"
    "  --full-rank N       keep the N tokens per head with the largest residual score\n"
    "                      e_t = mean_q |q.(k_t - U U^T k_t)| / sqrt(d) at full rank (needs --queries)\n"
    "  --reference U0.npy  '<f4' [heads, head_dim, R]: also print so = mean over heads of SO(U, U0)\n"
    "  --out-basis U.npy   '<f4' [heads, head_dim, R]: the key bases after the prefill update\n"
    "  --prefill P         converged (default: up to 32 steps at eta 1.5, about the prompt's PCA) |\n"
    "                      paper (ojakv.txt Alg. 1: one step at eta 0.10 from the --calib start,\n"
    "                      which it needs); docs/methods/ojakv.md says when each is better\n"
    "  -h, --help          this help\n";

const std::vector<FlagSpec> kOjaFlags = {
    {"--keys", true},      {"--values", true},    {"--rank", true},      {"--calib", true},
    {"--queries", true},   {"--full-rank", true}, {"--reference", true}, {"--out-basis", true},
    {"--prefill", true},
};

namespace {

npy::Array load_f32(const std::string& path, const char* what, std::size_t rank) {
  npy::Array a = npy::load(path);
  if (a.descr != npy::descr_of<float>())
    throw std::invalid_argument(path + ": " + what + " dtype '" + a.descr + "' not supported (expected '<f4' float32)");
  if (a.shape.size() != rank)
    throw std::invalid_argument(path + ": " + what + " must have " + std::to_string(rank) + " dimensions, got " +
                                std::to_string(a.shape.size()));
  return a;
}

struct Result {
  std::vector<float> bases;  // [heads][d][r]
  double rer = 0, rer_v = -1;  // rer_v: with --values only
  std::vector<Eigen::MatrixXd> u;
};

template <class T>
Result run(const Args& args, const npy::Array& keys, const npy::Array* values, std::int64_t rank) {
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2];
  const T* k = keys.as<T>();
  const KeysView<T> kv(k, H, N, d, N * d, d);

  const std::string mode = args.get("--prefill", "converged");
  if (mode != "converged" && mode != "paper")
    throw UsageError("oja: --prefill must be converged or paper (got '" + mode + "')");
  if (mode == "paper" && !args.has("--calib"))
    throw UsageError("oja: --prefill paper needs --calib (one step from a calibrated start)");
  const OjaOptions opt = mode == "paper" ? OjaOptions::paper() : OjaOptions{};
  std::vector<OjaBasis> kb;
  if (args.has("--calib")) {
    const std::string p = args.required("--calib");
    const npy::Array c = load_f32(p, "calibration", 3);
    if (c.shape[0] != H || c.shape[2] != d)
      throw std::invalid_argument(p + ": calibration shape [" + std::to_string(c.shape[0]) + ", " +
                                  std::to_string(c.shape[1]) + ", " + std::to_string(c.shape[2]) +
                                  "] does not match the keys' heads " + std::to_string(H) + " and head_dim " +
                                  std::to_string(d));
    for (std::int64_t h = 0; h < H; ++h)
      kb.push_back(OjaBasis::calibrate({{c.as<float>() + h * c.shape[1] * d, c.shape[1]}}, d,
                                       oja::RankRule::fixed(rank), opt));
  } else {
    for (std::int64_t h = 0; h < H; ++h) kb.push_back(OjaBasis::random(d, rank, std::uint64_t(h)));
  }
  for (std::int64_t h = 0; h < H; ++h) kb[std::size_t(h)].prefill(kv, h);
  std::vector<Eigen::MatrixXd> uv;
  if (values != nullptr) {
    const KeysView<T> vv(values->as<T>(), H, N, d, N * d, d);
    for (std::int64_t h = 0; h < H; ++h) {
      OjaBasis b = OjaBasis::random(d, rank, std::uint64_t(H + h));
      b.prefill(vv, h);
      uv.push_back(b.basis());
    }
  }

  Result res;
  for (const OjaBasis& b : kb) res.u.push_back(b.basis());

  // Full-rank tokens: the residual score through the generic selector.
  std::vector<unsigned char> full(std::size_t(H * N), 0);
  if (args.has("--full-rank")) {
    const std::int64_t n_full = args.get_int("--full-rank", 0, 0, INT64_MAX);
    if (n_full > N)
      throw std::invalid_argument("oja: --full-rank " + std::to_string(n_full) + " exceeds the " + std::to_string(N) +
                                  " tokens of the keys");
    const std::string qp = args.required("--queries");
    const npy::Array q = load_f32(qp, "queries", 3);
    if (q.shape[2] != d)
      throw std::invalid_argument(qp + ": queries have head_dim " + std::to_string(q.shape[2]) + ", keys " +
                                  std::to_string(d));
    const OjaResidual scorer(q.as<float>(), q.shape[0], q.shape[1], d, res.u);
    const Scores s = scorer.score(kv);
    const Selection sel = select(s, Budget::per_head(n_full));
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t : sel.head(h)) full[std::size_t(h * N + t)] = 1;
  }

  auto rer = [&](const KeysView<T>& x_view, const std::vector<Eigen::MatrixXd>& bases, const std::string& path) {
    double num = 0, den = 0;
    std::vector<double> row(static_cast<std::size_t>(d));
    for (std::int64_t h = 0; h < H; ++h) {
      const Eigen::MatrixXd& u = bases[std::size_t(h)];
      for (std::int64_t t = 0; t < N; ++t) {
        if (!oja::widen_row(x_view.row(h, t), d, row.data())) continue;  // invalid rows: left out
        const Eigen::Map<const Eigen::VectorXd> x(row.data(), d);
        den += x.squaredNorm();
        if (!full[std::size_t(h * N + t)]) num += (x - u * (u.transpose() * x)).squaredNorm();
      }
    }
    if (!(den > 0)) throw std::invalid_argument(path + ": zero energy over the valid rows (RER undefined)");
    return num / den;
  };
  res.rer = rer(kv, res.u, args.required("--keys"));
  if (values != nullptr) res.rer_v = rer(KeysView<T>(values->as<T>(), H, N, d, N * d, d), uv, args.required("--values"));

  res.bases.resize(std::size_t(H * d * rank));
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < d; ++i)
      for (std::int64_t j = 0; j < rank; ++j)
        res.bases[std::size_t((h * d + i) * rank + j)] = float(res.u[std::size_t(h)](i, j));
  return res;
}

}  // namespace

int cmd_oja(const Args& args) {
  const std::string keys_path = args.required("--keys");
  args.required("--rank");
  const std::string out_path = args.required("--out-basis");
  const std::int64_t rank = args.get_int("--rank", 0, 1, INT64_MAX);
  if (args.has("--full-rank") && !args.has("--queries"))
    throw UsageError("oja: --full-rank needs --queries (the residual score is query-weighted)");
  if (args.has("--queries") && !args.has("--full-rank"))
    throw UsageError("oja: --queries applies only with --full-rank");
  args.get_int("--full-rank", 0, 0, INT64_MAX);  // validates the number before any file is read

  const npy::Array keys = npy::load(keys_path);
  if (keys.shape.size() != 3)
    throw std::invalid_argument(keys_path + ": keys must have shape [heads, tokens, head_dim], got " +
                                std::to_string(keys.shape.size()) + " dimensions");
  const std::int64_t H = keys.shape[0], N = keys.shape[1], d = keys.shape[2];
  if (H == 0 || N == 0) throw std::invalid_argument(keys_path + ": empty keys (" + std::to_string(H) + " heads, " +
                                                    std::to_string(N) + " tokens)");
  if (d < 1 || d > kMaxHeadDim)
    throw std::invalid_argument(keys_path + ": head_dim " + std::to_string(d) + " not supported (1.." +
                                std::to_string(kMaxHeadDim) + ")");
  if (rank > d)
    throw std::invalid_argument("oja: --rank " + std::to_string(rank) + " exceeds head_dim " + std::to_string(d));
  npy::Array values;
  if (args.has("--values")) {
    const std::string vp = args.required("--values");
    values = npy::load(vp);
    if (values.descr != keys.descr || values.shape != keys.shape)
      throw std::invalid_argument(vp + ": values must have the keys' dtype '" + keys.descr + "' and shape [" +
                                  std::to_string(H) + ", " + std::to_string(N) + ", " + std::to_string(d) + "]");
  }
  const npy::Array* vptr = args.has("--values") ? &values : nullptr;

  Result res;
  try {
    res = visit_dtype(npy::element_dtype(keys, keys_path + ": keys"),
                      [&]<class T>(std::type_identity<T>) { return run<T>(args, keys, vptr, rank); });
  } catch (const std::invalid_argument& e) {
    std::string m = e.what();
    if (m.compare(0, 9, "kvscore::") == 0) m = "oja: " + m.substr(9);
    throw std::invalid_argument(m);
  }

  std::string line = "rer=" + oja::num(res.rer);
  if (res.rer_v >= 0) line += " rer_v=" + oja::num(res.rer_v);
  if (args.has("--reference")) {
    const std::string rp = args.required("--reference");
    const npy::Array r = load_f32(rp, "reference basis", 3);
    if (r.shape[0] != H || r.shape[1] != d || r.shape[2] != rank)
      throw std::invalid_argument(rp + ": reference basis shape [" + std::to_string(r.shape[0]) + ", " +
                                  std::to_string(r.shape[1]) + ", " + std::to_string(r.shape[2]) + "] is not [" +
                                  std::to_string(H) + ", " + std::to_string(d) + ", " + std::to_string(rank) + "]");
    double so = 0;
    for (std::int64_t h = 0; h < H; ++h) {
      const Eigen::Map<const oja::RowMajorF> u0(r.as<float>() + h * d * rank, d, rank);
      try {
        so += subspace_overlap(res.u[std::size_t(h)], u0.cast<double>());
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(rp + ": head " + std::to_string(h) + ": " + e.what());
      }
    }
    line += " so=" + oja::num(so / double(H));
  }
  save_f32_npy_atomic(out_path, {H, d, rank}, res.bases.data());
  std::printf("%s\n", line.c_str());
  return kExitOk;
}

KVSCORE_CLI_COMMAND(oja, "oja", "OjaKV prefill update of the key bases (.npy in, U.npy out), prints RER/SO", cmd_oja,
                    kOjaFlags, kOjaUsage);

}  // namespace kvscore::cli
