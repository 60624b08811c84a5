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

**Ownership.** Each component turns its ``c=`` into a geometry once, in ``__init__``, with
:func:`as_geometry` (the one conversion of the package), and then reads the curvature, the clip mode,
the clip radius and the map into the ball (:meth:`PoincareGeometry.to_ball`) from that object at use.
No component keeps its own clip radius or its own map into the ball, and the package's defaults are
written once, here (:data:`DEFAULT_CURVATURE`, :data:`DEFAULT_CLIP_R`, :func:`default_geometry`).

**Curvature and its constraint.** hypll stores a raw ``value`` and applies a constraining strategy
(softplus by default, so hypll's ``Curvature(1.0)`` is c ≈ 1.313). Here ``c=0.1`` means c = 0.1:

* fixed curvature: ``value = c`` with the identity constraint (no gradient);
* learnable curvature: ``value = log c`` with the ``exp`` constraint, so c stays > 0 and an
  optimiser step changes c multiplicatively (scale-free).

``value`` is a **float64** parameter (hypll creates float32): c = 0.1 rounded to float32 is off by
1.5e-9, which 1 − c‖x‖² amplifies by up to 1/(1 − c‖x‖²) near the boundary. Module dtype casts
(``model.float()``, ``model.half()``) keep it float64, except on a device without float64 (MPS),
where it follows the cast. The curvature range is :data:`C_RANGE` (√c and 1/√c stay normal
float32 numbers).

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
from numbers import Real

import torch
from hypll.manifolds.poincare_ball import Curvature, PoincareBall
from torch import Tensor

from . import poincare_ball as pb

__all__ = ["PoincareGeometry", "DEFAULT_CURVATURE", "DEFAULT_CLIP_R", "CLIP_MODES", "C_RANGE", "clip_tangent",
           "as_geometry", "default_geometry", "map_to_ball"]

#: The package's one default curvature magnitude (Hyp-ViT's c = 0.1).
DEFAULT_CURVATURE = 0.1
#: The Hyp-ViT clip radius of the tangent vector.
DEFAULT_CLIP_R = 2.3
CLIP_MODES = ("hard", "tanh", None)
#: Accepted curvature magnitudes (inclusive), as :data:`pml_hyperbolic.poincare_ball.C_RANGE`.
C_RANGE = pb.C_RANGE


class _Unset:
    """The "argument not given" marker of keyword arguments where ``None`` is a value (``clip_r=None``
    means no clipping). One instance, compared by identity; it pickles to itself and reads
    ``<unset>`` in ``help()``."""

    __slots__ = ()
    _instance: "_Unset | None" = None

    def __new__(cls) -> "_Unset":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<unset>"

    def __reduce__(self):
        return (_Unset, ())

    def __copy__(self) -> "_Unset":
        return self

    def __deepcopy__(self, memo) -> "_Unset":
        return self


_UNSET = _Unset()


def _check_clip_r(clip_r, clip) -> float | None:
    """``clip_r`` as a float (None when ``clip`` is None); ValueError/TypeError naming ``clip_r``."""
    if clip is None:
        return None
    if clip_r is None:
        raise ValueError(f"clip_r must be a finite number > 0 when clip={clip!r}, got None "
                         "(use clip=None for no clipping)")
    if isinstance(clip_r, bool) or not isinstance(clip_r, Real):
        if not (isinstance(clip_r, Tensor) and clip_r.numel() == 1 and clip_r.is_floating_point()):
            raise TypeError(f"clip_r must be a real number, got {type(clip_r).__name__} {clip_r!r}")
    value = float(clip_r)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"clip_r must be a finite number > 0 when clip={clip!r}, got {clip_r!r} "
                         "(use clip=None for no clipping)")
    return value


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
        # min(1, r/‖v‖) with both branches finite: no 0·inf in the gradient of a tiny vector
        longer = norm > clip_r
        factor = torch.where(longer, clip_r / torch.where(longer, norm, torch.ones_like(norm)), torch.ones_like(norm))
    else:
        u = norm / clip_r
        # tanh(u)/u → 1 as u → 0; the series keeps it exact (and differentiable) for tiny norms
        small = u < 1e-4
        u_safe = torch.where(small, torch.ones_like(u), u)
        factor = torch.where(small, 1.0 - u * u / 3.0, torch.tanh(u_safe) / u_safe)
    return v * factor.to(v.dtype)


