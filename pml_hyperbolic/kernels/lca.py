r"""HIER's LCA triplet rows as ``torch.library`` custom ops (namespace ``pml_hyperbolic``), each with
a fake (meta) implementation, the forward with a registered autograd formula.

``pml_hyperbolic::hier_lca_rows(dist, i, j, k, tau, margin, key, block, keep_grads) -> (loss, a, b)``:
for triplet rows t = (i_t, j_t, k_t) of the (N, P) distances D from N points to P candidates,

.. math::
    m^{1} = \max(D_i, D_j),\quad m^{2} = \max(m^{1}, D_k),\quad
    a = \arg\max_p(-m^{1}_p/\tau + g^{1}_p),\quad b = \arg\max_p(-m^{2}_p/\tau + g^{2}_p),

    \ell = [D_{ia} - D_{ib} + \delta]_+ + [D_{ja} - D_{jb} + \delta]_+ + [D_{kb} - D_{ka} + \delta]_+ ,

g the Gumbel noise of draws generated from ``key`` (None: g = 0). Its gradient is the hard path's
exact one plus the straight-through term of the softmaxes :math:`\pi^{r} = \operatorname{softmax}(-m^{r}/\tau
+ g^{r})` (the estimator of HIER's hard Gumbel-softmax; the formulas:
:class:`pml_hyperbolic.losses.HIERLoss` and :func:`triplet_rows`).
``pml_hyperbolic::hier_lca_rows_backward`` is that backward.

The op is a function of its inputs: the noise comes from ``key`` (a 0-d int64 tensor, drawn by the
caller), on CPU by the counter-based generator :func:`counter_uniform` (the values the native loop
generates), elsewhere by a ``torch.Generator`` of the tensors' device seeded with it. On CPU the rows
and the backward scatter run in the native library (:func:`pml_hyperbolic.kernels.native.lca_rows`,
:func:`~pml_hyperbolic.kernels.native.lca_backward`) when it is built and enabled, otherwise the torch
ops of :func:`triplet_rows` (the same choices, losses and gradients to rounding).

Why ops: one node to ``torch.compile`` and to autograd, checked by ``torch.library.opcheck``. The
forward's (T, P) gradient slabs are not outputs: the eager forward leaves them in a per-thread slot
keyed by the loss it belongs to, where the autograd registration picks them up (and hands them back
to :data:`_SPARE_GRADS` after the backward); where they are missing (a traced graph, a second
backward) the backward op recomputes them from the same key.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch
from torch import Tensor

from . import native as _native
from .build import values_checked
from .spare_buffers import SpareBuffers

__all__ = ["counter_uniform", "hier_lca_rows", "hier_lca_rows_backward", "lca_triplet_loss", "triplet_rows"]

_slot = threading.local()  # the last eager forward's (weakref to its loss, grads, on)

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = 2 ** 64 - 1


def _mix32(x: np.ndarray) -> np.ndarray:
    """The "lowbias32" integer hash on uint32 arrays (wrapping arithmetic), in place."""
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def counter_uniform(key: int, streams: np.ndarray, p: int, dtype: torch.dtype) -> torch.Tensor:
    r"""(len(streams), p) draws in [0, 1): draw q of stream s under the 64-bit ``key``,

    .. math::
        \sigma = \mathrm{splitmix64}(key + (s + 1)\gamma), \quad
        x = \mathrm{mix32}(\mathrm{mix32}(q + \sigma_{lo}) \oplus \sigma_{hi}),

    U = (x ≫ 8)·2⁻²⁴ in float32, (x·2²¹ + (mix32(x + γ_lo) ≫ 11))·2⁻⁵³ in float64 (γ the golden
    gamma 0x9E3779B97F4A7C15, arithmetic mod 2³² / 2⁶⁴).

    Args:
        key: the 64-bit key (an int in [0, 2⁶⁴)).
        streams: the stream numbers s (non-negative integers).
        p: draws per stream.
        dtype: torch.float32 or torch.float64.

    Returns:
        The (len(streams), p) CPU tensor of draws.

    Why a counter: the native loop generates the same values where it uses them (``pml_uniform_*`` in
    ``kernels/csrc/kernels.c``), in any row order or thread split; this numpy form serves the torch path.

    Design note: docs/design/kernels.md
    """
    s = np.asarray(streams, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + (s + np.uint64(1)) * np.uint64(_GOLDEN_GAMMA)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        lo = (z & np.uint64(0xFFFFFFFF)).astype(np.uint32)[:, None]
        hi = (z >> np.uint64(32)).astype(np.uint32)[:, None]
        x = _mix32(_mix32(np.arange(p, dtype=np.uint32)[None, :] + lo) ^ hi)
        if dtype == torch.float64:
            tail = _mix32(x + np.uint32(_GOLDEN_GAMMA & 0xFFFFFFFF)) >> np.uint32(11)
            bits = (x.astype(np.uint64) << np.uint64(21)) | tail.astype(np.uint64)
            return torch.from_numpy(bits.astype(np.float64) * 2.0 ** -53)
        return torch.from_numpy((x >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24))


class _CounterUniform:
    """The Gumbel noise's uniform draws on CPU, defined by a counter: the draws of LCA choice r
    (0: LCA(i, j), 1: LCA(i, j, k)) for triplet row t are stream 2t + r of :func:`counter_uniform`
    under ``key``. Nothing is stored or drawn ahead: the native loop generates each value where it
    uses it, in any row order or thread split, and a replay with the same key gives the same noise."""

    def __init__(self, key: int):
        self.key = int(key) & _MASK64

    def draws(self, choice: int, start: int, stop: int, p: int, dtype, device) -> torch.Tensor:
        """(stop − start, p) draws of ``choice`` for triplet rows start..stop."""
        streams = 2 * np.arange(start, stop, dtype=np.uint64) + np.uint64(choice)
        return counter_uniform(self.key, streams, p, dtype).to(device)


class _DeviceUniform:
    """Off the CPU: ``torch.rand`` on the device from a generator seeded with ``key``, drawn in the
    torch path's order (block by block, choice 0 then 1): the same key and block size, the same draws."""

    def __init__(self, key: int, device: torch.device):
        self.key = int(key) & _MASK64
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(self.key)

    def draws(self, choice: int, start: int, stop: int, p: int, dtype, device) -> torch.Tensor:
        return torch.rand(stop - start, p, dtype=dtype, device=device, generator=self._generator)


