"""The pairwise-distance kernel on radial distributions: points near the origin, all at
the origin, near the boundary. The cliff near the origin came from a per-row closeness bound that
flagged ~6% of all pairs as "close" (explicit recomputation or a float64 redo) when radii spread
down to the origin; these tests pin the per-pair test, the accuracy there, and the gradients."""
import math

import pytest
import torch

from pml_hyperbolic.kernels import pairwise as kernel
from pml_hyperbolic.kernels import gram, tail
from pml_hyperbolic import poincare_ball as pb

C = 0.1


def radial_points(n, dim, d0_low, d0_high, seed, c=C, dtype=torch.float32):
    """Random directions, hyperbolic distance to the origin d0 uniform in [d0_low, d0_high]."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = d0_low + (d0_high - d0_low) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return (v * torch.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c)).to(dtype)


def reference(x, y, c=C):
    """float64 explicit differences (N×M×D: small inputs only)."""
    x, y = x.double(), y.double()
    s = ((x[:, None] - y[None]) ** 2).sum(-1)
    a = 1 - c * (x * x).sum(1)
    b = 1 - c * (y * y).sum(1)
    return 2 / math.sqrt(c) * torch.asinh(torch.sqrt(c * s / (a[:, None] * b[None])))


def errors(d, ref):
    """(max relative error where ref >= 1e-2, max absolute error below)."""
    err = (d.double() - ref).abs()
    big = ref >= 1e-2
    rel = float((err[big] / ref[big]).max()) if big.any() else 0.0
    small = float(err[~big].max()) if (~big).any() else 0.0
    return rel, small


def close_pairs_of(x, y, c=C, same=False):
    with torch.no_grad():
        W, bound = kernel._gram_W(x, y, *gram._row_terms(x, c), *gram._row_terms(y, c), c, x.dtype)
        rows, _ = gram._close_pairs(W, bound, same)
    return rows.numel()


# ------------------------------------------------------------------ the cause of the cliff
@pytest.mark.parametrize("d0_range", [(0.0, 0.5), (0.0, 2.5), (15.0, 30.0)])
def test_spread_radii_flag_no_close_pairs(d0_range):
    # random directions in 128-D: no pair is anywhere near a duplicate, so none needs the explicit
    # path (the per-row bound flagged 5-6% of the pairs near the origin, 44% near the boundary)
    for seed in range(4):
        x = radial_points(300, 128, *d0_range, seed)
        assert close_pairs_of(x, x, same=True) == 0


def test_near_duplicates_near_the_origin_are_still_flagged():
    x = radial_points(50, 32, 0.0, 0.5, 0)
    g = torch.Generator().manual_seed(1)
    y = x + 1e-5 * torch.randn(50, 32, generator=g)
    assert close_pairs_of(x, y) >= 50  # every x_i with its own near-copy y_i


def test_collapsed_batch_still_falls_back(monkeypatch):
    dtypes = []
    real = kernel._gram_W
    monkeypatch.setattr(kernel, "_gram_W", lambda *a: dtypes.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(0)
    x = (radial_points(1, 16, 0.3, 0.3, 0) + 1e-4 * torch.randn(80, 16, generator=g))
    d = pb.pairwise_dist(x, x, C)
    assert dtypes == [torch.float32, torch.float64]
    rel, small = errors(d, reference(x, x))
    assert rel <= 1e-4 and small <= 1e-6


# ------------------------------------------------------------------ accuracy near the origin
@pytest.mark.parametrize("d0_range", [(0.0, 0.5), (0.0, 0.01), (0.0, 2.5), (1.0, 2.5), (15.0, 30.0)])
def test_float32_error_against_float64_stays_at_the_kernel_level(d0_range):
    # measured: relative 1e-7..4e-7, absolute (D < 0.01) ~1e-9; the spec is 1e-4 / 1e-3
    for seed in range(2):
        x = radial_points(200, 64, *d0_range, seed)
        y = radial_points(150, 64, *d0_range, seed + 10)
        for a, b in ((x, x), (x, y)):
            rel, small = errors(pb.pairwise_dist(a, b, C), reference(a, b))
            assert rel <= 2e-6, (d0_range, rel)
            assert small <= 1e-7, (d0_range, small)


def test_head_like_points_take_the_plain_log_and_stay_accurate():
    x = pb.expmap0(0.2 * torch.randn(300, 128, generator=torch.Generator().manual_seed(0)), C)
    rel, small = errors(pb.pairwise_dist(x, x, C), reference(x, x))
    assert rel <= 1e-6 and small == 0.0  # only the diagonal is below 1e-2, and it is exactly 0


def test_float64_near_the_origin():
    x = radial_points(60, 16, 0.0, 0.5, 3, dtype=torch.float64)
    y = radial_points(50, 16, 0.0, 1e-4, 4, dtype=torch.float64)
    rel, small = errors(pb.pairwise_dist(x, y, C), reference(x, y))
    assert rel <= 1e-12 and small <= 1e-15


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2.5e-7), (torch.float64, 5e-16)])
def test_log1p_from_log_reference_values(dtype, tol):
    u = torch.cat([torch.tensor([0.0, 1e-30, 1e-12, 2.0 ** -24, 1e-7, 0.5, 1.0, 3.0, 1e6]),
                   torch.logspace(-12, 4, 2001, dtype=torch.float64).float()]).to(dtype)
    v, t = torch.empty_like(u), torch.empty_like(u)
    got = tail._log1p_from_log(u.clone(), v, t)
    ref = u.double().log1p()
    assert got[0] == 0
    assert float(((got.double() - ref).abs() / ref.clamp_min(1e-300))[1:].max()) <= tol


# ------------------------------------------------------------------ the origin itself
@pytest.mark.parametrize("same", [True, False])
def test_all_points_at_the_origin(same):
    x = torch.zeros(40, 8, requires_grad=True)
    y = x if same else torch.zeros(30, 8, requires_grad=True)
    c = torch.tensor(C, requires_grad=True)
    d = pb.pairwise_dist(x, y, c)
    assert d.shape == (40, 40 if same else 30) and (d == 0).all()
    (d * torch.randn_like(d)).sum().backward()
    for t in (x, y, c):
        assert t.grad is not None and (t.grad == 0).all()


def test_nan_input_is_not_taken_for_the_origin():
    x = torch.full((5, 4), float("nan"))
    assert torch.isnan(pb.pairwise_dist(x, x, C)).all()


def test_some_points_at_the_origin_gradients_match_reference():
    x = torch.cat([torch.zeros(3, 6, dtype=torch.float64), radial_points(7, 6, 0.0, 0.5, 5, dtype=torch.float64)])
    y = torch.cat([radial_points(4, 6, 0.0, 0.5, 6, dtype=torch.float64), torch.zeros(2, 6, dtype=torch.float64)])
    U = torch.randn(10, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    xo, yo = x.clone().requires_grad_(), y.clone().requires_grad_()
    (pb.pairwise_dist(xo, yo, C) * U).sum().backward()
    # reference: row-wise dist (0 subgradient at x = y), with the origin–origin pairs left out
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    i, j = torch.nonzero((x.norm(dim=1) > 0)[:, None] | (y.norm(dim=1) > 0)[None], as_tuple=True)
    (pb.dist(xr[i], yr[j], C) * U[i, j]).sum().backward()
    torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(yo.grad, yr.grad, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------ gradients, small radii
@pytest.mark.parametrize("d0_high", [1e-3, 0.5])
def test_gradcheck_float64_small_radii(d0_high):
    x = radial_points(6, 5, 0.0, d0_high, 0, dtype=torch.float64).requires_grad_()
    y = radial_points(7, 5, 0.0, d0_high, 1, dtype=torch.float64).requires_grad_()
    c = torch.tensor(C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, cc: pb.pairwise_dist(a, b, cc), (x, y, c))
    xs = radial_points(7, 5, 0.0, d0_high, 2, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, cc: pb.pairwise_dist(a, a, cc), (xs, c))


def test_second_backward_with_retain_graph_matches_the_first():
    # the backward reuses S's buffer for E; a second backward through the same graph recomputes S
    x = radial_points(20, 8, 0.0, 0.5, 3).requires_grad_()
    c = torch.tensor(C, requires_grad=True)
    d = pb.pairwise_dist(x, x, c)
    U = torch.randn_like(d)
    first = torch.autograd.grad((d * U).sum(), (x, c), retain_graph=True)
    second = torch.autograd.grad((d * U).sum(), (x, c))
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------ helpers and bad input
@pytest.mark.parametrize("n,tile", [(1, 4), (7, 4), (8, 4), (13, 5), (30, 512)])
def test_symmetrize_in_place_equals_e_plus_e_transpose(n, tile):
    E = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
    expected = E + E.T
    out = tail._symmetrize_(E, tile)
    assert out is E
    torch.testing.assert_close(E, expected, rtol=0, atol=0)


def test_band_ratio():
    assert gram._band_ratio_sq(1.0) == math.inf
    f = 0.07
    r = math.sqrt(gram._band_ratio_sq(f))
    assert abs((1 - r) ** 2 - f * (1 + r * r)) < 1e-12 and r > 1


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="2-D"):
        pb.pairwise_dist(torch.zeros(2, 3, 4), torch.zeros(2, 4), C)
    with pytest.raises(ValueError, match="dimensions differ"):
        pb.pairwise_dist(torch.zeros(2, 4), torch.zeros(2, 5), C)


def test_scratch_reuse_across_interleaved_graphs_gives_the_same_gradients():
    # S's buffer is handed back after a backward and reused by the next forward: graphs whose
    # forwards and backwards interleave must not see each other's buffers
    xs = [radial_points(30, 8, 0.0, 2.5, seed).requires_grad_() for seed in range(3)]
    U = torch.randn(30, 30, generator=torch.Generator().manual_seed(9))

    def fresh_grad(x):
        x = x.detach().clone().requires_grad_()
        (pb.pairwise_dist(x, x, C) * U).sum().backward()
        return x.grad

    expected = [fresh_grad(x) for x in xs]
    d0 = pb.pairwise_dist(xs[0], xs[0], C)
    d1 = pb.pairwise_dist(xs[1], xs[1], C)
    d1_before = d1.detach().clone()
    (d0 * U).sum().backward()  # hands its buffer back
    d2 = pb.pairwise_dist(xs[2], xs[2], C)  # takes it
    (d1 * U).sum().backward()
    (d2 * U).sum().backward()
    assert torch.equal(d1.detach(), d1_before)
    for x, g in zip(xs, expected):
        torch.testing.assert_close(x.grad, g, rtol=0, atol=0)


def test_forward_without_grad_matches_forward_with_grad():
    x = radial_points(50, 16, 0.0, 0.5, 4)
    with_grad = pb.pairwise_dist(x.clone().requires_grad_(), x, C).detach()
    torch.testing.assert_close(pb.pairwise_dist(x, x.clone(), C), with_grad, rtol=0, atol=0)


def test_curvature_gradient_does_not_depend_on_the_thread_count(monkeypatch):
    # The kernel picks its threads by machine load (_kernel_threads); the learnable curvature's
    # gradient must still be the same in every run of one seed, and accurate against float64.
    import pml_hyperbolic.kernels.pairwise as kernel

    x0 = pb.expmap0(0.3 * torch.randn(700, 32, generator=torch.Generator().manual_seed(3)), 0.1)
    w = torch.rand(700, 700, generator=torch.Generator().manual_seed(4))
    grads = {}
    for threads in (1, 2):
        monkeypatch.setattr(kernel, "uncontended_threads", lambda threads=threads: threads)
        for dtype in (torch.float32, torch.float64):
            x = x0.to(dtype).requires_grad_()
            c = torch.tensor(0.1, dtype=dtype, requires_grad=True)
            (pb.pairwise_dist(x, x, c) * w.to(dtype)).sum().backward()
            grads[threads, dtype] = c.grad.item()
    assert grads[1, torch.float32] == grads[2, torch.float32]
    assert grads[1, torch.float32] == pytest.approx(grads[1, torch.float64], rel=1e-5)
