"""PoincareDistance as a PML BaseDistance."""
import math

import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance


def ball_points(n, dim, c, seed, rmax=0.95, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    return (v * torch.rand(n, 1, generator=g, dtype=torch.float64) * rmax / math.sqrt(c)).to(dtype)


def test_defaults():
    dist = PoincareDistance()
    assert dist.is_inverted is False
    assert dist.normalize_embeddings is False
    assert float(dist.c) == pytest.approx(0.1)  # one default curvature across the package
    assert "c=0.1" in repr(dist)


def test_smoke_and_shapes():
    dist = PoincareDistance(c=0.1)
    x, y = ball_points(8, 16, 0.1, 0), ball_points(5, 16, 0.1, 1)
    assert dist(x).shape == (8, 8)
    assert dist(x, y).shape == (8, 5)  # ref_emb
    assert dist.pairwise_distance(x[:5], y).shape == (5,)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_mat_agrees_with_pairwise_distance(dtype):
    dist = PoincareDistance(c=0.5)
    x, y = ball_points(9, 6, 0.5, 2, dtype=dtype), ball_points(7, 6, 0.5, 3, dtype=dtype)
    mat = dist(x, y)
    rows = dist.pairwise_distance(x[:, None, :].expand(-1, 7, -1), y[None].expand(9, -1, -1))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mat, rows, **tol)
    torch.testing.assert_close(mat, pb.pairwise_dist(x, y, 0.5))
    assert torch.all(dist(x).diagonal() == 0)


