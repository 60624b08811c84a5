"""Every loss against the independent float64 plain-loop references (value and gradient)."""
import math

import pytest
import torch
from pytorch_metric_learning.distances import CosineSimilarity

from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, PairwiseCrossEntropyLoss,
                                   UncertaintyAdaptiveContrastiveLoss, UncertaintyAdaptiveTripletLoss)

from tests.losses import _loss_reference as ref

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
    loss = HierarchicalLogRatioLoss(omega=10.0, one_sided=False, train_radius=True,
                                    distance=PoincareDistance(c=c))  # the paper's form, full gradient
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
    loss = HierarchicalMarginLoss(margin_form="contrastive", num_classes=4, gamma=0.1, distance=PoincareDistance(c=c)).double()
    compare(loss, lambda: ref.hierarchical_margin(E, y.tolist(), R, ry.tolist(), c, 0.1, not use_ref),
            E, y, R, ry, use_ref)


# ------------------------------------------------------------------------------------------------
# Hierarchical (N, K) labels: both losses against slow loops written here (float64), gradcheck,
# bad arguments, and the pinned defaults.
# ------------------------------------------------------------------------------------------------
def loop_poincare(x, y, c):
    num = 2 * c * ((x - y) ** 2).sum()
    den = (1 - c * (x ** 2).sum()) * (1 - c * (y ** 2).sum())
    return torch.acosh(1 + num / den) / math.sqrt(c)


def loop_level(a, b):
    """1 + first (finest-first) level where rows a and b agree, K + 1 if none."""
    for k, (u, v) in enumerate(zip(a, b)):
        if u == v:
            return k + 1
    return len(a) + 1


def loop_log_ratio(E, L, R, RL, c, omega, eps, self_ref, one_sided=False):
    """Every triplet (i, j, l), s_ij < s_il, enumerated; mean over l per (i, j), then over (i, j).
    ``one_sided``: only residuals > 0 (the farther sample not Ω^(s_il − s_ij) times as far) count."""
    per_pair = []
    for i in range(len(E)):
        for j in range(len(R)):
            if self_ref and j == i:
                continue
            sij = loop_level(L[i], RL[j])
            terms = []
            for l in range(len(R)):
                if self_ref and l == i:
                    continue
                sil = loop_level(L[i], RL[l])
                if sil <= sij:
                    continue
                r = (torch.log(loop_poincare(E[i], R[j], c) + eps) - torch.log(loop_poincare(E[i], R[l], c) + eps)
                     - (sij - sil) * math.log(omega))
                terms.append(torch.relu(r) ** 2 if one_sided else r ** 2)
            if terms:
                per_pair.append(sum(terms) / len(terms))
    return sum(per_pair) / len(per_pair)


def loop_class_means(E, R, y, ry, c, self_ref):
    """Detached, symmetrised mean Poincaré distance per class pair (self-pairs excluded), by loops."""
    sums, counts = {}, {}
    for i in range(len(E)):
        for j in range(len(R)):
            if self_ref and i == j:
                continue
            d = loop_poincare(E[i], R[j], c).detach()
            for key in ((y[i], ry[j]), (ry[j], y[i])):
                sums[key] = sums.get(key, 0.0) + d / 2
                counts[key] = counts.get(key, 0) + 0.5
    return {k: sums[k] / counts[k] for k in sums}


def loop_margin(E, L, R, RL, c, gamma, delta, self_ref, pairs=None):
    """Fresh HierarchicalMarginLoss on (N, K) labels: class (column 0) means of this batch (detached,
    symmetrised, self-pairs excluded), M_p = d_a + γ, M_n = d_ab − d_a + γ + δ (s_il − 2); each
    sub-loss the mean of its non-zero hinges. ``pairs``: (pos list, neg list), else all pairs."""
    y, ry = [row[0] for row in L], [row[0] for row in RL]
    mean = loop_class_means(E, R, y, ry, c, self_ref)
    if pairs is None:
        all_pairs = [(i, j) for i in range(len(E)) for j in range(len(R)) if not (self_ref and i == j)]
        pairs = ([p for p in all_pairs if y[p[0]] == ry[p[1]]], [p for p in all_pairs if y[p[0]] != ry[p[1]]])
    pos = []
    for i, j in pairs[0]:
        da = mean.get((y[i], y[i]), 0.0)
        pos.append(torch.relu(loop_poincare(E[i], R[j], c) - da - gamma))
    neg = []
    for i, l in pairs[1]:
        da = mean.get((y[i], y[i]), 0.0)
        s = loop_level(L[i], RL[l])
        neg.append(torch.relu(mean[y[i], ry[l]] - da + gamma + delta * (s - 2) - loop_poincare(E[i], R[l], c)))

    def avg_nonzero(ts):
        nz = [t for t in ts if t > 0]
        return sum(nz) / len(nz) if nz else sum(ts) * 0
    return avg_nonzero(pos) + avg_nonzero(neg)


