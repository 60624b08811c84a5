r"""One owner for the geometry: :class:`PoincareGeometry`, a hypll ``PoincareBall`` that also knows
how this package's heads enter the ball.

Why one object. The curvature and the head's clipping are read by the head, the distance, the
losses, the miners, the uncertainty, the kNN and the plots. Copying a float into each of them
breaks as soon as the curvature is learnable (the copies go stale) and lets defaults drift apart.
Build one ``PoincareGeometry`` and pass it **by reference** wherever a ``c`` is taken::

    geometry = PoincareGeometry(c=0.1, learnable_c=True)
    head = HyperbolicEmbeddingHead(384, 128, c=geometry)
    distance = PoincareDistance(c=geometry)          # reads the current c at every call

Every ``c=`` argument of the package accepts it (as well as a float, a 0-d tensor or a plain hypll
``Curvature`` / ``PoincareBall``); the curvature is validated once, here, and read at use.

**Curvature and its constraint.** hypll stores a raw ``value`` and applies a constraining strategy
(softplus by default, so hypll's ``Curvature(1.0)`` is c ≈ 1.313). Here ``c=0.1`` means c = 0.1:

* fixed curvature: ``value = c`` with the identity constraint (no gradient);
* learnable curvature: ``value = log c`` with the ``exp`` constraint, so c stays > 0 and an
  optimiser step changes c multiplicatively (scale-free).

**Entering the ball** (:meth:`PoincareGeometry.to_ball`): a Euclidean (tangent) vector v is clipped,
mapped by :math:`\exp_0^c` and projected: :math:`\operatorname{proj}(\exp_0^c(\operatorname{clip}(v)))`.

* ``clip="hard"``: :math:`v\,\min(1, r/\|v\|)` (Guo et al., CVPR'22; the Hyp-ViT head). Every
  vector longer than r lands on one sphere: the order of the norms is erased there.
* ``clip="tanh"``: :math:`v\,r\tanh(\|v\|/r)/\|v\|`, a smooth saturation: identity near 0, < r
  everywhere, monotone, so the order of the norms survives (and the radial gradient is never 0).
* ``clip=None``: no clipping (HCL's setting).

The projection margin per dtype is :func:`pml_hyperbolic.poincare_ball.boundary_eps`.

Design note: docs/design/geometry.md
"""
from __future__ import annotations

import math

import torch
from hypll.manifolds.poincare_ball import Curvature, PoincareBall
from torch import Tensor

from . import poincare_ball as pb

__all__ = ["PoincareGeometry", "DEFAULT_CURVATURE", "DEFAULT_CLIP_R", "CLIP_MODES", "clip_tangent"]

#: The package's one default curvature magnitude (Hyp-ViT's c = 0.1).
DEFAULT_CURVATURE = 0.1
#: The Hyp-ViT clip radius of the tangent vector.
DEFAULT_CLIP_R = 2.3
CLIP_MODES = ("hard", "tanh", None)


def identity_constraint(value: Tensor) -> Tensor:
    """c = value (fixed curvature: ``c=0.1`` means 0.1). A named function so modules pickle."""
    return value


def exp_constraint(value: Tensor) -> Tensor:
    """c = exp(value) (learnable curvature stored as log c: stays positive)."""
    return value.exp()


def clip_tangent(v: Tensor, clip_r: float | None, mode: str | None = "hard") -> Tensor:
    r"""Bound the Euclidean norm of tangent vectors ``v`` (…, D) by ``clip_r``.

    ``"hard"``: :math:`v\min(1, r/\|v\|)`; ``"tanh"``: :math:`v\,r\tanh(\|v\|/r)/\|v\|`
    (finite, identity Jacobian at v = 0); ``None`` or ``clip_r=None``: v unchanged.
    """
    if mode is None or clip_r is None:
        return v
    if mode not in ("hard", "tanh"):
        raise ValueError(f"clip must be one of {CLIP_MODES}, got {mode!r}")
    # The norm and the factor in float64 (scaled for huge float64 inputs): a float32 norm overflows
    # to inf from ~1.8e19 on, and the factor r/inf = 0 sent such vectors to the origin.
    norm = pb._wide_norm(v, huge=True)
    if mode == "hard":
        factor = torch.clamp(clip_r / norm.clamp_min(torch.finfo(norm.dtype).tiny), max=1.0)
    else:
        u = norm / clip_r
        # tanh(u)/u → 1 as u → 0; the series keeps it exact (and differentiable) for tiny norms
        small = u < 1e-4
        u_safe = torch.where(small, torch.ones_like(u), u)
        factor = torch.where(small, 1.0 - u * u / 3.0, torch.tanh(u_safe) / u_safe)
    return v * factor.to(v.dtype)


