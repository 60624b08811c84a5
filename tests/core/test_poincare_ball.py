"""Property, dtype and bad-input tests of the Poincaré-ball math."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pml_hyperbolic import poincare_ball as pb

CURVATURES = [1e-3, 0.1, 1.0, 10.0]
PROPERTY = settings(deadline=None, max_examples=40)


def ball_points(n, dim, c, seed, rmax=0.99, dtype=torch.float64):
    """Points with sqrt(c)·‖x‖ uniform-ish in [0, rmax) and uniform directions."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    r = torch.rand(n, 1, generator=g, dtype=torch.float64) * rmax / math.sqrt(c)
    return (v * r).to(dtype)


point_args = dict(
    seed=st.integers(0, 2**31 - 1),
    c=st.sampled_from(CURVATURES),
    dim=st.integers(1, 12),
    rmax=st.floats(0.05, 0.999),
)


# ---------------------------------------------------------------- properties (hypothesis)
@PROPERTY
@given(**point_args)
def test_expmap0_logmap0_roundtrip(seed, c, dim, rmax):
    x = ball_points(8, dim, c, seed, rmax)
    torch.testing.assert_close(pb.expmap0(pb.logmap0(x, c), c), x, rtol=1e-9, atol=1e-12 / math.sqrt(c))
    v = torch.randn(8, dim, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) / math.sqrt(c)
    torch.testing.assert_close(pb.logmap0(pb.expmap0(v, c), c), v, rtol=1e-8, atol=1e-10)


@PROPERTY
@given(**point_args)
def test_distance_to_itself_is_zero(seed, c, dim, rmax):
    x = ball_points(8, dim, c, seed, rmax)
    assert torch.all(pb.dist(x, x, c) == 0)
    assert torch.all(pb.pairwise_dist(x, x, c).diagonal() == 0)


@PROPERTY
@given(**point_args)
def test_symmetry(seed, c, dim, rmax):
    x, y = ball_points(6, dim, c, seed, rmax), ball_points(5, dim, c, seed + 1, rmax)
    torch.testing.assert_close(pb.dist(x[:5], y, c), pb.dist(y, x[:5], c), rtol=1e-12, atol=0)
    torch.testing.assert_close(pb.pairwise_dist(x, y, c), pb.pairwise_dist(y, x, c).T, rtol=1e-11, atol=1e-14)


@PROPERTY
@given(**point_args)
def test_triangle_inequality(seed, c, dim, rmax):
    x, y, z = (ball_points(16, dim, c, seed + k, rmax) for k in range(3))
    lhs = pb.dist(x, z, c)
    rhs = pb.dist(x, y, c) + pb.dist(y, z, c)
    assert torch.all(lhs <= rhs * (1 + 1e-10) + 1e-12)


@PROPERTY
@given(**point_args)
def test_left_cancellation(seed, c, dim, rmax):
    x, y = ball_points(8, dim, c, seed, rmax), ball_points(8, dim, c, seed + 1, rmax)
    # Conditioning grows like 1/(1 - c‖x‖²): tolerance relative to the radius.
    torch.testing.assert_close(pb.mobius_add(-x, pb.mobius_add(x, y, c), c), y, rtol=1e-6, atol=1e-7 / math.sqrt(c))


@PROPERTY
@given(**point_args)
def test_mobius_left_translation_is_an_isometry(seed, c, dim, rmax):
    a, x, y = (ball_points(8, dim, c, seed + k, min(rmax, 0.9)) for k in range(3))
    before = pb.dist(x, y, c)
    after = pb.dist(pb.mobius_add(a, x, c), pb.mobius_add(a, y, c), c)
    torch.testing.assert_close(after, before, rtol=1e-7, atol=1e-9)


@PROPERTY
@given(**point_args)
def test_distance_to_origin(seed, c, dim, rmax):
    x = ball_points(8, dim, c, seed, rmax)
    expected = 2 / math.sqrt(c) * torch.atanh(math.sqrt(c) * x.norm(dim=1))
    torch.testing.assert_close(pb.dist0(x, c), expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(pb.dist(torch.zeros_like(x), x, c), expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(pb.pairwise_dist(torch.zeros(1, dim, dtype=x.dtype), x, c)[0], expected,
                               rtol=1e-10, atol=1e-14)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), dim=st.integers(1, 12))
