"""The native kernels' entry points for torch tensors: each checks that it applies (a contiguous
CPU float32/float64 tensor of the expected shape, the native path enabled and built) and runs the
compiled operator (``csrc/kernels.c`` through ``csrc/ops.cpp``, built by
:mod:`pml_hyperbolic.kernels.build`), or declines (returns False or None) and the caller takes the
torch path, with the same results within the kernels' tolerances. An entry point never raises for
an environment reason: no compiler, a failed build or self-check, a wrong dtype, device or layout
all mean "declined".

The kernels: :func:`distance_tail` (the fused one-pass tail W = P·q_j, S = √(W + W²/2),
D = log1p(W + √2·S)/√c of :func:`pml_hyperbolic.kernels.tail._distance_tail`), the symmetric tail
and gradient weights for x is y, the radius row terms, and HIER's LCA rows, their counter-based
random numbers and their backward scatter. Thread splits are computed here (row ranges of about
equal work) and run on torch's intra-op threads.

Design note: docs/design/native-code.md
"""
from __future__ import annotations

import torch
from torch import Tensor

from .build import enabled, library, reset, status, switched_on

__all__ = ["distance_tail", "enabled", "general_distance_tail", "lca_backward", "lca_rows", "reset", "row_terms",
           "status", "switched_on", "symmetric_distance_tail", "symmetric_gradient_weights", "uniform_rows"]

# Below this many elements a call runs on one thread (a thread hand-off costs more than it saves).
_MIN_ELEMENTS_PER_THREAD = 1 << 16


def _signed64(key: int) -> int:
    """An unsigned 64-bit key as the int64 an operator takes (the same bits)."""
    key = int(key) & (2 ** 64 - 1)
    return key - 2 ** 64 if key >= 2 ** 63 else key


