"""Radius terms: RadialCalibrationLoss, DegradedCopyRadiusLoss, RandomDegradation,
DegradedCopyTrainer and the recipes' --radial-calibration / --degraded-copies."""
import math

import numpy as np
import pytest
import torch
from pytorch_metric_learning.miners import BatchEasyHardMiner

from pml_hyperbolic.data.degradations import RandomDegradation, gaussian_blur, gaussian_blur_batch, gaussian_kernel1d
from pml_hyperbolic.geometry import PoincareGeometry
from pml_hyperbolic.losses import DegradedCopyRadiusLoss, RadialCalibrationLoss
from pml_hyperbolic.losses.radial_calibration_loss import radius_ranking_loss, retrieval_success_target

# Reference points (2-D, c = 0.1) and their values, from this plain-numpy snippet (float64,
# independent of the package):
#
#   c, tau, s = 0.1, 0.2, 0.1
#   d0 = 2 / sqrt(c) * arctanh(sqrt(c) * |x|)
#   D_ij = 2 / sqrt(c) * arcsinh(sqrt(c |x_i - x_j|² / ((1 - c|x_i|²)(1 - c|x_j|²))))
#   anchors: samples with a same-class partner; for each, q_i = sum over same-class j != i of
#   softmax_{k != i}(-D_ik / tau)_j;  W_ij = max(0, q_i - q_j) over anchors
#   loss = s * sum(W * log1p(exp(-(d0_i - d0_j) / s))) / sum(W)
#   hinge = mean(max(0, 0.2 + d0(x_deg) - d0(x_clean)))
X = [[0.3, -0.5], [0.4, -0.2], [-1.0, 0.9], [-0.8, 1.2], [0.1, 0.05]]
Y = [0, 1, 1, 0, 0]  # the best-retrieved anchor (index 4) is the one nearest the origin: a large loss
CALIBRATION_REFERENCE = 1.6975663386007245
Y_ORDERED = [0, 0, 1, 1, 2]  # here the radii already follow the targets: a small loss
CALIBRATION_REFERENCE_ORDERED = 0.001504528282875153
X_DEGRADED = [[0.2, -0.4], [0.5, -0.3], [-0.5, 0.4]]
HINGE_REFERENCE = 0.15974030703549524


def geometry(**kw):
    return PoincareGeometry(c=0.1, clip_r=2.3, **kw)


# ---------------------------------------------------------------- RadialCalibrationLoss

@pytest.mark.parametrize("labels, expected", [(Y, CALIBRATION_REFERENCE), (Y_ORDERED, CALIBRATION_REFERENCE_ORDERED)])
def test_calibration_reference_values(labels, expected):
    loss = RadialCalibrationLoss(c=geometry())
    assert float(loss(torch.tensor(X, dtype=torch.float64), torch.tensor(labels))) == pytest.approx(expected, rel=1e-8)
    assert float(loss(torch.tensor(X), torch.tensor(labels))) == pytest.approx(expected, rel=1e-4)


def test_calibration_gradient_is_radial_and_orders_the_radii():
    x = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    RadialCalibrationLoss(c=geometry())(x, torch.tensor(Y)).backward()
    g = x.grad
    # the target is detached: the gradient is radial (parallel to x) for every sample
    cross = g[:, 0] * x[:, 1] - g[:, 1] * x[:, 0]
    assert torch.allclose(cross, torch.zeros_like(cross), atol=1e-12)
    radial = (g * x).sum(1)  # < 0: a descent step moves the point outwards
    assert radial[4] < 0  # best retrieved, nearest the origin: pushed out
    assert radial[3] > 0  # worst retrieved of its class, farthest out: pushed in


