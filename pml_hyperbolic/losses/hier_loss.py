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

from ..kernels import lca as _lca
# (names of the LCA rows' implementation, read here by tests and tools under their former home)
from ..kernels.lca import _SPARE_GRADS, _first_index_of, _route_through_maxima, counter_uniform  # noqa: F401
from .. import poincare_ball as pb
from ..manifold_tensors import AcceptsManifoldTensors
from .._batch_utils import self_match_mask
from ._common import (check_labels, check_nonnegative, check_positive, index_tensors, require_ref_labels,
                      sub_loss_reducer_type)

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


def _fixed_size_triplets(device: torch.device) -> bool:
    """Whether triplets are drawn at a fixed size (:func:`_triplets_by_rank`): on accelerators, where
    a data-dependent size would make the host wait for the device in the middle of a training step."""
    return device.type != "cpu"


def _triplets_by_rank(pos: torch.Tensor, neg: torch.Tensor, max_triplets: int):
    """Triplets (a, p, n) of the masks at a fixed size, with their validity, without a device-to-host read.

    The ordered triplets are ranked in :func:`_triplets_from_masks`' listing order (pairs row-major,
    then the anchor's negatives in column order); rank r maps to its triplet by two ``searchsorted``
    on cumulative counts (per pair, then of the negatives). Slot s holds rank s when there are at most
    ``max_triplets`` triplets (the slots past the count are invalid: the same triplets as the listing,
    in the same order), else a rank drawn uniformly with replacement (the listing's draw). Memory O(Q·R).

    Returns:
        (a, p, n, valid): four 1-D tensors of length ``min(max_triplets, Q·R·R)``; invalid slots hold
        in-range indices.
    """
    dev = pos.device
    q, r = pos.shape
    size = min(max_triplets, q * r * r)
    n_neg = neg.sum(dim=1)
    per_pair = (pos * n_neg.view(-1, 1)).reshape(-1)  # triplets of each (anchor, positive) pair
    pair_end = torch.cumsum(per_pair, 0)
    slot = torch.arange(size, device=dev)
    if size == 0:
        return slot, slot, slot, slot.bool()
    total = pair_end[-1]
    drawn = torch.randint(0, 2 ** 62, (size,), device=dev) % total.clamp_min(1)
    rank = torch.where(total <= max_triplets, slot, drawn)
    valid = slot < total  # drawing: total > max_triplets >= size, every slot valid
    rank = torch.minimum(rank, (total - 1).clamp_min(0))
    pair = torch.searchsorted(pair_end, rank, right=True).clamp_max(q * r - 1)
    within = rank - (pair_end[pair] - per_pair[pair])  # the rank among the anchor's negatives
    a, p = pair // r, pair % r
    neg_end = torch.cumsum(neg.reshape(-1), 0)
    row_start = torch.cumsum(n_neg, 0) - n_neg
    n_flat = torch.searchsorted(neg_end, row_start[a] + within, right=True).clamp_max(q * r - 1)
    return a, p, n_flat % r, valid


