"""View pairs, HypMix distance, PML miners, CrossBatchMemory, bad arguments, degenerate batches, autocast."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from pytorch_metric_learning.distances import CosineSimilarity
from pml_hyperbolic.losses import HyperbolicCrossBatchMemory as CrossBatchMemory
from pytorch_metric_learning.miners import MultiSimilarityMiner, TripletMarginMiner

from pml_hyperbolic.distances import MixedGeometryDistance, PoincareDistance
from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, HypMixLoss,
                                   PairwiseCrossEntropyLoss, UncertaintyAdaptiveContrastiveLoss,
                                   UncertaintyAdaptiveTripletLoss)
from pml_hyperbolic import poincare_ball as pb

from tests.losses import _loss_reference as ref


def all_losses():
    return [PairwiseCrossEntropyLoss(), HypMixLoss(), UncertaintyAdaptiveContrastiveLoss(),
            UncertaintyAdaptiveTripletLoss(),
            HierarchicalLogRatioLoss(omega=10.0, one_sided=False, train_radius=True),  # the references' form
            HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=64)]


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


# ---- independent float64 plain-loop references on explicit pair / triplet lists ----
C = 0.1


def ref_hypmix_dist(a, b, lam=3.0, c=C, tau_e=0.05, tau_h=0.2):
    """HypMix Eq. (12) from scratch: cosine distance / τ_e + λ d_c(exp0(u), exp0(u')) / τ_h, u = a/‖a‖
    (the head's clip at 2.3 and the ball projection are no-ops on unit vectors)."""
    ua, ub = a / a.norm(), b / b.norm()

    def exp0(u):
        return torch.tanh(math.sqrt(c) * u.norm()) * u / (math.sqrt(c) * u.norm())

    return (1 - ua @ ub) / tau_e + lam * ref.poincare(exp0(ua), exp0(ub), c) / tau_h


def ref_pair_ce(E, R, pos, neg, dfun, taus):
    """Mean over the distinct positive pairs (i, j) of −log softmax_k(−D_ik/τ_i)[j], k over the
    pairs (positive or negative) listed for anchor i."""
    cands = {}
    for i, k in list(pos) + list(neg):
        cands.setdefault(i, set()).add(k)
    cache = {}

    def D(i, k):
        if (i, k) not in cache:
            cache[i, k] = dfun(E[i], R[k])
        return cache[i, k]

    terms = []
    for i, j in sorted(set(pos)):
        den = sum(torch.exp(-D(i, k) / taus[i]) for k in sorted(cands[i]))
        terms.append(D(i, j) / taus[i] + torch.log(den))
    return sum(terms) / len(terms)


def uncertainty_factors(E):
    U = [ref.uncertainty_clip(e.detach(), C, 2.3) for e in E]
    umax = max(U)
    return [torch.log(u / umax + 1) for u in U]


def avg_non_zero(terms):
    nz = [t for t in terms if t > 0]
    return sum(nz) / len(nz) if nz else sum(terms) * 0


def ref_uat(E, R, triplets):
    """Hyp-UML Eq. (7) on the listed triplets, mean over the non-zero ones (AvgNonZeroReducer)."""
    f = uncertainty_factors(E)
    return avg_non_zero([torch.relu(ref.poincare(E[a], R[p], C) - ref.poincare(E[a], R[n], C) + f[a] * math.exp(C))
                         for a, p, n in triplets])


def ref_log_ratio(E, y, R, ry, triplets, omega=10.0, eps=1e-6):
    """Mean over the listed triplets of (log((D_aj + ε)/(D_al + ε)) − (s_aj − s_al) log Ω)²."""
    terms = []
    for a, j, l in triplets:
        s = ref.level([y[a]], [ry[j]]) - ref.level([y[a]], [ry[l]])
        ratio = torch.log(ref.poincare(E[a], R[j], C) + eps) - torch.log(ref.poincare(E[a], R[l], C) + eps)
        terms.append((ratio - s * math.log(omega)) ** 2)
    return sum(terms) / len(terms)


def ref_hmargin(E, y, pos, neg, gamma=0.1, R=None, ry=None, self_pairs=None):
    """Fresh HierarchicalMarginLoss: class-pair mean distances over all (query, reference) pairs
    except the self-pairs (detached; reference = the batch by default, self-pairs = the diagonal),
    hinges on the listed pairs only, each sub-loss AvgNonZero, summed."""
    R, ry = (E, y) if R is None else (R, ry)
    n, m = len(E), len(R)
    skip = {(i, i) for i in range(n)} if self_pairs is None else set(self_pairs)
    D = [[ref.poincare(E[i], R[j], C) if (i, j) not in skip else None for j in range(m)] for i in range(n)]
    means = {}
    for a in set(y) | set(ry):
        for b in set(y) | set(ry):
            vals = [D[i][j].detach() for i in range(n) for j in range(m)
                    if (i, j) not in skip and (y[i], ry[j]) in ((a, b), (b, a))]
            means[a, b] = sum(vals) / len(vals) if vals else None
    d_a = {a: means[a, a] if means[a, a] is not None else 0.0 for a in set(y)}
    pos_terms = [torch.relu(D[i][j] - (d_a[y[i]] + gamma)) for i, j in pos]
    neg_terms = [torch.relu(means[y[i], ry[j]] - d_a[y[i]] + gamma - D[i][j]) for i, j in neg]
    return avg_non_zero(pos_terms) + avg_non_zero(neg_terms)


def reference_loss(loss_idx, E, y, R, ry, pairs=None, triplets=None, self_pairs=None):
    """Reference value of loss ``loss_idx`` (see ``all_losses``) on exactly the given pairs
    ((pos, neg) lists) or triplets, E against R."""
    y, ry = y.tolist(), ry.tolist()
    if loss_idx == 0:
        return ref_pair_ce(E, R, *pairs, lambda a, b: ref.poincare(a, b, C), [0.2] * len(E))
    if loss_idx == 1:
        return ref_pair_ce(E, R, *pairs, ref_hypmix_dist, [1.0] * len(E))
    if loss_idx == 2:
        return ref_pair_ce(E, R, *pairs, lambda a, b: ref.poincare(a, b, C),
                           [torch.clamp(f * 0.3, min=0.05) for f in uncertainty_factors(E)])
    if loss_idx == 3:
        return ref_uat(E, R, triplets)
    if loss_idx == 4:
        return ref_log_ratio(E, y, R, ry, triplets)
    if R is E:
        return ref_hmargin(E, y, *pairs)
    return ref_hmargin(E, y, *pairs, R=R, ry=ry, self_pairs=self_pairs)


def pair_lists(t):
    a1, p, a2, n = (x.tolist() for x in t)
    return list(zip(a1, p)), list(zip(a2, n))


def triplet_list(t):
    return list(zip(*(x.tolist() for x in t)))


def test_pair_references_agree_with_dense_references():
    """The list-based references above against the dense ones of _loss_reference on all pairs."""
    E = embed(9, seed=5).double()
    y = torch.arange(3).repeat_interleave(3)
    yl = y.tolist()
    pos = [(i, j) for i in range(9) for j in range(9) if i != j and yl[i] == yl[j]]
    neg = [(i, j) for i in range(9) for j in range(9) if yl[i] != yl[j]]
    trip = [(a, p, n) for a, p in pos for i, n in neg if i == a]
    dense = {
        0: ref.pairwise_ce(E, yl, E, yl, lambda a, b: ref.poincare(a, b, C), 0.2, True),
        2: ref.adaptive_ce(E, yl, E, yl, C, lambda f: torch.clamp(f * 0.3, min=0.05), True),
        3: ref.adaptive_triplet(E, yl, E, yl, C, True),
        4: ref.log_ratio_dense(E, [[v] for v in yl], E, [[v] for v in yl], C, 10.0, 1e-6, True),  # balanced
        5: ref.hierarchical_margin(E, yl, E, yl, C, 0.1, True),
    }
    for idx, want in dense.items():
        got = reference_loss(idx, E, y, E, y, pairs=(pos, neg), triplets=trip)
        assert torch.allclose(got, want, atol=1e-12, rtol=1e-12), idx


def test_hypmix_learnable_lambda_gets_gradient():
    loss = HypMixLoss(learnable_lambda=True, lam=8.0)
    params = list(loss.parameters())
    assert len(params) == 1
    f = torch.randn(12, 8, requires_grad=True)
    loss(f, torch.arange(4).repeat_interleave(3)).backward()
    assert params[0].grad is not None and torch.isfinite(params[0].grad).all()
    assert torch.allclose(loss.distance.lam, torch.tensor([8.0]))
    assert bool((params[0].grad != 0).all()) and bool((f.grad != 0).any())
    # value and d/dρ (λ = exp ρ) against the from-scratch HypMix formula, in float64
    params[0].grad = None
    g = torch.Generator().manual_seed(1)
    f64 = torch.randn(12, 8, generator=g, dtype=torch.float64)
    y = torch.arange(4).repeat_interleave(3)
    got = loss(f64, y)
    got.backward()
    rho = params[0].detach().double().clone().requires_grad_()
    yl = y.tolist()
    pos = [(i, j) for i in range(12) for j in range(12) if i != j and yl[i] == yl[j]]
    neg = [(i, j) for i in range(12) for j in range(12) if yl[i] != yl[j]]
    want = ref_pair_ce(f64, f64, pos, neg, lambda a, b: ref_hypmix_dist(a, b, lam=rho.exp()), [1.0] * 12)
    (want_grad,) = torch.autograd.grad(want, rho)
    assert torch.allclose(got.double(), want, rtol=1e-5)
    assert torch.allclose(params[0].grad.double(), want_grad.view(1), rtol=1e-4, atol=1e-7)
    assert float(want_grad) != 0


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
    assert bool((z.grad != 0).any())


@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_indices_tuple_selects_exactly_those_tuples(loss_idx):
    """Loss on a miner's tuple and on a subset of it = the reference on exactly those pairs /
    triplets (value and gradient, float64); the subset gives another value."""
    z = embed(12).double()
    y = torch.arange(4).repeat_interleave(3)
    triplets = loss_idx in (3, 4)
    miner = TripletMarginMiner(margin=5.0, distance=PoincareDistance(c=C)) if triplets else \
        MultiSimilarityMiner(epsilon=10.0, distance=PoincareDistance(c=C))
    mined = miner(z, y)
    assert all(len(t) > 0 for t in mined)
    subset = tuple(t[::3] for t in mined) if triplets else (mined[0][::2], mined[1][::2], mined[2][::3], mined[3][::3])
    values = []
    for tup in (mined, subset):
        E = z.clone().requires_grad_()
        got = all_losses()[loss_idx].double()(E, y, indices_tuple=tup)  # fresh: no running state
        kw = dict(triplets=triplet_list(tup)) if triplets else dict(pairs=pair_lists(tup))
        want = reference_loss(loss_idx, E, y, E, y, **kw)
        assert torch.allclose(got, want, atol=1e-9, rtol=1e-7), (float(got), float(want))
        g_got, = torch.autograd.grad(got, E)
        g_want, = torch.autograd.grad(want, E)
        assert torch.allclose(g_got, g_want, atol=1e-8, rtol=1e-6)
        assert bool((g_got != 0).any())
        values.append(got.item())
    assert abs(values[0] - values[1]) > 1e-6, values


@pytest.mark.parametrize("loss_idx", range(6), ids=LOSS_IDS)
def test_cross_batch_memory(loss_idx):
    n, size = 12, 20
    loss = all_losses()[loss_idx].double()
    xbm = CrossBatchMemory(loss, embedding_size=8, memory_size=size)
    mem_e, mem_y, filled = torch.zeros(size, 8, dtype=torch.float64), torch.zeros(size, dtype=torch.long), 0
    for step in range(3):
        z = embed(n, seed=step).double().requires_grad_()
        y = torch.arange(4).repeat_interleave(3) + step
        out = xbm(z, y)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(z.grad).all()
        assert bool((z.grad != 0).any())
        # memory: a ring buffer of the last `size` batch entries, this batch written after the previous ones
        slots = [(n * step + i) % size for i in range(n)]
        mem_e[slots], mem_y[slots] = z.detach(), y
        filled = min(size, filled + n)
        assert xbm.queue_idx == n * (step + 1) % size and xbm.has_been_filled == (n * (step + 1) >= size)
        assert torch.equal(xbm.embedding_memory, mem_e) and torch.equal(xbm.label_memory, mem_y)
        # loss: the batch against the filled memory, every pair / triplet except the self-pairs
        R, ry = mem_e[:filled], mem_y[:filled]
        yl, ryl = y.tolist(), ry.tolist()
        pos = [(i, j) for i in range(n) for j in range(filled) if j != slots[i] and yl[i] == ryl[j]]
        neg = [(i, j) for i in range(n) for j in range(filled) if yl[i] != ryl[j]]
        plain = all_losses()[loss_idx].double()(z, y)  # fresh loss, batch only
        if step > 0:
            assert abs(out.item() - plain.item()) > 1e-6  # the memory adds other references
        if loss_idx == 5 and step > 0:
            # its class means are running averages across calls (momentum), which the fresh
            # reference does not keep; step 0 checks the self-copies in the memory are left out
            continue
        E = z.detach().clone().requires_grad_()
        trip = [(a, p, k) for a, p in pos for b, k in neg if b == a]
        want = reference_loss(loss_idx, E, y, R, ry, pairs=(pos, neg), triplets=trip,
                              self_pairs=[(i, slots[i]) for i in range(n)])
        assert torch.allclose(out.detach(), want.detach(), atol=1e-9, rtol=1e-7), (out.item(), want.item())
        assert torch.allclose(z.grad, torch.autograd.grad(want, E)[0], atol=1e-8, rtol=1e-6)
        if step == 0:  # memory = the batch itself: same as the plain loss (balanced classes)
            assert torch.allclose(out, plain, atol=1e-10, rtol=1e-9)


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
    assert all(bool((p.grad != 0).any()) for p in head.parameters())


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
        HierarchicalMarginLoss(margin_form="contrastive", num_classes=3, gamma=-1)
    with pytest.raises(ValueError, match="momentum"):
        HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3, momentum=1.0)
    with pytest.raises(ValueError, match="num_classes"):
        HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=0)
    z = embed(6)
    with pytest.raises(ValueError, match="labels"):
        HierarchicalLogRatioLoss()(z, torch.zeros(5, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="ref_labels"):
        HierarchicalLogRatioLoss()(z, torch.zeros(6, 2, dtype=torch.long), ref_emb=z, ref_labels=torch.zeros(6, 3))
    with pytest.raises(ValueError, match="labels"):
        HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3)(z, torch.arange(6))
    with pytest.raises(ValueError, match="labels"):
        PairwiseCrossEntropyLoss()(z, torch.arange(5))


def test_margin_loss_running_estimates_checkpoint_and_update():
    loss = HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3, momentum=0.5)
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
    fresh = HierarchicalMarginLoss(margin_form="contrastive", gamma=0.1, num_classes=3)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.inter_mean, loss.inter_mean)
    loss.eval()
    before = loss.intra_mean.clone()
    loss(z1, y)
    assert torch.equal(before, loss.intra_mean)


