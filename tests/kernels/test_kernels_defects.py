"""Regression tests of the math-kernel defects found by an outside stress test ("No silent wrong
numbers"). Each test failed on the code before its fix."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.geometry import PoincareGeometry

PROPERTY = settings(deadline=None, max_examples=40)


def shell_points(n, dim, c, seed, rmin, rmax, dtype=torch.float64):
    """Points with sqrt(c)·‖x‖ uniform in [rmin, rmax] (float64 values, then cast)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    r = rmin + (rmax - rmin) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return (v * r / math.sqrt(c)).to(dtype)


def exact_dist(x, y, c):
    """float64 explicit-difference reference with the unrounded c (row-wise, broadcasting)."""
    x, y = x.double(), y.double()
    s = ((x - y) ** 2).sum(-1)
    a = 1 - c * (x * x).sum(-1)
    b = 1 - c * (y * y).sum(-1)
    return 2 / math.sqrt(c) * torch.asinh(torch.sqrt(c * s / (a * b)))


# ------------------------------------------------------------------ 1. boundary point in a batch
def test_boundary_point_does_not_corrupt_other_pairs_issue_example():
    x = torch.tensor([[0.9, 0.1], [0.2, 0.3]])
    near = x[:1] + 3e-4
    edge = pb.expmap0(torch.tensor([[40.0, 0.0]]), 1.0)  # rounds onto the boundary
    alone = pb.pairwise_dist(x, near, 1.0)
    with_edge = pb.pairwise_dist(x, torch.cat([near, edge]), 1.0)
    assert alone[0, 0] > 4e-3
    torch.testing.assert_close(with_edge[:, :1], alone, rtol=1e-5, atol=1e-7)
    assert torch.isfinite(with_edge).all() and (with_edge >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("same", [False, True])
def test_boundary_points_leave_valid_pairs_exact(dtype, same):
    c = 1.0
    x = shell_points(60, 16, c, 1, 0.99, 1 - 1e-4, dtype)
    y = shell_points(40, 16, c, 2, 0.99, 1 - 1e-4, dtype)
    y = torch.cat([y, x[:10] + 1e-4 * torch.randn(10, 16, dtype=dtype, generator=torch.Generator().manual_seed(3))])
    unit = torch.randn(3, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    unit = unit / unit.norm(dim=1, keepdim=True)
    bad = (unit * torch.tensor([[1.0 + 1e-6], [1.0 + 1e-3], [3.0]], dtype=torch.float64)).to(dtype)  # outside
    clean = pb.pairwise_dist(x, x if same else y, c)
    xs = torch.cat([x[:30], bad[:2], x[30:]])
    ys = xs if same else torch.cat([y[:5], bad, y[5:]])
    d = pb.pairwise_dist(xs, ys, c)
    assert not torch.isnan(d).any() and (d >= 0).all()
    keep_x = torch.cat([torch.arange(30), torch.arange(32, xs.shape[0])])
    keep_y = keep_x if same else torch.cat([torch.arange(5), torch.arange(8, ys.shape[0])])
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(d[keep_x][:, keep_y], clean, **tol)
    # the bad points' own distances are dist's after the same clamping
    torch.testing.assert_close(d, pb.dist(xs[:, None], ys[None], c), rtol=1e-4 if dtype == torch.float32 else 1e-9,
                               atol=1e-4 if dtype == torch.float32 else 1e-9)
    if same:
        assert (d.diagonal() == 0).all()
    # gradients: finite, and those of dist's clamped formula (float64)
    grads = []
    for fn in (pb.pairwise_dist, lambda a, b, cc: pb.dist(a[:, None], b[None], cc)):
        xg = xs.detach().double().requires_grad_()
        yg = xg if same else ys.detach().double().requires_grad_()
        cg = torch.tensor(c, dtype=torch.float64, requires_grad=True)
        u = torch.rand(xg.shape[0], yg.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        grads.append(torch.autograd.grad((fn(xg, yg, cg) * u).sum(), (xg, cg) if same else (xg, yg, cg)))
    for g, r in zip(*grads):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-9)


def test_boundary_points_random_batches_no_nan():
    for dtype in (torch.float32, torch.float64):
        for seed in range(5):
            x = shell_points(50, 8, 1.0, seed, 0.999, 1.0, dtype)  # some round onto / past the boundary
            x = torch.cat([x, pb.expmap0(40 * torch.randn(3, 8, dtype=dtype), 1.0)])
            d = pb.pairwise_dist(x, x, 1.0)
            assert not torch.isnan(d).any() and (d >= 0).all()
            inside = 1 - (x.double() ** 2).sum(1) > 2e-5
            ref = exact_dist(x[inside][:, None], x[inside][None], 1.0)
            rel = ((d[inside][:, inside].double() - ref).abs() / ref.clamp_min(1e-2)).max()
            assert rel <= (1e-4 if dtype == torch.float32 else 1e-9)


# ------------------------------------------------------------------ 5. double backward
@pytest.mark.parametrize("same", [False, True])
def test_pairwise_dist_double_backward(same):
    x = shell_points(6, 3, 1.0, 5, 0.1, 0.9).requires_grad_()
    y = x if same else shell_points(5, 3, 1.0, 6, 0.1, 0.9).requires_grad_()
    c = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)

    def reference(a, b, cc):  # row-wise dist on the pairs; the diagonal of (x, x) left at 0
        i, j = torch.nonzero(~torch.eye(a.shape[0], b.shape[0], dtype=torch.bool) if same
                             else torch.ones(a.shape[0], b.shape[0], dtype=torch.bool), as_tuple=True)
        return torch.zeros(a.shape[0], b.shape[0], dtype=a.dtype).index_put((i, j), pb.dist(a[i], b[j], cc))

    def penalty(fn):
        d = fn(x, y, c)
        gx, gc = torch.autograd.grad((d * d).sum(), (x, c), create_graph=True)
        assert gx.requires_grad and gc.requires_grad
        return torch.autograd.grad((gx ** 2).sum() + gc ** 2, (x, c))

    got = penalty(pb.pairwise_dist)
    ref = penalty(reference)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, rtol=1e-7, atol=1e-9)
    other = shell_points(5, 3, 1.0, 7, 0.1, 0.9)  # distinct points: d is smooth there
    assert torch.autograd.gradgradcheck(lambda a, b, cc: pb.pairwise_dist(a, b, cc),
                                        (x.detach().clone().requires_grad_(), other.requires_grad_(), c))


