// tools/cmd_synth.cpp — `kvscore synth`: write a synthetic cache with planted structure
// (include/kvscore/synth.hpp, docs/reference/synth.md) as K.npy, V.npy, Q.npy + planted.json.
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include <unistd.h>

#include <kvscore/core/dtype.hpp>
#include <kvscore/io/npy.hpp>
#include <kvscore/synth.hpp>

#include "cli.hpp"

namespace kvscore::cli {

namespace {
/// The usage text, with the defaults of synth::Spec.
std::string synth_usage() {
  const synth::Spec d;
  const auto n = [](auto v) { return std::to_string(v); };
  return
    "usage: kvscore synth --kind KIND --out DIR [options]\n"
    "\n"
    "Writes a synthetic KV cache with planted structure to DIR (created if missing):\n"
    "  K.npy, V.npy  [kv_heads, tokens, d]  ([layers, kv_heads, tokens, d] with --layers > 1)\n"
    "  Q.npy         [q_heads, queries, d]  ([layers, q_heads, queries, d])\n"
    "  planted.json  the spec and the positions of every planted token per (layer, head)\n"
    "Same arguments, same bytes (splitmix64 + Box-Muller; see docs/reference/synth.md).\n"
    "\n"
    "  --kind KIND     mixed (everything, moderate: the built-in benchmark data) | sinks |\n"
    "                  anisotropic | lowrank | drift | radial-needles | angular-needles |\n"
    "                  multikey-needles | anchors\n"
    "  --out DIR       output directory\n"
    "  --layers L      layers (default " + n(d.layers) + ")\n"
    "  --kv-heads H    KV heads (default " + n(d.kv_heads) + ")\n"
    "  --group G       query heads per KV head (default " + n(d.group) + ")\n"
    "  --tokens N      tokens (default " + n(d.tokens) + ", >= 64)\n"
    "  --head-dim D    head dimension (default " + n(d.head_dim) + ", in [16, 1024])\n"
    "  --queries Q     queries per query head (default " + n(d.queries) + ")\n"
    "  --segment S     tokens per topic segment for drift / mixed (default " + n(d.segment) + "); pass it to\n"
    "                  `kvscore eval --window S`\n"
    "  --seed S        seed (default " + n(d.seed) + ")\n"
    "  --dtype T       f32 (default) | f16: element type of K.npy, V.npy, Q.npy\n"
    "  -h, --help      this help\n";
}
}  // namespace

const std::string kSynthUsageText = synth_usage();
const char* const kSynthUsage = kSynthUsageText.c_str();

const std::vector<FlagSpec> kSynthFlags = {
    {"--kind", true},    {"--out", true},     {"--layers", true},  {"--kv-heads", true}, {"--group", true},
    {"--tokens", true},  {"--head-dim", true}, {"--queries", true}, {"--segment", true},  {"--seed", true},
    {"--dtype", true},
};

namespace {

/// Writes `data` with `shape` as '<f4' or '<f2' to a temporary name; returns it.
std::string synth_save_tmp(const std::string& path, const std::vector<std::int64_t>& shape,
                           const std::vector<float>& data, bool f16) {
  const std::string tmp = path + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
  if (f16) {
    std::vector<half> h(data.size());
    for (std::size_t i = 0; i < data.size(); ++i) h[i] = from_float<half>(data[i]);
    npy::save<half>(tmp, shape, h.data());
  } else {
    npy::save<float>(tmp, shape, data.data());
  }
  return tmp;
}

std::string synth_json(const synth::Data& D) {
  const synth::Spec& s = D.spec;
  std::string o = "{\n  \"kvscore_synth\": 1,\n  \"kind\": \"" + std::string(synth::kind_name(s.kind)) +
                  "\",\n  \"layers\": " + std::to_string(s.layers) + ", \"kv_heads\": " + std::to_string(s.kv_heads) +
                  ", \"group\": " + std::to_string(s.group) + ", \"tokens\": " + std::to_string(s.tokens) +
                  ", \"head_dim\": " + std::to_string(s.head_dim) + ", \"queries\": " + std::to_string(s.queries) +
                  ", \"segment\": " + std::to_string(s.segment) + ", \"seed\": " + std::to_string(s.seed) +
                  ",\n  \"planted\": {";
  for (std::size_t i = 0; i < D.planted.size(); ++i) {
    o += std::string(i ? "," : "") + "\n    \"" + D.planted[i].first + "\": [";
    const auto& per = D.planted[i].second;
    for (std::size_t j = 0; j < per.size(); ++j) {
      o += std::string(j ? ", " : "") + "[";
      for (std::size_t k = 0; k < per[j].size(); ++k) o += (k ? ", " : "") + std::to_string(per[j][k]);
      o += "]";
    }
    o += "]";
  }
  return o + "\n  }\n}\n";
}

}  // namespace

int cmd_synth(const Args& args) {
  synth::Spec s;
  const std::string kind = args.required("--kind");
  try {
    s.kind = synth::parse_kind(kind);
  } catch (const std::invalid_argument& e) {
    const std::string m = e.what();
    throw UsageError("synth: --kind: " + m.substr(m.find(": ") + 2));
  }
  const std::string dir = args.required("--out");
  s.layers = args.get_int("--layers", s.layers, 1, 1024);
  s.kv_heads = args.get_int("--kv-heads", s.kv_heads, 1, 1024);
  s.group = args.get_int("--group", s.group, 1, 64);
  s.tokens = args.get_int("--tokens", s.tokens, 64, std::int64_t(1) << 24);
  s.head_dim = args.get_int("--head-dim", s.head_dim, 16, 1024);
  s.queries = args.get_int("--queries", s.queries, 1, 65536);
  s.segment = args.get_int("--segment", s.segment, 16, INT64_MAX);
  s.seed = std::uint64_t(args.get_int("--seed", std::int64_t(s.seed), 0, INT64_MAX));
  const std::string dtype = args.get("--dtype", "f32");
  if (dtype != "f32" && dtype != "f16") throw UsageError("synth: --dtype: '" + dtype + "' (expected f32 or f16)");
  if (s.segment > s.tokens)
    throw UsageError("synth: --segment " + std::to_string(s.segment) + " exceeds --tokens " + std::to_string(s.tokens));

  const synth::Data D = synth::generate(s);
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    throw std::invalid_argument("synth: --out " + dir + ": cannot create the directory" +
                                (ec ? " (" + ec.message() + ")" : std::string()));
  const bool multi = s.layers > 1;
  auto shp = [&](std::int64_t a, std::int64_t b) {
    return multi ? std::vector<std::int64_t>{s.layers, a, b, s.head_dim} : std::vector<std::int64_t>{a, b, s.head_dim};
  };
  // Everything goes to temporary names first, then renames: a failed run leaves no partial set.
  const std::vector<std::string> finals = {dir + "/K.npy", dir + "/V.npy", dir + "/Q.npy", dir + "/planted.json"};
  std::vector<std::string> tmps;
  try {
    tmps.push_back(synth_save_tmp(finals[0], shp(s.kv_heads, s.tokens), D.keys, dtype == "f16"));
    tmps.push_back(synth_save_tmp(finals[1], shp(s.kv_heads, s.tokens), D.values, dtype == "f16"));
    tmps.push_back(synth_save_tmp(finals[2], shp(D.q_heads(), s.queries), D.queries, dtype == "f16"));
    const std::string tj = finals[3] + ".tmp-" + std::to_string(static_cast<long long>(::getpid()));
    tmps.push_back(tj);
    const std::string j = synth_json(D);
    std::FILE* f = std::fopen(tj.c_str(), "wb");
    const bool ok = f != nullptr && std::fwrite(j.data(), 1, j.size(), f) == j.size();
    if (f == nullptr || (std::fclose(f) != 0) || !ok) throw std::invalid_argument(finals[3] + ": write error");
    for (std::size_t i = 0; i < finals.size(); ++i)
      if (std::rename(tmps[i].c_str(), finals[i].c_str()) != 0)
        throw std::invalid_argument(finals[i] + ": cannot rename into place");
  } catch (...) {
    for (const auto& t : tmps) std::remove(t.c_str());
    throw;
  }
  std::cout << "kvscore synth: " << synth::kind_name(s.kind) << ", " << s.layers << " layer(s), " << s.kv_heads
            << " KV heads x " << s.tokens << " tokens, " << D.q_heads() << " query heads x " << s.queries
            << " queries, head_dim " << s.head_dim << " -> " << dir << "/{K,V,Q}.npy, planted.json\n";
  return kExitOk;
}

KVSCORE_CLI_COMMAND(synth, "synth", "write a synthetic KV cache with planted structure (K, V, Q .npy)", cmd_synth,
                    kSynthFlags, kSynthUsage);

}  // namespace kvscore::cli
