"""One geometry owns the curvature, the clip mode and the clip radius: every public component that
takes ``c=`` is built from ONE non-default geometry (c = 0.37, ``clip="tanh"``, r = 0.9) and must use
exactly that one: its ``.geometry`` is the object, and its outputs never leave the clip radius."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from hypll.manifolds.poincare_ball import Curvature, PoincareBall

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import MixedGeometryDistance, PoincareDistance, PoincareSimilarity
from pml_hyperbolic.evaluation import (HyperbolicIndex, HyperbolicKNN, plot_poincare_disk, plot_uncertainty_vs_recall,
                                       uncertainty_failure_auroc, uncertainty_recall_table)
from pml_hyperbolic.evaluation.poincare_disk_plot import clip_distance
from pml_hyperbolic.evaluation.radius_health import radius_collapse
from pml_hyperbolic.geometry import (DEFAULT_CLIP_R, DEFAULT_CURVATURE, PoincareGeometry, as_geometry,
                                     default_geometry, map_to_ball)
from pml_hyperbolic.heads import HyperbolicEmbeddingHead, ToPoincare
from pml_hyperbolic.losses import (DegradedCopyRadiusLoss, HIERLoss, HypMixLoss, PairwiseCrossEntropyLoss,
                                   RadialCalibrationLoss, UncertaintyAdaptiveContrastiveLoss,
                                   UncertaintyAdaptiveTripletLoss)
from pml_hyperbolic.miners import (HardNegativeProbabilityMiner, HierarchicalPseudoLabeler,
                                   HierarchicalSimilarityMiner, MixedGeometryMiner)
from pml_hyperbolic.training.pseudo_labels import UnsupervisedPseudoLabels
from pml_hyperbolic.uncertainty import hyperbolic_uncertainty

C, R = 0.37, 0.9  # neither is a default
assert C != DEFAULT_CURVATURE and R != DEFAULT_CLIP_R


@pytest.fixture
def g():
    return PoincareGeometry(c=C, clip="tanh", clip_r=R)


@pytest.fixture
def feats():
    torch.manual_seed(0)
    return torch.randn(24, 16) * 5.0  # tangent norms far beyond r: the clip decides the radius


def d0(x):
    return pb.dist0(x.double(), C)


def tanh_clip_d0(v):
    """d₀ of exp₀(tanh-clip(v)) = 2·r·tanh(‖v‖/r) (d₀(exp₀ u) = 2‖u‖)."""
    return 2 * R * torch.tanh(torch.linalg.vector_norm(v.double(), dim=-1) / R)


def test_heads_use_the_geometry(g, feats):
    head = ToPoincare(c=g)
    out = head(feats)
    assert head.geometry is g
    torch.testing.assert_close(d0(out), tanh_clip_d0(feats), rtol=1e-5, atol=1e-5)  # tanh, r = 0.9, c = 0.37
    for radius in ("norm", "learned"):
        emb = HyperbolicEmbeddingHead(16, 8, c=g, radius=radius)
        assert emb.geometry is g
        assert float(d0(emb(feats).detach()).max()) <= 2 * R + 1e-5  # float32 rounding of a saturated tanh


def test_distances_use_the_geometry(g):
    x = g.to_ball(torch.randn(10, 4))
    dist = PoincareDistance(c=g)
    assert dist.geometry is g
    torch.testing.assert_close(dist(x), pb.pairwise_dist(x, x, torch.tensor(C, dtype=torch.float64)))
    sim = PoincareSimilarity(c=g)
    assert sim.geometry is g and sim.scale == pytest.approx(2 * R)
    mixed = MixedGeometryDistance(c=g)
    assert mixed.geometries[0] is g and mixed.clip_r == R and mixed.curvatures == [pytest.approx(C)]
    u, balls = mixed._views(torch.randn(6, 4) * 3)
    torch.testing.assert_close(balls[0], g.to_ball(u))  # the geometry's tanh map, not a hard clip
    # changing the geometry later reaches the similarity at its next use (read, not copied)
    g.clip_r = 1.5
    assert sim.scale == pytest.approx(3.0)


def test_uncertainty_losses_use_the_geometry(g):
    x = g.to_ball(torch.randn(12, 6) * 0.3)
    y = torch.arange(12) // 3
    expected = hyperbolic_uncertainty(x, c=C, clip_r=R)  # U = 1 − d₀/(2r) with this geometry's r
    other = hyperbolic_uncertainty(x, c=C, clip_r=DEFAULT_CLIP_R)
    assert not torch.allclose(expected, other)
    for loss in (UncertaintyAdaptiveContrastiveLoss(c=g), UncertaintyAdaptiveTripletLoss(c=g),
                 UncertaintyAdaptiveContrastiveLoss(distance=PoincareDistance(c=g)),  # c=None: the distance's
                 UncertaintyAdaptiveTripletLoss(distance=PoincareDistance(c=g))):
        assert loss.uncertainty_geometry is g and loss.clip_r == R
        torch.testing.assert_close(loss.uncertainty_factor(x),
                                   torch.log(expected / expected.max() + 1))
        assert torch.isfinite(loss(x, y))
    # the triplet margin scale e^c reads the geometry's c
    trip = UncertaintyAdaptiveTripletLoss(c=g)
    torch.testing.assert_close(trip.margins(x), trip.uncertainty_factor(x) * math.exp(C))


def test_other_losses_use_the_geometry(g, feats):
    hier = HIERLoss(16, num_proxies=8, c=g)
    assert hier.geometry is g and hier.clip_r == R
    with torch.no_grad():
        hier.proxies.mul_(100.0)
    proxies = hier.proxies_in_ball()
    torch.testing.assert_close(proxies, g.to_ball(hier.proxies))
    assert float(d0(proxies).max()) <= 2 * R + 1e-5  # float32 rounding of a saturated tanh
    x = g.to_ball(feats)
    y = torch.arange(24) // 4
    assert torch.isfinite(hier(x, y))
    mix = HypMixLoss(c=g)
    assert mix.distance.geometries[0] is g and torch.isfinite(mix(feats, y))
    assert RadialCalibrationLoss(c=g).geometry is g
    assert DegradedCopyRadiusLoss(c=g).geometry is g
    assert PairwiseCrossEntropyLoss(distance=PoincareDistance(c=g)).distance.geometry is g


def test_miners_and_evaluation_use_the_geometry(g, feats, tmp_path):
    x = g.to_ball(feats)
    y = torch.arange(24) // 4
    labeler = HierarchicalPseudoLabeler(levels=[6, 2], c=g)
    assert labeler.geometry is g and labeler.c == pytest.approx(C)
    assert HierarchicalSimilarityMiner(distance=PoincareDistance(c=g), pseudo_labeler=labeler).distance.geometry is g
    assert HardNegativeProbabilityMiner(distance=PoincareDistance(c=g)).distance.geometry is g
    assert MixedGeometryMiner(distances=[PoincareDistance(c=g)], temperatures=0.2).distances[0].geometry is g
    assert UnsupervisedPseudoLabels(c=g).geometry is g
    knn = HyperbolicKNN(c=g)
    assert knn.geometry is g and knn.c == pytest.approx(C)
    index = HyperbolicIndex(c=g)
    index.add(x)
    _, ids = index.search(x[:3], 1)
    assert index.c == pytest.approx(C) and ids[:, 0].tolist() == [0, 1, 2]
    # the plots, the radius report and the uncertainty tables read the clip radius from the geometry
    assert clip_distance(g) == pytest.approx(2 * R)
    report = radius_collapse(g.to_ball(torch.randn(30, 8) * 50), g)
    assert report is not None and report.clip_d0 == pytest.approx(2 * R)
    table = uncertainty_recall_table(x, y, c=g, n_bins=3)
    explicit = uncertainty_recall_table(x, y, c=g, n_bins=3, clip_r=R)
    assert table == explicit
    assert uncertainty_failure_auroc(x, y, c=g) == uncertainty_failure_auroc(x, y, c=g, clip_r=R)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plot_uncertainty_vs_recall(x, y, tmp_path / "u.png", c=g, n_bins=3, figsize=(3, 2), dpi=30)
        plot_poincare_disk(x, y, tmp_path / "d.png", c=g, figsize=(3, 3), dpi=30)
    assert (tmp_path / "u.png").stat().st_size > 0 and (tmp_path / "d.png").stat().st_size > 0


# ---- the one conversion -----------------------------------------------------------------------
def test_as_geometry_conversions():
    g = PoincareGeometry(c=C, clip="tanh", clip_r=R)
    assert as_geometry(g) is g
    for kw in ({"clip_r": 1.0}, {"clip": "hard"}, {"learnable_c": True}):
        with pytest.raises(ValueError, match="PoincareGeometry"):
            as_geometry(g, **kw)
    d = as_geometry(None)
    assert (float(d.c()), d.clip, d.clip_r) == (DEFAULT_CURVATURE, "hard", DEFAULT_CLIP_R)
    assert as_geometry(0.5).clip_r == DEFAULT_CLIP_R and as_geometry(0.5, clip_r=None).clip is None
    assert float(as_geometry(torch.tensor(0.5)).c()) == 0.5
    assert float(default_geometry().c()) == DEFAULT_CURVATURE
    # by reference: a learnable tensor keeps receiving gradients, a hypll object keeps its softplus
    p = torch.nn.Parameter(torch.tensor(0.4))
    gp = as_geometry(p)
    assert gp.learnable_c and p in list(gp.parameters())
    gp.curvature().backward()
    assert p.grad is not None and float(p.grad) == 1.0
    curv = Curvature(0.3)
    gc = as_geometry(curv)
    assert float(gc.c()) == pytest.approx(float(F.softplus(torch.tensor(0.3))))
    curv.value.data.fill_(1.0)
    assert float(gc.c()) == pytest.approx(float(F.softplus(torch.tensor(1.0))))  # read at use
    assert float(as_geometry(PoincareBall(Curvature(0.3))).c()) == pytest.approx(float(F.softplus(torch.tensor(0.3))))
    for bad in ("0.1", True, [0.1]):
        with pytest.raises(TypeError, match=r"\bc\b"):
            as_geometry(bad)
    with pytest.raises(ValueError, match=r"\bc\b"):
        as_geometry(-1.0)
    # a shared curvature is validated at every read (an optimiser may drive it negative)
    p.data.fill_(-0.2)
    with pytest.raises(ValueError, match=r"\bc\b"):
        gp.curvature()


def test_map_into_the_ball_is_overflow_safe():
    """A huge tangent vector keeps its direction (a plain float32 norm overflows to inf and the clip
    factor r/inf = 0 sent it to the origin)."""
    g = PoincareGeometry(c=C, clip="hard", clip_r=R)
    v = torch.tensor([[3e30, -4e30]], dtype=torch.float32)
    x = g.to_ball(v)
    assert torch.isfinite(x).all() and float(torch.linalg.vector_norm(x)) > 0
    torch.testing.assert_close(x / torch.linalg.vector_norm(x), torch.tensor([[0.6, -0.8]]))
    torch.testing.assert_close(map_to_ball(v, torch.tensor(C, dtype=torch.float64), R, "hard"), x)
    hier = HIERLoss(2, num_proxies=1, c=g)
    with torch.no_grad():
        hier.proxies.copy_(v)
    torch.testing.assert_close(hier.proxies_in_ball(), x)


def test_deprecated_clip_r_keywords_still_work():
    g = PoincareGeometry(c=C, clip="tanh", clip_r=R)
    x = g.to_ball(torch.randn(8, 4) * 0.5)
    for cls in (UncertaintyAdaptiveContrastiveLoss, UncertaintyAdaptiveTripletLoss):
        with pytest.warns(DeprecationWarning, match="clip_r"):
            loss = cls(c=g, clip_r=2.0)
        assert loss.clip_r == 2.0 and float(loss.uncertainty_geometry.c()) == pytest.approx(C)
        torch.testing.assert_close(loss.uncertainty_factor(x), torch.log(
            hyperbolic_uncertainty(x, c=C, clip_r=2.0) / hyperbolic_uncertainty(x, c=C, clip_r=2.0).max() + 1))
        with pytest.raises(ValueError, match="clip_r"), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cls(c=g, clip_r=-1.0)
    with pytest.warns(DeprecationWarning, match="clip_r"):
        hier = HIERLoss(4, num_proxies=2, c=g, clip_r=0.5)
    assert hier.clip_r == 0.5 and hier.geometry.clip == "hard"
    with pytest.warns(DeprecationWarning, match="clip_r"):
        mixed = MixedGeometryDistance(c=g, clip_r=0.5)
    assert mixed.clip_r == 0.5
    # without a geometry, clip_r builds one and does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert HIERLoss(4, num_proxies=2, c=0.2, clip_r=0.5).clip_r == 0.5
        assert MixedGeometryDistance(c=0.2, clip_r=0.5).clip_r == 0.5
        assert UncertaintyAdaptiveContrastiveLoss(c=0.2).clip_r == DEFAULT_CLIP_R
