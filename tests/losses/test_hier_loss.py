"""HIERLoss: arguments, dtypes, an independent loop reference, gradients, miners, training."""
import math

import numpy as np
import pytest
import torch
from pytorch_metric_learning.miners import BatchHardMiner, PairMarginMiner
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch.func import functional_call

from pml_hyperbolic.losses import HIERLoss

from tests.losses._loss_reference import poincare


def ball_points(n, d, c, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    r = (0.1 + 0.7 * torch.rand(n, 1, generator=g, dtype=torch.float64)) / math.sqrt(c)
    return (v / v.norm(dim=1, keepdim=True) * r).to(dtype)


def make_loss(d, p, c=0.1, seed=0, proxy_std=0.5, **kw):
    torch.manual_seed(seed)
    loss = HIERLoss(embedding_size=d, num_proxies=p, c=c, proxy_init_std=proxy_std, **kw)
    return loss


# ---- independent slow reference (plain loops, own maps and distances) ---------------------------

def ref_proxies_in_ball(V, c, clip_r):
    out = []
    for v in V:
        n = v.norm()
        if clip_r is not None and n > clip_r:
            v = v * (clip_r / n)
            n = v.norm()
        u = math.sqrt(c) * n
        out.append(v * (torch.tanh(u) / u))
    return out


def ref_dist(x, y, c):
    return poincare(x, y, c) if not torch.equal(x, y) else x.new_zeros(())


def ref_mutual_nn(D, k):
    """D: list of lists (square, self excluded). Returns set of (i, j) mutual k-NN pairs."""
    n = len(D)
    knn = [set(sorted((j for j in range(n) if j != i), key=lambda j: float(D[i][j]))[:k]) for i in range(n)]
    return {(i, j) for i in range(n) for j in range(n) if i != j and j in knn[i] and i in knn[j]}


def ref_lca(Dpts, members):
    """argmin over candidates of the max distance; lowest index on ties (Python's min)."""
    P = len(Dpts[members[0]])
    return min(range(P), key=lambda p: max(float(Dpts[m][p]) for m in members))


def ref_triplet_mean(Dpts, triplets, delta):
    terms = []
    for i, j, k in triplets:
        a, b = ref_lca(Dpts, [i, j]), ref_lca(Dpts, [i, j, k])
        if a == b:
            continue
        terms.append(torch.relu(Dpts[i][a] - Dpts[i][b] + delta) + torch.relu(Dpts[j][a] - Dpts[j][b] + delta)
                     + torch.relu(Dpts[k][b] - Dpts[k][a] + delta))
    return sum(terms) / len(terms) if terms else 0.0


def ref_hier(E, y, V, c, clip_r, delta, positives, nn_k, proxy_term, proxy_k):
    prox = ref_proxies_in_ball(V, c, clip_r)
    n = len(E)
    Dep = [[poincare(E[i], prox[p], c) for p in range(len(prox))] for i in range(n)]
    Dee = [[ref_dist(E[i], E[j], c) for j in range(n)] for i in range(n)]
    mutual = ref_mutual_nn(Dee, nn_k) if positives == "labels+mutual_nn" else set()
    trip = []
    for i in range(n):
        for j in range(n):
            if j == i or not (y[i] == y[j] or (i, j) in mutual):
                continue
            for k in range(n):
                if k != i and y[k] != y[i] and (i, k) not in mutual:
                    trip.append((i, j, k))
    total = ref_triplet_mean(Dep, trip, delta)
    if proxy_term:
        P = len(prox)
        Dpp = [[ref_dist(prox[a], prox[b], c) for b in range(P)] for a in range(P)]
        pos = ref_mutual_nn(Dpp, proxy_k)
        ptrip = [(i, j, k) for i in range(P) for j in range(P) if (i, j) in pos
                 for k in range(P) if k != i and (i, k) not in pos]
        total = total + ref_triplet_mean(Dpp, ptrip, delta)
    return total


# ---- tests ------------------------------------------------------------------------------------


def _check_against_reference_triplet_loss(out, got, E, loss, di, dj, dk, w1, w2, margin=0.1):
    """HIER's per-triplet value and gradients against the step-by-step formula: with the LCA weights w1
    (of i, j) and w2 (of i, j, k), relu(d_i·w1 − d_i·w2 + m) + relu(d_j·w1 − d_j·w2 + m) + relu(d_k·w2 − d_k·w1 + m)."""
    def dd(x, w):
        return (x * w).sum(1)

    want_val = (torch.relu(dd(di, w1) - dd(di, w2) + margin) + torch.relu(dd(dj, w1) - dd(dj, w2) + margin)
                + torch.relu(dd(dk, w2) - dd(dk, w1) + margin))
    assert torch.allclose(want_val, out["losses"].detach(), atol=1e-12)
    want = torch.autograd.grad(want_val.mean(), [E, loss.proxies])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-10)

