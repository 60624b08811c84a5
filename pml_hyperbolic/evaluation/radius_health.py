r"""Radius health: detect embeddings whose distance to the origin carries no information.

The radius :math:`d_0(x) = d_c(0, x)` of a ball embedding is the package's uncertainty
(:func:`~pml_hyperbolic.hyperbolic_uncertainty`) and half of what separates two points in
:class:`~pml_hyperbolic.distances.PoincareDistance`. When every embedding sits at one radius that
information is gone, and nothing fails: the loss falls, Recall@K is computed, U is one value. Two
ways to lose it are recognised:

* **at the clip** (``kind="clip"``): more than ``clip_fraction`` of the embeddings have
  :math:`d_0 \ge (1 - \mathrm{rtol})\,d_{clip}`, with :math:`d_{clip}` the largest radius the head
  can produce (:meth:`~pml_hyperbolic.geometry.PoincareGeometry.max_dist0`, capped at the radius
  of the ball's projection margin for the embeddings' dtype). Needs a geometry that clips;
* **flat** (``kind="flat"``): the 5th–95th percentile range of :math:`d_0` is below
  :math:`\mathrm{rtol}\cdot\max(1, \overline{d_0})` (needs at least two embeddings).

"clip" is reported when both hold. Why percentiles: a few stragglers (a handful of unusual
images) must not hide a collapse of everything else; why relative to the mean: the rounding of
:math:`d_0` grows with the radius.

Design note: docs/design/radius-health.md
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from numbers import Real
from typing import Dict, Optional, Union

import numpy as np
import torch

from .. import poincare_ball as pb
from ..poincare_ball import CurvatureLike

__all__ = ["RadiusReport", "RadiusCollapseWarning", "radius_collapse", "check_radius",
           "DEFAULT_RTOL", "DEFAULT_CLIP_FRACTION"]

#: Relative tolerance of both tests (0.1% of the clip radius, of the mean radius).
DEFAULT_RTOL = 1e-3
#: Share of the embeddings at the clip radius above which the radius counts as collapsed.
DEFAULT_CLIP_FRACTION = 0.5

_CAUSES = {
    "clip": ("the papers' head (radius='norm') on large features and losses that push points outward "
             "(margin losses on PoincareDistance such as TripletMarginLoss and the hierarchical losses, "
             "SupConLoss on PoincareSimilarity) do this"),
    "flat": ("nothing trains the radius (a loss that sees only directions leaves every point at the "
             "head's starting radius), or every point sits on the ball's boundary"),
}
_FIX = ("Fix: keep the polar head (radius='learned') and use MultiSimilarityLoss on PoincareSimilarity or "
        "PairwiseCrossEntropyLoss, or add RadialCalibrationLoss (recipes: --radial-calibration W); "
        "see docs/uncertainty.md.")
_SHORT_FIX = ("fix: polar head, MultiSimilarityLoss on PoincareSimilarity, PairwiseCrossEntropyLoss or "
              "RadialCalibrationLoss; docs/uncertainty.md")


class RadiusCollapseWarning(UserWarning):
    """Issued by :func:`check_radius` (and the recipes' evaluation) when the radius has collapsed."""


@dataclasses.dataclass(frozen=True)
class RadiusReport:
    """What :func:`radius_collapse` found: which collapse, and the radii behind the verdict.

    Attributes:
        kind: ``"clip"`` (most points at the clip radius) or ``"flat"`` (all at one radius).
        n: number of embeddings checked.
        d0_quantiles: the distances to the origin, ``{"min", "p05", "median", "p95", "max"}``.
        spread: ``p95 − p05`` of :math:`d_0`.
        flat_tolerance: the spread below which the radius is flat, ``rtol · max(1, mean d0)``.
        clip_d0: the largest radius the head can produce, or None when the geometry does not clip.
        fraction_at_clip: share of the embeddings within ``rtol`` of ``clip_d0`` (None without it).
        rtol: the relative tolerance used.
        clip_fraction: the share used for the ``"clip"`` test.
        what: what the embeddings are, as the messages name them.
    """

    kind: str
    n: int
    d0_quantiles: Dict[str, float]
    spread: float
    flat_tolerance: float
    clip_d0: Optional[float]
    fraction_at_clip: Optional[float]
    rtol: float
    clip_fraction: float
    what: str = "embeddings"

    def message(self) -> str:
        """The warning text: what collapsed and its usual causes (line 1), the fix (line 2)."""
        if self.kind == "clip":
            found = (f"{100 * self.fraction_at_clip:.1f}% of the {self.n} {self.what} sit at the clip radius "
                     f"d0 = {self.clip_d0:.2f}")
        else:
            found = (f"all {self.n} {self.what} sit at d0 = {self.d0_quantiles['median']:.3f} (5-95% spread "
                     f"{self.spread:.1e} < {self.flat_tolerance:.1e})")
        return (f"radius collapsed: {found}, so the radius carries no uncertainty; {_CAUSES[self.kind]}.\n"
                + _FIX)

    def summary_line(self) -> str:
        """One line for a run summary (no leading indentation)."""
        if self.kind == "clip":
            found = f"{100 * self.fraction_at_clip:.1f}% of the {self.what} at the clip radius d0 = {self.clip_d0:.2f}"
        else:
            found = f"all {self.what} at d0 = {self.d0_quantiles['median']:.3f}"
        return f"radius collapsed: {found}, the uncertainty is void ({_SHORT_FIX})"

    def as_dict(self) -> Dict:
        """JSON-ready fields, plus ``message`` and ``summary`` (:meth:`summary_line`)."""
        return {**dataclasses.asdict(self), "message": self.message(), "summary": self.summary_line()}


def _check_fraction(value, name: str, low_open: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = (0.0 < value < 1.0) if low_open else (0.0 <= value < 1.0)
    if not ok:
        raise ValueError(f"{name} must be in {'(0, 1)' if low_open else '[0, 1)'}, got {value!r}")
    return value


def _radii(embeddings, c) -> tuple:
    """(d0 in float64 on the CPU, the embeddings' dtype) after the argument checks."""
    if isinstance(embeddings, np.ndarray):
        embeddings = torch.from_numpy(embeddings)
    x = pb.check_tensor(embeddings, "embeddings")
    if x.ndim != 2:
        raise ValueError(f"embeddings must be 2-D (N, D), got shape {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"embeddings must hold at least one point of dimension >= 1, got shape {tuple(x.shape)}")
    pb.check_finite(x, "embeddings")
    c_t = pb.as_curvature(c, torch.float64, "cpu").detach()  # TypeError / ValueError naming c
    dtype = x.dtype
    x = x.detach().to("cpu", torch.float64)
    # projected with the margin of the embeddings' own dtype, as the package's distances do
    d0 = pb.dist0(pb.project(x, c_t, eps=pb.boundary_eps(dtype)), c_t)
    return d0, dtype, float(c_t)


def radius_collapse(embeddings: Union[torch.Tensor, np.ndarray], c: CurvatureLike,
                    rtol: float = DEFAULT_RTOL, clip_fraction: float = DEFAULT_CLIP_FRACTION,
                    what: str = "embeddings") -> Optional[RadiusReport]:
    r"""Whether the radius of ``embeddings`` has collapsed ("clip" or "flat", see the module text).

    .. math:: \text{clip: } \tfrac1N\#\{d_0 \ge (1-\mathrm{rtol})\,d_{clip}\} > \text{clip\_fraction};
              \qquad \text{flat: } P_{95}(d_0) - P_5(d_0) < \mathrm{rtol}\cdot\max(1, \overline{d_0})

    :math:`d_{clip}` is ``c.max_dist0()`` of a clipping
    :class:`~pml_hyperbolic.geometry.PoincareGeometry`, capped at the radius of the projection
    margin for the embeddings' dtype (a point cannot lie farther out). A plain curvature, or a
    geometry with ``clip=None``, has no clip radius: only the "flat" test applies.

    Args:
        embeddings: (N, D) ball points, a floating-point tensor or numpy array (any device).
        c: the embeddings' :class:`~pml_hyperbolic.geometry.PoincareGeometry` (its clip radius is
            used), or a curvature magnitude (float, 0-d tensor, hypll curvature).
        rtol: relative tolerance of both tests, in (0, 1).
        clip_fraction: share of the embeddings at the clip radius above which it is a collapse,
            in [0, 1).
        what: what the embeddings are, for the report's messages (e.g. ``"test queries"``).

    Returns:
        A :class:`RadiusReport` when the radius has collapsed, None when it is healthy.

    Raises:
        TypeError: ``embeddings`` is not a floating-point tensor or array, ``c`` is not a
            curvature, or ``rtol`` / ``clip_fraction`` is not a number.
        ValueError: ``embeddings`` is not 2-D, is empty or holds NaN/Inf; ``c`` is not a finite
            curvature > 0; ``rtol`` or ``clip_fraction`` is out of range.

    Design note: docs/design/radius-health.md
    """
    rtol = _check_fraction(rtol, "rtol", low_open=True)
    clip_fraction = _check_fraction(clip_fraction, "clip_fraction", low_open=False)
    d0, dtype, c_val = _radii(embeddings, c)
    n = d0.numel()
    q = torch.quantile(d0, torch.tensor([0.05, 0.5, 0.95], dtype=d0.dtype))
    quantiles = {"min": float(d0.min()), "p05": float(q[0]), "median": float(q[1]), "p95": float(q[2]),
                 "max": float(d0.max())}
    spread = quantiles["p95"] - quantiles["p05"]
    flat_tolerance = rtol * max(1.0, float(d0.mean()))
    clip_d0 = None
    fraction = None
    max_dist0 = getattr(c, "max_dist0", None) if getattr(c, "_is_pml_geometry", False) else None
    if max_dist0 is not None and math.isfinite(max_dist0()):
        # the projection margin of the dtype bounds the radius a stored point can have
        boundary_d0 = 2.0 / math.sqrt(c_val) * math.atanh(1.0 - pb.boundary_eps(dtype))
        clip_d0 = min(float(max_dist0()), boundary_d0)
        fraction = float((d0 >= (1.0 - rtol) * clip_d0).double().mean())
    if fraction is not None and fraction > clip_fraction:
        kind = "clip"
    elif n >= 2 and spread < flat_tolerance:
        kind = "flat"
    else:
        return None
    return RadiusReport(kind=kind, n=n, d0_quantiles=quantiles, spread=spread, flat_tolerance=flat_tolerance,
                        clip_d0=clip_d0, fraction_at_clip=fraction, rtol=rtol, clip_fraction=clip_fraction,
                        what=str(what))


def check_radius(embeddings: Union[torch.Tensor, np.ndarray], c: CurvatureLike, rtol: float = DEFAULT_RTOL,
                 clip_fraction: float = DEFAULT_CLIP_FRACTION, what: str = "embeddings",
                 stacklevel: int = 2) -> Optional[RadiusReport]:
    """:func:`radius_collapse`, plus one :class:`RadiusCollapseWarning` when the radius has collapsed.

    Args:
        embeddings: (N, D) ball points (see :func:`radius_collapse`).
        c: the embeddings' geometry or curvature (see :func:`radius_collapse`).
        rtol: relative tolerance of both tests, in (0, 1).
        clip_fraction: share at the clip radius that counts as a collapse, in [0, 1).
        what: what the embeddings are, for the message.
        stacklevel: passed to ``warnings.warn`` (2: the line that called this function).

    Returns:
        The :class:`RadiusReport`, or None when the radius is healthy (then nothing is issued).

    Raises:
        TypeError: as :func:`radius_collapse`.
        ValueError: as :func:`radius_collapse`.

    Warns:
        RadiusCollapseWarning: once per call, with :meth:`RadiusReport.message` (cause and fix).

    Design note: docs/design/radius-health.md
    """
    report = radius_collapse(embeddings, c, rtol=rtol, clip_fraction=clip_fraction, what=what)
    if report is not None:
        warnings.warn(report.message(), RadiusCollapseWarning, stacklevel=int(stacklevel))
    return report