def test_small_curvature_limit_is_twice_euclidean(seed, dim):
    x, y = ball_points(8, dim, 1.0, seed, 0.9), ball_points(8, dim, 1.0, seed + 1, 0.9)
    euclid = 2 * (x - y).norm(dim=1)
    for c in (1e-6, 1e-9):
        torch.testing.assert_close(pb.dist(x, y, c), euclid, rtol=10 * c, atol=1e-12)
        torch.testing.assert_close(pb.pairwise_dist(x, y, c).diagonal(), euclid, rtol=10 * c, atol=1e-12)


@PROPERTY
@given(seed=st.integers(0, 2**31 - 1), c=st.sampled_from(CURVATURES), dim=st.integers(1, 12),
       scale=st.floats(0.1, 100.0), dtype=st.sampled_from([torch.float32, torch.float64]))
def test_projection_is_idempotent_and_inside(seed, c, dim, scale, dtype):
    x = (torch.randn(10, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
         * scale / math.sqrt(c)).to(dtype)
    p = pb.project(x, c)
    assert p.dtype == dtype
    assert torch.all(math.sqrt(c) * p.double().norm(dim=1) < 1)
    assert torch.equal(pb.project(p, c), p)
    inside = math.sqrt(c) * x.double().norm(dim=1) < 1 - pb.boundary_eps(dtype)
    assert torch.equal(p[inside], x[inside])  # points inside are not moved


@PROPERTY
@given(**point_args, dtype=st.sampled_from([torch.float32, torch.float64]))
def test_pairwise_dist_equals_dist_row_by_row(seed, c, dim, rmax, dtype):
    x, y = ball_points(7, dim, c, seed, rmax, dtype), ball_points(5, dim, c, seed + 1, rmax, dtype)
    mat = pb.pairwise_dist(x, y, c)
    rows = pb.dist(x[:, None, :], y[None, :, :], c)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mat, rows, **tol)


