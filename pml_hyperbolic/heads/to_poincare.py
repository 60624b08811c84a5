"""Map Euclidean features into the Poincaré ball."""
from __future__ import annotations

import torch
from torch import nn

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CLIP_R, DEFAULT_CURVATURE, PoincareGeometry

_UNSET = object()


def resolve_geometry(c, clip_r=_UNSET, learnable_c=_UNSET, clip=_UNSET, default_clip="hard") -> PoincareGeometry:
    """The :class:`PoincareGeometry` a head uses: ``c`` itself when it is one (then the clipping and
    learnability are that object's, and passing them again is an error), else a new one built from
    the float / tensor / hypll curvature and the given clipping."""
    if isinstance(c, PoincareGeometry):
        given = [n for n, v in (("clip_r", clip_r), ("learnable_c", learnable_c), ("clip", clip)) if v is not _UNSET]
        if given:
            raise ValueError(f"{', '.join(given)} given together with a PoincareGeometry: the geometry owns "
                             "the clipping and the curvature; set them when building it")
        return c
    return PoincareGeometry(
        c=c, learnable_c=False if learnable_c is _UNSET else bool(learnable_c),
        clip=default_clip if clip is _UNSET else clip,
        clip_r=DEFAULT_CLIP_R if clip_r is _UNSET else clip_r)


class ToPoincare(nn.Module):
    r"""Clip the tangent vector, map it by the exponential map at the origin, project:

    .. math:: x \mapsto \operatorname{proj}\Big(\exp_0^c\big(\operatorname{clip}_r(x)\big)\Big)

    with :math:`\operatorname{clip}_r(x) = x\min(1, r/\|x\|)` (``clip="hard"``, Guo et al.,
    "Clipped hyperbolic classifiers", CVPR'22; Hyp-ViT) or :math:`x\,r\tanh(\|x\|/r)/\|x\|`
    (``clip="tanh"``: smooth, keeps the order of the norms); see :mod:`pml_hyperbolic.geometry`.

    Args:
        c: a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (shared by reference: the clipping
            and the curvature are then that object's), or a curvature magnitude (float, tensor or
            hypll object) from which a private geometry is built.
        clip_r: clipping radius (> 0); with ``clip=None`` no clipping. ``clip_r=None`` also means no
            clipping (the older spelling). ``clip_r <= 0`` is an error (one public implementation
            treats 0 as "off" but maps every feature to the origin).
        learnable_c: learn c (stored as log c in the geometry's hypll ``Curvature``).
        clip: ``"hard"`` (default here: the papers' head), ``"tanh"`` or ``None``.
    """

    def __init__(self, c=DEFAULT_CURVATURE, clip_r=_UNSET, learnable_c=_UNSET, clip=_UNSET):
        super().__init__()
        if clip_r is None and clip is _UNSET:
            clip = None
        if clip_r is not _UNSET and clip_r is not None and not (float(clip_r) > 0.0):
            raise ValueError(f"clip_r must be > 0 or None (no clipping), got {clip_r}")
        self.geometry = resolve_geometry(c, clip_r, learnable_c, clip)

    @property
    def c(self) -> torch.Tensor:
        """Current curvature magnitude (a 0-d tensor; differentiable when learnable)."""
        return self.geometry.curvature()

    @property
    def clip_r(self):
        return self.geometry.clip_r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pb.check_finite(x, "features")
        return self.geometry.to_ball(x)
