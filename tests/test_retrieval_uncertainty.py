"""retrieval_uncertainty: the class-level distance ratio d₁ / d_rival of a kNN search."""
from __future__ import annotations

import math

import pytest
import torch

from pml_hyperbolic import PoincareGeometry
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex, retrieval_uncertainty

C = 0.1


def _cos_dist(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(1 - a @ b / (a.norm() * b.norm()))


def test_reference_value_on_the_sphere():
    q = torch.tensor([[1.0, 0.0]])
    g = torch.tensor([[1.0, 0.1], [1.0, 0.3], [0.0, 1.0], [1.0, -0.5]])
    y = torch.tensor([0, 0, 1, 2])
    # ascending: [1, 0.1] (0), [1, 0.3] (0), [1, -0.5] (2), [0, 1] (1): the rival is [1, -0.5]
    expected = _cos_dist([1, 0], [1, 0.1]) / _cos_dist([1, 0], [1, -0.5])
    u = retrieval_uncertainty(q, g, y, c=None, k=4)
    assert u.shape == (1,) and u.dtype == torch.float32
    assert u.item() == pytest.approx(expected, rel=1e-6)


def test_reference_value_in_the_ball():
    q = torch.tensor([[0.1, 0.0]])
    g = torch.tensor([[0.3, 0.0], [0.5, 0.0], [-0.4, 0.0], [0.0, 1.5]])
    y = torch.tensor([7, 7, 3, 3])
    d = pb.pairwise_dist(q.double(), g.double(), C)[0]
    # nearest: 0.3 (label 7), then 0.5 (label 7), then -0.4 (label 3): the rival
    assert d.argsort().tolist()[:3] == [0, 1, 2]
    u = retrieval_uncertainty(q.double(), g.double(), y, c=C, k=3)
    assert u.dtype == torch.float64
    assert u.item() == pytest.approx(float(d[0] / d[2]), rel=1e-12)


def test_agreeing_neighbours_give_lower_uncertainty_than_disagreeing_ones():
    q = torch.tensor([[0.0, 0.0]])
    g = torch.tensor([[0.2, 0.0], [0.0, 0.3], [-0.4, 0.0], [0.0, -0.5], [0.6, 0.6]])
    agree = torch.tensor([1, 1, 1, 1, 2])
    disagree = torch.tensor([1, 2, 1, 1, 2])
    u_agree = retrieval_uncertainty(q, g, agree, c=C, k=5)
    u_disagree = retrieval_uncertainty(q, g, disagree, c=C, k=5)
    assert u_agree.item() < u_disagree.item()
    # the tie case: a rival exactly as far as the top-1 item gives 1
    tie = torch.tensor([[0.3, 0.0], [-0.3, 0.0], [0.0, 0.6]])
    assert retrieval_uncertainty(q, tie, torch.tensor([0, 1, 0]), c=C, k=3).item() == pytest.approx(1.0, abs=1e-6)


def test_no_rival_within_k_uses_the_kth_distance_and_no_labels_the_second():
    q = torch.tensor([[0.05, 0.0]])
    g = torch.tensor([[0.1, 0.0], [0.2, 0.0], [0.35, 0.0], [-0.5, 0.0]])
    d = pb.pairwise_dist(q.double(), g.double(), C)[0]
    same = torch.tensor([4, 4, 4, 9])
    assert retrieval_uncertainty(q, g, same, c=C, k=3).item() == pytest.approx(float(d[0] / d[2]), rel=1e-5)
    assert retrieval_uncertainty(q, g, same, c=C, k=4).item() == pytest.approx(float(d[0] / d[3]), rel=1e-5)
    # k beyond the gallery: the whole gallery is searched
    assert retrieval_uncertainty(q, g, same, c=C, k=50).item() == retrieval_uncertainty(q, g, same, c=C, k=4).item()
    assert retrieval_uncertainty(q, g, None, c=C, k=2).item() == pytest.approx(float(d[0] / d[1]), rel=1e-5)


def test_zero_distances():
    q = torch.tensor([[0.2, 0.1]])
    dup = torch.tensor([[0.2, 0.1], [0.2, 0.1], [0.5, 0.5]])
    # a rival label at distance 0: maximal uncertainty; only the same label at 0: none
    assert retrieval_uncertainty(q, dup, torch.tensor([0, 1, 2]), c=C, k=2).item() == 1.0
    assert retrieval_uncertainty(q, dup, torch.tensor([0, 0, 2]), c=C, k=2).item() == 0.0
    assert retrieval_uncertainty(q, dup, torch.tensor([0, 0, 2]), c=C, k=3).item() == 0.0


def _random_ball(n, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    return pb.expmap0(torch.randn(n, dim, generator=gen, dtype=torch.float64), C)


def test_range_and_invariances():
    q, g = _random_ball(40, 6, 0), _random_ball(120, 6, 1)
    y = torch.arange(120) % 7
    u = retrieval_uncertainty(q, g, y, c=C)
    assert ((u >= 0) & (u <= 1)).all()
    perm = torch.randperm(120, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(retrieval_uncertainty(q, g[perm], y[perm], c=C), u)   # gallery order
    torch.testing.assert_close(retrieval_uncertainty(q, g, (y * 13 + 5) % 91, c=C), u)  # label names
    rot, _ = torch.linalg.qr(torch.randn(6, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    torch.testing.assert_close(retrieval_uncertainty(q @ rot, g @ rot, y, c=C), u)  # an isometry of the ball
    # the sphere: the length of a vector does not count
    scale = torch.rand(120, 1, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.5
    torch.testing.assert_close(retrieval_uncertainty(q * 3, g * scale, y, c=None),
                               retrieval_uncertainty(q, g, y, c=None))


def test_curvature_forms_and_index_agree():
    q, g = _random_ball(30, 5, 5).float(), _random_ball(90, 5, 6).float()
    y = torch.arange(90) % 9
    ref = retrieval_uncertainty(q, g, y, c=C, k=8)
    torch.testing.assert_close(retrieval_uncertainty(q, g, y, c=PoincareGeometry(c=C), k=8), ref)
    torch.testing.assert_close(retrieval_uncertainty(q, g, y, c=torch.tensor(C), k=8), ref)
    index = HyperbolicIndex(c=C)
    index.add(g)
    torch.testing.assert_close(retrieval_uncertainty(q, index, y, k=8), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(retrieval_uncertainty(q, index, y, c=C, k=8), ref, rtol=1e-5, atol=1e-6)
    # another curvature is another geometry: other distances, another ratio
    assert not torch.allclose(retrieval_uncertainty(q, g, y, c=1.0, k=8), ref)


def test_no_gradient():
    q = _random_ball(4, 3, 7).float().requires_grad_(True)
    g = _random_ball(10, 3, 8).float()
    u = retrieval_uncertainty(q, g, torch.arange(10) % 2, c=C, k=3)
    assert not u.requires_grad and u.grad_fn is None


@pytest.mark.parametrize("kwargs, error, match", [
    ({"c": None, "k": 1}, ValueError, "k must be >= 2"),
    ({"c": None, "k": 2.0}, TypeError, "k must be an int"),
    ({"c": None, "k": True}, TypeError, "k must be an int"),
    ({}, ValueError, "c is required with a gallery tensor"),
    ({"c": -1.0}, ValueError, "c"),
    ({"c": "ball"}, TypeError, "c"),
])
def test_bad_arguments(kwargs, error, match):
    q, g, y = torch.zeros(2, 3), torch.rand(6, 3) * 0.1, torch.arange(6)
    with pytest.raises(error, match=match):
        retrieval_uncertainty(q, g, y, **kwargs)


def test_bad_tensors():
    g, y = torch.rand(6, 3) * 0.1, torch.arange(6)
    with pytest.raises(ValueError, match="query_embeddings must be a non-empty 2-D"):
        retrieval_uncertainty(torch.zeros(3), g, y, c=C)
    with pytest.raises(ValueError, match="query_embeddings have 4 dimensions, the gallery 3"):
        retrieval_uncertainty(torch.zeros(2, 4), g, y, c=C)
    with pytest.raises(ValueError, match="NaN"):
        retrieval_uncertainty(torch.full((2, 3), math.nan), g, y, c=C)
    with pytest.raises(TypeError, match="query_embeddings"):
        retrieval_uncertainty(torch.zeros(2, 3, dtype=torch.long), g, y, c=C)
    with pytest.raises(TypeError, match="gallery must be a"):
        retrieval_uncertainty(torch.zeros(2, 3), g.tolist(), y, c=C)
    with pytest.raises(ValueError, match="gallery must be a non-empty 2-D"):
        retrieval_uncertainty(torch.zeros(2, 3), torch.zeros(0, 3), None, c=C)
    with pytest.raises(ValueError, match="at least 2 items"):
        retrieval_uncertainty(torch.zeros(2, 3), torch.zeros(1, 3), None, c=C)
    with pytest.raises(TypeError, match="gallery_labels must be an integer tensor"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y.float(), c=C)
    with pytest.raises(ValueError, match=r"gallery_labels must have shape \(6,\)"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y[:5], c=C)
    index = HyperbolicIndex(c=C)
    with pytest.raises(ValueError, match="HyperbolicIndex is empty"):
        retrieval_uncertainty(torch.zeros(2, 3), index, None)
    index.add(g)
    with pytest.raises(ValueError, match="differs from the index's curvature"):
        retrieval_uncertainty(torch.zeros(2, 3), index, y, c=1.0)
    with pytest.raises(ValueError, match="differs from the index's curvature"):
        retrieval_uncertainty(torch.zeros(2, 3), index, y, c=None)
