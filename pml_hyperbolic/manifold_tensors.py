r"""hypll interoperability: ``ManifoldTensor`` in, plain tensors of ball points inside.

This package computes on plain ``torch.Tensor`` rows of Poincaré-ball points. A hypll network
(``hypll.nn.HLinear``, ``ChangeManifold``, …) returns a ``hypll.tensors.ManifoldTensor`` instead:
the same points plus the manifold they live on. The functions here convert between the two and
check that the manifold is the one the consumer computes with:

* :func:`unwrap_ball_tensor` — a ``ManifoldTensor`` on a hypll ``PoincareBall`` (a
  :class:`~pml_hyperbolic.geometry.PoincareGeometry` included) → its plain tensor, after checking
  that the points lie along the last dimension and (if ``c`` is given) that the manifold's
  curvature is ``c``. Anything else is returned unchanged.
* :func:`to_manifold_tensor` — plain ball points → a ``ManifoldTensor`` on a geometry
  (``HyperbolicEmbeddingHead(return_manifold_tensor=True)`` uses it).
* :func:`accept_manifold_tensors` — make any PML loss or miner accept ``ManifoldTensor``
  embeddings. PML's ``forward`` reads ``.ndim``/``.device`` of the embeddings before the distance
  ever sees them, so the distance alone cannot unwrap them; this registers a forward pre-hook that
  unwraps every ``ManifoldTensor`` argument, checked against the curvature of every
  :class:`~pml_hyperbolic.distances.PoincareDistance` (and the module's own ``c``) inside the module.
  Every loss and miner of this package does it at construction (:class:`AcceptsManifoldTensors`);
  for PML's own losses and miners call it once::

      loss_fn = accept_manifold_tensors(losses.TripletMarginLoss(distance=PoincareDistance(c=geometry)))

Curvature check: the identical object (the ``ManifoldTensor``'s manifold *is* the geometry the
consumer was given, or shares its hypll ``Curvature``) is accepted without evaluating anything;
otherwise both curvatures are evaluated (one device-to-host read) and must agree to a relative
1e-6. Remember that hypll's ``Curvature(1.0)`` means c = softplus(1) ≈ 1.313 (the error message
says so when that explains a mismatch); ``PoincareGeometry(c=1.0)`` means c = 1.

Design note: docs/design/geometry.md
"""
from __future__ import annotations

import torch
from hypll.manifolds.poincare_ball import Curvature, PoincareBall
from hypll.tensors import ManifoldTensor, TangentTensor
from torch import Tensor

from . import poincare_ball as pb

__all__ = [
    "unwrap_ball_tensor",
    "to_manifold_tensor",
    "is_manifold_tensor",
    "accept_manifold_tensors",
    "AcceptsManifoldTensors",
]

_RTOL = 1e-6


def is_manifold_tensor(x: object) -> bool:
    """True for a hypll ``ManifoldTensor`` (or ``TangentTensor``), which torch code cannot read."""
    return isinstance(x, (ManifoldTensor, TangentTensor))


def _softplus_curvature(obj):
    """The hypll ``Curvature`` with hypll's default softplus constraint behind ``obj``, or None."""
    if getattr(obj, "_is_pml_geometry", False):
        obj = obj.c._modules.get("source")  # a geometry reading a hypll object by reference, or None
    if isinstance(obj, PoincareBall) and not getattr(obj, "_is_pml_geometry", False):
        obj = obj.c
    if isinstance(obj, Curvature) and obj.constraining_strategy is torch.nn.functional.softplus:
        return obj
    return None


def _softplus_note(obj, value: float, other: float) -> str:
    curv = _softplus_curvature(obj)
    if curv is None:
        return ""
    raw = float(curv.value.detach())
    if abs(raw - other) > _RTOL * max(abs(raw), abs(other)):
        return ""
    return (f" Note: hypll's Curvature({raw:g}) applies softplus by default, so it means "
            f"c = softplus({raw:g}) ≈ {value:.4g}, not {raw:g}; use "
            f"pml_hyperbolic.geometry.PoincareGeometry(c={raw:g}) (or hypll's "
            f"Curvature({raw:g}, constraining_strategy=lambda v: v)) for c = {raw:g}.")


def _check_curvature(manifold: PoincareBall, c, consumer: str) -> None:
    if c is manifold or c is manifold.c or getattr(c, "c", None) is manifold.c:
        return  # the same object: nothing to evaluate
    actual = float(pb.as_curvature(manifold, torch.float64).detach())
    expected = float(pb.as_curvature(c, torch.float64).detach())
    if abs(actual - expected) <= _RTOL * max(abs(actual), abs(expected)):
        return
    note = _softplus_note(manifold, actual, expected) or _softplus_note(c, expected, actual)
    raise ValueError(
        f"curvature mismatch: the ManifoldTensor lies on a Poincaré ball with c = {actual:.6g}, but "
        f"{consumer} computes with c = {expected:.6g}. Build both from one PoincareGeometry "
        f"(pass it as the hypll manifold and as c=).{note}"
    )


