"""kvscore.select_joint (docs/reference/joint.md) against a numpy reference, its input forms and its errors."""

import numpy as np
import pytest

import kvscore

torch = pytest.importorskip("torch")

RNG = np.random.default_rng(34)


def znorm(rows):
    """Row z-scores as documented: float32((float64(x) - mean) * (1 / std)), population std, std 0 -> 0."""
    x = rows.astype(np.float64)
    mu = x.mean(axis=1, keepdims=True)
    sd = x.std(axis=1, keepdims=True)
    inv = np.where(sd > 0, 1.0 / np.where(sd > 0, sd, 1.0), 0.0)
    return ((x - mu) * inv).astype(np.float32)


def reference(rows, budget, sinks, recent, aggregate):
    """Kept positions: protected first, then the unprotected ranked by the aggregate (higher first,
    lower position on ties; vote: votes, then the mean, then position) -- a full numpy sort."""
    R, n = rows.shape
    z = znorm(rows)
    s0 = min(sinks, n)
    e0 = max(s0, n - min(recent, n))
    prot = np.zeros(n, bool)
    prot[:s0] = True
    prot[e0:] = True
    m = budget - prot.sum()
    mean = (z.astype(np.float64).sum(axis=0) / R).astype(np.float32)
    cand = np.flatnonzero(~prot)
    if aggregate == "max":
        key = (cand, -z.max(axis=0)[cand])
    elif aggregate == "mean":
        key = (cand, -mean[cand])
    else:
        votes = np.zeros(n, np.int64)
        for r in rows:  # every row's own top-m among the unprotected (lower position on ties)
            order = np.lexsort((cand, -r[cand]))
            votes[cand[order[:m]]] += 1
        key = (cand, -mean[cand], -votes[cand])
    top = cand[np.lexsort(key)[:m]]
    return np.sort(np.concatenate([np.flatnonzero(prot), top]))


@pytest.mark.parametrize("aggregate", ["max", "mean", "vote"])
@pytest.mark.parametrize("sinks,recent", [(0, 0), (4, 16)])
def test_select_joint_equals_numpy_reference(aggregate, sinks, recent):
    # integer scores over 256 tokens: every z-score is exact in both computations, and ties are many
    layers = RNG.integers(0, 6, size=(5, 3, 256)).astype(np.float32)
    got = kvscore.select_joint(layers, 100, sinks=sinks, recent=recent, aggregate=aggregate)
    assert got.dtype == np.int64 and got.shape == (100,)
    np.testing.assert_array_equal(got, reference(layers.reshape(15, 256), 100, sinks, recent, aggregate))


def test_select_joint_gaussian_keeps_the_top_of_the_aggregate():
    layers = (RNG.standard_normal((4, 3, 1000)) * np.arange(1, 5)[:, None, None]).astype(np.float32)
    for aggregate in ("max", "mean"):
        got = kvscore.select_joint(layers, 300, sinks=4, recent=32, aggregate=aggregate)
        z = znorm(layers.reshape(12, 1000))
        J = z.max(axis=0) if aggregate == "max" else z.mean(axis=0)
        free = np.ones(1000, bool)
        free[:4] = free[-32:] = False
        kept = np.zeros(1000, bool)
        kept[got] = True
        assert kept[~free].all() and kept.sum() == 300
        assert J[kept & free].min() >= J[~kept & free].max() - 1e-6


def test_select_joint_hand_worked_aggregates_differ():
    # two layers of one head (numpy): z = [0.815, -1.408, 0.593] and [-0.926, 1.389, -0.463]
    two = [np.array([[1, 0, 0.9]], np.float32), np.array([[0, 1, 0.2]], np.float32)]
    assert kvscore.select_joint(two, 1, aggregate="max").tolist() == [1]
    assert kvscore.select_joint(two, 1, aggregate="mean").tolist() == [2]
    assert kvscore.select_joint(two, 1, aggregate="vote").tolist() == [1]  # 1-1 vote, the mean decides
    assert kvscore.select_joint(two, 1).tolist() == [1]  # the default is max


def test_select_joint_input_forms_agree_and_torch_comes_back():
    layers = RNG.standard_normal((6, 3, 200)).astype(np.float32)
    a = kvscore.select_joint(layers, 50, sinks=2, recent=8)
    b = kvscore.select_joint(list(layers), 50, sinks=2, recent=8)
    c = kvscore.select_joint(layers.reshape(18, 200), 50, sinks=2, recent=8)
    t = kvscore.select_joint(torch.from_numpy(layers), 50, sinks=2, recent=8)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64
    np.testing.assert_array_equal(a, t.numpy())
    # layers with different head counts, and a strided (non-contiguous rows) view
    mixed = [layers[0], layers[1, :2]]
    np.testing.assert_array_equal(kvscore.select_joint(mixed, 20),
                                  kvscore.select_joint(np.concatenate(mixed), 20))
    wide = np.zeros((3, 400), np.float32)
    wide[:, :200] = layers[0]
    np.testing.assert_array_equal(kvscore.select_joint(layers[0], 20), kvscore.select_joint(wide[:, :200], 20))
    # thread count does not change the answer
    np.testing.assert_array_equal(a, kvscore.select_joint(layers, 50, sinks=2, recent=8, threads=1))
    np.testing.assert_array_equal(kvscore.select_joint(layers, 50, aggregate="vote", threads=1),
                                  kvscore.select_joint(layers, 50, aggregate="vote", threads=2))


