r"""All-pairs Poincaré distance as fused Triton kernels, registered as a ``torch.library`` op.

With :math:`\alpha_i = 1/\max(1 - c\|x_i\|^2, \varepsilon)`, :math:`\beta_j = 1/\max(1 - c\|y_j\|^2,
\varepsilon)` (:math:`\varepsilon` = ``DENOM_FLOOR`` = 2⁻⁶⁰) and :math:`s_{ij} = \|x_i - y_j\|^2`:

.. math:: t_{ij} = \sqrt{c\, s_{ij}}\,\sqrt{\alpha_i \beta_j} = \sqrt{w_{ij}}, \qquad
          D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh} t_{ij}.

Forward: one kernel over (i, j) tiles; :math:`s_{ij}` is summed from explicit differences
:math:`x_i - y_j` over the feature dimension (no Gram product, so nearby points keep every digit
and the diagonal of ``(x, x)`` is exactly 0). When ``y`` is ``x`` only the tiles on and above the
diagonal are computed, each written twice (the result is exactly symmetric). A second, small
kernel forms the row terms :math:`\alpha_i` in float64 from float64 squares. Inputs in float16,
bfloat16 or float32 are accumulated and returned in float32; float64 inputs in float64.

Backward, with upstream :math:`U`, :math:`\rho_{ij} = t_{ij}/\sqrt{1 + t_{ij}^2}` and
:math:`L_{ij} = \beta_j U_{ij} / (\sqrt c\, t_{ij}\sqrt{1 + t_{ij}^2})` (:math:`L_{ij} = 0` where
:math:`t_{ij} = 0`: the zero subgradient at :math:`x_i = y_j`):

.. math:: \nabla_{x_i} = 2c\,\alpha_i\Big[\sum_j L_{ij}(x_i - y_j)
          + [1 - c\|x_i\|^2 > \varepsilon]\; x_i \sum_j \frac{U_{ij}\rho_{ij}}{\sqrt c}\Big],

the same with the roles swapped for :math:`y` (one launch per side; when ``y`` is ``x`` a single
launch with :math:`U + U^\top`). Each row block's walk over the other side may be split into a few
partial sums (to fill the GPU when there are few rows), which a small kernel then adds in a fixed
order: no atomics, so the result does not depend on scheduling. And

.. math:: \frac{\partial \mathcal L}{\partial c} = -\frac{1}{2c}\sum_{ij} U_{ij} D_{ij}
          + \sum_{ij} \frac{U_{ij}\rho_{ij}}{\sqrt c}\Big(\frac1c + r_i + r'_j\Big), \qquad
          r_i = [\text{not floored}]\;\|x_i\|^2\alpha_i.

The differences :math:`x_i - y_j` are formed again in the backward (never an N×M×D temporary);
a backward run with ``create_graph=True`` instead differentiates a plain float64 torch composite of
the same formula (N×M×D memory) so that gradient penalties work.

Why: on a GPU the distance built from elementwise torch ops is a chain of N×M passes and
temporaries; one fused kernel per direction keeps memory at the N×M output (the backward saves
only the inputs).

Design note: docs/design/gpu-kernel.md
"""
from __future__ import annotations

from numbers import Real
from typing import Optional

import torch
from torch import Tensor

from pml_hyperbolic.kernels.gram import DENOM_FLOOR
from pml_hyperbolic.kernels.build import assert_curvature_on_device, values_checked

try:  # Triton is optional: without it the module imports, and the entry point says why it cannot run
    import triton
    from torch.library import triton_op, wrap_triton

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as error:  # pragma: no cover - depends on the installation
    triton = None
    _TRITON_IMPORT_ERROR = error