def test_smoke_default():
    torch.manual_seed(0)
    loss = HIERLoss(embedding_size=16)
    assert loss.proxies.shape == (512, 16) and loss.num_proxies == 512
    x = ball_points(24, 16, 0.1, 1, torch.float32).requires_grad_()
    y = torch.arange(6).repeat_interleave(4)
    out = loss(x, y)
    assert out.ndim == 0 and torch.isfinite(out) and out > 0
    assert loss.proxies_in_ball().norm(dim=1).max() < 1 / math.sqrt(0.1)
    assert "HIERLoss" in __import__("pml_hyperbolic.losses", fromlist=["__all__"]).__all__


@pytest.mark.parametrize("kwargs,name", [
    (dict(num_proxies=0), "num_proxies"), (dict(num_proxies=-3), "num_proxies"),
    (dict(num_proxies=2.5), "num_proxies"), (dict(margin=-0.1), "margin"), (dict(c=-1.0), "c"),
    (dict(c=0.0), "c"), (dict(c=float("nan")), "c"), (dict(c="a"), "c"), (dict(tau=0), "tau"),
    (dict(clip_r=0), "clip_r"), (dict(positives="mutual"), "positives"), (dict(max_triplets=0), "max_triplets"),
    (dict(embedding_size=0), "embedding_size"), (dict(distance=object()), "distance"),
])
def test_bad_arguments(kwargs, name):
    args = dict(embedding_size=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=name):
        HIERLoss(**args)