def three_level_batch(c, use_ref, seed=0):
    """12 samples, 6 classes of 2, K = 3: (class, class // 2, class // 3); ref with 3 extra rows."""
    E = ball_points(12, 5, c, seed).requires_grad_()
    y = torch.arange(6).repeat_interleave(2)
    L = torch.stack([y, y // 2, y // 3], 1)
    if not use_ref:
        return E, L, E, L
    R = ball_points(15, 5, c, seed + 100).requires_grad_()
    ry = torch.cat([y, torch.tensor([0, 5, 7])])
    RL = torch.stack([ry, ry // 2, ry // 3], 1)
    RL[-1, 1] = 1  # class 7 shares level 2 with classes 2, 3
    return E, L, R, RL


def check_value_and_grad(got, want, inputs):
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6), (float(got), float(want))
    for a, b in zip(torch.autograd.grad(got, inputs, retain_graph=True), torch.autograd.grad(want, inputs)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("use_ref", [False, True])
@pytest.mark.parametrize("omega,eps", [(10.0, 1e-6), (1.2, 1e-6), (3.0, 0.5)])  # paper, new default, other
@pytest.mark.parametrize("one_sided", [False, True])
def test_log_ratio_nk_labels_vs_loop(c, use_ref, omega, eps, one_sided):
    E, L, R, RL = three_level_batch(c, use_ref)
    loss = HierarchicalLogRatioLoss(omega=omega, eps=eps, one_sided=one_sided, train_radius=True,
                                    distance=PoincareDistance(c=c))  # the full gradient, as the loop's
    got = loss(E, L, ref_emb=R, ref_labels=RL) if use_ref else loss(E, L)
    want = loop_log_ratio(E, L.tolist(), R, RL.tolist(), c, omega, eps, not use_ref, one_sided)
    check_value_and_grad(got, want, [E, R] if use_ref else [E])


@pytest.mark.parametrize("one_sided", [False, True])
def test_log_ratio_nk_labels_gradcheck(one_sided):
    E, L, R, RL = three_level_batch(0.1, True, seed=3)
    E, R = E.detach().requires_grad_(), R.detach().requires_grad_()
    loss = HierarchicalLogRatioLoss(omega=3.0 if one_sided else 1.2, one_sided=one_sided, train_radius=True,
                                    distance=PoincareDistance(c=0.1))
    assert torch.autograd.gradcheck(lambda e, r: loss(e, L, ref_emb=r, ref_labels=RL), (E, R))
    assert torch.autograd.gradcheck(lambda e: loss(e, L), (E,))


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("use_ref", [False, True])
@pytest.mark.parametrize("delta", [None, 0.0, 0.7])
def test_margin_nk_labels_vs_loop(c, use_ref, delta):
    E, L, R, RL = three_level_batch(c, use_ref, seed=1)
    loss = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.1, level_gamma=delta,
                                  distance=PoincareDistance(c=c)).double()
    got = loss(E, L, ref_emb=R, ref_labels=RL) if use_ref else loss(E, L)
    want = loop_margin(E, L.tolist(), R, RL.tolist(), c, 0.1, 0.1 if delta is None else delta, not use_ref)
    check_value_and_grad(got, want, [E, R] if use_ref else [E])


def test_margin_nk_labels_with_indices_tuple_vs_loop():
    E, L, _, _ = three_level_batch(0.1, False, seed=2)
    a = torch.tensor([0, 0, 2, 5, 7])
    p = torch.tensor([1, 1, 3, 4, 6])
    n = torch.tensor([2, 11, 9, 0, 10])
    loss = HierarchicalMarginLoss(margin_form="contrastive", num_classes=6, gamma=0.1, level_gamma=0.5).double()
    got = loss(E, L, (a, p, n))
    # PML turns a triplet tuple into its unique (anchor, positive) and (anchor, negative) pairs
    pos = sorted(set(zip(a.tolist(), p.tolist())))
    neg = sorted(set(zip(a.tolist(), n.tolist())))
    want = loop_margin(E, L.tolist(), E, L.tolist(), 0.1, 0.1, 0.5, True, pairs=(pos, neg))
    check_value_and_grad(got, want, [E])


def test_margin_nk_labels_gradcheck():
    # the class means are detached by design (margins are constants for the gradient), so the
    # finite differences must not move them: estimate once in training mode, then freeze (eval)
    E, L, R, RL = three_level_batch(0.1, True, seed=4)
    E, R = E.detach().requires_grad_(), R.detach().requires_grad_()
    loss = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.1, level_gamma=0.5).double()
    loss(E, L, ref_emb=R, ref_labels=RL)
    loss.eval()
    assert torch.autograd.gradcheck(lambda e, r: loss(e, L, ref_emb=r, ref_labels=RL), (E, R))
    assert torch.autograd.gradcheck(lambda e: loss(e, L), (E,))


def test_margin_single_level_matrix_equals_flat_labels():
    E, L, R, RL = three_level_batch(0.1, True, seed=5)
    kw = dict(num_classes=8, gamma=0.1, level_gamma=0.9)
    flat = HierarchicalMarginLoss(margin_form="contrastive", **kw).double()(E, L[:, 0], ref_emb=R, ref_labels=RL[:, 0])
    as_nk = HierarchicalMarginLoss(margin_form="contrastive", **kw).double()(E, L[:, :1], ref_emb=R, ref_labels=RL[:, :1])
    no_growth = HierarchicalMarginLoss(margin_form="contrastive", num_classes=8, gamma=0.1, level_gamma=0.0).double()(
        E, L, ref_emb=R, ref_labels=RL)
    assert torch.allclose(flat, as_nk, atol=1e-12) and torch.allclose(flat, no_growth, atol=1e-12)
    grown = HierarchicalMarginLoss(margin_form="contrastive", **kw).double()(E, L, ref_emb=R, ref_labels=RL)
    assert float(grown.detach()) > float(flat.detach())  # the coarser-level negatives get larger margins


def test_margin_nk_labels_running_estimates_use_class_column():
    """The EMA buffers see column 0 only: (N, K) and 1-D training leave the same buffers."""
    E, L, _, _ = three_level_batch(0.1, False, seed=6)
    a, b = HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=6).double(), HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=6).double()
    for step in range(2):
        a(E + 0.01 * step, L)
        b(E + 0.01 * step, L[:, 0])
    assert torch.equal(a.intra_mean, b.intra_mean) and torch.equal(a.inter_mean, b.inter_mean)


