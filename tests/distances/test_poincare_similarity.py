"""PoincareSimilarity: 1 − d_c / T as a PML similarity (the ball under PML's cosine-tuned losses)."""
import math

import pytest
import torch
from pytorch_metric_learning.losses import MultiSimilarityLoss, SupConLoss
from pytorch_metric_learning.miners import MultiSimilarityMiner

from pml_hyperbolic import PoincareGeometry
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance, PoincareSimilarity


def ball_points(n, dim, c, seed, rmax=0.9, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.nn.functional.normalize(torch.randn(n, dim, generator=g, dtype=torch.float64), dim=1)
    return (v * torch.rand(n, 1, generator=g, dtype=torch.float64) * rmax / math.sqrt(c)).to(dtype)


def test_defaults_take_the_scale_from_the_geometry():
    sim = PoincareSimilarity()
    assert sim.is_inverted is True and sim.normalize_embeddings is False
    assert float(sim.c) == pytest.approx(0.1)
    assert sim.scale == pytest.approx(PoincareGeometry().max_dist0())  # 2 · clip_r = 4.6
    geometry = PoincareGeometry(c=0.3, clip_r=1.5)
    sim = PoincareSimilarity(c=geometry)
    assert sim.scale == pytest.approx(3.0) and sim._c is geometry  # shared by reference
    assert "scale=3" in repr(sim)
    geometry.clip_r = 1.0  # T is read from the geometry at each use, not copied at construction
    assert sim.scale == pytest.approx(2.0)
    assert PoincareSimilarity(c=geometry, scale=5.0).scale == 5.0  # a given scale stays


def test_smoke_and_shapes():
    sim = PoincareSimilarity(c=0.1, scale=2.0)
    x, y = ball_points(8, 16, 0.1, 0), ball_points(5, 16, 0.1, 1)
    assert sim(x).shape == (8, 8) and sim(x, y).shape == (8, 5)
    assert sim.pairwise_distance(x[:5], y).shape == (5,)
    assert torch.all(sim(x).diagonal() == 1)


def test_reference_value():
    # tests/distances/test_poincare_distance.py::test_reference_value: d_1 = 2.0423399433083769 (mpmath), so
    # with T = 4: s = 1 - 2.0423399433083769 / 4 = 0.48941501417290578
    x = torch.tensor([[0.3, -0.2]], dtype=torch.float64)
    y = torch.tensor([[-0.1, 0.6]], dtype=torch.float64)
    torch.testing.assert_close(PoincareSimilarity(c=1.0, scale=4.0)(x, y),
                               torch.tensor([[0.48941501417290578]], dtype=torch.float64))


def test_head_outputs_stay_in_the_cosine_range():
    # every pair of points the head can produce (d0 <= 2 clip_r each) has s in [-1, 1]; the extreme
    # pair (clip radius, opposite directions) reaches -1
    geometry = PoincareGeometry(c=0.1, clip_r=2.3)
    v = torch.randn(64, 8, dtype=torch.float64) * 10
    x = geometry.to_ball(torch.cat([v, -v[:1]]))
    s = PoincareSimilarity(c=geometry)(x)
    assert float(s.min()) >= -1 - 1e-6 and float(s.max()) <= 1 + 1e-9
    assert float(s[0, -1]) == pytest.approx(-1.0, abs=1e-6)


def test_order_is_the_poincare_distance_order():
    x, y = ball_points(6, 5, 0.1, 2, dtype=torch.float64), ball_points(9, 5, 0.1, 3, dtype=torch.float64)
    s, d = PoincareSimilarity(c=0.1, scale=3.0)(x, y), PoincareDistance(c=0.1)(x, y)
    torch.testing.assert_close(s, 1 - d / 3.0)
    assert torch.equal(s.argsort(dim=1, descending=True), d.argsort(dim=1))


def test_multi_similarity_equals_its_distance_form():
    # MultiSimilarity(alpha, beta, base) on s = 1 - d/T is 1/T times MultiSimilarity on d with alpha/T,
    # beta/T, base T(1 - base); the miner's epsilon becomes epsilon·T (the class docstring)
    torch.manual_seed(0)
    T = 2.0
    emb = ball_points(16, 6, 0.1, 4, dtype=torch.float64).requires_grad_()
    labels = torch.arange(16) // 4
    sim, dist = PoincareSimilarity(c=0.1, scale=T), PoincareDistance(c=0.1)
    pairs_s = MultiSimilarityMiner(epsilon=0.1, distance=sim)(emb, labels)
    pairs_d = MultiSimilarityMiner(epsilon=0.1 * T, distance=dist)(emb, labels)
    def as_sets(pairs):  # the miner sorts by similarity or by distance: same pairs, other order
        a1, p, a2, n = (t.tolist() for t in pairs)
        return set(zip(a1, p)), set(zip(a2, n))

    assert as_sets(pairs_s) == as_sets(pairs_d) and len(pairs_s[0]) > 0 and len(pairs_s[2]) > 0
    loss_s = MultiSimilarityLoss(alpha=2, beta=50, base=0.5, distance=sim)(emb, labels, pairs_s)
    loss_d = MultiSimilarityLoss(alpha=2 / T, beta=50 / T, base=0.5 * T, distance=dist)(emb, labels, pairs_d)
    torch.testing.assert_close(T * loss_s, loss_d)
    (g_s,) = torch.autograd.grad(loss_s, emb)
    (g_d,) = torch.autograd.grad(loss_d, emb)
    torch.testing.assert_close(T * g_s, g_d)


def test_supcon_on_the_similarity_is_finite_and_trains():
    emb = ball_points(12, 4, 0.1, 5).requires_grad_()
    loss = SupConLoss(temperature=0.1, distance=PoincareSimilarity(c=0.1, scale=2.0))(emb, torch.arange(12) // 3)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


def test_gradcheck_float64():
    x = ball_points(4, 3, 0.5, 6, dtype=torch.float64).requires_grad_()
    y = ball_points(3, 3, 0.5, 7, dtype=torch.float64).requires_grad_()
    sim = PoincareSimilarity(c=0.5, scale=1.5)
    assert torch.autograd.gradcheck(lambda a, b: sim(a, b), (x, y))


def test_learnable_curvature_gets_a_gradient():
    geometry = PoincareGeometry(c=0.2, learnable_c=True)
    sim = PoincareSimilarity(c=geometry)
    sim(ball_points(5, 3, 0.2, 8)).sum().backward()
    grads = [p.grad for p in geometry.parameters()]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scale=0.0), "scale must be"),
    (dict(scale=-1.0), "scale must be"),
    (dict(scale=float("inf")), "scale must be"),
    (dict(scale=float("nan")), "scale must be"),
    (dict(scale="2"), "scale must be"),
    (dict(scale=True), "scale must be"),
    (dict(c=0.1), "pass scale"),                       # a bare curvature has no clip radius
    (dict(c=PoincareGeometry(clip=None)), "pass scale"),  # nor an unclipped geometry
    (dict(scale=1.0, is_inverted=False), "is_inverted must be True"),
    (dict(c=-1.0, scale=1.0), "c"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PoincareSimilarity(**kwargs)


def test_non_finite_embeddings_raise():
    x = ball_points(4, 3, 0.1, 9)
    x[2, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        PoincareSimilarity(c=0.1, scale=1.0)(x)


def test_agrees_with_pb_pairwise_dist_in_float32():
    x = ball_points(20, 8, 0.1, 10)
    torch.testing.assert_close(PoincareSimilarity(c=0.1, scale=4.6)(x), 1 - pb.pairwise_dist(x, x, 0.1) / 4.6)


# ---- the scale and the [-1, 1] contract ----

@pytest.mark.parametrize("scale", [1e-300, 1e-39, 0.0, -1.0, math.inf, math.nan, 1e39])
def test_scales_whose_inverse_overflows_float32_are_rejected(scale):
    with pytest.raises(ValueError, match="scale must be"):
        PoincareSimilarity(c=0.1, scale=scale)


def test_switching_the_geometry_clipping_off_is_an_error_at_use_not_all_ones():
    geometry = PoincareGeometry()
    similarity = PoincareSimilarity(c=geometry)
    x = ball_points(6, 4, 0.1, 0)
    similarity(x)
    with pytest.raises(ValueError, match="clip_r"):
        geometry.clip_r = None
    geometry.clip = None
    with pytest.raises(ValueError, match="scale"):
        similarity(x)
    geometry.clip_r = 1e-300  # a radius whose T = 2r has no float32 inverse
    geometry.clip = "hard"
    with pytest.raises(ValueError, match="scale"):
        similarity(x)


@pytest.mark.parametrize("c, clip_r", [(3.0, 2.3), (1.0, 4.0), (0.1, 2.3)])
def test_float32_similarity_stays_in_minus_one_one_with_the_gradient_of_the_affine_map(c, clip_r):
    """Antipodal points at the clip radius: 1 − d/T rounds below −1 in float32; the similarity is
    clamped to [−1, 1] and its gradient is still that of 1 − d/T."""
    geometry = PoincareGeometry(c=c, clip_r=clip_r)
    g = torch.Generator().manual_seed(0)
    v = torch.randn(64, 16, generator=g)
    v = torch.cat([v, -v]) * 100  # far beyond the clip: every point on the clip sphere
    x = geometry.to_ball(v).detach().requires_grad_()
    similarity = PoincareSimilarity(c=geometry)
    s = similarity(x)
    assert s.min() >= -1.0 and s.max() <= 1.0
    assert (s == -1.0).any()
    s.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    (1.0 - PoincareDistance(c=geometry)(x_ref) / geometry.max_dist0()).sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