def test_bad_inputs():
    loss = make_loss(4, 8)
    y = torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="embedding_size"):
        loss(torch.zeros(4, 5), y)
    x = ball_points(4, 4, 0.1, 0, torch.float32)
    x[1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        loss(x, y)
    with pytest.raises(ValueError, match="labels"):
        loss(ball_points(4, 4, 0.1, 0, torch.float32))
    with pytest.raises(ValueError, match="indices_tuple"):
        loss(ball_points(4, 4, 0.1, 0, torch.float32), y, indices_tuple=(y, y))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    loss = make_loss(8, 16)
    if dtype == torch.float64:
        loss = loss.double()
    x = ball_points(12, 8, 0.1, 3, dtype).requires_grad_()
    y = torch.arange(4).repeat_interleave(3)
    out = loss(x, y)
    assert out.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    assert torch.isfinite(out)
    out.backward()
    assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("positives", ["labels", "labels+mutual_nn"])
@pytest.mark.parametrize("proxy_term", [False, True])
def test_reference_value(c, positives, proxy_term):
    d, p = 3, 7
    loss = make_loss(d, p, c=c, seed=1, proxy_std=0.6, positives=positives, mutual_nn_k=2,
                     proxy_term=proxy_term, proxy_nn_k=2, stochastic_lca=False, clip_r=1.0).double()
    E = ball_points(8, d, c, 5)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    got = loss(E, y)
    want = ref_hier(E, y.tolist(), loss.proxies.detach(), c, 1.0, 0.1, positives, 2, proxy_term, 2)
    assert abs(float(got.detach()) - float(want)) < 1e-6, (float(got.detach()), float(want))
    assert float(got.detach()) > 0


@pytest.mark.parametrize("positives", ["labels", "labels+mutual_nn"])
def test_gradcheck_embeddings_and_proxies(positives):
    """The hard (forward) path's exact gradient: with a tiny tau the straight-through softmax term
    contributes ~exp(-gap/tau) = 0, so analytical and numerical Jacobians must agree."""
    d, p = 3, 5
    loss = make_loss(d, p, seed=2, proxy_std=0.8, positives=positives, mutual_nn_k=2, proxy_nn_k=2,
                     stochastic_lca=False, tau=1e-4).double()
    E = ball_points(6, d, 0.1, 7).requires_grad_()
    V = loss.proxies.detach().clone().requires_grad_()
    y = torch.tensor([0, 0, 1, 1, 2, 2])

    def f(e, v):
        return functional_call(loss, {"proxies": v}, (e, y))

    assert float(f(E, V).detach()) > 0
    assert torch.autograd.gradcheck(f, (E, V), eps=1e-6, atol=1e-6, rtol=1e-5)


def test_straight_through_gradient_matches_naive_formula():
    """The combined zero-valued softmax term gives the same gradient as the textbook estimator
    d(x, rho) = sum_p (onehot_p + pi_p - sg(pi_p)) d(x, p) applied to each of the six distances."""
    d, p, tau = 3, 6, 0.5
    loss = make_loss(d, p, seed=6, proxy_std=0.8, proxy_term=False, stochastic_lca=False, tau=tau).double()
    E = ball_points(8, d, 0.1, 31).requires_grad_()
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    out = loss.compute_loss(E, y, None, E, y)["loss"]
    a, pp, n = out["indices"]
    got = torch.autograd.grad(out["losses"].mean(), [E, loss.proxies])

    from pml_hyperbolic import poincare_ball as pb
    D = pb.pairwise_dist(E, loss.proxies_in_ball(), 0.1)
    di, dj, dk = D[a], D[pp], D[n]
    m_ij = torch.maximum(di, dj)
    m_ijk = torch.maximum(m_ij, dk)

    def st(m):
        s = torch.softmax(-m / tau, dim=1)
        return torch.nn.functional.one_hot(m.argmin(1), p).to(s.dtype) + s - s.detach()

    w1, w2 = st(m_ij), st(m_ijk)
    _check_against_reference_triplet_loss(out, got, E, loss, di, dj, dk, w1, w2)
    assert loss.proxies.grad is None and got[1].abs().sum() > 0


def test_stochastic_gradient_matches_naive_gumbel_formula(monkeypatch):
    """Training mode: the same Gumbel noise fed to the per-op textbook estimator (hard Gumbel-softmax,
    g = −log(−log U)) gives the same losses and gradients as the fused exponential-race form (the
    native loop here, which generates its draws from the counter: recomputed below from the key)."""
    from pml_hyperbolic.losses import hier_loss

    keys = []
    real_source = hier_loss._noise_source

    def recording_source(device, seed=None):
        source, used_seed = real_source(device, seed)
        keys.append(source.key)
        return source, used_seed

    monkeypatch.setattr(hier_loss, "_noise_source", recording_source)
    d, p, tau = 3, 6, 0.5
    loss = make_loss(d, p, seed=6, proxy_std=0.8, proxy_term=False, tau=tau).double()
    assert loss.training and loss.stochastic_lca
    E = ball_points(8, d, 0.1, 31).requires_grad_()
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    out = loss.compute_loss(E, y, None, E, y)["loss"]
    a, pp, n = out["indices"]
    got = torch.autograd.grad(out["losses"].mean(), [E, loss.proxies])
    assert len(keys) == 1  # one call: streams 2t (LCA(i, j)) and 2t + 1 (LCA(i, j, k)) of triplet row t
    from pml_hyperbolic import poincare_ball as pb
    D = pb.pairwise_dist(E, loss.proxies_in_ball(), 0.1)
    # the kept rows of the (T, P) draws: recompute every triplet's row id from the kept triplets
    all_a, all_p, all_n = hier_loss._triplets_from_masks(
        (y.view(-1, 1) == y.view(1, -1)) & ~torch.eye(8, dtype=torch.bool), y.view(-1, 1) != y.view(1, -1), 8192)
    key = lambda *t: (t[0] * 64 + t[1]) * 64 + t[2]  # noqa: E731
    row = {int(k): r for r, k in enumerate(key(all_a, all_p, all_n))}
    rows = torch.tensor([row[int(k)] for k in key(a, pp, n)])
    streams = 2 * np.arange(all_a.numel(), dtype=np.uint64)
    u1 = hier_loss.counter_uniform(keys[0], streams, p, torch.float64)[rows]
    u2 = hier_loss.counter_uniform(keys[0], streams + np.uint64(1), p, torch.float64)[rows]
    di, dj, dk = D[a], D[pp], D[n]
    m_ij = torch.maximum(di, dj)
    m_ijk = torch.maximum(m_ij, dk)

    def st(m, u):
        z = -m / tau - torch.log(-torch.log(u))
        s = torch.softmax(z, dim=1)
        return torch.nn.functional.one_hot(z.argmax(1), p).to(s.dtype) + s - s.detach()

    w1, w2 = st(m_ij, u1), st(m_ijk, u2)
    _check_against_reference_triplet_loss(out, got, E, loss, di, dj, dk, w1, w2)


def test_blocked_equals_one_block(monkeypatch):
    """The (T, P) work runs in blocks of rows; any block size gives the same losses and gradients."""
    from pml_hyperbolic.losses import hier_loss

    E = ball_points(12, 4, 0.1, 13).requires_grad_()
    y = torch.arange(4).repeat_interleave(3)
    results = []
    for elements in (1 << 18, 9 * 5, 1):  # one block; 5 rows per block; one row per block
        monkeypatch.setattr(hier_loss, "_BLOCK_ELEMENTS", elements)
        loss = make_loss(4, 9, seed=3, stochastic_lca=False, proxy_nn_k=2).double()
        out = loss(E, y)
        results.append((out.detach(), torch.autograd.grad(out, [E, loss.proxies])))
    for val, grads in results[1:]:
        assert torch.allclose(val, results[0][0], atol=1e-12)
        for a, b in zip(grads, results[0][1]):
            assert torch.allclose(a, b, atol=1e-12)


def test_stochastic_reproducible_and_checkpoint_redraws_same_noise(monkeypatch):
    """torch.manual_seed fixes the Gumbel noise (drawn by numpy, seeded from torch's generator), and
    the chunked path's recomputation in backward (activation checkpointing) redraws the same noise:
    its gradients equal those of running the chunks without checkpointing."""
    from pml_hyperbolic.losses import hier_loss

    E = ball_points(16, 6, 0.1, 3).requires_grad_()
    y = torch.arange(4).repeat_interleave(4)

    def run(chunk):
        loss = make_loss(6, 12, seed=2, chunk_size=chunk, proxy_nn_k=3).double()
        torch.manual_seed(11)
        out = loss(E, y)
        return out.detach(), torch.autograd.grad(out, [E, loss.proxies])

    v1, g1 = run(10_000)
    v2, g2 = run(10_000)
    assert torch.equal(v1, v2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    v3, g3 = run(17)  # several chunks, checkpointed
    monkeypatch.setattr(hier_loss, "checkpoint", lambda fn, *args, **kw: fn(*args))
    v4, g4 = run(17)  # the same chunks, kept in memory
    assert torch.equal(v3, v4)
    for a, b in zip(g3, g4):
        assert torch.allclose(a, b, atol=1e-12)


def test_first_index_of_is_argmax_with_lowest_index_on_ties():
    from pml_hyperbolic.losses.hier_loss import _first_index_of

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (50, 37), generator=g).float()  # many ties
    assert torch.equal(_first_index_of(x, x.amax(1, keepdim=True)), x.argmax(1))
    assert torch.equal(_first_index_of(x, x.amin(1, keepdim=True)), x.argmin(1))
    y = torch.randn(20, 600, generator=g, dtype=torch.float64)
    assert torch.equal(_first_index_of(y, y.amax(1, keepdim=True)), y.argmax(1))
    assert _first_index_of(torch.zeros(2, 5), torch.zeros(2, 1)).tolist() == [0, 0]


def test_gradients_reach_proxies_and_embeddings_stochastic():
    loss = make_loss(8, 32, proxy_std=0.05)
    assert loss.training and loss.stochastic_lca
    x = ball_points(16, 8, 0.1, 11, torch.float32).requires_grad_()
    y = torch.arange(4).repeat_interleave(4)
    loss(x, y).backward()
    for g in (x.grad, loss.proxies.grad):
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    # the soft (straight-through) part reaches proxies that were not selected as an LCA too
    assert (loss.proxies.grad.abs().sum(dim=1) > 0).sum() > 2


def test_chunked_equals_unchunked():
    E = ball_points(10, 4, 0.1, 13).requires_grad_()
    y = torch.arange(5).repeat_interleave(2)
    grads, vals = [], []
    for chunk in (10_000, 7):
        loss = make_loss(4, 9, seed=3, stochastic_lca=False, chunk_size=chunk, proxy_nn_k=2).double()
        out = loss(E, y)
        vals.append(out.detach())
        grads.append(torch.autograd.grad(out, [E, loss.proxies]))
    assert torch.allclose(vals[0], vals[1], atol=1e-12)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-12)


