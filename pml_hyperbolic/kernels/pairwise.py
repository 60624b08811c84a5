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
:mod:`pml_hyperbolic.kernels.native`) the whole tail is instead ONE fused native pass with its own
vectorised log1p (within an ulp). Every point at the origin: D = 0 directly.

Symmetric forward (x is y on CPU, the call of PML's losses: ``compute_mat(emb, emb)``): the
matrix is symmetric, so :func:`_symmetric_forward` computes the Gram product x xᵀ only on and
above the diagonal (row blocks written straight into the output) and the native symmetric tail
evaluates each unordered pair once and mirrors it (S, kept for the backward, only above the
diagonal); the backward's weights E + Eᵀ = (U + Uᵀ)/S then come from one native pass (S is exactly
symmetric). Same closeness test, same explicit recomputation of close pairs; any case it does not
cover (no native library, extreme points, GPU, a collapsed float32 batch) takes the general path.
``PML_HYPERBOLIC_SYMMETRIC=0`` turns it off.

General forward (x is not y on CPU, no extreme point): one Gram product x yᵀ, then one native pass
(:func:`_general_forward`) that applies the closeness test below to s = ‖x_i‖² + ‖y_j‖² − 2 x_i·y_j,
evaluates D and S, and marks the close pairs for their explicit recomputation: the augmented product's
scaling and the prefilter's row minimum need no pass of their own. ``PML_HYPERBOLIC_GENERAL=0`` turns
it off (the augmented product, the torch prefilter and the plain tail).

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

from . import native as _native
from .gram import (_EXTREME_A, _MAX_CLOSE_FRACTION, _SQRT2, _TINY64, _TINY_SQ_NORM, DENOM_FLOOR, _augmented,
                   _close_pairs, _dist_from_w, _explicit_w, _extreme_pairs, _extreme_points,
                   _gram_regular, _gram_W, _row_terms)
from .tail import (_distance_tail, _folded_F, _general_forward, _give_scratch, _mirror_upper_, _mirror_upper_tiled_,
                   _symmetric_forward, _symmetrize_, general_enabled)
from .threads import limited_threads, uncontended_threads

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
    if not same and ext_x is None and ext_y is None and general_enabled():
        done = _general_forward(x, y, x2, inv_a, y2, inv_b, cf, keep_S)
        if done is not None:
            return (*done, x2, inv_a, y2, inv_b, False, False)
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


