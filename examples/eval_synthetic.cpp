// Which scorer at which budget? Generate a synthetic cache with topic drift, evaluate two
// scorers against full attention and print the table (docs/reference/evaluate.md, docs/reference/synth.md).
//
// The same from the command line:
//   kvscore synth --kind drift --out /tmp/kv --tokens 1024 --segment 256
//   kvscore eval --keys /tmp/kv/K.npy --values /tmp/kv/V.npy --queries /tmp/kv/Q.npy
//                --methods l2,windowed-l2 --keep 0.05,0.1,0.25 --window 256 --out r.json
#include <cstdio>

#include <kvscore/eval/evaluate.hpp>
#include <kvscore/eval/report.hpp>
#include <kvscore/synth.hpp>

int main() {
  kvscore::synth::Spec spec;
  spec.kind = kvscore::synth::Kind::drift;  // topics change every `segment` tokens
  spec.kv_heads = 2;
  spec.tokens = 1024;
  spec.segment = 256;
  spec.queries = 8;
  const kvscore::synth::Data data = kvscore::synth::generate(spec);

  // One layer: keys / values [kv_heads][tokens][d], queries [q_heads][queries][d], fp32.
  kvscore::eval::LayerInput layer;
  layer.keys = data.keys.data();
  layer.values = data.values.data();
  layer.queries = data.queries.data();
  layer.kv_heads = spec.kv_heads;
  layer.tokens = spec.tokens;
  layer.head_dim = spec.head_dim;
  layer.value_dim = spec.head_dim;
  layer.q_heads = data.q_heads();
  layer.n_queries = spec.queries;

  kvscore::eval::EvalOptions opt;
  opt.methods = kvscore::eval::resolve_methods("l2,windowed-l2,oracle");
  opt.keep = {0.05, 0.1, 0.25};
  opt.method.window = spec.segment;  // one window per topic
  const kvscore::eval::Report report = kvscore::eval::evaluate({layer}, opt);
  std::fputs(kvscore::eval::to_table(report).c_str(), stdout);

  // windowed L2 keeps each topic's outliers; global L2 keeps whole far-away topics
  const double global = report.results[0].attention_mass_recall, windowed = report.results[3].attention_mass_recall;
  std::printf("attention-mass recall at 5%%: l2 %.3f, windowed-l2 %.3f\n", global, windowed);
  return windowed > global ? 0 : 1;
}
