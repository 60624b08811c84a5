"""The vectorised / per-anchor formulations agree with the straightforward ones (value and gradient).

* ``PairwiseCrossEntropyLoss(view_pairs=True)``: one per-view log-sum-exp vs a loop over view pairs.
* ``MixedGeometryDistance``: the cosine-identity fast path vs the general per-curvature Poincaré path.
* ``UncertaintyAdaptiveTripletLoss`` / ``HierarchicalLogRatioLoss`` / ``HierarchicalMarginLoss``: the
  reductions done inside the loss ("already_reduced") vs every element listed for the reducer (a
  reducer subclass forces the listing path).
"""
import math

import pytest
import torch
from pytorch_metric_learning.reducers import AvgNonZeroReducer, MeanReducer
from pytorch_metric_learning.regularizers import LpRegularizer
from torch.autograd import gradcheck

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import MixedGeometryDistance, PoincareDistance
from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, HypMixLoss,
                                   PairwiseCrossEntropyLoss, UncertaintyAdaptiveTripletLoss)


class ListedMean(MeanReducer):
    """Same reduction as MeanReducer, but not *exactly* it: the losses list every element."""


class ListedAvgNonZero(AvgNonZeroReducer):
    pass


def ball(n, d=6, seed=0, dtype=torch.float64, c=0.1):
    g = torch.Generator().manual_seed(seed)
    return ToPoincare(c=c)(torch.randn(n, d, generator=g, dtype=dtype))


def value_and_grads(fn, inputs):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs)
    return out.detach(), grads


def assert_same(fast, slow, atol=1e-10):
    (v1, g1), (v2, g2) = fast, slow
    assert torch.allclose(v1, v2, atol=atol, rtol=1e-9), (float(v1), float(v2))
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, atol=atol, rtol=1e-8)


# ---------------------------------------------------------------- view pairs
def view_pairs_loop(z, y, tau=0.2, c=0.1):
    """Sum over ordered view pairs (v, w) of the class-mean cross-entropy; views = occurrence rank."""
    classes = torch.unique(y)
    members = [torch.nonzero(y == k).squeeze(1) for k in classes]  # batch order = view order
    m = len(members[0])
    logits = -pb.pairwise_dist(z, z, c) / tau
    total = 0
    for v in range(m):
        for w in range(m):
            if v == w:
                continue
            terms = []
            for k in range(len(classes)):
                a, p = members[k][v], members[k][w]
                cols = [int(mm[v]) for mm in members] + [int(mm[w]) for mm in members]
                cols = [j for j in cols if j != int(a)]
                terms.append(torch.logsumexp(logits[a, cols], 0) - logits[a, p])
            total = total + sum(terms) / len(terms)
    return total


@pytest.mark.parametrize("n_cls,m", [(3, 4), (5, 2), (1, 3)])
def test_view_pairs_vectorised_matches_loop_shuffled(n_cls, m):
    g = torch.Generator().manual_seed(n_cls * 10 + m)
    y = torch.arange(n_cls).repeat_interleave(m)[torch.randperm(n_cls * m, generator=g)]
    z = ball(n_cls * m, seed=m)
    loss = PairwiseCrossEntropyLoss(view_pairs=True)
    assert_same(value_and_grads(lambda a: loss(a, y), [z]), value_and_grads(lambda a: view_pairs_loop(a, y), [z]))


# ---------------------------------------------------------------- mixed geometry distance
MIXED_CONFIGS = [dict(), dict(c=[0.1, 1.0], lam=[1.0, 2.0]), dict(c=[0.5, 4.0], lam=2.0, clip_r=0.7),
                 dict(c=0.3, lam=8.0, learnable_lambda=True)]


