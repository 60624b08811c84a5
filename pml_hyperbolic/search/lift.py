r"""The hyperboloid lift of ball points: the vectors whose inner products rank by Poincaré distance.

A ball point :math:`x` (curvature :math:`-c`) lifts to the hyperboloid
:math:`X = \left(\frac{1 + c\|x\|^2}{\sqrt c\,(1 - c\|x\|^2)},\ \frac{2x}{1 - c\|x\|^2}\right)`, and

.. math:: \cosh(\sqrt c\, d_c(x, y)) = -c\,\langle X, Y\rangle_L,\qquad
          \langle X, Y\rangle_L = -X_0Y_0 + X_{1:}\cdot Y_{1:} = \langle (-X_0, X_{1:}),\ Y\rangle .

So with the *query* exported as :math:`(-X_0, X_{1:})` and the *database* as :math:`Y`, a plain
(Euclidean) inner product is the Lorentz product, which decreases as the distance grows: the maximum
inner product is the nearest point. Any engine with a maximum-inner-product metric can serve it.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .. import poincare_ball as pb

__all__ = ["to_inner_product"]


def _as_2d_float_tensor(x, name: str) -> Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N x D), got shape {tuple(x.shape)}")
    if not torch.is_floating_point(x):
        x = x.float()
    pb.check_finite(x, name)
    return x.detach()


def _conformal_terms(x: Tensor, c: float):
    """float64 (:math:`c\\|x\\|^2`, :math:`1 - c\\|x\\|^2` clamped above 0) per row of float64 ``x``: the
    terms of the Lorentz lift and the conformal denominators of the distance (the values
    :func:`pb.to_lorentz` computes, bit for bit)."""
    cx2 = c * (x * x).sum(-1)
    return cx2, (1 - cx2).clamp_min(torch.finfo(torch.float64).tiny)


def _lift_parts(x: Tensor, cx2: Tensor, den: Tensor, c: float):
    """float64 (:math:`X_0`, :math:`X_{1:}`) of the Lorentz lift
    :math:`((1 + c\\|x\\|^2)/(\\sqrt c\\,(1 - c\\|x\\|^2)),\\ 2x/(1 - c\\|x\\|^2))` from the
    :func:`_conformal_terms`: the values of :func:`pb.to_lorentz`, bit for bit."""
    x0 = (1 + cx2) / (math.sqrt(c) * den)
    return x0, torch.div(x, (0.5 * den)[:, None])  # 2x / den in one pass (halving den is exact)


def _lift32(x: Tensor, cx2: Tensor, den: Tensor, c: float):
    """(float32 Lorentz lift, float64 :math:`X_0`, float64 :math:`X_{1:}`):
    ``pb.to_lorentz(x, c).to(torch.float32)`` bit for bit, without the float64 (N, D + 1)
    concatenation."""
    x0, tail = _lift_parts(x, cx2, den, c)
    out = torch.empty(x.shape[0], x.shape[1] + 1, dtype=torch.float32)
    out[:, 0] = x0
    out[:, 1:] = tail
    return out, x0, tail


def _dist_from_diff(diff: Tensor, bx: Tensor, by: Tensor, c: float) -> Tensor:
    r"""The module's one distance formula, that of :func:`pb.dist`:
    :math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\,\|y - x\| / \sqrt{b_x b_y})` from the
    explicit differences ``diff = y - x`` (norm over the last dim, in diff's dtype) and
    :math:`b = 1 - c\|\cdot\|^2` (float64, broadcast against the norms). Returns float64."""
    sqrt_c = math.sqrt(c)
    z = torch.linalg.vector_norm(diff, dim=-1).to(torch.float64)
    return torch.asinh_(z.mul_(sqrt_c).div_((bx * by).sqrt_())).mul_(2 / sqrt_c)


def _max_lifted_norm(Y32: Tensor, y0: Tensor, cx2: Tensor, den: Tensor, c: float) -> Tensor:
    """(1,) float64: :math:`\\max_j \\|Y_j\\|` over the float32 lifted rows, the value
    ``vector_norm(Y32.double(), dim=1).max()`` gives, from the few rows that can hold it: a float32
    row's norm is within 2⁻²⁴ (relative) of the exact :math:`\\|Y_j\\|^2 = Y_0^2 + 4\\|x\\|^2/(1 - c\\|x\\|^2)^2`
    (known in float64 from the lift's terms), so a row whose exact norm is below the largest by more
    than 2⁻²⁰ cannot be the largest once rounded."""
    exact = (y0 * y0 + (4.0 / c) * cx2 / (den * den)).sqrt_()
    close = (exact >= exact.max() * (1.0 - 2.0 ** -20)).nonzero().squeeze(1)
    return torch.linalg.vector_norm(Y32.index_select(0, close).double(), dim=1).max().reshape(1)




def outside_tolerance(dtype: torch.dtype) -> float:
    """How far past the ball's radius (relative) a point of ``dtype`` may lie and still count as a
    boundary point rounded outwards (projected back), rather than a point of another space."""
    return max(1e-5, 64.0 * torch.finfo(dtype).eps)


def check_inside_ball(x: Tensor, c: float, name: str) -> None:
    r"""ValueError naming ``name`` when a row has :math:`\sqrt c\|x\| > 1 +` :func:`outside_tolerance`:
    such a point is not in the ball of curvature ``-c`` (Euclidean embeddings, or another ``c``)."""
    if x.shape[0] == 0:
        return
    radius = math.sqrt(c) * torch.linalg.vector_norm(x.detach().to(torch.float64), dim=-1)
    worst = int(torch.argmax(radius))
    if float(radius[worst]) > 1.0 + outside_tolerance(x.dtype):
        raise ValueError(
            f"{name}: row {worst} lies outside the Poincaré ball of curvature -{c:g} "
            f"(sqrt(c)*|x| = {float(radius[worst]):.6g} > 1); pass ball coordinates (e.g. a "
            f"HyperbolicEmbeddingHead's output) and the curvature they were made with")


def to_inner_product(x, c, side: str = "database", dtype=None):
    r"""Export ball points as vectors whose inner products rank exactly as the Poincaré distance.

    ``side="database"``: :math:`Y = (Y_0, Y_{1:})`, the hyperboloid lift (module docstring).
    ``side="query"``: :math:`(-X_0, X_{1:})`. Then for every query and database point

    .. math:: \langle q', y'\rangle = \langle X, Y\rangle_L = -\cosh(\sqrt c\, d_c(x, y)) / c,

    strictly decreasing in the distance, so the largest inner product is the nearest point and
    :math:`d_c = \operatorname{arcosh}(-c\langle q', y'\rangle)/\sqrt c`. Feed the database side to
    any maximum-inner-product index (faiss ``METRIC_INNER_PRODUCT``, a vector database's "dot" or
    "IP" metric) and search it with the query side. Computed in float64; a float32 export rounds
    each coordinate, and near the boundary (large :math:`X_0`) the score cancels, so close
    distances may swap (docs/search.md gives the limits); export in float64 where that matters.

    Why: the engine a user already runs then serves hyperbolic search without a custom metric.

    Design note: docs/design/knn-index.md

    Args:
        x: (N × D) ball coordinates, a torch tensor or numpy array.
        c: curvature magnitude: a float, tensor, hypll object or
            :class:`~pml_hyperbolic.geometry.PoincareGeometry`.
        side: ``"database"`` (the indexed vectors) or ``"query"`` (the search vectors).
        dtype: output dtype (a torch or numpy float dtype); ``None`` = the input's.

    Returns:
        (N × (D + 1)) vectors of the same kind as ``x`` (tensor or numpy array).

    Raises:
        ValueError: ``side`` not one of the two; ``x`` not 2-D, empty, with NaN/Inf, or a row outside
            the ball; a bad ``c``.
        TypeError: ``x`` neither a tensor nor an array.
    """
    if not (isinstance(side, str) and side in ("query", "database")):
        raise ValueError(f"side must be 'query' or 'database', got {side!r}")
    is_numpy = isinstance(x, np.ndarray)
    t = _as_2d_float_tensor(x, "x")
    if t.shape[0] == 0:
        raise ValueError("x is empty: nothing to export")
    try:
        cf = float(pb.as_curvature(c, torch.float64).detach())
    except (TypeError, ValueError) as err:
        raise ValueError(f"c: {err}") from None
    check_inside_ball(t, cf, "x")
    t64 = t.to(torch.float64).cpu()
    cx2, den = _conformal_terms(t64, cf)
    x0, tail = _lift_parts(t64, cx2, den, cf)
    out = torch.empty(t64.shape[0], t64.shape[1] + 1, dtype=torch.float64)
    out[:, 0] = -x0 if side == "query" else x0
    out[:, 1:] = tail
    if dtype is None:
        target = t.dtype
    elif isinstance(dtype, torch.dtype):
        target = dtype
    else:
        target = torch.from_numpy(np.zeros(0, dtype=np.dtype(dtype))).dtype
    out = out.to(target)
    if is_numpy:
        return out.numpy()
    return out.to(t.device)
