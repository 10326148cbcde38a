// examples/llama_cpp/kvscore_llama.cpp — kvscore inside llama.cpp (docs/guides/integration.md).
//
// Prefills a prompt, captures every layer's post-RoPE keys through cb_eval (capture.hpp), scores
// them with any kvscore scorer, picks ONE set of positions for all heads and layers
// (kvscore::select_joint: llama.cpp's cells hold every head of every layer, so a token is kept or
// removed everywhere), removes the others with llama_memory_seq_rm and goes on generating
// greedily from the smaller cache.
//
// --alloc per_head: every KV head of every layer keeps its own top tokens (the same count in
// each). The cells still hold the joint selection's positions (the mask and llama.cpp's next
// position read them), but each (layer, head)'s slice of their K and V rows is rewritten, through
// the state API, with that head's own kept tokens: a head's cells are then an unordered set of
// its tokens' post-RoPE keys and values, which is all attention reads from them (no per-head mask
// is needed: every cell is visible to every later query). Not for context shifts (a cell's
// K-shift would rotate tokens of other positions), SWA or M-RoPE models.
//
//   kvscore_llama --model SmolLM2-135M-Instruct.Q4_1.gguf --prompt-file text.txt \
//                 --method knorm --keep 0.5 --sinks 4 --recent 64 --n-predict 32
//
// --method kvzip (KVzip, docs/methods/kvzip.md; kvzip.hpp): after the prefill the model reconstructs the
// prompt from its cache in passes decoded after it; each pass's queries and keys are captured, the
// prompt's tokens are scored by the attention they receive, the pass's tokens are dropped
// (llama_memory_seq_rm), and the same joint selection evicts. --question-file F (repeatable): each
// question is decoded after the compressed prompt and answered greedily, then removed, so every
// question sees the same compressed cache. --save-session F writes the compressed sequence with
// llama.cpp's state files (llama_state_seq_save_file); --check-session loads it into a fresh
// context and asks the questions again: the answers must be the same tokens (the writer itself
// answers from the file's packed cells, see below). --load-session F starts from such a file of
// the whole prompt (--keep 1) instead of prefilling it: for decode-speed runs at long contexts, the
// prompt prefilled once for the plain and the sparse run (the prompt's last token is decoded again
// for its logits, as a one-token step that attends densely, as the prompt batch would).
//
// --check reads the cache back through the state API (llama_state_seq_get_data) after the
// eviction and after generation: the cells must hold exactly the kept positions (then those plus
// the generated ones), and each kept cell's K row, in every layer, must equal the captured key
// rounded to the cache's fp16. --compare-plain first runs plain llama.cpp (no callback, no
// eviction) on the same prompt and reports whether the generated tokens are identical; with
// --keep 1 a difference is an error. Exit codes: 0 ok, 1 a check failed, 2 bad arguments.
#include <kvscore/joint.hpp>
#include <kvscore/make_scorer.hpp>
#include <kvscore/select.hpp>
#include <kvscore/slots.hpp>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "capture.hpp"
#include "kvzip.hpp"
#include "sparse.hpp"
#include "util.hpp"

namespace {

using namespace kvscore_llama;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model, prompt, prompt_file, method = "knorm", aggregate, save_session, load_session, dump,
      alloc = "joint";
  std::vector<std::string> questions;  ///< question files
  std::int64_t max_tokens = 0, n_predict = 32, sinks = 4, recent = 64, window = 64, ubatch = 512;
  std::int64_t chunk = kvscore_llama::kLlamaKVzipChunk, kvzip_prefix = -1;
  std::string kvzip_suffix = "\n";
  double keep = 0.5;
  double attend = 0;  ///< --attend (0: dense decode)
  std::int64_t local = kvscore::kDefaultBlockSparseLocal, dense_below = kvscore::kDefaultDenseBelow;
  std::string block_score = "int4", fa = "auto", type_k = "f16";
  bool check_attend = false, attend_set = false, repack = false;
  int threads = 0;
  bool check = false, compare_plain = false, print_text = true, verbose = false, check_session = false;
  bool special = false;
};

