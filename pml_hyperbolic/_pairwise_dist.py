r"""Fused all-pairs Poincaré distance with a closed-form backward.

With :math:`a_i = 1 - c\|x_i\|^2`, :math:`b_j = 1 - c\|y_j\|^2`, :math:`s_{ij} = \|x_i - y_j\|^2`

.. math:: w_{ij} = \frac{c\, s_{ij}}{a_i b_j}, \qquad
          D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{w_{ij}}
          = \frac{1}{\sqrt c}\operatorname{log1p}\!\big(2w_{ij} + 2\sqrt{w_{ij}(1+w_{ij})}\big).

Why a custom kernel: PML's losses ask for the full N×M matrix at every step; built from
elementwise torch ops it costs several N×M×D temporaries and an autograd graph of them. Here the
forward is one matrix product plus one elementwise tail, the backward is two (one when ``x`` is
``y``), and memory is O(NM + ND).

Forward. :math:`P = 2p\,s` (:math:`W = 2w = P_{ij} q_j`) comes out of ONE matrix product of
augmented rows :math:`[-4p_i x_i,\; 2p_i\|x_i\|^2,\; 2p_i]\cdot[y_j,\; 1,\; \|y_j\|^2]` with
:math:`p = c/a`, :math:`q = 1/b` (row norms in float64); the column scale :math:`q_j` is applied in
the tail, so that the closeness test below is a clean per-row bound. Then
:math:`S = \sqrt{W + W^2/2} = \sqrt2\sqrt{w(1+w)}` (kept for the backward, only when one comes),
:math:`u = W + \sqrt2 S` and :math:`D = \operatorname{log1p}(u)/\sqrt c`, with log1p rebuilt from
``log`` (:func:`_log1p_from_log`, whose speed does not depend on the process state as aten's
``log1p_`` does), or plain ``log(1 + u)`` in row blocks where every u > 1. The elementwise tail
runs in row blocks of ``_TAIL_BLOCK_ELEMENTS`` so that its passes stay in cache, and writes D into
the product's own buffer. Where it can (contiguous CPU float32/float64 and a C compiler,
:mod:`pml_hyperbolic._native`) the whole tail is instead ONE fused native pass with its own
vectorised log1p (within an ulp). Every point at the origin: D = 0 directly.

Symmetric forward (x is y on CPU, the call of PML's losses: ``compute_mat(emb, emb)``): the
matrix is symmetric, so :func:`_symmetric_forward` computes the Gram product x xᵀ only on and
above the diagonal (row blocks written straight into the output) and the native symmetric tail
evaluates each unordered pair once and mirrors it (S, kept for the backward, only above the
diagonal); the backward's weights E + Eᵀ = (U + Uᵀ)/S then come from one native pass (S is exactly
symmetric). Same closeness test, same explicit recomputation of close pairs; any case it does not
cover (no native library, extreme points, GPU, a collapsed float32 batch) takes the general path.
``PML_HYPERBOLIC_SYMMETRIC=0`` turns it off.

Close pairs. A Gram product loses the small differences of nearby points: its absolute error on
:math:`w_{ij}` is about :math:`\varepsilon_g\, p_i q_j (\|x_i\|^2 + \|y_j\|^2)`. Pairs whose
:math:`P` is below that error scaled by ``1/_TARGET_REL_ERROR``, i.e.
:math:`\|x_i - y_j\|^2 < f(\|x_i\|^2 + \|y_j\|^2)` (:math:`f \approx 0.07` in float32), are
recomputed from explicit differences :math:`x_i - y_j`. The test is per pair; a per-row bound over
the :math:`j` that can be close to :math:`i` at all (:math:`\|y_j\|/\|x_i\|` within a band, by the
triangle inequality) first keeps the per-pair compare to the few rows that can have a close pair.
In float32, if more than 1/16 of all pairs are really close (a collapsed batch), the whole product
is redone in float64 instead, which needs the fix only for near-duplicates. Two points both
exactly at the origin give :math:`W = 0` exactly; points with :math:`0 < \|x\|^2` below
``_TINY_SQ_NORM`` (where float32 products underflow) are handled like extreme points. When ``x``
is ``y`` the diagonal is set to exactly 0 and the result is exactly symmetric on every path: the
general path (whose Gram product and per-pair test are not symmetric) mirrors its upper triangle
by tiles, and an explicit pair's w is formed as :math:`c\,(1/a_i \cdot 1/a_j)\,s_{ij}`, the same
bits for (i, j) and (j, i).

Extreme points. :math:`1 - c\|x\|^2` is floored at ``DENOM_FLOOR`` = 2⁻⁶⁰ (only points on or
outside the boundary reach it). Points with :math:`1 - c\|x\|^2` below ``_EXTREME_A`` (nearer the
boundary than ``project`` puts anything) enter the product with weight 0 and stay out of the
error bound (one such point would otherwise inflate every row's bound to inf and corrupt valid
pairs); all their pairs are computed explicitly, in float64. Their gradient treats a floored
denominator as the constant it is (as ``dist`` does).

Second order. The closed-form backward below is not itself differentiable; a backward run with
``create_graph=True`` instead differentiates :func:`_composite_dist` (plain float64 ops, same
close pairs and floor), so gradient penalties work.

Backward. With upstream gradient :math:`U`, :math:`E = U/\sqrt{w(1+w)}` and
:math:`F = E\,w = U\sqrt{w/(1+w)}`:

.. math:: \nabla_{x_i} = \frac{2\sqrt c}{a_i}\Big[x_i\big(\textstyle\sum_j E_{ij} q_j + \sum_j F_{ij}\big)
          - \sum_j E_{ij} q_j y_j\Big]

(symmetric for :math:`y`). The row sums of :math:`F` are folded into the same matrix product:
:math:`\sum_j E_{ij}w_{ij} = p_i\big(\|x_i\|^2 \sum_j E_{ij}q_j + \sum_j E_{ij}q_j\|y_j\|^2
- 2x_i\cdot\sum_j E_{ij}q_jy_j\big)`, so one product with :math:`[q y, q, q\|y\|^2]` gives
everything for :math:`x` (its cancellation error is bounded like the forward's, because every pair
left in it passed the closeness test). When ``x`` is ``y`` (PML's ``compute_mat(emb, emb)``) the two
gradients add up: :math:`(E + E^\top)A`, with :math:`E + E^\top` formed in place by tiles
(:func:`_symmetrize_`); :math:`E` lives in :math:`S`'s buffer, which is then kept for the next call
(:func:`_take_scratch`). Close pairs are taken out of :math:`E` and
added back sparsely in bounded explicit form: :math:`2U_{ij}\,(x_i - y_j)/(\|x_i - y_j\|
\sqrt{a_i b_j(1+w_{ij})})` (0 at :math:`x_i = y_j`, no NaN from the diagonal) plus their
:math:`F_{ij}`. For the curvature

.. math:: \frac{\partial D_{ij}}{\partial c} = -\frac{D_{ij}}{2c} + \frac{1}{\sqrt c}
          \sqrt{\frac{w_{ij}}{1+w_{ij}}}\Big(\frac1c + \frac{\|x_i\|^2}{a_i} + \frac{\|y_j\|^2}{b_j}\Big).

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from . import _native
from ._spare_buffers import SpareBuffers
from .threads import limited_threads, uncontended_threads

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


def _row_terms(x: Tensor, c: float):
    """Float64 row quantities: ‖x‖² and 1/(1 − c‖x‖²) (floored at :data:`DENOM_FLOOR`: never a
    division by zero); one native pass where it applies (:func:`pml_hyperbolic._native.row_terms`)."""
    if x.device.type == "cpu":
        done = _native.row_terms(x, c, DENOM_FLOOR)
        if done is not None:
            return done
    xd = x.double()
    x2 = torch.linalg.vecdot(xd, xd)
    inv_a = (1.0 - c * x2).clamp_min_(DENOM_FLOOR).reciprocal_()
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


def _log1p_from_log(u: Tensor, v: Tensor, t: Tensor) -> Tensor:
    r"""log1p(u) for u ≥ 0 from ``log``, written into ``t`` (``u`` is overwritten, ``v``/``t`` are
    scratch of u's shape):

    .. math:: v = \operatorname{fl}(1 + u),\quad e = u - (v - 1),\quad
              \operatorname{log1p}(u) = \log v + e/v + O(e^2/v^2).

    ``v − 1`` and ``u − (v − 1)`` are exact in floating point (Sterbenz), so ``e`` is the exact
    rounding error of ``1 + u`` and the result is accurate to a few ulps for every u ≥ 0, also
    u < eps (v = 1, e = u). Five passes, one transcendental; unlike aten's ``log1p_`` its speed does
    not depend on the process state."""
    torch.add(u, 1.0, out=v)
    torch.sub(v, 1.0, out=t)
    u.sub_(t)  # e
    torch.log(v, out=t)
    return t.addcdiv_(u, v)


# One N×M scratch buffer (the S/E of the last backward) is kept per process on CPU and reused as
# the next call's S: a fresh N×M allocation comes with fresh pages to fault in. The cost: that one
# buffer stays allocated between calls (3.2 MB at 900², 64 MB at 4096², float32).
# (CUDA's caching allocator already reuses memory: not used there.)
_SCRATCH = SpareBuffers(capacity=1)


def _take_scratch(like: Tensor) -> Tensor:
    """An uninitialised tensor shaped like ``like``: the kept scratch buffer if it fits, else new."""
    return _SCRATCH.take(like.shape, like)


def _give_scratch(buffer: Tensor) -> None:
    """Keep ``buffer`` (no longer referenced by its caller) for the next :func:`_take_scratch`."""
    _SCRATCH.give(buffer)


def _distance_tail(P: Tensor, c: float, col_scale: Tensor, row_min: Tensor | None = None,
                   keep_S: bool = True) -> Tensor | None:
    """In place: P → W = 2w = P·col_scale[j] → D = log1p(W + √2·S)/√c; returns
    S = √(W + W²/2) = √2·√(w(1+w)) (a scratch buffer, see :func:`_take_scratch`), or None
    without ``keep_S`` (no backward to come: S then lives in one block buffer).

    Row blocks keep each block's passes in cache; finite and exactly 0 at W = 0. A block whose
    rows' smallest P (``row_min``, the diagonal excluded; ≤ W as the scale 1/b ≥ 1) is at least
    ``_PLAIN_LOG_MIN_W`` takes plain ``log(1 + u)``: there u > 1, and the rounding of 1 + u costs
    at most 2⁻²⁴/log 2 relative (float32), under an ulp of D.

    Where it applies (contiguous CPU float32/float64, a C compiler at hand, not disabled by
    ``PML_HYPERBOLIC_NATIVE=0``) the same tail runs as ONE fused pass of native code
    (:mod:`pml_hyperbolic._native`, ``_native_tail.c``: its own vectorised log1p, within an ulp);
    the torch ops below are the fallback."""
    W = P
    S = _take_scratch(W) if keep_S else None
    # the fused one-pass loop (contiguous CPU float32/float64), with the kernel's thread count
    if _native.distance_tail(W, S, col_scale, 1.0 / math.sqrt(c), torch.get_num_threads()):
        return S
    rows = max(1, _TAIL_BLOCK_ELEMENTS // max(1, W.shape[1]))
    s_scratch = None if keep_S else W.new_empty(min(rows, W.shape[0]) * W.shape[1])
    starts = range(0, W.shape[0], rows)
    if row_min is None:
        plain = [False] * len(starts)
    else:  # one host transfer for all blocks
        padded = torch.nn.functional.pad(row_min, (0, len(starts) * rows - row_min.shape[0]), value=float("inf"))
        plain = (padded.view(len(starts), rows).amin(1) >= _PLAIN_LOG_MIN_W).tolist()
    v = t = None
    inv_sqrt_c = 1.0 / math.sqrt(c)
    for start, plain_log in zip(starts, plain):
        w_blk = W[start:start + rows]
        s_blk = S[start:start + rows] if keep_S else s_scratch[:w_blk.numel()].view(w_blk.shape)
        w_blk.mul_(col_scale)
        torch.addcmul(w_blk, w_blk, w_blk, value=0.5, out=s_blk).sqrt_()
        u = w_blk.add_(s_blk, alpha=_SQRT2)
        if plain_log:
            u.add_(1.0).log_().mul_(inv_sqrt_c)
            continue
        if v is None or v.shape != w_blk.shape:
            v, t = torch.empty_like(w_blk), torch.empty_like(w_blk)
        d = _log1p_from_log(u, v, t)
        torch.mul(d, inv_sqrt_c, out=w_blk)
    return S


def _symmetrize_(E: Tensor, tile: int = 512) -> Tensor:
    """E ← E + Eᵀ in place (square E), by pairs of tiles: each tile is copied out, transposed by
    aten's blocked transpose copy (a transposed contiguous source) and added back, through two
    reused tile buffers (no N×N temporary). Why: ``torch.add(E, E.T)`` reads Eᵀ with a
    cache-hostile stride."""
    n = E.shape[0]
    copy_buf = E.new_empty(min(n, tile) ** 2)
    transposed_buf = E.new_empty(min(n, tile) ** 2)

    def transposed(block: Tensor) -> Tensor:
        h, w = block.shape
        copy = copy_buf[:h * w].view(h, w).copy_(block)
        return transposed_buf[:h * w].view(w, h).copy_(copy.T)

    for i in range(0, n, tile):
        for j in range(i, n, tile):
            upper = E[i:i + tile, j:j + tile]
            if i == j:
                upper.add_(transposed(upper))
            else:
                lower = E[j:j + tile, i:i + tile]
                lower.add_(transposed(upper))  # lower + upperᵀ, whose transpose is the new upper
                upper.copy_(transposed(lower))
    return E


def _mirror_upper_tiled_(M: Tensor, tile: int = 512) -> Tensor:
    """M's part above the diagonal copied below it, in place, by tiles (half a pass over M, no
    N×N temporary): the general forward of (x, x) made exactly symmetric."""
    n = M.shape[0]
    below = torch.ones(min(n, tile), min(n, tile), dtype=torch.bool, device=M.device).tril_(-1)
    for i in range(0, n, tile):
        diag = M[i:i + tile, i:i + tile]
        k = diag.shape[0]
        diag.copy_(torch.where(below[:k, :k], diag.T, diag))
        for j in range(i + tile, n, tile):
            M[j:j + tile, i:i + tile].copy_(M[i:i + tile, j:j + tile].T)
    return M


def _mirror_upper_(M: Tensor) -> Tensor:
    """M's part above the diagonal copied below it, in place (the rare backward of a symmetric
    forward that cannot use the native symmetric weights: x and y the same data but distinct
    tensors, so that only one of them wants a gradient)."""
    lower = torch.ones(M.shape, dtype=torch.bool, device=M.device).tril_(-1)
    return M.masked_scatter_(lower, M.T[lower])


def _folded_F(z: Tensor, x: Tensor, x2: Tensor, p: Tensor) -> Tensor:
    """Σ_j E_ij w_ij = p_i (‖x_i‖² Σ_j E_ij q_j + Σ_j E_ij q_j‖y_j‖² − 2 x_i·Σ_j E_ij q_j y_j),
    from ``z = E @ [q y, q, q‖y‖²]``."""
    dim = x.shape[1]
    return p * (x2 * z[:, dim] + z[:, dim + 1] - 2.0 * torch.linalg.vecdot(x, z[:, :dim]))


def _composite_dist(x: Tensor, y: Tensor, c: Tensor, rows: Tensor, cols: Tensor, same: bool) -> Tensor:
    """The same matrix from plain differentiable float64 ops (Gram product, the forward's close and
    extreme pairs recomputed from explicit differences, the same denominator floor): the
    twice-differentiable path taken when a backward is run with ``create_graph=True``."""
    xd, yd, cd = x.double(), y.double(), c.double()
    x2, y2 = torch.linalg.vecdot(xd, xd), torch.linalg.vecdot(yd, yd)
    a = (1 - cd * x2).clamp_min(DENOM_FLOOR)
    b = (1 - cd * y2).clamp_min(DENOM_FLOOR)
    s = (x2[:, None] + y2[None] - 2 * (xd @ yd.T)).clamp_min(0)
    if rows.numel():
        diff = xd[rows] - yd[cols]
        s = s.index_put((rows, cols), torch.linalg.vecdot(diff, diff))
    w = cd * s / (a[:, None] * b[None])
    # w = 0 (x_i = y_j): sqrt's derivative is infinite there; the clamp makes it a zero subgradient
    d = (2 / cd.sqrt()) * torch.asinh(w.clamp_min(_TINY64).sqrt())
    if same:
        d = d.masked_fill(torch.eye(d.shape[0], dtype=torch.bool, device=d.device), 0.0)
    return d


def symmetric_enabled() -> bool:
    """False when ``PML_HYPERBOLIC_SYMMETRIC=0``: x is y then takes the general path too."""
    return _native.switched_on("PML_HYPERBOLIC_SYMMETRIC")


def _symmetric_block_rows(n: int, threads: int) -> int:
    """Rows per block of the triangular Gram product: each block of rows i0:i1 multiplies only the
    columns i0: (the part on and above the diagonal), about half the flops of one full product. A
    multiple of the native tail's band height (16): 128 to 384 rows on one thread. The height is
    part of the result: MKL's product for a row block can round differently in the last bits for
    another height, so changing it changes the numbers a seeded run prints.

    With several threads only three blocks (67% of a full product's flops): each product is a
    parallel region whose barrier waits for a descheduled thread when the machine turns busy."""
    if threads > 1:
        return (-(-n // 3) // 16 + 1) * 16
    return min(max(128, (n // 8) // 16 * 16), 384)


def _symmetric_forward(x: Tensor, x2: Tensor, inv_a: Tensor, cf: float, keep_S: bool,
                       row_vectors: tuple | None = None):
    """The forward for x is y on CPU through the native symmetric tail
    (:func:`pml_hyperbolic._native.symmetric_distance_tail`): the Gram product x xᵀ only on and
    above the diagonal (row blocks, written straight into the output), then one tiled pass that
    evaluates every unordered pair once and mirrors it. The closeness test is the one of
    :func:`_gram_W` (‖x_i − x_j‖² < f(‖x_i‖² + ‖x_j‖²), the same f), applied to
    s = ‖x_i‖² + ‖x_j‖² − 2 x_i·x_j; its pairs are recomputed from explicit differences in float64.
    Returns (D, S, rows, cols, w_close), or None when this path does not apply (not CPU float32 /
    float64, no native library, or a float32 batch with more than ``_MAX_CLOSE_FRACTION`` close
    pairs, which the general path redoes in float64); nothing is then kept. ``row_vectors``: the
    tail's (x2, 2c·inv_a, inv_a) in x's dtype when the caller has them (from the native row terms)."""
    n, dim = x.shape
    dtype = x.dtype
    if (x.device.type != "cpu" or dtype not in (torch.float32, torch.float64) or n < 2
            or not _native.enabled() or not symmetric_enabled() or _native.status() != "native"):
        return None
    G = torch.empty(n, n, dtype=dtype)
    S = _take_scratch(G) if keep_S else None
    factor = _gram_error(dtype, dim + 2) / _TARGET_REL_ERROR[dtype]
    if row_vectors is None:
        row_vectors = (x2.to(dtype), ((2.0 * cf) * inv_a).to(dtype), inv_a.to(dtype))
    tail = _native.symmetric_tail_runner(G, S, *row_vectors, 1.0 / math.sqrt(cf), factor)
    n_close = None
    if tail is not None:
        threads, n_close = torch.get_num_threads(), 0
        # 1 thread: each block's tail right after its product, still in cache; several: all
        # products, then one tail split over the threads (a block's tail is too small to share)
        block = _symmetric_block_rows(n, threads)
        for start in range(0, n, block):
            torch.mm(x[start:start + block], x[start:].T, out=G[start:start + block, start:])
            if threads == 1:
                n_close += tail(start, min(n, start + block))
        if threads > 1:
            n_close = tail(0, n, threads=threads)
    if n_close is None or (dtype == torch.float32 and n_close > _MAX_CLOSE_FRACTION * G.numel()):
        if S is not None:
            _give_scratch(S)
        return None
    if n_close:
        rows, cols = torch.nonzero(G < 0, as_tuple=True)
        w_close = _explicit_w(x, x, rows, cols, inv_a, inv_a, cf)
        G[rows, cols] = _dist_from_w(w_close, cf, dtype)
    else:
        rows = cols = torch.zeros(0, dtype=torch.long)
        w_close = x2.new_zeros(0)
    return G, S, rows, cols, w_close


def _extreme_points(x2: Tensor, inv_a: Tensor, dtype: torch.dtype):
    """Indices (or None) of the points kept out of the Gram product: on/outside the boundary or
    closer to it than `project` puts anything (1/a > 1/threshold ⇔ 1 − c‖x‖² < threshold, floored
    ones included), and nonzero points so small that their products underflow."""
    extreme = (inv_a > 1.0 / _EXTREME_A[dtype]) | ((x2 > 0) & (x2 < _TINY_SQ_NORM[dtype]))
    index = torch.nonzero(extreme).squeeze(1)
    return index if index.numel() else None


def _forward_core(x: Tensor, y: Tensor, cf: float, same: bool, keep_S: bool = True):
    """The forward's tensors: D, S (see :func:`_distance_tail`; None without ``keep_S`` or when
    every point is at the origin), the explicit pairs (rows, cols) with their float64 w, the
    float64 row terms, whether every point is at the origin, and whether the native symmetric
    forward ran (:func:`_symmetric_forward`: then S is exactly symmetric)."""
    dtype = x.dtype
    terms = None
    if same and x.device.type == "cpu" and x.shape[0] >= 2:
        # x is y on CPU (PML's compute_mat(emb, emb)): the row terms, the tail's row vectors and
        # the two checks below in one native pass (instead of about ten small torch ops), then the
        # symmetric forward
        terms = _native.row_terms(x, cf, DENOM_FLOOR, extreme=(1.0 / _EXTREME_A[dtype], _TINY_SQ_NORM[dtype]))
        if terms is not None:
            x2, inv_a, row_vectors, any_nonzero, any_extreme = terms
            if any_nonzero and not any_extreme:
                done = _symmetric_forward(x, x2, inv_a, cf, keep_S, row_vectors)
                if done is not None:
                    return (*done, x2, inv_a, x2, inv_a, False, True)
    if terms is None:
        x2, inv_a = _row_terms(x, cf)
    y2, inv_b = (x2, inv_a) if same else _row_terms(y, cf)
    if x.shape[0] == 0 or y.shape[0] == 0:
        empty = x.new_zeros(x.shape[0], y.shape[0])
        no_pairs = torch.zeros(0, dtype=torch.long, device=x.device)
        return empty, empty, no_pairs, no_pairs, x2.new_zeros(0), x2, inv_a, y2, inv_b, False, False
    if not (bool((x2 != 0).any()) or bool((y2 != 0).any())):  # (NaN != 0: NaN input is not 'at the origin')
        # every point at the origin: D = 0 and, with the zero subgradient at x_i = y_j, so is
        # every gradient (also a fast path: aten's sqrt is slow on zeros)
        zeros = x.new_zeros(x.shape[0], y.shape[0])
        no_pairs = torch.zeros(0, dtype=torch.long, device=x.device)
        return zeros, None, no_pairs, no_pairs, x2.new_zeros(0), x2, inv_a, y2, inv_b, True, False
    # Extreme points: out of the Gram product, all their pairs explicit (they must not touch the
    # other pairs).
    ext_x = _extreme_points(x2, inv_a, dtype)
    ext_y = ext_x if same else _extreme_points(y2, inv_b, dtype)
    if same and ext_x is None:
        done = _symmetric_forward(x, x2, inv_a, cf, keep_S)
        if done is not None:
            return (*done, x2, inv_a, y2, inv_b, False, True)
    gram = _gram_W if ext_x is None and ext_y is None else functools.partial(
        _gram_regular, ext_x=ext_x, ext_y=ext_y)
    W, bound = gram(x, y, x2, inv_a, y2, inv_b, cf, dtype)
    rows, cols, row_min = _close_pairs(W, bound, same, with_row_min=True)
    if dtype == torch.float32 and rows.numel() > _MAX_CLOSE_FRACTION * W.numel():
        W64, bound64 = gram(x, y, x2, inv_a, y2, inv_b, cf, torch.float64)
        rows, cols, row_min = _close_pairs(W64, bound64, same, with_row_min=True)
        W = W64.to(dtype)
    if ext_x is not None or ext_y is not None:
        ext_rows, ext_cols = _extreme_pairs(x.shape[0], y.shape[0], ext_x, ext_y, same, x.device)
        rows, cols = torch.cat([rows, ext_rows]), torch.cat([cols, ext_cols])
    if rows.numel():
        w_close = _explicit_w(x, y, rows, cols, inv_a, inv_b, cf)
    else:  # (the common case: seven small ops on empty tensors skipped)
        w_close = x2.new_zeros(0)
    S = _distance_tail(W, cf, inv_b.to(dtype), row_min, keep_S)  # (the explicit pairs' S is never read)
    d = W
    if rows.numel():  # explicit pairs: D from their float64 w
        d[rows, cols] = _dist_from_w(w_close, cf, dtype)
    if same:  # the Gram product and the per-pair closeness test are not symmetric: mirror
        _mirror_upper_tiled_(d)
    return d, S, rows, cols, w_close, x2, inv_a, y2, inv_b, False, False


def _sum_of_products(a: Tensor, b: Tensor, rows: int = 128) -> Tensor:
    r""":math:`\sum_{ij} a_{ij} b_{ij}` in float64, the same whatever the thread count: float32 products
    summed per row (one thread per row), the row sums added in float64, by blocks of ``rows`` rows.

    Why not ``torch.vdot``: one float32 reduction over N·M terms loses ~1e-4 relative at 4096² and
    its order depends on the number of threads, which :func:`_kernel_threads` chooses by load; the
    curvature's gradient would then differ between two runs of the same seed."""
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[0], rows):
        total += (a[start:start + rows] * b[start:start + rows]).sum(1).double().sum()
    return total


