"""Tensor parallelism (docs/guides/vllm.md): with tensor_parallel_size=2 each rank scores its own KV heads
and sends its joint_partial; the scheduler makes one decision from both. On a random Llama whose
heads split in two, the blocks freed at TP=2 are the blocks freed at TP=1 (the max aggregate
combines exactly; the keys themselves may differ in the last bits between TP=1 and TP=2, which
could flip a near-tie, hence the model's seed is fixed and the check is on whole decisions).
Sparse decode runs in the same engines: each rank chooses its blocks alone from its own heads,
and kvscore.vllm.check verifies every choice of every rank against the reference on that
rank's heads (what TP=1 would choose with those heads alone)."""
from conftest import run_engine
from test_engine import prompts


def test_tp2_decides_once_from_both_ranks_like_tp1(model_dir, tiny_llama):
    ps = prompts(model_dir, [700, 500])
    spec = {"model": tiny_llama, "prompts": ps, "max_tokens": 8, "check": True,
            "plugin": {"method": "keydiff", "ratio": 0.5, "attend": 0.3, "dense_below": 128}}
    one = run_engine(spec)
    # vLLM's automatic binding wants one NUMA node per rank; this machine has one: a core each
    two = run_engine({**spec, "tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}})
    assert len(one["decisions"]) == len(two["decisions"]) == 2
    by = lambda r: {d[0]: (d[1], d[2]) for d in r["decisions"]}  # noqa: E731
    assert by(two) == by(one)
    assert [d[3] for d in one["decisions"]] == [1, 1]     # one partial per rank, joined before the decision
    assert [d[3] for d in two["decisions"]] == [2, 2]
    assert two["freed_total"] == one["freed_total"] > 0
    assert all(len(t) == 8 for t in two["tokens"])
    # sparse decode: both ranks chose in every layer and decode step, each from its own KV head
    for r, ranks, heads in ((one, {0}, 2), (two, {0, 1}, 1)):
        recs = r["check"]
        assert {rec["rank"] for rec in recs} == ranks and {rec["kv_heads"] for rec in recs} == {heads}
        rows = [row for rec in recs for row in rec["rows"]]
        assert rows and all(row["match"] and row["protected_in"] for row in rows)
    # the ranks' step plans agree (the counts depend on the requests only); their choices may differ
    per_rank = [sorted((rec["step"], rec["layer"], row["first"], row["attend"]) for rec in two["check"]
                       if rec["rank"] == k for row in rec["rows"]) for k in (0, 1)]
    assert per_rank[0] == per_rank[1]