def test_hierarchical_losses_bad_arguments():
    E = ball_points(6, 4, 0.1, 0)
    L = torch.stack([torch.arange(6) // 2, torch.arange(6) // 4], 1)
    log_ratio = HierarchicalLogRatioLoss()
    margin = HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3)
    for loss in (log_ratio, margin):
        with pytest.raises(ValueError, match="labels"):
            loss(E, L[:5])  # wrong number of rows
        with pytest.raises(ValueError, match="labels"):
            loss(E, L.view(6, 2, 1))  # 3-D
        with pytest.raises(ValueError, match="labels"):
            loss(E, L[:, :0])  # K = 0
        with pytest.raises(ValueError, match="ref_labels"):
            loss(E, L, ref_emb=E, ref_labels=L[:4])
        with pytest.raises(ValueError, match="ref_labels"):
            loss(E, L, ref_emb=E, ref_labels=torch.cat([L, L[:, :1]], 1))  # different K
    with pytest.raises(ValueError, match="labels"):
        margin(E, L.double())  # float labels
    with pytest.raises(ValueError, match="labels"):
        margin(E, L + 3)  # class column outside [0, num_classes)
    for omega in (1.0, 0.5, 0.0, -2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="omega"):
            HierarchicalLogRatioLoss(omega=omega)
    for eps in (0.0, -1e-6, float("nan")):
        with pytest.raises(ValueError, match="eps"):
            HierarchicalLogRatioLoss(eps=eps)
    for bad in (-0.1, float("nan"), "x"):
        with pytest.raises(ValueError, match="level_gamma"):
            HierarchicalMarginLoss(margin_form="contrastive", num_classes=3, level_gamma=bad)


def test_hierarchical_losses_defaults_pinned():
    """The defaults chosen on the validation split (see the docstrings / bench/log_ratio_omega.py);
    the paper's Ω = 10 stays available explicitly."""
    loss = HierarchicalLogRatioLoss()
    assert loss.omega == 1.2 and loss.eps == 1e-6
    assert isinstance(loss.distance, PoincareDistance)
    assert HierarchicalLogRatioLoss(omega=10.0).omega == 10.0
    margin = HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3)
    assert margin.gamma == 0.1 and margin.level_gamma == 0.1 and margin.momentum == 0.9  # δ follows γ
    assert HierarchicalMarginLoss(margin_form="contrastive", num_classes=3, gamma=0.3).level_gamma == 0.3