@pytest.mark.parametrize("config", MIXED_CONFIGS, ids=["paper", "two_c", "clip_lt_1", "learnable"])
@pytest.mark.parametrize("use_ref", [False, True])
def test_mixed_distance_fast_path_matches_general(config, use_ref):
    dist = MixedGeometryDistance(**config).double()
    g = torch.Generator().manual_seed(1)
    f = torch.randn(7, 5, generator=g, dtype=torch.float64)
    r = torch.randn(9, 5, generator=g, dtype=torch.float64)
    w = torch.randn(7, 9 if use_ref else 7, generator=g, dtype=torch.float64)
    if use_ref:
        f_for_lam, w_lam = (f, r), w
    else:
        f_for_lam, w_lam = (f, f), w
    if use_ref:
        fast = value_and_grads(lambda a, b: (dist(a, b) * w).sum(), [f, r])
        slow = value_and_grads(lambda a, b: (dist._general_mat(a, b) * w).sum(), [f, r])
    else:
        fast = value_and_grads(lambda a: (dist(a) * w).sum(), [f])
        slow = value_and_grads(lambda a: (dist._general_mat(a, a) * w).sum(), [f])
    assert_same(fast, slow, atol=1e-9)
    if config.get("learnable_lambda"):
        grads = []
        for fn in (lambda: dist(*f_for_lam), lambda: dist._general_mat(*f_for_lam)):
            dist.log_lam.grad = None
            (fn() * w_lam).sum().backward()
            grads.append(dist.log_lam.grad.clone())
        assert torch.allclose(grads[0], grads[1], rtol=1e-9)