# ------------------------------------------------------------------ 6. float32 curvature rounding
@pytest.mark.parametrize("c", [0.1, 0.3])
def test_float32_kernels_use_the_unrounded_curvature(c):
    # the projected region up to its edge, sqrt(c)|x| <= 1 - 1e-5
    x = pb.project(shell_points(256, 64, c, 8, 0.999, 1.0, torch.float32), c)
    y = pb.project(shell_points(256, 64, c, 9, 0.999, 1.0, torch.float32), c)
    ref = exact_dist(x[:, None], y[None], c)
    for d in (pb.pairwise_dist(x, y, c), pb.dist(x[:, None], y[None], c)):
        assert ((d.double() - ref).abs() / ref).max() <= 1e-4
    ref0 = 2 / math.sqrt(c) * torch.atanh(math.sqrt(c) * x.double().norm(dim=1))
    assert ((pb.dist0(x, c).double() - ref0).abs() / ref0).max() <= 1e-4


# ------------------------------------------------------------------ 8. Lorentz distance
def test_lorentz_self_distance_is_zero_near_boundary():
    for dtype in (torch.float32, torch.float64):
        x = shell_points(16, 8, 1.0, 10, 0.999, 0.999, dtype)
        X = pb.to_lorentz(x, 1.0)
        assert (pb.lorentz_dist(X, X, 1.0) == 0).all()


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), c=st.sampled_from([1e-3, 0.1, 1.0, 10.0]), dim=st.integers(1, 12),
       rmax=st.sampled_from([0.5, 0.9, 0.999, 1 - 1e-6, 1 - 1e-9]), gap=st.sampled_from([0.0, 1e-8, 1e-4, 1.0]))
def test_lorentz_dist_equals_dist_over_the_whole_ball(seed, c, dim, rmax, gap):
    x = shell_points(8, dim, c, seed, 0.0, rmax)
    y = pb.project(x + gap / math.sqrt(c) * torch.randn(8, dim, dtype=torch.float64,
                                                         generator=torch.Generator().manual_seed(seed + 1)), c)
    d = pb.dist(x, y, c)
    ld = pb.lorentz_dist(pb.to_lorentz(x, c), pb.to_lorentz(y, c), c)
    # Both forms are limited by the rounding of 1 − c‖x‖² (to_lorentz's and dist's own), whose
    # relative error is ~eps/(1 − c‖x‖²): the condition of d on the point's coordinates.
    a, b = 1 - c * (x * x).sum(1), 1 - c * (y * y).sum(1)
    eps = torch.finfo(torch.float64).eps
    tol = 8 * eps * (1 / a + 1 / b) / math.sqrt(c) + 1e-13 / math.sqrt(c)
    assert ((ld - d).abs() <= 1e-9 * d + tol).all()
    assert (pb.lorentz_dist(pb.to_lorentz(x, c), pb.to_lorentz(x, c), c) == 0).all()