def _kernel_threads(x: Tensor):
    """The CPU threads of one kernel call: the cores no other process holds right now. The row-
    blocked tail is a loop of mid-sized parallel ops; on a busy machine each op's barrier would wait
    for a descheduled thread (see :mod:`pml_hyperbolic.threads`). Nothing to limit on one thread."""
    if x.device.type != "cpu" or torch.get_num_threads() <= 1:
        return contextlib.nullcontext()
    return limited_threads(uncontended_threads())


def _autocast_off(x: Tensor):
    """The kernel runs in its inputs' dtypes: autocast off for the call where it is on."""
    try:
        on = torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4 takes no device type here: switch it off regardless
        on = True
    return torch.autocast(device_type=x.device.type, enabled=False) if on else contextlib.nullcontext()


class PoincarePairwiseDist(torch.autograd.Function):
    """Autograd function behind :func:`pml_hyperbolic.poincare_ball.pairwise_dist`."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, c: Tensor) -> Tensor:
        cf = float(c.detach())
        # PML's compute_mat(emb, emb) passes one tensor twice: its diagonal is exactly 0.
        same = x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
        ctx.same = same
        ctx.same_object = x is y
        with _autocast_off(x), _kernel_threads(x):
            d, S, rows, cols, w_close, x2, inv_a, y2, inv_b, at_origin, symmetric = _forward_core(
                x, y, cf, same, keep_S=any(ctx.needs_input_grad))
        # S is kept as an attribute, not a saved tensor: the backward turns it into E in place
        # (one N×M buffer less, which at 4096² is a 64 MB fresh allocation, page faults included)
        # and a second backward (retain_graph) recomputes it.
        ctx.S = S
        ctx.symmetric_S = symmetric  # S exactly symmetric (the native symmetric forward)
        ctx.all_at_origin = at_origin
        ctx.save_for_backward(x, y, c, d if ctx.needs_input_grad[2] else None, rows, cols, w_close,
                              x2, inv_a, y2, inv_b)
        return d

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y, c, d, rows, cols, w_close, x2, inv_a, y2, inv_b = ctx.saved_tensors
        need_x, need_y, need_c = ctx.needs_input_grad
        if x.shape[0] == 0 or y.shape[0] == 0:
            return (torch.zeros_like(x) if need_x else None, torch.zeros_like(y) if need_y else None,
                    torch.zeros_like(c) if need_c else None)
        if torch.is_grad_enabled():  # create_graph=True (a gradient penalty): differentiable path
            return PoincarePairwiseDist._backward_create_graph(ctx, grad, x, y, c, rows, cols)
        if ctx.all_at_origin:  # D ≡ 0 (see _forward_core)
            return (torch.zeros_like(x) if need_x else None,
                    torch.zeros_like(y) if need_y and not (ctx.same_object and need_x) else None,
                    torch.zeros_like(c) if need_c else None)
        S, ctx.S = ctx.S, None  # consumed (overwritten by E) below
        if S is None:  # a second backward through the same graph (retain_graph=True)
            with torch.no_grad(), torch.autocast(device_type=x.device.type, enabled=False), _kernel_threads(x):
                core = _forward_core(x, y, float(c.detach()), ctx.same)
                S, ctx.symmetric_S = core[1], core[10]
        with torch.no_grad(), _kernel_threads(x):
            return PoincarePairwiseDist._backward_closed_form(ctx, grad, x, y, c, S, d, rows, cols, w_close,
                                                              x2, inv_a, y2, inv_b)

    @staticmethod
    def _backward_create_graph(ctx, grad, x, y, c, rows, cols):
        need_x, need_y, need_c = ctx.needs_input_grad
        combined = ctx.same_object and need_x and need_y
        d = _composite_dist(x, x if ctx.same_object else y, c, rows, cols, ctx.same)
        wanted = [(x, need_x), (y, need_y and not combined), (c, need_c)]
        targets = [t for t, need in wanted if need]
        grads = iter(torch.autograd.grad(d, targets, grad.to(d.dtype), create_graph=True, allow_unused=True))
        out = [next(grads) if need else None for _, need in wanted]
        out = [torch.zeros_like(t) if need and g is None else g for (t, need), g in zip(wanted, out)]
        return tuple(out)

    @staticmethod
    def _backward_closed_form(ctx, grad, x, y, c, S, d, rows, cols, w_close, x2, inv_a, y2, inv_b):
        need_x, need_y, need_c = ctx.needs_input_grad
        dtype = S.dtype
        combined = ctx.same_object and need_x and need_y
        with torch.autocast(device_type=x.device.type, enabled=False):
            grad = grad.to(dtype)
            cf = float(c.detach())
            sqrt_c = math.sqrt(cf)
            # E' = U/S = E/sqrt2 (undone in `scale` below), in S's buffer. Inf/NaN only where
            # S = 0: the diagonal, close pairs and pairs of two points at the origin, all zeroed
            # next (their gradient terms are 0 or added back explicitly).
            # x is y, both gradients wanted, S symmetric from the native forward: E' + E'ᵀ =
            # (U + Uᵀ)/S in one tiled pass (no E' then transposed copies), diagonal 0
            symmetric = combined and ctx.symmetric_S and _native.symmetric_gradient_weights(grad, S, torch.get_num_threads())
            if ctx.symmetric_S and not symmetric:  # the symmetric forward filled S above the diagonal only
                S = _mirror_upper_(S)
            E = S if symmetric else torch.div(grad, S, out=S)
            if ctx.same and not symmetric:  # x_i = y_i: both terms of the gradient are 0 there
                E.diagonal().zero_()
            at_origin_x = torch.nonzero(x2 == 0).squeeze(1)
            at_origin_y = at_origin_x if ctx.same else torch.nonzero(y2 == 0).squeeze(1)
            if at_origin_x.numel() and at_origin_y.numel():  # (cost ∝ the rows at the origin)
                E.index_copy_(0, at_origin_x, E.index_select(0, at_origin_x).index_fill_(1, at_origin_y, 0.0))
            n_close = rows.numel()
            if n_close:
                u_close = grad[rows, cols]
                E[rows, cols] = 0
                u64 = u_close.double()
                F64 = u64 * torch.sqrt(w_close / (1 + w_close))  # true scale
                F_close = F64.to(dtype)
                # a point whose denominator is floored (on/outside the boundary) has a constant a:
                # no F term for it (its 1/a = 2^60 exactly; an unfloored one is at most 2^53)
                F_row_close = torch.where(inv_a[rows] < 2.0 ** 60, F64, 0.0).to(dtype)
                F_col_close = torch.where(inv_b[cols] < 2.0 ** 60, F64, 0.0).to(dtype)
                coef = (2 * u64 / torch.sqrt((1 + w_close) / (inv_a[rows] * inv_b[cols]))).to(dtype)
                diff = x[rows] - y[cols]
                norm = torch.linalg.vector_norm(diff, dim=1)
                # x_i = y_j: the direction is undefined, the (sub)gradient is 0.
                inv_norm = torch.where(norm > 0, norm.reciprocal(), torch.zeros_like(norm))
                explicit = diff * (coef * inv_norm)[:, None]
            p = (cf * inv_a).to(dtype)
            q_c = (cf * inv_b).to(dtype)  # c/b
            x2d, y2d = x2.to(dtype), y2.to(dtype)
            dim = x.shape[1]
            gx = gy = gc = None
            row_F = col_F = None
            if combined:
                # x is y: ∇ = ∇_x + ∇_y = (E + E^T) A (weights 1/a = 1/b), E + E^T formed in place
                # by tiles (one product instead of E A + E^T A)
                A = _augmented(x, x2, inv_a, dtype, pad=True)
                Z = (E if symmetric else _symmetrize_(E)) @ A
                both_F = _SQRT2 * _folded_F(Z, x, x2d, p)
                if need_c:
                    total_F = both_F.double().sum() / 2 + (F_close.double().sum() if n_close else 0.0)
                if n_close:
                    both_F.index_add_(0, rows, F_row_close).index_add_(0, cols, F_col_close)
                scale = (2.0 * sqrt_c * _SQRT2) * inv_a.to(dtype)
                gx = scale[:, None] * (x * (Z[:, dim] + both_F / _SQRT2)[:, None] - Z[:, :dim])
                if n_close:
                    gx.index_add_(0, rows, explicit).index_add_(0, cols, -explicit)
                row_F, col_F = both_F, None
            else:
                if need_x or need_c:
                    R = E @ _augmented(y, y2, inv_b, dtype, pad=True)
                    row_F = _SQRT2 * _folded_F(R, x, x2d, p)
                    if need_c:
                        total_F = row_F.double().sum() + (F_close.double().sum() if n_close else 0.0)
                    if n_close:
                        row_F.index_add_(0, rows, F_row_close)
                    if need_x:
                        scale = (2.0 * sqrt_c * _SQRT2) * inv_a.to(dtype)
                        gx = scale[:, None] * (x * (R[:, dim] + row_F / _SQRT2)[:, None] - R[:, :dim])
                        if n_close:
                            gx.index_add_(0, rows, explicit)
                if need_y or need_c:
                    C = E.T @ _augmented(x, x2, inv_a, dtype, pad=True)
                    col_F = _SQRT2 * _folded_F(C, y, y2d, q_c)
                    if n_close:
                        col_F.index_add_(0, cols, F_col_close)
                    if need_y:
                        scale = (2.0 * sqrt_c * _SQRT2) * inv_b.to(dtype)
                        gy = scale[:, None] * (y * (C[:, dim] + col_F / _SQRT2)[:, None] - C[:, :dim])
                        if n_close:
                            gy.index_add_(0, cols, -explicit)
            if need_c:
                # Σ U ∂D/∂c = −Σ U D/(2c) + (1/√c)[Σ F/c + Σ_i ‖x_i‖²/a_i F_i· + Σ_j ‖y_j‖²/b_j F_·j]
                # (total_F, the sum of all F, was taken before the floored points' F were dropped)
                if combined:  # both_F = row sums + column sums of F (x = y)
                    weighted = (x2 * inv_a * both_F.double()).sum()
                else:
                    weighted = (x2 * inv_a * row_F.double()).sum() + (y2 * inv_b * col_F.double()).sum()
                total = -_sum_of_products(grad, d) / (2 * cf) + (
                    total_F / cf + weighted) / sqrt_c
                gc = total.to(c.dtype).reshape(c.shape)
            _give_scratch(E)  # E (S's buffer) is not read past this point
        return gx, (None if combined else gy), gc


def poincare_pairwise_dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """N×D, M×D (same float dtype), 0-d c → N×M distance matrix."""
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"pairwise_dist expects 2-D inputs, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"embedding dimensions differ: {x.shape[1]} vs {y.shape[1]}")
    return PoincarePairwiseDist.apply(x, y, c)