def test_select_joint_errors():
    s = RNG.standard_normal((2, 10)).astype(np.float32)
    with pytest.raises(ValueError, match="'median' must be 'max', 'mean' or 'vote'"):
        kvscore.select_joint(s, 2, aggregate="median")
    with pytest.raises(ValueError, match="budget of 11 tokens exceeds the 10 tokens"):
        kvscore.select_joint(s, 11)
    with pytest.raises(ValueError, match="protect 3 tokens"):
        kvscore.select_joint(s, 2, sinks=1, recent=2)
    with pytest.raises(ValueError, match="layer 1 has 9 tokens, layer 0 has 10"):
        kvscore.select_joint([s, s[:, :9]], 2)
    with pytest.raises(ValueError, match="float32"):
        kvscore.select_joint(s.astype(np.float64), 2)
    with pytest.raises(ValueError, match="got 1 dimensions"):
        kvscore.select_joint(s[0], 2)
    with pytest.raises(ValueError, match="no layers"):
        kvscore.select_joint([], 0)
    with pytest.raises(ValueError, match="numpy array or a torch tensor"):
        kvscore.select_joint("scores", 2)
    with pytest.raises(ValueError, match="stride"):
        kvscore.select_joint(np.asfortranarray(RNG.standard_normal((3, 10)).astype(np.float32)), 2)


def block_reference(rows, bs, budget, sinks, recent, aggregate, block_aggregate):
    """Kept blocks: the joint row (max or mean of the z-scores), each block's mean or max, the blocks
    holding a protected position or a partial last block first, then the others by score (higher
    first, lower block on ties) -- numpy."""
    z = znorm(rows).astype(np.float64)
    J = z.max(axis=0) if aggregate == "max" else z.mean(axis=0)
    n = rows.shape[1]
    nb = -(-n // bs)
    B = np.array([(J[b * bs:(b + 1) * bs].mean() if block_aggregate == "mean" else J[b * bs:(b + 1) * bs].max())
                  for b in range(nb)])
    prot = np.array([b * bs < sinks or min(n, (b + 1) * bs) > n - recent or min(n, (b + 1) * bs) - b * bs < bs
                     for b in range(nb)])
    cand = np.flatnonzero(~prot)
    order = cand[np.lexsort((cand, -B[cand]))]
    return np.sort(np.concatenate([np.flatnonzero(prot), order[:budget - prot.sum()]]))


@pytest.mark.parametrize("aggregate", ["max", "mean"])
@pytest.mark.parametrize("block_aggregate", ["mean", "max"])
def test_select_joint_blocks_against_numpy(aggregate, block_aggregate):
    for _ in range(20):
        layers, heads, n, bs = RNG.integers(1, 4), RNG.integers(1, 4), int(RNG.integers(1, 400)), int(RNG.integers(1, 40))
        scores = RNG.standard_normal((layers, heads, n)).astype(np.float32)
        sinks, recent = int(RNG.integers(0, 8)), int(RNG.integers(0, 50))
        nb = -(-n // bs)
        prot = kvscore._kvscore.protected_blocks(n, bs, sinks, recent)
        budget = int(RNG.integers(prot, nb + 1))
        got = kvscore.select_joint_blocks(scores, bs, budget, sinks=sinks, recent=recent, aggregate=aggregate,
                                          block_aggregate=block_aggregate)
        want = block_reference(scores.reshape(-1, n), bs, budget, sinks, recent, aggregate, block_aggregate)
        np.testing.assert_array_equal(got, want)
    t = kvscore.select_joint_blocks(torch.from_numpy(scores), bs, budget, sinks=sinks, recent=recent)
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64


def test_select_joint_blocks_errors_name_the_value():
    s = np.zeros((1, 2, 100), np.float32)
    with pytest.raises(ValueError, match=r"budget of 5 blocks out of range \[0, 4\]"):
        kvscore.select_joint_blocks(s, 32, 5)
    with pytest.raises(ValueError, match="below the 2 protected blocks"):
        kvscore.select_joint_blocks(s, 32, 1, sinks=1)       # block 0 and the partial last block
    with pytest.raises(ValueError, match=r"'max' or 'mean' for blocks \(got 'vote'\)"):
        kvscore.select_joint_blocks(s, 32, 3, aggregate="vote")
    with pytest.raises(TypeError):
        kvscore.select_joint_blocks(s, 32, 2.5)