const char* kUsage =
    "usage: kvscore_llama --model FILE.gguf (--prompt TEXT | --prompt-file FILE) [options]\n"
    "  --method NAME      kvscore scorer (knorm, keydiff, manifold_l2, windowed_manifold_l2, qfilter,\n"
    "                     snapkv, protokv, kvzip; default knorm); snapkv, protokv and qfilter use the last\n"
    "                     --window prompt queries; kvzip the queries of its reconstruction passes\n"
    "  --keep R           fraction of the prompt's tokens kept, in (0, 1] (default 0.5)\n"
    "  --sinks N          first positions always kept (default 4)\n"
    "  --recent N         last positions always kept, >= 1: llama.cpp continues at the last kept position + 1\n"
    "                     (default 64)\n"
    "  --aggregate A      joint selection over heads and layers: max, mean or vote (default max)\n"
    "  --alloc A          joint (one set of positions for every head and layer) or per_head (each KV head of\n"
    "                     every layer keeps its own top tokens in the same cells, rewritten through the state\n"
    "                     API; default joint)\n"
    "  --window W         query window of snapkv / protokv / qfilter (default 64)\n"
    "  --n-predict N      tokens to generate (default 32)\n"
    "  --max-tokens N     use the prompt's first N tokens (default: all)\n"
    "  --threads N        CPU threads for llama.cpp and kvscore (default: all hardware threads)\n"
    "  --ubatch N         llama.cpp's physical batch (default 512)\n"
    "  --chunk N          kvzip: prompt tokens reconstructed per pass (default 512; kvpress's is 2048)\n"
    "  --kvzip-prefix N   kvzip: first prompt tokens not reconstructed (a chat template's opening; default:\n"
    "                     the BOS token if the model adds one)\n"
    "  --kvzip-suffix S   kvzip: text between the reconstruction prompt and the chunk (default \"\\n\"; with a\n"
    "                     chat template its end of the user turn, as kvpress)\n"
    "  --question-file F  a question decoded after the compressed prompt and answered (--n-predict tokens),\n"
    "                     then removed; repeatable\n"
    "  --special          parse special tokens (<|im_start|>, ...) in the prompt and the questions\n"
    "  --save-session F   save the compressed sequence (llama_state_seq_save_file)\n"
    "  --check-session    with --save-session: load it into a fresh context; the questions' answers must\n"
    "                     be the same tokens\n"
    "  --load-session F   start from F (--save-session of the same prompt with --keep 1) instead of the\n"
    "                     prefill; its last token is decoded again for the logits, densely (--keep 1 only)\n"
    "  --dump DIR         kvzip: write the context's keys, each pass's keys, queries and span and the kept\n"
    "                     positions as .npy (kvzip_replay recomputes the selection from them)\n"
    "  --attend F         sparse decode: each decode step's query attends, per layer, the sinks, the newest\n"
    "                     --local cells and the best blocks of 32 cells up to a fraction F in (0, 1] of the\n"
    "                     visible cells or a whole count F > 1 of them (kvscore::CellBlockSelector); the\n"
    "                     other cells are masked (-INFINITY) for that layer's attention. Needs -fa on.\n"
    "                     Prompt batches and sequences under --dense-below cells decode densely; questions\n"
    "                     (--question-file) are decoded a token a step, so they attend sparsely too\n"
    "  --local N          --attend: newest cells always attended (default 64)\n"
    "  --dense-below N    --attend: sequences of fewer visible cells decode densely (default 1024)\n"
    "  --block-score S    --attend: int4 (default), exact, quest or meanstd\n"
    "  --repack           after a --keep eviction, pack the kept cells at the cache's front, in order (a\n"
    "                     state round trip), so that llama.cpp's attention spans the kept cells only and\n"
    "                     every block of 32 cells is full again; implied by --attend\n"
    "  --check-attend     --attend: every sparse layer's mask, read back after its attention ran, must equal\n"
    "                     kvscore::cell_block_reference on the captured query and the cache's keys\n"
    "  -fa, --flash-attn M  on, off or auto (llama.cpp's default: auto)\n"
    "  --type-k T         K cache type: f16 (default), q8_0 or f32\n"
    "  --check            read the cache back (state API) and verify it holds exactly the kept positions\n"
    "  --compare-plain    run plain llama.cpp first; with --keep 1 the tokens must be identical\n"
    "  --no-text          do not print the generated text\n"
    "  --verbose          llama.cpp's own log\n";

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
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
    else if (f == "--prompt") a.prompt = value(i);
    else if (f == "--prompt-file") a.prompt_file = value(i);
    else if (f == "--method") a.method = value(i);
    else if (f == "--aggregate") a.aggregate = value(i);
    else if (f == "--alloc") a.alloc = value(i);
    else if (f == "--keep") a.keep = parse_double(f, value(i));
    else if (f == "--sinks") a.sinks = parse_int(f, value(i));
    else if (f == "--recent") a.recent = parse_int(f, value(i));
    else if (f == "--window") a.window = parse_int(f, value(i));
    else if (f == "--n-predict") a.n_predict = parse_int(f, value(i));
    else if (f == "--max-tokens") a.max_tokens = parse_int(f, value(i));
    else if (f == "--threads") a.threads = int(parse_int(f, value(i)));
    else if (f == "--ubatch") a.ubatch = parse_int(f, value(i));
    else if (f == "--chunk") a.chunk = parse_int(f, value(i));
    else if (f == "--kvzip-prefix") a.kvzip_prefix = parse_int(f, value(i));
    else if (f == "--kvzip-suffix") a.kvzip_suffix = value(i);
    else if (f == "--question-file") a.questions.push_back(value(i));
    else if (f == "--special") a.special = true;
    else if (f == "--save-session") a.save_session = value(i);
    else if (f == "--check-session") a.check_session = true;
    else if (f == "--load-session") a.load_session = value(i);
    else if (f == "--dump") a.dump = value(i);
    else if (f == "--attend") a.attend = parse_double(f, value(i)), a.attend_set = true;
    else if (f == "--local") a.local = parse_int(f, value(i));
    else if (f == "--dense-below") a.dense_below = parse_int(f, value(i));
    else if (f == "--block-score") a.block_score = value(i);
    else if (f == "--check-attend") a.check_attend = true;
    else if (f == "--repack") a.repack = true;
    else if (f == "-fa" || f == "--flash-attn") a.fa = value(i);
    else if (f == "--type-k") a.type_k = value(i);
    else if (f == "--check") a.check = true;
    else if (f == "--compare-plain") a.compare_plain = true;
    else if (f == "--no-text") a.print_text = false;
    else if (f == "--verbose") a.verbose = true;
    else if (f == "--help" || f == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else throw Usage("unknown option '" + f + "'");
  }
  if (a.model.empty()) throw Usage("--model is required");
  if (a.prompt.empty() == a.prompt_file.empty()) throw Usage("give exactly one of --prompt and --prompt-file");
  if (!(a.keep > 0.0 && a.keep <= 1.0)) throw Usage("--keep must be in (0, 1] (got " + num(a.keep) + ")");
  if (a.sinks < 0) throw Usage("--sinks must be >= 0 (got " + std::to_string(a.sinks) + ")");
  if (a.recent < 1)
    throw Usage("--recent must be >= 1 (got " + std::to_string(a.recent) +
                "): llama.cpp decodes the next token at the sequence's last cached position + 1, so the last "
                "prompt position must stay");
  if (a.window < 1) throw Usage("--window must be >= 1 (got " + std::to_string(a.window) + ")");
  if (a.n_predict < 1) throw Usage("--n-predict must be >= 1 (got " + std::to_string(a.n_predict) + ")");
  if (a.max_tokens < 0) throw Usage("--max-tokens must be >= 0 (got " + std::to_string(a.max_tokens) + ")");
  if (a.threads < 0) throw Usage("--threads must be >= 0 (got " + std::to_string(a.threads) + ")");
  if (a.ubatch < 1) throw Usage("--ubatch must be >= 1 (got " + std::to_string(a.ubatch) + ")");
  if (a.chunk < 1) throw Usage("--chunk must be >= 1 (got " + std::to_string(a.chunk) + ")");
  if (a.fa != "on" && a.fa != "off" && a.fa != "auto") throw Usage("-fa must be on, off or auto (got '" + a.fa + "')");
  if (a.type_k != "f16" && a.type_k != "q8_0" && a.type_k != "f32")
    throw Usage("--type-k must be f16, q8_0 or f32 (got '" + a.type_k + "')");
  if (a.attend_set || a.check_attend) {
    if (!(a.attend > 0) || !std::isfinite(a.attend) || (a.attend > 1 && a.attend != std::floor(a.attend)))
      throw Usage("--attend must be a fraction in (0, 1] or a whole count of tokens > 1 (got " + num(a.attend) + ")");
    if (a.fa != "on")
      throw Usage("--attend needs -fa on (got -fa " + a.fa + "): the masked cells are skipped by llama.cpp's CPU "
                  "flash-attention kernel, and only its mask is one f16 row that can be rewritten per layer");
    if (a.local < 0) throw Usage("--local must be >= 0 (got " + std::to_string(a.local) + ")");
    if (a.dense_below < 0) throw Usage("--dense-below must be >= 0 (got " + std::to_string(a.dense_below) + ")");
    const kvscore::BlockScore bs = kvscore::parse_block_score(a.block_score);  // std::invalid_argument -> exit 2
    if (bs == kvscore::BlockScore::pariskv) throw Usage("--block-score pariskv is not offered with llama.cpp's cells");
    if (!a.save_session.empty() || a.alloc == "per_head")
      throw Usage(std::string("--attend does not take ") + (a.alloc == "per_head" ? "--alloc per_head" : "--save-session") +
                  " (a state load moves the cells the selector follows)");
  }
  if (a.check_session && a.save_session.empty()) throw Usage("--check-session needs --save-session FILE");
  if (a.attend_set) a.repack = true;  // after an eviction the blocks with holes would be attended whole
  if (!a.load_session.empty()) {  // nothing captured, nothing to score: decode from the loaded cache
    const char* other = a.keep != 1.0 ? "--keep below 1" : !a.save_session.empty() ? "--save-session"
                        : a.compare_plain ? "--compare-plain" : a.check ? "--check" : a.alloc != "joint" ? "--alloc per_head"
                        : a.method == "kvzip" ? "--method kvzip" : !a.dump.empty() ? "--dump" : nullptr;
    if (other)
      throw Usage(std::string("--load-session does not take ") + other +
                  " (the prompt is not prefilled, so nothing is captured to score or check)");
  }
  if (a.threads == 0) a.threads = int(std::max(1u, std::thread::hardware_concurrency()));
  if (!a.aggregate.empty()) kvscore::parse_joint_aggregate(a.aggregate);  // std::invalid_argument -> exit 2
  if (a.alloc != "joint" && a.alloc != "per_head")
    throw Usage("--alloc must be joint or per_head (got '" + a.alloc + "')");
  const kvscore::MethodInfo& info = kvscore::method_info(a.method);       // unknown name: the same
  if (!kvscore::is_scorer(info))
    throw Usage("--method '" + a.method + "' is a " + std::string(kvscore::kind_name(info.kind)) +
                ", not a scorer (scorers: " + kvscore::method_list(kvscore::is_scorer) + ")");
  if (!a.dump.empty() && info.name != kvscore::KVzip::name) throw Usage("--dump is for --method kvzip");
  return a;
}