def test_zero_when_no_triplet():
    loss = make_loss(4, 8, proxy_term=False)
    x = ball_points(5, 4, 0.1, 0, torch.float32).requires_grad_()
    y = torch.arange(5)  # all labels distinct: no positive pair
    assert loss.compute_loss(x, y, None, x, y) == loss.zero_losses()
    out = loss(x, y)
    assert float(out.detach()) == 0.0
    out.backward()  # still differentiable (PML's zero loss)
    # with the proxy term the batch sub-loss is zero, the proxies' is not
    loss2 = make_loss(4, 8, proxy_nn_k=2)
    d = loss2.compute_loss(x, y, None, x, y)
    assert d["loss"] == loss2.zero_loss() and float(d["proxy_loss"]["losses"].detach()) > 0


def test_miner_indices_tuple():
    loss = make_loss(4, 8, seed=4, stochastic_lca=False)
    x = ball_points(12, 4, 0.1, 17, torch.float32).requires_grad_()
    y = torch.arange(4).repeat_interleave(3)
    # all triplets as an indices tuple = the default label triplets
    full = lmu.get_all_triplets_indices(y)
    assert torch.allclose(loss(x, y, indices_tuple=full), loss(x, y), atol=1e-6)
    for miner in (BatchHardMiner(), PairMarginMiner(pos_margin=0.0, neg_margin=100.0)):
        out = loss(x, y, indices_tuple=miner(x, y))
        assert torch.isfinite(out)
    # max_triplets subsamples a long tuple
    small = make_loss(4, 32, seed=4, stochastic_lca=False, max_triplets=20, proxy_term=False)
    d = small.compute_loss(x, y, full, x, y)
    assert 0 < d["loss"]["losses"].numel() <= 20


