"""Embedding heads: a Linear layer followed by the ball map (Hyp-) or L2 normalisation (Sph-)."""
from __future__ import annotations

import torch
from torch import nn

from ..geometry import DEFAULT_CURVATURE
from .to_poincare import _UNSET, ToPoincare


def _orthogonal_linear(in_features: int, out_features: int) -> nn.Linear:
    # (Semi-)orthogonal weights and zero bias, as in the Hyp-ViT head.
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight)
    nn.init.zeros_(linear.bias)
    return linear


class HyperbolicEmbeddingHead(nn.Module):
    """The Hyp-ViT head: ``Linear(in, out)`` (orthogonal init, zero bias) then :class:`ToPoincare`.

    Defaults follow Ermolov et al. (CVPR'22): 128-d, c = 0.1, clip radius 2.3. Pass a
    :class:`~pml_hyperbolic.geometry.PoincareGeometry` as ``c`` to share the curvature and the
    clipping with the distance, losses and evaluation (by reference); ``head.geometry`` is the
    object in use either way. Returns a plain tensor of ball points.
    """

    def __init__(self, in_features: int, out_features: int = 128, c=DEFAULT_CURVATURE, clip_r=_UNSET,
                 learnable_c=_UNSET, clip=_UNSET):
        super().__init__()
        self.linear = _orthogonal_linear(in_features, out_features)
        self.to_poincare = ToPoincare(c=c, clip_r=clip_r, learnable_c=learnable_c, clip=clip)

    @property
    def geometry(self):
        return self.to_poincare.geometry

    @property
    def c(self) -> torch.Tensor:
        return self.to_poincare.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_poincare(self.linear(x))


class SphericalEmbeddingHead(nn.Module):
    """The "Sph-" baseline head: the same ``Linear`` then L2 normalisation onto the unit sphere."""

    def __init__(self, in_features: int, out_features: int = 128):
        super().__init__()
        self.linear = _orthogonal_linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.linear(x).float(), dim=-1)
