"""Which rows of the uncompressed cache a compressed cache kept (the press tests' shared helper)."""


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
