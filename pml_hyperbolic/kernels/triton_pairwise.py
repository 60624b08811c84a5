r"""All-pairs Poincaré distance as fused Triton kernels, registered as a ``torch.library`` op.

With :math:`\alpha_i = 1/\max(1 - c\|x_i\|^2, \varepsilon)`, :math:`\beta_j = 1/\max(1 - c\|y_j\|^2,
\varepsilon)` (:math:`\varepsilon` = ``DENOM_FLOOR`` = 2⁻⁶⁰) and :math:`s_{ij} = \|x_i - y_j\|^2`:

.. math:: t_{ij} = \sqrt{c\, s_{ij}}\,\sqrt{\alpha_i \beta_j} = \sqrt{w_{ij}}, \qquad
          D_{ij} = \frac{2}{\sqrt c}\operatorname{arsinh} t_{ij}.

Forward: one kernel over (i, j) tiles; :math:`s_{ij}` is summed from explicit differences
:math:`x_i - y_j` over the feature dimension (no Gram product, so nearby points keep every digit
and the diagonal of ``(x, x)`` is exactly 0). When ``y`` is ``x`` only the tiles on and above the
diagonal are computed, each written twice (the result is exactly symmetric). A second, small kernel forms the row terms
:math:`\alpha_i` in float64 from float64 squares. Inputs in float16, bfloat16 or float32 are
accumulated and returned in float32; float64 inputs in float64.

Backward, with upstream :math:`U`, :math:`\rho_{ij} = t_{ij}/\sqrt{1 + t_{ij}^2}` and
:math:`L_{ij} = \beta_j U_{ij} / (\sqrt c\, t_{ij}\sqrt{1 + t_{ij}^2})` (:math:`L_{ij} = 0` where
:math:`t_{ij} = 0`: the zero subgradient at :math:`x_i = y_j`):

.. math:: \nabla_{x_i} = 2c\,\alpha_i\Big[\sum_j L_{ij}(x_i - y_j)
          + [1 - c\|x_i\|^2 > \varepsilon]\; x_i \sum_j \frac{U_{ij}\rho_{ij}}{\sqrt c}\Big],

the same with the roles swapped for :math:`y` (one launch per side; when ``y`` is ``x`` a single
launch with :math:`U + U^\top`), and

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

from typing import Optional

import torch
from torch import Tensor

from pml_hyperbolic.poincare_ball import DENOM_FLOOR, as_curvature

try:  # Triton is optional: without it the module imports, and the entry point says why it cannot run
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    _TRITON_IMPORT_ERROR: Optional[BaseException] = None
except ImportError as error:  # pragma: no cover - depends on the installation
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = error

#: Name of the forward op (``torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton``).
OP_NAME = "pml_hyperbolic::pairwise_poincare_dist_triton"
#: Name of the backward op.
BACKWARD_OP_NAME = "pml_hyperbolic::pairwise_poincare_dist_triton_backward"

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Tile sizes: forward (i, j) tiles of _BM × _BN (square: the symmetric forward mirrors tiles) with
# _BK features per step; backward row blocks of _BWD_BM rows (one program per block walks every j
# tile, so the gradient rows are summed in a fixed order: no atomics, deterministic).
_BM, _BN, _BK = 32, 32, 8
_BWD_BM, _BWD_BN, _BWD_BK = 16, 32, 8
_ROWS_BLOCK, _ROWS_BK = 64, 32
_NUM_WARPS = 4


if triton is not None:

    @triton.jit
    def _asinh_nonneg(t):
        """arsinh(t) for t ≥ 0: odd series below 0.1 (the log of a number near 1 would lose digits
        on approximate log units), log(t + √(1 + t²)) up to 1e8, log(2t) above (t² overflows)."""
        small = tl.where(t < 0.1, t, 0.0)  # keeps the unused branches finite
        z = small * small
        series = small * (1.0 + z * (-1.0 / 6.0 + z * (3.0 / 40.0 + z * (-5.0 / 112.0 + z * (
            35.0 / 1152.0 + z * (-63.0 / 2816.0 + z * (231.0 / 13312.0)))))))
        big = tl.where(t > 1e8, 1.0, t)
        middle = tl.log(big + tl.sqrt(1.0 + big * big))
        large = tl.log(tl.where(t > 1e8, t, 1.0)) + 0.6931471805599453
        return tl.where(t < 0.1, series, tl.where(t > 1e8, large, middle))

    @triton.jit
    def _row_terms_kernel(X, CPTR, ROWS, N, D, sxn, sxd,
                          FLOOR: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
        """ROWS[i] = (α_i, r_i): α_i = 1/max(1 − c‖x_i‖², FLOOR), r_i = ‖x_i‖²α_i (0 where floored),
        with ‖x_i‖² summed in float64 from float64 squares."""
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        rmask = rows < N
        r64 = rows.to(tl.int64)
        sq = tl.zeros((BR,), dtype=tl.float64)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            v = tl.load(X + r64[:, None] * sxn + k[None, :] * sxd, mask=rmask[:, None] & (k < D)[None, :],
                        other=0.0).to(tl.float64)
            sq += tl.sum(v * v, axis=1)
        c = tl.load(CPTR).to(tl.float64)
        a = 1.0 - c * sq
        live = a > FLOOR
        alpha = 1.0 / tl.maximum(a, FLOOR)
        r = tl.where(live, sq * alpha, 0.0)
        out_ty = ROWS.dtype.element_ty
        tl.store(ROWS + r64 * 2, alpha.to(out_ty), mask=rmask)
        tl.store(ROWS + r64 * 2 + 1, r.to(out_ty), mask=rmask)

    @triton.jit
    def _sq_dist_tile(X, Y, ri, rj, mi, mj, D, sxn, sxd, syn, syd, s, BK: tl.constexpr):
        """s[i, j] += Σ_k (x_ik − y_jk)² over all features, in s's dtype."""
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            mk = k < D
            xv = tl.load(X + ri[:, None] * sxn + k[None, :] * sxd, mask=mi[:, None] & mk[None, :], other=0.0)
            yv = tl.load(Y + rj[:, None] * syn + k[None, :] * syd, mask=mj[:, None] & mk[None, :], other=0.0)
            diff = xv.to(s.dtype)[:, None, :] - yv.to(s.dtype)[None, :, :]
            s += tl.sum(diff * diff, axis=2)
        return s

    @triton.jit
    def _forward_kernel(X, Y, ROWX, ROWY, CPTR, OUT, N, M, D,
                        sxn, sxd, syn, syd, son, som,
                        SYM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """OUT[i, j] = 2/√c · arsinh(√(c s_ij) √(α_i β_j)) for one BM × BN tile. With SYM (Y is X,
        BM = BN) only tiles on and above the diagonal compute, and each also writes its mirror."""
        pid_i = tl.program_id(0)
        pid_j = tl.program_id(1)
        if (not SYM) or pid_j >= pid_i:
            acc_ty = ROWX.dtype.element_ty
            ri = (pid_i * BM + tl.arange(0, BM)).to(tl.int64)
            rj = (pid_j * BN + tl.arange(0, BN)).to(tl.int64)
            mi = ri < N
            mj = rj < M
            s = _sq_dist_tile(X, Y, ri, rj, mi, mj, D, sxn, sxd, syn, syd,
                              tl.zeros((BM, BN), dtype=acc_ty), BK)
            ax = tl.load(ROWX + ri * 2, mask=mi, other=1.0)
            ay = tl.load(ROWY + rj * 2, mask=mj, other=1.0)
            c = tl.load(CPTR).to(acc_ty)
            # √(α_i β_j) as one product: the same bits for (i, j) and (j, i), so (x, x) is exactly symmetric
            t = tl.sqrt(c * s) * tl.sqrt(ax[:, None] * ay[None, :])
            d = ((2.0 / tl.sqrt(c)) * _asinh_nonneg(t)).to(OUT.dtype.element_ty)
            mij = mi[:, None] & mj[None, :]
            tl.store(OUT + ri[:, None] * son + rj[None, :] * som, d, mask=mij)
            if SYM:
                tl.store(OUT + rj[None, :] * son + ri[:, None] * som, d, mask=mij)

    @triton.jit
    def _backward_kernel(A, B, U, ROWA, ROWB, CPTR, GACC, GOUT, RSUM, UDSUM, NA, NB, D,
                         san, sad, sbn, sbd, su_a, su_b, sgn, sgd, son, sod,
                         SYM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """Gradient of Σ U·D with respect to the rows of A (the other side B held fixed) for one block
        of BM rows, walking every tile of B in order. U[a, b] is read as U + a·su_a + b·su_b (and,
        with SYM, U[a, b] + U[b, a]). GACC holds Σ_j L_ij (a_i − b_j) while the walk lasts; GOUT
        (which may be GACC itself) gets the gradient. RSUM[i] = Σ_j U_ij ρ_ij/√c and
        UDSUM[i] = Σ_j U_ij D_ij feed the curvature's gradient."""
        acc_ty = ROWA.dtype.element_ty
        ri = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
        mi = ri < NA
        alpha_a = tl.load(ROWA + ri * 2, mask=mi, other=1.0)
        live_a = tl.load(ROWA + ri * 2 + 1, mask=mi, other=0.0) > 0.0
        c = tl.load(CPTR).to(acc_ty)
        sqc = tl.sqrt(c)
        rsum = tl.zeros((BM,), dtype=acc_ty)
        udsum = tl.zeros((BM,), dtype=acc_ty)
        for j0 in range(0, NB, BN):
            rj = (j0 + tl.arange(0, BN)).to(tl.int64)
            mj = rj < NB
            mij = mi[:, None] & mj[None, :]
            s = _sq_dist_tile(A, B, ri, rj, mi, mj, D, san, sad, sbn, sbd,
                              tl.zeros((BM, BN), dtype=acc_ty), BK)
            alpha_b = tl.load(ROWB + rj * 2, mask=mj, other=1.0)
            u = tl.load(U + ri[:, None] * su_a + rj[None, :] * su_b, mask=mij, other=0.0).to(acc_ty)
            if SYM:
                u += tl.load(U + rj[None, :] * su_a + ri[:, None] * su_b, mask=mij, other=0.0).to(acc_ty)
            t = tl.sqrt(c * s) * tl.sqrt(alpha_a[:, None] * alpha_b[None, :])
            sq1 = tl.sqrt(1.0 + t * t)  # inf once t² overflows: then L → 0 and ρ = 1 below
            rho = tl.where(t > 1e8, 1.0, t / sq1)
            positive = t > 0.0
            el = tl.where(positive, (alpha_b[None, :] * u) / (sqc * tl.where(positive, t, 1.0) * sq1), 0.0)
            rsum += tl.sum(u * rho, axis=1) / sqc
            udsum += tl.sum(u * ((2.0 / sqc) * _asinh_nonneg(t)), axis=1)
            for k0 in range(0, D, BK):
                k = k0 + tl.arange(0, BK)
                mk = k < D
                av = tl.load(A + ri[:, None] * san + k[None, :] * sad, mask=mi[:, None] & mk[None, :], other=0.0)
                bv = tl.load(B + rj[:, None] * sbn + k[None, :] * sbd, mask=mj[:, None] & mk[None, :], other=0.0)
                diff = av.to(acc_ty)[:, None, :] - bv.to(acc_ty)[None, :, :]
                part = tl.sum(el[:, :, None] * diff, axis=1)
                gptr = GACC + ri[:, None] * sgn + k[None, :] * sgd
                gmask = mi[:, None] & mk[None, :]
                tl.store(gptr, tl.load(gptr, mask=gmask, other=0.0) + part, mask=gmask)
        scale = 2.0 * c * alpha_a
        radial = tl.where(live_a, rsum, 0.0)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            mk = k < D
            gmask = mi[:, None] & mk[None, :]
            av = tl.load(A + ri[:, None] * san + k[None, :] * sad, mask=gmask, other=0.0).to(acc_ty)
            g = tl.load(GACC + ri[:, None] * sgn + k[None, :] * sgd, mask=gmask, other=0.0)
            g = scale[:, None] * (g + radial[:, None] * av)
            tl.store(GOUT + ri[:, None] * son + k[None, :] * sod, g.to(GOUT.dtype.element_ty), mask=gmask)
        tl.store(RSUM + ri, rsum, mask=mi)
        tl.store(UDSUM + ri, udsum, mask=mi)


def _interpreted() -> bool:
    """True when the kernels above were built for Triton's interpreter (``TRITON_INTERPRET=1`` at
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


def _side_gradient(a: Tensor, b: Tensor, grad: Tensor, su_a: int, su_b: int, rows_a: Tensor, rows_b: Tensor,
                   c64: Tensor, acc: torch.dtype, sym: bool):
    """(gradient for a's rows in a's dtype, RSUM, UDSUM) from one launch of the backward kernel."""
    na, nb, d = a.shape[0], b.shape[0], a.shape[1]
    gacc = torch.zeros((na, d), dtype=acc, device=a.device)
    gout = gacc if a.dtype == acc else torch.empty((na, d), dtype=a.dtype, device=a.device)
    rsum = torch.empty((na,), dtype=acc, device=a.device)
    udsum = torch.empty((na,), dtype=acc, device=a.device)
    if na and nb and d:
        grid = (triton.cdiv(na, _BWD_BM),)
        wrap_triton(_backward_kernel)[grid](
            a, b, grad, rows_a, rows_b, c64, gacc, gout, rsum, udsum, na, nb, d,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), su_a, su_b,
            gacc.stride(0), gacc.stride(1), gout.stride(0), gout.stride(1),
            SYM=sym, BM=_BWD_BM, BN=_BWD_BN, BK=_BWD_BK, num_warps=_NUM_WARPS)
    else:  # nothing to walk (no pairs or no features): the gradient and the sums are 0
        gout.zero_()
        rsum.zero_()
        udsum.zero_()
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
            gradient) or anything :func:`pml_hyperbolic.poincare_ball.as_curvature` reads.

    Returns:
        The (N, M) distance matrix, float32 (float64 if ``x`` or ``y`` is float64).

    Raises:
        TypeError: ``x`` or ``y`` is not a floating-point tensor, or ``c`` is of an unknown type.
        ValueError: ``x`` or ``y`` is not 2-D, their feature sizes or devices differ, or ``c`` is not
            a finite positive number.
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
    curvature = as_curvature(c, torch.float64, x.device)
    _check_inputs(x, None if y is x else y, curvature)
    return torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton(x, None if y is x else y, curvature)


__all__ = ["pairwise_poincare_dist_triton", "triton_available", "OP_NAME", "BACKWARD_OP_NAME"]