def unwrap_ball_tensor(x: Tensor | ManifoldTensor, c: float | Tensor | torch.nn.Module | None = None,
                       consumer: str = "the consumer"):
    """Plain tensor of ball points from ``x``.

    Args:
        x: a hypll ``ManifoldTensor`` whose manifold is a hypll ``PoincareBall`` (e.g. a
            :class:`~pml_hyperbolic.geometry.PoincareGeometry`) with the points along the last
            dimension; anything else (a plain tensor, an array) is returned unchanged.
        c: the curvature the caller computes with (float, 0-d tensor, hypll ``Curvature`` /
            ``PoincareBall`` or ``PoincareGeometry``); None skips the curvature check.
        consumer: how the caller is named in error messages.

    Returns: ``x.tensor`` itself for a ``ManifoldTensor`` (same object: autograd flows through,
    and ``unwrap(a) is unwrap(a)``), else ``x``.

    Raises:
        TypeError: a ``TangentTensor``, or a ``ManifoldTensor`` on a manifold other than a
            Poincaré ball (e.g. hypll's ``Euclidean``).
        ValueError: the manifold dimension is not the last one, or the curvature differs from ``c``.
    """
    if isinstance(x, TangentTensor):
        raise TypeError(f"{consumer} takes points of the Poincaré ball, got a hypll TangentTensor "
                        "(tangent vectors): map them onto the ball first, e.g. manifold.expmap(v)")
    if not isinstance(x, ManifoldTensor):
        return x
    manifold = x.manifold
    if not isinstance(manifold, PoincareBall):
        raise TypeError(
            f"{consumer} takes points of a Poincaré ball, got a ManifoldTensor on "
            f"{type(manifold).__name__}; map it onto the ball first (e.g. hypll.nn.ChangeManifold"
            "(PoincareGeometry(c)) or manifold.expmap of its tangent vectors)"
        )
    if x.man_dim != x.tensor.dim() - 1:
        raise ValueError(
            f"{consumer} takes ball points along the last dimension (man_dim=-1), got a ManifoldTensor "
            f"of shape {tuple(x.tensor.shape)} with man_dim={x.man_dim}"
        )
    if c is not None:
        _check_curvature(manifold, c, consumer)
    return x.tensor


def to_manifold_tensor(x: Tensor, geometry: PoincareBall) -> ManifoldTensor:
    """Wrap ball points ``x`` (…, D) in a hypll ``ManifoldTensor`` on ``geometry`` (``man_dim=-1``).

    ``geometry`` must be a hypll ``PoincareBall`` (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`
    is one). A ``ManifoldTensor`` already on ``geometry`` is returned as is; one on another ball of
    the same curvature is re-wrapped; a mismatch raises as in :func:`unwrap_ball_tensor`. The data
    is not copied (autograd flows through).
    """
    if not isinstance(geometry, PoincareBall):
        raise TypeError(f"geometry must be a hypll PoincareBall (e.g. PoincareGeometry(c)), got "
                        f"{type(geometry).__name__}")
    if isinstance(x, ManifoldTensor) and x.manifold is geometry and x.man_dim == x.tensor.dim() - 1:
        return x
    x = unwrap_ball_tensor(x, geometry, "to_manifold_tensor(geometry)")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor of ball points or a ManifoldTensor, got {type(x).__name__}")
    return ManifoldTensor(x, manifold=geometry, man_dim=-1)


# ---- losses and miners ------------------------------------------------------------------------

#: attributes holding the geometry a module computes with (the distances' and HIERLoss's
#: ``geometry``, the uncertainty losses' ``uncertainty_geometry``); the pseudo-labeler's ``geometry``
_GEOMETRY_ATTRS = ("geometry", "uncertainty_geometry")


def _expected_curvatures(module: torch.nn.Module) -> list:
    # Duck-typed (no import of the distances, which import this module): a component that takes
    # Euclidean features says so with ``takes_ball_points = False``.
    found = []

    def add(c):
        if c is not None and not any(c is f for f in found):
            found.append(c)

    for m in module.modules():
        if getattr(type(m), "takes_ball_points", True) is False:
            raise TypeError(
                f"{type(module).__name__} uses {type(m).__name__}, which takes the Euclidean head "
                "output (it maps it onto the sphere and the ball itself), not ball points: pass the "
                "plain features, not a Poincaré-ball ManifoldTensor"
            )
        for attr in _GEOMETRY_ATTRS:
            geometry = getattr(m, attr, None)
            if isinstance(geometry, PoincareBall):
                add(geometry)
    add(getattr(getattr(module, "pseudo_labeler", None), "geometry", None))
    return found


def _unwrap_hook(module, args, kwargs):
    if not any(is_manifold_tensor(a) for a in (*args, *kwargs.values())):
        return None  # the common case: plain tensors, nothing to do
    curvatures = _expected_curvatures(module)
    name = type(module).__name__

    def unwrap(a):
        if not is_manifold_tensor(a):
            return a
        out = unwrap_ball_tensor(a, curvatures[0] if curvatures else None, name)
        for c in curvatures[1:]:
            unwrap_ball_tensor(a, c, name)
        return out

    return tuple(unwrap(a) for a in args), {k: unwrap(v) for k, v in kwargs.items()}


def accept_manifold_tensors(module: torch.nn.Module) -> torch.nn.Module:
    """Let ``module`` (any PML loss, miner or wrapper) take hypll ``ManifoldTensor`` embeddings.

    Registers a forward pre-hook (once) that replaces every ``ManifoldTensor`` argument by its
    plain tensor (:func:`unwrap_ball_tensor`), checked against the curvature of every
    ``PoincareDistance`` inside ``module`` and its own ``c``, if any. Plain tensors pass untouched
    at the cost of one ``isinstance`` per argument. Returns ``module`` (for chaining).
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module (a PML loss or miner), got {type(module).__name__}")
    if not getattr(module, "_accepts_manifold_tensors", False):
        module.register_forward_pre_hook(_unwrap_hook, with_kwargs=True)
        module._accepts_manifold_tensors = True
    return module


class AcceptsManifoldTensors:
    """Mixin (first base) for this package's losses and miners: :func:`accept_manifold_tensors`
    at construction. A pre-hook rather than a ``forward`` override, so that it runs before a
    subclass's own ``forward`` touches the embeddings."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        accept_manifold_tensors(self)