@PROPERTY
@given(**point_args)
def test_lorentz_lift_is_an_isometry_and_roundtrips(seed, c, dim, rmax):
    x, y = ball_points(8, dim, c, seed, rmax), ball_points(8, dim, c, seed + 1, rmax)
    X, Y = pb.to_lorentz(x, c), pb.to_lorentz(y, c)
    assert X.shape == (8, dim + 1) and torch.all(X[:, 0] > 0)
    torch.testing.assert_close(pb.lorentz_inner(X, X), torch.full((8,), -1 / c, dtype=X.dtype),
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(pb.from_lorentz(X, c), x, rtol=1e-9, atol=1e-12 / math.sqrt(c))
    # arcosh is ill-conditioned near 1: compare with a tolerance in absolute distance.
    torch.testing.assert_close(pb.lorentz_dist(X, Y, c), pb.dist(x, y, c), rtol=1e-6, atol=1e-5 / math.sqrt(c))


@PROPERTY
@given(**point_args)
def test_dist_equals_mobius_formula(seed, c, dim, rmax):
    x, y = ball_points(8, dim, c, seed, min(rmax, 0.95)), ball_points(8, dim, c, seed + 1, min(rmax, 0.95))
    mobius = 2 / math.sqrt(c) * torch.atanh(math.sqrt(c) * pb.mobius_add(-x, y, c).norm(dim=1))
    torch.testing.assert_close(pb.dist(x, y, c), mobius, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------- reference values
def test_reference_values():
    # Generated with mpmath (50 digits):
    #   from mpmath import mp, mpf, sqrt, asinh, atanh; mp.dps = 50
    #   c = mpf(1); x = [mpf('0.3'), mpf('-0.2')]; y = [mpf('-0.1'), mpf('0.6')]
    #   s = sum((a - b)**2 for a, b in zip(x, y)); a = 1 - c*(x[0]**2 + x[1]**2); b = 1 - c*(y[0]**2 + y[1]**2)
    #   2/sqrt(c)*asinh(sqrt(c*s/(a*b)))           -> 2.04233994330837686...
    #   2*atanh(sqrt(mpf('0.13')))                 -> dist0(x, c=1)
    #   c = mpf('0.1'): 2/sqrt(c)*asinh(sqrt(c*s/((1-c*mpf('0.13'))*(1-c*mpf('0.37')))))
    x = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    y = torch.tensor([[-0.1, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(pb.dist(x, y, 1.0), torch.tensor([2.0423399433083769], dtype=torch.float64),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(pb.dist0(x, 1.0), torch.tensor([0.7550476643010149], dtype=torch.float64),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(pb.pairwise_dist(x, y, 0.1), torch.tensor([[1.8100506986598649]], dtype=torch.float64),
                               rtol=1e-14, atol=0)
    torch.testing.assert_close(pb.conformal_factor(x, 1.0), torch.tensor([2 / 0.87], dtype=torch.float64))


# ---------------------------------------------------------------- curvature forms
def test_curvature_forms_agree():
    x, y = ball_points(4, 3, 0.5, 0), ball_points(4, 3, 0.5, 1)
    expected = pb.dist(x, y, 0.5)
    from hypll.manifolds.poincare_ball import Curvature, PoincareBall

    identity = Curvature(0.5, constraining_strategy=lambda v: v)
    for c in (0.5, torch.tensor(0.5), torch.tensor([0.5]), identity, PoincareBall(identity)):
        torch.testing.assert_close(pb.dist(x, y, c), expected)
        torch.testing.assert_close(pb.pairwise_dist(x, y, c), pb.dist(x[:, None], y[None], 0.5))


def test_hypll_curvature_is_softplus_constrained():
    from hypll.manifolds.poincare_ball import Curvature, PoincareBall

    softplus_one = math.log1p(math.e)  # hypll's default: Curvature(1.0) is c = softplus(1) ≈ 1.313
    assert float(pb.as_curvature(Curvature(1.0))) == pytest.approx(softplus_one)
    assert float(pb.as_curvature(PoincareBall(Curvature(1.0)))) == pytest.approx(softplus_one)
    x = ball_points(3, 2, 1.4, 2)
    torch.testing.assert_close(pb.dist0(x, Curvature(1.0)), pb.dist0(x, softplus_one))


@pytest.mark.parametrize("fn", ["dist", "pairwise_dist", "expmap0", "logmap0", "project", "mobius_add", "to_lorentz"])
def test_learnable_curvature_receives_gradient(fn):
    x, y = ball_points(5, 3, 1.0, 3, 0.8), ball_points(5, 3, 1.0, 4, 0.8)
    c = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    f = getattr(pb, fn)
    if fn in ("dist", "pairwise_dist", "mobius_add"):
        out = f(x, y, c)
    else:  # tangent vectors / points outside the ball for expmap0 and project, ball points otherwise
        out = f(x * 2 if fn in ("expmap0", "project") else x, c)
    out.sum().backward()
    assert c.grad is not None and torch.isfinite(c.grad) and c.grad != 0


def test_hypll_curvature_parameter_receives_gradient():
    from hypll.manifolds.poincare_ball import Curvature

    curv = Curvature(0.3, requires_grad=True)
    x, y = ball_points(4, 3, 1.0, 0, 0.5), ball_points(3, 3, 1.0, 1, 0.5)
    pb.pairwise_dist(x, y, curv).sum().backward()
    assert curv.value.grad is not None and torch.isfinite(curv.value.grad)
    assert curv.value.grad != 0
    # float64 reference: c = softplus(value), d_c = arcosh(1 + 2c‖x−y‖² / ((1−c‖x‖²)(1−c‖y‖²))) / √c
    value = curv.value.detach().double().clone().requires_grad_()
    c = torch.nn.functional.softplus(value)
    diff2 = ((x[:, None] - y[None]) ** 2).sum(-1)
    den = (1 - c * (x * x).sum(-1))[:, None] * (1 - c * (y * y).sum(-1))[None]
    (torch.acosh(1 + 2 * c * diff2 / den) / c.sqrt()).sum().backward()
    assert float(curv.value.grad) == pytest.approx(float(value.grad), rel=1e-5)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf"), torch.tensor(0.0),
                                 torch.tensor(float("nan")), torch.tensor(-2.0)])
@pytest.mark.parametrize("fn", ["dist", "pairwise_dist", "expmap0", "project", "as_curvature"])
def test_bad_curvature_raises_value_error_naming_c(bad, fn):
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\bc\b"):
        if fn == "as_curvature":
            pb.as_curvature(bad)
        elif fn in ("dist", "pairwise_dist"):
            getattr(pb, fn)(x, x, bad)
        else:
            getattr(pb, fn)(x, bad)


def test_bad_curvature_types():
    with pytest.raises(ValueError, match="c must be a scalar"):
        pb.as_curvature(torch.ones(2))
    with pytest.raises(TypeError, match="c must be"):
        pb.as_curvature("1.0")
    with pytest.raises(TypeError, match="c must be"):
        pb.as_curvature(True)


def test_check_finite():
    pb.check_finite(torch.zeros(3))
    pb.check_finite(torch.zeros(0, 4))  # empty: nothing to check
    pb.check_finite(torch.full((5,), 3e38))  # large but finite
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="emb.*NaN/Inf"):
            pb.check_finite(torch.tensor([0.0, bad]), "emb")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_check_finite_finds_every_kind_anywhere(dtype):
    """The extremes-based check (one aminmax) against isfinite: NaN, +inf and -inf at the first, a
    middle and the last position, among values of both signs, with and without autograd."""
    g = torch.Generator().manual_seed(0)
    for bad, count in ((float("nan"), 1), (float("inf"), 1), (-float("inf"), 1), (float("nan"), 3)):
        for position in (0, 517, 1023):
            x = torch.randn(1024, generator=g).to(dtype)
            x[position] = bad
            x[(position + 7) % 1024: (position + 7) % 1024 + count - 1] = bad
            with pytest.raises(ValueError, match=f"contains {count} NaN/Inf"):
                pb.check_finite(x.view(32, 32).requires_grad_(), "emb")


# ---------------------------------------------------------------- dtypes and shapes
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtype_matrix(dtype):
    x = ball_points(6, 4, 1.0, 0, 0.9).to(dtype)
    y = ball_points(5, 4, 1.0, 1, 0.9).to(dtype)
    out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    results = {
        "dist": pb.dist(x[:5], y, 1.0), "pairwise_dist": pb.pairwise_dist(x, y, 1.0),
        "dist0": pb.dist0(x, 1.0), "expmap0": pb.expmap0(x, 1.0), "logmap0": pb.logmap0(x, 1.0),
        "project": pb.project(x * 10, 1.0), "mobius_add": pb.mobius_add(x[:5], y, 1.0),
        "conformal_factor": pb.conformal_factor(x, 1.0), "to_lorentz": pb.to_lorentz(x, 1.0),
    }
    expected_shapes = {"dist": (5,), "pairwise_dist": (6, 5), "dist0": (6,), "conformal_factor": (6,),
                       "to_lorentz": (6, 5)}
    for name, out in results.items():
        assert out.dtype == out_dtype, name
        assert torch.isfinite(out).all(), name
        assert out.shape == expected_shapes.get(name, (x.shape[0] if name != "mobius_add" else 5, 4)), name
    ref = pb.pairwise_dist(x.double(), y.double(), 1.0)
    torch.testing.assert_close(results["pairwise_dist"].double(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_computes_in_float32(autocast_dtype):
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 8)
    feats = torch.randn(10, 16)
    try:
        ctx = torch.autocast("cpu", dtype=autocast_dtype)
    except RuntimeError:  # pragma: no cover - older torch without CPU fp16 autocast
        pytest.skip(f"CPU autocast with {autocast_dtype} unsupported")
    with ctx:
        h = layer(feats)
        ball = pb.project(pb.expmap0(h, 0.1), 0.1)
        mat = pb.pairwise_dist(ball, ball, 0.1)
        rows = pb.dist(ball, ball.flip(0), 0.1)
    for out in (ball, mat, rows):
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert torch.all(mat.diagonal() == 0)
    mat.sum().backward()
    assert torch.isfinite(layer.weight.grad).all()


def test_batched_leading_dims():
    x = ball_points(12, 3, 1.0, 0).reshape(2, 6, 3)
    y = ball_points(12, 3, 1.0, 1).reshape(2, 6, 3)
    assert pb.dist(x, y, 1.0).shape == (2, 6)
    assert pb.expmap0(x, 1.0).shape == (2, 6, 3)
    assert pb.dist0(x, 1.0).shape == (2, 6)


@pytest.mark.parametrize("fn", ["dist", "dist0", "expmap0", "logmap0", "mobius_add", "project", "to_lorentz"])
def test_gradcheck_float64(fn):
    x = ball_points(4, 3, 1.0, 5, 0.9).requires_grad_()
    y = ball_points(4, 3, 1.0, 6, 0.9).requires_grad_()
    c = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    f = getattr(pb, fn)
    if fn in ("dist", "mobius_add"):
        assert torch.autograd.gradcheck(lambda a, b, cc: f(a, b, cc), (x, y, c))
    else:
        arg = (x * 1.5).detach().requires_grad_() if fn == "project" else x
        assert torch.autograd.gradcheck(lambda a, cc: f(a, cc), (arg, c))


def test_gradients_finite_at_origin_and_boundary():
    c = torch.tensor(1.0, requires_grad=True)
    x = torch.zeros(3, 4, requires_grad=True)
    for f in (lambda t: pb.expmap0(t, c), lambda t: pb.logmap0(t, c), lambda t: pb.dist0(t, c),
              lambda t: pb.dist(t, t, c), lambda t: pb.project(t, c)):
        x.grad = None
        f(x).sum().backward()
        assert torch.isfinite(x.grad).all()
    edge = pb.project(torch.randn(3, 4) * 10, 1.0).requires_grad_()
    (pb.dist0(edge, c).sum() + pb.logmap0(edge, c).sum() + pb.dist(edge, edge.flip(0), c).sum()).backward()
    assert torch.isfinite(edge.grad).all() and torch.isfinite(c.grad)


# ---- project: huge and tiny points, eps; float32 lifts against mpmath ----

@pytest.mark.parametrize("dtype, big", [(torch.float32, 1e20), (torch.float32, 3e38), (torch.float64, 1e200)])
def test_project_puts_huge_points_on_the_margin_in_their_own_direction(dtype, big):
    c = 0.1
    x = torch.tensor([[big, 0.0, 0.0], [0.0, -big, big]], dtype=dtype)
    out = pb.project(x, c)
    r_max = (1 - pb.boundary_eps(dtype)) / math.sqrt(c)
    norms = out.double().norm(dim=1)
    assert torch.allclose(norms, torch.full_like(norms, r_max), rtol=1e-6, atol=0)
    direction = out.double() / norms[:, None]
    expected = torch.tensor([[1.0, 0, 0], [0, -1 / math.sqrt(2), 1 / math.sqrt(2)]], dtype=torch.float64)
    assert torch.allclose(direction, expected, atol=1e-6)


@pytest.mark.parametrize("dtype, tiny", [(torch.float32, 1e-20), (torch.float32, 1e-30),
                                         (torch.float64, 1e-160), (torch.float64, 1e-300)])
def test_project_gradient_is_finite_for_tiny_points(dtype, tiny):
    x = torch.tensor([[tiny, 0.0, -tiny], [0.0, 0.0, 0.0]], dtype=dtype, requires_grad=True)
    pb.project(x, 0.1).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # inside: the identity


def test_project_gradient_outside_the_ball_is_finite():
    x = torch.tensor([[1e20, 0.0], [3.0, 4.0]], requires_grad=True)
    pb.project(x, 0.1).sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("eps", [-1.0, 1.0, 2.0, math.nan, math.inf])
def test_project_rejects_eps_outside_0_1(eps):
    with pytest.raises(ValueError, match=r"eps must lie in \[0, 1\)"):
        pb.project(torch.ones(2, 3), 0.1, eps=eps)
    with pytest.raises(TypeError, match="eps"):
        pb.project(torch.ones(2, 3), 0.1, eps="0.1")


def _mp_lift(x64: torch.Tensor, c: str):
    import mpmath

    mpmath.mp.dps = 50
    cm = mpmath.mpf(c)
    n2 = sum(mpmath.mpf(float(v)) ** 2 for v in x64)
    den = 1 - cm * n2
    return float((1 + cm * n2) / (mpmath.sqrt(cm) * den)), float(2 / den)


@pytest.mark.parametrize("one_minus", [1e-3, 2e-5, 1e-6])
def test_float32_lorentz_lift_and_conformal_factor_match_mpmath(one_minus):
    """1 − c‖x‖² is formed in float64 from the float32 coordinates: X₀ and λ are within float32
    rounding (a float32 1 − c‖x‖² was off by 1.5e-3 relative at 1 − 2e-5)."""
    c = 0.1
    x = (torch.tensor([[3.0, -4.0, 0.0]], dtype=torch.float64) / 5 * (1 - one_minus) / math.sqrt(c)).float()
    x0_ref, lam_ref = _mp_lift(x[0], "0.1")
    X = pb.to_lorentz(x, c)
    assert X.dtype == torch.float32
    assert abs(X[0, 0].item() - x0_ref) <= 1e-6 * x0_ref
    lam = pb.conformal_factor(x, c)
    assert lam.dtype == torch.float32 and abs(lam.item() - lam_ref) <= 1e-6 * lam_ref


def test_float32_lorentz_distance_near_the_boundary_matches_float64():
    c = 0.1
    x = torch.tensor([[(1 - 1e-7) / math.sqrt(c), 0.0, 0.0]], dtype=torch.float64).float()
    y = torch.tensor([[0.0, 0.3, 0.0]])
    ld = pb.lorentz_dist(pb.to_lorentz(x, c), pb.to_lorentz(y, c), c)
    ref = pb.dist(x.double(), y.double(), c)
    assert abs(ld.item() - ref.item()) <= 1e-5 * ref.item()


@pytest.mark.parametrize("fn", ["dist", "dist0", "project", "expmap0", "to_lorentz", "pairwise_dist"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_non_float_inputs_are_rejected_naming_the_dtype(fn, dtype):
    x = torch.ones(2, 3).to(dtype)
    args = {"dist": (x, x), "pairwise_dist": (x, x)}.get(fn, (x,))
    with pytest.raises(TypeError, match=f"floating-point tensor, got dtype {dtype}"):
        getattr(pb, fn)(*args, 0.1)


def test_non_tensor_and_meta_inputs_are_rejected():
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        pb.dist0([[0.1, 0.2]], 0.1)
    with pytest.raises(ValueError, match="meta device"):
        pb.dist0(torch.ones(2, 3, device="meta"), 0.1)


@pytest.mark.parametrize("c", [1e-13, 1e13, 1e-300, 1e300])
def test_curvature_outside_the_range_is_rejected(c):
    with pytest.raises(ValueError, match="must lie in"):
        pb.as_curvature(c)


def test_the_triton_switch_leaves_cpu_tensors_on_the_exact_cpu_path(monkeypatch):
    from pml_hyperbolic import poincare_ball

    x = 0.2 * torch.randn(12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = poincare_ball.pairwise_dist(x, x, 0.1)
    monkeypatch.setenv("PML_HYPERBOLIC_TRITON", "1")
    assert poincare_ball._triton_requested()
    assert torch.equal(poincare_ball.pairwise_dist(x, x, 0.1), expected)
    monkeypatch.setenv("PML_HYPERBOLIC_TRITON", "0")
    assert not poincare_ball._triton_requested()


def test_cuda_tensors_take_the_triton_kernels_unless_switched_off(monkeypatch):
    from pml_hyperbolic import poincare_ball

    monkeypatch.delenv("PML_HYPERBOLIC_TRITON", raising=False)
    assert poincare_ball._triton_requested()  # the default
    for off in ("0", "false", "no", "OFF"):
        monkeypatch.setenv("PML_HYPERBOLIC_TRITON", off)
        assert not poincare_ball._triton_requested()


def test_value_checks_read_cpu_tensors_always_and_accelerator_tensors_on_request(monkeypatch):
    monkeypatch.delenv("PML_HYPERBOLIC_CHECK_VALUES", raising=False)
    assert pb.values_checked(torch.zeros(2))
    on_device = torch.empty(2, device="meta")  # any non-CPU tensor: reading it back would wait for the device
    assert not pb.values_checked(on_device)
    pb.check_finite(on_device)  # not read: no error, no transfer
    monkeypatch.setenv("PML_HYPERBOLIC_CHECK_VALUES", "1")
    assert pb.values_checked(on_device)
    monkeypatch.setenv("PML_HYPERBOLIC_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="NaN/Inf"):
        pb.check_finite(torch.tensor([0.0, float("nan")]))  # CPU tensors: always checked


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_project_of_points_inside_is_a_copy_with_the_identity_gradient(dtype):
    """Every point inside (the common case): project returns the same values in a new tensor and
    passes the upstream gradient through unchanged, as the general path does."""
    x = (torch.randn(50, 8, generator=torch.Generator().manual_seed(0), dtype=dtype) * 0.1).requires_grad_()
    y = pb.project(x, 0.1)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    upstream = torch.randn(50, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)
    y.backward(upstream)
    assert torch.equal(x.grad, upstream)
    y.detach().add_(1.0)  # the result is not the input
    assert float(x.detach().abs().max()) < 1.0
    # one point outside: the whole batch takes the projecting path; only that point moves
    z = x.detach().clone()
    z[3] *= 1e3
    p = pb.project(z, 0.1)
    assert torch.equal(p[:3], z[:3]) and torch.equal(p[4:], z[4:])
    assert float(p[3].norm()) < 1 / 0.1 ** 0.5
