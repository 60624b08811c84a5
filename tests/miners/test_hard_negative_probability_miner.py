"""HardNegativeProbabilityMiner: smoke, bad args, shapes, brute-force reference, edge cases."""
import math

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
from pytorch_metric_learning.losses import CrossBatchMemory, TripletMarginLoss

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.miners import HardNegativeProbabilityMiner


def ball_points(n, d=6, c=0.1, scale=0.6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return pb.expmap0(scale * torch.randn(n, d, generator=g, dtype=dtype) / math.sqrt(c), c)


def ref_poincare(x, y, c):
    """Independent float64 formula: arcosh(1 + 2c|x-y|^2 / ((1-c|x|^2)(1-c|y|^2))) / sqrt(c)."""
    num = 2 * c * sum((a - b) ** 2 for a, b in zip(x, y))
    den = (1 - c * sum(a * a for a in x)) * (1 - c * sum(b * b for b in y))
    return math.acosh(1 + num / den) / math.sqrt(c)


def ref_cosine(x, y):
    dot = sum(a * b for a, b in zip(x, y))
    return dot / math.sqrt(sum(a * a for a in x) * sum(b * b for b in y))


def brute_force(emb, labels, ref, ref_labels, same_object, score, inverted, tau, threshold, top_k, include_positives):
    """Plain-loop reference of the mined triplet set."""
    emb, ref = emb.tolist(), ref.tolist()
    labels, ref_labels = labels.tolist(), ref_labels.tolist()
    out = set()
    for a in range(len(emb)):
        def is_self(k):
            return (same_object and k == a) or (not same_object and ref_labels[k] == labels[a] and ref[k] == emb[a])

        cands = [k for k in range(len(ref)) if not is_self(k) and (include_positives or ref_labels[k] != labels[a])]
        logits = {}
        for k in cands:
            v = score(emb[a], ref[k])
            logits[k] = v / tau if inverted else -v / tau
        if not logits:
            continue
        mx = max(logits.values())
        z = sum(math.exp(v - mx) for v in logits.values())
        p = {k: math.exp(v - mx) / z for k, v in logits.items()}
        negs = [k for k in range(len(ref)) if ref_labels[k] != labels[a]]
        sel = set(negs)
        if threshold is not None:
            sel = {k for k in sel if p[k] >= threshold}
        if top_k is not None:
            ranked = sorted(negs, key=lambda k: -p[k])[:top_k]
            sel &= set(ranked)
        if threshold is None and top_k is None:
            sel = {k for k in sel if p[k] > 1.0 / len(cands)}
        poss = [k for k in range(len(ref)) if ref_labels[k] == labels[a] and not is_self(k)]
        out |= {(a, pp, n) for pp in poss for n in sel}
    return out


def as_set(t):
    return set(zip(*(x.tolist() for x in t)))


def test_smoke_defaults_and_types():
    x = ball_points(18, dtype=torch.float32)
    y = torch.arange(18) // 3
    miner = HardNegativeProbabilityMiner()
    a, p, n = miner(x, y)
    assert isinstance(miner.distance, PoincareDistance) and miner.temperature == 0.2
    for t in (a, p, n):
        assert t.dtype == torch.int64 and t.ndim == 1 and t.shape == a.shape
    assert len(a) > 0 and miner.num_triplets == len(a)
    assert bool((y[a] == y[p]).all()) and bool((y[a] != y[n]).all()) and bool((a != p).all())


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.5), "threshold"),
        (dict(threshold=-0.1), "threshold"),
        (dict(threshold="x"), "threshold"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        HardNegativeProbabilityMiner(**kwargs)


def test_threshold_one_is_valid():
    miner = HardNegativeProbabilityMiner(threshold=1.0)
    assert miner.threshold == 1.0 and miner.top_k is None
    # p(n) >= 1 keeps a negative only when it is the anchor's whole softmax support
    x = torch.tensor([[0.1, 0.0], [0.3, 0.0], [-0.5, 0.2]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    # positives in the softmax (default): anchors 0 and 1 split their weight between 1 positive and
    # 1 negative (p(2) = 1 / (1 + exp((D_a2 - D_a+) / τ)) < 1); anchor 2 has no positive -> nothing
    p01, p02, p12 = (ref_poincare(x[i].tolist(), x[j].tolist(), 0.1) for i, j in ((0, 1), (0, 2), (1, 2)))
    w = miner.negative_weights(x, y)
    assert float(w[0, 2]) == pytest.approx(1 / (1 + math.exp((p02 - p01) / 0.2)), rel=1e-12)
    assert float(w[1, 2]) == pytest.approx(1 / (1 + math.exp((p12 - p01) / 0.2)), rel=1e-12)
    assert float(w[0, 2]) < 1 and float(w[1, 2]) < 1
    a, p, n = miner(x, y)
    assert len(a) == len(p) == len(n) == 0
    # negatives only: the single negative of anchors 0 and 1 has p = 1 -> kept; anchor 2's two
    # negatives share its weight (p < 1) and it has no positive anyway
    only_neg = HardNegativeProbabilityMiner(threshold=1.0, include_positives=False)
    w = only_neg.negative_weights(x, y)
    assert float(w[0, 2]) == 1.0 and float(w[1, 2]) == 1.0
    assert 0 < float(w[2, 0]) < 1 and float(w[2, 0] + w[2, 1]) == pytest.approx(1.0)
    assert as_set(only_neg(x, y)) == {(0, 1, 2), (1, 0, 2)}
    assert as_set(only_neg(x, y)) == brute_force(x, y, x, y, True, lambda u, v: ref_poincare(u, v, 0.1), False,
                                                0.2, 1.0, None, False)


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize(
    "threshold, top_k, include_positives",
    [(0.05, None, True), (None, 3, True), (0.02, 4, True), (None, None, True), (0.05, None, False), (None, 2, False)],
)
@pytest.mark.parametrize("per_class", [2, 3])
def test_matches_brute_force_poincare(c, threshold, top_k, include_positives, per_class):
    n = 8 * per_class
    x = ball_points(n, c=c, seed=per_class)
    y = torch.arange(n) // per_class
    miner = HardNegativeProbabilityMiner(
        distance=PoincareDistance(c=c), temperature=0.2, threshold=threshold, top_k=top_k, include_positives=include_positives
    )
    got = as_set(miner(x, y))
    want = brute_force(x, y, x, y, True, lambda u, v: ref_poincare(u, v, c), False, 0.2, threshold, top_k, include_positives)
    assert got == want and len(want) > 0


@pytest.mark.parametrize("threshold, top_k", [(0.08, None), (None, 2)])
def test_matches_brute_force_with_ref_emb(threshold, top_k):
    x, r = ball_points(10, seed=1), ball_points(14, seed=2)
    y, ry = torch.arange(10) % 4, torch.arange(14) % 4
    miner = HardNegativeProbabilityMiner(distance=PoincareDistance(c=0.1), threshold=threshold, top_k=top_k)
    got = as_set(miner(x, y, r, ry))
    want = brute_force(x, y, r, ry, False, lambda u, v: ref_poincare(u, v, 0.1), False, 0.2, threshold, top_k, True)
    assert got == want and len(want) > 0


@pytest.mark.parametrize("threshold, top_k", [(0.06, None), (None, 3)])
def test_inverted_similarity_matches_brute_force(threshold, top_k):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 5, generator=g, dtype=torch.float64)
    y = torch.arange(16) // 2
    miner = HardNegativeProbabilityMiner(distance=CosineSimilarity(), temperature=0.1, threshold=threshold, top_k=top_k)
    got = as_set(miner(x, y))
    want = brute_force(x, y, x, y, True, ref_cosine, True, 0.1, threshold, top_k, True)
    assert got == want and len(want) > 0


def test_negative_weights_are_a_softmax_and_bounded_selection():
    x = ball_points(20, seed=4)
    y = torch.arange(20) // 4
    miner = HardNegativeProbabilityMiner(threshold=0.1)
    w = miner.negative_weights(x, y)
    assert torch.allclose(w.sum(1), torch.ones(20, dtype=w.dtype))
    assert bool((w.diagonal() == 0).all())
    a, p, n = miner(x, y)
    # p(n) >= t and Σ p <= 1 ⇒ at most ⌊1/t⌋ negatives per anchor
    for anchor in range(20):
        assert len(set(n[a == anchor].tolist())) <= 10


def test_smaller_temperature_concentrates_weight():
    x = ball_points(20, seed=5)
    y = torch.arange(20) // 4
    hot = HardNegativeProbabilityMiner(temperature=1.0).negative_weights(x, y).max(1).values
    cold = HardNegativeProbabilityMiner(temperature=0.05).negative_weights(x, y).max(1).values
    assert bool((cold >= hot - 1e-12).all())


def test_identical_ref_copy_is_treated_as_self():
    """CrossBatchMemory / DistributedMinerWrapper(efficient) put the batch itself into ref_emb."""
    x = ball_points(12, seed=6)
    y = torch.arange(12) // 3
    miner = HardNegativeProbabilityMiner(threshold=0.05)
    assert as_set(miner(x, y)) == as_set(miner(x, y, x.clone(), y.clone()))


def test_cross_batch_memory():
    torch.manual_seed(0)
    miner = HardNegativeProbabilityMiner(distance=PoincareDistance(c=0.1), top_k=3)
    loss_fn = CrossBatchMemory(TripletMarginLoss(distance=PoincareDistance(c=0.1)), 6, memory_size=40, miner=miner)
    for step in range(4):
        x = ball_points(12, seed=10 + step, dtype=torch.float32).requires_grad_()
        y = torch.arange(12) // 3 + step
        loss = loss_fn(x, y)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
        assert miner.num_triplets > 0


def test_empty_results():
    miner = HardNegativeProbabilityMiner(top_k=2)
    x = ball_points(5, dtype=torch.float32)
    for y in (torch.zeros(5, dtype=torch.long), torch.arange(5)):  # one class / all distinct
        a, p, n = miner(x, y)
        assert a.numel() == p.numel() == n.numel() == 0 and a.dtype == torch.int64
    a, p, n = miner(x[:1], torch.zeros(1, dtype=torch.long))
    assert a.numel() == 0


def test_no_nan_at_boundary_origin_duplicates():
    c = 0.1
    d = 6
    edge = torch.randn(6, d)
    edge = edge / edge.norm(dim=1, keepdim=True) * (1 / math.sqrt(c))  # on the boundary (projected inside)
    clip = pb.expmap0(torch.randn(6, d) / torch.randn(6, d).norm(dim=1, keepdim=True) * 2.3, c)
    origin = torch.zeros(3, d)
    dup = clip[:3].clone()
    x = torch.cat([edge, clip, origin, dup])
    y = torch.tensor([0, 1, 2, 0, 1, 2] * 3)
    miner = HardNegativeProbabilityMiner(distance=PoincareDistance(c=c), top_k=3)
    w = miner.negative_weights(x, y)
    assert torch.isfinite(w).all()
    a, p, n = miner(x, y)
    assert len(a) > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_and_half_inputs(dtype):
    x = ball_points(16, dtype=torch.float32)
    y = torch.arange(16) // 4
    want = as_set(HardNegativeProbabilityMiner(top_k=2)(x, y))
    with torch.autocast("cpu", dtype=dtype):
        got = HardNegativeProbabilityMiner(top_k=2)(x, y)
        got_cos = HardNegativeProbabilityMiner(distance=CosineSimilarity(), temperature=0.05, top_k=2)(x.to(dtype), y)
    half = HardNegativeProbabilityMiner(top_k=2)(x.to(dtype), y)
    assert all(t.dtype == torch.int64 for t in (*got, *got_cos, *half))
    assert as_set(got) == want
    # half-precision rounding may reorder near-ties: require a large overlap, not identity
    assert len(as_set(half) & want) >= 0.8 * len(want)


def test_works_with_lp_distance():
    x = ball_points(12, dtype=torch.float32)
    y = torch.arange(12) // 3
    a, p, n = HardNegativeProbabilityMiner(distance=LpDistance(), threshold=0.05)(x, y)
    assert len(a) > 0


def test_label_shape_mismatch():
    x = ball_points(6, dtype=torch.float32)
    miner = HardNegativeProbabilityMiner(top_k=1)
    with pytest.raises(ValueError, match="labels"):
        miner(x, torch.arange(5))
    with pytest.raises(ValueError, match="labels"):
        miner(x, torch.zeros(6, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels"):
        miner(x, torch.arange(6), ball_points(4, dtype=torch.float32), torch.arange(3))