def test_ref_emb_copy_matches_batch():
    loss = make_loss(4, 8, seed=5, stochastic_lca=False)
    x = ball_points(9, 4, 0.1, 19)
    y = torch.arange(3).repeat_interleave(3)
    loss = loss.double()
    for positives in ("labels", "labels+mutual_nn"):
        loss.positives = positives
        a = loss(x, y)
        b = loss(x, y, ref_emb=x.clone(), ref_labels=y)
        assert torch.allclose(a, b, atol=1e-12)


def test_sampling_bounds_triplets():
    loss = make_loss(4, 16, max_triplets=50, max_proxy_triplets=40, stochastic_lca=False)
    x = ball_points(32, 4, 0.1, 23, torch.float32)
    y = torch.arange(8).repeat_interleave(4)  # 32·3·28 = 2688 triplets
    d = loss.compute_loss(x, y, None, x, y)
    a, p, n = d["loss"]["indices"]
    assert a.numel() <= 50
    assert (y[a] == y[p]).all() and (y[a] != y[n]).all() and (a != p).all()
    assert torch.isfinite(d["proxy_loss"]["losses"])


def test_curvature_stored_by_reference():
    c = torch.nn.Parameter(torch.tensor(0.1))
    loss = make_loss(4, 8, c=c, stochastic_lca=False)
    assert loss._c is c
    x = ball_points(8, 4, 0.5, 29, torch.float32)
    y = torch.arange(4).repeat_interleave(2)
    out = loss(x, y)
    out.backward()
    assert c.grad is not None and torch.isfinite(c.grad)
    before = loss.proxies_in_ball().detach().clone()
    with torch.no_grad():
        c.fill_(0.5)  # read at every forward
    assert not torch.allclose(loss.proxies_in_ball(), before)
    assert torch.isfinite(loss(x, y))
    hypll = pytest.importorskip("hypll.manifolds.poincare_ball")
    ball = hypll.PoincareBall(hypll.Curvature(0.1))
    loss_h = make_loss(4, 8, c=ball, stochastic_lca=False)
    assert loss_h._c is ball and torch.isfinite(loss_h(x, y))


