#!/usr/bin/env python3
"""The Python snippets of README.md, python/README.md (the package's page) and docs/ ("Ten lines"), run as a program: each doc shows exactly a marked region of this file (python/tests/test_examples.py
runs it and compares), so a snippet cannot use a name it does not define."""

# [ten-lines:begin]
import torch, kvscore

keys = torch.randn(1, 8, 4096, 128, dtype=torch.float16)    # one layer of an HF cache, batch 1
values = torch.randn_like(keys)
scores = kvscore.ManifoldL2().score(keys)                  # float32 [8, 4096], higher = keep
keep = kvscore.select(scores, 1024, sinks=4, recent=64)    # int64 [8, 1024], rows ascending
queries = torch.randn(32, 64, 128)                         # the last 64 queries of 32 query heads
snap = kvscore.SnapKV(queries, window=64)                  # GQA by shape: 4 query heads per KV head
keep = kvscore.select(snap.score(keys), 1024, recent=snap.protected_recent)
n = kvscore.compact(keys, values, keep)                    # in place: kept rows first
keys, values = keys[:, :, :n], values[:, :, :n]
# [ten-lines:end]

assert scores.shape == (8, 4096) and scores.dtype == torch.float32
assert keep.shape == (8, 1024) and bool((keep[:, -64:] == torch.arange(4096 - 64, 4096)).all())
assert n == 1024 and keys.shape == values.shape == (1, 8, 1024, 128)


def readme():
    # [readme:begin]
    import torch, kvscore
    keys = torch.randn(1, 8, 4096, 128, dtype=torch.float16)      # one layer of an HF cache, read in place
    values = torch.randn_like(keys)
    keep = kvscore.select(kvscore.ManifoldL2().score(keys), 1024, sinks=4, recent=64)  # int64 [8, 1024]
    n = kvscore.compact(keys, values, keep)                      # in place: keys[:, :, :n] are the kept rows
    from kvscore.presses import KvscorePress                      # kvpress: `with press(model):` ...
    press = KvscorePress(method="manifold_l2", compression_ratio=0.5)
    # [readme:end]
    assert n == 1024 and bool((keep[:, :4] == torch.arange(4)).all()) and press.method == "manifold_l2"


def package():
    # [package:begin]
    import torch, kvscore
    keys = torch.randn(1, 8, 4096, 128, dtype=torch.float16)   # one layer of an HF cache
    values = torch.randn_like(keys)
    keep = kvscore.select(kvscore.KNorm().score(keys), 1024, sinks=4, recent=64)   # int64 [8, 1024]
    n = kvscore.compact(keys, values, keep)                   # in place
    # [package:end]
    assert n == 1024 and tuple(keep.shape) == (8, 1024)


readme()
package()
print("quickstart: ok")