def _noise(key: Tensor | None, device: torch.device):
    """The uniform source of ``key`` (None: no noise) for tensors on ``device``."""
    if key is None:
        return None
    value = int(key.item()) & _MASK64
    return _CounterUniform(value) if device.type == "cpu" else _DeviceUniform(value, device)


# The (T, P) slabs the forward keeps for its backward (two natively: u¹, u², 33 MB at HIER's default
# 8,192 triplets × 512 proxies; three on the torch path), kept between calls on CPU: ~8,000 fresh
# pages per call otherwise (two calls per step, the batch's triplets and the proxies').
_SPARE_GRADS = SpareBuffers(capacity=2)


def _first_index_of(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(R,) long: the first column where each row of ``x`` (R, P) equals ``value`` (R, 1).

    With ``value`` a row max (min) this is ``argmax`` (``argmin``), lowest index on ties, in three
    vectorised passes: aten's CPU arg-reductions are scalar loops, slower than the three."""
    p = x.shape[1]
    hit = torch.eq(x, value, out=torch.empty_like(x))
    descending = torch.arange(p, 0, -1, device=x.device, dtype=x.dtype)  # p - column (exact in float)
    return (p - hit.mul_(descending).amax(dim=1)).long()


def _select_lca(m: torch.Tensor, tau: float, u: torch.Tensor | None, need_pi: bool):
    r"""Row-wise LCA choice :math:`\arg\max_p (z_p + g_p)` with :math:`z = -m/\tau`, and
    :math:`\pi = \operatorname{softmax}(z + g)` (None unless ``need_pi``). ``m`` is overwritten.

    ``u`` None: g = 0, the plain argmax (first maximum on ties) and softmax. Otherwise ``u`` holds
    U[0, 1) draws (the shape of ``m``) and g is Gumbel noise, drawn as the exponential
    race :math:`g_p = -\log E_p`, :math:`E_p = -\log U_p \sim \operatorname{Exp}(1)`: with
    :math:`e^{z_p + g_p} = e^{z_p}/E_p`, :math:`q_p = e^{z_p - \max z} / \log U_p = -e^{z_p + g_p - \max z}`,
    the choice is :math:`\arg\min q` and :math:`\pi = q / \sum q`: one logarithm per element
    instead of the two of :math:`-\log(-\log U)`, and no separate softmax (U = 0: weight 0)."""
    z = m.div_(-tau)
    z_max = z.amax(dim=1, keepdim=True)
    if u is None:
        choice = _first_index_of(z, z_max)
        return choice, (z.softmax(dim=1) if need_pi else None)
    log_u = u.log_()
    q = z.sub_(z_max).exp_().div_(log_u)
    choice = _first_index_of(q, q.amin(dim=1, keepdim=True))
    return choice, (q.div_(q.sum(dim=1, keepdim=True)) if need_pi else None)


def _route_through_maxima(dist, i, j, k, u):
    """(g_i, g_j, g_k) from the rows u = (u¹, u²) (2, T, P): through m² = max(m¹, D_k) and
    m¹ = max(D_i, D_j), ties to the first argument (the torch form of ``pml_lca_backward_*``)."""
    di, dj, dk = dist[i], dist[j], dist[k]
    g_k = torch.where(dk > torch.maximum(di, dj), u[1], torch.zeros_like(u[1]))
    g_m = (u[1] - g_k) - u[0]
    g_i = torch.where(di >= dj, g_m, torch.zeros_like(g_m))
    return g_i, g_m - g_i, g_k


def triplet_rows(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, tau: float, margin: float, noise, block: int,
                 need_grad: bool):
    r"""The forward's loop: per-triplet losses, choices and the backward's unit-factor rows.

    With :math:`w = [h_1>0] D_i + [h_2>0] D_j - [h_3>0] D_k` (:math:`h` the three hinges), the
    straight-through term's gradient of row t is :math:`c_t/\tau` times
    :math:`\partial/\partial m^{1} = -u^{1}`, :math:`\partial/\partial m^{2} = u^{2}`,
    :math:`u^{r} = \pi^{r} \odot (w - \langle \pi^{r}, w\rangle)`, routed through the maxima to
    :math:`D_i, D_j, D_k` (ties to the first argument).

    Args:
        dist: (N, P) distances, floating point.
        i: (T,) int64 rows of dist.
        j: (T,) int64 rows of dist.
        k: (T,) int64 rows of dist.
        tau: the softmax temperature (> 0).
        margin: the hinge margin δ.
        noise: None (no Gumbel noise) or a source with ``draws`` (:class:`_CounterUniform` runs natively).
        block: rows per block (temporaries that stay in cache).
        need_grad: also return the backward's rows.

    Returns:
        ``(loss, a, b, grads, on)``: loss (T,) in dist's dtype, the int64 choices a, b (T,); with
        ``need_grad`` the rows (u¹, u²) (2, T, P) of the native loop or the routed (g_i, g_j, g_k)
        (3, T, P) of the torch ops (from :data:`_SPARE_GRADS`: give them back when done) and the
        active hinges ``on`` (3, T) as 0/1 in dist's dtype, else None, None.

    Why the rows in the forward: all of the gradient but the row factor :math:`c_t/\tau` is known
    there, so the backward only scales, routes and scatters (autograd over the per-op form kept a
    dozen (T, P) intermediates and ran a backward kernel for each).

    Design note: docs/design/kernels.md
    """
    n, p = i.numel(), dist.shape[1]
    loss = dist.new_empty(n)
    a = torch.empty(n, dtype=torch.long, device=dist.device)
    b = torch.empty_like(a)
    on = dist.new_empty(3, n) if need_grad else None  # active hinges
    if dist.device.type == "cpu":  # one native pass per row (same formulas, same draws)
        u = _SPARE_GRADS.take((2, n, p), dist) if need_grad else None  # u¹, u²: routed in the backward
        done = _native.lca_rows(dist.contiguous(), i.contiguous(), j.contiguous(), k.contiguous(), tau, margin,
                                noise, block, u, on)
        if done is not None:
            return (*done, u, on)
        if u is not None:
            _SPARE_GRADS.give(u)
    grads = _SPARE_GRADS.take((3, n, p), dist) if need_grad else None  # unit-factor d/dD_i, d/dD_j, d/dD_k
    for start in range(0, n, block):
        rows = slice(start, start + block)
        di, dj, dk = (dist.index_select(0, idx[rows]) for idx in (i, j, k))
        m1 = torch.maximum(di, dj)
        if need_grad:  # routing through the maxima as 0/1 floats written straight into float
            # tensors (``out=``): bool masks, or converting them, are several times slower on CPU
            i_wins = torch.ge(di, dj, out=torch.empty_like(di))
            k_wins = torch.gt(dk, m1, out=torch.empty_like(di))
        m2 = torch.maximum(m1, dk)
        stop = min(n, start + block)
        u1, u2 = ((None, None) if noise is None else
                  (noise.draws(r, start, stop, p, dist.dtype, dist.device) for r in (0, 1)))
        a_r, pi1 = _select_lca(m1, tau, u1, need_grad)
        b_r, pi2 = _select_lca(m2, tau, u2, need_grad)
        a[rows], b[rows] = a_r, b_r
        a_col, b_col = a_r.view(-1, 1), b_r.view(-1, 1)
        h1 = di.gather(1, a_col) - di.gather(1, b_col) + margin  # (rows, 1)
        h2 = dj.gather(1, a_col) - dj.gather(1, b_col) + margin
        h3 = dk.gather(1, b_col) - dk.gather(1, a_col) + margin
        loss[rows] = (torch.relu(h1) + torch.relu(h2) + torch.relu(h3)).view(-1)
        if not need_grad:
            continue
        on1, on2, on3 = (h > 0 for h in (h1, h2, h3))
        on1, on2, on3 = on1.to(di.dtype), on2.to(di.dtype), on3.to(di.dtype)
        on[0, rows], on[1, rows], on[2, rows] = on1.view(-1), on2.view(-1), on3.view(-1)
        w = di.mul_(on1).addcmul_(dj, on2).addcmul_(dk, on3, value=-1.0)
        u1 = torch.mul(pi1, w)  # u = π ⊙ w − π ⟨π, w⟩
        u1.addcmul_(pi1, u1.sum(dim=1, keepdim=True), value=-1.0)
        u2 = w.mul_(pi2)
        u2.addcmul_(pi2, u2.sum(dim=1, keepdim=True), value=-1.0)
        g_i, g_j, g_k = grads[0, rows], grads[1, rows], grads[2, rows]
        torch.mul(u2, k_wins, out=g_k)  # m² = max(m¹, D_k): d/dm² to D_k where it is the larger
        g_m1 = u2.sub_(g_k).sub_(u1)  # the rest of d/dm², plus d/dm¹ = −u¹
        torch.mul(g_m1, i_wins, out=g_i)
        torch.sub(g_m1, g_i, out=g_j)
    return loss, a, b, grads, on


def _scatter(grad_loss: Tensor, dist: Tensor, i: Tensor, j: Tensor, k: Tensor, a: Tensor, b: Tensor,
             grads: Tensor, on: Tensor, tau: float) -> Tensor:
    """The (N, P) gradient of dist: the rows ``grads`` scaled by grad_loss/τ and scattered to rows i, j,
    k (natively on CPU, with the routing of u¹, u²), plus the hard path: +c at LCA(i, j), −c at
    LCA(i, j, k) (reversed for k), through the active hinges ``on``."""
    p = dist.shape[1]
    scale = (grad_loss / tau).contiguous()
    grad = dist.new_zeros(dist.shape[0], p)
    if grads.shape[0] == 2:  # the native forward's u¹, u²: routed and scattered natively in one pass
        if not _native.lca_backward(grad, dist.contiguous(), i.contiguous(), j.contiguous(), k.contiguous(),
                                    grads, scale):
            grads = torch.stack(_route_through_maxima(dist, i, j, k, grads))  # (native switched off since)
    if grads.shape[0] == 3:  # grad[idx] += grads[r] · scale
        scaled = torch.empty_like(grads[0])  # one buffer for the three: the given ones stay intact
        for r, idx in enumerate((i, j, k)):
            grad.index_add_(0, idx, torch.mul(grads[r], scale.view(-1, 1), out=scaled))
    hard = on * grad_loss.view(1, -1)  # (3, T)
    flat = grad.view(-1)
    for r, (idx, sign) in enumerate(((i, 1.0), (j, 1.0), (k, -1.0))):
        flat.index_add_(0, idx * p + a, hard[r], alpha=sign).index_add_(0, idx * p + b, hard[r], alpha=-sign)
    return grad


def _check_args(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, tau: float, margin: float, key: Tensor | None,
                block: int) -> None:
    """The checks that need no data (shapes, dtypes, devices, scalars): the fake implementations run
    them too."""
    if not dist.is_floating_point():
        raise TypeError(f"dist must be a floating-point tensor, got {dist.dtype}")
    if dist.ndim != 2:
        raise ValueError(f"dist must be (N, P), got shape {tuple(dist.shape)}")
    for name, index in (("i", i), ("j", j), ("k", k)):
        if index.dtype != torch.long:
            raise TypeError(f"{name} must be an int64 index tensor, got {index.dtype} (convert it with .long())")
        if index.ndim != 1 or index.shape != i.shape:
            raise ValueError(f"i, j, k must be 1-D of one length, got {tuple(i.shape)}, {tuple(j.shape)}, "
                             f"{tuple(k.shape)}")
        if index.device != dist.device:
            raise ValueError(f"{name} must be on dist's device {dist.device}, got {index.device}")
    if not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
    if not math.isfinite(margin):
        raise ValueError(f"margin must be finite, got {margin!r}")
    if key is not None and (key.dtype != torch.long or key.ndim != 0):
        raise TypeError(f"key must be None or a 0-d int64 tensor, got {key.dtype} of shape {tuple(key.shape)}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")


def _check_rows(n: int, i: Tensor, j: Tensor, k: Tensor) -> None:
    """ValueError naming the first of i, j, k with an entry outside [0, n) (one device read for the three).

    Read where :func:`~pml_hyperbolic.kernels.build.values_checked` says (CPU; accelerators on
    request): elsewhere an index out of range stops the device's gather with its own error."""
    if i.numel() == 0 or not values_checked(i):
        return
    bounds = torch.stack([torch.stack([t.min(), t.max()]) for t in (i, j, k)]).tolist()
    for name, (low, high) in zip("ijk", bounds):
        if low < 0 or high >= n:
            raise ValueError(f"{name}: row indices must lie in [0, {n}) (the rows of dist), got values in "
                             f"[{low}, {high}]")


def _check_grads(dist: Tensor, i: Tensor, grads: Tensor | None, on: Tensor | None) -> None:
    if (grads is None) != (on is None):
        raise ValueError("grads and on must be given together (the forward's rows) or both be None (recomputed)")
    if grads is None:
        return
    t, p = i.shape[0], dist.shape[1]
    if grads.ndim != 3 or grads.shape[0] not in (2, 3) or tuple(grads.shape[1:]) != (t, p) or grads.dtype != dist.dtype:
        raise ValueError(f"grads must be (2 or 3, T={t}, P={p}) in {dist.dtype}, "
                         f"got {tuple(grads.shape)} {grads.dtype}")
    if tuple(on.shape) != (3, t) or on.dtype != dist.dtype:
        raise ValueError(f"on must be (3, T={t}) in {dist.dtype}, got {tuple(on.shape)} {on.dtype}")


@torch.library.custom_op("pml_hyperbolic::hier_lca_rows", mutates_args=())
def hier_lca_rows(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, tau: float, margin: float, key: Tensor | None,
                  block: int, keep_grads: bool) -> tuple[Tensor, Tensor, Tensor]:
    r"""HIER's per-triplet LCA losses and choices.

    .. math:: \ell_t = [D_{i_t a_t} - D_{i_t b_t} + \delta]_+ + [D_{j_t a_t} - D_{j_t b_t} + \delta]_+
              + [D_{k_t b_t} - D_{k_t a_t} + \delta]_+

    with :math:`a_t = \operatorname{LCA}(i_t, j_t)`, :math:`b_t = \operatorname{LCA}(i_t, j_t, k_t)`
    chosen by the (noisy) softmin of the rows' maxima (the module docstring).

    Args:
        dist: (N, P) distances from N points to P candidates, floating point.
        i: (T,) int64 anchor rows of dist.
        j: (T,) int64 positive rows of dist.
        k: (T,) int64 negative rows of dist.
        tau: the softmax temperature (> 0).
        margin: the hinge margin δ.
        key: a 0-d int64 tensor keying the Gumbel noise, or None for no noise.
        block: rows per block of the loop (memory only: the results do not depend on it on CPU).
        keep_grads: keep the backward's rows for the autograd registration (a backward will come).

    Returns:
        ``(loss, a, b)``: loss (T,) in dist's dtype, a and b (T,) int64 candidate indices.

    Raises:
        TypeError: dist not floating point, an index tensor not int64, key not a 0-d int64 tensor.
        ValueError: wrong shapes or devices, tau ≤ 0, margin not finite, block < 1, or an index of
            i, j, k outside [0, N) (checked before anything is read).

    Why explicit key: the op is a function of its inputs (a replay, a traced graph and the backward's
    recomputation draw the same noise).

    Design note: docs/design/kernels.md
    """
    _check_args(dist, i, j, k, tau, margin, key, block)
    _check_rows(dist.shape[0], i, j, k)
    loss, a, b, grads, on = triplet_rows(dist, i, j, k, tau, margin, _noise(key, dist.device), block, keep_grads)
    if keep_grads:
        _slot.last = (weakref.ref(loss), grads, on)
    return loss, a, b


@hier_lca_rows.register_fake
def _hier_lca_rows_fake(dist, i, j, k, tau, margin, key, block, keep_grads):
    _check_args(dist, i, j, k, tau, margin, key, block)
    t = i.shape[0]
    return dist.new_empty(t), i.new_empty(t), i.new_empty(t)


def _hier_lca_rows_setup(ctx, inputs, output):
    dist, i, j, k, tau, margin, key, block, _ = inputs
    loss, a, b = output
    last = getattr(_slot, "last", None)
    _slot.last = None
    fresh = last is not None and last[0]() is loss
    ctx.grads, ctx.on = (last[1], last[2]) if fresh else (None, None)
    ctx.mark_non_differentiable(a, b)
    ctx.save_for_backward(dist, i, j, k, a, b, key)
    ctx.tau, ctx.margin, ctx.block = tau, margin, block


def _hier_lca_rows_backward(ctx, grad_loss, _grad_a, _grad_b):
    dist, i, j, k, a, b, key = ctx.saved_tensors
    grads, on = ctx.grads, ctx.on
    ctx.grads = ctx.on = None  # consumed: a second backward recomputes them
    if grad_loss is None:
        grad_loss = dist.new_zeros(i.shape[0])
    grad = torch.ops.pml_hyperbolic.hier_lca_rows_backward(grad_loss, dist, i, j, k, a, b, grads, on, ctx.tau,
                                                            ctx.margin, key, ctx.block)
    if grads is not None and dist.device.type == "cpu":  # the buffer serves the next call
        _SPARE_GRADS.give(grads)
    return grad, None, None, None, None, None, None, None, None


hier_lca_rows.register_autograd(_hier_lca_rows_backward, setup_context=_hier_lca_rows_setup)


@torch.library.custom_op("pml_hyperbolic::hier_lca_rows_backward", mutates_args=())
def hier_lca_rows_backward(grad_loss: Tensor, dist: Tensor, i: Tensor, j: Tensor, k: Tensor, a: Tensor, b: Tensor,
                           grads: Tensor | None, on: Tensor | None, tau: float, margin: float, key: Tensor | None,
                           block: int) -> Tensor:
    r"""Backward of :func:`hier_lca_rows`: the gradient of :math:`\sum_t c_t \ell_t` with respect to dist.

    .. math:: \nabla D = \sum_t c_t \big(\text{hard path}_t + \tfrac{1}{\tau}\,
              \mathrm{route}(-u^{1}_t, u^{2}_t)\big)

    (hard path: ±1 at the chosen candidates through each active hinge; the routing and :math:`u^{r}`:
    :func:`triplet_rows`).

    Args:
        grad_loss: (T,) upstream gradient c.
        dist: the forward's dist.
        i: the forward's i.
        j: the forward's j.
        k: the forward's k.
        a: the forward's LCA(i, j) choices.
        b: the forward's LCA(i, j, k) choices.
        grads: the forward's rows ((2, T, P) native or (3, T, P) torch), or None to recompute them.
        on: the forward's active hinges (3, T), or None (with grads).
        tau: the forward's tau.
        margin: the forward's margin.
        key: the forward's key (the recomputation draws the same noise).
        block: the forward's block.

    Returns:
        The (N, P) gradient of dist.

    Raises:
        ValueError: grads and on not given together, or of the wrong shapes (and the forward's checks).

    Why one op: the recomputation and the native scatter stay opaque to a traced graph.

    Design note: docs/design/kernels.md
    """
    _check_args(dist, i, j, k, tau, margin, key, block)
    _check_grads(dist, i, grads, on)
    _check_rows(dist.shape[0], i, j, k)
    own = grads is None
    if own:
        _, _, _, grads, on = triplet_rows(dist, i, j, k, tau, margin, _noise(key, dist.device), block, True)
    grad = _scatter(grad_loss, dist, i, j, k, a, b, grads, on, tau)
    if own and dist.device.type == "cpu":
        _SPARE_GRADS.give(grads)
    return grad


@hier_lca_rows_backward.register_fake
def _hier_lca_rows_backward_fake(grad_loss, dist, i, j, k, a, b, grads, on, tau, margin, key, block):
    _check_args(dist, i, j, k, tau, margin, key, block)
    _check_grads(dist, i, grads, on)
    return torch.empty_like(dist, memory_format=torch.contiguous_format)


def lca_triplet_loss(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, *, tau: float, margin: float,
                     key: Tensor | None = None, block: int = 512) -> tuple[Tensor, Tensor, Tensor]:
    r"""Per-triplet HIER losses through ``pml_hyperbolic::hier_lca_rows``, keeping the backward's rows
    when a backward can come.

    .. math:: \ell_t = [D_{i_t a_t} - D_{i_t b_t} + \delta]_+ + [D_{j_t a_t} - D_{j_t b_t} + \delta]_+
              + [D_{k_t b_t} - D_{k_t a_t} + \delta]_+

    Args:
        dist: (N, P) distances.
        i: (T,) int64 rows.
        j: (T,) int64 rows.
        k: (T,) int64 rows.
        tau: the softmax temperature (> 0).
        margin: the hinge margin δ.
        key: a 0-d int64 tensor keying the Gumbel noise, or None for none.
        block: rows per block of the loop.

    Returns:
        ``(loss, a, b)`` (:func:`hier_lca_rows`).

    Raises:
        TypeError: as :func:`hier_lca_rows`.
        ValueError: as :func:`hier_lca_rows`.

    Why a wrapper: whether a backward can come is known here, not inside the op.

    Design note: docs/design/kernels.md
    """
    keep = torch.is_grad_enabled() and dist.requires_grad
    return torch.ops.pml_hyperbolic.hier_lca_rows(dist, i, j, k, float(tau), float(margin), key, int(block), keep)