def test_training_two_level_hierarchy():
    """Adam on free embeddings + proxies of a 2-level hierarchy (4 super × 2 sub classes): the loss
    goes down, and LCAs of same-class pairs sit deeper (farther from the origin) than LCAs of
    triplets across superclasses."""
    torch.manual_seed(0)
    d, n_super, n_sub, m = 8, 4, 2, 4
    centers = torch.randn(n_super, d) * 1.5
    sub = centers.repeat_interleave(n_sub, 0) + 0.5 * torch.randn(n_super * n_sub, d)
    y = torch.arange(n_super * n_sub).repeat_interleave(m)
    tangent = (sub[y] + 0.1 * torch.randn(len(y), d)).requires_grad_()
    from pml_hyperbolic.heads import ToPoincare
    to_ball = ToPoincare(c=0.1, clip_r=2.3)
    loss = make_loss(d, 32, proxy_std=0.05, stochastic_lca=False, proxy_nn_k=3)
    opt = torch.optim.Adam([tangent, loss.proxies], lr=0.05)
    history = []
    for _ in range(60):
        opt.zero_grad()
        out = loss(to_ball(tangent), y)
        out.backward()
        opt.step()
        history.append(float(out.detach()))
    assert sum(history[-10:]) / 10 < 0.7 * sum(history[:5]) / 5, history
    with torch.no_grad():
        emb = to_ball(tangent)
        prox = loss.proxies_in_ball()
        from pml_hyperbolic import poincare_ball as pb
        D = pb.pairwise_dist(emb, prox, 0.1)
        depth = pb.dist0(prox, 0.1)
        sup = y // n_sub
        same = [(i, j) for i in range(len(y)) for j in range(len(y)) if i != j and y[i] == y[j]]
        cross = [(i, j, k) for (i, j) in same[::3] for k in range(len(y)) if sup[k] != sup[i]]
        leaf = torch.stack([depth[torch.maximum(D[i], D[j]).argmin()] for i, j in same]).mean()
        root = torch.stack([depth[torch.maximum(torch.maximum(D[i], D[j]), D[k]).argmin()]
                            for i, j, k in cross]).mean()
    assert leaf > root, (float(leaf), float(root))


def test_eval_mode_is_deterministic_train_mode_is_stochastic():
    loss = make_loss(8, 64, proxy_std=0.3, proxy_nn_k=3)
    x = ball_points(16, 8, 0.1, 37, torch.float32)
    y = torch.arange(4).repeat_interleave(4)
    train_vals = {float(loss(x, y).detach()) for _ in range(4)}
    assert len(train_vals) > 1  # Gumbel noise in the LCA choice
    loss.eval()
    with torch.no_grad():
        a, b = loss(x, y), loss(x, y)
    assert torch.equal(a, b)
    fixed = make_loss(8, 64, proxy_std=0.3, proxy_nn_k=3, stochastic_lca=False)
    assert torch.equal(fixed(x, y), a)  # same seed, same proxies; no-grad path = grad path value


def test_second_backward_recomputes_the_same_gradient_and_buffers_are_reused():
    """The (3, T, P) gradient buffer is handed back after a backward and reused by the next call
    (no fresh 50 MB per call on CPU); a second backward through the same graph (retain_graph)
    replays the same Gumbel draws and gives the same gradient."""
    from pml_hyperbolic.losses import hier_loss

    hier_loss._SPARE_GRADS.clear()
    loss = make_loss(4, 12, seed=3, proxy_std=0.8, proxy_term=False, tau=0.5)
    assert loss.training and loss.stochastic_lca
    E = ball_points(16, 4, 0.1, 7).requires_grad_()
    y = torch.arange(16) // 2
    torch.manual_seed(0)
    out = loss.compute_loss(E, y, None, E, y)["loss"]
    value = out["losses"].sum()
    first, = torch.autograd.grad(value, E, retain_graph=True)
    spare, = list(hier_loss._SPARE_GRADS)  # handed back
    second, = torch.autograd.grad(value, E)
    assert torch.equal(first, second)
    torch.manual_seed(0)
    again = loss.compute_loss(E, y, None, E, y)["loss"]["losses"].sum()
    assert not hier_loss._SPARE_GRADS  # taken by the new call
    third, = torch.autograd.grad(again, E)
    assert len(hier_loss._SPARE_GRADS) == 1 and list(hier_loss._SPARE_GRADS)[0] is spare  # the same memory
    assert torch.equal(first, third)  # same seed, same draws, same gradient through a reused buffer


def test_mutual_nn_symmetric_shortcut_equals_the_general_form():
    """On an exactly symmetric matrix (the proxies' distances) the column neighbours are the row
    neighbours transposed: one topk gives the same mutual-neighbour mask as two."""
    from pml_hyperbolic.losses.hier_loss import _mutual_nn

    g = torch.Generator().manual_seed(12)
    for n, k in ((50, 5), (40, 39), (7, 10)):
        d = torch.rand(n, n, generator=g, dtype=torch.float64)
        d = 0.5 * (d + d.T)
        eye = torch.eye(n, dtype=torch.bool)
        general = _mutual_nn(d, k, eye)
        assert torch.equal(_mutual_nn(d, k, eye, symmetric=True), general)
        assert general.any() and torch.equal(general, general.T)


