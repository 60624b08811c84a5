r"""Hyperbolic uncertainty: how close an embedding lies to the origin of the Poincaré ball.

Hyp-UML (Yan, Liu, Xu), Sec. III-B, defines :math:`U(x) = 1 - D_{Hyp}(x, 0)`. As written this is
unusable for the embeddings every hyperbolic metric-learning head produces: the paper's
:math:`D` lacks the factor 2 of the geodesic distance, and with feature clipping at radius
:math:`r` (Hyp-ViT's head: :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`) :math:`D(x, 0)` (with or without the 2) exceeds 1 for almost every
point, so :math:`U < 0` and the losses' :math:`\log(U / \max U + 1)` is NaN or reversed.

:func:`hyperbolic_uncertainty` therefore offers several normalisations (``mode``):

* ``"clip"`` (**the default**: in [0, 1] and batch-independent):
  :math:`U = \operatorname{clamp}(1 - d_c(x, 0) / (2 r), 0, 1)`. For points produced by
  ``ToPoincare`` (clip then ``expmap0``), :math:`d_c(x, 0) = 2\|v\|` with :math:`\|v\| \le r` the
  clipped tangent norm, so :math:`U = 1 - \|v\|/r \in [0, 1]`: 1 at the origin, 0 at the clip radius.
  Batch-independent, so it is also the right quantity for analysis (recall per uncertainty).
  Values within 64 ulp of 0 are snapped to 0 (rounding of points at the clip radius). A head
  whose outputs all sit at the clip radius gives U = 0 for every embedding; the losses then use
  the same factor log 2 for every anchor (see :func:`uncertainty_ratio_log`).
* ``"ball"``: :math:`U = 1 - \sqrt{c}\,\|x\|` (the Euclidean fraction of the ball's radius still free),
  in (0, 1]; needs no clip radius but compresses clipped points into [1 − tanh(√c r), 1].
* ``"batch"``: min–max within the batch, :math:`U = (\max_B d - d)/(\max_B d - \min_B d)`
  (all 1 when every distance is equal). Depends on the batch; the most certain point gets U = 0.
* ``"literal"``: the paper's formula :math:`U = 1 - \tfrac12 d_c(x, 0)` (its :math:`D` without the
  factor 2, i.e. :math:`\operatorname{artanh}(\sqrt c\|x\|)/\sqrt c`). Values may be negative: a
  ``RuntimeWarning`` is issued when any is ≤ 0; the losses then guard the logarithm (see
  :func:`uncertainty_ratio_log`).

Larger U always means more uncertain (nearer the origin).

Design note: docs/design/uncertainty.md
"""
from __future__ import annotations

import math
import warnings
from numbers import Real

import torch

from . import poincare_ball as pb
from .geometry import DEFAULT_CLIP_R, DEFAULT_CURVATURE, PoincareGeometry, as_geometry

__all__ = ["hyperbolic_uncertainty", "uncertainty_ratio_log", "uncertainty_clip_radius", "UNCERTAINTY_MODES",
           "DEFAULT_MODE"]

UNCERTAINTY_MODES = ("clip", "ball", "batch", "literal")
DEFAULT_MODE = "clip"
_F32 = torch.finfo(torch.float32)


def _check_mode(mode):
    mode = DEFAULT_MODE if mode is None else mode
    if mode not in UNCERTAINTY_MODES:
        raise ValueError(f"mode must be None or one of {UNCERTAINTY_MODES}, got {mode!r}")
    return mode


def uncertainty_clip_radius(geometry: PoincareGeometry, clip_r: float | None = None) -> float:
    """The radius r of ``"clip"`` mode: ``clip_r`` when given, else the geometry's clip radius, else
    (a geometry that does not clip) :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`.

    Args:
        geometry: the geometry the embeddings live on.
        clip_r: an explicit radius, or None.

    Returns:
        The radius (not validated here; :func:`hyperbolic_uncertainty` does).
    """
    if clip_r is not None:
        return clip_r
    return DEFAULT_CLIP_R if geometry.clip_r is None else geometry.clip_r