def test_calibration_gradient_matches_the_formula_with_a_fixed_target_float64():
    # the target q is detached, so finite differences of the loss (which also move q) do not apply:
    # compare with autograd through the explicit formula at the loss's own (fixed) q
    from pml_hyperbolic import poincare_ball as pb

    loss = RadialCalibrationLoss(c=geometry())
    labels = torch.tensor(Y)
    x = torch.tensor(X, dtype=torch.float64, requires_grad=True)
    loss(x, labels).backward()
    with torch.no_grad():
        pos = labels[:, None] == labels[None]
        pos.fill_diagonal_(False)
        q = retrieval_success_target(pb.pairwise_dist(x, x, 0.1), pos, ~torch.eye(5, dtype=torch.bool), 0.2)
    x2 = x.detach().clone().requires_grad_(True)
    d0 = 2 / math.sqrt(0.1) * torch.atanh(math.sqrt(0.1) * x2.norm(dim=1))
    a = pos.any(1)
    w = (q[a][:, None] - q[a][None]).clamp_min(0)
    margin = (d0[a][:, None] - d0[a][None]) / 0.1
    (0.1 * (w * torch.nn.functional.softplus(-margin)).sum() / w.sum()).backward()
    assert torch.allclose(x.grad, x2.grad, rtol=1e-7, atol=1e-10)


