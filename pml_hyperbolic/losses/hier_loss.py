"""HIER: hierarchical-proxy regulariser (Kim, Jeong, Kwak, CVPR 2023)."""
from __future__ import annotations


import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import poincare_ball as pb
from ..manifold_tensors import AcceptsManifoldTensors
from .._batch_utils import self_match_mask
from ._common import check_labels, check_nonnegative, check_positive

_POSITIVES = ("labels", "labels+mutual_nn")


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _gumbel_like(x: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise −log(−log U) (uniform draws are much cheaper than exponential_ on CPU)."""
    tiny = torch.finfo(x.dtype).tiny
    u = torch.rand_like(x).clamp_(tiny, 1.0 - torch.finfo(x.dtype).eps)
    return u.log_().neg_().log_().neg_()


def _mutual_nn(dist: torch.Tensor, k: int, exclude: torch.Tensor) -> torch.Tensor:
    """(Q, R) bool: j is among the k nearest refs of i AND i among the k nearest queries of j."""
    d = dist.masked_fill(exclude, float("inf"))
    q, r = d.shape
    row = torch.zeros_like(exclude)
    col = torch.zeros_like(exclude)
    if min(k, r) > 0:
        row.scatter_(1, d.topk(min(k, r), dim=1, largest=False).indices, True)
    if min(k, q) > 0:
        col.scatter_(0, d.topk(min(k, q), dim=0, largest=False).indices, True)
    return row & col & ~exclude


def _triplets_from_masks(pos: torch.Tensor, neg: torch.Tensor, max_triplets: int):
    """Ordered triplets (a, p, n) with pos[a, p] and neg[a, n], memory O(Q·R + T).

    All of them (in a fixed order) if there are at most ``max_triplets``; otherwise
    ``max_triplets`` drawn uniformly with replacement from the set of all of them (pair drawn
    with probability ∝ its anchor's negative count, then a uniform negative of the anchor).
    """
    dev = pos.device
    n_neg = neg.sum(dim=1)
    a, p = pos.nonzero(as_tuple=True)
    per_pair = n_neg[a]
    keep = per_pair > 0
    a, p, per_pair = a[keep], p[keep], per_pair[keep]
    total = int(per_pair.sum()) if per_pair.numel() else 0
    if total == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return empty, empty, empty
    neg_cols = neg.nonzero(as_tuple=True)[1]  # row-major: anchor a's negatives are contiguous
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
    return aa, p[pair_id], neg_cols[row_start[aa] + rank]


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
    Gumbel(0, 1) noise (hard Gumbel-softmax, as in the paper); in eval mode or with
    ``stochastic_lca=False`` g = 0 and the selection is the deterministic argmin (ties: lowest
    proxy index; proxy-proxy distances are symmetrised so that LCA(i, j) ties between proxies i
    and j are broken the same way every time). The π-part is an estimator, not the derivative of
    the (piecewise-constant in the choice) forward value; the hard path's gradient is exact.
    Triplet subsampling (above the budgets) stays random in eval mode.

    **Memory.** One (N, P) distance matrix (N = batch [+ reference set]) and one (P, P) for the
    proxy term; the per-triplet (T, P) work is done in chunks of ``chunk_size`` triplets,
    recomputed in backward (activation checkpointing) when there is more than one chunk:
    O(N·P + P² + T + chunk_size·P), never O(B³).

    Args:
        embedding_size: D of the embeddings (and the proxies).
        num_proxies: P, default 512 (paper).
        margin: δ ≥ 0, default 0.1.
        c: curvature magnitude, default 0.1 (Hyp-ViT): float, 0-d tensor or hypll
            Curvature/PoincareBall, stored as given and read at every forward (learnable ones
            keep receiving gradients; a Parameter or hypll module is registered on the loss, so it is
            part of ``parameters()``, like in ``PoincareDistance``). Embeddings are assumed to be ball points of this c (they are
            projected into the ball, not mapped).
        clip_r: clipping radius of the proxies' tangent vectors; ``"auto"`` (default): the clipping of
            ``c`` when it is a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (the proxies enter the
            ball exactly like the embeddings), else 2.3; None disables.
        tau: softmax temperature of the straight-through LCA selection, default 0.1.
        positives: ``"labels"`` (default) or ``"labels+mutual_nn"``.
        mutual_nn_k: k of the mutual-neighbour positives, default 10.
        proxy_term: add the proxy-proxy hierarchy term, default True.
        proxy_nn_k: k of the proxies' mutual-neighbour positives, default 10 (k ≥ P − 1 leaves
            no proxy negatives: no proxy term).
        max_triplets / max_proxy_triplets: triplet budget per term, default 8192 each (about the
            paper's 50 triplets per anchor for a batch of ~160).
        stochastic_lca: Gumbel noise in training mode, default True.
        proxy_init_std: proxies start as N(0, std²) tangent vectors, default 0.01 (near the
            origin, i.e. near the root of the hierarchy; ~0.11 Euclidean norm at D = 128).
        chunk_size: triplets per chunk, default 8192 (a default call is one chunk per term, no
            recomputation; larger budgets are chunked).
    """

    def __init__(self, embedding_size, num_proxies=512, margin=0.1, c=0.1, clip_r="auto", tau=0.1,
                 positives="labels", mutual_nn_k=10, proxy_term=True, proxy_nn_k=10, max_triplets=8192,
                 max_proxy_triplets=8192, stochastic_lca=True, proxy_init_std=0.01, chunk_size=8192, **kwargs):
        if "distance" in kwargs:
            raise ValueError("distance: HIERLoss always uses the Poincaré distance of its own c; pass c instead")
        self.proxy_term = bool(proxy_term)  # read by _sub_loss_names during super().__init__
        super().__init__(**kwargs)
        self.embedding_size = _check_int(embedding_size, "embedding_size", 1)
        self.num_proxies = _check_int(num_proxies, "num_proxies", 1)
        self.margin = check_nonnegative(margin, "margin")
        self.tau = check_positive(tau, "tau")
        self._geometry_clips = isinstance(clip_r, str) and clip_r == "auto" and getattr(c, "_is_pml_geometry", False)
        if isinstance(clip_r, str):
            if clip_r != "auto":
                raise ValueError(f"clip_r must be a number > 0, None or 'auto', got {clip_r!r}")
            clip_r = c.clip_r if self._geometry_clips else 2.3
        if clip_r is not None:
            clip_r = check_positive(clip_r, "clip_r")
        self.clip_r = clip_r
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
        try:
            pb.as_curvature(c)  # validate now (a bad c fails at construction, naming c)
        except TypeError as e:
            raise ValueError(f"c: {e}") from None
        if isinstance(c, nn.Module):
            self.curvature_module = c  # registers a hypll Curvature/PoincareBall's parameters
        elif isinstance(c, nn.Parameter):
            self.c_param = c
        self._c = c  # by reference: read at every forward
        self.proxies = nn.Parameter(torch.randn(self.num_proxies, self.embedding_size) * std)
        self.add_to_recordable_attributes(list_of_names=["margin", "tau"], is_stat=False)

    def get_default_reducer(self):
        return MeanReducer()

    def _sub_loss_names(self):
        return ["loss", "proxy_loss"] if self.proxy_term else ["loss"]

    @property
    def c(self) -> torch.Tensor:
        """The current curvature magnitude (0-d tensor, differentiable if learnable)."""
        return pb.as_curvature(self._c)

    def _lca_stochastic(self) -> bool:
        return self.training and self.stochastic_lca

    def proxies_in_ball(self, dtype=None) -> torch.Tensor:
        """(P, D) proxies mapped into the ball: clip to ``clip_r``, expmap0, project."""
        x = self.proxies
        dtype = pb.compute_dtype(x.dtype if dtype is None else dtype)
        x = x.to(dtype)
        if self._geometry_clips:  # the embeddings' own mapping (hard or tanh clip) of the shared geometry
            return self._c.to_ball(x)
        if self.clip_r is not None:
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(dtype).tiny)
            x = x * torch.clamp(self.clip_r / norm, max=1.0)
        c = pb.as_curvature(self._c, dtype, x.device)
        return pb.project(pb.expmap0(x, c), c)

    # ---- per-triplet LCA margin loss -------------------------------------------------------
    def _chunk_losses(self, dist, i, j, k):
        """Loss of each triplet (before dropping), LCA(i, j) and LCA(i, j, k) indices.

        ``dist`` is (N, P) point→candidate distances; every op here is O(len(i)·P)."""
        di, dj, dk = dist[i], dist[j], dist[k]
        m_ij = torch.maximum(di, dj)
        m_ijk = torch.maximum(m_ij, dk)
        logit_ij, logit_ijk = -m_ij / self.tau, -m_ijk / self.tau
        if self._lca_stochastic():
            logit_ij = logit_ij + _gumbel_like(logit_ij)
            logit_ijk = logit_ijk + _gumbel_like(logit_ijk)
        a = logit_ij.argmax(dim=1)  # first maximum = lowest index on ties
        b = logit_ijk.argmax(dim=1)

        def at(d, idx):
            return d.gather(1, idx.view(-1, 1)).squeeze(1)

        delta = self.margin
        h1 = at(di, a) - at(di, b) + delta  # hard values: the loss value uses the selected proxies
        h2 = at(dj, a) - at(dj, b) + delta
        h3 = at(dk, b) - at(dk, a) + delta
        # Straight-through: d(x, ρ) = Σ_p (onehot_p + π_p − sg(π_p)) d(x, p). The π-parts of the six
        # distances are gathered into one exactly-zero term whose gradient is the softmax's;
        # each enters through its hinge, hence the (detached) active-hinge factors.
        loss = torch.relu(h1) + torch.relu(h2) + torch.relu(h3)
        if not (torch.is_grad_enabled() and dist.requires_grad):
            return loss, a, b
        with torch.no_grad():
            on1, on2, on3 = (h1 > 0).to(di.dtype), (h2 > 0).to(di.dtype), (h3 > 0).to(di.dtype)
        s_ij, s_ijk = logit_ij.softmax(dim=1), logit_ijk.softmax(dim=1)
        st = (s_ij - s_ij.detach()) - (s_ijk - s_ijk.detach())  # 0 valued
        weighted = on1.view(-1, 1) * di + on2.view(-1, 1) * dj - on3.view(-1, 1) * dk
        loss = loss + (st * weighted).sum(dim=1)
        return loss, a, b

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
            if len(indices_tuple) not in (3, 4):
                raise ValueError(f"indices_tuple must be a PML triplet (3) or pair (4) tuple, got {len(indices_tuple)}")
            a, p, n = lmu.convert_to_triplets(tuple(t.to(dev).long() for t in indices_tuple), labels, ref_labels)
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
            pos = _mutual_nn(proxy_dist, self.proxy_nn_k, eye)
            neg = ~pos & ~eye
        return _triplets_from_masks(pos, neg, self.max_proxy_triplets)

    # ---- PML entry point -------------------------------------------------------------------
    def forward(self, embeddings, labels=None, indices_tuple=None, ref_emb=None, ref_labels=None):
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
        c = pb.as_curvature(self._c, dtype, embeddings.device)
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
