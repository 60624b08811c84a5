r"""The kernels as ``torch.library`` custom ops (namespace ``pml_hyperbolic``), each with a fake
(meta) implementation and a registered autograd formula.

``pml_hyperbolic::pairwise_poincare_dist(x, y, c, keep_S)`` returns the all-pairs Poincaré distance
:math:`D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{c\|x_i - y_j\|^2/(a_i b_j)}` (algorithm:
:mod:`pml_hyperbolic.kernels.pairwise`) followed by the residuals its backward needs (the explicit
pairs, their float64 :math:`w`, the float64 row terms and three flags);
``pml_hyperbolic::pairwise_poincare_dist_backward`` is the closed-form backward.
``pml_hyperbolic::poincare_row_terms(x, c, floor)`` returns :math:`(\|x_i\|^2,\; 1/\max(1 - c\|x_i\|^2,
\mathrm{floor}))` in float64.

Why ops and not an ``autograd.Function``: a registered op is one node to ``torch.compile`` (traced
through without a graph break, its shapes known from the fake implementation), and
``torch.library.opcheck`` checks its schema, fake implementation and autograd registration.

The N×M buffer S = √(W + W²/2) of the forward is not an output (its lower triangle is scratch on
the symmetric path): the eager forward leaves it in a per-thread slot, keyed by the output it
belongs to, where the autograd registration picks it up; where it is missing (a traced graph, a
second backward) the backward op recomputes it.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import threading
import weakref

import torch
from torch import Tensor

from . import pairwise as _pairwise
from .gram import _row_terms

__all__ = ["pairwise_poincare_dist", "pairwise_poincare_dist_backward", "poincare_pairwise_dist",
           "poincare_row_terms"]

_slot = threading.local()  # the last eager forward's (weakref to its d, S)


def _distinct(outputs: list, inputs: tuple) -> tuple:
    """``outputs`` with every tensor that shares memory with an input or an earlier output, or is a
    view (an offset or strided part of another tensor, as ``nonzero``'s columns are), cloned: an
    op's outputs are fresh contiguous tensors that alias nothing (the kernel reuses some row terms for
    x is y)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        key = t.untyped_storage().data_ptr()
        if t.numel() == 0 or key in seen or t.storage_offset() or not t.is_contiguous():
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(key)
        out.append(t)
    return tuple(out)


