// kvscore/block_sparse.hpp — block-sparse decode attention over a paged KV cache: at every
// decode step each sequence attends its sink blocks, its newest blocks and the blocks whose keys
// score highest for this step's query; the rest of its blocks stay in the cache, unread this
// step (docs/reference/block_sparse.md). The engine's own paged attention kernel runs unchanged on a
// shorter block table (vLLM: kvscore.vllm's `attend`).
//
// [snippet block-sparse: tests/test_snippets.cpp]
//   kvscore::BlockSparseOptions opt;                 // int4 codes, 4 sinks, 64 local tokens
//   kvscore::PagedBlockSelector sel(layers, num_blocks, kv_heads, head_dim, block_size, opt);
//   sel.begin_step(written_slots, first_blocks);     // once per step: the slots written since
//   sel.select(layer, keys, q_heads, rows);          // per layer: every rows[i].out is filled
//
// The umbrella of the block_sparse/ room (each file says what it holds):
//   options.hpp        BlockScore, QueryGroup, BlockSparseOptions and the defaults, attended_blocks,
//                      BlockSparseRow
//   keys.hpp           block key sources: where the scorers read a (KV head, block) key tile
//   summary_store.hpp  the summaries per (layer, block, KV head), remade after a write
//   score_quest.hpp, score_meanstd.hpp, score_int4.hpp, score_pariskv.hpp, score_exact.hpp
//                      one scorer per score (scorer.hpp: what a scorer is; scorers.hpp: the five
//                      as one value)
//   choice.hpp         scores -> the top k; chooser.hpp: one row's choice (kept or scored)
//   refresh.hpp        RefreshPolicy: when a kept choice stands, and its triggers
//   probe.hpp          the probe, a decorator of the chooser (recall of the exact choice)
//   selector.hpp       PagedBlockSelector
//   reference.hpp      block_sparse_reference, the stateless choice
//   planner.hpp        BlockSparsePlanner: a step's rows planned once, each layer's call then
//                      passes its query (what an engine drives; kvscore.vllm's binding is one)
//   cells.hpp          CellBlockSelector and cell_block_reference: the same scorers over a
//                      token-major cell cache (llama.cpp's K: f32, f16, q8_0; blocks of 32 cells)
//
// One block table row serves every KV head (vLLM's kernels), so a block is chosen per sequence
// and layer: each query head turns its block scores into a softmax over the candidate blocks
// (scores × the attention's scale: its estimated share of attention per block), and a block's
// score is the sum of those shares over the layer's query heads — a block that one sharp head
// needs outranks one that a flat head slightly prefers. The blocks chosen: the sinks' and the
// local window's (the last block always), then the best of the rest (ties: the lower logical
// block), written in ascending logical order. The count depends only on the sequence's length
// (attended_blocks), never on the layer, so every layer of a step has the same sequence lengths
// (one attention schedule per step).
#pragma once

#include "kvscore/block_sparse/cells.hpp"
#include "kvscore/block_sparse/keys.hpp"
#include "kvscore/block_sparse/options.hpp"
#include "kvscore/block_sparse/planner.hpp"
#include "kvscore/block_sparse/reference.hpp"
#include "kvscore/block_sparse/refresh.hpp"
#include "kvscore/block_sparse/scorers.hpp"
#include "kvscore/block_sparse/selector.hpp"
