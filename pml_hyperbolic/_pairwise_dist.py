r"""Fused all-pairs Poincaré distance with a closed-form backward.

With :math:`a_i = 1 - c\|x_i\|^2`, :math:`b_j = 1 - c\|y_j\|^2`, :math:`s_{ij} = \|x_i - y_j\|^2`

.. math:: w_{ij} = \frac{c\, s_{ij}}{a_i b_j}, \qquad
          D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{w_{ij}}
          = \frac{1}{\sqrt c}\operatorname{log1p}\!\big(2w_{ij} + 2\sqrt{w_{ij}(1+w_{ij})}\big).

Forward. :math:`W = 2w` comes out of ONE matrix product of augmented rows
:math:`[-4p_i x_i,\; 2p_i\|x_i\|^2,\; 2p_i]\cdot[q_j y_j,\; q_j,\; q_j\|y_j\|^2]` with
:math:`p = c/a`, :math:`q = 1/b` (row norms in float64). Then
:math:`S = \sqrt{W + W^2/2} = \sqrt2\sqrt{w(1+w)}` (saved for the backward) and
:math:`D = \operatorname{log1p}(W + \sqrt2 S)/\sqrt c`: a few elementwise passes, all vectorised
(aten's ``asinh``/``acosh`` are scalar libm calls, 10-20× slower here). aten's ``log1p_`` was chosen by
measurement on torch 2.14: 2.2× faster than a log-based rebuild and 3× more accurate
(``python bench/distance.py --log1p`` prints the comparison for the installed torch).

A Gram product loses the small differences of nearby points: its absolute error on :math:`w_{ij}`
is about :math:`\varepsilon_g\, p_i q_j (\|x_i\|^2 + \|y_j\|^2)`. Pairs whose :math:`w` is below a
per-row bound derived from that error (``_TARGET_REL_ERROR``) are recomputed from explicit
differences :math:`x_i - y_j`. In float32, if more than 1/16 of all pairs are close (a collapsed
batch), the whole product is redone in float64 instead, which needs the fix only for
near-duplicates. When ``x`` is ``y`` the diagonal is set to exactly 0. Memory is O(NM + ND); no
N×M×D tensor is built.

Extreme points. :math:`1 - c\|x\|^2` is floored at ``DENOM_FLOOR`` = 2⁻⁶⁰ (only points on or
outside the boundary reach it). Points with :math:`1 - c\|x\|^2` below ``_EXTREME_A`` (nearer the
boundary than ``project`` puts anything) enter the product with weight 0 and stay out of the
error bound (one such point used to inflate every row's bound to inf and NaN the close-pair
search, corrupting valid pairs); all their pairs are computed explicitly, in float64. Their
gradient treats a floored denominator as the constant it is (as ``dist`` does).

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
gradients add up: :math:`(E + E^\top)A`, computed as :math:`EA + E^\top A`. Close pairs are taken out of :math:`E` and
added back sparsely in bounded explicit form: :math:`2U_{ij}\,(x_i - y_j)/(\|x_i - y_j\|
\sqrt{a_i b_j(1+w_{ij})})` (0 at :math:`x_i = y_j`, no NaN from the diagonal) plus their
:math:`F_{ij}`. For the curvature

.. math:: \frac{\partial D_{ij}}{\partial c} = -\frac{D_{ij}}{2c} + \frac{1}{\sqrt c}
          \sqrt{\frac{w_{ij}}{1+w_{ij}}}\Big(\frac1c + \frac{\|x_i\|^2}{a_i} + \frac{\|y_j\|^2}{b_j}\Big).
"""
from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

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
_TINY64 = torch.finfo(torch.float64).tiny


def _gram_error(dtype: torch.dtype, dim: int) -> float:
    """Relative error bound of a length-``dim`` dot product (random-walk accumulation, ×2)."""
    return 2.0 * math.sqrt(dim) * torch.finfo(dtype).eps


def _row_terms(x: Tensor, c: float):
    """Float64 row quantities: ‖x‖² and 1/(1 − c‖x‖²) (floored at :data:`DENOM_FLOOR`: never a
    division by zero)."""
    xd = x.double()
    x2 = torch.linalg.vecdot(xd, xd)
    inv_a = (1.0 - c * x2).clamp_min_(DENOM_FLOOR).reciprocal_()
    return x2, inv_a


