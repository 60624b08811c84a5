r"""Fused all-pairs Poincaré distance with a closed-form backward.

With :math:`a_i = 1 - c\|x_i\|^2`, :math:`b_j = 1 - c\|y_j\|^2`, :math:`s_{ij} = \|x_i - y_j\|^2`

.. math:: w_{ij} = \frac{c\, s_{ij}}{a_i b_j}, \qquad
          D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{w_{ij}}
          = \frac{1}{\sqrt c}\log\!\big(1 + 2w_{ij} + 2\sqrt{w_{ij}(1+w_{ij})}\big).

Forward. :math:`w` comes out of ONE matrix product of augmented rows
:math:`[p_i\|x_i\|^2,\; p_i,\; -2p_i x_i]\cdot[q_j,\; q_j\|y_j\|^2,\; q_j y_j]` with
:math:`p = c/a`, :math:`q = 1/b` (row norms in float64). A Gram product loses the small
differences of nearby points: its absolute error on :math:`w_{ij}` is about
:math:`\varepsilon_g\, p_i q_j (\|x_i\|^2 + \|y_j\|^2)`. Pairs whose :math:`w` is below a
per-row bound derived from that error (``_CLOSE_FACTOR``) are recomputed from explicit
differences :math:`x_i - y_j`. In float32, if more than 1/16 of all pairs are close (a collapsed
batch), the whole product is redone in float64 instead, which needs the fix only for
near-duplicates. Memory is O(NM + ND); no N×M×D tensor is built.

Backward. With upstream gradient :math:`U` and :math:`E = U/\sqrt{w(1+w)}`,
:math:`F = U\sqrt{w/(1+w)}`:

.. math:: \nabla_{x_i} = \frac{2\sqrt c}{a_i}\Big[x_i\big(\textstyle\sum_j E_{ij} q_j + \sum_j F_{ij}\big)
          - \sum_j E_{ij} q_j y_j\Big]

(symmetric for :math:`y`), i.e. two matrix products. For the close pairs the first term is
replaced by its bounded explicit form :math:`2U_{ij}\,(x_i - y_j)/(\|x_i - y_j\|\sqrt{a_i b_j(1+w_{ij})})`,
which is 0 at :math:`x_i = y_j` (no NaN from the diagonal). For the curvature

.. math:: \frac{\partial D_{ij}}{\partial c} = -\frac{D_{ij}}{2c} + \frac{1}{\sqrt c}
          \sqrt{\frac{w_{ij}}{1+w_{ij}}}\Big(\frac1c + \frac{\|x_i\|^2}{a_i} + \frac{\|y_j\|^2}{b_j}\Big).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Target relative error of w for pairs left to the matrix product (d's relative error is at most
# half of it): float32 4e-5 (spec: 1e-4 on d), float64 4e-11 (spec: 1e-10).
_TARGET_REL_ERROR = {torch.float32: 4e-5, torch.float64: 4e-11}
# Pairs recomputed explicitly are processed in chunks of at most this many elements (K×D).
_CHUNK_ELEMENTS = 1 << 22
# Above this fraction of close pairs a float32 call redoes the product in float64.
_MAX_CLOSE_FRACTION = 1.0 / 16.0


def _gram_error(dtype: torch.dtype, dim: int) -> float:
    """Relative error bound of a length-``dim`` dot product (random-walk accumulation, ×2)."""
    return 2.0 * math.sqrt(dim) * torch.finfo(dtype).eps


def _row_terms(x: Tensor, c64: Tensor):
    """Float64 row quantities: ‖x‖², 1/a = 1/(1 − c‖x‖²)."""
    x2 = x.double().pow(2).sum(1)
    inv_a = 1.0 / (1.0 - c64 * x2).clamp_min(torch.finfo(torch.float64).tiny)
    return x2, inv_a


def _gram_w(x, y, x2, inv_a, y2, inv_b, c64, dtype):
    """w = c‖x−y‖²/(ab) from one augmented matrix product, plus the per-row closeness bound."""
    p = c64 * inv_a
    left = torch.cat([(p * x2)[:, None], p[:, None], -2.0 * p[:, None] * x.double()], 1)
    right = torch.cat([inv_b[:, None], (inv_b * y2)[:, None], inv_b[:, None] * y.double()], 1)
    w = left.to(dtype) @ right.to(dtype).T
    factor = _gram_error(dtype, x.shape[1] + 2) / _TARGET_REL_ERROR[dtype]
    # Upper bound of p_i * max_j q_j (‖x_i‖² + ‖y_j‖²): the Gram error scale of row i.
    bound = factor * p * (x2 * inv_b.max() + (inv_b * y2).max()) if y.shape[0] else p * 0
    return w, bound.to(dtype)


def _close_pairs(w: Tensor, bound: Tensor, same: bool):
    """Indices of the pairs the Gram product cannot resolve (excluding the diagonal if ``same``).

    A per-row minimum first keeps the full-matrix compare and ``nonzero`` (the costliest
    elementwise steps here) to the few rows that have a close pair at all. With ``same`` the
    diagonal is exactly zero and is written directly.
    """
    if same:
        w.diagonal().fill_(float("inf"))
    candidates = torch.nonzero(w.amin(1) <= bound).squeeze(1)
    if candidates.numel() == 0:
        rows = cols = candidates
    elif candidates.numel() == w.shape[0]:
        rows, cols = torch.nonzero(w <= bound[:, None], as_tuple=True)
    else:
        sub_rows, cols = torch.nonzero(w[candidates] <= bound[candidates, None], as_tuple=True)
        rows = candidates[sub_rows]
    if same:
        w.diagonal().zero_()
    return rows, cols


def _explicit_sq_diff(x: Tensor, y: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """‖x_rows − y_cols‖² from explicit differences, chunked to bound memory."""
    out = torch.empty(rows.shape[0], dtype=x.dtype, device=x.device)
    step = max(1, _CHUNK_ELEMENTS // max(1, x.shape[1]))
    for start in range(0, rows.shape[0], step):
        sl = slice(start, start + step)
        out[sl] = (x[rows[sl]] - y[cols[sl]]).pow(2).sum(1)
    return out


class PoincarePairwiseDist(torch.autograd.Function):
    """Autograd function behind :func:`pml_hyperbolic.poincare_ball.pairwise_dist`."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, c: Tensor) -> Tensor:
        dtype = x.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            c64 = c.detach().double()
            x2, inv_a = _row_terms(x, c64)
            y2, inv_b = _row_terms(y, c64)
            # PML's compute_mat(emb, emb) passes one tensor twice: its diagonal is exactly 0.
            same = x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
            w, bound = _gram_w(x, y, x2, inv_a, y2, inv_b, c64, dtype)
            rows, cols = _close_pairs(w, bound, same)
            if dtype == torch.float32 and rows.numel() > _MAX_CLOSE_FRACTION * w.numel():
                w64, bound64 = _gram_w(x, y, x2, inv_a, y2, inv_b, c64, torch.float64)
                rows, cols = _close_pairs(w64, bound64, same)
                w = w64.to(dtype)
            if rows.numel():
                scale = (c64 * inv_a[rows] * inv_b[cols]).to(dtype)
                w[rows, cols] = scale * _explicit_sq_diff(x, y, rows, cols)
            # arsinh(sqrt w) = ½ log1p(2(w + sqrt(w(1+w)))): vectorised ops only (aten's asinh is
            # scalar libm, ~4x slower here), and sqrt(w(1+w)) is reused by the backward.
            root = torch.addcmul(w, w, w).sqrt_()
            d = torch.add(w, root).mul_(2.0).log1p_().mul_(1.0 / math.sqrt(float(c64)))
        ctx.save_for_backward(x, y, c, w, root, d, rows, cols, x2, inv_a, y2, inv_b)
        ctx.same = same
        return d

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor):
        x, y, c, w, root, d, rows, cols, x2, inv_a, y2, inv_b = ctx.saved_tensors
        need_x, need_y, need_c = ctx.needs_input_grad
        dtype = w.dtype
        with torch.autocast(device_type=x.device.type, enabled=False):
            grad = grad.to(dtype)
            c64 = c.detach().double()
            sqrt_c = math.sqrt(float(c64))
            E = torch.div(grad, root)  # U / sqrt(w(1+w)); Inf only at w = 0 (close pairs)
            F = E * w  # U sqrt(w/(1+w)); NaN only at w = 0: a close pair or the diagonal
            if ctx.same:  # x_i = y_i: both terms of the gradient are 0 there
                E.diagonal().zero_()
                F.diagonal().zero_()
            if rows.numel():
                w_close = w[rows, cols]
                u_close = grad[rows, cols]
                E[rows, cols] = 0
                F[rows, cols] = u_close * torch.sqrt(w_close / (1 + w_close))
            row_F, col_F = F.sum(1), F.sum(0)
            gx = gy = gc = None
            if need_x or need_y:
                if rows.numel():
                    ab = (inv_a[rows] * inv_b[cols]).to(dtype).reciprocal()
                    coef = 2 * u_close / torch.sqrt(ab * (1 + w_close))
                    pair_x, pair_y = x[rows], y[cols]
                    diff = pair_x - pair_y
                    norm = torch.linalg.vector_norm(diff, dim=1)
                    # x_i = y_j: the direction is undefined, the (sub)gradient is 0.
                    inv_norm = torch.where(norm > 0, norm.reciprocal(), torch.zeros_like(norm))
                    explicit = diff * (coef * inv_norm)[:, None]
            if need_x:
                ia, ib = inv_a.to(dtype), inv_b.to(dtype)
                R = E @ torch.cat([ib[:, None] * y, ib[:, None]], 1)
                gx = (2 * sqrt_c) * ia[:, None] * (x * (R[:, -1] + row_F)[:, None] - R[:, :-1])
                if rows.numel():
                    gx.index_add_(0, rows, explicit)
            if need_y:
                ia, ib = inv_a.to(dtype), inv_b.to(dtype)
                C = E.T @ torch.cat([ia[:, None] * x, ia[:, None]], 1)
                gy = (2 * sqrt_c) * ib[:, None] * (y * (C[:, -1] + col_F)[:, None] - C[:, :-1])
                if rows.numel():
                    gy.index_add_(0, cols, -explicit)
            if need_c:
                cf = float(c64)
                total = (
                    -(grad * d).sum().double() / (2 * cf)
                    + (
                        row_F.double().sum() / cf
                        + (x2 * inv_a * row_F.double()).sum()
                        + (y2 * inv_b * col_F.double()).sum()
                    )
                    / sqrt_c
                )
                gc = total.to(c.dtype).reshape(c.shape)
        return gx, gy, gc


def poincare_pairwise_dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """N×D, M×D (same float dtype), 0-d c → N×M distance matrix."""
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"pairwise_dist expects 2-D inputs, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"embedding dimensions differ: {x.shape[1]} vs {y.shape[1]}")
    return PoincarePairwiseDist.apply(x, y, c)