class PoincareGeometry(PoincareBall):
    """The Poincaré ball of curvature −c with this package's head mapping (a hypll ``PoincareBall``).

    Args:
        c: curvature magnitude, > 0 (float or 0-d tensor; default :data:`DEFAULT_CURVATURE`).
        learnable_c: learn c (stored as log c through hypll's ``Curvature``; see the module text).
        clip: ``"hard"`` (the papers'), ``"tanh"`` (smooth, keeps the order of norms) or ``None``.
        clip_r: clip radius r of the tangent vector (> 0; ignored when ``clip`` is None).

    Raises:
        TypeError: ``c`` is already a ``PoincareGeometry`` (share that object instead).
        ValueError: ``c`` is not a finite curvature > 0, ``clip`` is not one of :data:`CLIP_MODES`,
            or ``clip_r`` is not a finite number > 0 while clipping.

    hypll's own methods (``expmap``, ``dist``, … on ``ManifoldTensor`` objects) work unchanged on
    this object; :meth:`to_ball` and :meth:`curvature` are the plain-tensor entry points the
    package's components use.
    """

    _is_pml_geometry = True  # how poincare_ball.as_curvature recognises it without a circular import

    def __init__(self, c: float | Tensor | torch.nn.Module = DEFAULT_CURVATURE, learnable_c: bool = False,
                 clip: str | None = "hard", clip_r: float | None = DEFAULT_CLIP_R):
        if isinstance(c, PoincareGeometry):
            raise TypeError("c is already a PoincareGeometry: pass that object itself, not a copy of it")
        value = float(pb.as_curvature(c, torch.float64).detach())  # ValueError naming c
        if clip not in CLIP_MODES:
            raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}")
        if clip is not None:
            if clip_r is None or not (math.isfinite(float(clip_r)) and float(clip_r) > 0):
                raise ValueError(f"clip_r must be a finite number > 0 when clip={clip!r}, got {clip_r!r} "
                                 "(use clip=None for no clipping)")
        if learnable_c:
            curvature = Curvature(math.log(value), constraining_strategy=exp_constraint, requires_grad=True)
        else:
            curvature = Curvature(value, constraining_strategy=identity_constraint, requires_grad=False)
        super().__init__(c=curvature)
        self.clip = clip
        self.clip_r = None if clip is None else float(clip_r)
        self.learnable_c = bool(learnable_c)

    # ---- curvature ----
    def curvature(self, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> Tensor:
        """The current c as a 0-d tensor (differentiable when learnable). Not re-validated: the
        constraint keeps it positive, so no device-to-host read happens per call."""
        c = self.c()
        return c.to(dtype=dtype, device=device if device is not None else c.device)

    def boundary_eps(self, dtype: torch.dtype) -> float:
        """Relative projection margin to the boundary for ``dtype``."""
        return pb.boundary_eps(dtype)

    # ---- entering the ball ----
    def clip_tangent(self, v: Tensor) -> Tensor:
        """The head's clipping of tangent vectors (see :func:`clip_tangent`)."""
        return clip_tangent(v, self.clip_r, self.clip)

    def to_ball(self, v: Tensor) -> Tensor:
        r""":math:`\operatorname{proj}(\exp_0^c(\operatorname{clip}(v)))` for Euclidean vectors v (N, D).

        Half-precision input is computed in float32 (the ball breaks in fp16)."""
        v = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
        c = self.curvature(v.dtype, v.device)
        return pb.project(pb.expmap0(self.clip_tangent(v), c), c)

    def dist0(self, x: Tensor) -> Tensor:
        """Geodesic distance of ball points to the origin (the Hyp-UML uncertainty's input)."""
        return pb.dist0(x, self.curvature(pb.compute_dtype(x.dtype), x.device))

    def max_dist0(self) -> float:
        """Largest distance to the origin :meth:`to_ball` can produce (inf without clipping):
        2·r for both clip modes (tanh approaches it), since d₀(exp₀(v)) = 2‖v‖."""
        return math.inf if self.clip_r is None else 2.0 * self.clip_r

    def extra_repr(self) -> str:
        return (f"c={float(self.c().detach()):.6g}, learnable_c={self.learnable_c}, clip={self.clip!r}, "
                f"clip_r={self.clip_r}")
