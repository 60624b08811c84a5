r"""Gromov δ-hyperbolicity of a point set and the curvature it suggests (Hyp-ViT §2.3).

For a finite metric space with base point :math:`w`, the Gromov product is

.. math:: (x\cdot y)_w = \tfrac12\big(d(x,w) + d(y,w) - d(x,y)\big),

and the space is δ-hyperbolic (four-point condition) with

.. math:: \delta = \max_{x,y,z}\ \Big[\min\big((x\cdot y)_w, (y\cdot z)_w\big) - (x\cdot z)_w\Big]
          = \max_{i,j}\ (G \otimes G - G)_{ij},

where :math:`(G\otimes G)_{ij} = \max_k \min(G_{ik}, G_{kj})` is the (max, min) matrix product of
the Gromov-product matrix G. Relative: :math:`\delta_{rel} = 2\delta/\operatorname{diam}`
(0 for a tree, → 1 for very non-hyperbolic sets). Hyp-ViT suggests the ball curvature
:math:`c = (0.144/\delta_{rel})^2`.

Memory is O(n²): the (max, min) product is computed in (row-block × column-block) tiles of size
``block_rows × block_cols × n``; never an n×n×n tensor. Because G and the product are symmetric,
only tiles with ``j ≥ i`` are formed.

Threads. The tile loop is thousands of small torch ops, each ending in an OpenMP barrier, which
extra threads make slow on a busy machine. It runs with
:func:`~pml_hyperbolic.kernels.threads.uncontended_threads` (the caller's count on an idle machine, 1
when other processes hold the cores), and always with 1 thread for small sets, where the work
cannot repay a thread start. Tiles are 16 × 16 (cache-sized, and a fine pruning grain). The result
does not depend on tiles or threads: every step is an exact min/max.

Design note: docs/design/evaluation.md
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from .. import poincare_ball as pb
from .._checks import check_bool, check_int, check_positive
from ..kernels.threads import limited_threads, uncontended_threads

BLOCK_ROWS = 16
BLOCK_COLS = 16
# sets up to this size run single-threaded without asking: their O(n³/2) tile work costs about
# what choosing a thread count by looking at the machine does (docs/design/evaluation.md)
_SERIAL_MAX_N = 300


def _distance_matrix(embeddings, distances, metric: str, c) -> Tensor:
    if (embeddings is None) == (distances is None):
        raise ValueError("give exactly one of embeddings or distances")
    if distances is not None:
        D = _as_float_tensor(distances, "distances")
        D = D.detach().to(torch.float64)
        if D.dim() != 2 or D.shape[0] != D.shape[1]:
            raise ValueError(f"distances must be a square matrix, got shape {tuple(D.shape)}")
        if D.shape[0] == 0:
            raise ValueError("distances is empty")
        pb.check_finite(D, "distances")
        scale = float(D.abs().max()) if D.numel() else 0.0
        if bool((D < 0).any()):
            raise ValueError("distances has negative entries: not a metric")
        # (tolerances allow the rounding of a float32 torch.cdist, whose diagonal is not exactly 0)
        if not torch.allclose(D, D.T, rtol=1e-5, atol=1e-6 * max(scale, 1e-30)):
            raise ValueError("distances is not symmetric: not a metric (pass D or (D + D.T) / 2)")
        return D
    x = _as_float_tensor(embeddings, "embeddings")
    x = x.detach().to(torch.float64)
    if x.dim() != 2:
        raise ValueError(f"embeddings must be 2-D (N x D), got shape {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError("embeddings is empty")
    pb.check_finite(x, "embeddings")
    if metric == "euclidean":
        sq = (x * x).sum(1)
        D2 = (sq[:, None] + sq[None, :] - 2 * x @ x.T).clamp_min(0)
        return D2.sqrt().fill_diagonal_(0)
    if metric == "cosine":
        xn = torch.nn.functional.normalize(x, dim=1)
        return (1 - xn @ xn.T).clamp_min(0).fill_diagonal_(0)
    if metric == "poincare":
        if c is None:
            raise ValueError("metric='poincare' needs the curvature c")
        x = pb.project(x, c)
        return pb.pairwise_dist(x, x, c).fill_diagonal_(0)
    raise ValueError(f"metric must be 'euclidean', 'cosine' or 'poincare', got {metric!r}")


def _as_float_tensor(value, name: str) -> Tensor:
    """``value`` (tensor or array-like of real numbers) as a tensor; TypeError naming ``name`` otherwise."""
    try:
        x = torch.as_tensor(np.asarray(value) if not isinstance(value, Tensor) else value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(f"{name} must be a numeric array or tensor, got {type(value).__name__}") from None
    if x.is_complex():
        raise TypeError(f"{name} must hold real numbers, got {x.dtype}")
    return x


def _delta_from_distances(D: Tensor, base: int, dtype, block_rows: int, block_cols: int) -> float:
    n = D.shape[0]
    if not 0 <= base < n:
        raise ValueError(f"base must index a point (0 <= base < {n}), got {base}")
    for name, value in (("block_rows", block_rows), ("block_cols", block_cols)):
        if value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value}")
    with limited_threads(_threads_for(n)):
        return _delta_tiles(D, base, dtype, block_rows, block_cols)


def _threads_for(n: int) -> int:
    """Threads for δ of n points: 1 for small sets, else what the machine's load leaves free."""
    return 1 if n <= _SERIAL_MAX_N else uncontended_threads()


