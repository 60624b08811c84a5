"""HierarchicalSimilarityMiner: triplets (i, j, l) with s_ij < s_il."""
import math
from collections import Counter

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pytorch_metric_learning.losses import CrossBatchMemory, TripletMarginLoss

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.miners import HierarchicalPseudoLabeler, HierarchicalSimilarityMiner


def ball_points(n, d=6, c=0.1, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return pb.expmap0(0.6 * torch.randn(n, d, generator=g, dtype=dtype) / math.sqrt(c), c)


def nested_labels(n, seed=0):
    """Random nested 3-level labels: fine id → mid id → coarse id."""
    g = torch.Generator().manual_seed(seed)
    fine = torch.randint(0, 6, (n,), generator=g)
    return torch.stack([fine, fine // 2, fine // 4], 1)


def level(hi, hj):
    return next((k + 1 for k in range(len(hi)) if hi[k] == hj[k]), len(hi) + 1)


def brute_force(h, hr, same_object, emb=None, ref=None, order=None):
    h, hr = h.tolist(), hr.tolist()
    out = set()
    for i in range(len(h)):
        def is_self(k):
            if same_object:
                return k == i
            return hr[k] == h[i] and ref[k].tolist() == emb[i].tolist()

        for j in range(len(hr)):
            for l in range(len(hr)):
                if is_self(j) or is_self(l):
                    continue
                if level(h[i], hr[j]) < level(h[i], hr[l]) and (order is None or order[i][j] >= order[i][l]):
                    out.add((i, j, l))
    return out


def as_set(t):
    return set(zip(*(x.tolist() for x in t)))


def test_smoke_shapes_and_defaults():
    x = ball_points(15, dtype=torch.float32)
    h = nested_labels(15)
    miner = HierarchicalSimilarityMiner()
    i, j, l = miner(x, h)
    assert isinstance(miner.distance, PoincareDistance)
    assert all(t.dtype == torch.int64 and t.shape == i.shape for t in (i, j, l)) and len(i) > 0
    assert miner.num_triplets == len(i)


@pytest.mark.parametrize("use_ref", [False, True])
def test_all_triplets_match_brute_force(use_ref):
    x, h = ball_points(10, seed=1), nested_labels(10, seed=1)
    if use_ref:
        r, hr = ball_points(8, seed=2), nested_labels(8, seed=2)
        got = HierarchicalSimilarityMiner()(x, h, r, hr)
        want = brute_force(h, hr, False, x, r)
    else:
        got = HierarchicalSimilarityMiner()(x, h)
        want = brute_force(h, h, True)
    assert as_set(got) == want and len(got[0]) == len(want) > 0


def test_violating_only_matches_brute_force():
    x, h = ball_points(10, seed=3), nested_labels(10, seed=3)
    d = [[PoincareDistance(c=0.1)(x[a : a + 1], x[b : b + 1]).item() for b in range(10)] for a in range(10)]
    got = HierarchicalSimilarityMiner(violating_only=True)(x, h)
    assert as_set(got) == brute_force(h, h, True, order=d)
    sim = CosineSimilarity()(x)
    got = HierarchicalSimilarityMiner(distance=CosineSimilarity(), violating_only=True)(x, h)
    assert as_set(got) == brute_force(h, h, True, order=(-sim).tolist())


def test_flat_labels_are_one_level():
    x = ball_points(9, seed=4)
    y = torch.arange(9) // 3
    got = HierarchicalSimilarityMiner()(x, y)
    # K = 1: j a positive, l a negative (standard all-triplets)
    assert as_set(got) == brute_force(y[:, None], y[:, None], True)


def test_sampled_triplets_are_valid_and_uniform():
    x, h = ball_points(8, seed=5), nested_labels(8, seed=5)
    valid = brute_force(h, h, True)
    miner = HierarchicalSimilarityMiner(triplets_per_anchor=4000, seed=0)
    i, j, l = miner(x, h)
    anchors_with_pairs = {a for a, _, _ in valid}
    assert len(i) == 4000 * len(anchors_with_pairs)
    sampled = list(zip(i.tolist(), j.tolist(), l.tolist()))
    assert set(sampled) <= valid
    for a in anchors_with_pairs:
        counts = Counter(t for t in sampled if t[0] == a)
        n_valid = sum(1 for t in valid if t[0] == a)
        assert len(counts) == n_valid  # every valid triplet is reachable
        expected = 4000 / n_valid
        chi2 = sum((counts[t] - expected) ** 2 / expected for t in valid if t[0] == a)
        assert chi2 < n_valid + 6 * math.sqrt(2 * n_valid) + 10  # loose chi-square bound (deterministic seed)
    # reproducible with a seed
    again = HierarchicalSimilarityMiner(triplets_per_anchor=4000, seed=0)(x, h)
    assert all(torch.equal(u, v) for u, v in zip((i, j, l), again))


def test_one_dimensional_labels_decoded_through_labeler():
    x = ball_points(40, seed=6)
    lab = HierarchicalPseudoLabeler(levels=(8, 4, 2))
    h = lab.fit_predict(x)
    miner = HierarchicalSimilarityMiner(pseudo_labeler=lab)
    assert as_set(miner(x, h[:, 0])) == as_set(HierarchicalSimilarityMiner()(x, h))
    with pytest.raises(ValueError, match="labels"):
        miner(x, torch.full((40,), 99))


def test_labels_none_clusters_the_batch():
    x = ball_points(30, seed=7)
    lab = HierarchicalPseudoLabeler(levels=(6, 3))
    i, j, l = HierarchicalSimilarityMiner(pseudo_labeler=lab, triplets_per_anchor=5, seed=0)(x, None)
    assert len(i) > 0 and lab.level_sizes_ == (6, 3)
    with pytest.raises(ValueError, match="labels"):
        HierarchicalSimilarityMiner()(x, None)


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(triplets_per_anchor=0), "triplets_per_anchor"), (dict(triplets_per_anchor=1.5), "triplets_per_anchor"),
     (dict(pseudo_labeler="x"), "pseudo_labeler")],
)
def test_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        HierarchicalSimilarityMiner(**kwargs)


