"""hypll interoperability: ManifoldTensors in the distance, losses, miners and head; the docs example."""
import math

import pytest
import torch
from hypll.manifolds.euclidean import Euclidean
from hypll.manifolds.poincare_ball import Curvature, PoincareBall
from hypll.tensors import ManifoldTensor, TangentTensor
from pytorch_metric_learning import losses, miners

from pml_hyperbolic import (
    HardNegativeProbabilityMiner,
    HierarchicalSimilarityMiner,
    HyperbolicCrossBatchMemory,
    HyperbolicEmbeddingHead,
    HypMixLoss,
    MixedGeometryMiner,
    PairwiseCrossEntropyLoss,
    PoincareDistance,
    UncertaintyAdaptiveContrastiveLoss,
    UncertaintyAdaptiveTripletLoss,
    accept_manifold_tensors,
    to_manifold_tensor,
    unwrap_ball_tensor,
)
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.geometry import PoincareGeometry
from pml_hyperbolic.losses import HIERLoss
from pml_hyperbolic.miners import HierarchicalPseudoLabeler

# The "hypll networks" example of docs/plug-into-pml.md, verbatim: keep the block identical to this string.
README_EXAMPLE = '''\
import torch
from hypll.manifolds.euclidean import Euclidean
from hypll.nn import ChangeManifold, HLinear
from hypll.optim import RiemannianAdam
from hypll.tensors import ManifoldTensor
from pytorch_metric_learning import losses

from pml_hyperbolic import PoincareDistance, accept_manifold_tensors
from pml_hyperbolic.geometry import PoincareGeometry

torch.manual_seed(0)
geometry = PoincareGeometry(c=0.1)  # c = 0.1 exactly (hypll's Curvature(0.1) would be softplus(0.1))
net = torch.nn.Sequential(
    ChangeManifold(geometry),               # Euclidean features -> ball (expmap at the origin)
    HLinear(32, 16, manifold=geometry),     # Poincaré fully connected layer
)
loss_fn = accept_manifold_tensors(          # PML's own losses: unwrap ManifoldTensors first
    losses.TripletMarginLoss(margin=0.5, distance=PoincareDistance(c=geometry)))
optimizer = RiemannianAdam(net.parameters(), lr=1e-2)

labels = torch.arange(8).repeat_interleave(8)                    # 8 classes x 8 samples
features = torch.randn(8, 32)[labels] + 2.0 * torch.randn(64, 32)
inputs = ManifoldTensor(features, manifold=Euclidean())
losses_seen = []
for step in range(20):
    embeddings = net(inputs)                # a ManifoldTensor on `geometry`
    loss = loss_fn(embeddings, labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses_seen.append(loss.item())
print(f"triplet loss {losses_seen[0]:.3f} -> {losses_seen[-1]:.3f}")
'''

C = 0.1


def ball_points(n, dim, c=C, seed=0, rmax=0.9):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g)
    v = v / v.norm(dim=1, keepdim=True)
    return v * torch.rand(n, 1, generator=g) * rmax / math.sqrt(c)


@pytest.fixture
def geometry():
    return PoincareGeometry(c=C)


@pytest.fixture
def batch(geometry):
    x = ball_points(12, 6)
    labels = torch.arange(12) // 3
    return x, ManifoldTensor(x, manifold=geometry), labels


# ---- unwrap / wrap ---------------------------------------------------------------------------
def test_round_trip(geometry):
    x = ball_points(5, 4).requires_grad_()
    mt = to_manifold_tensor(x, geometry)
    assert isinstance(mt, ManifoldTensor) and mt.manifold is geometry and mt.man_dim == 1
    assert mt.tensor is x
    assert unwrap_ball_tensor(mt, c=geometry) is x
    assert unwrap_ball_tensor(mt) is x
    assert unwrap_ball_tensor(x, c=geometry) is x  # plain tensors pass through
    assert to_manifold_tensor(mt, geometry) is mt
    unwrap_ball_tensor(to_manifold_tensor(x, geometry)).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # a ManifoldTensor on another ball of the same curvature is re-wrapped on the geometry
    other = ManifoldTensor(x, manifold=PoincareGeometry(c=C))
    assert to_manifold_tensor(other, geometry).manifold is geometry
    with pytest.raises(TypeError, match="PoincareBall"):
        to_manifold_tensor(x, 0.1)


def test_identical_object_is_not_evaluated(geometry, monkeypatch):
    mt = ManifoldTensor(ball_points(3, 4), manifold=geometry)

    def boom(*args, **kwargs):
        raise AssertionError("curvature evaluated")

    monkeypatch.setattr(pb, "as_curvature", boom)
    assert unwrap_ball_tensor(mt, c=geometry) is mt.tensor
    assert unwrap_ball_tensor(mt, c=geometry.c) is mt.tensor  # the shared hypll Curvature