#: Name of the forward op (``torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton``).
OP_NAME = "pml_hyperbolic::pairwise_poincare_dist_triton"
#: Name of the backward op.
BACKWARD_OP_NAME = "pml_hyperbolic::pairwise_poincare_dist_triton_backward"

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Tile sizes: forward (i, j) tiles of _BM × _BN (square: the symmetric forward mirrors tiles) with
# _BK features per step; backward row blocks of _BWD_BM rows, each walking its share of the j tiles
# (up to _MAX_SPLITS shares, partial sums reduced in a fixed order: no atomics, deterministic).
_BM, _BN, _BK = 32, 32, 8
_BWD_BM, _BWD_BN, _BWD_BK = 16, 32, 8
_FIN_BM, _FIN_BK = 32, 32
_MAX_SPLITS = 16
_ROWS_BLOCK, _ROWS_BK = 64, 32
# Tests set this to force a number of splits (the interpreter has no multiprocessor count).
_SPLITS_OVERRIDE: Optional[int] = None
_NUM_WARPS = 4


if triton is not None:
    from pml_hyperbolic.kernels.triton_pairwise_kernels import (
        _backward_kernel,
        _finish_kernel,
        _forward_kernel,
        _row_terms_kernel,
    )


def _interpreted() -> bool:
    """True when the kernels were built for Triton's interpreter (``TRITON_INTERPRET=1`` at
    import): they then run on CPU tensors."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_forward_kernel, InterpretedFunction)


def triton_available(device: torch.device | str) -> bool:
    """Whether :func:`pairwise_poincare_dist_triton` can run on ``device``.

    Args:
        device: a device or a tensor's ``.device``.

    Returns:
        True when Triton imports and ``device`` is a CUDA (or ROCm) device, or when the kernels were
        built for Triton's interpreter (``TRITON_INTERPRET=1`` set before this module was imported)
        and ``device`` is the CPU.

    Design note: docs/design/gpu-kernel.md
    """
    if triton is None:
        return False
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and _interpreted())


def _acc_dtype(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_inputs(x: Tensor, y: Optional[Tensor], c: Tensor) -> None:
    """One clear error per kind of bad input (shared by the entry point and the ops)."""
    for name, t in (("x", x), ("y", y)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D (points × features), got shape {tuple(t.shape)}")
    if y is not None:
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"x and y must have the same number of features, got {x.shape[1]} and {y.shape[1]}")
        if x.device != y.device:
            raise ValueError(f"x and y must be on the same device, got {x.device} and {y.device}")
    if not isinstance(c, Tensor) or c.numel() != 1 or not c.is_floating_point():
        raise TypeError("c must be a one-element floating-point tensor (pass a float to "
                        "pairwise_poincare_dist_triton, which converts it)")
    if c.device != x.device:
        raise ValueError(f"c must be on x's device ({x.device}), got {c.device}")


def _row_terms(x: Tensor, c64: Tensor, acc: torch.dtype) -> Tensor:
    rows = torch.empty((x.shape[0], 2), dtype=acc, device=x.device)
    if x.shape[0]:
        grid = (triton.cdiv(x.shape[0], _ROWS_BLOCK),)
        wrap_triton(_row_terms_kernel)[grid](x, c64, rows, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                                             FLOOR=DENOM_FLOOR, BR=_ROWS_BLOCK, BK=_ROWS_BK,
                                             num_warps=_NUM_WARPS)
    return rows


def _splits(a: Tensor, na: int, nb: int) -> int:
    """How many parts the walk over the other side's tiles is split into: enough programs to fill
    the GPU (about four per multiprocessor) when there are few row blocks, at most one per tile."""
    if _SPLITS_OVERRIDE is not None:
        return max(1, min(_SPLITS_OVERRIDE, triton.cdiv(nb, _BWD_BN)))
    if a.device.type != "cuda":
        return 1
    programs = 4 * torch.cuda.get_device_properties(a.device).multi_processor_count
    return max(1, min(triton.cdiv(programs, triton.cdiv(na, _BWD_BM)), triton.cdiv(nb, _BWD_BN), _MAX_SPLITS))


def _side_gradient(a: Tensor, b: Tensor, grad: Tensor, su_a: int, su_b: int, rows_a: Tensor, rows_b: Tensor,
                   c64: Tensor, acc: torch.dtype, sym: bool):
    """(gradient for a's rows in a's dtype, RSUM, UDSUM): the split walk, then the finishing pass."""
    na, nb, d = a.shape[0], b.shape[0], a.shape[1]
    gout = torch.empty((na, d), dtype=a.dtype, device=a.device)
    rsum = torch.empty((na,), dtype=acc, device=a.device)
    udsum = torch.empty((na,), dtype=acc, device=a.device)
    if not (na and nb and d):  # nothing to walk (no pairs or no features): the gradient and the sums are 0
        return gout.zero_(), rsum.zero_(), udsum.zero_()
    splits = _splits(a, na, nb)
    gacc = torch.zeros((splits, na, d), dtype=acc, device=a.device)
    rpart = torch.empty((splits, na), dtype=acc, device=a.device)
    upart = torch.empty((splits, na), dtype=acc, device=a.device)
    wrap_triton(_backward_kernel)[(triton.cdiv(na, _BWD_BM), splits)](
        a, b, grad, rows_a, rows_b, c64, gacc, rpart, upart, na, nb, d,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), su_a, su_b,
        gacc.stride(0), gacc.stride(1), gacc.stride(2),
        SYM=sym, BM=_BWD_BM, BN=_BWD_BN, BK=_BWD_BK, num_warps=_NUM_WARPS)
    wrap_triton(_finish_kernel)[(triton.cdiv(na, _FIN_BM),)](
        a, rows_a, c64, gacc, rpart, upart, gout, rsum, udsum, na, d, splits,
        a.stride(0), a.stride(1), gacc.stride(0), gacc.stride(1), gacc.stride(2), gout.stride(0), gout.stride(1),
        BM=_FIN_BM, BK=_FIN_BK, num_warps=_NUM_WARPS)
    return gout, rsum, udsum


def _forward_impl(x: Tensor, y: Optional[Tensor], c: Tensor) -> Tensor:
    _check_inputs(x, y, c)
    other = x if y is None else y
    acc = _acc_dtype(x, other)
    n, m, d = x.shape[0], other.shape[0], x.shape[1]
    out = torch.empty((n, m), dtype=acc, device=x.device)
    if n == 0 or m == 0:
        return out
    c64 = c.detach().reshape(()).to(torch.float64)
    rows_x = _row_terms(x, c64, acc)
    rows_y = rows_x if y is None else _row_terms(other, c64, acc)
    grid = (triton.cdiv(n, _BM), triton.cdiv(m, _BN))
    wrap_triton(_forward_kernel)[grid](x, other, rows_x, rows_y, c64, out, n, m, d,
                                       x.stride(0), x.stride(1), other.stride(0), other.stride(1),
                                       out.stride(0), out.stride(1),
                                       SYM=y is None, BM=_BM, BN=_BN, BK=_BK, num_warps=_NUM_WARPS)
    return out


def _backward_impl(grad: Tensor, x: Tensor, y: Optional[Tensor], c: Tensor):
    _check_inputs(x, y, c)
    other = x if y is None else y
    acc = _acc_dtype(x, other)
    n, m = x.shape[0], other.shape[0]
    if grad.shape != (n, m):
        raise ValueError(f"grad must have shape {(n, m)}, got {tuple(grad.shape)}")
    # Triton compiles a kernel per stride pattern (a stride of 1 is specialised), and two
    # compilations round float32 sums differently; a contiguous upstream makes the gradient the same
    # bits whatever layout arrives (an expanded `.sum()` gradient in eager mode, a contiguous tangent
    # under torch.compile)
    grad = grad.contiguous()
    c64 = c.detach().reshape(()).to(torch.float64)
    rows_x = _row_terms(x, c64, acc)
    rows_y = rows_x if y is None else _row_terms(other, c64, acc)
    su0, su1 = grad.stride(0), grad.stride(1)
    gx, rsum_x, udsum_x = _side_gradient(x, other, grad, su0, su1, rows_x, rows_y, c64, acc, sym=y is None)
    # ∂/∂c = −Σ U D/(2c) + Σ_ij (U ρ/√c)(1/c + r_i + r'_j); with y = x the launch above used U + Uᵀ,
    # which doubles Σ U D and Σ U ρ but counts r_i + r_j exactly once
    cw = c64
    rx = rows_x[:, 1].to(torch.float64)
    rsum_x64, udsum_x64 = rsum_x.to(torch.float64), udsum_x.to(torch.float64)
    if y is None:
        gy = x.new_empty((0, x.shape[1]))
        gc = -udsum_x64.sum() / (4 * cw) + rsum_x64.sum() / (2 * cw) + (rsum_x64 * rx).sum()
    else:
        gy, rsum_y, _ = _side_gradient(other, x, grad, su1, su0, rows_y, rows_x, c64, acc, sym=False)
        ry = rows_y[:, 1].to(torch.float64)
        gc = (-udsum_x64.sum() / (2 * cw) + rsum_x64.sum() / cw + (rsum_x64 * rx).sum()
              + (rsum_y.to(torch.float64) * ry).sum())
    return gx, gy, gc.to(c.dtype).reshape(c.shape)


def _composite(x: Tensor, y: Optional[Tensor], c: Tensor) -> Tensor:
    """The same distance from plain differentiable float64 torch ops (N×M×D memory): the graph that
    a backward with ``create_graph=True`` differentiates."""
    xd = x.double()
    yd = xd if y is None else y.double()
    cd = c.double().reshape(())
    a = (1 - cd * (xd * xd).sum(1)).clamp_min(DENOM_FLOOR)
    b = (1 - cd * (yd * yd).sum(1)).clamp_min(DENOM_FLOOR)
    s = ((xd[:, None, :] - yd[None, :, :]) ** 2).sum(-1)
    w = cd * s / (a[:, None] * b[None, :])
    # the clamp gives w = 0 (x_i = y_j) a zero subgradient instead of sqrt's infinite slope
    return (2 / cd.sqrt()) * torch.asinh(w.clamp_min(torch.finfo(torch.float64).tiny).sqrt())


if triton is not None:

    @triton_op(OP_NAME, mutates_args=())
    def _pairwise_op(x: Tensor, y: Optional[Tensor], c: Tensor) -> Tensor:
        return _forward_impl(x, y, c)

    @triton_op(BACKWARD_OP_NAME, mutates_args=())
    def _pairwise_backward_op(grad: Tensor, x: Tensor, y: Optional[Tensor], c: Tensor
                              ) -> tuple[Tensor, Tensor, Tensor]:
        return _backward_impl(grad, x, y, c)

    # Explicit fake implementations: the output shapes and dtypes without running a kernel. (The
    # default fake of a triton_op traces its body; under the interpreter the kernels would then be
    # called on fake tensors.)
    @_pairwise_op.register_fake
    def _pairwise_fake(x: Tensor, y: Optional[Tensor], c: Tensor) -> Tensor:
        _check_inputs(x, y, c)
        other = x if y is None else y
        return x.new_empty((x.shape[0], other.shape[0]), dtype=_acc_dtype(x, other))

    @_pairwise_backward_op.register_fake
    def _pairwise_backward_fake(grad: Tensor, x: Tensor, y: Optional[Tensor], c: Tensor):
        _check_inputs(x, y, c)
        gy = x.new_empty((0, x.shape[1])) if y is None else torch.empty_like(y)
        return torch.empty_like(x), gy, torch.empty_like(c)

    def _setup_context(ctx, inputs, output) -> None:
        x, y, c = inputs
        ctx.save_for_backward(x, y, c)

    def _backward(ctx, grad: Tensor):
        x, y, c = ctx.saved_tensors
        needs_x, needs_y, needs_c = ctx.needs_input_grad
        if torch.is_grad_enabled():  # create_graph=True: a differentiable graph of the gradient
            inputs = [t for t, needed in ((x, needs_x), (y, needs_y), (c, needs_c)) if needed]
            grads = iter(torch.autograd.grad(_composite(x, y, c), inputs, grad.double(), create_graph=True,
                                             allow_unused=True))
            gx, gy, gc = (next(grads) if needed else None for needed in (needs_x, needs_y, needs_c))
            cast = (lambda g, like: None if g is None else g.to(like.dtype))
            return cast(gx, x), cast(gy, y), cast(gc, c)
        gx, gy, gc = torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton_backward(grad, x, y, c)
        return (gx if needs_x else None, gy if (needs_y and y is not None) else None, gc if needs_c else None)

    _pairwise_op.register_autograd(_backward, setup_context=_setup_context)


def pairwise_poincare_dist_triton(x: Tensor, y: Tensor, c: float | Tensor) -> Tensor:
    r"""All-pairs Poincaré distance on the fused Triton kernels:

    .. math:: D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh}\sqrt{\frac{c\|x_i - y_j\|^2}
              {(1 - c\|x_i\|^2)(1 - c\|y_j\|^2)}}

    (denominators floored at ``DENOM_FLOOR`` = 2⁻⁶⁰, as :func:`pml_hyperbolic.poincare_ball.dist`).
    Differentiable in ``x``, ``y`` and a tensor ``c``; when ``y`` is ``x`` (PML's
    ``compute_mat(emb, emb)``) the backward is one launch and the diagonal is exactly 0 with a zero
    gradient. Accumulates in float32 for float16/bfloat16/float32 inputs (so under autocast it runs
    and returns float32) and in float64 for float64 inputs. Squared distances come from explicit
    differences, so nearby points are as accurate as distant ones.

    Args:
        x: (N, D) points of the ball, float16, bfloat16, float32 or float64.
        y: (M, D) points of the ball on ``x``'s device (may be ``x`` itself).
        c: curvature magnitude > 0: a float, a one-element tensor (a learnable one receives its
            gradient; for a :class:`~pml_hyperbolic.geometry.PoincareGeometry` pass
            ``geometry.curvature(torch.float64)``).

    Returns:
        The (N, M) distance matrix, float32 (float64 if ``x`` or ``y`` is float64).

    Raises:
        TypeError: ``x`` or ``y`` is not a floating-point tensor, or ``c`` is of an unknown type.
        ValueError: ``x`` or ``y`` is not 2-D, their feature sizes or devices differ, or ``c`` is not
            a finite positive number (a ``c`` tensor on an accelerator is read back only where
            :func:`~pml_hyperbolic.kernels.build.values_checked` says so, otherwise checked by an
            asynchronous device assertion).
        RuntimeError: Triton is not installed, or ``x``'s device cannot run the kernels (see
            :func:`triton_available`).

    Design note: docs/design/gpu-kernel.md
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not isinstance(y, Tensor):
        raise TypeError(f"y must be a torch.Tensor, got {type(y).__name__}")
    if not triton_available(x.device):
        why = (f"Triton is not installed ({_TRITON_IMPORT_ERROR})" if triton is None else
               f"the kernels run on CUDA tensors (or on CPU under TRITON_INTERPRET=1 set before import), "
               f"got a tensor on {x.device}")
        raise RuntimeError(f"pairwise_poincare_dist_triton cannot run: {why}; use "
                           f"pml_hyperbolic.poincare_ball.pairwise_dist instead")
    curvature = _curvature_tensor(c, x.device)
    _check_inputs(x, None if y is x else y, curvature)
    return torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton(x, None if y is x else y, curvature)


