"""One clear error for each bad input of HyperbolicIndex (flat and approximate factories)."""
import pytest
import torch

from pml_hyperbolic.evaluation import HyperbolicIndex, HyperbolicKNN
from pml_hyperbolic.geometry import PoincareGeometry


def points(n, d=6, c=0.5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g) * 0.9 / c ** 0.5


@pytest.fixture(params=["Flat", "HNSW8", "IVF4,Flat"])
def index(request):
    return HyperbolicIndex(c=0.5, factory=request.param).add(points(300))


@pytest.mark.parametrize("value, match", [(float("nan"), "NaN"), (float("inf"), "Inf|finite")])
def test_non_finite_rows(index, value, match):
    bad = points(10, seed=1)
    bad[4, 2] = value
    with pytest.raises(ValueError, match=match):
        index.search(bad, 3)
    with pytest.raises(ValueError, match=match):
        index.add(bad)


def test_points_outside_the_ball(index):
    outside = points(10, seed=2)
    outside[3] = torch.ones(6)  # sqrt(0.5) * sqrt(6) = 1.73 > 1
    with pytest.raises(ValueError, match="row 3 lies outside the Poincaré ball"):
        index.search(outside, 3)
    with pytest.raises(ValueError, match="outside the Poincaré ball"):
        index.add(outside)
    # a boundary point rounded outwards by float32 is projected, as before
    edge = points(10, seed=2)
    edge[0] = edge[0] / edge[0].norm() / 0.5 ** 0.5 * (1 + 1e-7)
    assert index.search(edge, 3)[1].shape == (10, 3)


def test_wrong_dimension(index):
    with pytest.raises(ValueError, match="dimension 5 but"):
        index.search(points(4, d=5), 2)
    with pytest.raises(ValueError, match="dimension 5 but"):
        index.add(points(4, d=5))


def test_k_larger_than_the_index(index):
    with pytest.raises(ValueError, match="k=301 is larger"):
        index.search(points(2), 301)
    with pytest.raises(ValueError, match="k must"):
        index.search(points(2), 0)


def test_untrained_ivf():
    with pytest.raises(ValueError, match="index is empty"):
        HyperbolicIndex(c=0.5, factory="IVF64,Flat").search(points(3), 1)
    with pytest.raises(ValueError, match="needs at least 64 points"):
        HyperbolicIndex(c=0.5, factory="IVF64,Flat").add(points(20))
    with pytest.raises(ValueError, match="needs at least 64 points"):
        HyperbolicIndex(c=0.5, factory="IVF64,Flat").train(points(20))


def test_curvature_that_changed_since_the_index_was_built():
    geometry = PoincareGeometry(c=0.5, learnable_c=True)
    index = HyperbolicIndex(c=geometry).add(points(100))
    index.search(points(3), 2)
    with torch.no_grad():
        for p in geometry.parameters():
            p.add_(0.3)
    with pytest.raises(ValueError, match="curvature is now"):
        index.search(points(3, c=1.0), 2)
    with pytest.raises(ValueError, match="curvature is now"):
        index.add(points(3, c=1.0))
    # HyperbolicKNN reads the geometry at every call: no stale index
    knn = HyperbolicKNN(c=geometry)
    x = points(50, c=1.0)
    assert knn(x, 2, x, True)[1].shape == (50, 2)


def test_hnsw_m_guards_are_kept():
    for m in (0, 1, -1):
        with pytest.raises(ValueError, match="hnsw_m must be"):
            HyperbolicIndex(c=0.1, kind="hnsw", hnsw_m=m)