def map_to_ball(v: Tensor, c: Tensor, clip_r: float | None = None, mode: str | None = "hard") -> Tensor:
    r""":math:`\operatorname{proj}(\exp_0^c(\operatorname{clip}(v)))` with a curvature tensor ``c``.

    The computation behind :meth:`PoincareGeometry.to_ball`, for callers that hold c as a tensor
    (several curvatures mixed in one loss): every norm is overflow-safe (float64, scaled for huge
    float64 input), so a huge vector keeps its direction instead of going to the origin.

    Args:
        v: floating-point tangent vectors (…, D); half precision is computed in float32.
        c: the curvature magnitude, a 0-d tensor (or anything
            :func:`~pml_hyperbolic.poincare_ball.as_curvature` accepts).
        clip_r: clip radius (> 0), or None for no clipping.
        mode: ``"hard"``, ``"tanh"`` or None, as :func:`clip_tangent`.

    Returns:
        Points strictly inside the ball, of v's compute dtype.

    Raises:
        TypeError: ``v`` is not a floating-point tensor.
        ValueError: ``mode`` is not one of :data:`CLIP_MODES`, or ``c`` is invalid.

    Design note: docs/design/geometry.md
    """
    v = pb.check_tensor(v, "features")
    v = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
    return pb.project(pb.expmap0(clip_tangent(v, clip_r, mode), c), c)


class _SharedCurvature(Curvature):
    """A hypll ``Curvature`` that reads c, at every call, from a tensor or a hypll object given by
    reference (a learnable tensor keeps its gradient; a hypll constraint is applied as hypll does).

    The value is validated at every read (on an accelerator without a host read, see
    :func:`~pml_hyperbolic.poincare_ball.as_curvature`): unlike a ``PoincareGeometry``'s own
    constraint, an outside one does not guarantee c > 0 after an optimiser step.
    """

    def __init__(self, source: Tensor | torch.nn.Module):
        torch.nn.Module.__init__(self)
        self.constraining_strategy = identity_constraint
        if isinstance(source, torch.nn.Module):
            self.source = source  # registers its parameters
        elif isinstance(source, torch.nn.Parameter):
            self.value = source
        else:
            self.__dict__["value"] = source  # a plain tensor, read by reference (not a buffer)

    def forward(self) -> Tensor:
        return pb.as_curvature(self.source if "source" in self._modules else self.value, torch.float64)