def _curvature_tensor(c: float | Tensor, device: torch.device) -> Tensor:
    """``c`` as a float64 tensor on ``device`` (a tensor keeps its autograd link). Only numbers and
    tensors: this module sits below the geometry (which imports the kernels)."""
    if isinstance(c, Tensor):
        if c.numel() != 1:
            raise ValueError(f"c must be a scalar curvature (a one-element tensor), got shape {tuple(c.shape)}")
        tensor = c.to(device=device, dtype=torch.float64).reshape(())
        if not values_checked(c):
            # on an accelerator, validated there: reading it back would make every call wait for the
            # device (values_checked: the same policy as the other value checks)
            assert_curvature_on_device(c)
            return tensor
        value = float(c.detach())
    elif isinstance(c, Real) and not isinstance(c, bool):
        value = float(c)
        tensor = torch.tensor(value, dtype=torch.float64, device=device)
    else:
        value = tensor = None
    if tensor is not None:
        if not (value > 0 and value < float("inf")):
            raise ValueError(f"c must be a finite curvature magnitude > 0, got {value!r}")
        return tensor
    raise TypeError(f"c must be a float or a one-element tensor, got {type(c).__name__}; for a "
                    "PoincareGeometry pass geometry.curvature(torch.float64)")


__all__ = ["pairwise_poincare_dist_triton", "triton_available", "OP_NAME", "BACKWARD_OP_NAME"]
