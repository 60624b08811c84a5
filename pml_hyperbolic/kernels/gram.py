r"""The pairwise distance's matrix product and its accuracy guards: row terms, the augmented Gram
product, the closeness bound, extreme points and the explicit recomputation of pairs.

With :math:`p = c/a`, :math:`q = 1/b` the product of augmented rows
:math:`[-4p_i x_i,\; 2p_i\|x_i\|^2,\; 2p_i]\cdot[y_j,\; 1,\; \|y_j\|^2]` gives
:math:`P_{ij} = 2p_i\|x_i - y_j\|^2`; a pair with :math:`\|x_i - y_j\|^2 < f(\|x_i\|^2 + \|y_j\|^2)`
cannot be resolved by it and is recomputed from explicit differences in float64
(:func:`_explicit_w`). Why here: these are the parts of the kernel that decide its error bound, kept
apart from the elementwise tail (:mod:`pml_hyperbolic.kernels.tail`) and the op
(:mod:`pml_hyperbolic.kernels.pairwise`).

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import native as _native

# Target relative error of w for pairs left to the matrix product (d's relative error is at most
# half of it): float32 4e-5 (spec: 1e-4 on d), float64 4e-11 (spec: 1e-10).
_TARGET_REL_ERROR = {torch.float32: 4e-5, torch.float64: 4e-11}
# Pairs recomputed explicitly are processed in chunks of at most this many elements (K×D).
_CHUNK_ELEMENTS = 1 << 22
# Above this fraction of close pairs a float32 call redoes the product in float64.
_MAX_CLOSE_FRACTION = 1.0 / 16.0
_SQRT2 = math.sqrt(2.0)
#: Floor of the conformal denominators 1 − c‖x‖² (shared with ``poincare_ball.dist``). Computed in
#: float64, 1 − c‖x‖² is either ≥ 2⁻⁵³ or ≤ 0, so the floor acts exactly on points on or outside the
#: boundary; 2⁻⁶⁰ keeps 1/a (1.2e18) and 1/(ab) finite even in float32.
DENOM_FLOOR = 2.0 ** -60
# Points with 1 − c‖x‖² below this (closer to the boundary than `project` puts anything, or
# outside) are "extreme": kept out of the Gram product and its error bound (one of them would
# inflate the bound of every row), their pairs are all computed explicitly.
_EXTREME_A = {torch.float32: 1e-5, torch.float64: 1e-10}
# Nonzero points with ‖x‖² below this are handled like extreme points (explicit float64 pairs):
# their products underflow in the Gram matrix. Exact zeros stay in it (their W is exactly 0).
_TINY_SQ_NORM = {torch.float32: 1e-30, torch.float64: 1e-290}
# The elementwise tail runs in row blocks of about this many elements (1 MB of float32 per
# temporary), so that each block's passes stay in cache.
_TAIL_BLOCK_ELEMENTS = 1 << 18
# Row blocks whose smallest W = 2w is at least this (u = W + √(2W + W²) > 1) need no log1p.
_PLAIN_LOG_MIN_W = 0.3
_TINY64 = torch.finfo(torch.float64).tiny


def _gram_error(dtype: torch.dtype, dim: int) -> float:
    """Relative error bound of a length-``dim`` dot product (random-walk accumulation, ×2)."""
    return 2.0 * math.sqrt(dim) * torch.finfo(dtype).eps


def _row_terms(x: Tensor, c: float, floor: float = DENOM_FLOOR):
    """Float64 row quantities: ‖x‖² and 1/(1 − c‖x‖²) (floored at ``floor``, :data:`DENOM_FLOOR` by
    default: never a division by zero); one native pass where it applies
    (:func:`pml_hyperbolic.kernels.native.row_terms`)."""
    if x.device.type == "cpu":
        done = _native.row_terms(x, c, floor)
        if done is not None:
            return done
    xd = x.double()
    x2 = torch.linalg.vecdot(xd, xd)
    inv_a = (1.0 - c * x2).clamp_min_(floor).reciprocal_()
    return x2, inv_a


def _augmented(x: Tensor, x2: Tensor, scale: Tensor, dtype: torch.dtype, pad: bool = False) -> Tensor:
    """Rows ``[scale·x, scale, scale·‖x‖²]`` in ``dtype`` (the right factor of the backward products).

    ``pad`` appends zero columns up to a multiple of 8 (MKL's products are faster on widths that
    are a multiple of the vector length)."""
    n, dim = x.shape
    width = -(-(dim + 2) // 8) * 8 if pad else dim + 2
    out = torch.empty(n, width, dtype=dtype, device=x.device)
    torch.mul(x.to(dtype), scale.to(dtype)[:, None], out=out[:, :dim])
    out[:, dim] = scale
    out[:, dim + 1] = scale * x2
    out[:, dim + 2:] = 0
    return out


class _CloseBound(NamedTuple):
    """Closeness bound of the Gram product's pairs: pair (i, j) is close if
    P_ij < row_x_i + row_1_i·y2_j (= f·2p_i (‖x_i‖² + ‖y_j‖²), P = W before its column scaling);
    ``row`` (in P's dtype) bounds it over every j that can be close to i at all, a prefilter."""

    row: Tensor
    row_x: Tensor
    row_1: Tensor
    y2: Tensor


def _band_ratio_sq(f: float) -> float:
    """Largest (‖y‖/‖x‖)² of a pair that can be close: ‖x − y‖² ≥ (‖x‖ − ‖y‖)², so
    ‖x − y‖² < f(‖x‖² + ‖y‖²) needs (1 − r)² < f(1 + r²), i.e. r below the larger root of
    (1 − f)r² − 2r + (1 − f) = 0 (inf when f ≥ 1: no band)."""
    if f >= 1.0:
        return math.inf
    return ((1.0 + math.sqrt(1.0 - (1.0 - f) ** 2)) / (1.0 - f)) ** 2


def _gram_W(x, y, x2, inv_a, y2, inv_b, c: float, dtype):
    """P = 2c‖x−y‖²/a from one augmented matrix product (W = 2w = P·q_j, q = 1/b, is applied by
    :func:`_distance_tail`), plus its :class:`_CloseBound`.

    The columns are left unscaled so that the closeness test ‖x−y‖² < f(‖x‖² + ‖y‖²) is a
    per-row bound on P whatever the spread of 1/b (near the boundary it spans orders of
    magnitude). (Extreme points enter with 1/a = 0; see :func:`_gram_regular`.)"""
    p2 = (2.0 * c) * inv_a
    dim = x.shape[1]
    left = _augmented(x, x2, -2.0 * p2, dtype)  # [-4p x, -2p, -2p‖x‖²] -> fix the last two
    left[:, dim] = p2 * x2
    left[:, dim + 1] = p2
    right = _augmented(y, y2, torch.ones_like(y2), dtype)  # [y, 1, ‖y‖²]
    P = left @ right.T  # 2p (‖x‖² + ‖y‖² − 2 x·y)
    factor = _gram_error(dtype, dim + 2) / _TARGET_REL_ERROR[dtype]
    # The Gram error scale of P_ij is 2 p_i (‖x_i‖² + ‖y_j‖²). Only columns with ‖y_j‖² up to
    # band·‖x_i‖² can be close to row i, so its largest bound is at min(band·‖x_i‖², max ‖y‖²).
    row_x, row_1 = factor * p2 * x2, factor * p2
    y2_max = y2.max() if y2.numel() else x2.new_zeros(())
    row = row_x + row_1 * torch.clamp(x2 * _band_ratio_sq(factor), max=y2_max)
    return P, _CloseBound(row.to(dtype), row_x, row_1, y2)


def _gram_regular(x, y, x2, inv_a, y2, inv_b, c: float, dtype, ext_x, ext_y):
    """:func:`_gram_W` with the extreme rows ``ext_x`` / columns ``ext_y`` (index tensors or None)
    left out: their 1/a is 0 in the product and the bound, their entries of P are +inf (never
    "close"); the caller computes all their pairs explicitly."""
    if ext_x is not None:
        inv_a = inv_a.index_fill(0, ext_x, 0.0)
    P, bound = _gram_W(x, y, x2, inv_a, y2, inv_b, c, dtype)
    if ext_x is not None:
        P.index_fill_(0, ext_x, float("inf"))
    if ext_y is not None:
        P.index_fill_(1, ext_y, float("inf"))
    return P, bound


def _close_pairs(P: Tensor, bound: _CloseBound, same: bool, with_row_min: bool = False):
    """Indices of the pairs the Gram product cannot resolve (excluding the diagonal if ``same``),
    and with ``with_row_min`` also each row's smallest off-diagonal P (the tail uses it).

    The per-row bound first keeps the per-pair test to the rows that can have a close pair at
    all; on those (in row blocks, to stay in cache) each P_ij is compared with its own bound, a
    rank-2 matrix built by one small product. Strict ``<``: a pair whose bound is 0 (both points
    at the origin) has P = 0 exactly and is not close. With ``same`` the diagonal is written as
    exactly 0.
    """
    if same:
        P.diagonal().fill_(float("inf"))
    row_min = P.amin(1)
    candidates = torch.nonzero(row_min < bound.row).squeeze(1)
    rows, cols = [], []
    if candidates.numel():
        left = torch.stack([bound.row_x[candidates], bound.row_1[candidates]], 1).to(P.dtype)
        right = torch.stack([torch.ones_like(bound.y2), bound.y2]).to(P.dtype)
        step = max(1, _TAIL_BLOCK_ELEMENTS // max(1, P.shape[1]))
        for start in range(0, candidates.numel(), step):
            block = candidates[start:start + step]
            sub_rows, sub_cols = torch.nonzero(P[block] < left[start:start + step] @ right, as_tuple=True)
            rows.append(block[sub_rows])
            cols.append(sub_cols)
    if same:
        P.diagonal().zero_()
    if not rows:
        rows, cols = candidates, candidates
    else:
        rows, cols = (torch.cat(rows), torch.cat(cols)) if len(rows) > 1 else (rows[0], cols[0])
    return (rows, cols, row_min) if with_row_min else (rows, cols)


def _extreme_pairs(n: int, m: int, ext_x, ext_y, same: bool, device):
    """All pairs (i, j) with x_i or y_j extreme, each once (row-major blocks)."""
    parts_r, parts_c = [], []
    if ext_x is not None:
        parts_r.append(ext_x.repeat_interleave(m))
        parts_c.append(torch.arange(m, device=device).repeat(ext_x.numel()))
    if ext_y is not None:
        regular = torch.ones(n, dtype=torch.bool, device=device)
        if ext_x is not None:
            regular[ext_x] = False
        reg_rows = torch.nonzero(regular).squeeze(1)
        parts_r.append(reg_rows.repeat_interleave(ext_y.numel()))
        parts_c.append(ext_y.repeat(reg_rows.numel()))
    return torch.cat(parts_r), torch.cat(parts_c)


def _explicit_sq_diff(x: Tensor, y: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """‖x_rows − y_cols‖² from explicit differences, chunked to bound memory."""
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, rows.shape[0], step):
        sl = slice(start, start + step)
        diff = x[rows[sl]] - y[cols[sl]]
        out[sl] = torch.linalg.vecdot(diff, diff)
    return out


def _explicit_w(x: Tensor, y: Tensor, rows: Tensor, cols: Tensor, inv_a: Tensor, inv_b: Tensor,
                cf: float) -> Tensor:
    """Float64 w = c‖x_i − y_j‖²/(a_i b_j) of the listed pairs from explicit differences (w of a pair
    with a floored denominator can exceed float32's range)."""
    # cf·(1/a_i · 1/b_j): the product of the two row terms first, so that (i, j) and (j, i) of
    # (x, x) get the same bits
    return (cf * (inv_a[rows] * inv_b[cols])) * _explicit_sq_diff(x, y, rows, cols).double()


def _dist_from_w(w: Tensor, cf: float, dtype: torch.dtype) -> Tensor:
    """D = (2/√c) arsinh(√w), in ``dtype``."""
    return ((2.0 / math.sqrt(cf)) * torch.asinh(w.sqrt())).to(dtype)



def _extreme_points(x2: Tensor, inv_a: Tensor, dtype: torch.dtype):
    """Indices (or None) of the points kept out of the Gram product: on/outside the boundary or
    closer to it than `project` puts anything (1/a > 1/threshold ⇔ 1 − c‖x‖² < threshold, floored
    ones included), and nonzero points so small that their products underflow."""
    extreme = (inv_a > 1.0 / _EXTREME_A[dtype]) | ((x2 > 0) & (x2 < _TINY_SQ_NORM[dtype]))
    index = torch.nonzero(extreme).squeeze(1)
    return index if index.numel() else None