def distance_tail(P: Tensor, S: Tensor | None, col_scale: Tensor, inv_sqrt_c: float, threads: int = 1) -> bool:
    """In place: P → D = log1p(W + √2·S)/√c with W = P·col_scale[j], S = √(W + W²/2) written into
    ``S`` (or not, when None). Returns False (nothing written) when the native path does not apply:
    disabled, unavailable, not CPU, not float32/float64, dtypes differ, not contiguous, not 2-D.

    ``threads`` > 1 splits the rows over that many of torch's threads, for calls large enough to
    pay for the hand-off."""
    if not enabled() or P.device.type != "cpu" or P.dtype not in (torch.float32, torch.float64):
        return False
    if P.ndim != 2 or col_scale.shape != (P.shape[1],) or col_scale.dtype != P.dtype:
        return False
    if not (P.is_contiguous() and col_scale.is_contiguous() and col_scale.device.type == "cpu"):
        return False
    if S is not None and (S.shape != P.shape or S.dtype != P.dtype or not S.is_contiguous()
                          or S.device.type != "cpu"):
        return False
    if P.numel() == 0:
        return True
    lib = library()
    if lib is None:
        return False
    n = P.shape[0]
    parts = max(1, min(int(threads), n, P.numel() // _MIN_ELEMENTS_PER_THREAD))
    lib._native_tail_(P, S, col_scale, inv_sqrt_c, [n * k // parts for k in range(parts + 1)])
    return True


# Rows per band of the symmetric loops (PML_SYM_ROWS in csrc/kernels.c).
_SYM_TILE = 16


def _usable(*tensors: Tensor) -> bool:
    """Contiguous CPU tensors of one dtype, float32 or float64."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.float64) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def _tile_row_bounds(n: int, threads: int, first: int = 0, end: int | None = None) -> list[int]:
    """Band boundaries splitting bands [first, end) of the upper triangle of an n×n matrix (all
    bands by default) into ``threads`` parts of about equal area (band t of n_bands holds about
    n_bands - t blocks), fewer for small parts."""
    tiles = -(-n // _SYM_TILE)
    end = tiles if end is None else min(end, tiles)
    sizes = [tiles - t for t in range(first, end)]
    total = float(sum(sizes))
    parts = max(1, min(int(threads), len(sizes), int(total * _SYM_TILE * _SYM_TILE) // _MIN_ELEMENTS_PER_THREAD))
    bounds, done, t = [first], 0.0, first
    for k in range(1, parts):
        while t < end and done < total * k / parts:
            done += tiles - t
            t += 1
        bounds.append(t)
    bounds.append(end)
    return sorted(set(bounds))


def symmetric_distance_tail(G: Tensor, S: Tensor | None, x2: Tensor, p2: Tensor, q: Tensor,
                            inv_sqrt_c: float, close_factor: float, threads: int = 1,
                            rows: tuple[int, int] | None = None) -> int | None:
    """In place, for x is y: ``G`` holds x xᵀ on and above its diagonal; afterwards it holds the full
    symmetric distance matrix D, and ``S``, when given, S = √(W + W²/2) on and above its diagonal
    (its lower triangle is left as it was), with s = x2_i + x2_j − 2G_ij, W = s·p2_i·q_j. Pairs with
    s < close_factor·(x2_i + x2_j) get D = −1 (to be recomputed by the caller); returns their
    number (both orientations), or None (nothing written) when the native path does not apply.
    ``rows = (begin, end)`` (multiples of the band height, 16, except an end at n) does the pairs
    (i, j > i) of those rows only (with their mirror): the caller runs it on each block of the
    Gram product right after that block, while it is still in cache (:func:`symmetric_tail_runner`
    checks the arguments once for all the blocks)."""
    run = symmetric_tail_runner(G, S, x2, p2, q, inv_sqrt_c, close_factor)
    if run is None:
        return None
    n = G.shape[0]
    return run(*((0, n) if rows is None else rows), threads=threads)


def symmetric_tail_runner(G: Tensor, S: Tensor | None, x2: Tensor, p2: Tensor, q: Tensor,
                          inv_sqrt_c: float, close_factor: float):
    """:func:`symmetric_distance_tail` with its arguments checked once: returns
    ``run(begin, end, threads=1) -> count`` for row ranges of the same matrices, or None when the
    native path does not apply. The symmetric forward calls the tail once per Gram block: checking
    the arguments once instead of per block saves a visible share of the forward
    (docs/design/native-code.md); ``run`` itself is one operator call per block."""
    if not enabled() or G.ndim != 2 or G.shape[0] != G.shape[1] or not _usable(G, x2, p2, q):
        return None
    n = G.shape[0]
    if any(t.shape != (n,) for t in (x2, p2, q)) or (S is not None and (S.shape != G.shape or not _usable(G, S))):
        return None
    lib = library()
    if lib is None:
        return None
    fn = lib._native_sym_tail_

    def run(begin: int, stop: int, threads: int = 1) -> int:
        if begin % _SYM_TILE or (stop % _SYM_TILE and stop != n) or not 0 <= begin <= stop <= n:
            raise ValueError(f"rows must be band-aligned ({_SYM_TILE}) within [0, {n}], got {(begin, stop)}")
        if n == 0:
            return 0
        first, end = begin // _SYM_TILE, -(-stop // _SYM_TILE)
        bounds = [first, end] if threads <= 1 else _tile_row_bounds(n, threads, first, end)
        return fn(G, S, x2, p2, q, inv_sqrt_c, close_factor, bounds)

    return run


def general_distance_tail(G: Tensor, S: Tensor | None, x2: Tensor, p2: Tensor, y2: Tensor, q: Tensor,
                          inv_sqrt_c: float, close_factor: float, threads: int = 1) -> int | None:
    """In place, for x not y: ``G`` (N, M) holds x yᵀ; afterwards it holds the distance matrix D, and
    ``S``, when given, S = √(W + W²/2), with s = x2_i + y2_j − 2G_ij and W = s·p2_i·q_j. Pairs with
    s < close_factor·(x2_i + y2_j) get D = −1 (to be recomputed by the caller); returns their number,
    or None (nothing written) when the native path does not apply. ``threads`` > 1 splits the rows."""
    if not enabled() or G.ndim != 2 or not _usable(G, x2, p2, y2, q):
        return None
    n, m = G.shape
    if x2.shape != (n,) or p2.shape != (n,) or y2.shape != (m,) or q.shape != (m,):
        return None
    if S is not None and (S.shape != G.shape or not _usable(G, S)):
        return None
    if G.numel() == 0:
        return 0
    lib = library()
    if lib is None:
        return None
    parts = max(1, min(int(threads), n, G.numel() // _MIN_ELEMENTS_PER_THREAD))
    return lib._native_gen_tail_(G, S, x2, p2, y2, q, inv_sqrt_c, close_factor,
                                 [n * k // parts for k in range(parts + 1)])


def symmetric_gradient_weights(U: Tensor, S: Tensor, threads: int = 1) -> bool:
    """In place, for x is y: S (from :func:`symmetric_distance_tail`: only its part on and above the
    diagonal is read) becomes E = U/S + (U/S)ᵀ, i.e. (U_ij + U_ji)/S_ij off the diagonal and 0 on
    it. ``U`` may have any strides (a broadcast upstream gradient, as from ``D.sum().backward()``,
    is read in place: making it contiguous would cost a pass over n² elements).
    Returns False (nothing written) when the native path does not apply."""
    if not enabled() or S.ndim != 2 or S.shape[0] != S.shape[1] or U.shape != S.shape:
        return False
    if not _usable(S) or U.dtype != S.dtype or U.device.type != "cpu":
        return False
    n = S.shape[0]
    if n == 0:
        return True
    lib = library()
    if lib is None:
        return False
    lib._native_sym_grad_(U, S, _tile_row_bounds(n, threads))
    return True


def row_terms(x: Tensor, c: float, floor: float, extreme: tuple[float, float] | None = None):
    """(‖x_i‖², 1/max(1 − c‖x_i‖², floor)) in float64 for the rows of a contiguous CPU float32/float64
    ``x`` (eight partial sums per row, so that the loop vectorises, unlike ``x.double()`` and
    ``vecdot``), or None when the native path does not apply.

    With ``extreme = (inv_a_bound, tiny_sq_norm)`` (the symmetric forward), the same pass also
    returns the symmetric tail's row vectors in x's dtype, ``(x2, 2c·inv_a, inv_a)`` rounded as
    ``.to(dtype)`` rounds them, whether any row has x2 ≠ 0 (NaN counts) and whether any row is
    extreme (inv_a > inv_a_bound or 0 < x2 < tiny_sq_norm): ``(x2, inv_a, vectors, any_nonzero,
    any_extreme)``."""
    if not enabled() or x.ndim != 2 or not _usable(x) or x.numel() == 0:
        return None
    lib = library()
    if lib is None:
        return None
    if extreme is None:
        x2, inv_a, _, _, _ = lib._native_row_terms(x, float(c), float(floor), 0.0, 0.0, False)
        return x2, inv_a
    x2, inv_a, vectors, nonzero, n_extreme = lib._native_row_terms(x, float(c), float(floor), float(extreme[0]),
                                                                   float(extreme[1]), True)
    return x2, inv_a, tuple(vectors.unbind(0)), nonzero > 0, n_extreme > 0


# An LCA element (two exponentials and logarithms) costs several times a distance-tail element,
# so a part pays for a thread hand-off at fewer elements (32k against 256k).
_LCA_MIN_ELEMENTS_PER_THREAD = 1 << 15


def lca_rows(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, tau: float, margin: float, noise, block: int,
             grads: Tensor | None, on: Tensor | None, threads: int | None = None):
    """HIER's LCA triplet rows natively (``pml_lca_rows_*`` in ``csrc/kernels.c``): fills ``loss``,
    ``a``, ``b`` and, when given, ``grads`` (2, T, P: the rows u¹, u² of the straight-through
    estimator, before their routing through the maxima, which :func:`lca_backward` does) and ``on``
    (3, T), with the formulas of ``kernels.lca.triplet_rows``'s torch ops. ``noise``: None (no
    Gumbel noise) or a ``kernels.lca._CounterUniform``, whose draws the C loop generates from its ``key``
    where it uses them (the same values as the source's ``draws``). ``block`` rows at a time, shared by ``threads``
    (default: torch's count). Returns (loss, a, b), or None when the native path does not apply
    (also for a noise source that is not counter-based). Raises IndexError for an index of i, j, k
    outside [0, N), before anything is read (the C loop checks them too)."""
    if noise is not None and not isinstance(getattr(noise, "key", None), int):
        return None
    if not enabled() or dist.ndim != 2 or not _usable(dist) or (grads is not None and not _usable(dist, grads, on)):
        return None
    if any(t.dtype != torch.long or t.device.type != "cpu" or not t.is_contiguous() for t in (i, j, k)):
        return None
    if grads is not None and tuple(grads.shape) != (2, i.numel(), dist.shape[1]):
        return None
    if i.shape != j.shape or i.shape != k.shape or i.ndim != 1:
        raise ValueError(f"i, j, k must be 1-D of one length, got {tuple(i.shape)}, {tuple(j.shape)}, {tuple(k.shape)}")
    _check_rows(dist.shape[0], i, j, k)
    lib = library()
    if lib is None:
        return None
    n, p = i.numel(), dist.shape[1]
    if p >= 2 ** 31:  # the loop's candidate indices and draw counters are 32-bit lanes
        return None
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    loss = dist.new_empty(n)
    a = torch.empty(n, dtype=torch.long)
    b = torch.empty(n, dtype=torch.long)
    work = dist.new_empty(threads, 2 * p)  # each part's two rows of scratch
    key = 0 if noise is None else _signed64(noise.key)
    for start in range(0, n, block):
        stop = min(n, start + block)
        parts = max(1, min(threads, (stop - start) * p // _LCA_MIN_ELEMENTS_PER_THREAD))
        bounds = [start + (stop - start) * q // parts for q in range(parts + 1)]
        code = lib._native_lca_rows_(dist, i, j, k, 1.0 / tau, margin, noise is not None, key, loss, a, b, grads, on,
                                     work, bounds)
        if code:  # (the check above makes this unreachable: the C loop's own bounds check)
            raise IndexError(f"lca_rows: a row index outside [0, {dist.shape[0]})")
    return loss, a, b


def _check_rows(n: int, *indices: Tensor) -> None:
    """IndexError unless every entry of the int64 ``indices`` lies in [0, n)."""
    for index in indices:
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"index out of range [0, {n})")


def uniform_rows(key: int, first_row: int, rows: int, p: int, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """(rows, p) of the counter-based draws that ``lca_rows`` generates for streams ``first_row``..
    under ``key`` (``pml_uniform_rows_*``), or None without the native library. For checking the
    numpy form in ``kernels.lca._CounterUniform`` against the C loop's."""
    lib = library()
    if lib is None:
        return None
    out = torch.empty(rows, p, dtype=dtype)
    lib._native_uniform_rows_(_signed64(key), _signed64(first_row), out)
    return out


def lca_backward(grad: Tensor, dist: Tensor, i: Tensor, j: Tensor, k: Tensor, u: Tensor, scale: Tensor,
                 threads: int | None = None) -> bool:
    """HIER's backward scatter (``pml_lca_backward_*``): adds to ``grad`` (N, P), zero or not, the rows
    ``u`` (2, T, P) of :func:`lca_rows` routed through the maxima of ``dist`` (N, P) rows i, j, k and
    scaled by ``scale`` (T,): per row t, ``grad[i_t] += g_i s_t``, then j, then k (the formulas in
    ``csrc/kernels.c``). Contiguous CPU tensors of one dtype, int64 indices in [0, N) (checked before
    anything is written). ``threads`` (default torch's count) take disjoint ranges of grad's rows, each
    scanning every t in order: the same additions in the same order as one thread, bit for bit.
    Returns False (nothing written) when the native path does not apply."""
    if not enabled() or grad.ndim != 2 or u.ndim != 3 or not _usable(grad, dist, u, scale):
        return False
    n, p = dist.shape
    rows = i.numel()
    if grad.shape != (n, p) or u.shape != (2, rows, p) or scale.shape != (rows,):
        return False
    if any(index.shape != (rows,) or index.dtype != torch.long or index.device.type != "cpu"
           or not index.is_contiguous() for index in (i, j, k)):
        return False
    _check_rows(n, i, j, k)
    lib = library()
    if lib is None:
        return False
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    parts = max(1, min(threads, n, 3 * rows * p // _LCA_MIN_ELEMENTS_PER_THREAD))
    bounds = [n * q // parts for q in range(parts + 1)]
    if lib._native_lca_backward_(grad, dist, i, j, k, u, scale, bounds):
        raise IndexError(f"lca_backward: a row index outside [0, {n})")  # (unreachable after _check_rows)
    return True