# ------------------------------------------------------------------------------------------------
# margin_form="triplet" (the default): [D_ij − D_il + M_n(i, l)]_+ over (anchor, positive, negative)
# ------------------------------------------------------------------------------------------------
def loop_margin_triplet(E, L, R, RL, c, gamma, delta, self_ref, reduce="avg_nonzero"):
    """Fresh triplet-form HierarchicalMarginLoss: the class means as in ``loop_margin``; every
    (i, j, l) with y_i = y_j, y_i ≠ y_l; hinge D_ij − D_il + d_{y_i y_l} − d_{y_i} + γ + δ(s_il − 2)."""
    y, ry = [row[0] for row in L], [row[0] for row in RL]
    mean = loop_class_means(E, R, y, ry, c, self_ref)
    hinges = []
    for i in range(len(E)):
        da = mean.get((y[i], y[i]), 0.0)
        for j in range(len(R)):
            if (self_ref and i == j) or y[i] != ry[j]:
                continue
            for l in range(len(R)):
                if y[i] == ry[l]:
                    continue
                s = loop_level(L[i], RL[l])
                m = mean[y[i], ry[l]] - da + gamma + delta * (s - 2)
                hinges.append(torch.relu(loop_poincare(E[i], R[j], c) - loop_poincare(E[i], R[l], c) + m))
    if reduce == "mean":
        return sum(hinges) / len(hinges)
    nz = [t for t in hinges if t > 0]
    return sum(nz) / len(nz) if nz else sum(hinges) * 0


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("use_ref", [False, True])
@pytest.mark.parametrize("flat", [False, True])
def test_margin_triplet_form_vs_loop(c, use_ref, flat):
    E, L, R, RL = three_level_batch(c, use_ref, seed=1)
    loss = HierarchicalMarginLoss(num_classes=8, gamma=0.3, level_gamma=0.2, distance=PoincareDistance(c=c)).double()
    assert loss.margin_form == "triplet"
    if flat:
        L, RL = L[:, :1], RL[:, :1]
    got = loss(E, L, ref_emb=R, ref_labels=RL) if use_ref else loss(E, L)
    want = loop_margin_triplet(E, L.tolist(), R, RL.tolist(), c, 0.3, 0.2, not use_ref)
    check_value_and_grad(got, want, [E, R] if use_ref else [E])
    if flat:  # 1-D labels: the same loss
        fresh = HierarchicalMarginLoss(num_classes=8, gamma=0.3, distance=PoincareDistance(c=c)).double()
        got1 = fresh(E, L[:, 0], ref_emb=R, ref_labels=RL[:, 0]) if use_ref else fresh(E, L[:, 0])
        assert torch.allclose(got1, want, atol=1e-6, rtol=1e-6)


