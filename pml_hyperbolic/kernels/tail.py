r"""The pairwise distance's elementwise tail and its symmetric forward.

From :math:`P` (the Gram product, :mod:`pml_hyperbolic.kernels.gram`) and the column scale
:math:`q_j`: :math:`W = P_{ij} q_j`, :math:`S = \sqrt{W + W^2/2}`, :math:`D = \operatorname{log1p}(W +
\sqrt2 S)/\sqrt c`, in row blocks that stay in cache, or in one fused native pass
(:mod:`pml_hyperbolic.kernels.native`). For x is y the symmetric forward computes the product on and
above the diagonal only and evaluates each unordered pair once. Why separate: the tail is where the
native code and the torch reference meet; both must give the same numbers within the tolerances.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import native as _native
from .gram import (_MAX_CLOSE_FRACTION, _PLAIN_LOG_MIN_W, _SQRT2, _TAIL_BLOCK_ELEMENTS, _TARGET_REL_ERROR, _dist_from_w,
                   _explicit_w, _gram_error)
from .spare_buffers import SpareBuffers

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
    (:mod:`pml_hyperbolic.kernels.native`, ``kernels/csrc/kernels.c``: its own vectorised log1p, within an ulp);
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


def general_enabled() -> bool:
    """False when ``PML_HYPERBOLIC_GENERAL=0``: x is not y then takes the torch prefilter and the plain tail."""
    return _native.switched_on("PML_HYPERBOLIC_GENERAL")


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


def _recompute_marked(G: Tensor, S: Tensor | None, n_close: int | None, x: Tensor, y: Tensor, inv_a: Tensor,
                      inv_b: Tensor, cf: float):
    """After a native tail that marked its close pairs with D = −1 and counted them: those pairs' D from
    explicit float64 differences, as ``(D, S, rows, cols, w_close)``; None (S given back) when the tail did
    not run or a float32 batch has more than ``_MAX_CLOSE_FRACTION`` close pairs (the caller's general path
    then redoes the product in float64)."""
    dtype = G.dtype
    if n_close is None or (dtype == torch.float32 and n_close > _MAX_CLOSE_FRACTION * G.numel()):
        if S is not None:
            _give_scratch(S)
        return None
    if n_close:
        rows, cols = torch.nonzero(G < 0, as_tuple=True)
        w_close = _explicit_w(x, y, rows, cols, inv_a, inv_b, cf)
        G[rows, cols] = _dist_from_w(w_close, cf, dtype)
    else:
        rows = cols = torch.zeros(0, dtype=torch.long)
        w_close = inv_a.new_zeros(0)
    return G, S, rows, cols, w_close


def _general_forward(x: Tensor, y: Tensor, x2: Tensor, inv_a: Tensor, y2: Tensor, inv_b: Tensor, cf: float,
                     keep_S: bool):
    """The forward for x is not y on CPU through the native general tail
    (:func:`pml_hyperbolic.kernels.native.general_distance_tail`): one Gram product x yᵀ, then one pass that
    tests closeness, evaluates D (and S) and marks the close pairs, which are recomputed from explicit
    differences in float64. The closeness test is the one of :func:`_gram_W` (the same f), applied to
    s = ‖x_i‖² + ‖y_j‖² − 2 x_i·y_j: the prefilter's row minimum and the augmented product's scaling are
    folded into that one pass. Returns (D, S, rows, cols, w_close), or None when this path does not apply
    (not CPU float32 / float64, no native library, or a float32 batch with more than
    ``_MAX_CLOSE_FRACTION`` close pairs, which the general path redoes in float64); nothing is then kept.
    The caller keeps extreme points off this path."""
    dtype = x.dtype
    if (x.device.type != "cpu" or dtype not in (torch.float32, torch.float64) or y.dtype != dtype
            or not _native.enabled() or _native.status() != "native"):
        return None
    G = torch.mm(x, y.T)
    S = _take_scratch(G) if keep_S else None
    factor = _gram_error(dtype, x.shape[1] + 2) / _TARGET_REL_ERROR[dtype]
    n_close = _native.general_distance_tail(G, S, x2.to(dtype), ((2.0 * cf) * inv_a).to(dtype), y2.to(dtype),
                                            inv_b.to(dtype), 1.0 / math.sqrt(cf), factor, torch.get_num_threads())
    return _recompute_marked(G, S, n_close, x, y, inv_a, inv_b, cf)


def _symmetric_forward(x: Tensor, x2: Tensor, inv_a: Tensor, cf: float, keep_S: bool,
                       row_vectors: tuple | None = None):
    """The forward for x is y on CPU through the native symmetric tail
    (:func:`pml_hyperbolic.kernels.native.symmetric_distance_tail`): the Gram product x xᵀ only on and
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
    return _recompute_marked(G, S, n_close, x, x, inv_a, inv_a, cf)