def test_flat_nonzero_is_nonzero_in_row_major_order():
    from pml_hyperbolic.losses.hier_loss import _flat_nonzero

    g = torch.Generator().manual_seed(13)
    for shape in ((0, 5), (5, 0), (30, 17), (1, 1)):
        mask = torch.rand(shape, generator=g) > 0.6
        rows, cols = mask.nonzero(as_tuple=True)
        flat = _flat_nonzero(mask)
        assert flat.dtype == torch.long and torch.equal(flat, rows * shape[1] + cols)
    assert torch.equal(_flat_nonzero(torch.ones(4, 6, dtype=torch.bool).T), torch.arange(24))  # not contiguous


_BAD_INDICES = [
    (([0], [1], [10 ** 8]), r"indices_tuple\[2\] has indices outside \[0, 8\)"),
    (([0], [1], [99]), r"indices_tuple\[2\] has indices outside"),
    (([0], [-1], [2]), r"indices_tuple\[1\] has indices outside"),
    (([8], [1], [2]), r"indices_tuple\[0\] has indices outside"),
    (([0], [1], [2], [2 ** 40]), r"indices_tuple\[3\] has indices outside"),
    (([0, 1], [1], [2]), r"indices_tuple: members \(0, 1, 2\) must have one length"),
    (([0, 1], [1, 2], [2], [3, 4]), r"indices_tuple: members \(2, 3\) must have one length"),
    (([0.0], [1], [2]), r"indices_tuple\[0\] must be a 1-D integer tensor"),
    (([True], [1], [2]), r"indices_tuple\[0\] must be a 1-D integer tensor"),
    (([[0]], [[1]], [[2]]), r"indices_tuple\[0\] must be a 1-D integer tensor"),
    ((["a"], [1], [2]), r"indices_tuple\[0\] must be a 1-D sequence of integers"),
    (([0], [1]), r"indices_tuple must be a PML triplet \(3\) or pair \(4\) tuple, got 2"),
    ("abc", r"indices_tuple must be a PML triplet \(3\) or pair \(4\) tuple, got str"),
]


@pytest.mark.parametrize("indices_tuple, message", _BAD_INDICES)
@pytest.mark.parametrize("grad", [True, False])
def test_bad_indices_tuple_is_refused_before_any_native_read(indices_tuple, message, grad):
    # out-of-range triplet indices used to reach the native LCA loop: a segfault for 10**8, and a
    # loss read from foreign memory (different on identical calls) for 99
    loss = HIERLoss(embedding_size=4, num_proxies=8, c=0.1, proxy_term=False)
    X, Y = torch.randn(8, 4) * 0.1, torch.arange(8) % 2
    with torch.set_grad_enabled(grad):
        with pytest.raises(ValueError, match=message):
            loss(X, Y, indices_tuple=indices_tuple)


def test_indices_tuple_as_lists_or_tensors_gives_one_loss():
    torch.manual_seed(0)
    loss = HIERLoss(embedding_size=4, num_proxies=8, c=0.1, proxy_term=False, stochastic_lca=False)
    X, Y = torch.randn(8, 4) * 0.1, torch.arange(8) % 2
    as_lists = loss(X, Y, indices_tuple=([0, 2], [4, 6], [1, 7]))
    as_tensors = loss(X, Y, indices_tuple=tuple(torch.tensor(v, dtype=torch.int32) for v in ([0, 2], [4, 6], [1, 7])))
    assert torch.equal(as_lists, as_tensors)


