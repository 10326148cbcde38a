"""What the press tests share: which rows of the uncompressed cache a compressed cache kept, and the
kvscore presses paired with kvpress's own."""


def kept_positions(full_keys, kept_keys, ordered=False):
    """Positions of the kept key rows in the uncompressed cache, per head: sorted, or in the kept
    cache's own order with ordered=True. Rows are identified by their fp32 bytes."""
    out = []
    for h in range(full_keys.shape[1]):
        rows = {full_keys[0, h, t].float().numpy().tobytes(): t for t in range(full_keys.shape[2])}
        assert len(rows) == full_keys.shape[2], "rows must be distinct to identify them"
        pos = [rows[kept_keys[0, h, i].float().numpy().tobytes()] for i in range(kept_keys.shape[2])]
        out.append(pos if ordered else sorted(pos))
    return out


def kvpress_pairs(kvpress, window):
    """(kvscore method, its press options, kvpress's press for a ratio) for the methods both have."""
    return [
        ("knorm", {}, lambda r: kvpress.KnormPress(compression_ratio=r)),
        ("keydiff", {}, lambda r: kvpress.KeyDiffPress(compression_ratio=r)),
        ("snapkv", {"window": window}, lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=window)),
        ("streaming_llm", {"sinks": 4}, lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4)),
    ]
