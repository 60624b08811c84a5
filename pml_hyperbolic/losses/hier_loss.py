"""HIER: hierarchical-proxy regulariser (Kim, Jeong, Kwak, CVPR 2023)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..kernels import native as _native
from .. import poincare_ball as pb
from ..manifold_tensors import AcceptsManifoldTensors
from .._batch_utils import self_match_mask
from ..kernels.spare_buffers import SpareBuffers
from ._common import check_labels, check_nonnegative, check_positive, index_tensors, require_ref_labels

_POSITIVES = ("labels", "labels+mutual_nn")
# Elements of (rows × proxies) per block of the triplet computation: temporaries of ~1 MiB (float32)
# stay in cache and are recycled by the allocator instead of faulting in fresh pages every time.
_BLOCK_ELEMENTS = 1 << 18
# On a GPU the same loop is bound by kernel launches (about twenty ops per block, sixteen blocks per
# call at the defaults): one block of up to 8M elements (~400 MB of float32 temporaries at most;
# the trade of memory for time: docs/design/hier-loss.md).
_BLOCK_ELEMENTS_GPU = 1 << 23


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _mutual_nn(dist: torch.Tensor, k: int, exclude: torch.Tensor, symmetric: bool = False) -> torch.Tensor:
    """(Q, R) bool: j is among the k nearest refs of i AND i among the k nearest queries of j.

    ``symmetric``: ``dist`` and ``exclude`` are exactly symmetric (the proxies' distances), so the
    k nearest queries of column j are the k nearest refs of row j: one ``topk`` instead of two."""
    d = dist.masked_fill(exclude, float("inf"))
    q, r = d.shape
    row = torch.zeros_like(exclude)
    if min(k, r) > 0:
        row.scatter_(1, d.topk(min(k, r), dim=1, largest=False).indices, True)
    if symmetric:
        col = row.T
    else:
        col = torch.zeros_like(exclude)
        if min(k, q) > 0:
            col.scatter_(0, d.topk(min(k, q), dim=0, largest=False).indices, True)
    return row & col & ~exclude


def _flat_nonzero(mask: torch.Tensor) -> torch.Tensor:
    """(K,) long: the row-major flat indices of ``mask``'s True entries (``nonzero`` order). On CPU by
    numpy's ``flatnonzero``, faster than aten's ``nonzero`` on HIER's B × B masks."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.contiguous().numpy()))
    return mask.reshape(-1).nonzero().squeeze(1)


def _triplets_from_masks(pos: torch.Tensor, neg: torch.Tensor, max_triplets: int):
    """Ordered triplets (a, p, n) with pos[a, p] and neg[a, n], memory O(Q·R + T).

    All of them (in a fixed order) if there are at most ``max_triplets``; otherwise
    ``max_triplets`` drawn uniformly with replacement from the set of all of them (pair drawn
    with probability ∝ its anchor's negative count, then a uniform negative of the anchor).
    """
    dev = pos.device
    n_neg = neg.sum(dim=1)
    width = pos.shape[1]
    pos_flat = _flat_nonzero(pos)
    a, p = pos_flat // width, pos_flat % width
    per_pair = n_neg[a]
    keep = per_pair > 0
    a, p, per_pair = a[keep], p[keep], per_pair[keep]
    total = int(per_pair.sum()) if per_pair.numel() else 0
    if total == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty, empty
    neg_flat = _flat_nonzero(neg)  # row-major: anchor a's negatives are contiguous
    row_start = torch.cumsum(n_neg, 0) - n_neg
    if total <= max_triplets:
        pair_id = torch.repeat_interleave(torch.arange(a.numel(), device=dev), per_pair)
        first = torch.cumsum(per_pair, 0) - per_pair
        rank = torch.arange(total, device=dev) - first[pair_id]
    else:
        pair_id = torch.multinomial(per_pair.to(torch.float64), max_triplets, replacement=True)
        cnt = per_pair[pair_id]
        rank = torch.minimum((torch.rand(max_triplets, device=dev, dtype=torch.float64) * cnt).long(), cnt - 1)
    aa = a[pair_id]
    return aa, p[pair_id], neg_flat[row_start[aa] + rank] % width


def _first_index_of(x: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """(R,) long: the first column where each row of ``x`` (R, P) equals ``value`` (R, 1).

    With ``value`` a row max (min) this is ``argmax`` (``argmin``), lowest index on ties, in three
    vectorised passes: aten's CPU arg-reductions are scalar loops, slower than the three."""
    p = x.shape[1]
    hit = torch.eq(x, value, out=torch.empty_like(x))
    descending = torch.arange(p, 0, -1, device=x.device, dtype=x.dtype)  # p - column (exact in float)
    return (p - hit.mul_(descending).amax(dim=1)).long()


_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


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
    gamma 0x9E3779B97F4A7C15, arithmetic mod 2³² / 2⁶⁴). The formula of ``pml_uniform_*`` in
    ``kernels/csrc/kernels.c``, which generates the same values inside HIER's native LCA loop; this numpy
    form serves the torch path (no native library, or ``PML_HYPERBOLIC_NATIVE=0``)."""
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
        self.key = int(key)

    def draws(self, choice: int, start: int, stop: int, p: int, dtype, device) -> torch.Tensor:
        """(stop − start, p) draws of ``choice`` for triplet rows start..stop."""
        streams = 2 * np.arange(start, stop, dtype=np.uint64) + np.uint64(choice)
        return counter_uniform(self.key, streams, p, dtype).to(device)


class _DeviceUniform:
    """Off the CPU: ``torch.rand`` on the device, in the torch path's order (torch's generator)."""

    def draws(self, choice: int, start: int, stop: int, p: int, dtype, device) -> torch.Tensor:
        return torch.rand(stop - start, p, dtype=dtype, device=device)


def _noise_source(device: torch.device, seed: int | None = None):
    """The Gumbel noise's uniform source: (source, seed); seed is None off the CPU.

    On CPU a :class:`_CounterUniform` whose 62-bit key is drawn from torch's default generator (or
    given: ``seed``, to replay the same draws), so ``torch.manual_seed`` reproduces the noise and
    activation checkpointing (which restores torch's RNG state) redraws the same. Generated inside
    the native loop, the draws cost no buffer and no pass of their own (no (2, rows, P) buffers
    filled ahead)."""
    if device.type != "cpu":
        return _DeviceUniform(), None
    seed = int(torch.randint(0, 2 ** 62, ())) if seed is None else int(seed)
    return _CounterUniform(seed), seed


# The (T, P) slabs _LCATripletLoss keeps for its backward (two natively: u¹, u², 33 MB at the default
# 8,192 triplets × 512 proxies; three on the torch path), kept between calls on CPU: ~8,000 fresh
# pages per call otherwise (two calls per step, the batch's triplets and the proxies').
_SPARE_GRADS = SpareBuffers(capacity=2)


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


class _LCATripletLoss(torch.autograd.Function):
    r"""Per-triplet HIER loss with the straight-through LCA gradient, as one autograd node.

    Forward, for triplet rows t = (i, j, k) and candidates p, with :math:`D` = ``dist`` (N, P):
    :math:`m^{1} = \max(D_i, D_j)`, :math:`m^{2} = \max(m^{1}, D_k)`,
    :math:`z^{r} = -m^{r}/\tau + g^{r}` (g: Gumbel noise or 0), :math:`a = \arg\max z^{1}`,
    :math:`b = \arg\max z^{2}` (:func:`_select_lca`), and

    .. math::
        \ell = [D_{ia} - D_{ib} + \delta]_+ + [D_{ja} - D_{jb} + \delta]_+ + [D_{kb} - D_{ka} + \delta]_+ .

    Backward: the hard path's exact gradient (±1 at the selected proxies, through each active
    hinge) plus that of the straight-through term :math:`\sum_p (\pi^{1}_p - \pi^{2}_p) w_p`
    (value 0), :math:`\pi^{r} = \operatorname{softmax}(z^{r})`,
    :math:`w = [h_1>0] D_i + [h_2>0] D_j - [h_3>0] D_k`, whose row-t gradient is :math:`c_t/\tau` times

    .. math::
        \frac{\partial}{\partial m^{1}} = -u^{1}, \quad \frac{\partial}{\partial m^{2}} = u^{2},
        \qquad u^{r} = \pi^{r} \odot (w - \langle \pi^{r}, w\rangle),

    routed through the maxima to :math:`D_i, D_j, D_k` (ties to the first argument). All of this
    but the row factor :math:`c_t/\tau` is known in the forward pass, so the forward computes the
    three (T, P) unit-factor gradients block by block (``block`` rows: temporaries that stay in
    cache and are reused by the allocator) and the backward only scales their rows, adds the hard
    path and scatters them into (N, P). Autograd over the per-op form kept a dozen (T, P)
    intermediates and ran a backward kernel for each (gathers, maxima, both softmaxes, the
    zero-valued product, bool-mask routing), many times the cost of this form.

    On CPU the rows run in the native library (:func:`pml_hyperbolic.kernels.native.lca_rows`: one pass
    per row for the maxima, one per choice, one writing u¹ and u²; the same draws, the same choices,
    gradients equal to rounding), and the backward routes u¹, u² through the maxima while it scatters
    them (:func:`pml_hyperbolic.kernels.native.lca_backward`): two (T, P) slabs written and read instead of
    three. Elsewhere, or with ``PML_HYPERBOLIC_NATIVE=0``, the torch ops below. Costs:
    docs/design/hier-loss.md.
    """

    @staticmethod
    def forward(ctx, dist, i, j, k, tau, margin, stochastic, block):
        need_grad = ctx.needs_input_grad[0]
        noise, seed = _noise_source(dist.device) if stochastic else (None, None)
        loss, a, b, grads, on = _LCATripletLoss._run(dist, i, j, k, tau, margin, noise, block, need_grad)
        ctx.mark_non_differentiable(a, b)
        if need_grad:
            # grads is kept as an attribute, not a saved tensor: the backward hands it back for the
            # next call (_SPARE_GRADS); a second backward through the same graph (retain_graph)
            # recomputes it from the same draws (``seed``). Off the CPU it stays with the graph.
            ctx.grads, ctx.seed, ctx.stochastic = grads, seed, stochastic
            ctx.save_for_backward(dist, on, i, j, k, a, b)
            ctx.tau, ctx.margin, ctx.block = tau, margin, block
        return loss, a, b

    @staticmethod
    def _run(dist, i, j, k, tau, margin, noise, block, need_grad):
        """The forward's loop: (loss, a, b, grads or None, on or None)."""
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

    @staticmethod
    def backward(ctx, grad_loss, _grad_a, _grad_b):
        dist, on, i, j, k, a, b = ctx.saved_tensors
        grads = ctx.grads
        if grads is None:  # a second backward (retain_graph=True): the same draws again
            noise = _noise_source(dist.device, ctx.seed)[0] if ctx.stochastic else None
            grads = _LCATripletLoss._run(dist.detach(), i, j, k, ctx.tau, ctx.margin, noise, ctx.block, True)[3]
        p = grads.shape[2]
        scale = (grad_loss / ctx.tau).contiguous()
        grad = grads.new_zeros(dist.shape[0], p)
        if grads.shape[0] == 2:  # the native forward's u¹, u²: routed and scattered natively in one pass
            if not _native.lca_backward(grad, dist.contiguous(), i, j, k, grads, scale):
                grads = torch.stack(_route_through_maxima(dist, i, j, k, grads))  # (native switched off since)
        if grads.shape[0] == 3:  # grad[idx] += grads[r] · scale
            scaled = torch.empty_like(grads[0])  # one buffer for the three: the saved ones stay intact
            for r, idx in enumerate((i, j, k)):
                grad.index_add_(0, idx, torch.mul(grads[r], scale.view(-1, 1), out=scaled))
        if dist.device.type == "cpu":  # consumed: the buffer serves the next call
            ctx.grads = None
            _SPARE_GRADS.give(grads)
        # hard path: +c at LCA(i, j), −c at LCA(i, j, k) (reversed for k), through active hinges
        hard = on * grad_loss.view(1, -1)  # (3, T)
        flat = grad.view(-1)
        for r, (idx, sign) in enumerate(((i, 1.0), (j, 1.0), (k, -1.0))):
            flat.index_add_(0, idx * p + a, hard[r], alpha=sign).index_add_(0, idx * p + b, hard[r], alpha=-sign)
        return grad, None, None, None, None, None, None, None


class HIERLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""HIER: learnable hierarchical proxies in the Poincaré ball as a regulariser.

    Kim, Jeong, Kwak, "HIER: Metric Learning Beyond Class Labels via Hierarchical
    Regularization", CVPR 2023 (own implementation from the paper's description).

    ``num_proxies`` proxies are stored as Euclidean (tangent-space) parameters and mapped into the
    ball like the embeddings of :class:`~pml_hyperbolic.heads.ToPoincare`: clipping to ``clip_r``,
    :math:`\exp_0`, projection (:meth:`proxies_in_ball`). The lowest common ancestor of a set S of
    points is the proxy minimising the largest distance to S,
    :math:`\operatorname{LCA}(S) = \arg\min_p \max_{s \in S} d_c(s, p)`. For a triplet (i, j, k),
    j a positive and k a negative of i, with :math:`\rho_{ij} = \operatorname{LCA}(i, j)` and
    :math:`\rho_{ijk} = \operatorname{LCA}(i, j, k)`:

    .. math::
        \ell_{ijk} = [d(x_i, \rho_{ij}) - d(x_i, \rho_{ijk}) + \delta]_+
                   + [d(x_j, \rho_{ij}) - d(x_j, \rho_{ijk}) + \delta]_+
                   + [d(x_k, \rho_{ijk}) - d(x_k, \rho_{ij}) + \delta]_+

    Triplets with :math:`\rho_{ij} = \rho_{ijk}` are dropped; the sub-loss ``"loss"`` lists the
    remaining triplets (reduction type "triplet", PML indices (a, p, n): the default
    ``MeanReducer`` averages them). With ``proxy_term=True`` the same loss on triplets of proxies
    (the proxies being both the points and the LCA candidates) is the sub-loss ``"proxy_loss"``,
    returned "already_reduced" (mean over its kept triplets); PML adds the sub-losses. Use it
    beside a main loss: ``loss = main(emb, y) + w * hier(emb, y)``, and give the optimizer
    ``hier.parameters()`` (the proxies). No hierarchy labels are needed.

    **Triplets.** Ordered (anchor i, positive j, negative k of i), PML's convention. Positives:
    ``"labels"``: same label; ``"labels+mutual_nn"``: same label, or mutual ``mutual_nn_k``-nearest
    neighbours by (detached) distance; negatives are all other samples (self and, with ``ref_emb``,
    the sample's own bit-identical copy are neither). Proxy triplets: positives are mutual
    ``proxy_nn_k``-nearest proxies, negatives the other proxies. If a term has at most
    ``max_triplets`` (``max_proxy_triplets``) triplets all are used, in a fixed order; otherwise
    that many are drawn uniformly (with replacement) from all of them, without ever listing the
    O(B³) set. A PML miner's ``indices_tuple`` (triplets, or pairs joined into triplets by anchor)
    replaces the batch triplets (subsampled the same way); ``positives`` is then unused.

    **LCA selection.** The argmin is hard in the forward pass (the loss value uses the selected
    proxy); gradients pass straight through a softmax :math:`\pi_p \propto
    \exp(-\max_{s}d(s,p)/\tau + g_p)` (``tau``), so the distances to every candidate, hence all
    proxies, get gradient. In training mode with ``stochastic_lca=True`` the :math:`g_p` are
    Gumbel(0, 1) noise (hard Gumbel-softmax, as in the paper; on CPU from a counter-based generator
    keyed from torch's generator, :func:`counter_uniform`, so ``torch.manual_seed`` reproduces it;
    on other devices ``torch.rand``); in eval mode or with
    ``stochastic_lca=False`` g = 0 and the selection is the deterministic argmin (ties: lowest
    proxy index; proxy-proxy distances are symmetrised so that LCA(i, j) ties between proxies i
    and j are broken the same way every time). The π-part is an estimator, not the derivative of
    the (piecewise-constant in the choice) forward value; the hard path's gradient is exact.
    Triplet subsampling (above the budgets) stays random in eval mode.

    **Memory.** One (N, P) distance matrix (N = batch [+ reference set]) and one (P, P) for the
    proxy term; the per-triplet (T, P) work is done in chunks of ``chunk_size`` triplets,
    recomputed in backward (activation checkpointing) when there is more than one chunk:
    O(N·P + P² + T + chunk_size·P), never O(B³). A chunk keeps two (chunk_size, P) gradient slabs
    for the backward on CPU (three on the torch path); its temporaries are blocks of ~2¹⁸ elements.

    **Cost.** O(T·P) per term for T triplets and P proxies: ``max_triplets``,
    ``max_proxy_triplets`` and ``num_proxies`` scale it linearly (timings against PML's
    ``SupConLoss``: the design note).

    Design note: docs/design/hier-loss.md

    Args:
        embedding_size: D of the embeddings (and the proxies).
        num_proxies: P, default 512 (paper).
        margin: δ ≥ 0, default 0.1.
        c: the geometry: a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (the head's, by
            reference: the proxies enter the ball exactly like the embeddings, by its ``to_ball``), or a
            curvature (float, 0-d tensor or hypll Curvature/PoincareBall) turned into one by
            :func:`~pml_hyperbolic.geometry.as_geometry` and read at every forward (learnable ones
            keep receiving gradients; a Parameter or hypll module is registered on the loss, so it is
            part of ``parameters()``, like in ``PoincareDistance``). None (default):
            :func:`~pml_hyperbolic.geometry.default_geometry`. Embeddings are assumed to be ball points of this c (they are
            projected into the ball, not mapped).
        clip_r: clip radius of the geometry built from a curvature ``c`` (``"auto"``, the default:
            :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`; None: no clipping). With a
            ``PoincareGeometry`` it is **deprecated** (a ``DeprecationWarning``; removed in the next
            release): the proxies then use that radius with the geometry's curvature.
        tau: softmax temperature of the straight-through LCA selection, default 0.1.
        positives: ``"labels"`` (default) or ``"labels+mutual_nn"``.
        mutual_nn_k: k of the mutual-neighbour positives, default 10.
        proxy_term: add the proxy-proxy hierarchy term, default True.
        proxy_nn_k: k of the proxies' mutual-neighbour positives, default 10 (k ≥ P − 1 leaves
            no proxy negatives: no proxy term).
        max_triplets: triplet budget of the batch term, default 8192 (about the paper's 50
            triplets per anchor for a batch of ~160).
        max_proxy_triplets: triplet budget of the proxy term, default 8192.
        stochastic_lca: Gumbel noise in training mode, default True.
        proxy_init_std: proxies start as N(0, std²) tangent vectors, default 0.01 (near the
            origin, i.e. near the root of the hierarchy; ~0.11 Euclidean norm at D = 128).
        chunk_size: triplets per chunk, default 8192 (a default call is one chunk per term, no
            recomputation; larger budgets are chunked).
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``reducer``, ...); ``distance`` is
            refused (the loss always uses the Poincaré distance of its own ``c``).

    Raises:
        ValueError: at construction, a bad argument, naming it; at a call, embeddings of the wrong
            shape or not finite, or an ``indices_tuple`` that is not a triplet or pair tuple of 1-D
            integer indices of matching lengths within the batch (checked before any is used).
    """

    def __init__(self, embedding_size: int, num_proxies: int = 512, margin: float = 0.1,
                 c: float | torch.Tensor | nn.Module | None = None, clip_r: float | str | None = "auto", tau: float = 0.1,
                 positives: str = "labels", mutual_nn_k: int = 10, proxy_term: bool = True, proxy_nn_k: int = 10,
                 max_triplets: int = 8192, max_proxy_triplets: int = 8192, stochastic_lca: bool = True,
                 proxy_init_std: float = 0.01, chunk_size: int = 8192, **kwargs: Any):
        if "distance" in kwargs:
            raise ValueError("distance: HIERLoss always uses the Poincaré distance of its own c; pass c instead")
        self.proxy_term = bool(proxy_term)  # read by _sub_loss_names during super().__init__
        super().__init__(**kwargs)
        self.embedding_size = _check_int(embedding_size, "embedding_size", 1)
        self.num_proxies = _check_int(num_proxies, "num_proxies", 1)
        self.margin = check_nonnegative(margin, "margin")
        self.tau = check_positive(tau, "tau")
        if isinstance(clip_r, str) and clip_r != "auto":
            raise ValueError(f"clip_r must be a number > 0, None or 'auto', got {clip_r!r}")
        if clip_r is not None and not isinstance(clip_r, str):
            clip_r = check_positive(clip_r, "clip_r")
        if positives not in _POSITIVES:
            raise ValueError(f"positives must be one of {_POSITIVES}, got {positives!r}")
        self.positives = positives
        self.mutual_nn_k = _check_int(mutual_nn_k, "mutual_nn_k", 1)
        self.proxy_nn_k = _check_int(proxy_nn_k, "proxy_nn_k", 1)
        self.max_triplets = _check_int(max_triplets, "max_triplets", 1)
        self.max_proxy_triplets = _check_int(max_proxy_triplets, "max_proxy_triplets", 1)
        self.chunk_size = _check_int(chunk_size, "chunk_size", 1)
        self.stochastic_lca = bool(stochastic_lca)
        std = check_nonnegative(proxy_init_std, "proxy_init_std")
        try:  # validates now (a bad c fails at construction, naming c)
            geometry = self._proxy_geometry(c, clip_r)
        except TypeError as e:
            raise ValueError(f"c: {e}") from None
        if isinstance(c, nn.Module):
            self.curvature_module = c  # registers a hypll Curvature/PoincareBall's parameters
        elif isinstance(c, nn.Parameter):
            self.c_param = c
        self._c = c  # the caller's object, by reference (the state dict's keys of earlier versions)
        self.__dict__["_geometry"] = geometry  # read at every forward; held, not registered
        self.proxies = nn.Parameter(torch.randn(self.num_proxies, self.embedding_size) * std)
        self.add_to_recordable_attributes(list_of_names=["margin", "tau"], is_stat=False)

    def get_default_reducer(self):
        return MeanReducer()

    def _sub_loss_names(self):
        return ["loss", "proxy_loss"] if self.proxy_term else ["loss"]

    @property
    def c(self) -> torch.Tensor:
        """The current curvature magnitude (0-d tensor, differentiable if learnable)."""
        return self.geometry.curvature()

    @property
    def geometry(self):
        """The :class:`~pml_hyperbolic.geometry.PoincareGeometry` in use (curvature, proxy clipping)."""
        if "_geometry" not in self.__dict__:  # a loss pickled before it held one
            clip_r = "auto" if self.__dict__.get("_geometry_clips") else self.__dict__.get("clip_r", "auto")
            self.__dict__["_geometry"] = self._proxy_geometry(self._c, clip_r)
        return self.__dict__["_geometry"]

    @staticmethod
    def _proxy_geometry(c, clip_r):
        """The geometry of ``c`` (:func:`~pml_hyperbolic.geometry.as_geometry`); an explicit ``clip_r``
        with a ``PoincareGeometry`` (deprecated) gives one sharing its curvature with that radius."""
        import warnings

        from ..geometry import PoincareGeometry, as_geometry

        if not isinstance(c, PoincareGeometry):
            return as_geometry(c) if isinstance(clip_r, str) else as_geometry(c, clip_r=clip_r)
        if isinstance(clip_r, str):  # "auto"
            return c
        warnings.warn("HIERLoss(clip_r=...) together with a PoincareGeometry is deprecated and will be an error "
                      "in the next release: the geometry owns the clip radius (set it when building the geometry)",
                      DeprecationWarning, stacklevel=4)
        return PoincareGeometry._sharing(c, None if clip_r is None else "hard", clip_r)

    @property
    def clip_r(self):
        """The proxies' clip radius: the geometry's (None: no clipping)."""
        return self.geometry.clip_r

    def _lca_stochastic(self) -> bool:
        return self.training and self.stochastic_lca

    def proxies_in_ball(self, dtype=None) -> torch.Tensor:
        """(P, D) proxies mapped into the ball: clip to ``clip_r``, expmap0, project."""
        x = self.proxies
        dtype = pb.compute_dtype(x.dtype if dtype is None else dtype)
        x = x.to(dtype)
        # the geometry's own (overflow-safe) map, hard or tanh clip, as its to_ball (without to_ball's
        # NaN scan: no device-to-host read per forward)
        from ..geometry import map_to_ball
        g = self.geometry
        return map_to_ball(x, g.curvature(pb._wide_dtype(x), x.device), g.clip_r, g.clip)

    # ---- per-triplet LCA margin loss -------------------------------------------------------
    def _chunk_losses(self, dist, i, j, k):
        """Loss of each triplet (before dropping), LCA(i, j) and LCA(i, j, k) indices.

        ``dist`` is (N, P) point→candidate distances; every op is O(len(i)·P) (see
        :class:`_LCATripletLoss` for the formulas and why it is one autograd node)."""
        elements = _BLOCK_ELEMENTS if dist.device.type == "cpu" else _BLOCK_ELEMENTS_GPU
        block = max(1, elements // dist.shape[1])
        return _LCATripletLoss.apply(dist, i, j, k, self.tau, self.margin, self._lca_stochastic(), block)

    def _triplet_losses(self, dist, i, j, k):
        """Per-triplet losses and the kept mask (LCAs differ), chunked + checkpointed."""
        n = i.numel()
        if n <= self.chunk_size:
            loss, a, b = self._chunk_losses(dist, i, j, k)
            return loss, a != b
        use_ckpt = torch.is_grad_enabled() and dist.requires_grad
        losses, keeps = [], []
        for s in range(0, n, self.chunk_size):
            sl = slice(s, s + self.chunk_size)
            if use_ckpt:
                loss, a, b = checkpoint(self._chunk_losses, dist, i[sl], j[sl], k[sl], use_reentrant=False)
            else:
                loss, a, b = self._chunk_losses(dist, i[sl], j[sl], k[sl])
            losses.append(loss)
            keeps.append(a != b)
        return torch.cat(losses), torch.cat(keeps)

    # ---- triplet selection -----------------------------------------------------------------
    def _subsample(self, triplet, cap):
        n = triplet[0].numel()
        if n <= cap:
            return triplet
        idx = torch.randint(n, (cap,), device=triplet[0].device)
        return tuple(t[idx] for t in triplet)

    def _batch_triplets(self, embeddings, labels, indices_tuple, ref_emb, ref_labels, emb_c, ref_c, c):
        B, R = embeddings.shape[0], ref_emb.shape[0]
        dev = embeddings.device
        if indices_tuple is not None:
            # checked before any use: the native loop reads rows by these indices
            indices_tuple = tuple(t.to(device=dev, dtype=torch.long)
                                  for t in index_tensors(indices_tuple, B, R))
            a, p, n = lmu.convert_to_triplets(indices_tuple, labels, ref_labels)
            return self._subsample((a, p, n), self.max_triplets)
        if labels is None:
            raise ValueError("labels or indices_tuple is required")
        check_labels(labels, B, "labels")
        check_labels(ref_labels, R, "ref_labels")
        with torch.no_grad():
            same = labels.view(-1, 1) == ref_labels.view(1, -1)
            self_mask = self_match_mask(embeddings, ref_emb, same)
            pos = same & ~self_mask
            neg = ~same
            if self.positives == "labels+mutual_nn":
                mutual = _mutual_nn(pb.pairwise_dist(emb_c, ref_c, c), self.mutual_nn_k, self_mask)
                pos = pos | mutual
                neg = neg & ~mutual
        return _triplets_from_masks(pos, neg, self.max_triplets)

    def _proxy_triplets(self, proxy_dist):
        with torch.no_grad():
            eye = torch.eye(proxy_dist.shape[0], dtype=torch.bool, device=proxy_dist.device)
            pos = _mutual_nn(proxy_dist, self.proxy_nn_k, eye, symmetric=True)
            neg = ~pos & ~eye
        return _triplets_from_masks(pos, neg, self.max_proxy_triplets)

    # ---- PML entry point -------------------------------------------------------------------
    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
        require_ref_labels(ref_emb, ref_labels, labels, indices_tuple)
        # Half precision is computed in float32. Upcast before PML's forward: its MultipleReducers
        # (two sub-losses) would otherwise add them up in the embeddings' (half) dtype.
        half = (torch.float16, torch.bfloat16)
        if embeddings.dtype in half:
            same = ref_emb is embeddings
            embeddings = embeddings.float()
            if same:
                ref_emb = embeddings
        if ref_emb is not None and ref_emb.dtype in half:
            ref_emb = ref_emb.float()
        return super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        for name, x in (("embeddings", embeddings), ("ref_emb", ref_emb)):
            if x.ndim != 2 or x.shape[1] != self.embedding_size:
                raise ValueError(f"{name} must have shape (N, embedding_size={self.embedding_size}), "
                                 f"got {tuple(x.shape)}")
            pb.check_finite(x, name)
        same_ref = ref_emb is embeddings
        dtype = pb.compute_dtype(torch.promote_types(torch.promote_types(embeddings.dtype, ref_emb.dtype),
                                                     self.proxies.dtype))
        c = self.geometry.curvature(dtype, embeddings.device)
        emb_c = pb.project(embeddings.to(dtype), c)
        ref_c = emb_c if same_ref else pb.project(ref_emb.to(dtype), c)
        proxies = self.proxies_in_ball(dtype)

        out = {}
        a, p, n = self._batch_triplets(embeddings, labels, indices_tuple, ref_emb, ref_labels, emb_c, ref_c, c)
        if a.numel():
            points = emb_c if same_ref else torch.cat([emb_c, ref_c])
            off = 0 if same_ref else emb_c.shape[0]
            dist = pb.pairwise_dist(points, proxies, c)  # (N, P)
            losses, keep = self._triplet_losses(dist, a, p + off, n + off)
            if bool(keep.any()):
                out["loss"] = {"losses": losses[keep], "indices": (a[keep], p[keep], n[keep]),
                               "reduction_type": "triplet"}
        if self.proxy_term:
            pd = pb.pairwise_dist(proxies, proxies, c)
            # exactly symmetric with a zero diagonal: LCA(i, j) ties between i and j break alike
            pd = 0.5 * (pd + pd.T)
            pd = pd.masked_fill(torch.eye(pd.shape[0], dtype=torch.bool, device=pd.device), 0.0)
            pi, pj, pk = self._proxy_triplets(pd)
            if pi.numel():
                losses, keep = self._triplet_losses(pd, pi, pj, pk)
                if bool(keep.any()):
                    out["proxy_loss"] = {"losses": losses[keep].mean(), "indices": None,
                                         "reduction_type": "already_reduced"}
        if not out:
            return self.zero_losses()
        for name in self._sub_loss_names():
            out.setdefault(name, self.zero_loss())
        return out