def _sum_of_products(a: Tensor, b: Tensor, elements: int = 1 << 20) -> Tensor:
    r""":math:`\sum_{ij} a_{ij} b_{ij}` in float64, the same whatever the thread count: float32 products
    summed per row (``vecdot``, one thread per row), the row sums added in float64, by blocks of rows
    of at most ``elements`` entries (one block at PML's batch sizes: each block is a few small ops).

    Why not ``torch.vdot``: one float32 reduction over N·M terms loses ~1e-4 relative at 4096² and
    its order depends on the number of threads, which :func:`_kernel_threads` chooses by load; the
    curvature's gradient would then differ between two runs of the same seed."""
    rows = max(1, elements // max(1, a.shape[1]))
    total = torch.zeros((), dtype=torch.float64, device=a.device)
    for start in range(0, a.shape[0], rows):
        total += torch.linalg.vecdot(a[start:start + rows], b[start:start + rows], dim=1).double().sum()
    return total


def _kernel_threads(x: Tensor):
    """The CPU threads of one kernel call: the cores no other process holds right now. The row-
    blocked tail is a loop of mid-sized parallel ops; on a busy machine each op's barrier would wait
    for a descheduled thread (see :mod:`pml_hyperbolic.kernels.threads`). Nothing to limit on one thread."""
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


class Flags(NamedTuple):
    """The forward's facts the backward needs (carried as a small int64 CPU tensor through the op)."""

    same: bool  # x and y are the same memory (the diagonal is exactly 0)
    at_origin: bool  # every point at the origin: D and every gradient are 0
    symmetric: bool  # the native symmetric forward ran: S is exactly symmetric, filled above the diagonal


def forward(x: Tensor, y: Tensor, c: Tensor, keep_S: bool):
    """The distance matrix and what its backward needs: ``(d, S, rows, cols, w_close, x2, inv_a, y2,
    inv_b, flags)`` (S is None without ``keep_S`` or when every point is at the origin; ``flags`` a
    :class:`Flags`)."""
    cf = float(c.detach())
    # PML's compute_mat(emb, emb) passes one tensor twice: its diagonal is exactly 0.
    same = x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
    with torch.no_grad(), _autocast_off(x), _kernel_threads(x):
        d, S, rows, cols, w_close, x2, inv_a, y2, inv_b, at_origin, symmetric = _forward_core(
            x, y, cf, same, keep_S=keep_S)
    return d, S, rows, cols, w_close, x2, inv_a, y2, inv_b, Flags(same, at_origin, symmetric)


def backward(grad: Tensor, x: Tensor, y: Tensor, c: Tensor, d: Tensor | None, rows: Tensor, cols: Tensor,
             w_close: Tensor, x2: Tensor, inv_a: Tensor, y2: Tensor, inv_b: Tensor, flags: Flags, S: Tensor | None,
             same_object: bool, need: tuple[bool, bool, bool]):
    """The closed-form gradients ``(gx, gy, gc)`` (None where not ``need``ed; ``gy`` None also when
    ``same_object`` and both are needed: ``gx`` then holds both terms). ``S`` from :func:`forward` is
    consumed (overwritten, then kept as scratch for the next call); None recomputes it."""
    need_x, need_y, need_c = need
    combined = same_object and need_x and need_y
    if x.shape[0] == 0 or y.shape[0] == 0 or flags.at_origin:  # nothing to differentiate, or D ≡ 0
        return (torch.zeros_like(x) if need_x else None, torch.zeros_like(y) if need_y and not combined else None,
                torch.zeros_like(c) if need_c else None)
    symmetric_S = flags.symmetric
    with torch.no_grad(), _kernel_threads(x):
        if S is None:  # a second backward through the same graph (retain_graph=True), or a traced graph
            with torch.autocast(device_type=x.device.type, enabled=False):
                core = _forward_core(x, y, float(c.detach()), flags.same)
            S, symmetric_S = core[1], core[10]
        return _closed_form(grad, x, y, c, S, d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags.same,
                            symmetric_S, combined, need)


def create_graph_backward(grad: Tensor, x: Tensor, y: Tensor, c: Tensor, rows: Tensor, cols: Tensor, same: bool,
                          same_object: bool, need: tuple[bool, bool, bool]):
    """The gradients as a differentiable graph (``create_graph=True``: gradient penalties), from
    :func:`_composite_dist` with the forward's close and extreme pairs."""
    need_x, need_y, need_c = need
    combined = same_object and need_x and need_y
    d = _composite_dist(x, x if same_object else y, c, rows, cols, same)
    wanted = [(x, need_x), (y, need_y and not combined), (c, need_c)]
    targets = [t for t, want in wanted if want]
    grads = iter(torch.autograd.grad(d, targets, grad.to(d.dtype), create_graph=True, allow_unused=True))
    out = [next(grads) if want else None for _, want in wanted]
    return tuple(torch.zeros_like(t) if want and g is None else g for (t, want), g in zip(wanted, out))


def _closed_form(grad, x, y, c, S, d, rows, cols, w_close, x2, inv_a, y2, inv_b, same: bool, symmetric_S: bool,
                 combined: bool, need):
    """The closed-form backward of the module docstring (E in S's buffer)."""
    need_x, need_y, need_c = need
    dtype = S.dtype
    with torch.autocast(device_type=x.device.type, enabled=False):
        grad = grad.to(dtype)
        cf = float(c.detach())
        sqrt_c = math.sqrt(cf)
        # E' = U/S = E/sqrt2 (undone in `scale` below), in S's buffer. Inf/NaN only where
        # S = 0: the diagonal, close pairs and pairs of two points at the origin, all zeroed
        # next (their gradient terms are 0 or added back explicitly).
        # x is y, both gradients wanted, S symmetric from the native forward: E' + E'ᵀ =
        # (U + Uᵀ)/S in one tiled pass (no E' then transposed copies), diagonal 0
        symmetric = combined and symmetric_S and _native.symmetric_gradient_weights(grad, S, torch.get_num_threads())
        if symmetric_S and not symmetric:  # the symmetric forward filled S above the diagonal only
            S = _mirror_upper_(S)
        E = S if symmetric else torch.div(grad, S, out=S)
        if same and not symmetric:  # x_i = y_i: both terms of the gradient are 0 there
            E.diagonal().zero_()
        at_origin_x = torch.nonzero(x2 == 0).squeeze(1)
        at_origin_y = at_origin_x if same else torch.nonzero(y2 == 0).squeeze(1)
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