# ------------------------------------------------------------------ 9. float32 row-wise accuracy
@pytest.mark.parametrize("c", [0.3, 1.0])
def test_float32_rowwise_functions_as_accurate_as_the_kernel(c):
    x = pb.project(shell_points(256, 64, c, 11, 0.999, 1.0, torch.float32), c)
    y = pb.project(shell_points(256, 64, c, 12, 0.999, 1.0, torch.float32), c)
    ref = exact_dist(x, y, c)
    assert ((pb.dist(x, y, c).double() - ref).abs() / ref).max() <= 1e-4
    ref0 = 2 / math.sqrt(c) * torch.atanh(math.sqrt(c) * x.double().norm(dim=1))
    assert ((pb.dist0(x, c).double() - ref0).abs() / ref0).max() <= 1e-4
    u = math.sqrt(c) * x.double().norm(dim=1, keepdim=True)
    ref_log = x.double() * torch.atanh(u) / u
    assert ((pb.logmap0(x, c).double() - ref_log).norm(dim=1) / ref_log.norm(dim=1)).max() <= 1e-4


def test_poincare_distance_pairwise_distance_matches_compute_mat():
    from pml_hyperbolic.distances import PoincareDistance
    c = 0.1
    x = pb.project(shell_points(256, 64, c, 13, 0.999, 1.0, torch.float32), c)
    y = pb.project(shell_points(256, 64, c, 14, 0.999, 1.0, torch.float32), c)
    dist = PoincareDistance(c=c)
    mat = dist.compute_mat(x, y)
    rows = dist.pairwise_distance(x, y)
    assert ((rows - mat.diagonal()).abs() / mat.diagonal()).max() <= 1e-4


# ------------------------------------------------------------------ 10. huge tangent norms
@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1e20), (torch.float32, 1e30), (torch.float64, 1e160)])
def test_huge_tangent_vectors_land_on_the_clip_sphere(dtype, scale):
    c = 0.1
    v = torch.randn(4, 16, dtype=dtype, generator=torch.Generator().manual_seed(0)) * scale
    direction = v.double() / v.double().abs().amax()
    direction = direction / direction.norm(dim=1, keepdim=True)
    for clip in ("hard", "tanh", None):
        geometry = PoincareGeometry(c=c, clip=clip)
        x = geometry.to_ball(v)
        assert torch.isfinite(x).all()
        radius = math.sqrt(c) * x.double().norm(dim=1)
        if clip is None:
            assert (radius >= 1 - 1e-4).all() and (radius < 1).all()
        else:  # hard: on the clip sphere; tanh: tanh(|v|/r) -> 1, at radius r
            expected = math.tanh(math.sqrt(c) * geometry.clip_r)
            torch.testing.assert_close(radius, torch.full_like(radius, expected), rtol=1e-5, atol=0)
        torch.testing.assert_close(x.double() / x.double().norm(dim=1, keepdim=True), direction, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ properties (float64)
point_args = dict(seed=st.integers(0, 2**31 - 1), c=st.sampled_from([1e-3, 0.1, 1.0, 10.0]),
                  dim=st.integers(1, 12), rmax=st.floats(0.05, 0.999))


@PROPERTY
@given(**point_args)
def test_isometry_invariance_of_pairwise_dist(seed, c, dim, rmax):
    a = shell_points(1, dim, c, seed, 0.0, min(rmax, 0.9))
    x = shell_points(6, dim, c, seed + 1, 0.0, min(rmax, 0.9))
    y = shell_points(5, dim, c, seed + 2, 0.0, min(rmax, 0.9))
    before = pb.pairwise_dist(x, y, c)
    after = pb.pairwise_dist(pb.mobius_add(a, x, c), pb.mobius_add(a, y, c), c)
    torch.testing.assert_close(after, before, rtol=1e-7, atol=1e-9)


@PROPERTY
@given(**point_args)
def test_left_cancellation_whole_ball(seed, c, dim, rmax):
    x = shell_points(8, dim, c, seed, 0.0, rmax)
    y = shell_points(8, dim, c, seed + 1, 0.0, rmax)
    back = pb.mobius_add(-x, pb.mobius_add(x, y, c), c)
    # measured in the ball's own metric: the distance between y and the round trip
    assert (pb.dist(back, y, c) <= 1e-6).all()
