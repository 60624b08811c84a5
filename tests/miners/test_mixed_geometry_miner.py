"""MixedGeometryMiner: union of per-geometry hard triplets, deduplicated."""
import math

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance
from pytorch_metric_learning.losses import CrossBatchMemory, TripletMarginLoss

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.miners import HardNegativeProbabilityMiner, MixedGeometryMiner


def ball_points(n, d=6, c=0.1, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return pb.expmap0(0.6 * torch.randn(n, d, generator=g, dtype=dtype) / math.sqrt(c), c)


def as_set(t):
    return set(zip(*(x.tolist() for x in t)))


def test_smoke_defaults():
    x = ball_points(18, dtype=torch.float32)
    y = torch.arange(18) // 3
    miner = MixedGeometryMiner(top_k=2)
    a, p, n = miner(x, y)
    assert isinstance(miner.distances[0], CosineSimilarity) and isinstance(miner.distances[1], PoincareDistance)
    assert [m.temperature for m in miner.geometry_miners] == [0.05, 0.2]
    assert all(t.dtype == torch.int64 and t.shape == a.shape for t in (a, p, n)) and len(a) > 0


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=[0.1, 2.0]), "threshold"),
        (dict(top_k=0), "top_k"),
        (dict(top_k=[1, 2, 3]), "top_k"),
        (dict(temperatures=(0.1,)), "temperatures"),
        (dict(temperatures=(0.1, -1.0)), "temperature"),
        (dict(distances=[]), "distances"),
    ],
)
def test_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MixedGeometryMiner(**kwargs)


@pytest.mark.parametrize("threshold, top_k", [(0.05, None), (None, 2), ([0.1, 0.03], None), (None, [1, 3])])
@pytest.mark.parametrize("use_ref", [False, True])
def test_union_of_single_geometry_sets(threshold, top_k, use_ref):
    x = ball_points(16, seed=1)
    y = torch.arange(16) // 4
    ref, ref_y = (ball_points(20, seed=2), torch.arange(20) % 4) if use_ref else (None, None)
    dists = [CosineSimilarity(), PoincareDistance(c=0.1), LpDistance()]
    taus = [0.05, 0.2, 0.5]
    th = threshold if isinstance(threshold, list) else [threshold] * 2
    tk = top_k if isinstance(top_k, list) else [top_k] * 2
    th, tk = th + [th[-1]], tk + [tk[-1]]
    miner = MixedGeometryMiner(
        distances=dists, temperatures=taus,
        threshold=th if isinstance(threshold, list) else threshold,
        top_k=tk if isinstance(top_k, list) else top_k,
    )
    got = miner(x, y, ref, ref_y)
    want = set()
    for d, t, a, b in zip(dists, taus, th, tk):
        want |= as_set(HardNegativeProbabilityMiner(distance=d, temperature=t, threshold=a, top_k=b)(x, y, ref, ref_y))
    assert as_set(got) == want and len(want) > 0
    assert len(got[0]) == len(want)  # deduplicated
    assert sum(miner.num_triplets_per_geometry) >= len(want)


def test_fusion_adds_triplets_over_each_geometry():
    x = ball_points(24, seed=3)
    y = torch.arange(24) // 4
    miner = MixedGeometryMiner(top_k=1)
    pool = as_set(miner(x, y))
    for m in miner.geometry_miners:
        assert as_set(m(x, y)) <= pool


def test_cross_batch_memory_and_empty():
    miner = MixedGeometryMiner(top_k=2)
    loss_fn = CrossBatchMemory(TripletMarginLoss(distance=PoincareDistance(c=0.1)), 6, memory_size=30, miner=miner)
    for step in range(3):
        x = ball_points(12, seed=step, dtype=torch.float32).requires_grad_()
        loss = loss_fn(x, torch.arange(12) // 3)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    a, p, n = MixedGeometryMiner(top_k=2)(ball_points(4, dtype=torch.float32), torch.zeros(4, dtype=torch.long))
    assert a.numel() == 0 and a.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_autocast_and_degenerate_points(dtype):
    c = 0.1
    x = torch.cat([torch.zeros(2, 6), ball_points(8, dtype=torch.float32), ball_points(2, dtype=torch.float32)])
    x[3] = x[3] / x[3].norm() * (1 / math.sqrt(c))  # on the boundary
    y = torch.tensor([0, 1, 0, 1, 2, 2, 3, 3, 0, 1, 0, 1])
    with torch.autocast("cpu", dtype=dtype):
        a, p, n = MixedGeometryMiner(top_k=2)(x, y)
    assert a.dtype == torch.int64 and len(a) > 0
    a2, _, _ = MixedGeometryMiner(top_k=2)(x.to(dtype), y)
    assert len(a2) > 0