def test_label_shape_mismatch():
    x = ball_points(6)
    miner = HierarchicalSimilarityMiner()
    with pytest.raises(ValueError, match="labels"):
        miner(x, nested_labels(5))
    with pytest.raises(ValueError, match="ref_labels"):
        miner(x, nested_labels(6), ball_points(4), nested_labels(3))
    with pytest.raises(ValueError, match="ref_labels"):
        miner(x, nested_labels(6), ball_points(4), nested_labels(4)[:, :2])
    with pytest.raises(ValueError, match="labels"):
        miner(x, torch.zeros(6, 2, 2, dtype=torch.long))


def test_cross_batch_memory_with_finest_ids():
    """CrossBatchMemory stores 1-D labels: pass finest ids and let the labeler decode them."""
    data = ball_points(60, seed=8, dtype=torch.float32)
    lab = HierarchicalPseudoLabeler(levels=(10, 5, 2))
    fine = lab.fit_predict(data)[:, 0]
    miner = HierarchicalSimilarityMiner(pseudo_labeler=lab, triplets_per_anchor=20, seed=0)
    loss_fn = CrossBatchMemory(TripletMarginLoss(distance=PoincareDistance(c=0.1)), 6, memory_size=40, miner=miner)
    for step in range(3):
        idx = torch.arange(step * 15, step * 15 + 15)
        x = data[idx].clone().requires_grad_()
        loss = loss_fn(x, fine[idx])
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and miner.num_triplets > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_and_degenerate_points(dtype):
    c = 0.1
    x = torch.cat([torch.zeros(3, 6), ball_points(6, dtype=torch.float32)])
    x[4] = x[4] / x[4].norm() / math.sqrt(c)
    x[5] = x[6]
    h = nested_labels(9, seed=9)
    with torch.autocast("cpu", dtype=dtype):
        i, j, l = HierarchicalSimilarityMiner(violating_only=True)(x, h)
    i2, _, _ = HierarchicalSimilarityMiner(triplets_per_anchor=3)(x.to(dtype), h)
    assert i.dtype == i2.dtype == torch.int64 and len(i2) > 0