/// `extra`: the longest batch decoded after the prompt (a KVzip pass, a question), beside --n-predict.
/// cb_eval of a context: the prefill capture and sparse decode, side by side (either may be absent).
struct Hooks {
  Capture* cap = nullptr;
  SparseDecode* sparse = nullptr;
  static bool callback(ggml_tensor* t, bool ask, void* user) {
    auto* h = static_cast<Hooks*>(user);
    if (ask) {
      bool want = h->cap && Capture::callback(t, true, h->cap);
      if (h->sparse) want = h->sparse->ask(t) || want;
      return want;
    }
    bool ok = !h->cap || Capture::callback(t, false, h->cap);
    if (h->sparse) ok = h->sparse->observed(t) && ok;
    return ok;
  }
  /// sparse decode's first error (a decode that met one is not to be trusted)
  void rethrow() const {
    if (sparse && !sparse->error.empty()) throw std::runtime_error("sparse decode: " + sparse->error);
  }
};

llama_context* make_context(llama_model* model, const Args& a, std::int64_t n_prompt, Hooks* hooks,
                            std::int64_t extra = 0) {
  llama_context_params p = llama_context_default_params();
  p.n_ctx = std::uint32_t(n_prompt + extra + a.n_predict + 16);
  p.n_batch = std::uint32_t(std::max(n_prompt, extra));  // the prompt (or a pass) in one llama_decode call
  p.n_ubatch = std::uint32_t(std::min<std::int64_t>(a.ubatch, std::max(n_prompt, extra)));
  p.n_seq_max = 1;
  p.n_threads = a.threads;
  p.n_threads_batch = a.threads;
  p.no_perf = true;
  if (a.fa != "auto") p.flash_attn_type = a.fa == "on" ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
  p.type_k = a.type_k == "q8_0" ? GGML_TYPE_Q8_0 : a.type_k == "f32" ? GGML_TYPE_F32 : GGML_TYPE_F16;
  if (hooks) {
    p.cb_eval = &Hooks::callback;
    p.cb_eval_user_data = hooks;
  }
  llama_context* ctx = llama_init_from_model(model, p);
  if (!ctx) throw std::runtime_error("llama_init_from_model failed");
  return ctx;
}

/// Greedy continuation from its first token `t` (the argmax of the logits before it): n tokens
/// (stops early at end of generation).
std::vector<llama_token> generate(llama_context* ctx, const llama_vocab* vocab, std::int64_t n, llama_token t,
                                  const Hooks* hooks = nullptr) {
  std::vector<llama_token> out;
  out.push_back(t);
  while (std::int64_t(out.size()) < n && !llama_vocab_is_eog(vocab, t)) {
    llama_batch b = llama_batch_get_one(&t, 1);
    if (llama_decode(ctx, b) != 0) throw std::runtime_error("llama_decode failed during generation");
    if (hooks) hooks->rethrow();
    t = argmax(ctx, vocab);
    out.push_back(t);
  }
  return out;
}

/// Each question decoded after the prompt's N tokens (positions N, N+1, ...), answered greedily
/// with n tokens, then removed with its answer: every question sees the same cache.
std::vector<std::vector<llama_token>> answer_all(llama_context* ctx, const llama_vocab* vocab,
                                                 const std::vector<std::vector<llama_token>>& questions,
                                                 std::int64_t N, std::int64_t n, const Hooks* hooks = nullptr) {
  std::vector<std::vector<llama_token>> out;
  for (std::vector<llama_token> q : questions) {
    // --attend: a question is decoded a token a step, so that each of its tokens attends sparsely too
    // (a batch of tokens is a prompt batch: dense)
    const std::size_t step = hooks && hooks->sparse ? 1 : q.size();
    for (std::size_t i = 0; i < q.size(); i += step) {
      if (llama_decode(ctx, llama_batch_get_one(q.data() + i, std::int32_t(std::min(step, q.size() - i)))) != 0)
        throw std::runtime_error("llama_decode failed on a question");
      if (hooks) hooks->rethrow();
    }
    out.push_back(generate(ctx, vocab, n, argmax(ctx, vocab), hooks));
    if (!llama_memory_seq_rm(llama_get_memory(ctx), 0, llama_pos(N), -1))
      throw std::runtime_error("llama_memory_seq_rm refused to drop a question");
  }
  return out;
}

std::string text_of(const llama_vocab* vocab, const std::vector<llama_token>& t) {
  std::string s;
  for (llama_token x : t) s += piece(vocab, x);
  return s;
}

