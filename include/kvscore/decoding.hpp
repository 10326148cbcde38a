// kvscore/decoding.hpp — keep a growing cache at a target size during generation, the decode-time
// policy of kvpress's DecodingPress for any kvscore scorer:
//
// [snippet decoding-header: tests/test_snippets.cpp]
//   kvscore::DecodingCompressor<kvscore::half, kvscore::KNorm> gen(kv_heads, head_dim, kvscore::KNorm{},
//                                                                  {.target = 1024, .interval = 256});
//   gen.append(k, v, 1);                        // per decode step: [kv_heads][1][head_dim] keys and values
//   auto kept = gen.key_view(); auto pos = gen.positions(h);  // the kept cache, each row's original position
//
// The cache holds at most target + interval tokens per head. When an append brings it there, the
// scorer scores every held token, kvscore::select keeps `target` per head (the same selector and
// tie rule as a prefill compression: protected sinks/recent, lower position wins ties, kept rows
// stay in position order) and kvscore::compact moves them to the front. So after a prefill of
// N ≥ target + interval tokens and every `interval` decode steps after that, each head holds
// exactly `target` tokens. kvpress's compression_interval = interval, target_size = target.
// Scorer: anything with `Scores score(const KeysView<T>&) const` (KNorm, KeyDiff, ManifoldL2,
// QFilter, SnapKV bound to its queries, ...). Per-head budgets only (every head keeps `target`).
// Errors: std::invalid_argument naming the value; a rejected append changes nothing.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kvscore/compact.hpp"
#include "kvscore/core/dtype.hpp"
#include "kvscore/select.hpp"
#include "kvscore/core/view.hpp"

namespace kvscore {

/// Options of DecodingCompressor.
struct DecodingOptions {
  std::int64_t target = 1024;  ///< tokens per head kept by a compression (kvpress target_size)
  std::int64_t interval = 256;  ///< tokens appended between compressions (kvpress compression_interval)
  SelectOptions select{};       ///< sinks, recent, threads; alloc must be per_head
};

/// A generating cache of `heads` KV heads kept at `target` tokens per head: append() stores each new token's K and
/// V rows; every `interval` appended tokens the held keys are scored (`Scorer`), `target` per head selected and K/V
/// compacted in place, so the held length stays within target + interval (kvpress's DecodingPress).
template <class T, class Scorer>
class DecodingCompressor {
  static_assert(is_element_type_v<T>, "DecodingCompressor: T must be float, half or bfloat16");

 public:
  /// Empty store for `heads` KV heads of `head_dim` dimensions, scored by `scorer`; std::invalid_argument for a bad
  /// shape or option (sinks + recent > target, an alloc other than per_head).
  DecodingCompressor(std::int64_t heads, std::int64_t head_dim, Scorer scorer, const DecodingOptions& opt = {})
      : scorer_(std::move(scorer)), opt_(opt), h_(heads), d_(head_dim) {
    const std::string who = "kvscore::DecodingCompressor";
    auto need = [&](bool ok, const char* name, std::int64_t v, const char* rule) {
      if (!ok) throw std::invalid_argument(who + ": " + name + " must be " + rule + " (got " + std::to_string(v) + ")");
    };
    need(heads >= 1, "heads", heads, ">= 1");
    need(head_dim >= 1, "head_dim", head_dim, ">= 1");
    need(opt.target >= 1, "target", opt.target, ">= 1");
    need(opt.interval >= 1, "interval", opt.interval, ">= 1");
    need(opt.select.sinks + opt.select.recent <= opt.target, "sinks + recent", opt.select.sinks + opt.select.recent,
         "<= target");
    if (opt.select.alloc != Alloc::per_head)
      throw std::invalid_argument(who + ": select.alloc must be per_head (every head keeps `target` tokens)");
    cap_ = opt.target + opt.interval;
    k_.assign(std::size_t(h_ * cap_ * d_), T{});
    v_.assign(k_.size(), T{});
    pos_.assign(std::size_t(h_ * cap_), 0);
  }

