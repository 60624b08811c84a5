"""retrieval_uncertainty: the soft kNN vote plus the class-prototype ratio of a search result."""
from __future__ import annotations

import math

import pytest
import torch

from pml_hyperbolic import PoincareGeometry
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex, retrieval_uncertainty
from pml_hyperbolic.evaluation.retrieval_confidence import PROTOTYPE_WEIGHT, VOTE_POWER

C = 0.1


def _reference(d_items, labels, d_protos, proto_labels, p=VOTE_POWER, a=PROTOTYPE_WEIGHT):
    """The formula written out for one query: sorted item distances and labels, prototype distances."""
    order = sorted(range(len(d_items)), key=lambda i: d_items[i])
    d = [d_items[i] for i in order]
    y = [labels[i] for i in order]
    w = [1.0 if di <= d[0] else (d[0] / di) ** p for di in d]
    vote = 1 - sum(wi for wi, yi in zip(w, y) if yi == y[0]) / sum(w)
    own = d_protos[proto_labels.index(y[0])]
    rival = min(dp for dp, yp in zip(d_protos, proto_labels) if yp != y[0])
    rho = own / (own + rival)
    return (vote + a * rho) / (1 + a)


def test_reference_value_on_the_sphere():
    q = torch.tensor([[1.0, 0.0]])
    g = torch.tensor([[1.0, 0.1], [1.0, 0.3], [0.0, 1.0], [1.0, -0.5]])
    y = torch.tensor([0, 0, 1, 2])
    unit = torch.nn.functional.normalize(g.double(), dim=1)
    cos = lambda v: float(1 - v[0] / v.norm())  # noqa: E731 (distance of [1, 0] to v)
    p0 = unit[:2].mean(0)
    expected = _reference([cos(v) for v in unit], [0, 0, 1, 2], [cos(p0), cos(unit[2]), cos(unit[3])], [0, 1, 2])
    u = retrieval_uncertainty(q, g, y, c=None)
    assert u.shape == (1,) and u.dtype == torch.float32
    assert u.item() == pytest.approx(expected, rel=1e-6)


def test_reference_value_in_the_ball():
    # on one line through the origin the tangent mean of two points is the point at the mean signed d0/2
    q = torch.tensor([[0.1, 0.0]], dtype=torch.float64)
    g = torch.tensor([[0.3, 0.0], [0.5, 0.0], [-0.4, 0.0], [0.0, 1.5]], dtype=torch.float64)
    y = torch.tensor([7, 7, 3, 3])
    dist = lambda a, b: float(pb.dist(a, b, C))  # noqa: E731
    artanh_r = [math.atanh(math.sqrt(C) * r) for r in (0.3, 0.5)]
    p7 = torch.tensor([math.tanh(sum(artanh_r) / 2) / math.sqrt(C), 0.0], dtype=torch.float64)
    p3 = pb.expmap0((pb.logmap0(g[2], C) + pb.logmap0(g[3], C)) / 2, C)
    expected = _reference([dist(q[0], x) for x in g], [7, 7, 3, 3], [dist(q[0], p7), dist(q[0], p3)], [7, 3])
    u = retrieval_uncertainty(q, g, y, c=C)
    assert u.dtype == torch.float64
    assert u.item() == pytest.approx(expected, rel=1e-10)


def test_agreeing_neighbours_give_lower_uncertainty_than_disagreeing_ones():
    q = torch.tensor([[0.0, 0.0]])
    g = torch.tensor([[0.2, 0.0], [0.0, 0.3], [-0.4, 0.0], [0.0, -0.5], [0.6, 0.6], [0.7, 0.5]])
    agree = torch.tensor([1, 1, 1, 1, 2, 2])
    disagree = torch.tensor([1, 2, 1, 2, 1, 2])
    assert retrieval_uncertainty(q, g, agree, c=C).item() < retrieval_uncertainty(q, g, disagree, c=C).item()
    # the query nearer the top-1 class than any other: lower than midway between two classes
    two = torch.tensor([[0.3, 0.0], [0.35, 0.0], [-0.3, 0.0], [-0.35, 0.0]])
    labels = torch.tensor([0, 0, 1, 1])
    near = retrieval_uncertainty(torch.tensor([[0.25, 0.0]]), two, labels, c=C).item()
    midway = retrieval_uncertainty(torch.tensor([[0.0, 0.01]]), two, labels, c=C).item()
    assert near < midway
    assert midway == pytest.approx((0.5 + PROTOTYPE_WEIGHT * 0.5) / (1 + PROTOTYPE_WEIGHT), abs=0.02)