def _delta_tiles(D: Tensor, base: int, dtype, block_rows: int, block_cols: int) -> float:
    """δ by the pruned, tiled (max, min) product (module docstring)."""
    n = D.shape[0]
    G64 = 0.5 * (D[base][:, None] + D[base][None, :] - D)
    # Pruning bound: for k outside {i, j}, min(G_ik, G_kj) <= min(r_i, r_j) with r_i the largest
    # off-diagonal entry of row i; k in {i, j} gives exactly G_ij. So a tile whose
    # max(min(r_i, r_j) - G_ij) cannot beat the best δ so far is skipped. Rows are visited by
    # decreasing r (a symmetric permutation leaves δ unchanged) so that good δ are found early.
    off = G64.clone().fill_diagonal_(-math.inf)
    r = off.max(dim=1).values if n > 1 else torch.zeros(1, dtype=G64.dtype)
    perm = torch.argsort(r, descending=True)
    G64 = G64[perm][:, perm]
    r = r[perm]
    G = G64.to(dtype).contiguous()
    bound = torch.minimum(r[:, None], r[None, :]) - G64
    best = -math.inf
    buf = torch.empty((block_rows, block_cols, n), dtype=dtype)
    for i0 in range(0, n, block_rows):
        gi = G[i0 : i0 + block_rows, None, :]
        ni = gi.shape[0]
        # symmetric: tiles with j >= i cover every unordered pair
        for j0 in range((i0 // block_cols) * block_cols, n, block_cols):
            if best > -math.inf and float(bound[i0 : i0 + ni, j0 : j0 + block_cols].max()) <= best:
                continue
            gj = G[None, j0 : j0 + block_cols, :]
            nj = gj.shape[1]
            tile = buf[:ni, :nj]
            torch.minimum(gi, gj, out=tile)
            v = float((tile.amax(dim=-1) - G[i0 : i0 + ni, j0 : j0 + nj]).max())
            if v > best:
                best = v
    return max(best, 0.0)


def gromov_delta(
    embeddings: Any = None,
    *,
    distances: Any = None,
    metric: str = "euclidean",
    c: Optional[float] = None,
    base: int = 0,
    dtype: torch.dtype = torch.float64,
    block_rows: int = BLOCK_ROWS,
    block_cols: int = BLOCK_COLS,
) -> float:
    r"""Gromov δ (absolute) of a point set, from Gromov products at point ``base``.

    Args:
        embeddings: (n × D) points, compared with ``metric``; give this or ``distances``.
        distances: a precomputed (n × n) symmetric, non-negative distance matrix instead.
        metric: "euclidean" (default, as Hyp-ViT on backbone features), "cosine" (1 − cos) or
            "poincare" (needs ``c``).
        c: curvature for ``metric="poincare"``.
        base: index of the base point w (Hyp-ViT: point 0).
        dtype: dtype of the (max, min) product; float32 is faster, exact up to the rounding of
            the Gromov products (relative 1e-7).
        block_rows: tile rows of the (max, min) product (speed only; the value does not depend on it).
        block_cols: tile columns of the (max, min) product (speed only).

    Returns:
        δ ≥ 0 as a float. O(n²) memory, O(n³) time. Sets of at most 3 points are 0-hyperbolic (any
        3-point metric space embeds in a tree), so they return exactly 0.0; for a *relative* δ of a
        degenerate set see :func:`relative_delta`, which refuses coincident points.

    Raises:
        ValueError: both or neither of ``embeddings`` / ``distances``, a matrix that is not a
            metric, NaN/Inf, an empty set, a bad ``metric``, ``base`` out of range or < 0, or a
            block size < 1.
        TypeError: ``embeddings`` / ``distances`` not numeric, or ``base`` / a block size not an
            integer (bool included).

    Design note: docs/design/evaluation.md
    """
    base = check_int(base, "base", 0)
    block_rows = check_int(block_rows, "block_rows", 1)
    block_cols = check_int(block_cols, "block_cols", 1)
    src = embeddings if embeddings is not None else distances
    n = len(src) if hasattr(src, "__len__") and np.ndim(src) > 0 else 0  # bad input: the error below
    # the distance matrix and the Gromov products are big ops, but on a busy machine their
    # barriers wait for descheduled threads like the tile loop's: same thread count for all
    with limited_threads(_threads_for(n)):
        D = _distance_matrix(embeddings, distances, metric, c)
        return _delta_from_distances(D, int(base), dtype, int(block_rows), int(block_cols))


def relative_delta(
    embeddings: Any = None,
    *,
    distances: Any = None,
    metric: str = "euclidean",
    c: Optional[float] = None,
    base: int = 0,
    n_samples: Optional[int] = None,
    n_draws: int = 1,
    seed: int = 0,
    return_std: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Union[float, Tuple[float, float]]:
    r"""Relative δ: :math:`\delta_{rel} = 2\delta / \operatorname{diam}` (in [0, 1]).

    With ``n_samples`` (and more points than that) the estimate is the mean over ``n_draws``
    random subsets of ``n_samples`` points (seeded by ``seed``; base = each subset's first point),
    as Hyp-ViT does on large sets.

    Args:
        embeddings: (n × D) points; give this or ``distances``.
        distances: a precomputed (n × n) distance matrix instead.
        metric: as in :func:`gromov_delta`.
        c: curvature for ``metric="poincare"``.
        base: base point index when the whole set is used.
        n_samples: subset size (None: the whole set).
        n_draws: number of random subsets averaged.
        seed: seed of the subsets.
        return_std: also return the standard deviation over the draws.
        dtype: dtype of the (max, min) product.

    Returns:
        δ_rel as a float, or ``(mean, std)`` with ``return_std``.

    Raises:
        ValueError: ``n_draws`` < 1, ``n_samples`` < 2, ``seed`` < 0, no or empty input, or a set
            (or subset) whose points all coincide (0/0), plus :func:`gromov_delta`'s errors.
        TypeError: ``n_draws`` / ``n_samples`` / ``seed`` / ``base`` not an integer, or
            ``return_std`` not a bool.

    Design note: docs/design/evaluation.md
    """
    n_draws = check_int(n_draws, "n_draws", 1)
    if n_samples is not None:
        n_samples = check_int(n_samples, "n_samples", 2)
    seed = check_int(seed, "seed", 0)
    base = check_int(base, "base", 0)
    return_std = check_bool(return_std, "return_std")
    src = embeddings if embeddings is not None else distances
    if src is None:
        raise ValueError("give exactly one of embeddings or distances")
    n = len(src)
    if n == 0:
        raise ValueError("cannot compute δ of an empty set")
    if n_samples is None or n_samples >= n:
        draws = [None]
    else:
        gen = torch.Generator().manual_seed(int(seed))
        draws = [torch.randperm(n, generator=gen)[:n_samples] for _ in range(n_draws)]
    values = []
    with limited_threads(_threads_for(n if n_samples is None else min(n, n_samples))):
        for sel in draws:
            values.append(_relative_delta_of(embeddings, distances, metric, c, base, sel, dtype))
    mean = float(np.mean(values))
    if return_std:
        return mean, float(np.std(values))
    return mean


def _relative_delta_of(embeddings, distances, metric, c, base, sel, dtype) -> float:
    """2δ/diam of the whole set (``sel`` None) or of the subset ``sel`` (base = its first point)."""
    if sel is None:
        D = _distance_matrix(embeddings, distances, metric, c)
        b = base
    else:
        if embeddings is not None:
            e = torch.as_tensor(np.asarray(embeddings) if not isinstance(embeddings, Tensor) else embeddings)
            D = _distance_matrix(e[sel], None, metric, c)
        else:
            D = _distance_matrix(None, torch.as_tensor(np.asarray(distances))[sel][:, sel], metric, c)
        b = 0
    diam = float(D.max())
    if diam <= 0:
        raise ValueError("relative δ is undefined (0/0): every point of the set (or of a sampled subset) "
                         "coincides; check the features (a collapsed backbone?)")
    delta = _delta_from_distances(D, int(b), dtype, BLOCK_ROWS, BLOCK_COLS)
    return 2.0 * delta / diam


def suggest_curvature(
    embeddings: Any,
    *,
    metric: str = "euclidean",
    n_samples: int = 2000,
    n_draws: int = 5,
    seed: int = 0,
    max_curvature: float = 10.0,
    min_curvature: float = 1e-4,
    **kwargs: Any,
) -> float:
    r"""Curvature suggested by Hyp-ViT: :math:`c = (0.144 / \delta_{rel})^2`, with δ_rel the mean
    of :func:`relative_delta` over ``n_draws`` subsets of ``n_samples`` points (Hyp-ViT: raw
    backbone features, Euclidean). Clamped to ``[min_curvature, max_curvature]`` (a tree-like set
    has δ_rel ≈ 0 and would suggest c = ∞); a warning says when the clamp applied.
    This is what the recipes' ``--curvature auto`` uses.

    Args:
        embeddings: (n × D) points.
        metric: as in :func:`gromov_delta`.
        n_samples: subset size of each draw.
        n_draws: number of random subsets averaged.
        seed: seed of the subsets.
        max_curvature: upper clamp.
        min_curvature: lower clamp (> 0).
        **kwargs: further :func:`relative_delta` arguments (``c``, ``dtype``, ...).

    Returns:
        c as a float.

    Raises:
        ValueError: ``min_curvature`` / ``max_curvature`` not finite numbers > 0,
            ``min_curvature`` > ``max_curvature``, or ``n_samples`` < 2, plus :func:`relative_delta`'s
            errors.
        TypeError: ``n_samples`` not an integer (None included).

    Design note: docs/design/evaluation.md
    """
    # an integer here (relative_delta's None, "the whole set", is not this function's contract)
    n_samples = check_int(n_samples, "n_samples", 2)
    min_curvature = check_positive(min_curvature, "min_curvature")
    max_curvature = check_positive(max_curvature, "max_curvature")
    if not min_curvature <= max_curvature:
        raise ValueError(f"need min_curvature <= max_curvature, got {min_curvature} > {max_curvature}")
    d_rel = relative_delta(embeddings, metric=metric, n_samples=n_samples, n_draws=n_draws,
                           seed=seed, **kwargs)
    c = math.inf if d_rel <= 0 else (0.144 / d_rel) ** 2
    if not (min_curvature <= c <= max_curvature):
        warnings.warn(f"suggest_curvature: δ_rel = {d_rel:.4g} gives c = {c:.4g}; clamped to "
                      f"[{min_curvature}, {max_curvature}]")
        c = min(max(c, min_curvature), max_curvature)
    return float(c)