def test_log_ratio_hierarchical_levels_convention():
    from pml_hyperbolic.miners.hierarchy import pairwise_first_shared_level as similarity_levels
    L = torch.tensor([[0, 0], [0, 0], [1, 0], [2, 1]])
    s = similarity_levels(L, L)
    assert s[0, 1] == 1 and s[0, 2] == 2 and s[0, 3] == 3 and s[2, 3] == 3


class LargestAllocation(TorchDispatchMode):
    """Records the largest tensor storage (bytes) produced by any aten op, forward and backward."""

    def __init__(self):
        super().__init__()
        self.max_bytes, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > self.max_bytes:
                self.max_bytes, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def dense_log_ratio_per_anchor(z, levels, omega=10.0, eps=1e-6, c=C):
    """All dense triplets (i, j, l), s_ij < s_il, j, l != i: mean over (i, j) of the mean over l of
    the squared log-ratio residual, one anchor at a time (float64, no pml_hyperbolic code)."""
    z = z.detach().double()
    sq = (z * z).sum(1)
    K = levels.shape[1]
    total, n_pairs = torch.zeros((), dtype=torch.float64), 0
    for i in range(len(z)):
        d2 = ((z - z[i]) ** 2).sum(1)
        D = torch.acosh(1 + 2 * c * d2 / ((1 - c * sq[i]) * (1 - c * sq))) / math.sqrt(c)
        s = torch.full((len(z),), K + 1, dtype=torch.long)
        for k in reversed(range(K)):
            s[levels[:, k] == levels[i, k]] = k + 1
        s[i] = 0  # never a partner nor a farther sample
        logd = torch.log(D + eps)
        for t in range(1, K + 1):
            j, l = torch.where(s == t)[0], torch.where(s > t)[0]
            if len(j) == 0 or len(l) == 0:
                continue
            r = logd[j].view(-1, 1) - logd[l].view(1, -1) - (t - s[l].view(1, -1)).double() * math.log(omega)
            total = total + (r ** 2).mean(dim=1).sum()
            n_pairs += len(j)
    return total / n_pairs