def test_zero_distances_and_small_galleries():
    q = torch.tensor([[0.2, 0.1]])
    g = torch.tensor([[0.2, 0.1], [0.2, 0.1], [0.5, 0.5]])
    # two labels at distance 0: the vote is split evenly between them
    u = retrieval_uncertainty(q, g, torch.tensor([0, 1, 2]), c=C, k=2)
    assert u.item() == pytest.approx((0.5 + PROTOTYPE_WEIGHT * 0.5) / (1 + PROTOTYPE_WEIGHT))
    # one label at distance 0 (and its prototype on the query): certain
    assert retrieval_uncertainty(q, g, torch.tensor([0, 0, 2]), c=C).item() == pytest.approx(0.0, abs=1e-6)
    # k beyond the gallery: the whole gallery votes
    assert retrieval_uncertainty(q, g, torch.tensor([0, 1, 2]), c=C, k=50).item() == \
        retrieval_uncertainty(q, g, torch.tensor([0, 1, 2]), c=C, k=3).item()


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
    torch.testing.assert_close(retrieval_uncertainty(q, g, y, index=index, k=8), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(retrieval_uncertainty(q, g, y, c=C, index=index, k=8), ref, rtol=1e-5, atol=1e-6)
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
    ({}, ValueError, "c is required"),
    ({"c": -1.0}, ValueError, "c"),
    ({"c": "ball"}, TypeError, "c"),
    ({"index": "flat"}, TypeError, "index must be None or a HyperbolicIndex"),
])
def test_bad_arguments(kwargs, error, match):
    q, g, y = torch.zeros(2, 3), torch.rand(6, 3) * 0.1, torch.arange(6)
    with pytest.raises(error, match=match):
        retrieval_uncertainty(q, g, y, **kwargs)


def test_bad_tensors():
    g, y = torch.rand(6, 3) * 0.1, torch.arange(6)
    with pytest.raises(ValueError, match="query_embeddings must be a non-empty 2-D"):
        retrieval_uncertainty(torch.zeros(3), g, y, c=C)
    with pytest.raises(ValueError, match="query_embeddings have 4 dimensions, gallery_embeddings 3"):
        retrieval_uncertainty(torch.zeros(2, 4), g, y, c=C)
    with pytest.raises(ValueError, match="NaN"):
        retrieval_uncertainty(torch.full((2, 3), math.nan), g, y, c=C)
    with pytest.raises(TypeError, match="query_embeddings"):
        retrieval_uncertainty(torch.zeros(2, 3, dtype=torch.long), g, y, c=C)
    with pytest.raises(TypeError, match="gallery_embeddings"):
        retrieval_uncertainty(torch.zeros(2, 3), g.tolist(), y, c=C)
    with pytest.raises(ValueError, match="gallery_embeddings must be a non-empty 2-D"):
        retrieval_uncertainty(torch.zeros(2, 3), torch.zeros(0, 3), y[:0], c=C)
    with pytest.raises(TypeError, match="gallery_labels must be an integer tensor"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y.float(), c=C)
    with pytest.raises(ValueError, match=r"gallery_labels must have shape \(6,\)"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y[:5], c=C)
    with pytest.raises(ValueError, match="at least 2 distinct labels"):
        retrieval_uncertainty(torch.zeros(2, 3), g, torch.zeros(6, dtype=torch.long), c=C)
    index = HyperbolicIndex(c=C)
    index.add(g[:4])
    with pytest.raises(ValueError, match="index holds 4 items, gallery_embeddings 6"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y, index=index)
    index.add(g[4:])
    with pytest.raises(ValueError, match="differs from the index's curvature"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y, c=1.0, index=index)
    with pytest.raises(ValueError, match="differs from the index's curvature"):
        retrieval_uncertainty(torch.zeros(2, 3), g, y, c=None, index=index)