def test_equal_curvatures_of_different_objects_are_accepted(geometry):
    x = ball_points(3, 4)
    assert unwrap_ball_tensor(ManifoldTensor(x, manifold=geometry), c=0.1) is x
    assert unwrap_ball_tensor(ManifoldTensor(x, manifold=geometry), c=torch.tensor(0.1)) is x
    softplus_one = math.log1p(math.e)  # hypll's Curvature(1.0) is c = softplus(1)
    assert unwrap_ball_tensor(ManifoldTensor(x, manifold=PoincareBall(Curvature(1.0))), c=softplus_one) is x


def test_curvature_mismatch_names_both_values(geometry):
    mt = ManifoldTensor(ball_points(3, 4), manifold=geometry)
    with pytest.raises(ValueError, match=r"c = 0\.1\b.*c = 0\.2\b") as err:
        unwrap_ball_tensor(mt, c=0.2)
    assert "softplus" not in str(err.value)


def test_curvature_mismatch_explains_hypll_softplus():
    mt = ManifoldTensor(ball_points(3, 4, c=1.0), manifold=PoincareBall(Curvature(1.0)))
    with pytest.raises(ValueError, match=r"1\.31.*softplus") as err:
        unwrap_ball_tensor(mt, c=1.0)
    assert "Curvature(1)" in str(err.value) and "PoincareGeometry(c=1)" in str(err.value)
    # the other way round: the consumer was given hypll's Curvature(0.1), the points are on c = 0.1
    mt = ManifoldTensor(ball_points(3, 4), manifold=PoincareGeometry(c=0.1))
    with pytest.raises(ValueError, match=r"softplus\(0\.1\) ≈ 0\.744"):
        PoincareDistance(c=Curvature(0.1))(mt)


def test_not_a_poincare_ball_is_an_error(geometry):
    with pytest.raises(TypeError, match="Euclidean"):
        unwrap_ball_tensor(ManifoldTensor(torch.randn(3, 4), manifold=Euclidean()))
    with pytest.raises(TypeError, match="TangentTensor"):
        unwrap_ball_tensor(TangentTensor(torch.randn(3, 4), manifold=geometry))
    with pytest.raises(ValueError, match="man_dim"):
        unwrap_ball_tensor(ManifoldTensor(ball_points(3, 4).T.contiguous(), manifold=geometry, man_dim=0))
    with pytest.raises(TypeError, match="Euclidean"):
        PoincareDistance(c=C)(ManifoldTensor(torch.randn(3, 4), manifold=Euclidean()))


# ---- distance, losses, miners ----------------------------------------------------------------
def test_poincare_distance_on_manifold_tensors(geometry):
    x, y = ball_points(7, 5, seed=1), ball_points(4, 5, seed=2)
    mx, my = ManifoldTensor(x, manifold=geometry), ManifoldTensor(y, manifold=geometry)
    for c in (geometry, C):
        dist = PoincareDistance(c=c)
        torch.testing.assert_close(dist(mx), dist(x), rtol=0, atol=0)
        torch.testing.assert_close(dist(mx, my), dist(x, y), rtol=0, atol=0)
        torch.testing.assert_close(dist(mx, y), dist(x, y), rtol=0, atol=0)
        torch.testing.assert_close(dist.compute_mat(mx, my), dist.compute_mat(x, y), rtol=0, atol=0)
        torch.testing.assert_close(dist.pairwise_distance(ManifoldTensor(x[:4], manifold=geometry), my), dist.pairwise_distance(x[:4], y),
                                   rtol=0, atol=0)
    xg = x.clone().requires_grad_()
    PoincareDistance(c=geometry)(ManifoldTensor(xg, manifold=geometry)).sum().backward()
    assert xg.grad is not None and torch.isfinite(xg.grad).all() and xg.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="curvature mismatch"):
        PoincareDistance(c=1.0)(mx)


@pytest.mark.parametrize("make_loss", [
    lambda g: PairwiseCrossEntropyLoss(distance=PoincareDistance(c=g)),
    lambda g: UncertaintyAdaptiveContrastiveLoss(distance=PoincareDistance(c=g)),
    lambda g: UncertaintyAdaptiveTripletLoss(distance=PoincareDistance(c=g)),
    lambda g: accept_manifold_tensors(losses.TripletMarginLoss(distance=PoincareDistance(c=g))),
    lambda g: HyperbolicCrossBatchMemory(PairwiseCrossEntropyLoss(distance=PoincareDistance(c=g)),
                                         embedding_size=6, memory_size=32),
    lambda g: HIERLoss(embedding_size=6, num_proxies=8, c=g),
], ids=["pairwise_ce", "ua_contrastive", "ua_triplet", "pml_triplet", "xbm", "hier"])
def test_losses_accept_manifold_tensors(make_loss, geometry, batch):
    x, mx, labels = batch
    torch.manual_seed(0)
    plain = make_loss(geometry)
    torch.manual_seed(0)
    wrapped = make_loss(geometry)
    torch.manual_seed(1)  # HIERLoss samples
    expected = plain(x, labels)
    torch.manual_seed(1)
    torch.testing.assert_close(wrapped(mx, labels), expected)
    if not isinstance(plain, (HyperbolicCrossBatchMemory, HIERLoss)):
        ref = ball_points(6, 6, seed=3)
        ref_labels = torch.arange(6) // 2
        torch.testing.assert_close(
            wrapped(mx, labels, ref_emb=ManifoldTensor(ref, manifold=geometry), ref_labels=ref_labels),
            plain(x, labels, ref_emb=ref, ref_labels=ref_labels))
    with pytest.raises(ValueError, match="curvature mismatch"):
        wrapped(ManifoldTensor(x, manifold=PoincareGeometry(c=0.3)), labels)