class PoincareGeometry(PoincareBall):
    """The Poincaré ball of curvature −c with this package's head mapping (a hypll ``PoincareBall``).

    Args:
        c: curvature magnitude in :data:`C_RANGE` (float or 0-d tensor; default
            :data:`DEFAULT_CURVATURE`). Kept in float64.
        learnable_c: learn c (stored as log c through hypll's ``Curvature``; see the module text).
        clip: ``"hard"`` (the papers'), ``"tanh"`` (smooth, keeps the order of norms) or ``None``.
        clip_r: clip radius r of the tangent vector (> 0; ignored when ``clip`` is None). Validated
            again on assignment (``geometry.clip_r = ...``), since the similarity and the
            uncertainty read it at use.

    Raises:
        TypeError: ``c`` is already a ``PoincareGeometry`` (share that object instead), or ``c`` /
            ``clip_r`` is not a number.
        ValueError: ``c`` is not a finite curvature in :data:`C_RANGE`, ``clip`` is not one of
            :data:`CLIP_MODES`, or ``clip_r`` is not a finite number > 0 while clipping.

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
        clip_r = _check_clip_r(clip_r, clip)
        raw = math.log(value) if learnable_c else value
        curvature = Curvature(raw, constraining_strategy=exp_constraint if learnable_c else identity_constraint,
                              requires_grad=bool(learnable_c))
        # hypll makes a float32 parameter: the raw value in float64 instead (see the module text)
        curvature.value = torch.nn.Parameter(torch.tensor(raw, dtype=torch.float64),
                                             requires_grad=bool(learnable_c))
        super().__init__(c=curvature)
        self._clip = clip
        self._clip_r = clip_r
        self.learnable_c = bool(learnable_c)

    @classmethod
    def _sharing(cls, source: Tensor | torch.nn.Module, clip: str | None, clip_r: float | None) -> "PoincareGeometry":
        """A geometry whose curvature is read from ``source`` by reference (see :func:`as_geometry`)."""
        pb.as_curvature(source)  # ValueError / TypeError naming c, now rather than at first use
        if clip not in CLIP_MODES:
            raise ValueError(f"clip must be one of {CLIP_MODES}, got {clip!r}")
        clip_r = _check_clip_r(clip_r, clip)
        geometry = cls.__new__(cls)
        PoincareBall.__init__(geometry, c=_SharedCurvature(source))
        geometry._clip = clip
        geometry._clip_r = clip_r
        geometry.learnable_c = any(p.requires_grad for p in geometry.parameters()) or (
            isinstance(source, Tensor) and source.requires_grad)
        return geometry

    # ---- clipping settings (validated on assignment: read at use by other components) ----
    @property
    def clip(self) -> str | None:
        """The clipping mode (one of :data:`CLIP_MODES`; ``None``: no clipping, and ``clip_r`` reads
        None). Switching clipping on needs a clip radius."""
        return self._clip

    @clip.setter
    def clip(self, mode: str | None) -> None:
        if mode not in CLIP_MODES:
            raise ValueError(f"clip must be one of {CLIP_MODES}, got {mode!r}")
        if mode is not None and self._clip_r is None:
            raise ValueError(f"clip={mode!r} needs a clip radius: set clip_r first")
        self._clip = mode

    @property
    def clip_r(self) -> float | None:
        """The clip radius, None exactly when ``clip`` is None. Assigning validates it: a finite
        number > 0 (kept for later while clipping is off), or None only while ``clip`` is None."""
        return None if self._clip is None else self._clip_r

    @clip_r.setter
    def clip_r(self, value: float | None) -> None:
        if value is None and self._clip is None:
            self._clip_r = None
            return
        self._clip_r = _check_clip_r(value, self._clip if self._clip is not None else "hard")

    def __setstate__(self, state: dict) -> None:
        # modules pickled whole before clip/clip_r became validated properties
        for name in ("clip", "clip_r"):
            if name in state:
                state["_" + name] = state.pop(name)
        super().__setstate__(state)

    def _apply(self, fn, recurse: bool = True):
        """Module casts keep the curvature's float64 (except on a device without float64)."""
        def keep_float64(t: Tensor) -> Tensor:
            if t.dtype != torch.float64:
                return fn(t)
            try:
                out = fn(t)
            except (TypeError, RuntimeError):  # a device without float64 (MPS)
                return fn(t.float())
            if out.is_floating_point() and out.dtype != torch.float64 and out.device.type != "mps":
                out = t.to(out.device)  # a dtype cast: the float64 values (not the cast's rounding)
            return out

        return super()._apply(keep_float64, recurse)

    # ---- curvature ----
    def curvature(self, dtype: torch.dtype = torch.float32,
                  device: torch.device | str | None = None) -> Tensor:
        """The current c as a 0-d tensor of ``dtype`` (differentiable when learnable), rounded once
        from the float64 value. Not re-validated: the constraint keeps it positive, so no
        device-to-host read happens per call."""
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
        r""":math:`\operatorname{proj}(\exp_0^c(\operatorname{clip}(v)))` for Euclidean vectors v (…, D).

        Half-precision input is computed in float32 (the ball breaks in fp16).

        Args:
            v: floating-point tangent vectors ("features").

        Returns:
            Ball points of v's dtype (float32 for half precision), strictly inside the ball.

        Raises:
            TypeError: ``v`` is not a floating-point tensor (the message names its dtype).
            ValueError: ``v`` holds NaN or Inf, or lives on the meta device.
        """
        v = pb.check_tensor(v, "features")
        pb.check_finite(v, "features")
        v = v.float() if v.dtype in (torch.float16, torch.bfloat16) else v
        return map_to_ball(v, self.curvature(pb._wide_dtype(v), v.device), self.clip_r, self.clip)

    def dist0(self, x: Tensor) -> Tensor:
        """Geodesic distance of ball points to the origin (the Hyp-UML uncertainty's input).

        Points on or outside the boundary are projected first (:func:`~pml_hyperbolic.poincare_ball.project`,
        as the distances do), so the result is finite for every finite input; points inside keep
        their exact value.

        Raises:
            TypeError: ``x`` is not a floating-point tensor.
            ValueError: ``x`` holds NaN or Inf, or lives on the meta device.
        """
        x = pb.check_tensor(x, "x")
        pb.check_finite(x, "x")
        c = self.curvature(pb._wide_dtype(x), x.device)
        return pb.dist0(pb.project(x, c), c)

    def max_dist0(self) -> float:
        """Largest distance to the origin :meth:`to_ball` can produce (inf without clipping):
        2·r for both clip modes (tanh approaches it), since d₀(exp₀(v)) = 2‖v‖."""
        return math.inf if self.clip_r is None else 2.0 * self.clip_r

    def extra_repr(self) -> str:
        return (f"c={float(self.c().detach()):.6g}, learnable_c={self.learnable_c}, clip={self.clip!r}, "
                f"clip_r={self.clip_r}")


