// examples/llama_cpp/kvzip_replay.cpp — the test of `kvscore_llama --method kvzip --dump DIR`:
// recomputes the kept positions from what the run dumped (the prompt's captured keys, each
// reconstruction pass's captured keys, queries and span, the selection options) with
// kvscore::KVzip::score_span and select_joint, and checks them against the run's kept.npy. So
// the capture, the pass layout (query i at its own row i), the spans and the joint selection of
// the llama.cpp example are the library's definition on the same tensors. Also checks what the
// dump must satisfy whatever the scorer: the spans tile the prompt after its prefix, each pass's
// keys and queries have one row per pass token. Exit 0: same positions; 1: they differ; 2: usage.
//
//   kvzip_replay DIR
#include <kvscore/io/npy.hpp>
#include <kvscore/joint.hpp>
#include <kvscore/scorers/kvzip.hpp>

#include <cstdint>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

namespace {

int run(const std::string& dir) {
  namespace npy = kvscore::npy;
  const npy::Array ck = npy::load(dir + "/context_keys.npy");  // [L, N, Hkv, D]
  const npy::Array spans = npy::load(dir + "/spans.npy");      // [passes, 2]
  const npy::Array kept = npy::load(dir + "/kept.npy");        // [budget]
  const npy::Array opt = npy::load(dir + "/options.npy");      // budget, sinks, recent, aggregate
  const std::int64_t L = ck.shape[0], N = ck.shape[1], Hkv = ck.shape[2], D = ck.shape[3];
  const std::int64_t* sp = spans.as<std::int64_t>();
  const std::int64_t* o = opt.as<std::int64_t>();
  const std::int64_t sinks = o[1];  // the run's --sinks: the passes' softmax sinks and the protected ones
  const std::int64_t P = spans.shape[0];
  std::vector<kvscore::Scores> scores(std::size_t(L), kvscore::Scores(Hkv, N));
  for (std::int64_t i = 0; i < P; ++i) {
    if (sp[2 * i + 1] - sp[2 * i] <= 0 || (i > 0 && sp[2 * i] != sp[2 * i - 1]) || (i + 1 == P && sp[2 * i + 1] != N)) {
      std::printf("FAILED: the spans do not tile the prompt after its prefix (pass %lld: [%lld, %lld))\n", (long long)i,
                  (long long)sp[2 * i], (long long)sp[2 * i + 1]);
      return 1;
    }
    const std::string f = dir + "/pass" + std::to_string(i);
    const npy::Array k = npy::load(f + "_keys.npy");     // [L, m, Hkv, D]
    const npy::Array q = npy::load(f + "_queries.npy");  // [L, Hq, m, D]
    const std::int64_t m = k.shape[1], Hq = q.shape[1];
    if (q.shape[2] != m || k.shape[0] != L || q.shape[0] != L) {
      std::printf("FAILED: pass %lld holds %lld keys but %lld queries per layer\n", (long long)i, (long long)m,
                  (long long)q.shape[2]);
      return 1;
    }
    for (std::int64_t l = 0; l < L; ++l) {
      kvscore::KVzip z(q.as<float>() + l * Hq * m * D, Hq, m, D);
      z.score_span(kvscore::KeysView<float>::token_major(ck.as<float>() + l * N * Hkv * D, N, Hkv, D),
                   kvscore::KeysView<float>::token_major(k.as<float>() + l * m * Hkv * D, m, Hkv, D),
                   kvscore::KVzipSpan{sp[2 * i], sp[2 * i + 1], sinks}, scores[std::size_t(l)].view());
    }
  }
  kvscore::JointOptions jo;
  jo.sinks = o[1];
  jo.recent = o[2];
  jo.aggregate = kvscore::JointAggregate(o[3]);
  const std::vector<std::int64_t> want = kvscore::select_joint(scores, o[0], jo);
  const std::vector<std::int64_t> got(kept.as<std::int64_t>(), kept.as<std::int64_t>() + kept.size());
  std::size_t same = 0;
  for (std::size_t i = 0; i < want.size() && i < got.size(); ++i) same += want[i] == got[i];
  std::printf("kvzip_replay: %lld layers, %lld passes, %lld prompt tokens: %zu of %zu kept positions recomputed "
              "from the dump %s\n",
              (long long)L, (long long)P, (long long)N, same, want.size(), want == got ? "(identical)" : "DIFFER");
  return want == got ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc != 2) {
      std::fprintf(stderr, "usage: kvzip_replay DIR\n");
      return 2;
    }
    return run(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvzip_replay: %s\n", e.what());
    return 2;
  }
}