def _noise_source(device: torch.device, seed: int | None = None):
    """The Gumbel noise's key holder: (source, seed), ``source.key`` the 62-bit key handed to the op.

    The key is drawn from torch's default generator (or given: ``seed``, to replay the same draws), so
    ``torch.manual_seed`` reproduces the noise and activation checkpointing (which restores torch's RNG
    state) redraws the same. On CPU the draws are :func:`~pml_hyperbolic.kernels.lca.counter_uniform`'s
    (generated inside the native loop: no buffer, no pass of their own), elsewhere those of a device
    generator seeded with the key."""
    seed = int(torch.randint(0, 2 ** 62, ())) if seed is None else int(seed)
    return (_lca._CounterUniform(seed) if device.type == "cpu" else _lca._DeviceUniform(seed, device)), seed


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
    ``MeanReducer`` averages them; on an accelerator, where the triplets are held at a fixed size so that
    the step never waits for a count, that mean is taken in the loss and returned "already_reduced",
    other reducers still get the list). With ``proxy_term=True`` the same loss on triplets of proxies
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
    keyed from torch's generator, :func:`~pml_hyperbolic.kernels.lca.counter_uniform`, so
    ``torch.manual_seed`` reproduces it; on other devices ``torch.rand`` from a device generator seeded
    with that key); in eval mode or with
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

        ``dist`` is (N, P) point→candidate distances; every op is O(len(i)·P), one custom op with its
        registered autograd (``pml_hyperbolic::hier_lca_rows``, :mod:`pml_hyperbolic.kernels.lca`: the
        formulas, and why the backward's rows are computed in the forward). The Gumbel noise's key is
        drawn here, from torch's generator, and handed to the op."""
        elements = _BLOCK_ELEMENTS if dist.device.type == "cpu" else _BLOCK_ELEMENTS_GPU
        block = max(1, elements // dist.shape[1])
        key = None
        if self._lca_stochastic():
            key = torch.tensor(_noise_source(dist.device)[0].key, dtype=torch.long)
        return _lca.lca_triplet_loss(dist, i, j, k, tau=self.tau, margin=self.margin, key=key, block=block)

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
            return (*self._subsample((a, p, n), self.max_triplets), None)
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
        return self._masked_triplets(pos, neg, self.max_triplets)

    @staticmethod
    def _masked_triplets(pos, neg, max_triplets):
        """(a, p, n, valid): the masks' triplets; ``valid`` None where they are listed at their own size."""
        if _fixed_size_triplets(pos.device):
            return _triplets_by_rank(pos, neg, max_triplets)
        return (*_triplets_from_masks(pos, neg, max_triplets), None)

    def _term(self, losses, keep, valid, triplet):
        """A sub-loss from per-triplet ``losses`` and the mask of those kept (None: none kept).

        Listed (reduction "triplet", PML indices) for the reducer, except at a fixed size under the
        default ``MeanReducer``, where the mean over the kept triplets is taken here ("already_reduced":
        the same value without a data-dependent size). Without ``triplet`` (the proxy term) always
        that mean."""
        if valid is not None:
            keep = keep & valid
            if triplet is None or sub_loss_reducer_type(self) is MeanReducer:
                weight = keep.to(losses.dtype)
                value = (losses * weight).sum() / weight.sum().clamp_min(1)
                return {"losses": value, "indices": None, "reduction_type": "already_reduced"}
        if not bool(keep.any()):
            return None
        if triplet is None:
            return {"losses": losses[keep].mean(), "indices": None, "reduction_type": "already_reduced"}
        return {"losses": losses[keep], "indices": tuple(t[keep] for t in triplet), "reduction_type": "triplet"}

    def _proxy_triplets(self, proxy_dist):
        with torch.no_grad():
            eye = torch.eye(proxy_dist.shape[0], dtype=torch.bool, device=proxy_dist.device)
            pos = _mutual_nn(proxy_dist, self.proxy_nn_k, eye, symmetric=True)
            neg = ~pos & ~eye
        return self._masked_triplets(pos, neg, self.max_proxy_triplets)

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
        a, p, n, valid = self._batch_triplets(embeddings, labels, indices_tuple, ref_emb, ref_labels, emb_c, ref_c, c)
        if a.numel():
            points = emb_c if same_ref else torch.cat([emb_c, ref_c])
            off = 0 if same_ref else emb_c.shape[0]
            dist = pb.pairwise_dist(points, proxies, c)  # (N, P)
            losses, keep = self._triplet_losses(dist, a, p + off, n + off)
            term = self._term(losses, keep, valid, (a, p, n))
            if term is not None:
                out["loss"] = term
        if self.proxy_term:
            pd = pb.pairwise_dist(proxies, proxies, c)
            # exactly symmetric with a zero diagonal: LCA(i, j) ties between i and j break alike
            pd = 0.5 * (pd + pd.T)
            pd = pd.masked_fill(torch.eye(pd.shape[0], dtype=torch.bool, device=pd.device), 0.0)
            pi, pj, pk, valid = self._proxy_triplets(pd)
            if pi.numel():
                losses, keep = self._triplet_losses(pd, pi, pj, pk)
                term = self._term(losses, keep, valid, None)
                if term is not None:
                    out["proxy_loss"] = term
        if not out:
            return self.zero_losses()
        for name in self._sub_loss_names():
            out.setdefault(name, self.zero_loss())
        return out