def default_geometry() -> PoincareGeometry:
    """A new geometry with the package's defaults: c = :data:`DEFAULT_CURVATURE`, ``clip="hard"`` at
    :data:`DEFAULT_CLIP_R`, fixed curvature (what a component builds when given no ``c``).

    Returns:
        A new :class:`PoincareGeometry` (not shared: pass one geometry to every component instead).

    Design note: docs/design/geometry.md
    """
    return PoincareGeometry()


def as_geometry(c: "PoincareGeometry | float | Tensor | torch.nn.Module | None" = None, *,
                clip: str | None | _Unset = _UNSET, clip_r: float | None | _Unset = _UNSET,
                learnable_c: bool | _Unset = _UNSET, default_clip: str | None = "hard") -> PoincareGeometry:
    r"""The one conversion of a ``c=`` argument into the :class:`PoincareGeometry` a component uses.

    * a ``PoincareGeometry``: returned as is (shared by reference: its curvature, clip mode and clip
      radius are read at use);
    * ``None``: :func:`default_geometry`;
    * a Python number, or a tensor without gradient: a new geometry with that fixed c;
    * a tensor that requires grad (e.g. an ``nn.Parameter``), a hypll ``Curvature`` or a hypll
      ``PoincareBall``: a new geometry that reads c from it at every use (gradients reach it;
      hypll's constraint applies, so ``Curvature(1.0)`` is c = softplus(1) ≈ 1.313).

    The settings ``clip`` / ``clip_r`` / ``learnable_c`` apply to a new geometry only (unset:
    ``default_clip``, :data:`DEFAULT_CLIP_R`, fixed c). ``learnable_c`` applies to a number only (a
    referenced tensor or hypll object is learnable when it requires grad).

    Why one function: components used to tell six types of ``c`` apart by duck typing each on its
    own, so a new accepted type or a new clip setting had to reach every one of them.

    Args:
        c: the geometry, or a curvature to build one from (see above).
        clip: clipping mode of a new geometry (one of :data:`CLIP_MODES`).
        clip_r: clip radius of a new geometry (> 0; ``None`` means no clipping).
        learnable_c: learn the curvature of a new geometry built from a number.
        default_clip: the clipping mode used when ``clip`` is unset.

    Returns:
        ``c`` itself, or the new geometry.

    Raises:
        ValueError: ``clip``, ``clip_r`` or ``learnable_c`` given together with a ``PoincareGeometry``
            (the geometry owns them: set them when building it); a curvature outside
            :data:`C_RANGE`; a bad ``clip`` / ``clip_r``.
        TypeError: ``c`` is none of the accepted types (a bool or a string included).

    Design note: docs/design/geometry.md
    """
    if isinstance(c, PoincareGeometry):
        given = [n for n, v in (("clip_r", clip_r), ("learnable_c", learnable_c), ("clip", clip)) if v is not _UNSET]
        if given:
            raise ValueError(f"{', '.join(given)} given together with a PoincareGeometry: the geometry owns "
                             "the clipping and the curvature; set them when building it")
        return c
    mode = default_clip if clip is _UNSET else clip
    if clip_r is None and clip is _UNSET:
        mode = None  # clip_r=None means no clipping
    radius = DEFAULT_CLIP_R if clip_r is _UNSET else clip_r
    if c is None:
        c = DEFAULT_CURVATURE
    shared = isinstance(c, torch.nn.Module) or (isinstance(c, Tensor) and c.requires_grad)
    if shared:
        if learnable_c is not _UNSET and bool(learnable_c):
            raise ValueError("learnable_c=True with a curvature given by reference (a tensor or hypll object): "
                             "its own requires_grad decides; pass a number to build a learnable geometry")
        return PoincareGeometry._sharing(c, mode, radius)
    return PoincareGeometry(c=c, learnable_c=False if learnable_c is _UNSET else bool(learnable_c),
                            clip=mode, clip_r=radius)