/// Sequence 0 of the cache as llama_state_seq_get_data writes it (llama-kv-cache.cpp
/// state_write: n_stream, then per stream the cell count, each cell's position and sequence ids,
/// v_trans and the layer count, per layer the K type, the K row size and the K rows of those
/// cells; then per layer the V type and either the V row size and rows or, transposed, the
/// element size, n_embd_v_gqa and each V dimension's elements of those cells).
struct StateBytes {
  std::vector<std::uint8_t> buf;
  std::uint32_t cells = 0, v_trans = 0;
  std::vector<std::int32_t> pos;           ///< each cell's position, in cell order
  std::int32_t k_type = -1;
  std::vector<std::size_t> k_at, v_at;     ///< per layer: offset of its first K row / its V data
  std::vector<std::uint64_t> k_row, v_row; ///< per layer: bytes of a K row / a V row (transposed: an element)
  std::vector<std::uint32_t> v_dims;       ///< transposed V: per layer n_embd_v_gqa
  std::string error;                       ///< a layout this reader does not take (the fields above are partial)
};

StateBytes state_of(llama_context* ctx) {
  StateBytes s;
  s.buf.resize(llama_state_seq_get_size(ctx, 0));
  const std::size_t n = llama_state_seq_get_data(ctx, s.buf.data(), s.buf.size(), 0);
  s.buf.resize(n);
  std::size_t o = 0;
  auto skip = [&](std::uint64_t bytes) {
    if (o + bytes > n) throw std::runtime_error("state of sequence 0 ends early (format not understood)");
    o += bytes;
  };
  auto get = [&](void* dst, std::size_t bytes) {
    skip(bytes);
    std::memcpy(dst, s.buf.data() + o - bytes, bytes);
  };
  std::uint32_t magic = 0, n_stream = 0;
  std::int32_t seq = 0;
  get(&magic, 4);
  get(&seq, 4);
  get(&n_stream, 4);
  if (n_stream != 1) {
    s.error = "expected 1 stream, state has " + std::to_string(n_stream);
    return s;
  }
  get(&s.cells, 4);
  for (std::uint32_t c = 0; c < s.cells; ++c) {
    std::int32_t p = 0, id = 0;
    std::uint32_t n_seq = 0;
    get(&p, 4);
    get(&n_seq, 4);
    for (std::uint32_t j = 0; j < n_seq; ++j) get(&id, 4);
    if (n_seq != 1 || id != 0) s.error = "cell " + std::to_string(c) + " is not (only) in sequence 0";
    s.pos.push_back(p);
  }
  if (s.cells == 0) return s;
  std::uint32_t n_layer = 0;
  get(&s.v_trans, 4);
  get(&n_layer, 4);
  for (std::uint32_t l = 0; l < n_layer; ++l) {
    std::uint64_t row = 0;
    get(&s.k_type, 4);
    get(&row, 8);
    s.k_row.push_back(row);
    s.k_at.push_back(o);
    skip(std::uint64_t(s.cells) * row);
  }
  for (std::uint32_t l = 0; l < n_layer && o < n; ++l) {
    std::int32_t v_type = 0;
    get(&v_type, 4);
    if (!s.v_trans) {
      std::uint64_t row = 0;
      get(&row, 8);
      s.v_row.push_back(row);
      s.v_at.push_back(o);
      skip(std::uint64_t(s.cells) * row);
    } else {
      std::uint32_t el = 0, dims = 0;
      get(&el, 4);
      get(&dims, 4);
      s.v_row.push_back(el);
      s.v_dims.push_back(dims);
      s.v_at.push_back(o);
      skip(std::uint64_t(dims) * s.cells * el);
    }
  }
  if (s.v_at.size() != n_layer) s.error = "V rows of " + std::to_string(s.v_at.size()) + " of " + std::to_string(n_layer) + " layers";
  return s;
}

/// --load-session: sequence 0 from a state file of this prompt's whole cache (--save-session with
/// --keep 1), less its last token's cell (the caller decodes that token again: the logits). Loaded
/// into a fresh context the cells are 0..N-1 in position order, which is checked here (and by
/// sparse decode's cell map at its first step).
void load_prompt(llama_context* ctx, const std::string& file, const std::vector<llama_token>& prompt) {
  std::vector<llama_token> saved(prompt.size() + 1);
  std::size_t n = 0;
  if (llama_state_seq_load_file(ctx, file.c_str(), 0, saved.data(), saved.size(), &n) == 0)
    throw Usage("--load-session " + file + ": llama_state_seq_load_file refused it (not a state file of this model "
                "and context, or of a longer prompt)");
  saved.resize(n);
  if (saved != prompt)
    throw Usage("--load-session " + file + ": it was saved for another prompt of " + std::to_string(n) +
                " tokens (this one: " + std::to_string(prompt.size()) + ")");
  const StateBytes s = state_of(ctx);
  bool whole = s.error.empty() && s.cells == prompt.size();
  for (std::size_t c = 0; whole && c < s.pos.size(); ++c) whole = s.pos[c] == std::int32_t(c);
  if (!whole)
    throw Usage("--load-session " + file + ": its cache is not the whole prompt in order (" + std::to_string(s.cells) +
                " cells for " + std::to_string(prompt.size()) + " tokens" + (s.error.empty() ? "" : ", " + s.error) +
                "): save it with --keep 1");
  if (!llama_memory_seq_rm(llama_get_memory(ctx), 0, llama_pos(prompt.size() - 1), -1))
    throw std::runtime_error("llama_memory_seq_rm refused the prompt's last cell");
}

/// --repack: sequence 0's cells packed at the cache's front in their order (position order: one
/// prompt batch, then evictions), by a state round trip into the emptied sequence (a load fills cells
/// from the cache's head, which llama_memory_seq_rm of every cell puts at 0). Returns the cells'
/// positions, read back from the state.
std::vector<std::int32_t> repack_cells(llama_context* ctx) {
  std::vector<std::uint8_t> buf(llama_state_seq_get_size(ctx, 0));
  const std::size_t n = llama_state_seq_get_data(ctx, buf.data(), buf.size(), 0);
  if (n == 0) throw std::runtime_error("--repack: llama_state_seq_get_data wrote nothing");
  llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
  if (llama_state_seq_set_data(ctx, buf.data(), n, 0) == 0)
    throw std::runtime_error("--repack: llama_state_seq_set_data refused the sequence's own state");
  const StateBytes s = state_of(ctx);
  if (!s.error.empty()) throw std::runtime_error("--repack: " + s.error);
  return s.pos;
}

