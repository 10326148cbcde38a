"""kvscore.vllm.Config and kv_transfer_config: every bad setting is a ValueError naming it (the same
checks the connector runs at engine start), budgets in whole blocks, the registry's methods."""
import pytest

import kvscore
from kvscore.vllm import METHODS, Config, kv_transfer_config


def test_methods_are_the_registrys_query_agnostic_scorers_without_per_layer_data_and_snapkv():
    want = [m["name"] for m in kvscore.REGISTRY
            if (m["kind"] == "scorer" and "filters" not in m["options"]) or m["cls"] == "SnapKV"]
    assert list(METHODS) == want and len(want) >= 4
    assert Config("snapkv", 0.5).query_window == Config("snapkv", 0.5).recent > 0
    assert Config("keydiff", 0.5).query_window == 0


@pytest.mark.parametrize("settings,match", [
    ({"method": "no_such_method", "ratio": 0.5}, "unknown method 'no_such_method'"),
    ({"method": "protokv", "ratio": 0.5}, "method 'protokv' is not one the vLLM plugin runs"),
    ({"method": "qfilter", "ratio": 0.5}, "method 'qfilter' is not one the vLLM plugin runs"),
    ({"method": "snapkv", "ratio": 0.5, "recent": 0}, "recent 0 must be >= 1"),
    ({"method": "keydiff", "ratio": 1.0}, r"ratio 1.0 must be a number in \[0, 1\)"),
    ({"method": "keydiff", "ratio": -0.1}, r"ratio -0.1 must be"),
    ({"method": "keydiff", "ratio": 0.5, "sinks": -1}, "sinks -1 must be an integer >= 0"),
    ({"method": "keydiff", "ratio": 0.5, "aggregate": "vote"}, "aggregate 'vote' must be 'max' or 'mean'"),
    ({"method": "keydiff", "ratio": 0.5, "block_aggregate": "sum"}, "block_aggregate 'sum'"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0}, r"attend 0 must be a fraction in \(0, 1\] or a whole count"),
    ({"method": "knorm", "ratio": 0.0, "attend": -0.1}, "attend -0.1 must be"),
    ({"method": "knorm", "ratio": 0.0, "attend": 1.5}, "attend 1.5 must be"),
    ({"method": "knorm", "ratio": 0.0, "attend": float("nan")}, "attend nan must be"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "block_score": "minmax"}, "block_score 'minmax' must be one of"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "local": -1}, "local -1 must be an integer >= 0"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "dense_below": 1.5}, "dense_below 1.5 must be an integer"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "query_group": "max"}, "query_group 'max' must be"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "prefilter": -1}, "prefilter -1 must be an integer >= 0"),
    ({"method": "knorm", "ratio": 0.0, "attend": 0.1, "refresh": 0}, "refresh 0 must be an integer >= 1"),
    ({"method": "knorm", "ratio": 0.5, "swap_space": -1}, "swap_space -1 must be a number of GiB >= 0"),
])
def test_bad_settings(settings, match):
    with pytest.raises(ValueError, match=match):
        Config(**settings)


def test_extra_config_needs_method_and_ratio_and_knows_its_keys():
    with pytest.raises(ValueError, match="needs 'ratio'"):
        Config.from_extra({"method": "knorm"})
    with pytest.raises(ValueError, match=r"unknown setting\(s\) \['ration'\]"):
        Config.from_extra({"method": "knorm", "ratio": 0.5, "ration": 1})
    c = kv_transfer_config("knorm", 0.5)
    assert c["kv_connector"] == "KvscoreConnector" and c["kv_connector_extra_config"]["method"] == "knorm"


def test_sparse_decode_settings():
    assert not Config("knorm", 0.5).sparse and Config("knorm", 0.5).evicts
    c = Config("knorm", 0.0, attend=0.1)
    assert c.sparse and not c.evicts                  # sparse decode alone: no eviction pass
    assert Config("knorm", 0.5, attend=0.1).evicts     # both
    assert Config("knorm", 0.0, attend=2048).attend == 2048 and Config("knorm", 0.0, attend=2048.0).sparse
    assert Config("knorm", 0.0, attend=1).attend == 1.0 and not Config("knorm", 0.0, attend=1).sparse
    d = kv_transfer_config("knorm", 0.0, attend=0.1)["kv_connector_extra_config"]
    assert d["attend"] == 0.1 and d["block_score"] == "int4" and Config.from_extra(d).as_dict() == d


def test_budget_in_whole_blocks_never_below_the_protected_ones():
    c = Config("keydiff", 0.5, sinks=4, recent=64)
    assert c.budget(2048, 32) == 32                 # 64 blocks, 32 evicted
    assert c.budget(2047, 32) == 32                 # 64 blocks (the last partial), floor(32) evicted
    assert c.budget(40, 32) == 2                    # 2 blocks, both protected: left whole
    assert Config("keydiff", 0.0).budget(1000, 32) == 32
    assert Config("keydiff", 0.9, sinks=1, recent=0).budget(3200, 32) == 10


def test_the_general_plugins_entry_point_registers_the_connector_name():
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvscore"]
    assert [e.value for e in eps] == ["kvscore.vllm:register"]
    eps[0].load()()
    eps[0].load()()  # loaded in every vLLM process, possibly twice: no error
    from kvscore.vllm.connector import KvscoreConnector
    assert KVConnectorFactory.get_connector_class_by_name("KvscoreConnector") is KvscoreConnector


def test_threads_0_is_the_workers_torch_thread_count_never_openmps_default():
    # OpenMP's default asked from vLLM's forward was 1 (the selection ran on one thread): the
    # connector passes an explicit count to every C++ call
    import types

    import torch
    from kvscore.vllm.worker import KvscoreWorker

    def threads(n):
        return KvscoreWorker._threads(types.SimpleNamespace(cfg=Config("knorm", 0.0, threads=n)))

    assert threads(0) == max(1, torch.get_num_threads()) >= 1
    assert threads(3) == 3


def test_a_shape_folder_has_the_published_config_and_smollm2s_tokenizer_with_its_chat_template(model_dir, tmp_path):
    # kvscore.vllm.bench --shape: the prompts go through the copied tokenizer's chat template
    import json

    from transformers import AutoTokenizer

    from kvscore.vllm import shapes

    out = shapes.model_dir("llama-3.2-1b", str(tmp_path / "s"), model_dir)
    cfg = json.load(open(tmp_path / "s" / "config.json"))
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]) == (16, 8, 64, 2048)
    msgs = [{"role": "user", "content": "hi"}]
    want = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(msgs, tokenize=False)
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(msgs, tokenize=False) == want


def test_bench_rejects_max_num_batched_tokens_0_with_exit_2_naming_it(capsys):
    from kvscore.vllm import bench

    with pytest.raises(SystemExit) as e:
        bench.main(["--model", "m", "--workload", "decode", "--max-num-batched-tokens", "0"])
    assert e.value.code == 2
    assert "--max-num-batched-tokens 0: must be at least 1" in capsys.readouterr().err