def test_loss_gradient_reaches_the_points(geometry, batch):
    x, _, labels = batch
    xg = x.clone().requires_grad_()
    PairwiseCrossEntropyLoss(distance=PoincareDistance(c=geometry))(
        ManifoldTensor(xg, manifold=geometry), labels).backward()
    assert xg.grad is not None and xg.grad.abs().sum() > 0


def test_pml_loss_without_the_hook_fails_on_manifold_tensors(geometry, batch):
    _, mx, labels = batch  # documents why accept_manifold_tensors exists
    with pytest.raises(AttributeError):
        losses.TripletMarginLoss(distance=PoincareDistance(c=geometry))(mx, labels)


def test_hypmix_rejects_ball_points(batch):
    _, mx, labels = batch
    with pytest.raises(TypeError, match="MixedGeometryDistance"):
        HypMixLoss()(mx, labels)


@pytest.mark.parametrize("make_miner", [
    lambda g: HardNegativeProbabilityMiner(distance=PoincareDistance(c=g)),
    lambda g: MixedGeometryMiner(),  # default: cosine + PoincareDistance(c=0.1)
    lambda g: HierarchicalSimilarityMiner(distance=PoincareDistance(c=g), violating_only=True, seed=0),
    lambda g: accept_manifold_tensors(miners.TripletMarginMiner(distance=PoincareDistance(c=g))),
], ids=["hard_negative", "mixed_geometry", "hierarchical_similarity", "pml_triplet_miner"])
def test_miners_accept_manifold_tensors(make_miner, geometry, batch):
    x, mx, labels = batch
    miner = make_miner(geometry)
    out_plain, out_wrapped = miner(x, labels), miner(mx, labels)
    assert len(out_plain) == len(out_wrapped)
    for a, b in zip(out_plain, out_wrapped):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="curvature mismatch"):
        miner(ManifoldTensor(x, manifold=PoincareGeometry(c=0.3)), labels)


def test_pseudo_labeler_accepts_manifold_tensors(geometry, batch):
    x, mx, _ = batch
    labeler = HierarchicalPseudoLabeler(levels=(4, 2), c=geometry)
    assert torch.equal(labeler.fit_predict(mx), labeler.fit_predict(x))
    with pytest.raises(ValueError, match="curvature mismatch"):
        labeler.fit_predict(ManifoldTensor(x, manifold=PoincareGeometry(c=0.3)))


# ---- head ------------------------------------------------------------------------------------
def test_head_returns_manifold_tensor_on_its_geometry(geometry):
    torch.manual_seed(0)
    head = HyperbolicEmbeddingHead(10, 6, c=geometry, return_manifold_tensor=True)
    f = torch.randn(5, 10)
    out = head(f)
    assert isinstance(out, ManifoldTensor)
    assert out.manifold is head.geometry and head.geometry is geometry and out.man_dim == 1
    head.return_manifold_tensor = False
    plain = head(f)
    assert isinstance(plain, torch.Tensor) and torch.equal(out.tensor, plain)
    assert not HyperbolicEmbeddingHead(10, 6).return_manifold_tensor  # default: plain tensors
    # own geometry (c given as a float): still a ManifoldTensor on head.geometry
    head2 = HyperbolicEmbeddingHead(10, 6, c=0.2, radius="norm", return_manifold_tensor=True)
    assert head2(f).manifold is head2.geometry
    # and straight into a package loss sharing the geometry
    loss = PairwiseCrossEntropyLoss(distance=PoincareDistance(c=head.geometry))
    head.return_manifold_tensor = True
    assert torch.isfinite(loss(head(f), torch.tensor([0, 0, 1, 1, 2])))


# ---- docs ----------------------------------------------------------------------------------
def test_readme_example_trains_a_hypll_network(capsys):
    namespace = {}
    exec(compile(README_EXAMPLE, "README_EXAMPLE", "exec"), namespace)
    seen = namespace["losses_seen"]
    assert all(math.isfinite(v) for v in seen)
    assert seen[-1] < 0.8 * seen[0]
    layer = namespace["net"][1]
    for p in (layer.z, layer.bias):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
    assert "triplet loss" in capsys.readouterr().out


def test_readme_hypll_example_is_the_tested_code():
    import os

    readme = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "docs", "plug-into-pml.md")
    with open(readme, encoding="utf-8") as fh:
        text = fh.read()
    block = text.split("## hypll networks", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert block.strip() == README_EXAMPLE.strip()
