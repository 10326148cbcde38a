// OjaKV from prompt to generation (docs/methods/ojakv.md "Prefill modes" and "Decode"):
//  1. which prefill to use — the default (converge to the prompt's principal subspace) or the
//     paper's (one step at eta 0.10 from a calibrated start) — measured as the residual energy
//     ratio (RER) on the prompt and on the next 8K tokens of synthetic drifting keys;
//  2. a hybrid cache that grows during generation: append() per decoded token, a basis update and
//     rebase every T tokens, the residual rule keeping 10% of each block at full rank.
//
// The table of step 1 from the command line (one prompt length, one rank):
//   kvscore synth --kind drift --tokens 12288 --out /tmp/kv
//   kvscore oja --keys /tmp/kv/K.npy --rank 4 --calib CAL.npy --prefill paper --out-basis U.npy
#include <cstdio>
#include <vector>

#include <kvscore/ojakv/ojakv.hpp>
#include <kvscore/select.hpp>
#include <kvscore/synth.hpp>

int main() {
  using namespace kvscore;
  const std::int64_t H = 4, d = 64, N = 2048 + 2048 + 8192;
  synth::Spec spec;
  spec.kind = synth::Kind::drift;  // topics change every 256 tokens
  spec.kv_heads = H;
  spec.group = 1;
  spec.queries = 1;
  spec.head_dim = d;
  spec.tokens = N;
  spec.seed = 3;
  const synth::Data data = synth::generate(spec);

  // 1. Prefill modes. Calibration: the stream's first 2K tokens; then a prompt, then 8K more.
  std::printf("rank  prompt | RER on the prompt: calibrated  paper  converged | on the next 8K: calibrated  paper  converged\n");
  for (std::int64_t r : {4, 12})
    for (std::int64_t prompt : {128, 2048}) {
      double rer[3][2] = {};
      for (std::int64_t h = 0; h < H; ++h) {
        const float* K = data.keys.data() + h * N * d;
        auto rows = [&](std::int64_t a, std::int64_t n) {
          return Eigen::Map<const oja::RowMajorF>(K + a * d, n, d).cast<double>().eval();
        };
        const Eigen::MatrixXd P = rows(2048, prompt), C = rows(2048 + prompt, 8192);
        for (int m = 0; m < 3; ++m) {  // calibrated only, paper, converged (the default)
          OjaBasis b = OjaBasis::calibrate({{K, 2048}}, d, oja::RankRule::fixed(r),
                                           m == 1 ? OjaOptions::paper() : OjaOptions{});
          if (m > 0) b.prefill(KeysView<float>(K + 2048 * d, 1, prompt, d, prompt * d, d), 0);
          rer[m][0] += residual_energy_ratio(P, b.basis()) / double(H);
          rer[m][1] += residual_energy_ratio(C, b.basis()) / double(H);
        }
      }
      std::printf("%4lld  %6lld | %29.4f  %5.4f  %9.4f | %27.4f  %5.4f  %9.4f\n", (long long)r, (long long)prompt,
                  rer[0][0], rer[1][0], rer[2][0], rer[0][1], rer[1][1], rer[2][1]);
    }

  // 2. Generation: a 2K prompt (prefill + 10% full rank by the residual rule), 4096 decoded tokens.
  const std::int64_t prompt = 2048, steps = 4096, r = 12, w = 32;
  const KeysView<float> keys(data.keys.data(), H, prompt, d, N * d, d), values(data.values.data(), H, prompt, d, N * d, d);
  std::vector<OjaProjector> proj;
  std::vector<Eigen::MatrixXd> uk;
  std::vector<float> window(static_cast<std::size_t>(H * w * d));
  for (std::int64_t h = 0; h < H; ++h) {
    proj.push_back(OjaProjector::random(d, r, r, std::uint64_t(h)));
    proj.back().prefill(keys, values, h);
    uk.push_back(proj.back().key().basis());
    for (std::int64_t i = 0; i < w * d; ++i)  // the prompt's last w keys stand in for its queries
      window[std::size_t(h * w * d + i)] = data.keys[std::size_t((h * N + prompt - w) * d + i)];
  }
  const OjaResidual residual(window.data(), H, w, d, uk);
  OjaHybridCache cache = OjaHybridCache::build(
      proj, keys, values, select(residual.score(keys), Budget::per_head(budget_from_ratio(prompt, 0.1))));
  std::vector<float> k(static_cast<std::size_t>(H * d)), v(k.size());
  for (std::int64_t t = prompt; t < prompt + steps; ++t) {
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < d; ++j) {
        k[std::size_t(h * d + j)] = data.keys[std::size_t((h * N + t) * d + j)];
        v[std::size_t(h * d + j)] = data.values[std::size_t((h * N + t) * d + j)];
      }
    cache.append(proj, k.data(), v.data(), /*queries: the token's own key*/ k.data(), H);
  }
  const OjaMemory m = cache.memory(0, /*fp16*/ 2);
  std::printf("\ngeneration: %lld tokens per head, %lld basis updates, %zu at full rank; %.1f B/token at fp16 "
              "(full rank %lld, ratio %.3f)\n",
              (long long)cache.tokens(), (long long)proj[0].key().decode_updates(), cache.head(0).full_pos.size(),
              double(m.hybrid_bytes) / double(cache.tokens()), (long long)(2 * d * 2), m.ratio);
  return cache.tokens() == prompt + steps ? 0 : 1;
}
