import math
import warnings

import pytest
import torch

from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.uncertainty import UNCERTAINTY_MODES, hyperbolic_uncertainty, uncertainty_ratio_log


def test_clip_mode_matches_tangent_norm():
    v = torch.randn(20, 8, dtype=torch.float64)
    z = ToPoincare(c=0.1, clip_r=2.3)(v)
    u = hyperbolic_uncertainty(z, c=0.1)
    r = v.norm(dim=1).clamp(max=2.3)
    assert torch.allclose(u, 1 - r / 2.3, atol=1e-6)
    assert u.shape == (20,) and not u.requires_grad


@pytest.mark.parametrize("mode", ["clip", "ball", "batch"])
def test_sound_modes_in_unit_interval_and_ordered(mode):
    radii = torch.linspace(0.0, 2.3, 7, dtype=torch.float64)
    v = torch.zeros(7, 3, dtype=torch.float64)
    v[:, 0] = radii
    z = ToPoincare(c=0.1, clip_r=2.3)(v)
    u = hyperbolic_uncertainty(z, c=0.1, mode=mode)
    assert bool(((u >= 0) & (u <= 1)).all())
    assert bool((u[1:] < u[:-1]).all())  # nearer the origin = more uncertain


def test_literal_mode_warns_and_ratio_guard_is_finite():
    z = ToPoincare(c=0.1, clip_r=2.3)(torch.randn(10, 4) * 5)
    with pytest.warns(RuntimeWarning, match="literal"):
        u = hyperbolic_uncertainty(z, c=0.1, mode="literal")
    assert bool((u < 0).all())
    f = uncertainty_ratio_log(u)
    assert bool(torch.isfinite(f).all())
    d0 = (2 / math.sqrt(0.1)) * torch.atanh(math.sqrt(0.1) * z.double().norm(dim=1))
    assert torch.allclose(u.double(), 1 - d0 / 2, atol=1e-4)


def test_detach_switch_and_gradient_finite_at_origin():
    z = torch.zeros(3, 4, requires_grad=True)
    u = hyperbolic_uncertainty(z, detach=False, mode="ball")
    u.sum().backward()
    assert torch.isfinite(z.grad).all()


def test_bad_args():
    z = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="mode"):
        hyperbolic_uncertainty(z, mode="nope")
    with pytest.raises(ValueError, match="clip_r"):
        hyperbolic_uncertainty(z, clip_r=0)
    with pytest.raises(ValueError, match="c"):
        hyperbolic_uncertainty(z, c=-1.0)
    with pytest.raises(ValueError, match="embeddings"):
        hyperbolic_uncertainty(torch.zeros(3))
    assert set(UNCERTAINTY_MODES) == {"clip", "ball", "batch", "literal"}


def test_batch_mode_constant_batch():
    assert torch.equal(hyperbolic_uncertainty(torch.zeros(4, 2), mode="batch"), torch.ones(4))
