"""Every loss against the independent float64 plain-loop references (value and gradient)."""
import math

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity

from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, PairwiseCrossEntropyLoss,
                                   UncertaintyAdaptiveContrastiveLoss, UncertaintyAdaptiveTripletLoss)

import _loss_reference as ref

CASES = [(c, m, use_ref) for c in (0.1, 1.0) for m in (2, 3) for use_ref in (False, True)]


def ball_points(n, d, c, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    r = (0.1 + 0.7 * torch.rand(n, 1, generator=g, dtype=torch.float64)) / math.sqrt(c)
    return v / v.norm(dim=1, keepdim=True) * r


def batch(c, m, use_ref, n_classes=3, d=5, seed=0):
    E = ball_points(n_classes * m, d, c, seed).requires_grad_()
    y = torch.arange(n_classes).repeat_interleave(m)
    if use_ref:
        R = ball_points(n_classes * m + 2, d, c, seed + 100).requires_grad_()
        ry = torch.cat([torch.arange(n_classes).repeat_interleave(m), torch.tensor([0, n_classes])])
    else:
        R, ry = E, y
    return E, y, R, ry


def compare(loss_fn, ref_fn, E, y, R, ry, use_ref, atol=1e-9):
    kwargs = dict(ref_emb=R, ref_labels=ry) if use_ref else {}
    got = loss_fn(E, y, **kwargs)
    want = ref_fn()
    assert torch.allclose(got, want, atol=atol, rtol=1e-7), (float(got), float(want))
    inputs = [E, R] if use_ref else [E]
    g_got = torch.autograd.grad(got, inputs)
    g_want = torch.autograd.grad(want, inputs)
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("c,m,use_ref", CASES)
def test_pairwise_cross_entropy_reference(c, m, use_ref):
    E, y, R, ry = batch(c, m, use_ref)
    loss = PairwiseCrossEntropyLoss(temperature=0.2, distance=PoincareDistance(c=c))
    compare(loss, lambda: ref.pairwise_ce(E, y.tolist(), R, ry.tolist(), lambda a, b: ref.poincare(a, b, c), 0.2,
                                          not use_ref), E, y, R, ry, use_ref)


@pytest.mark.parametrize("m", [2, 3])
def test_pairwise_cross_entropy_cosine_reference(m):
    E, y, R, ry = batch(1.0, m, False)
    loss = PairwiseCrossEntropyLoss(temperature=0.1, distance=CosineSimilarity())
    # logits = cos/τ; 1 - cos differs by a constant that cancels in the softmax
    compare(loss, lambda: ref.pairwise_ce(E, y.tolist(), R, ry.tolist(), ref.cos_dist, 0.1, True), E, y, R, ry, False)


@pytest.mark.parametrize("c,m,use_ref", CASES)
def test_uncertainty_contrastive_reference(c, m, use_ref):
    E, y, R, ry = batch(c, m, use_ref)
    loss = UncertaintyAdaptiveContrastiveLoss(distance=PoincareDistance(c=c), scale=0.3, min_temperature=0.05)
    compare(loss, lambda: ref.adaptive_ce(E, y.tolist(), R, ry.tolist(), c, lambda f: torch.clamp(f * 0.3, min=0.05),
                                          not use_ref), E, y, R, ry, use_ref)


@pytest.mark.parametrize("c,m,use_ref", CASES)
def test_uncertainty_triplet_reference(c, m, use_ref):
    E, y, R, ry = batch(c, m, use_ref)
    loss = UncertaintyAdaptiveTripletLoss(distance=PoincareDistance(c=c))
    compare(loss, lambda: ref.adaptive_triplet(E, y.tolist(), R, ry.tolist(), c, not use_ref), E, y, R, ry, use_ref)


@pytest.mark.parametrize("c,m,use_ref", CASES)
@pytest.mark.parametrize("two_level", [False, True])
def test_log_ratio_reference(c, m, use_ref, two_level):
    E, y, R, ry = batch(c, m, use_ref, n_classes=4)
    if two_level:
        L, RL = torch.stack([y, y // 2], 1), torch.stack([ry, ry // 2], 1)
    else:
        L, RL = y, ry
    loss = HierarchicalLogRatioLoss(omega=10.0, distance=PoincareDistance(c=c))
    Ll = L.view(len(L), -1).tolist()
    RLl = RL.view(len(RL), -1).tolist()
    kwargs = dict(ref_emb=R, ref_labels=RL) if use_ref else {}
    got = loss(E, L, **kwargs)
    want = ref.log_ratio_dense(E, Ll, R, RLl, c, 10.0, 1e-6, not use_ref)
    assert torch.allclose(got, want, atol=1e-9, rtol=1e-7)
    inputs = [E, R] if use_ref else [E]
    for a, b in zip(torch.autograd.grad(got, inputs), torch.autograd.grad(want, inputs)):
        assert torch.allclose(a, b, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("c,m,use_ref", CASES)
def test_hierarchical_margin_reference(c, m, use_ref):
    E, y, R, ry = batch(c, m, use_ref)
    loss = HierarchicalMarginLoss(num_classes=4, gamma=0.1, distance=PoincareDistance(c=c)).double()
    compare(loss, lambda: ref.hierarchical_margin(E, y.tolist(), R, ry.tolist(), c, 0.1, not use_ref),
            E, y, R, ry, use_ref)