def test_margin_triplet_form_listed_reducer_vs_loop():
    from pytorch_metric_learning.reducers import MeanReducer

    E, L, R, RL = three_level_batch(0.1, True, seed=7)
    loss = HierarchicalMarginLoss(num_classes=8, gamma=0.5, level_gamma=0.4, reducer=MeanReducer()).double()
    got = loss(E, L, ref_emb=R, ref_labels=RL)
    want = loop_margin_triplet(E, L.tolist(), R, RL.tolist(), 0.1, 0.5, 0.4, False, reduce="mean")
    check_value_and_grad(got, want, [E, R])


def test_margin_triplet_form_gradcheck():
    E, L, R, RL = three_level_batch(0.1, True, seed=4)
    E, R = E.detach().requires_grad_(), R.detach().requires_grad_()
    loss = HierarchicalMarginLoss(num_classes=8, gamma=0.5, level_gamma=0.5).double()
    loss(E, L, ref_emb=R, ref_labels=RL)  # estimate the means once, then freeze them (eval)
    loss.eval()
    assert torch.autograd.gradcheck(lambda e, r: loss(e, L, ref_emb=r, ref_labels=RL), (E, R))
    assert torch.autograd.gradcheck(lambda e: loss(e, L[:, 0]), (E,))


def test_margin_form_bad_arguments():
    for bad in ("paper", "Triplet", None, 1, True):
        with pytest.raises(ValueError, match="margin_form"):
            HierarchicalMarginLoss(num_classes=3, margin_form=bad)
    assert HierarchicalMarginLoss(num_classes=3, margin_form="contrastive").sub_loss_names() == ["pos_loss", "neg_loss"]
    assert HierarchicalMarginLoss(num_classes=3).sub_loss_names() == ["triplet_loss"]


def test_margin_defaults_pinned():
    """Chosen on the validation split (class docstring); the paper's form stays available."""
    m = HierarchicalMarginLoss(num_classes=3)
    assert m.margin_form == "triplet" and m.gamma == 0.05 and m.level_gamma == 0.05 and m.momentum == 0.9
    assert isinstance(m.distance, PoincareDistance) and m.distance.c == 0.1
    paper = HierarchicalMarginLoss(num_classes=3, gamma=0.1, margin_form="contrastive")
    assert paper.margin_form == "contrastive" and paper.gamma == 0.1 and paper.sub_loss_names() == ["pos_loss", "neg_loss"]


def test_margin_triplet_form_indices_tuple_vs_loop():
    """A triplet tuple → PML's unique (anchor, positive) and (anchor, negative) pairs; every listed
    positive pair is combined with the same anchor's listed negatives; class means over all pairs."""
    E, L, _, _ = three_level_batch(0.1, False, seed=2)
    a = torch.tensor([0, 0, 2, 5, 7, 7])
    p = torch.tensor([1, 1, 3, 4, 6, 6])
    n = torch.tensor([2, 11, 9, 0, 10, 3])
    loss = HierarchicalMarginLoss(num_classes=6, gamma=0.2, level_gamma=0.5).double()
    got = loss(E, L, (a, p, n))
    Ll, y = L.tolist(), L[:, 0].tolist()
    sums, counts = {}, {}
    for i in range(12):
        for j in range(12):
            if i != j:
                key = (y[i], y[j])
                sums[key] = sums.get(key, 0.0) + loop_poincare(E[i], E[j], 0.1).detach()
                counts[key] = counts.get(key, 0) + 1
    mean = {k: sums[k] / counts[k] for k in sums}
    pos = sorted(set(zip(a.tolist(), p.tolist())))
    neg = sorted(set(zip(a.tolist(), n.tolist())))
    hinges = []
    for i, j in pos:
        for i2, l in neg:
            if i2 != i:
                continue
            m = mean[y[i], y[l]] - mean[y[i], y[i]] + 0.2 + 0.5 * (loop_level(Ll[i], Ll[l]) - 2)
            hinges.append(torch.relu(loop_poincare(E[i], E[j], 0.1) - loop_poincare(E[i], E[l], 0.1) + m))
    nz = [t for t in hinges if t > 0]
    want = sum(nz) / len(nz)
    check_value_and_grad(got, want, [E])
