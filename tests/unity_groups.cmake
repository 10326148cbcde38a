# The test binary's unity groups (KVSCORE_UNITY_TESTS=ON, which scripts/test.sh sets): the files of a
# group compile as one translation unit, so the Eigen, Catch2 and kvscore templates they share are
# instantiated and compiled once (the 39 files at -O1: 398 -> 291 s of CPU). Two files whose
# file-scope names clash (the same helper name in both anonymous namespaces, or overloads that
# become ambiguous) are never in one group. A file in no group compiles alone: a new test file
# needs no entry here; to join one, pick a group it builds in (docs/contributing/testing.md).
# A group's files are included in the target's (alphabetical) order, which matters: a file's
# `using namespace` reaches the files after it. Groups balance the files' compile times;
# test_ojakv_decode.cpp stays alone (its own -O2), test_joint.cpp and test_manifoldkv.cpp clash with most.
# One string per group, its files separated by ":".
set(KVSCORE_TEST_UNITY_GROUPS
  "test_decoding.cpp:test_ojakv.cpp:test_windowed_manifoldkv.cpp"
  "test_contract.cpp:test_eval.cpp:test_keydiff.cpp:test_protokv.cpp"
  "test_golden.cpp:test_paged_amx.cpp:test_qfilter.cpp:test_synth.cpp:test_view.cpp"
  "test_block_sparse.cpp:test_kvzip.cpp:test_npy.cpp:test_snippets.cpp"
  "test_block_sparse_cells.cpp:test_eval_metrics.cpp:test_pariskv.cpp:test_pariskv_layer.cpp:test_slots.cpp"
  "test_block_sparse_planner.cpp:test_dtype.cpp:test_knorm.cpp:test_methods.cpp:test_safetensors.cpp:test_snapkv.cpp"
  "test_compact.cpp:test_robustness.cpp:test_select.cpp:test_simd.cpp:test_tree.cpp"
  "test_ojakv_layer.cpp:test_paged.cpp:test_pariskv_cache.cpp:test_scorer_properties.cpp:test_streaming_llm.cpp"
)