def test_mixed_distance_fast_path_gradcheck():
    dist = MixedGeometryDistance(c=[0.1, 1.0], lam=[3.0, 1.0]).double()
    g = torch.Generator().manual_seed(2)
    f = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    r = torch.randn(6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    assert gradcheck(lambda a: dist(a), (f,))
    assert gradcheck(lambda a, b: dist(a, b), (f, r))


def test_mixed_distance_duplicates_and_near_duplicates():
    dist = MixedGeometryDistance(lam=8.0)
    g = torch.Generator().manual_seed(3)
    f = torch.randn(6, 8, generator=g)
    f[3] = f[1]  # exact duplicate
    f[4] = 3 * f[1] + 1e-4 * torch.randn(8, generator=g)  # angle ~1e-5: below the Gram product's resolution
    f[5] = f[0] + 3e-3 * torch.randn(8, generator=g)
    w = torch.randn(6, 6, generator=g)
    v32, (g32,) = value_and_grads(lambda a: (dist(a) * w).sum(), [f])
    out = dist(f)
    assert float(out[1, 3]) == 0 and float(out[3, 1]) == 0 and bool((out.diagonal() == 0).all())
    assert torch.isfinite(g32).all()
    # float32 fast path vs the float64 general path: as accurate as the float32 general path
    d64 = MixedGeometryDistance(lam=8.0).double()
    v64, (g64,) = value_and_grads(lambda a: (d64._general_mat(a, a) * w.double()).sum(), [f.double()])
    assert torch.allclose(dist(f).double(), d64._general_mat(f.double(), f.double()), atol=1e-3)
    assert (g32.double() - g64).abs().max() <= 1e-3 * g64.abs().max()


def test_mixed_distance_zero_row_and_collapsed_batch_use_general_path():
    dist = MixedGeometryDistance()
    f = torch.randn(5, 4)
    f[2] = 0
    assert torch.equal(dist(f), dist._general_mat(f, f))
    collapsed = (torch.ones(300, 64) + 1e-6 * torch.randn(300, 64)).requires_grad_()
    out = dist(collapsed)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(collapsed.grad).all()


def test_hypmix_loss_half_precision_computed_in_float32():
    x = torch.randn(36, 16, requires_grad=True)
    y = torch.arange(12).repeat_interleave(3)
    dist = MixedGeometryDistance(lam=8.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = torch.nn.functional.linear(x, torch.eye(16))
        out = HypMixLoss(distance=dist)(h, y)
        under_autocast = dist(h)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
    assert under_autocast.dtype == torch.float32
    assert torch.allclose(under_autocast, dist(h.float()), atol=1e-5)  # no bf16 product inside


# ---------------------------------------------------------------- in-loss reductions
def batch(n_cls=5, m=3, extra_ref=False, seed=0, c=0.1):
    z = ball(n_cls * m, seed=seed, c=c)
    y = torch.arange(n_cls).repeat_interleave(m)
    if not extra_ref:
        return z, y, None, None
    r = ball(n_cls * m + 4, seed=seed + 50, c=c)
    ry = torch.cat([y, torch.tensor([0, 1, n_cls, n_cls + 1])])
    return z, y, r, ry


def run(loss, z, y, r, ry):
    if r is None:
        return value_and_grads(lambda a: loss(a, y), [z])
    return value_and_grads(lambda a, b: loss(a, y, ref_emb=b, ref_labels=ry), [z, r])


@pytest.mark.parametrize("extra_ref", [False, True])
@pytest.mark.parametrize("fast,listed", [(AvgNonZeroReducer, ListedAvgNonZero), (MeanReducer, ListedMean)])
def test_triplet_per_anchor_reduction_matches_listed(extra_ref, fast, listed):
    for c in (0.1, 1.0):
        z, y, r, ry = batch(extra_ref=extra_ref, c=c)
        kwargs = dict(distance=PoincareDistance(c=c), margin_scale=3.0)
        assert_same(run(UncertaintyAdaptiveTripletLoss(reducer=fast(), **kwargs), z, y, r, ry),
                    run(UncertaintyAdaptiveTripletLoss(reducer=listed(), **kwargs), z, y, r, ry))


def test_triplet_per_anchor_with_regularizer_and_uneven_classes():
    # an embedding regularizer makes PML wrap the reducer in MultipleReducers: still the fast path
    z = ball(11, seed=4)
    y = torch.tensor([0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 3])
    reg = dict(embedding_regularizer=LpRegularizer())
    fast = UncertaintyAdaptiveTripletLoss(**reg)
    slow = UncertaintyAdaptiveTripletLoss(reducer=ListedAvgNonZero(), **reg)
    assert_same(run(fast, z, y, None, None), run(slow, z, y, None, None))


@pytest.mark.parametrize("extra_ref", [False, True])
@pytest.mark.parametrize("two_level", [False, True])
def test_log_ratio_table_reduction_matches_listed(extra_ref, two_level):
    z, y, r, ry = batch(n_cls=6, m=3, extra_ref=extra_ref, seed=7)
    if two_level:
        y = torch.stack([y, y // 2], 1)
        ry = None if ry is None else torch.stack([ry, ry // 2], 1)
    assert_same(run(HierarchicalLogRatioLoss(), z, y, r, ry),
                run(HierarchicalLogRatioLoss(reducer=ListedMean()), z, y, r, ry))


@pytest.mark.parametrize("extra_ref", [False, True])
def test_margin_dense_reduction_matches_listed(extra_ref):
    z, y, r, ry = batch(extra_ref=extra_ref, seed=9)
    fast = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.3).double()
    slow = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.3, reducer=ListedAvgNonZero()).double()
    for step in range(2):  # second step: running estimates in use
        assert_same(run(fast, z + 0.01 * step, y, r, ry), run(slow, z + 0.01 * step, y, r, ry))
    assert torch.allclose(fast.inter_mean, slow.inter_mean) and torch.allclose(fast.intra_mean, slow.intra_mean)


@pytest.mark.parametrize("extra_ref", [False, True])
def test_margin_dense_reduction_matches_listed_hierarchical_labels(extra_ref):
    """(N, K) labels: the level-grown negative margins on the dense path == on the listed pairs."""
    z, y, r, ry = batch(n_cls=6, m=3, extra_ref=extra_ref, seed=11)
    y = torch.stack([y, y // 2, y // 4], 1)
    ry = None if ry is None else torch.stack([ry, ry // 2, ry // 4], 1)
    fast = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.2, level_gamma=0.4).double()
    slow = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.2, level_gamma=0.4, reducer=ListedAvgNonZero()).double()
    for step in range(2):  # second step: running estimates in use
        assert_same(run(fast, z + 0.01 * step, y, r, ry), run(slow, z + 0.01 * step, y, r, ry))


@pytest.mark.parametrize("extra_ref", [False, True])
@pytest.mark.parametrize("levels", [1, 3])
def test_margin_triplet_binned_reduction_matches_listed(extra_ref, levels):
    """Triplet form: the binned mean of the non-zero hinges (per-anchor thresholds, no (P, R)
    matrix) == AvgNonZero over every listed triplet, value and gradient, also with running means."""
    z, y, r, ry = batch(n_cls=6, m=4, extra_ref=extra_ref, seed=13)
    if levels == 3:
        y = torch.stack([y, y // 2, y // 4], 1)
        ry = None if ry is None else torch.stack([ry, ry // 2, ry // 4], 1)
    fast = HierarchicalMarginLoss(num_classes=8, gamma=0.3, level_gamma=0.2).double()
    slow = HierarchicalMarginLoss(num_classes=8, gamma=0.3, level_gamma=0.2, reducer=ListedAvgNonZero()).double()
    for step in range(2):  # second step: running estimates in use
        assert_same(run(fast, z + 0.01 * step, y, r, ry), run(slow, z + 0.01 * step, y, r, ry))


def test_margin_triplet_binned_reduction_uneven_and_many_positives():
    """Uneven positive counts per anchor (padding), an anchor with no negative, and > 32 positives
    per anchor (the binary-search branch of the bin count)."""
    g = torch.Generator().manual_seed(3)
    z = ToPoincare(c=0.1)(torch.randn(60, 6, generator=g, dtype=torch.float64))
    for y in (torch.tensor([0] * 40 + [1] * 3 + [2] * 2 + list(range(3, 18))),  # 39 positives of class 0
              torch.tensor([0] * 5 + [1] * 2 + [2] * 53)):
        fast = HierarchicalMarginLoss(num_classes=18, gamma=0.5).double()
        slow = HierarchicalMarginLoss(num_classes=18, gamma=0.5, reducer=ListedAvgNonZero()).double()
        assert_same(run(fast, z, y, None, None), run(slow, z, y, None, None))
    only_one_class = torch.zeros(60, dtype=torch.long)  # positives but no negative: loss 0
    out = HierarchicalMarginLoss(num_classes=1).double()(z.clone().requires_grad_(), only_one_class)
    assert float(out.detach()) == 0.0


def test_count_below_matches_searchsorted_with_ties():
    from pml_hyperbolic.losses.hierarchical_margin_loss import _count_below

    g = torch.Generator().manual_seed(0)
    for k in (1, 5, 32, 33, 70):
        rows = torch.randint(-3, 4, (9, k), generator=g).double().sort(dim=1).values  # repeated values
        vals = torch.randint(-4, 5, (9, 50), generator=g).double()  # equal to thresholds too
        want = torch.searchsorted(rows, vals, side="left")
        assert torch.equal(_count_below(rows, vals), want)
    rows = torch.tensor([[float("-inf"), 0.0, float("inf")]])
    assert _count_below(rows, torch.tensor([[float("-inf"), -1.0, 0.0, 1.0]])).tolist() == [[0, 1, 1, 2]]


def test_triplet_and_log_ratio_large_batch_finite():
    z = ToPoincare(c=0.1)(torch.randn(900, 32)).requires_grad_()
    y = torch.arange(100).repeat_interleave(9)
    out = UncertaintyAdaptiveTripletLoss()(z, y) + HierarchicalLogRatioLoss()(z, torch.stack([y, y // 10], 1))
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(z.grad).all() and not math.isclose(float(out.detach()), 0.0)


def _pce_case(kind, generator):
    e = (0.3 * torch.randn(24, 8, dtype=torch.float64, generator=generator)).requires_grad_()
    if kind == "no positives":
        return e, torch.arange(24), None
    labels = torch.randint(0, 5, (24,), generator=generator)
    if kind == "pairs":  # a PML pair tuple: the denominator runs over the mined pairs only
        return e, labels, (torch.tensor([0, 1, 2]), torch.tensor([1, 0, 5]), torch.tensor([0, 3]), torch.tensor([3, 4]))
    return e, labels, None


@pytest.mark.parametrize("kind", ["labels", "pairs", "no positives"])
def test_pairwise_cross_entropy_mean_without_a_pair_list_matches_listed(kind):
    e, labels, tuples = _pce_case(kind, torch.Generator().manual_seed(7))
    listed = PairwiseCrossEntropyLoss(reducer=ListedMean())(e, labels, tuples)
    fast = PairwiseCrossEntropyLoss()(e, labels, tuples)
    (g_fast,) = torch.autograd.grad(fast, e)
    g_listed = torch.autograd.grad(listed, e)[0] if listed.requires_grad else torch.zeros_like(e)
    assert fast.item() == pytest.approx(listed.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(g_fast, g_listed, rtol=1e-10, atol=1e-14) and bool(torch.isfinite(g_fast).all())
    if kind == "no positives":
        assert fast.item() == 0.0
