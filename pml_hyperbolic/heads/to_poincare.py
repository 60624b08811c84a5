"""Map Euclidean features into the Poincaré ball.

Design note: docs/design/heads.md
"""
from __future__ import annotations

from numbers import Real

import torch
from torch import Tensor, nn

from ..geometry import _UNSET, DEFAULT_CURVATURE, PoincareGeometry, _Unset, as_geometry


def resolve_geometry(c: float | Tensor | PoincareGeometry | nn.Module, clip_r: float | None | _Unset = _UNSET,
                     learnable_c: bool | _Unset = _UNSET, clip: str | None | _Unset = _UNSET,
                     default_clip: str | None = "hard") -> PoincareGeometry:
    """The :class:`PoincareGeometry` a head uses: :func:`~pml_hyperbolic.geometry.as_geometry` (the
    package's one conversion), kept under this name for existing callers.

    Args:
        c: a ``PoincareGeometry`` (returned as is: the clipping and learnability are that object's),
            or a curvature from which a new geometry is built.
        clip_r: clip radius of the new geometry; unset: ``DEFAULT_CLIP_R``.
        learnable_c: learn the new geometry's curvature; unset: ``False``.
        clip: clipping mode of the new geometry; unset: ``default_clip``.
        default_clip: the clipping mode used when ``clip`` is unset.

    Returns:
        ``c`` itself, or the new geometry.

    Raises:
        ValueError: ``clip_r``, ``learnable_c`` or ``clip`` given together with a geometry, or
            rejected by :class:`PoincareGeometry`.
    """
    return as_geometry(c, clip_r=clip_r, learnable_c=learnable_c, clip=clip, default_clip=default_clip)


class ToPoincare(nn.Module):
    r"""Clip the tangent vector, map it by the exponential map at the origin, project:

    .. math:: x \mapsto \operatorname{proj}\Big(\exp_0^c\big(\operatorname{clip}_r(x)\big)\Big)

    with :math:`\operatorname{clip}_r(x) = x\min(1, r/\|x\|)` (``clip="hard"``, Guo et al.,
    "Clipped hyperbolic classifiers", CVPR'22; Hyp-ViT) or :math:`x\,r\tanh(\|x\|/r)/\|x\|`
    (``clip="tanh"``: smooth, keeps the order of the norms); see :mod:`pml_hyperbolic.geometry`.

    Args:
        c: a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (shared by reference: the clipping
            and the curvature are then that object's), or a curvature magnitude (float, tensor or
            hypll object) from which a private geometry is built by
            :func:`~pml_hyperbolic.geometry.as_geometry`; default
            :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`.
        clip_r: clipping radius (> 0); unset: :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`
            (Hyp-ViT's). ``clip_r=None`` means no clipping
            (as ``clip=None``). ``clip_r <= 0`` is an error rather than "off": a radius of 0 would
            map every feature to the origin.
        learnable_c: learn c (stored as log c in the geometry's hypll ``Curvature``); unset: False.
        clip: ``"hard"`` (unset: the papers' head), ``"tanh"`` or ``None``.

    Raises:
        TypeError: ``clip_r`` is not a real number (a bool or a string included). At call time,
            features that are not a floating-point tensor.
        ValueError: ``clip_r <= 0`` (or not finite); ``clip_r``, ``learnable_c`` or ``clip`` given
            with a ``PoincareGeometry``; an invalid curvature or clipping mode. At call time,
            features that hold NaN or Inf.

    Design note: docs/design/heads.md
    """

    def __init__(self, c: float | Tensor | PoincareGeometry | nn.Module = DEFAULT_CURVATURE,
                 clip_r: float | None | _Unset = _UNSET, learnable_c: bool | _Unset = _UNSET,
                 clip: str | None | _Unset = _UNSET):
        super().__init__()
        if clip_r is None and clip is _UNSET:
            clip = None
        if clip_r is not _UNSET and clip_r is not None:
            is_scalar_tensor = isinstance(clip_r, Tensor) and clip_r.numel() == 1 and clip_r.is_floating_point()
            if isinstance(clip_r, bool) or not (isinstance(clip_r, Real) or is_scalar_tensor):
                raise TypeError(f"clip_r must be a real number > 0 or None (no clipping), "
                                f"got {type(clip_r).__name__} {clip_r!r}")
            if not (float(clip_r) > 0.0):
                raise ValueError(f"clip_r must be > 0 or None (no clipping), got {clip_r}")
        self.geometry = resolve_geometry(c, clip_r, learnable_c, clip)

    @property
    def c(self) -> torch.Tensor:
        """Current curvature magnitude (a 0-d tensor; differentiable when learnable)."""
        return self.geometry.curvature()

    @property
    def clip_r(self) -> float | None:
        """The geometry's clip radius (``None``: no clipping)."""
        return self.geometry.clip_r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.geometry.to_ball(x)  # checks the features (type, dtype, NaN/Inf)