def test_reference_set_without_its_labels_is_one_clear_error():
    from pml_hyperbolic.geometry import PoincareGeometry

    geometry = PoincareGeometry()
    x = geometry.to_ball(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
    loss = HIERLoss(embedding_size=4, num_proxies=8, c=geometry)
    with pytest.raises(ValueError, match="ref_labels is required with ref_emb"):
        loss(x, torch.arange(8) % 4, ref_emb=x.clone())


# ---- fixed-size triplets (the accelerator path, run here on CPU) --------------------------------

def _random_masks(q, r, seed, density=0.3):
    g = torch.Generator().manual_seed(seed)
    pos = torch.rand(q, r, generator=g) < density
    neg = ~pos & (torch.rand(q, r, generator=g) < 0.7)
    return pos, neg


@pytest.mark.parametrize("q, r, seed", [(5, 7, 0), (9, 9, 1), (1, 12, 2), (8, 3, 3)])
def test_triplets_by_rank_lists_what_the_listing_lists(q, r, seed):
    """At most max_triplets triplets: the fixed-size slots hold the listing's triplets, in its order,
    the slots past the count are invalid (and hold in-range indices)."""
    from pml_hyperbolic.losses import hier_loss

    pos, neg = _random_masks(q, r, seed)
    a, p, n = hier_loss._triplets_from_masks(pos, neg, 10 ** 6)
    for budget in (a.numel(), a.numel() + 5, 10 ** 6):
        ra, rp, rn, valid = hier_loss._triplets_by_rank(pos, neg, budget)
        assert ra.numel() == min(budget, q * r * r) and int(valid.sum()) == a.numel()
        assert torch.equal(ra[valid], a) and torch.equal(rp[valid], p) and torch.equal(rn[valid], n)
        assert not valid[a.numel():].any()
        assert int(ra.max()) < q and int(rp.max()) < r and int(rn.max()) < r


def test_triplets_by_rank_draws_uniformly_over_the_triplets():
    """More triplets than the budget: every slot valid, every drawn triplet a real one, and each of
    the triplets drawn about equally often (the listing's uniform draw)."""
    from pml_hyperbolic.losses import hier_loss

    pos, neg = _random_masks(6, 6, 4, density=0.4)
    a, p, n = hier_loss._triplets_from_masks(pos, neg, 10 ** 6)
    total = a.numel()
    assert total > 20
    index = {(int(x), int(y), int(z)): t for t, (x, y, z) in enumerate(zip(a, p, n))}
    counts = np.zeros(total)
    torch.manual_seed(0)
    for _ in range(400):
        ra, rp, rn, valid = hier_loss._triplets_by_rank(pos, neg, 20)
        assert ra.numel() == 20 and bool(valid.all())
        for x, y, z in zip(ra.tolist(), rp.tolist(), rn.tolist()):
            counts[index[(x, y, z)]] += 1  # KeyError: not a triplet of the masks
    expected = 400 * 20 / total
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < total + 6 * math.sqrt(2 * total)  # χ² with total − 1 degrees of freedom, far tail


def test_triplets_by_rank_without_triplets():
    from pml_hyperbolic.losses import hier_loss

    pos = torch.zeros(4, 4, dtype=torch.bool)
    a, p, n, valid = hier_loss._triplets_by_rank(pos, ~pos, 100)
    assert a.numel() == 64 and not valid.any() and int(a.max()) < 4 and int(n.max()) < 4
    a, p, n, valid = hier_loss._triplets_by_rank(torch.zeros(0, 4, dtype=torch.bool),
                                                 torch.zeros(0, 4, dtype=torch.bool), 100)
    assert a.numel() == 0 and valid.dtype == torch.bool


@pytest.mark.parametrize("reducer", [None, "AvgNonZeroReducer"])
@pytest.mark.parametrize("proxy_term", [True, False])
def test_fixed_size_path_gives_the_listing_path_value(monkeypatch, reducer, proxy_term):
    """The accelerator's path (fixed-size triplets; the mean taken in the loss under the default
    reducer, the kept triplets listed for any other) gives the CPU path's loss and gradients."""
    from pytorch_metric_learning import reducers

    from pml_hyperbolic.losses import hier_loss

    d, p = 4, 10
    E = ball_points(12, d, 0.1, 40)
    y = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    results = []
    for fixed in (False, True):
        monkeypatch.setattr(hier_loss, "_fixed_size_triplets", lambda device, fixed=fixed: fixed)
        kw = {} if reducer is None else {"reducer": getattr(reducers, reducer)()}
        loss = make_loss(d, p, seed=7, proxy_std=0.6, proxy_term=proxy_term, stochastic_lca=False,
                         proxy_nn_k=3, **kw).double()
        e = E.clone().requires_grad_()
        value = loss(e, y)
        results.append((value.detach(), *torch.autograd.grad(value, [e, loss.proxies])))
    for listed, fixed in zip(*results):
        torch.testing.assert_close(fixed, listed, rtol=1e-12, atol=1e-14)
    assert float(results[0][0]) > 0


def test_fixed_size_path_without_kept_triplets_is_zero(monkeypatch):
    """No triplet kept (one class: no negatives): the term is zero, with gradients, as on the CPU path."""
    from pml_hyperbolic.losses import hier_loss

    monkeypatch.setattr(hier_loss, "_fixed_size_triplets", lambda device: True)
    loss = make_loss(3, 5, proxy_term=False).double()
    e = ball_points(6, 3, 0.1, 41).requires_grad_()
    value = loss(e, torch.zeros(6, dtype=torch.long))
    assert float(value.detach()) == 0.0
    (grad,) = torch.autograd.grad(value, [e], allow_unused=True)
    assert grad is None or float(grad.abs().max()) == 0.0