def hyperbolic_uncertainty(embeddings: torch.Tensor, c: float | torch.Tensor | torch.nn.Module = DEFAULT_CURVATURE,
                           mode: str | None = None, clip_r: float | None = None,
                           detach: bool = True) -> torch.Tensor:
    r"""Per-embedding uncertainty (N,) from the distance to the origin of the ball of curvature −c.

    Args:
        embeddings: (N, D) points of the Poincaré ball (as returned by ``ToPoincare``; points on or
            outside the boundary are projected inside first).
        c: the geometry (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`, whose clip radius is
            then the default ``clip_r``), or a curvature magnitude (> 0) given to
            :func:`~pml_hyperbolic.geometry.as_geometry`.
        mode: ``None`` (= ``"clip"``, the sound default), ``"clip"``, ``"ball"``, ``"batch"`` or
            ``"literal"`` (the paper's formula), see the module docstring.
        clip_r: the head's clip radius r (> 0), used by ``"clip"`` mode only; ``None``: the
            geometry's (:func:`uncertainty_clip_radius`).
        detach: return a tensor without gradient (default; Hyp-UML does not say whether U is
            detached, a detached U keeps the uncertainty a weighting, not an objective).

    Returns:
        (N,) tensor in the compute dtype (float32 for half inputs); larger = more uncertain.

    Raises:
        TypeError: ``embeddings`` is not a floating-point tensor, or ``clip_r`` not a number
            (``"clip"`` mode).
        ValueError: an unknown ``mode``, embeddings that are not 2-D or hold NaN/Inf, an invalid
            ``c``, or a ``clip_r`` whose 2·clip_r is not a normal float32 number (``"clip"`` mode).
    """
    mode = _check_mode(mode)
    pb.check_tensor(embeddings, "embeddings")
    if embeddings.ndim != 2:
        raise ValueError(f"embeddings must be 2-D (N, D), got shape {tuple(embeddings.shape)}")
    geometry = as_geometry(c)  # ValueError / TypeError naming c
    clip_r = uncertainty_clip_radius(geometry, clip_r)
    if mode == "clip":
        if isinstance(clip_r, bool) or not isinstance(clip_r, Real):
            raise TypeError(f"clip_r must be a real number > 0, got {type(clip_r).__name__} {clip_r!r}")
        # 2r and 1/(2r) must be finite normal float32 numbers (U = 1 − d₀/(2r) in float32)
        if not (_F32.tiny <= 2.0 * float(clip_r) <= _F32.max):
            raise ValueError(f"clip_r must be a finite number > 0 for mode='clip' (2·clip_r in "
                             f"[{_F32.tiny:.3g}, {_F32.max:.3g}]), got {clip_r!r}")
    pb.check_finite(embeddings, "embeddings")
    x = embeddings.detach() if detach else embeddings
    # c in float64 (the kernels' scalar dtype): not rounded to float32 on the way
    c_t = geometry.curvature(pb._wide_dtype(x), x.device)
    x = pb.project(x, c_t)
    if mode == "ball":
        return (1 - c_t.sqrt() * torch.linalg.vector_norm(x.to(c_t.dtype), dim=-1)).to(x.dtype)
    d0 = pb.dist0(x, c_t)
    if mode == "clip":
        u = (1 - d0 / (2 * float(clip_r))).clamp(0.0, 1.0)
        # a point at the clip radius has U = 0 exactly; rounding in expmap0/dist0 leaves a few ulp,
        # which the batch-max ratio of the losses would blow up to log 2
        return u.masked_fill(u <= 64 * torch.finfo(u.dtype).eps, 0.0)
    if mode == "batch":
        if d0.numel() == 0:
            return d0
        lo, hi = d0.min(), d0.max()
        span = hi - lo
        # all-equal batch: every point equally (and maximally) uncertain instead of 0/0
        return torch.where(span > 0, (hi - d0) / span.clamp_min(torch.finfo(d0.dtype).tiny), torch.ones_like(d0))
    u = 1 - d0 / 2  # literal: the paper's D(x, 0) has no factor 2
    if bool((u <= 0).any()):
        warnings.warn(
            "literal Hyp-UML uncertainty 1 - D(x, 0) is <= 0 for some embeddings (expected for clipped "
            "embeddings); the losses guard log(U/max U + 1). Use mode=None for a sound normalisation.",
            RuntimeWarning, stacklevel=2)
    return u


def uncertainty_ratio_log(u: torch.Tensor, guard_eps: float = 1e-6) -> torch.Tensor:
    r""":math:`\log(U_i / \max_B U + 1)`, the Hyp-UML factor of Eq. (6) and (7), with a guard.

    For sound modes U ∈ [0, 1] and the value lies in [0, log 2]. An anchor whose U equals the batch
    maximum gets U/max U = 1 (log 2) even when that maximum is 0: a batch whose embeddings all sit at
    the clip radius ("clip" mode U = 0 for all, the usual state of a clipped head) is uniformly
    certain, so every anchor gets the same factor, log 2, and not the 0/0 → 0 that would silently
    drive every temperature to its floor. The guard (needed by ``"literal"``): the maximum is
    clamped to ≥ ``guard_eps`` (all-U ≤ 0 batches would otherwise divide by ≤ 0) and the
    logarithm's argument to ≥ ``guard_eps``, so the result is finite (≥ log guard_eps).
    """
    if u.numel() == 0:
        return u
    u_max = u.max()
    ratio = torch.where(u >= u_max, torch.ones_like(u), u / u_max.clamp_min(guard_eps))
    return torch.log((ratio + 1).clamp_min(guard_eps))