/// --alloc per_head: with the cache holding the joint selection's cells, each (layer, KV head)'s
/// slice of cell c's K and V rows becomes that of heads[layer].head(h)[c], copied from `full`
/// (the state before eviction), and the state is loaded back in place of the sequence.
void give_heads_their_tokens(llama_context* ctx, const StateBytes& full, const std::vector<kvscore::Selection>& heads) {
  StateBytes cur = state_of(ctx);
  if (!full.error.empty() || !cur.error.empty())
    throw std::runtime_error("--alloc per_head: " + (full.error.empty() ? cur.error : full.error));
  if (cur.k_at.size() != heads.size() || full.k_at.size() != heads.size() || cur.v_trans != full.v_trans)
    throw std::runtime_error("--alloc per_head: the state's layers differ from the scored ones");
  std::vector<std::int64_t> cell_of;  // position -> cell of `full`
  for (std::uint32_t c = 0; c < full.cells; ++c) {
    const auto p = std::size_t(full.pos[c]);
    if (p >= cell_of.size()) cell_of.resize(p + 1, -1);
    cell_of[p] = c;
  }
  std::uint8_t* dst = cur.buf.data();
  const std::uint8_t* src = full.buf.data();
  for (std::size_t l = 0; l < heads.size(); ++l) {
    const kvscore::Selection& sel = heads[l];
    const std::int64_t H = sel.heads;
    for (std::int64_t h = 0; h < H; ++h)
      if (sel.kept(h) != std::int64_t(cur.cells))
        throw std::runtime_error("--alloc per_head: layer " + std::to_string(l) + " head " + std::to_string(h) +
                                 " keeps " + std::to_string(sel.kept(h)) + " tokens for " + std::to_string(cur.cells) +
                                 " cells");
    const std::uint64_t kr = cur.k_row[l], vr = cur.v_row[l];
    const std::uint64_t vd = cur.v_trans ? cur.v_dims[l] : vr;
    if (kr % std::uint64_t(H) != 0 || vd % std::uint64_t(H) != 0)
      throw std::runtime_error("--alloc per_head: layer " + std::to_string(l) + "'s K or V row does not split into " +
                               std::to_string(H) + " heads (a quantized cache type whose blocks straddle heads)");
    const std::uint64_t kh = kr / std::uint64_t(H), vh = vd / std::uint64_t(H);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::span<const std::int64_t> toks = sel.head(h);
      for (std::uint32_t c = 0; c < cur.cells; ++c) {
        const std::uint64_t f = std::uint64_t(cell_of.at(std::size_t(toks[c])));
        std::memcpy(dst + cur.k_at[l] + c * kr + std::uint64_t(h) * kh, src + full.k_at[l] + f * kr + std::uint64_t(h) * kh, kh);
        if (!cur.v_trans) {
          std::memcpy(dst + cur.v_at[l] + c * vr + std::uint64_t(h) * vh, src + full.v_at[l] + f * vr + std::uint64_t(h) * vh,
                      vh);
        } else {  // dimension j of cell c at (j · cells + c) · element
          for (std::uint64_t j = std::uint64_t(h) * vh; j < std::uint64_t(h + 1) * vh; ++j)
            std::memcpy(dst + cur.v_at[l] + (j * cur.cells + c) * vr, src + full.v_at[l] + (j * full.cells + f) * vr, vr);
        }
      }
    }
  }
  llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
  if (llama_state_seq_set_data(ctx, cur.buf.data(), cur.buf.size(), 0) == 0)
    throw std::runtime_error("--alloc per_head: llama_state_seq_set_data refused the rewritten cells");
}

/// The 2 bytes of fp16 V element (cell c, dimension j) of layer l in a state, either V layout.
std::uint16_t v_half(const StateBytes& s, std::size_t l, std::uint64_t c, std::uint64_t j) {
  std::uint16_t x = 0;
  const std::uint64_t at = s.v_trans ? (j * s.cells + c) * 2 : c * s.v_row[l] + j * 2;
  std::memcpy(&x, s.buf.data() + s.v_at[l] + at, 2);
  return x;
}

/// The cache holds exactly `expect` (positions, ascending) and, when `keys` is given, each cell's
/// K row equals fp16 of the captured key of its position in every layer; with `heads` (--alloc
/// per_head) head h's slice of the c-th cell holds heads[layer].head(h)[c]'s key instead, and its
/// V slice that token's values in `before` (the cache read before the eviction). Prints what it
/// found.
bool check_cache(llama_context* ctx, const std::vector<std::int64_t>& expect, const Capture* keys, const char* when,
                 const std::vector<kvscore::Selection>* heads = nullptr, const StateBytes* before = nullptr) {
  const StateBytes s = state_of(ctx);
  if (!s.error.empty()) {
    std::printf("check (%s): FAILED: %s\n", when, s.error.c_str());
    return false;
  }
  std::vector<std::int64_t> got(s.pos.begin(), s.pos.end());
  std::sort(got.begin(), got.end());
  if (got != expect) {
    std::printf("check (%s): FAILED: the cache holds %zu positions, expected %zu\n", when, got.size(), expect.size());
    return false;
  }
  // llama_memory_seq_pos_min/max agree with the state
  llama_memory_t mem = llama_get_memory(ctx);
  if (llama_memory_seq_pos_min(mem, 0) != expect.front() || llama_memory_seq_pos_max(mem, 0) != expect.back()) {
    std::printf("check (%s): FAILED: seq_pos_min/max %d/%d, expected %lld/%lld\n", when,
                llama_memory_seq_pos_min(mem, 0), llama_memory_seq_pos_max(mem, 0), (long long)expect.front(),
                (long long)expect.back());
    return false;
  }
  std::int64_t rows = 0, mismatched = 0, moved = 0;
  if (keys) {
    const std::int64_t w = keys->kv_heads * keys->head_dim, D = keys->head_dim;
    if (s.k_type != GGML_TYPE_F16 || std::int64_t(s.k_at.size()) != keys->n_layer) {
      std::printf("check (%s): FAILED: K cache type %d with %zu layers (expected f16, %lld)\n", when, s.k_type,
                  s.k_at.size(), (long long)keys->n_layer);
      return false;
    }
    for (std::int64_t l = 0; l < keys->n_layer; ++l)
      for (std::size_t c = 0; c < s.pos.size(); ++c) {
        std::uint16_t row[kvscore::kMaxHeadDim];
        for (std::int64_t h = 0; h < keys->kv_heads; ++h) {
          const std::int64_t p = heads ? (*heads)[std::size_t(l)].head(h)[c] : s.pos[c];
          if (p >= keys->n_tokens) continue;  // generated after the capture
          moved += p != s.pos[c];
          std::memcpy(row, s.buf.data() + s.k_at[std::size_t(l)] + (c * std::size_t(w) + std::size_t(h * D)) * 2,
                      std::size_t(D) * 2);
          const float* src = keys->keys[std::size_t(l)].data() + p * w + h * D;
          for (std::int64_t i = 0; i < D; ++i) mismatched += kvscore::from_float<kvscore::half>(src[i]).bits != row[i];
        }
        ++rows;
      }
    if (mismatched) {
      std::printf("check (%s): FAILED: %lld of %lld K values differ from fp16(captured key)\n", when,
                  (long long)mismatched, (long long)(rows * w));
      return false;
    }
    if (heads && before) {  // V: each head's slice from its own token's cell before the eviction
      std::vector<std::int64_t> cell_before(std::size_t(keys->n_tokens), -1);
      for (std::uint32_t c = 0; c < before->cells; ++c)
        if (before->pos[c] < keys->n_tokens) cell_before[std::size_t(before->pos[c])] = c;
      for (std::int64_t l = 0; l < keys->n_layer; ++l) {
        for (const StateBytes* x : {&s, before})
          if (x->v_row[std::size_t(l)] != (x->v_trans ? 2u : std::uint64_t(w) * 2)) {
            std::printf("check (%s): FAILED: layer %lld's V cache is not f16\n", when, (long long)l);
            return false;
          }
        for (std::size_t c = 0; c < s.pos.size(); ++c)
          for (std::int64_t h = 0; h < keys->kv_heads; ++h) {
            const std::int64_t p = (*heads)[std::size_t(l)].head(h)[c];
            for (std::int64_t j = h * D; j < (h + 1) * D; ++j)
              mismatched += v_half(s, std::size_t(l), c, std::uint64_t(j)) !=
                            v_half(*before, std::size_t(l), std::uint64_t(cell_before[std::size_t(p)]), std::uint64_t(j));
          }
      }
      if (mismatched) {
        std::printf("check (%s): FAILED: %lld V values are not their head's token's\n", when, (long long)mismatched);
        return false;
      }
    }
  }
  std::printf("check (%s): the cache holds exactly the %zu expected positions", when, expect.size());
  if (keys) std::printf("; their K rows in all %lld layers equal the captured post-RoPE keys (fp16)", (long long)keys->n_layer);
  if (heads)
    std::printf(", each KV head's its own kept tokens' (%lld head slices hold another position's key)%s", (long long)moved,
                before ? ", and so do their V rows" : "");
  std::printf("\n");
  return true;
}

