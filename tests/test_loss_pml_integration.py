"""View pairs, HypMix distance, PML miners, CrossBatchMemory, bad arguments, degenerate batches, autocast."""
import math
import warnings

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity
from pml_hyperbolic.losses import HyperbolicCrossBatchMemory as CrossBatchMemory
from pytorch_metric_learning.miners import MultiSimilarityMiner, TripletMarginMiner

from pml_hyperbolic.distances import MixedGeometryDistance, PoincareDistance
from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, HypMixLoss,
                                   PairwiseCrossEntropyLoss, UncertaintyAdaptiveContrastiveLoss,
                                   UncertaintyAdaptiveTripletLoss)
from pml_hyperbolic import poincare_ball as pb


def all_losses():
    return [PairwiseCrossEntropyLoss(), HypMixLoss(), UncertaintyAdaptiveContrastiveLoss(),
            UncertaintyAdaptiveTripletLoss(), HierarchicalLogRatioLoss(), HierarchicalMarginLoss(num_classes=64)]


LOSS_IDS = ["pce", "hypmix", "uac", "uat", "logratio", "hmargin"]


def embed(n=12, d=8, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return ToPoincare(c=0.1)(torch.randn(n, d, generator=g) * scale)


@pytest.mark.parametrize("m", [2, 3])
def test_view_pairs_matches_authors_formulation(m):
    n_cls, c, tau = 4, 0.1, 0.2
    z = embed(n_cls * m, seed=m).double()
    y = torch.arange(n_cls).repeat_interleave(m)  # class-major, as the authors' view(classes, m)
    got = PairwiseCrossEntropyLoss(view_pairs=True)(z, y)
    zz = z.view(n_cls, m, -1)
    want = 0
    for i in range(m):
        for j in range(m):
            if i == j:
                continue
            x0, x1 = zz[:, i], zz[:, j]
            l01 = -pb.pairwise_dist(x0, x1, c) / tau
            l00 = -pb.pairwise_dist(x0, x0, c) / tau - torch.eye(n_cls, dtype=z.dtype) * 1e9
            logits = torch.cat([l01, l00], 1)
            want = want + torch.nn.functional.cross_entropy(logits, torch.arange(n_cls))
    assert torch.allclose(got, want, atol=1e-10)
    if m == 2:  # documented factor: exactly 2x the default mean formulation
        plain = PairwiseCrossEntropyLoss()(z, y)
        assert torch.allclose(got, 2 * plain, atol=1e-10)


def test_view_pairs_order_invariant_and_bad_labels():
    z = embed(8).double()
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    perm_first = PairwiseCrossEntropyLoss(view_pairs=True)(z, y)
    order = torch.argsort(y, stable=True)
    assert torch.allclose(perm_first, PairwiseCrossEntropyLoss(view_pairs=True)(z[order], y[order]))
    with pytest.raises(ValueError, match="labels"):
        PairwiseCrossEntropyLoss(view_pairs=True)(z[:7], y[:7])
    with pytest.raises(ValueError, match="ref_emb"):
        PairwiseCrossEntropyLoss(view_pairs=True)(z, y, ref_emb=z.clone(), ref_labels=y)


def test_mixed_distance_matches_paper_logits():
    f = torch.randn(6, 5, dtype=torch.float64)
    dist = MixedGeometryDistance(c=0.1, lam=3.0, tau_e=0.05, tau_h=0.2)
    u = torch.nn.functional.normalize(f, dim=1)
    zh = ToPoincare(c=0.1, clip_r=2.3)(u)
    want = (1 - u @ u.T) / 0.05 + 3.0 * pb.pairwise_dist(zh, zh, 0.1) / 0.2
    assert torch.allclose(dist(f), want, atol=1e-9)
    assert torch.allclose(dist.pairwise_distance(f, f.flip(0)), want.diagonal(0).new_tensor(
        [want[i, 5 - i] for i in range(6)]), atol=1e-9)
    multi = MixedGeometryDistance(c=[0.1, 1.0], lam=[1.0, 2.0])
    zh1 = ToPoincare(c=1.0, clip_r=2.3)(u)
    want2 = (1 - u @ u.T) / 0.05 + (pb.pairwise_dist(zh, zh, 0.1) + 2 * pb.pairwise_dist(zh1, zh1, 1.0)) / 0.2
    assert torch.allclose(multi(f), want2, atol=1e-8)


def test_hypmix_learnable_lambda_gets_gradient():
    loss = HypMixLoss(learnable_lambda=True, lam=8.0)
    params = list(loss.parameters())
    assert len(params) == 1
    f = torch.randn(12, 8, requires_grad=True)
    loss(f, torch.arange(4).repeat_interleave(3)).backward()
    assert params[0].grad is not None and torch.isfinite(params[0].grad).all()
    assert torch.allclose(loss.distance.lam, torch.tensor([8.0]))


@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_pml_miner_indices_tuple(loss_idx):
    loss = all_losses()[loss_idx]
    z = embed(12).requires_grad_()
    y = torch.arange(4).repeat_interleave(3)
    miner = TripletMarginMiner(margin=5.0, distance=PoincareDistance(c=0.1)) if loss_idx in (3, 4) else \
        MultiSimilarityMiner(epsilon=10.0, distance=PoincareDistance(c=0.1))
    out = loss(z, y, indices_tuple=miner(z, y))
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(z.grad).all()


@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_cross_batch_memory(loss_idx):
    loss = all_losses()[loss_idx]
    xbm = CrossBatchMemory(loss, embedding_size=8, memory_size=20)
    for step in range(3):
        z = embed(12, seed=step).requires_grad_()
        y = torch.arange(4).repeat_interleave(3) + step
        out = xbm(z, y)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(z.grad).all()


def degenerate_batches():
    r = 2.3
    at_clip = ToPoincare(c=0.1, clip_r=r)(torch.randn(8, 6) * 100)
    return {
        "clip_radius": (at_clip, torch.arange(4).repeat_interleave(2)),
        "origin": (torch.zeros(8, 6), torch.arange(4).repeat_interleave(2)),
        "duplicates": (embed(1).repeat(8, 1), torch.arange(4).repeat_interleave(2)),
        "one_class": (embed(8), torch.zeros(8, dtype=torch.long)),
        "all_distinct": (embed(8), torch.arange(8)),
    }


@pytest.mark.parametrize("case", list(degenerate_batches()))
@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_degenerate_batches_finite(case, loss_idx):
    z, y = degenerate_batches()[case]
    z = z.clone().requires_grad_()
    out = all_losses()[loss_idx](z, y)
    if isinstance(out, torch.Tensor) and out.requires_grad:
        out.backward()
        assert torch.isfinite(z.grad).all()
    assert math.isfinite(float(out.detach() if isinstance(out, torch.Tensor) else out))
    if case == "all_distinct" and loss_idx in (0, 1, 2, 3):
        assert float(out.detach() if isinstance(out, torch.Tensor) else out) == 0  # no positive pair -> zero_losses()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_autocast(dtype, loss_idx):
    head = torch.nn.Linear(16, 8)
    x = torch.randn(12, 16)
    y = torch.arange(4).repeat_interleave(3)
    with torch.autocast("cpu", dtype=dtype):
        h = head(x)
        z = h if loss_idx == 1 else ToPoincare(c=0.1)(h)
        out = all_losses()[loss_idx](z, y)
    out.backward()
    assert torch.isfinite(out) and all(torch.isfinite(p.grad).all() for p in head.parameters())


def test_bad_arguments_name_the_argument():
    for kw in ({"temperature": 0}, {"temperature": -1.0}):
        with pytest.raises(ValueError, match="temperature"):
            PairwiseCrossEntropyLoss(**kw)
    with pytest.raises(ValueError, match="omega"):
        HierarchicalLogRatioLoss(omega=1.0)
    with pytest.raises(ValueError, match="omega"):
        HierarchicalLogRatioLoss(omega=0.5)
    with pytest.raises(ValueError, match="lam"):
        HypMixLoss(lam=-1.0)
    with pytest.raises(ValueError, match="lam"):
        MixedGeometryDistance(c=[0.1, 1.0], lam=[1.0])
    with pytest.raises(ValueError, match="tau_e"):
        MixedGeometryDistance(tau_e=0)
    with pytest.raises(ValueError, match="tau_h"):
        HypMixLoss(tau_h=-0.2)
    with pytest.raises(ValueError, match="c"):
        MixedGeometryDistance(c=0)
    with pytest.raises(ValueError, match="scale"):
        UncertaintyAdaptiveContrastiveLoss(scale=0)
    with pytest.raises(ValueError, match="scale_rule"):
        UncertaintyAdaptiveContrastiveLoss(scale_rule="add")
    with pytest.raises(ValueError, match="min_temperature"):
        UncertaintyAdaptiveContrastiveLoss(min_temperature=0)
    with pytest.raises(ValueError, match="mode"):
        UncertaintyAdaptiveTripletLoss(mode="x")
    with pytest.raises(ValueError, match="margin_scale"):
        UncertaintyAdaptiveTripletLoss(margin_scale=-1)
    with pytest.raises(ValueError, match="gamma"):
        HierarchicalMarginLoss(num_classes=3, gamma=-1)
    with pytest.raises(ValueError, match="momentum"):
        HierarchicalMarginLoss(num_classes=3, momentum=1.0)
    with pytest.raises(ValueError, match="num_classes"):
        HierarchicalMarginLoss(num_classes=0)
    z = embed(6)
    with pytest.raises(ValueError, match="labels"):
        HierarchicalLogRatioLoss()(z, torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ref_labels"):
        HierarchicalLogRatioLoss()(z, torch.zeros(6, 2, dtype=torch.long), ref_emb=z, ref_labels=torch.zeros(6, 3))
    with pytest.raises(ValueError, match="labels"):
        HierarchicalMarginLoss(num_classes=3)(z, torch.arange(6))
    with pytest.raises(ValueError, match="labels"):
        PairwiseCrossEntropyLoss()(z, torch.arange(5))


def test_margin_loss_running_estimates_checkpoint_and_update():
    loss = HierarchicalMarginLoss(num_classes=3, momentum=0.5)
    z1, z2 = embed(6, seed=1), embed(6, seed=2)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss(z1, y)
    first = loss.intra_mean.clone()
    d1 = pb.dist(z1[0:1], z1[1:2], 0.1)
    assert torch.allclose(first[0], d1[0], atol=1e-5)
    loss(z2, y)
    d2 = pb.dist(z2[0:1], z2[1:2], 0.1)
    assert torch.allclose(loss.intra_mean[0], 0.5 * d1[0] + 0.5 * d2[0], atol=1e-5)
    state = loss.state_dict()
    assert {"intra_mean", "intra_seen", "inter_mean", "inter_seen"} <= set(state)
    fresh = HierarchicalMarginLoss(num_classes=3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.inter_mean, loss.inter_mean)
    loss.eval()
    before = loss.intra_mean.clone()
    loss(z1, y)
    assert torch.equal(before, loss.intra_mean)


def test_log_ratio_hierarchical_levels_convention():
    from pml_hyperbolic.losses.hierarchical_log_ratio_loss import similarity_levels
    L = torch.tensor([[0, 0], [0, 0], [1, 0], [2, 1]])
    s = similarity_levels(L, L)
    assert s[0, 1] == 1 and s[0, 2] == 2 and s[0, 3] == 3 and s[2, 3] == 3


def test_log_ratio_large_batch_memory_bounded():
    # B = 900 dense triplets without enumerating B^3 of them
    z = embed(900, d=16)
    y = torch.stack([torch.arange(100).repeat_interleave(9), torch.arange(100).repeat_interleave(9) // 10], 1)
    out = HierarchicalLogRatioLoss()(z, y)
    assert torch.isfinite(out)


def test_sphere_baseline_cosine():
    z = torch.randn(12, 8)
    y = torch.arange(4).repeat_interleave(3)
    out = PairwiseCrossEntropyLoss(temperature=0.1, distance=CosineSimilarity())(z, y)
    assert torch.isfinite(out) and out > 0
