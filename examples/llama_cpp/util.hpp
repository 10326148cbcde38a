// examples/llama_cpp/util.hpp — the small llama.cpp chores both programs share: quiet logging,
// reading and tokenising the prompt, greedy (argmax) decoding, argument parsing helpers.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "llama.h"

namespace kvscore_llama {

/// A bad command line: the programs print the message and exit 2.
struct Usage : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// llama.cpp's log: errors only, unless verbose.
inline void quiet_logs(bool verbose) {
  static bool v = false;
  v = verbose;
  llama_log_set(
      [](ggml_log_level level, const char* text, void*) {
        if (v || level == GGML_LOG_LEVEL_ERROR) std::fputs(text, stderr);
      },
      nullptr);
}

inline std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw Usage("cannot read prompt file '" + path + "'");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

/// The prompt's tokens with BOS (the model's special tokens added), first max_tokens (0: all);
/// `special`: special tokens in the text (a chat template's <|im_start|>, ...) are parsed as such.
inline std::vector<llama_token> tokenize(const llama_vocab* vocab, const std::string& text, std::int64_t max_tokens,
                                         bool special = false) {
  std::vector<llama_token> t(text.size() + 8);
  int n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), t.data(), std::int32_t(t.size()), true, special);
  if (n < 0) {
    t.resize(std::size_t(-n));
    n = llama_tokenize(vocab, text.data(), std::int32_t(text.size()), t.data(), std::int32_t(t.size()), true, special);
  }
  if (n < 0) throw std::runtime_error("llama_tokenize failed");
  t.resize(std::size_t(n));
  if (max_tokens > 0 && std::int64_t(t.size()) > max_tokens) t.resize(std::size_t(max_tokens));
  return t;
}

/// The highest logit of the last output row (lowest token id on ties): greedy decoding.
inline llama_token argmax(llama_context* ctx, const llama_vocab* vocab) {
  const float* logits = llama_get_logits_ith(ctx, -1);
  const int n = llama_vocab_n_tokens(vocab);
  return llama_token(std::max_element(logits, logits + n) - logits);
}

inline std::string piece(const llama_vocab* vocab, llama_token t) {
  char buf[256];
  const int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, false);
  return n > 0 ? std::string(buf, std::size_t(n)) : std::string();
}

inline std::int64_t parse_int(const std::string& flag, const std::string& v) {
  try {
    std::size_t used = 0;
    const long long x = std::stoll(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw Usage(flag + ": '" + v + "' is not an integer");
}

inline double parse_double(const std::string& flag, const std::string& v) {
  try {
    std::size_t used = 0;
    const double x = std::stod(v, &used);
    if (used == v.size()) return x;
  } catch (const std::exception&) {
  }
  throw Usage(flag + ": '" + v + "' is not a number");
}

}  // namespace kvscore_llama