int run(const Args& a) {
  quiet_logs(a.verbose);
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(a.model.c_str(), mp);
  if (!model) throw Usage("cannot load model '" + a.model + "'");
  const llama_vocab* vocab = llama_model_get_vocab(model);
  const std::vector<llama_token> prompt =
      tokenize(vocab, a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file), a.max_tokens, a.special);
  const auto N = std::int64_t(prompt.size());
  std::vector<std::vector<llama_token>> questions;
  for (const std::string& f : a.questions) {
    const std::string q = read_file(f);
    questions.push_back(a.special ? tokenize_plain(vocab, q) : tokenize(vocab, q, 0));
    if (!a.special && !questions.back().empty() && llama_vocab_get_add_bos(vocab))
      questions.back().erase(questions.back().begin());  // no BOS inside the sequence
    if (questions.back().empty()) throw Usage("--question-file " + f + " holds no token");
  }
  const std::int64_t L = llama_model_n_layer(model), Hq = llama_model_n_head(model),
                     Hkv = llama_model_n_head_kv(model), D = llama_model_n_embd(model) / Hq;

  // The scorer (query scorers get the last `window` prompt queries of each layer, so one per layer;
  // kvzip the queries of its reconstruction passes, kvzip.hpp).
  const kvscore::MethodInfo& info = kvscore::method_info(a.method);  // checked in parse()
  const bool kvzip = info.name == kvscore::KVzip::name;
  const bool needs_queries = !kvzip && (info.kind == kvscore::MethodKind::query_scorer || info.name == "qfilter");
  const std::int64_t window = needs_queries ? std::min(a.window, N) : 0;
  const std::int64_t budget = kvscore::budget_from_ratio(N, a.keep);
  kvscore::JointOptions jo;
  jo.sinks = a.sinks;
  jo.recent = a.recent;
  jo.num_threads = a.threads;
  if (!a.aggregate.empty()) jo.aggregate = kvscore::parse_joint_aggregate(a.aggregate);
  if (info.kind == kvscore::MethodKind::query_scorer) jo.recent = std::max(jo.recent, window);  // the window stays
  const std::int64_t protect = std::min(N, std::min(jo.sinks, N) + std::min(jo.recent, N));
  if (budget < protect)
    throw Usage("--keep " + num(a.keep) + " keeps " + std::to_string(budget) + " of " + std::to_string(N) +
                " tokens, fewer than the " + std::to_string(protect) + " protected by --sinks " +
                std::to_string(jo.sinks) + " and --recent " + std::to_string(jo.recent));
  KVzipOptions zo;
  std::int64_t extra = 0;  // the longest batch after the prompt: a KVzip pass or a question
  for (const auto& q : questions) extra = std::max(extra, std::int64_t(q.size()));
  if (kvzip) {
    zo.chunk = a.chunk;
    zo.prefix = a.kvzip_prefix >= 0 ? a.kvzip_prefix : (llama_vocab_get_add_bos(vocab) ? 1 : 0);
    zo.suffix = a.kvzip_suffix;
    zo.sinks = a.sinks;
    zo.threads = a.threads;
    zo.dump = a.dump;
    for (const KVzipPass& p : kvzip_passes(vocab, prompt, zo)) extra = std::max(extra, std::int64_t(p.tokens.size()));
    const std::int64_t limit = llama_model_n_ctx_train(model);
    if (N + extra > limit)
      throw Usage("kvzip: the prompt of " + std::to_string(N) + " tokens and a reconstruction pass of " +
                  std::to_string(extra) + " leave no room in the model's " + std::to_string(limit) +
                  " positions (a smaller --chunk)");
  }

  std::printf("prompt: %lld tokens; model: %lld layers, %lld KV heads, head_dim %lld; method %s, keep %lld of %lld, "
              "sinks %lld, recent %lld, aggregate %s, alloc %s, %d threads\n",
              (long long)N, (long long)L, (long long)Hkv, (long long)D, std::string(info.name).c_str(),
              (long long)budget, (long long)N, (long long)jo.sinks, (long long)jo.recent,
              std::string(kvscore::joint_aggregate_name(jo.aggregate)).c_str(), a.alloc.c_str(), a.threads);

  int rc = 0;
  std::vector<llama_token> plain;
  double plain_prefill = 0;
  if (a.compare_plain) {  // plain llama.cpp: no callback, no eviction
    llama_context* ctx = make_context(model, a, N, nullptr, extra);
    auto t0 = Clock::now();
    std::vector<llama_token> p = prompt;
    if (llama_decode(ctx, llama_batch_get_one(p.data(), std::int32_t(N))) != 0)
      throw std::runtime_error("llama_decode failed on the prompt");
    plain_prefill = ms_since(t0);
    plain = generate(ctx, vocab, a.n_predict, argmax(ctx, vocab));
    llama_free(ctx);
  }

  Capture cap;
  SparseDecode sp;
  Hooks hooks{&cap, a.attend_set ? &sp : nullptr};
  if (hooks.sparse) {
    sp.attend = a.attend;
    sp.dense_below = a.dense_below;
    sp.check = a.check_attend;
    sp.opt.score = kvscore::parse_block_score(a.block_score);
    sp.opt.sinks = a.sinks;
    sp.opt.local = a.local;
    sp.opt.num_threads = a.threads;
    sp.start(L, Hq, Hkv, D);
  }
  llama_context* ctx = make_context(model, a, N, &hooks, extra);
  const bool loading = !a.load_session.empty();
  auto t0 = Clock::now();
  if (loading) {
    load_prompt(ctx, a.load_session, prompt);
    if (hooks.sparse) {
      sp.preloaded.resize(std::size_t(N - 1));  // a fresh context's load fills cells 0.. in order
      std::iota(sp.preloaded.begin(), sp.preloaded.end(), std::int32_t(0));
      sp.dense_next = 1;     // the prompt's last token attends densely, as in the prompt batch
    }
    llama_token last = prompt.back();  // decoded again: the logits
    if (llama_decode(ctx, llama_batch_get_one(&last, 1)) != 0)
      throw std::runtime_error("llama_decode failed on the prompt's last token");
    hooks.rethrow();
  } else {
    cap.start(L, Hkv, Hq, D, N, window);
    std::vector<llama_token> p = prompt;
    if (llama_decode(ctx, llama_batch_get_one(p.data(), std::int32_t(N))) != 0)
      throw std::runtime_error("llama_decode failed on the prompt");
    hooks.rethrow();
  }
  const double t_prefill = ms_since(t0);
  cap.active = false;
  if (!loading && !cap.complete())
    throw std::runtime_error("the cb_eval capture is incomplete (" +
                             (cap.error.empty() ? std::string("a layer's Kcur ROPE tensor was not seen") : cap.error) +
                             ")");
  const llama_token first = argmax(ctx, vocab);  // the continuation's first token, before any other decode

  // One scorer per layer (query scorers hold that layer's last `window` prompt queries). Building
  // one is separate from scoring: for qfilter it is the calibration (an SVD per query head), which
  // a deployment does once per model, offline; it is timed on its own.
  std::vector<kvscore::Scores> scores;
  double t_setup = 0, t_score = 0;
  KVzipRun zr;
  Capture context;  // kvzip: the prompt's keys, while its passes reuse `cap`
  if (loading) {  // --keep 1: nothing to score
  } else if (kvzip) {
    context = std::move(cap);
    cap = Capture();
    zr = kvzip_score(ctx, vocab, prompt, context, cap, zo);
    scores = std::move(zr.scores);
    t_score = zr.score_ms;
  } else {
    t0 = Clock::now();
    std::vector<kvscore::AnyScorer> scorers;
    scorers.reserve(std::size_t(L));
    for (std::int64_t l = 0; l < L; ++l) {
      kvscore::ScorerArgs sa;
      sa.threads = a.threads;
      sa.kv_heads = Hkv;
      if (window > 0) {
        sa.queries = cap.queries[std::size_t(l)].data();
        sa.q_heads = Hq;
        sa.n_queries = window;
        sa.head_dim = D;
      }
      scorers.push_back(kvscore::make_scorer(info.name, sa));
    }
    t_setup = ms_since(t0);

    // Score every layer: keys [tokens][kv_heads][head_dim] fp32, read in place.
    t0 = Clock::now();
    scores.reserve(std::size_t(L));
    for (std::int64_t l = 0; l < L; ++l)
      scores.push_back(scorers[std::size_t(l)].score(
          kvscore::KeysView<float>::token_major(cap.keys[std::size_t(l)].data(), N, Hkv, D)));
    t_score = ms_since(t0);
  }
  t0 = Clock::now();
  std::vector<std::int64_t> kept;
  if (loading) {  // every position
    kept.resize(std::size_t(N));
    std::iota(kept.begin(), kept.end(), std::int64_t(0));
  } else {
    kept = kvscore::select_joint(scores, budget, jo);
  }
  std::vector<kvscore::Selection> heads;  // --alloc per_head: each layer's KV heads' own tokens
  if (a.alloc == "per_head") {
    kvscore::SelectOptions so;
    so.sinks = jo.sinks;
    so.recent = jo.recent;
    so.num_threads = a.threads;
    for (const kvscore::Scores& sc : scores) heads.push_back(kvscore::select(sc, kvscore::Budget::per_head(budget), so));
  }
  const double t_select = ms_since(t0);
  if (!a.dump.empty()) {
    kvscore::npy::save<std::int64_t>(a.dump + "/kept.npy", {std::int64_t(kept.size())}, kept.data());
    const std::vector<std::int64_t> o{budget, jo.sinks, jo.recent, std::int64_t(jo.aggregate)};
    kvscore::npy::save<std::int64_t>(a.dump + "/options.npy", {4}, o.data());
  }
  t0 = Clock::now();
  llama_memory_t mem = llama_get_memory(ctx);
  StateBytes full;  // --alloc per_head: every token's K and V, before the eviction
  if (!heads.empty()) full = state_of(ctx);
  const std::vector<kvscore::PositionRange> evict = kvscore::evicted_ranges(kept, N);
  for (const kvscore::PositionRange& r : evict)
    if (!llama_memory_seq_rm(mem, 0, llama_pos(r.begin), llama_pos(r.end)))
      throw std::runtime_error("llama_memory_seq_rm refused [" + std::to_string(r.begin) + ", " +
                               std::to_string(r.end) + ")");
  if (!heads.empty()) {
    give_heads_their_tokens(ctx, full, heads);
  }
  const double t_evict = ms_since(t0);
  if (a.repack && !evict.empty()) {
    t0 = Clock::now();
    const std::vector<std::int32_t> pos = repack_cells(ctx);
    if (pos.size() != kept.size() || !std::equal(pos.begin(), pos.end(), kept.begin()))
      throw std::runtime_error("--repack: the packed cells do not hold the kept positions in order");
    if (hooks.sparse) sp.repacked(pos);
    std::printf("repacked: the %zu kept cells at the cache's front in %.1f ms\n", pos.size(), ms_since(t0));
  }

  if (a.check && !check_cache(ctx, kept, kvzip ? &context : &cap, "after eviction", heads.empty() ? nullptr : &heads,
                              heads.empty() ? nullptr : &full))
    rc = 1;
  if (!a.save_session.empty()) {
    if (llama_state_seq_save_file(ctx, a.save_session.c_str(), 0, prompt.data(), prompt.size()) == 0)
      throw std::runtime_error("llama_state_seq_save_file failed for " + a.save_session);
    // Read back into this context too: a load packs the kept cells at the cache's front, and
    // attention sums over cells in cell order, so the writer answers from the layout every reader
    // of the file gets (from the scattered cells a near-tie can flip a token: docs/methods/kvzip.md).
    std::vector<llama_token> back(prompt.size() + 1);
    std::size_t n_back = 0;
    llama_memory_seq_rm(mem, 0, -1, -1);
    if (llama_state_seq_load_file(ctx, a.save_session.c_str(), 0, back.data(), back.size(), &n_back) == 0)
      throw std::runtime_error("llama_state_seq_load_file failed for " + a.save_session);
  }

  t0 = Clock::now();
  const std::vector<std::vector<llama_token>> answers = answer_all(ctx, vocab, questions, N, a.n_predict, &hooks);
  const double t_answer = ms_since(t0);
  for (std::size_t i = 0; i < answers.size(); ++i) {
    std::printf("answer %zu:", i);
    for (llama_token t : answers[i]) std::printf(" %d", t);
    std::printf(" | %s\n", text_of(vocab, answers[i]).c_str());
  }

  t0 = Clock::now();
  const std::vector<llama_token> out = generate(ctx, vocab, a.n_predict, first, &hooks);
  const double t_decode = ms_since(t0);
  if (hooks.sparse) {
    std::printf("sparse decode: attend %s, score %s, sinks %lld, local %lld, dense below %lld: %lld of %lld decode "
                "ubatches sparse, %lld layer choices attending %.1f %% of the visible cells (%.1f of %.1f per layer), "
                "selection %.2f ms in all (%.3f ms per sparse step); K cache %s\n",
                num(a.attend).c_str(), a.block_score.c_str(), (long long)a.sinks, (long long)a.local,
                (long long)a.dense_below, (long long)sp.sparse_steps, (long long)sp.decode_steps, (long long)sp.layer_calls,
                sp.visible ? 100.0 * double(sp.attended) / double(sp.visible) : 100.0,
                sp.layer_calls ? double(sp.attended) / double(sp.layer_calls) : 0.0,
                sp.layer_calls ? double(sp.visible) / double(sp.layer_calls) : 0.0, sp.select_ms,
                sp.sparse_steps ? sp.select_ms / double(sp.sparse_steps) : 0.0, sp.k_type.empty() ? "-" : sp.k_type.c_str());
    if (a.check_attend) {
      const bool ok = sp.checked > 0 && sp.check_mismatch == 0;
      std::printf("attend check: %lld layer choices read back from the mask after their attention: %s\n",
                  (long long)sp.checked,
                  ok ? "every one equals kvscore::cell_block_reference on the captured query and the cache keys"
                     : sp.checked == 0 ? "FAILED: none was sparse" : "FAILED: some differ");
      if (!ok) rc = 1;
    }
  }

  if (a.check) {  // the generated tokens were appended after the kept ones (the last is not decoded)
    std::vector<std::int64_t> expect = kept;
    for (std::int64_t i = 0; i + 1 < std::int64_t(out.size()); ++i) expect.push_back(N + i);
    if (!check_cache(ctx, expect, nullptr, "after generation")) rc = 1;
  }

  if (a.check_session) {  // a fresh context from the state file answers the same
    llama_context* fresh = make_context(model, a, N, nullptr, extra);
    std::vector<llama_token> saved(prompt.size() + 1);
    std::size_t n_saved = 0;
    if (llama_state_seq_load_file(fresh, a.save_session.c_str(), 0, saved.data(), saved.size(), &n_saved) == 0)
      throw std::runtime_error("llama_state_seq_load_file failed for " + a.save_session);
    saved.resize(n_saved);
    const std::vector<std::vector<llama_token>> again = answer_all(fresh, vocab, questions, N, a.n_predict);
    const bool same = again == answers && saved == prompt;
    std::printf("session: %s loaded into a fresh context (%zu prompt tokens, %lld cells): %zu answers %s\n",
                a.save_session.c_str(), n_saved, (long long)(llama_memory_seq_pos_max(llama_get_memory(fresh), 0) + 1),
                again.size(), same ? "identical" : "DIFFER");
    if (!same) {
      rc = 1;
      for (std::size_t i = 0; i < again.size(); ++i) {
        std::printf("session answer %zu:", i);
        for (llama_token t : again[i]) std::printf(" %d", t);
        std::printf(" | %s\n", text_of(vocab, again[i]).c_str());
      }
    }
    llama_free(fresh);
  }

  const double t_kv = t_score + t_select + t_evict;
  std::printf("timing: prefill %.1f ms (%lld tokens), score+select+evict %.2f ms = %.2f %% of prefill "
              "(score %.2f, select %.2f, evict %.2f in %zu seq_rm calls), decode %.1f ms (%zu tokens, %.1f tok/s); "
              "scorer set-up %.2f ms%s\n",
              t_prefill, (long long)N, t_kv, 100.0 * t_kv / t_prefill, t_score, t_select, t_evict, evict.size(),
              t_decode, out.size(), out.size() > 1 ? 1000.0 * double(out.size() - 1) / t_decode : 0.0, t_setup,
              info.name == "qfilter" ? " (Q-Filters calibration on the window queries: offline, once per model, in a deployment)" : "");
  if (kvzip)
    std::printf("kvzip: %lld passes of %lld tokens in all: forward %.1f ms (%.1f %% of prefill), scoring %.2f ms = "
                "%.2f %% of the passes' forward; everything (passes + score + select + evict) %.1f ms = %.1f %% of "
                "prefill\n",
                (long long)zr.passes, (long long)zr.tokens, zr.forward_ms, 100.0 * zr.forward_ms / t_prefill,
                zr.score_ms, 100.0 * zr.score_ms / zr.forward_ms, zr.forward_ms + t_kv,
                100.0 * (zr.forward_ms + t_kv) / t_prefill);
  if (!questions.empty()) std::printf("questions: %zu answered in %.1f ms\n", questions.size(), t_answer);
  std::printf("tokens:");
  for (llama_token t : out) std::printf(" %d", t);
  std::printf("\n");
  if (a.compare_plain) {
    std::size_t same = 0;
    while (same < out.size() && same < plain.size() && out[same] == plain[same]) ++same;
    const bool identical = out == plain;
    std::printf("plain llama.cpp: prefill %.1f ms (this run's prefill with the capture: %+.1f %%); generated tokens "
                "%s (%zu of %zu equal before the first difference)\n",
                plain_prefill, 100.0 * (t_prefill - plain_prefill) / plain_prefill,
                identical ? "identical" : "differ", same, plain.size());
    if (!identical && budget == N && (!a.attend_set || a.attend == 1)) {
      std::printf("FAILED: with every token kept (and attended) the tokens must be plain llama.cpp's\n");
      rc = 1;
    }
  }
  if (a.print_text) {
    std::string text;
    for (llama_token t : out) text += piece(vocab, t);
    std::printf("text: %s\n", text.c_str());
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return rc;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const Usage& e) {
    std::fprintf(stderr, "kvscore_llama: %s (--help lists the options)\n", e.what());
    return 2;
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "kvscore_llama: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvscore_llama: error: %s\n", e.what());
    return 1;
  }
}