@torch.library.custom_op("pml_hyperbolic::pairwise_poincare_dist", mutates_args=())
def pairwise_poincare_dist(x: Tensor, y: Tensor, c: Tensor, keep_S: bool
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""All-pairs Poincaré distance and the residuals of its backward.

    .. math:: D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{\frac{c\|x_i - y_j\|^2}{a_i b_j}},
              \quad a_i = 1 - c\|x_i\|^2,\; b_j = 1 - c\|y_j\|^2.

    Args:
        x: (N, D) points, float32 or float64.
        y: (M, D) points, x's dtype and device.
        c: 0-d curvature tensor (positive).
        keep_S: keep the backward's N×M buffer (a backward will come).

    Returns:
        ``(d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags)``: d (N, M) in x's dtype; the K pairs
        computed explicitly (int64 rows and cols, their float64 w); float64 ‖x‖², 1/a, ‖y‖², 1/b;
        int64 CPU flags (x is y in memory, every point at the origin, symmetric forward ran).

    Why residuals as outputs: the backward's cost is one or two matrix products only because it
    reuses them.

    Design note: docs/design/kernels.md
    """
    d, S, rows, cols, w_close, x2, inv_a, y2, inv_b, flags = _pairwise.forward(x, y, c, keep_S)
    if keep_S:
        _slot.last = (weakref.ref(d), S)
    flag_tensor = torch.tensor([int(v) for v in flags], dtype=torch.long)
    return _distinct([d, rows, cols, w_close, x2, inv_a, y2, inv_b, flag_tensor], (x, y, c))


@pairwise_poincare_dist.register_fake
def _pairwise_fake(x, y, c, keep_S):
    pairs = torch.library.get_ctx().new_dynamic_size()
    long = dict(dtype=torch.long, device=x.device)
    f64 = dict(dtype=torch.float64, device=x.device)
    n, m = x.shape[0], y.shape[0]
    return (x.new_empty(n, m), x.new_empty(pairs, **long), x.new_empty(pairs, **long), x.new_empty(pairs, **f64),
            x.new_empty(n, **f64), x.new_empty(n, **f64), x.new_empty(m, **f64), x.new_empty(m, **f64),
            torch.empty(3, dtype=torch.long, device="cpu"))


def _pairwise_setup(ctx, inputs, output):
    x, y, c, _ = inputs
    d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags = output
    last = getattr(_slot, "last", None)
    _slot.last = None
    ctx.S = last[1] if last is not None and last[0]() is d else None
    ctx.same_object = x is y
    ctx.mark_non_differentiable(rows, cols, w_close, x2, inv_a, y2, inv_b, flags)
    ctx.save_for_backward(x, y, c, d if ctx.needs_input_grad[2] else None, rows, cols, w_close, x2, inv_a, y2,
                          inv_b, flags)


def _pairwise_backward(ctx, grad, *_residual_grads):
    x, y, c, d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags = ctx.saved_tensors
    need = tuple(bool(v) for v in ctx.needs_input_grad[:3])
    combined = ctx.same_object and need[0] and need[1]
    if grad is None:
        grad = torch.zeros(x.shape[0], y.shape[0], dtype=x.dtype, device=x.device)
    if torch.is_grad_enabled():  # create_graph=True (a gradient penalty): a differentiable graph
        same = bool(flags[0])
        gx, gy, gc = _pairwise.create_graph_backward(grad, x, y, c, rows, cols, same, ctx.same_object, need)
        return gx, gy, gc, None
    S, ctx.S = ctx.S, None  # consumed (overwritten) by the backward
    gx, gy, gc = torch.ops.pml_hyperbolic.pairwise_poincare_dist_backward(
        grad, x, y, c, d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags, S, ctx.same_object, *need)
    return (gx if need[0] else None, gy if need[1] and not combined else None, gc if need[2] else None, None)


pairwise_poincare_dist.register_autograd(_pairwise_backward, setup_context=_pairwise_setup)


@torch.library.custom_op("pml_hyperbolic::pairwise_poincare_dist_backward", mutates_args=("S",))
def pairwise_poincare_dist_backward(grad: Tensor, x: Tensor, y: Tensor, c: Tensor, d: Tensor | None, rows: Tensor,
                                    cols: Tensor, w_close: Tensor, x2: Tensor, inv_a: Tensor, y2: Tensor,
                                    inv_b: Tensor, flags: Tensor, S: Tensor | None, same_object: bool,
                                    need_x: bool, need_y: bool, need_c: bool) -> tuple[Tensor, Tensor, Tensor]:
    r"""Closed-form backward of :func:`pairwise_poincare_dist`.

    .. math:: \nabla_{x_i} = \frac{2\sqrt c}{a_i}\Big[x_i\big(\textstyle\sum_j E_{ij} q_j + \sum_j F_{ij}\big)
              - \sum_j E_{ij} q_j y_j\Big],\quad E = U/\sqrt{w(1+w)},\; F = E\,w.

    Args:
        grad: (N, M) upstream gradient U (any strides).
        x: the forward's x.
        y: the forward's y.
        c: the forward's curvature.
        d: the forward's distances (needed for the curvature's gradient only), or None.
        rows: the forward's explicit pairs (rows).
        cols: the forward's explicit pairs (columns).
        w_close: their float64 w.
        x2: float64 ‖x‖².
        inv_a: float64 1/a.
        y2: float64 ‖y‖².
        inv_b: float64 1/b.
        flags: the forward's flags.
        S: the forward's N×M buffer (overwritten), or None to recompute it.
        same_object: x and y are one tensor (one gradient holds both terms).
        need_x: the gradient of x is wanted.
        need_y: the gradient of y is wanted.
        need_c: the gradient of c is wanted.

    Returns:
        ``(gx, gy, gc)``, zeros where not wanted (``gy`` zeros also when ``same_object`` and both are
        wanted: ``gx`` then holds both terms).

    Why one op: the backward reads data-dependent residuals (the explicit pairs), which a traced
    graph keeps opaque.

    Design note: docs/design/kernels.md
    """
    flag = _pairwise.Flags(*(bool(v) for v in flags.tolist()))
    need = (need_x, need_y, need_c)
    gx, gy, gc = _pairwise.backward(grad, x, y, c, d, rows, cols, w_close, x2, inv_a, y2, inv_b, flag, S,
                                    same_object, need)
    return (torch.zeros_like(x) if gx is None else gx, torch.zeros_like(y) if gy is None else gy,
            torch.zeros_like(c) if gc is None else gc)


@pairwise_poincare_dist_backward.register_fake
def _pairwise_backward_fake(grad, x, y, c, d, rows, cols, w_close, x2, inv_a, y2, inv_b, flags, S, same_object,
                            need_x, need_y, need_c):
    return torch.empty_like(x), torch.empty_like(y), torch.empty_like(c)


@torch.library.custom_op("pml_hyperbolic::poincare_row_terms", mutates_args=())
def poincare_row_terms(x: Tensor, c: float, floor: float) -> tuple[Tensor, Tensor]:
    r"""The conformal row terms of the ball, in float64.

    .. math:: x2_i = \|x_i\|^2, \qquad \mathrm{inv\_a}_i = 1/\max(1 - c\|x_i\|^2,\ \mathrm{floor}).

    Args:
        x: (N, D) points, float32 or float64.
        c: the curvature (positive).
        floor: the floor of 1 − c‖x‖² (keeps 1/a finite on and outside the boundary).

    Returns:
        ``(x2, inv_a)``, two float64 (N,) tensors.

    Why an op: one native pass over x (eight partial sums per row) where the compiled kernels run.

    Design note: docs/design/kernels.md
    """
    x2, inv_a = _row_terms(x, c, floor)
    return _distinct([x2, inv_a], (x,))


@poincare_row_terms.register_fake
def _row_terms_fake(x, c, floor):
    return x.new_empty(x.shape[0], dtype=torch.float64), x.new_empty(x.shape[0], dtype=torch.float64)


def _row_terms_setup(ctx, inputs, output):
    x, c, floor = inputs
    ctx.c, ctx.floor = c, floor
    ctx.save_for_backward(x, output[1])


def _row_terms_backward(ctx, g_x2, g_inv_a):
    x, inv_a = ctx.saved_tensors
    # d‖x‖²/dx = 2x; d(1/a)/dx = 2c x/a² where 1 − c‖x‖² is above the floor (a floored a is constant)
    weight = torch.zeros_like(inv_a)
    if g_x2 is not None:
        weight = weight + 2.0 * g_x2
    if g_inv_a is not None:
        free = inv_a < 1.0 / ctx.floor
        weight = weight + torch.where(free, 2.0 * ctx.c * inv_a * inv_a * g_inv_a, 0.0)
    return (weight.to(x.dtype)[:, None] * x, None, None)


poincare_row_terms.register_autograd(_row_terms_backward, setup_context=_row_terms_setup)


def poincare_pairwise_dist(x: Tensor, y: Tensor, c: Tensor) -> Tensor:
    """N×D, M×D (same float dtype), 0-d c → N×M distance matrix (through
    ``pml_hyperbolic::pairwise_poincare_dist``).

    Args:
        x: (N, D) points.
        y: (M, D) points.
        c: 0-d curvature tensor.

    Returns:
        The (N, M) distances.

    Raises:
        ValueError: for inputs that are not 2-D or whose embedding dimensions differ.
    """
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"pairwise_dist expects 2-D inputs, got shapes {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"embedding dimensions differ: {x.shape[1]} vs {y.shape[1]}")
    keep_S = torch.is_grad_enabled() and (x.requires_grad or y.requires_grad or c.requires_grad)
    return pairwise_poincare_dist(x, y, c, keep_S)[0]