def test_calibration_gradcheck_of_the_ranking_float64():
    d0 = torch.tensor([0.5, 1.0, 2.0, 1.5], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([0.9, 0.1, 0.5, 0.3], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda d: radius_ranking_loss(d, q, 0.1), (d0,))
    assert float(radius_ranking_loss(d0, torch.full((4,), 0.5, dtype=torch.float64), 0.1).detach()) == 0.0


def test_calibration_fewer_than_two_anchors_gives_zero_with_grad():
    x = torch.tensor(X, requires_grad=True)
    value = RadialCalibrationLoss(c=geometry())(x, torch.arange(5))
    assert float(value.detach()) == 0.0
    value.backward()  # still part of the graph (PML zero_losses)


def test_calibration_with_miner_pairs_runs_and_is_finite():
    torch.manual_seed(0)
    x = 0.3 * torch.randn(16, 8)
    labels = torch.arange(4).repeat_interleave(4)
    pairs = BatchEasyHardMiner()(x, labels)
    value = RadialCalibrationLoss(c=geometry())(x, labels, pairs)
    assert math.isfinite(float(value)) and float(value) >= 0


def test_retrieval_success_target_values():
    d = torch.tensor([[0.0, 1.0, 2.0], [1.0, 0.0, 1.0]])
    pos = torch.tensor([[False, True, False], [False, False, False]])
    cand = torch.tensor([[False, True, True], [False, False, False]])
    q = retrieval_success_target(d, pos, cand, temperature=1.0)
    assert float(q[0]) == pytest.approx(math.exp(-1) / (math.exp(-1) + math.exp(-2)))
    assert float(q[1]) == 0.0  # no candidates: 0, not NaN


@pytest.mark.parametrize("kwargs, match", [
    ({}, "PoincareGeometry"),
    ({"c": 0.1}, "PoincareGeometry"),
    ({"c": PoincareGeometry(c=0.1, clip_r=2.3), "temperature": 0}, "temperature"),
    ({"c": PoincareGeometry(c=0.1, clip_r=2.3), "scale": -1}, "scale"),
])
def test_calibration_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RadialCalibrationLoss(**kwargs)


def test_calibration_shares_the_geometry_by_reference():
    g = geometry(learnable_c=True)
    loss = RadialCalibrationLoss(c=g)
    assert loss.geometry is g and loss.distance._c is g


# ---------------------------------------------------------------- DegradedCopyRadiusLoss

def test_hinge_reference_value():
    clean = torch.tensor(X[:3], dtype=torch.float64)
    value = DegradedCopyRadiusLoss(c=geometry())(clean, ref_emb=torch.tensor(X_DEGRADED, dtype=torch.float64))
    assert float(value) == pytest.approx(HINGE_REFERENCE, rel=1e-9)


def test_hinge_gradcheck_float64():
    loss = DegradedCopyRadiusLoss(c=geometry(), margin=0.5)
    clean = torch.tensor(X[:3], dtype=torch.float64, requires_grad=True)
    degraded = torch.tensor(X_DEGRADED, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: loss(a, ref_emb=b), (clean, degraded))


def test_hinge_pushes_copy_inwards_and_source_outwards():
    clean = torch.tensor([[0.5, 0.0]], requires_grad=True)
    degraded = torch.tensor([[0.6, 0.0]], requires_grad=True)
    DegradedCopyRadiusLoss(c=geometry())(clean, ref_emb=degraded).backward()
    assert clean.grad[0, 0] < 0 < degraded.grad[0, 0]  # descent: clean outwards, copy inwards


def test_hinge_bad_inputs():
    loss = DegradedCopyRadiusLoss(c=geometry())
    x = torch.tensor(X[:3])
    with pytest.raises(ValueError, match="ref_emb"):
        loss(x)
    with pytest.raises(ValueError, match="shape"):
        loss(x, ref_emb=torch.tensor(X))
    with pytest.raises(ValueError, match="PoincareGeometry"):
        DegradedCopyRadiusLoss(c=0.1)
    with pytest.raises(ValueError, match="margin"):
        DegradedCopyRadiusLoss(c=geometry(), margin=-1)


# ---------------------------------------------------------------- RandomDegradation

def test_degradation_shapes_and_input_untouched():
    images = torch.randn(6, 3, 20, 24)
    before = images.clone()
    out = RandomDegradation()(images, torch.Generator().manual_seed(0))
    assert out.shape == images.shape and torch.equal(images, before)
    assert not torch.equal(out, images)


def test_degradation_is_reproducible_with_a_generator():
    images = torch.randn(5, 3, 16, 16)
    a = RandomDegradation()(images, torch.Generator().manual_seed(3))
    b = RandomDegradation()(images, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_each_kind():
    images = torch.randn(4, 3, 32, 32)
    gen = torch.Generator().manual_seed(1)
    occluded = RandomDegradation(kinds=["occlusion"], occlusion_side=(0.25, 0.25))(images, gen)
    assert ((occluded == 0).all(dim=1).sum(dim=(1, 2)) == 64).all()  # one 8x8 square per image
    noisy = RandomDegradation(kinds=["noise"], noise_std=(0.5, 0.5))(images, gen)
    assert 0.4 < float((noisy - images).std()) < 0.6
    flat = torch.full((1, 3, 16, 16), 0.7)
    blurred = RandomDegradation(kinds=["blur"])(flat, gen)
    assert torch.allclose(blurred, flat, atol=1e-6)  # a constant image stays constant (reflect padding)
    sharp = torch.zeros(1, 3, 17, 17)
    sharp[..., 8, 8] = 1.0
    assert float(RandomDegradation(kinds=["blur"], blur_sigma=(0.1, 0.1))(sharp, gen).amax()) < 0.1


def test_gaussian_kernel_and_blur_values():
    k = gaussian_kernel1d(1.0, torch.float64)
    assert len(k) == 7 and float(k.sum()) == pytest.approx(1.0)
    assert float(k[3] / k[4]) == pytest.approx(math.exp(0.5))
    image = torch.zeros(1, 9, 9, dtype=torch.float64)
    image[0, 4, 4] = 1.0
    out = gaussian_blur(image, 1.0)
    assert float(out[0, 4, 4]) == pytest.approx(float(k[3] ** 2))


def test_batch_blur_matches_a_separable_reference_per_image():
    # reference: scipy's correlate1d with this module's taps, mode "mirror" (= torch's "reflect"),
    # one image and one sigma at a time, in float64
    from scipy.ndimage import correlate1d

    gen = torch.Generator().manual_seed(5)
    images = torch.randn(5, 2, 19, 23, generator=gen, dtype=torch.float64)
    sigmas = torch.tensor([0.4, 1.0, 2.2, 0.7, 3.1], dtype=torch.float64)  # kernel widths 3 to 21 taps
    out = gaussian_blur_batch(images, sigmas)
    for i, sigma in enumerate(sigmas.tolist()):
        taps = gaussian_kernel1d(sigma, torch.float64).numpy()
        ref = correlate1d(correlate1d(images[i].numpy(), taps, axis=2, mode="mirror"), taps, axis=1, mode="mirror")
        assert np.allclose(out[i].numpy(), ref, rtol=0, atol=1e-12)
        assert torch.allclose(out[i], gaussian_blur(images[i], sigma), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="one positive"):
        gaussian_blur_batch(images, sigmas[:3])
    with pytest.raises(ValueError, match="one positive"):
        gaussian_blur_batch(images, -sigmas)


def test_mixed_kinds_touch_each_image_once_and_keep_the_batch_order():
    images = torch.randn(40, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    out = RandomDegradation(occlusion_side=(0.5, 0.5))(images, torch.Generator().manual_seed(4))
    changed = (out != images).flatten(1)
    assert changed.any(dim=1).all()  # every image degraded
    occluded = (out == 0).all(dim=1).flatten(1).sum(dim=1) == 64  # an 8x8 square, nothing else changed
    only_square = changed.sum(dim=1) <= 3 * 64
    assert (occluded & only_square).any() and (~occluded).any()
    assert RandomDegradation()(images[:0]).shape == (0, 3, 16, 16)


@pytest.mark.parametrize("kwargs, match", [
    ({"kinds": ["fog"]}, "kinds"), ({"kinds": []}, "kinds"), ({"blur_sigma": (0.1, 0.01)}, "blur_sigma"),
    ({"noise_std": (-1, 1)}, "noise_std"), ({"occlusion_side": 0.3}, "occlusion_side"),
])
def test_degradation_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RandomDegradation(**kwargs)


def test_degradation_needs_a_batch():
    with pytest.raises(ValueError, match="B, C, H, W"):
        RandomDegradation()(torch.zeros(3, 8, 8))


# ---------------------------------------------------------------- DegradedCopyTrainer

def _tiny_trainer(copy_fraction=0.25, **kw):
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss
    from pml_hyperbolic.training.degraded_copy_trainer import DegradedCopyTrainer

    g = geometry()
    trunk = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    head = HyperbolicEmbeddingHead(4, 8, c=g)
    images = torch.randn(32, 3, 12, 12)
    labels = torch.arange(8).repeat_interleave(4)
    dataset = torch.utils.data.TensorDataset(images, labels)
    loss_funcs = {"metric_loss": PairwiseCrossEntropyLoss(), "degraded_copy_loss": DegradedCopyRadiusLoss(c=g)}
    optimizers = {"embedder_optimizer": torch.optim.SGD(head.parameters(), lr=0.1)}
    trainer = DegradedCopyTrainer(models={"trunk": trunk, "embedder": head}, optimizers=optimizers, batch_size=16,
                                  loss_funcs=loss_funcs, mining_funcs={}, dataset=dataset, show_progress=False,
                                  copy_fraction=copy_fraction, data_and_label_getter=lambda b: (b[0], b[1]), **kw)
    return trainer, head, images, labels


def test_trainer_step_computes_both_losses_on_one_forward(monkeypatch):
    trainer, head, images, labels = _tiny_trainer()
    seen = []
    original = head.forward
    monkeypatch.setattr(head, "forward", lambda x: (seen.append(len(x)), original(x))[1])
    torch.manual_seed(0)
    trainer.calculate_loss((images[:16], labels[:16]))
    assert seen == [16 + 4]  # ⌈0.25·16⌉ copies in the same forward
    assert torch.is_tensor(trainer.losses["metric_loss"]) and torch.is_tensor(trainer.losses["degraded_copy_loss"])
    assert float(trainer.losses["degraded_copy_loss"].detach()) >= 0


def test_trainer_trains():
    trainer, head, _, _ = _tiny_trainer(copy_fraction=1.0)
    torch.manual_seed(0)
    before = [p.detach().clone() for p in head.parameters()]
    trainer.train(num_epochs=1)
    assert any(not torch.equal(a, b) for a, b in zip(before, head.parameters()))


def test_trainer_bad_arguments():
    with pytest.raises(ValueError, match="copy_fraction"):
        _tiny_trainer(copy_fraction=0)
    with pytest.raises(ValueError, match="copy_fraction"):
        _tiny_trainer(copy_fraction="lots")
    for bad in (True, "0.5", float("nan"), float("inf"), -0.1, 1.5, None):
        with pytest.raises(ValueError, match="copy_fraction"):
            _tiny_trainer(copy_fraction=bad)
    with pytest.raises(TypeError, match="degradation"):
        _tiny_trainer(degradation="blur")


# ---------------------------------------------------------------- recipes: --radial-calibration, --degraded-copies

def test_hyp_uml_recipe_trains_with_both_terms_by_default(tmp_path):
    from pytorch_metric_learning.losses import MultipleLosses
    from tests.recipes.test_recipe_end_to_end import run

    from pml_hyperbolic.training.degraded_copy_trainer import DegradedCopyTrainer

    instances = []
    run("hyp_uml_cars", "HypUML", tmp_path, ["--no-plots"], instances=instances)
    recipe = instances[0]
    assert isinstance(recipe.trainer, DegradedCopyTrainer) and recipe.trainer.copy_fraction == 0.25
    metric = recipe.trainer.loss_funcs["metric_loss"]
    assert isinstance(metric, MultipleLosses) and isinstance(metric.losses[1], RadialCalibrationLoss)
    assert metric.losses[1].geometry is recipe.geometry  # one geometry, by reference
    assert recipe.trainer.loss_funcs["degraded_copy_loss"].geometry is recipe.geometry


def test_hyp_vit_recipe_terms_off_by_default_and_on_by_flag(tmp_path):
    from tests.recipes.test_recipe_end_to_end import run

    from pml_hyperbolic.training.degraded_copy_trainer import DegradedCopyTrainer

    instances = []
    run("hyp_vit", "HypViT", tmp_path / "off", instances=instances)
    assert not isinstance(instances[0].trainer, DegradedCopyTrainer)
    run("hyp_vit", "HypViT", tmp_path / "on", ["--degraded-copies", "0.5", "--degraded-copy-margin", "0.3"],
        instances=instances)
    trainer = instances[1].trainer
    assert isinstance(trainer, DegradedCopyTrainer) and trainer.copy_fraction == 0.5
    assert trainer.loss_funcs["degraded_copy_loss"].margin == 0.3


@pytest.mark.parametrize("flags, message", [
    (["--degraded-copies", "0.5", "--head-radius", "norm"], "--head-radius learned"),
    (["--radial-calibration", "1", "--model", "sph"], "hyperbolic head"),
    (["--degraded-copies", "1.5"], "fraction"),
    (["--radial-calibration", "-1"], ">= 0"),
])
def test_recipe_flag_errors(flags, message, tmp_path, capsys):
    from tests.recipes.test_recipe_end_to_end import expect_flag_error, load_recipe

    expect_flag_error(load_recipe("hyp_vit").HypViT, flags, message, tmp_path, capsys)


# ---------------------------------------------------------------- contracts on degenerate and bad inputs

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_calibration_all_labels_equal_is_exactly_zero_with_zero_gradient(dtype, seed):
    # every q is 1 in exact arithmetic (no negatives): the targets carry no information
    torch.manual_seed(seed)
    x = (torch.randn(16, 4, dtype=dtype) * 0.5).requires_grad_()
    value = RadialCalibrationLoss(c=geometry())(x, torch.zeros(16, dtype=torch.long))
    value.backward()
    assert float(value.detach()) == 0.0
    assert float(x.grad.abs().max()) == 0.0


def test_calibration_takes_hierarchical_labels_by_their_finest_level():
    # the unsupervised recipe hands (N, K) pseudo-labels (finest first) to every loss of its
    # MultipleLosses: the calibration uses the finest column, as with (N,) labels
    torch.manual_seed(0)
    x = torch.randn(24, 4) * 0.5
    fine = torch.arange(24) // 3
    loss = RadialCalibrationLoss(c=geometry())
    flat = loss(x, fine)
    assert torch.equal(loss(x, fine[:, None]), flat)
    assert torch.equal(loss(x, torch.stack([fine, fine // 4], dim=1)), flat)


def test_ranking_loss_ignores_rounding_noise_in_the_targets():
    d0 = torch.tensor([0.1, 0.5, 0.9], requires_grad=True)
    target = torch.tensor([1.0, 1.0 - 1.2e-7, 1.0 - 2.4e-7])  # equal up to float32 rounding
    value = radius_ranking_loss(d0, target, 0.1)
    value.backward()
    assert float(value.detach()) == 0.0 and float(d0.grad.abs().max()) == 0.0
    # a real spread still gives the documented loss
    assert float(radius_ranking_loss(d0.detach(), torch.tensor([0.0, 0.5, 1.0]), 0.1)) > 0


def test_hinge_rejects_non_finite_and_one_dimensional_input():
    loss = DegradedCopyRadiusLoss(c=geometry())
    x = torch.tensor(X[:3])
    bad = x.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match="embeddings.*NaN/Inf"):
        loss(bad, ref_emb=x)
    with pytest.raises(ValueError, match="ref_emb.*NaN/Inf"):
        loss(x, ref_emb=x.masked_fill(torch.eye(3, 2, dtype=torch.bool), float("inf")))
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        loss(x[:, 0], ref_emb=x[:, 1])
    with pytest.raises(TypeError, match="floating point"):
        loss(x.long(), ref_emb=x.long())


def test_hinge_manifold_tensor_curvature_mismatch_names_both():
    from hypll.tensors import ManifoldTensor

    loss = DegradedCopyRadiusLoss(c=geometry())  # c = 0.1
    other = PoincareGeometry(c=0.3)
    clean = ManifoldTensor(torch.tensor(X[:3]), manifold=other, man_dim=-1)
    with pytest.raises(ValueError, match=r"(?s)0\.3.*0\.1"):
        loss(clean, ref_emb=torch.tensor(X_DEGRADED))
    with pytest.raises(ValueError, match=r"(?s)0\.3.*0\.1"):
        loss(torch.tensor(X[:3]), ref_emb=ManifoldTensor(torch.tensor(X_DEGRADED), manifold=other, man_dim=-1))
    same = ManifoldTensor(torch.tensor(X[:3], dtype=torch.float64), manifold=PoincareGeometry(c=0.1), man_dim=-1)
    value = loss(same, ref_emb=torch.tensor(X_DEGRADED, dtype=torch.float64))
    assert float(value) == pytest.approx(HINGE_REFERENCE, rel=1e-9)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), True, "0.2", 1e-320])
def test_radius_helpers_reject_bad_scalars(bad):
    d = torch.rand(3, 3)
    mask = torch.eye(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="temperature"):
        retrieval_success_target(d, mask, torch.ones(3, 3, dtype=torch.bool), bad)
    with pytest.raises(ValueError, match="scale"):
        radius_ranking_loss(torch.rand(3), torch.tensor([0.0, 0.5, 1.0]), bad)
    if bad != 0.0 and bad != 1e-320:  # a zero margin is valid
        from pml_hyperbolic.losses.degraded_copy_radius_loss import radius_order_hinge

        with pytest.raises(ValueError, match="margin"):
            radius_order_hinge(torch.rand(3), torch.rand(3), bad)