def _augmented(x: Tensor, x2: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Rows ``[scale·x, scale, scale·‖x‖²]`` in ``dtype`` (the right factor of the backward products)."""
    n, dim = x.shape
    out = torch.empty(n, dim + 2, dtype=dtype, device=x.device)
    torch.mul(x.to(dtype), scale.to(dtype)[:, None], out=out[:, :dim])
    out[:, dim] = scale
    out[:, dim + 1] = scale * x2
    return out


def _gram_W(x, y, x2, inv_a, y2, inv_b, c: float, dtype):
    """W = 2w = 2c‖x−y‖²/(ab) from one augmented matrix product, plus the per-row closeness bound.

    (Extreme points enter with 1/a = 0, i.e. out of the bound; see :func:`_gram_regular`.)"""
    p2 = (2.0 * c) * inv_a
    dim = x.shape[1]
    left = _augmented(x, x2, -2.0 * p2, dtype)  # [-4p x, -2p, -2p‖x‖²] -> fix the last two
    left[:, dim] = p2 * x2
    left[:, dim + 1] = p2
    right = _augmented(y, y2, inv_b, dtype)  # [q y, q, q‖y‖²]
    W = left @ right.T  # 2p q (‖x‖² + ‖y‖² − 2 x·y)
    factor = _gram_error(dtype, dim + 2) / _TARGET_REL_ERROR[dtype]
    # Upper bound of 2 p_i max_j q_j (‖x_i‖² + ‖y_j‖²): the Gram error scale of row i of W.
    bound = factor * p2 * (x2 * inv_b.max() + (inv_b * y2).max())
    return W, bound.to(dtype)


def _gram_regular(x, y, x2, inv_a, y2, inv_b, c: float, dtype, ext_x, ext_y):
    """:func:`_gram_W` with the extreme rows ``ext_x`` / columns ``ext_y`` (index tensors or None)
    left out: their 1/a is 0 in the product and the bound, their entries of W are +inf (never
    "close"); the caller computes all their pairs explicitly."""
    if ext_x is not None:
        inv_a = inv_a.index_fill(0, ext_x, 0.0)
    if ext_y is not None:
        inv_b = inv_b.index_fill(0, ext_y, 0.0)
    W, bound = _gram_W(x, y, x2, inv_a, y2, inv_b, c, dtype)
    if ext_x is not None:
        W.index_fill_(0, ext_x, float("inf"))
    if ext_y is not None:
        W.index_fill_(1, ext_y, float("inf"))
    return W, bound


def _close_pairs(W: Tensor, bound: Tensor, same: bool):
    """Indices of the pairs the Gram product cannot resolve (excluding the diagonal if ``same``).

    A per-row minimum first keeps the full-matrix compare and ``nonzero`` to the few rows that
    have a close pair at all. With ``same`` the diagonal is written as exactly 0.
    """
    if same:
        W.diagonal().fill_(float("inf"))
    candidates = torch.nonzero(W.amin(1) <= bound).squeeze(1)
    if candidates.numel() == 0:
        rows = cols = candidates
    elif candidates.numel() == W.shape[0]:
        rows, cols = torch.nonzero(W <= bound[:, None], as_tuple=True)
    else:
        sub_rows, cols = torch.nonzero(W[candidates] <= bound[candidates, None], as_tuple=True)
        rows = candidates[sub_rows]
    if same:
        W.diagonal().zero_()
    return rows, cols


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


class PoincarePairwiseDist(torch.autograd.Function):
    """Autograd function behind :func:`pml_hyperbolic.poincare_ball.pairwise_dist`."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, c: Tensor) -> Tensor:
        dtype = x.dtype
        cf = float(c.detach())
        # PML's compute_mat(emb, emb) passes one tensor twice: its diagonal is exactly 0.
        same = x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
        ctx.same = same
        ctx.same_object = x is y
        with torch.autocast(device_type=x.device.type, enabled=False):
            x2, inv_a = _row_terms(x, cf)
            y2, inv_b = (x2, inv_a) if same else _row_terms(y, cf)
            if x.shape[0] == 0 or y.shape[0] == 0:
                empty = x.new_zeros(x.shape[0], y.shape[0])
                ctx.save_for_backward(x, y, c, empty, empty, None, None, None, x2, inv_a, y2, inv_b)
                return empty
            # Points on/outside the boundary (or closer to it than `project` puts anything): out of
            # the Gram product, all their pairs explicit (they must not touch the other pairs).
            # (1/a > 1/threshold ⇔ 1 − c‖x‖² < threshold, floored ones included)
            ext_x = torch.nonzero(inv_a > 1.0 / _EXTREME_A[dtype]).squeeze(1)
            ext_y = ext_x if same else torch.nonzero(inv_b > 1.0 / _EXTREME_A[dtype]).squeeze(1)
            ext_x = ext_x if ext_x.numel() else None
            ext_y = ext_y if ext_y.numel() else None
            gram = _gram_W if ext_x is None and ext_y is None else functools.partial(
                _gram_regular, ext_x=ext_x, ext_y=ext_y)
            W, bound = gram(x, y, x2, inv_a, y2, inv_b, cf, dtype)
            rows, cols = _close_pairs(W, bound, same)
            if dtype == torch.float32 and rows.numel() > _MAX_CLOSE_FRACTION * W.numel():
                W64, bound64 = gram(x, y, x2, inv_a, y2, inv_b, cf, torch.float64)
                rows, cols = _close_pairs(W64, bound64, same)
                W = W64.to(dtype)
            n_gram_close = rows.numel()
            if ext_x is not None or ext_y is not None:
                ext_rows, ext_cols = _extreme_pairs(x.shape[0], y.shape[0], ext_x, ext_y, same, x.device)
                rows, cols = torch.cat([rows, ext_rows]), torch.cat([cols, ext_cols])
            if rows.numel():
                # float64: w of a pair with a floored denominator can exceed float32's range
                w_close = (cf * inv_a[rows] * inv_b[cols]) * _explicit_sq_diff(x, y, rows, cols).double()
                W[rows, cols] = (2.0 * w_close).to(dtype)
            else:
                w_close = x2.new_zeros(0)
            # S = sqrt(W + W²/2) = sqrt2·sqrt(w(1+w)); D = log1p(W + sqrt2·S)/sqrt(c). In place;
            # finite and exactly 0 at W = 0 (no rsqrt, whose Inf at 0 would need patching).
            S = torch.addcmul(W, W, W, value=0.5).sqrt_()
            d = W.add_(S, alpha=_SQRT2).log1p_()  # aten's log1p: fastest and most accurate here (bench/distance.py --log1p)
            if cf != 1.0:
                d.mul_(1.0 / math.sqrt(cf))
            if rows.numel() > n_gram_close:  # extreme pairs: D in float64 (their W may overflow)
                w_ext = w_close[n_gram_close:]
                d[rows[n_gram_close:], cols[n_gram_close:]] = (
                    (2.0 / math.sqrt(cf)) * torch.asinh(w_ext.sqrt())).to(dtype)
        ctx.save_for_backward(x, y, c, S, d if ctx.needs_input_grad[2] else None, rows, cols, w_close,
                              x2, inv_a, y2, inv_b)
        return d

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, y, c, S, d, rows, cols, w_close, x2, inv_a, y2, inv_b = ctx.saved_tensors
        need_x, need_y, need_c = ctx.needs_input_grad
        if S.numel() == 0:
            return (torch.zeros_like(x) if need_x else None, torch.zeros_like(y) if need_y else None,
                    torch.zeros_like(c) if need_c else None)
        if torch.is_grad_enabled():  # create_graph=True (a gradient penalty): differentiable path
            return PoincarePairwiseDist._backward_create_graph(ctx, grad, x, y, c, rows, cols)
        with torch.no_grad():
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
            # E' = U/S = E/sqrt2 (undone in `scale` below); Inf/NaN only where S = 0 (diagonal,
            # close pairs), which are overwritten next.
            E = torch.div(grad, S)
            if ctx.same:  # x_i = y_i: both terms of the gradient are 0 there
                E.diagonal().zero_()
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
                # x is y: ∇ = ∇_x + ∇_y = (E + E^T) A (weights 1/a = 1/b). For large matrices as
                # two products (BLAS reads E^T in place), since forming E + E^T is a cache-hostile
                # transpose: at 4096 × 4096 measured 61 ms against 26 ms for the second product;
                # at 900 × 900 the two ways cost the same
                A = _augmented(x, x2, inv_a, dtype)
                Z = torch.addmm(E.T @ A, E, A) if E.numel() >= (1 << 22) else torch.add(E, E.T) @ A
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
                    R = E @ _augmented(y, y2, inv_b, dtype)
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
                    C = E.T @ _augmented(x, x2, inv_a, dtype)
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
                total = -torch.vdot(grad.reshape(-1), d.reshape(-1)).double() / (2 * cf) + (
                    total_F / cf + weighted) / sqrt_c
                gc = total.to(c.dtype).reshape(c.shape)
        return gx, (None if combined else gy), gc


def poincare_pairwise_dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """N×D, M×D (same float dtype), 0-d c → N×M distance matrix."""
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"pairwise_dist expects 2-D inputs, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"embedding dimensions differ: {x.shape[1]} vs {y.shape[1]}")
    return PoincarePairwiseDist.apply(x, y, c)