  std::int64_t heads() const noexcept { return h_; }  ///< KV heads held
  std::int64_t head_dim() const noexcept { return d_; }  ///< elements per key and value row
  /// Tokens held per head now (at most target + interval).
  std::int64_t length() const noexcept { return len_; }
  /// Tokens appended so far (the position the next token gets).
  std::int64_t appended() const noexcept { return seen_; }
  std::int64_t compressions() const noexcept { return compressions_; }  ///< compressions run so far
  const DecodingOptions& options() const noexcept { return opt_; }  ///< the options it was built with
  /// The held keys / values: head h, row t at h·(target+interval)·head_dim + t·head_dim.
  KeysView<T> key_view() const { return KeysView<T>(k_.data(), h_, len_, d_, cap_ * d_, d_); }
  /// The held values, as key_view() holds the keys.
  KeysView<T> value_view() const { return KeysView<T>(v_.data(), h_, len_, d_, cap_ * d_, d_); }
  /// Original positions of head h's held rows, ascending.
  std::span<const std::int64_t> positions(std::int64_t h) const {
    if (h < 0 || h >= h_)
      throw std::invalid_argument("kvscore::DecodingCompressor::positions: head " + std::to_string(h) +
                                  " out of range [0, " + std::to_string(h_) + ")");
    return {pos_.data() + h * cap_, std::size_t(len_)};
  }
  /// Bytes held: K and V at capacity plus the positions (fixed after construction).
  std::size_t memory_bytes() const noexcept { return 2 * k_.size() * sizeof(T) + pos_.size() * sizeof(std::int64_t); }

  /// Appends n tokens for every head: keys/values [heads][n][head_dim] (row t of head h at
  /// (h·n + t)·head_dim), compressing whenever the cache reaches target + interval tokens.
  void append(const T* keys, const T* values, std::int64_t n) {
    const std::string who = "kvscore::DecodingCompressor::append";
    if (n < 0) throw std::invalid_argument(who + ": n must be >= 0 (got " + std::to_string(n) + ")");
    if (n == 0) return;
    if (keys == nullptr || values == nullptr) throw std::invalid_argument(who + ": keys or values is null");
    for (std::int64_t i = 0; i < h_ * n * d_; ++i)
      if (!std::isfinite(to_float(keys[i])) || !std::isfinite(to_float(values[i])))
        throw std::invalid_argument(who + ": " + (std::isfinite(to_float(keys[i])) ? "value" : "key") + " of head " +
                                    std::to_string(i / (n * d_)) + ", token " + std::to_string(seen_ + (i / d_) % n) +
                                    " has a non-finite element " + std::to_string(i % d_));
    for (std::int64_t done = 0; done < n;) {
      const std::int64_t m = std::min(n - done, cap_ - len_);
      for (std::int64_t h = 0; h < h_; ++h) {
        std::copy(keys + (h * n + done) * d_, keys + (h * n + done + m) * d_, k_.begin() + (h * cap_ + len_) * d_);
        std::copy(values + (h * n + done) * d_, values + (h * n + done + m) * d_, v_.begin() + (h * cap_ + len_) * d_);
        for (std::int64_t t = 0; t < m; ++t) pos_[std::size_t(h * cap_ + len_ + t)] = seen_ + t;
      }
      len_ += m;
      seen_ += m;
      done += m;
      if (len_ == cap_) compress();
    }
  }

 private:
  void compress() {
    const Scores s = scorer_.score(key_view());
    const Selection sel = select(s, Budget::per_head(opt_.target), opt_.select);
    const MutKeysView<T> kv(k_.data(), h_, len_, d_, cap_ * d_, d_), vv(v_.data(), h_, len_, d_, cap_ * d_, d_);
    compact(kv, vv, sel);
    for (std::int64_t h = 0; h < h_; ++h) {  // the kept positions, ascending like the rows
      const auto keep = sel.head(h);
      for (std::size_t i = 0; i < keep.size(); ++i)
        pos_[std::size_t(h * cap_) + i] = pos_[std::size_t(h * cap_ + keep[i])];
    }
    len_ = opt_.target;
    ++compressions_;
  }

  Scorer scorer_;
  DecodingOptions opt_;
  std::int64_t h_ = 0, d_ = 0, cap_ = 0, len_ = 0, seen_ = 0, compressions_ = 0;
  std::vector<T> k_, v_;
  std::vector<std::int64_t> pos_;
};

}  // namespace kvscore