def test_reference_value():
    # Same value as tests/core/test_poincare_ball.py::test_reference_values (mpmath, c = 1).
    x = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    y = torch.tensor([[-0.1, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(PoincareDistance(c=1.0)(x, y), torch.tensor([[2.0423399433083769]], dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_embeddings_raise(bad):
    x = ball_points(4, 3, 1.0, 0)
    x[1, 2] = bad
    dist = PoincareDistance()
    with pytest.raises(ValueError, match="embeddings contains .*NaN/Inf"):
        dist(x)
    with pytest.raises(ValueError, match="NaN/Inf"):
        dist(ball_points(4, 3, 1.0, 1), x)
    with pytest.raises(ValueError, match="NaN/Inf"):
        dist.pairwise_distance(x, x)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_curvature(bad):
    with pytest.raises(ValueError, match=r"\bc\b"):
        PoincareDistance(c=bad)


def test_is_inverted_true_is_rejected():
    with pytest.raises(ValueError, match="is_inverted"):
        PoincareDistance(is_inverted=True)


def test_points_outside_the_ball_are_projected():
    c = 1.0
    x = torch.tensor([[2.0, 0.0], [0.0, 1.0], [0.3, 0.1]])  # outside, on the boundary, inside
    d = PoincareDistance(c=c)(x)
    assert torch.isfinite(d).all()
    torch.testing.assert_close(d, pb.pairwise_dist(pb.project(x, c), pb.project(x, c), c))
    assert d[0, 1] > 10  # both near the boundary, far apart


def test_without_projection_points_are_used_as_given():
    x = ball_points(5, 3, 1.0, 4)
    torch.testing.assert_close(PoincareDistance(c=1.0, project=False)(x), pb.pairwise_dist(x, x, 1.0))


def test_learnable_curvature_parameter():
    c = torch.nn.Parameter(torch.tensor(0.3))
    dist = PoincareDistance(c=c)
    assert any(p is c for p in dist.parameters())
    x = ball_points(6, 4, 0.3, 5).requires_grad_()
    dist(x).sum().backward()
    assert torch.isfinite(c.grad) and c.grad != 0
    assert torch.isfinite(x.grad).all()


def test_hypll_curvature_is_registered_and_softplus():
    from hypll.manifolds.poincare_ball import Curvature

    curv = Curvature(1.0)
    dist = PoincareDistance(c=curv)
    assert float(dist.c) == pytest.approx(math.log1p(math.e))  # softplus(1), not 1
    assert any(p is curv.value for p in dist.parameters())


def test_autocast_input_gives_float32():
    x = ball_points(6, 4, 1.0, 6).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        d = PoincareDistance(c=1.0)(x)
    assert d.dtype == torch.float32 and torch.isfinite(d).all()


def test_gradcheck_through_distance():
    x = ball_points(5, 3, 1.0, 7, dtype=torch.float64).requires_grad_()
    y = ball_points(4, 3, 1.0, 8, dtype=torch.float64).requires_grad_()
    dist = PoincareDistance(c=1.0)
    assert torch.autograd.gradcheck(lambda a, b: dist(a, b), (x, y))
    assert torch.autograd.gradcheck(lambda a: dist(a), (x,))


# ---- precision of c, huge points, input types ----

def _mp_pair(x: torch.Tensor, y: torch.Tensor, c: str = "0.1") -> float:
    import mpmath

    mpmath.mp.dps = 50
    cm = mpmath.mpf(c)
    xs = [mpmath.mpf(float(v)) for v in x]
    ys = [mpmath.mpf(float(v)) for v in y]
    s = sum((a - b) ** 2 for a, b in zip(xs, ys))
    a = 1 - cm * sum(v * v for v in xs)
    b = 1 - cm * sum(v * v for v in ys)
    return float(2 / mpmath.sqrt(cm) * mpmath.asinh(mpmath.sqrt(cm * s / (a * b))))


@pytest.mark.parametrize("one_minus", [1e-3, 2e-5])
@pytest.mark.parametrize("geometry", [False, True])
def test_float32_input_uses_the_float64_curvature(one_minus, geometry):
    """A float c (or a geometry's) reaches the kernels unrounded for float32 input: as accurate as
    ``pb.pairwise_dist`` (a float32 c cost 1e-6 relative at 0.999 and 3.4e-5 at 0.99998)."""
    from pml_hyperbolic.geometry import PoincareGeometry

    c = PoincareGeometry(c=0.1) if geometry else 0.1
    x = torch.tensor([[(1 - one_minus) / math.sqrt(0.1), 0.0, 0.0], [0.0, -0.5, 0.0]], dtype=torch.float64).float()
    ref = _mp_pair(x[0], x[1])
    distance = PoincareDistance(c=c, project=False)
    assert abs(distance(x)[0, 1].item() - ref) <= 2e-7 * ref
    assert abs(distance.pairwise_distance(x[:1], x[1:])[0].item() - ref) <= 2e-7 * ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_huge_point_is_projected_onto_the_boundary_not_the_origin(dtype):
    x = torch.tensor([[1e20, 0, 0, 0], [3.0, 0, 0, 0]], dtype=dtype)
    d = PoincareDistance()(x)[0, 1].item()
    edge = pb.project(torch.tensor([[10.0, 0, 0, 0]], dtype=dtype), 0.1)
    expected = pb.dist(edge, x[1:], 0.1).item()
    assert d == pytest.approx(expected, rel=1e-5) and d > 20  # the origin would give 11.5


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64])
def test_non_float_embeddings_are_rejected_naming_the_dtype(dtype):
    x = torch.ones(3, 4).to(dtype)
    with pytest.raises(TypeError, match=f"query_emb must be a floating-point tensor, got dtype {dtype}"):
        PoincareDistance()(x)
    with pytest.raises(TypeError, match=f"ref_emb must be a floating-point tensor, got dtype {dtype}"):
        PoincareDistance()(torch.zeros(3, 4), x)
    with pytest.raises(TypeError, match="floating-point"):
        PoincareDistance().compute_mat(x, x)


@pytest.mark.parametrize("emb", [[[0.1, 0.2]], ((0.1, 0.2),), "ab"])
def test_non_tensor_embeddings_are_rejected(emb):
    import numpy as np

    for value in (emb, np.asarray([[0.1, 0.2]])):
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            PoincareDistance()(value)


def test_meta_embeddings_are_rejected():
    with pytest.raises(ValueError, match="meta device"):
        PoincareDistance()(torch.zeros(3, 4, device="meta"))