def test_log_ratio_large_batch_memory_bounded():
    # B = 900 dense triplets (~6.5M of them) without enumerating B^3 of them
    B = 900
    z = embed(B, d=16).requires_grad_()
    y = torch.stack([torch.arange(100).repeat_interleave(9), torch.arange(100).repeat_interleave(9) // 10], 1)
    with LargestAllocation() as mem:  # counts allocations, not time: deterministic
        out = HierarchicalLogRatioLoss(omega=10.0, one_sided=False)(z, y)
        out.backward()
    assert torch.isfinite(out) and torch.isfinite(z.grad).all() and bool((z.grad != 0).any())
    # O(B²): at most a few (B, B) float64 matrices, never a (B, B, ·) tensor (one per triplet = B³)
    assert mem.max_bytes <= 4 * B * B * 8, (mem.max_bytes, mem.op)
    # and the value is the dense per-anchor mean over all triplets
    want = dense_log_ratio_per_anchor(z, y)
    assert torch.allclose(HierarchicalLogRatioLoss(omega=10.0, one_sided=False)(z.detach().double(), y), want, rtol=1e-9)
    assert torch.allclose(out.detach().double(), want, rtol=1e-4)


def test_sphere_baseline_cosine():
    z = torch.randn(12, 8)
    y = torch.arange(4).repeat_interleave(3)
    out = PairwiseCrossEntropyLoss(temperature=0.1, distance=CosineSimilarity())(z, y)
    assert torch.isfinite(out) and out > 0
    # Hyp-ViT's "Sph-" baseline: mean over positive pairs (i, j) of −log softmax_{k≠i}(cos_ik / τ)[j]
    zd = z.double()
    cos = [[float(zd[i] @ zd[k] / (zd[i].norm() * zd[k].norm())) for k in range(12)] for i in range(12)]
    terms = [-cos[i][j] / 0.1 + math.log(sum(math.exp(cos[i][k] / 0.1) for k in range(12) if k != i))
             for i in range(12) for j in range(12) if i != j and y[i] == y[j]]
    assert len(terms) == 24
    assert float(out) == pytest.approx(sum(terms) / len(terms), rel=1e-5)
