"""Accuracy, gradient, fallback and memory tests of the fused pairwise_dist kernel."""
import math

import pytest
import torch

from pml_hyperbolic.kernels import native as _native
from pml_hyperbolic.kernels import pairwise as kernel
from pml_hyperbolic.kernels import gram
from pml_hyperbolic import poincare_ball as pb

CURVATURES = [1e-3, 0.1, 1.0, 10.0]


def ball_points(n, dim, c, seed, rmax=1 - 1e-3):
    """float64 points with sqrt(c)·‖x‖ up to rmax (volume-uniform radius: many near the boundary)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    r = torch.rand(n, 1, generator=g, dtype=torch.float64) ** (1 / 3) * rmax
    return v * r / math.sqrt(c)


def spec_points(c, seed=0, n=160, dim=64):
    """Spread points plus near-duplicates (relative offsets 1e-7..1e-2) and exact duplicates."""
    x = ball_points(n, dim, c, seed)
    g = torch.Generator().manual_seed(seed + 1)
    offsets = 10 ** torch.empty(n // 2, 1, dtype=torch.float64).uniform_(-7, -2, generator=g)
    near = x[: n // 2] + offsets / math.sqrt(c) * torch.randn(n // 2, dim, generator=g, dtype=torch.float64) / math.sqrt(dim)
    return torch.cat([x, pb.project(near, c), x[:4]])


def reference(x, y, c):
    """float64 explicit-difference formula (no Gram cancellation); N×M×D, small inputs only."""
    x, y = x.double(), y.double()
    s = ((x[:, None] - y[None]) ** 2).sum(-1)
    a = 1 - c * (x**2).sum(1)
    b = 1 - c * (y**2).sum(1)
    return 2 / math.sqrt(c) * torch.asinh(torch.sqrt(c * s / (a[:, None] * b[None])))


def check_spec(d, ref, rel, abs_small):
    err = (d.double() - ref).abs()
    big = ref >= 1e-2
    if big.any():
        assert (err[big] / ref[big]).max() <= rel
    if (~big).any():
        assert err[~big].max() <= abs_small


@pytest.mark.parametrize("c", CURVATURES)
def test_float32_accuracy_spec(c):
    x = spec_points(c)
    x32 = x.float()
    ref = reference(x32, x32, c)  # the float32 inputs, evaluated exactly
    d = pb.pairwise_dist(x32, x32, c)
    check_spec(d, ref, rel=1e-4, abs_small=1e-3)
    assert torch.all(d.diagonal() == 0)  # spec: <= 1e-3; ours is exact
    y32 = ball_points(50, 64, c, 7).float()
    check_spec(pb.pairwise_dist(x32, y32, c), reference(x32, y32, c), rel=1e-4, abs_small=1e-3)
    # x and y distinct tensors holding the same values: still accurate on the diagonal
    assert pb.pairwise_dist(x32, x32.clone(), c).diagonal().abs().max() <= 1e-3


@pytest.mark.parametrize("c", CURVATURES)
def test_float64_accuracy_spec(c):
    x = spec_points(c, seed=3)
    d = pb.pairwise_dist(x, x, c)
    check_spec(d, reference(x, x, c), rel=1e-10, abs_small=1e-10)
    assert torch.all(d.diagonal() == 0)


def test_near_boundary_pairs_against_mpmath():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 60
    for c in CURVATURES:
        x = ball_points(6, 8, c, 11, rmax=1 - 1e-3)
        x = x / (math.sqrt(c) * x.norm(dim=1, keepdim=True)) * (1 - 1e-3)  # exactly at sqrt(c)|x| = 1 - 1e-3
        y = torch.cat([x[:3] + 1e-6 / math.sqrt(c), -x[3:]])
        for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
            xd, yd = x.to(dtype), y.to(dtype)
            d = pb.pairwise_dist(xd, yd, c)
            for i in range(6):
                for j in (i, (i + 1) % 6):
                    xi = [mpmath.mpf(float(v)) for v in xd[i]]
                    yj = [mpmath.mpf(float(v)) for v in yd[j]]
                    cm = mpmath.mpf(c)
                    s = sum((a - b) ** 2 for a, b in zip(xi, yj))
                    a = 1 - cm * sum(v * v for v in xi)
                    b = 1 - cm * sum(v * v for v in yj)
                    exact = float(2 / mpmath.sqrt(cm) * mpmath.asinh(mpmath.sqrt(cm * s / (a * b))))
                    if exact >= 1e-2:
                        assert abs(float(d[i, j]) - exact) <= tol * exact, (c, dtype, i, j)
                    else:
                        assert abs(float(d[i, j]) - exact) <= (1e-3 if dtype == torch.float32 else tol)


def test_collapsed_batch_uses_float64_fallback(monkeypatch):
    """More than 1/16 close pairs in float32: the product is redone in float64, still accurate."""
    dtypes = []
    real = kernel._gram_W

    def spy(*args):
        dtypes.append(args[-1])
        return real(*args)

    monkeypatch.setattr(kernel, "_gram_W", spy)
    c = 1.0
    base = ball_points(1, 32, c, 0, rmax=0.9)
    g = torch.Generator().manual_seed(1)
    x = (base + 3e-3 * torch.randn(120, 32, generator=g, dtype=torch.float64)).float()
    d = pb.pairwise_dist(x, x, c)
    assert dtypes == [torch.float32, torch.float64]
    check_spec(d, reference(x, x, c), rel=1e-4, abs_small=1e-3)
    assert torch.all(d.diagonal() == 0)
    x.requires_grad_()
    pb.pairwise_dist(x, x, c).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("native", ["0", "1"])
def test_spread_batch_uses_one_float32_product(monkeypatch, native):
    """A spread batch needs no float64 redo: one float32 Gram product (the general path), or with
    the native library the symmetric path alone (its triangular product, no general product)."""
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", native)
    dtypes, symmetric = [], []
    real, real_sym = kernel._gram_W, kernel._symmetric_forward
    monkeypatch.setattr(kernel, "_gram_W", lambda *a: dtypes.append(a[-1]) or real(*a))
    monkeypatch.setattr(kernel, "_symmetric_forward", lambda *a: symmetric.append(real_sym(*a)) or symmetric[-1])
    x = ball_points(100, 16, 1.0, 0, rmax=0.9).float()
    d = pb.pairwise_dist(x, x, 1.0)
    check_spec(d, reference(x, x, 1.0), rel=1e-4, abs_small=1e-3)
    if native == "1" and _native.status() == "native":
        assert dtypes == [] and symmetric[0] is not None
    else:
        assert dtypes == [torch.float32]


@pytest.mark.parametrize("c", [1e-6, 1e-3, 0.1, 1.0, 10.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_finite_everywhere(c, dtype):
    x = ball_points(20, 8, c, 0, rmax=1.0).to(dtype)
    x = pb.project(torch.cat([x, torch.zeros(2, 8, dtype=dtype), x[:3], x[:3] * (1 + 1e-7)]), c)  # max norm, 0, dups
    x = x.detach().requires_grad_()
    y = torch.cat([x.detach()[:10], torch.zeros(1, 8, dtype=dtype)]).requires_grad_()
    cc = torch.tensor(c, dtype=dtype, requires_grad=True)
    for a, b in ((x, x), (x, y)):
        d = pb.pairwise_dist(a, b, cc)
        assert torch.isfinite(d).all()
        (d * torch.randn_like(d)).sum().backward()
    for t in (x, y, cc):
        assert torch.isfinite(t.grad).all()


def test_gradient_is_zero_on_identical_inputs():
    x = ball_points(3, 4, 1.0, 0, 0.9).requires_grad_()
    pb.pairwise_dist(x, x, 1.0).diagonal().sum().backward()
    assert torch.all(x.grad == 0)
    y = x.detach().clone().requires_grad_()
    pb.pairwise_dist(x.detach(), y, 1.0).diagonal().sum().backward()  # same values, distinct tensors
    assert torch.all(y.grad == 0)


def test_gradients_match_autograd_reference():
    """Closed-form backward (incl. the x-is-y shortcut and close pairs) vs autograd of the reference."""
    c0 = 0.5
    x = spec_points(c0, seed=5, n=24, dim=6)
    y = torch.cat([ball_points(10, 6, c0, 9), x[:5] + 1e-9])
    for mode in ("same", "distinct"):
        c_ref = torch.tensor(c0, dtype=torch.float64, requires_grad=True)
        xr = x.clone().requires_grad_()
        yr = xr if mode == "same" else y.clone().requires_grad_()
        U = torch.randn(xr.shape[0], yr.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        s = ((xr[:, None] - yr[None]) ** 2).sum(-1)
        ref = 2 / c_ref.sqrt() * torch.asinh(torch.sqrt(c_ref * s / ((1 - c_ref * (xr**2).sum(1))[:, None]
                                                                   * (1 - c_ref * (yr**2).sum(1))[None]) + 1e-300))
        (ref * U).sum().backward()
        c = torch.tensor(c0, dtype=torch.float64, requires_grad=True)
        xo = x.clone().requires_grad_()
        yo = xo if mode == "same" else y.clone().requires_grad_()
        (pb.pairwise_dist(xo, yo, c) * U).sum().backward()
        torch.testing.assert_close(xo.grad, xr.grad, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(c.grad, c_ref.grad, rtol=1e-7, atol=1e-9)
        if mode == "distinct":
            torch.testing.assert_close(yo.grad, yr.grad, rtol=1e-7, atol=1e-9)


def test_gradcheck_distinct_inputs_and_curvature():
    x = ball_points(6, 5, 0.7, 0, 0.95).requires_grad_()
    y = ball_points(7, 5, 0.7, 1, 0.95).requires_grad_()
    c = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, cc: pb.pairwise_dist(a, b, cc), (x, y, c))


def test_gradcheck_with_close_pairs():
    x = ball_points(6, 4, 1.0, 2, 0.9)
    y = torch.cat([x[:3] + 1e-7, ball_points(3, 4, 1.0, 3, 0.9)])  # three close pairs, recomputed explicitly
    c = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        W, bound = kernel._gram_W(x, y, *gram._row_terms(x, 1.0), *gram._row_terms(y, 1.0), 1.0, torch.float64)
        rows, _ = gram._close_pairs(W, bound, same=False)
    assert rows.numel() >= 3  # the explicit path is really exercised
    assert torch.autograd.gradcheck(lambda a, b, cc: pb.pairwise_dist(a, b, cc),
                                    (x.requires_grad_(), y.requires_grad_(), c), eps=1e-9, atol=1e-5)


def test_gradcheck_same_tensor_twice():
    """PML passes one tensor as query and reference: the E + E^T shortcut must be right."""
    x = ball_points(7, 4, 2.0, 4, 0.95).requires_grad_()
    c = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, cc: pb.pairwise_dist(a, a, cc), (x, c))


def test_shapes_and_bad_input():
    x = torch.zeros(3, 4)
    assert pb.pairwise_dist(x, torch.zeros(5, 4), 1.0).shape == (3, 5)
    assert pb.pairwise_dist(x, torch.zeros(0, 4), 1.0).shape == (3, 0)
    empty = torch.zeros(0, 4, requires_grad=True)
    pb.pairwise_dist(empty, x, 1.0).sum().backward()
    assert empty.grad.shape == (0, 4)
    with pytest.raises(ValueError, match="2-D"):
        pb.pairwise_dist(torch.zeros(4), torch.zeros(4), 1.0)
    with pytest.raises(ValueError, match="dimensions differ"):
        pb.pairwise_dist(x, torch.zeros(2, 3), 1.0)
    with pytest.raises(ValueError, match=r"\bc\b"):
        pb.pairwise_dist(x, x, -0.1)
    # mixed float32/float64 inputs compute in float64
    assert pb.pairwise_dist(x, x.double(), 1.0).dtype == torch.float64


def test_never_materialises_n_by_m_by_d():
    """N = M = 3000, D = 512: an N×M×D float32 tensor would need 18 GB (this machine has 24 GB,
    shared), so completing quickly with a correct result shows it is never built."""
    n, dim, c = 3000, 512, 0.1
    g = torch.Generator().manual_seed(0)
    x = pb.expmap0(torch.randn(n, dim, generator=g) * 0.05, c).requires_grad_()
    d = pb.pairwise_dist(x, x, c)
    assert d.shape == (n, n)
    d.sum().backward()
    assert torch.isfinite(x.grad).all()
    idx = torch.randint(0, n, (2, 64), generator=g)
    sampled = pb.dist(x.detach()[idx[0]].double(), x.detach()[idx[1]].double(), c)
    torch.testing.assert_close(d.detach()[idx[0], idx[1]].double(), sampled, rtol=1e-4, atol=1e-5)


def test_reference_values():
    # From mpmath (60 digits), e.g. for the first entry:
    #   from mpmath import mp, mpf, sqrt, asinh; mp.dps = 60; c = mpf(10)
    #   x = [mpf('0.1'), mpf('0.2')]; y = [mpf('-0.2'), mpf('0.05')]
    #   s = sum((a-b)**2 for a, b in zip(x, y)); a = 1-c*sum(v*v for v in x); b = 1-c*sum(v*v for v in y)
    #   2/sqrt(c)*asinh(sqrt(c*s/(a*b)))
    x = torch.tensor([[0.1, 0.2], [0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([[-0.2, 0.05], [0.3, 0.0]], dtype=torch.float64)
    expected = torch.tensor([[0.90682553570191511, 1.3248125385356362], [0.4924494912489351, 1.1500865228483709]], dtype=torch.float64)
    torch.testing.assert_close(pb.pairwise_dist(x, y, 10.0), expected, rtol=1e-13, atol=0)
    torch.testing.assert_close(pb.pairwise_dist(x.float(), y.float(), 10.0), expected.float(), rtol=1e-5, atol=0)


def test_large_self_gradient_matches_the_general_path():
    # x is y with >= 2^22 pairs: E + E^T is formed in place by tiles, then one product; it must equal the gradient
    # of the general path (a copy of x as y, then the two gradients added)
    g = torch.Generator().manual_seed(7)
    x = pb.expmap0(0.4 * torch.randn(2100, 16, generator=g, dtype=torch.float64), 0.5)
    w = torch.rand(2100, 2100, generator=g, dtype=torch.float64)  # a non-symmetric upstream gradient
    a = x.clone().requires_grad_()
    (pb.pairwise_dist(a, a, 0.5) * w).sum().backward()
    b, c = x.clone().requires_grad_(), x.clone().requires_grad_()
    (pb.pairwise_dist(b, c, 0.5) * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad + c.grad, rtol=1e-10, atol=1e-10)


# ---- (x, x) is exactly symmetric on every path ----

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(2, 24), dim=st.integers(1, 6), seed=st.integers(0, 2**16),
       dtype=st.sampled_from([torch.float32, torch.float64]),
       special=st.sampled_from(["none", "boundary", "tiny", "duplicates", "collapsed", "origin"]),
       native=st.sampled_from(["1", "0"]))
def test_self_distances_are_bit_symmetric_on_every_path(monkeypatch, n, dim, seed, dtype, special, native):
    """Near-boundary and tiny points send (x, x) off the native symmetric path (extreme points);
    ``PML_HYPERBOLIC_NATIVE=0`` takes the general path; a collapsed float32 batch the float64 redo.
    Every one of them returns D == Dᵀ bit for bit, with a zero diagonal."""
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", native)
    c = 0.1
    x = ball_points(n, dim, c, seed, rmax=0.999)
    if special == "boundary":
        x[0] = x[0] / x[0].norm() * (1 - 1e-9) / math.sqrt(c)
    elif special == "tiny":
        x[n // 2] = x[n // 2] * (1e-17 if dtype == torch.float32 else 1e-150)
    elif special == "duplicates":
        x[1:] = x[0] + 1e-4 * x[1:]
    elif special == "collapsed":
        x[:] = x[0] + 1e-6 * torch.randn(n, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    elif special == "origin":
        x[: n // 2] = 0
    x = x.to(dtype)
    d = pb.pairwise_dist(x, x, c)
    assert torch.equal(d, d.T)
    assert torch.all(d.diagonal() == 0)
