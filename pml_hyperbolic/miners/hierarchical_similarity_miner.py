"""Triplets ordered by hierarchical similarity (Yan et al., CVPR'21, unsupervised)."""
from __future__ import annotations

import numbers

import torch
from pytorch_metric_learning.distances import BaseDistance
from pytorch_metric_learning.miners import BaseMiner
from pytorch_metric_learning.utils import common_functions as c_f

from ..distances import PoincareDistance
from ..manifold_tensors import AcceptsManifoldTensors
from ..losses._common import check_bool, check_int, check_miner_inputs_on_call
from .._batch_utils import self_match_mask
from .hierarchical_pseudo_labeler import HierarchicalPseudoLabeler
from ..hierarchy_levels import as_hierarchical_labels, pairwise_first_shared_level


class HierarchicalSimilarityMiner(AcceptsManifoldTensors, BaseMiner):
    r"""Mine triplets (i, j, l) whose hierarchical similarity levels satisfy :math:`s_{ij} < s_{il}`.

    Yan et al., "Unsupervised Hyperbolic Metric Learning" (CVPR 2021), Eq. 4–5: the log-ratio
    loss :math:`(\log\frac{D(z_i,z_j)}{D(z_i,z_l)} - (s_{ij}-s_{il})\log\Omega)^2` is applied to
    triplets around each anchor i; j is more similar to i than l is. s is the level at which two
    samples first share a cluster (1 = same finest cluster = most similar, K + 1 = never; see
    :func:`~pml_hyperbolic.miners.hierarchy.pairwise_first_shared_level`, shared with
    ``HierarchicalLogRatioLoss``).

    Labels may be

    * N × K hierarchical labels (finest first), e.g. from
      :meth:`HierarchicalPseudoLabeler.fit_predict`;
    * 1-D labels: finest-level cluster ids decoded through ``pseudo_labeler.fine_to_hierarchy_``
      if a fitted ``pseudo_labeler`` is attached (this is how hierarchical labels pass through
      ``CrossBatchMemory``, whose label memory is 1-D), otherwise flat labels (K = 1);
    * ``None``: the batch (plus ``ref_emb``) is clustered on the fly by ``pseudo_labeler``
      (required then; its levels must fit the batch size).

    Triplets: all (i, j, l) with j, l in the reference set, neither of them the anchor itself
    (dense, as in the log-ratio loss of Kim et al. that Yan et al. build on), or, with
    ``triplets_per_anchor=T``, T triplets per anchor drawn uniformly with replacement from that
    anchor's valid set (dense mining is O(B³); use T for large batches). ``violating_only=True``
    keeps only triplets whose distances contradict the hierarchy, D(i, j) ≥ D(i, l) (for a
    similarity: sim(i, j) ≤ sim(i, l)), computed with ``distance``.

    Args:
        distance: PML distance used by ``violating_only`` (default ``PoincareDistance()`` (default geometry)).
        pseudo_labeler: optional :class:`HierarchicalPseudoLabeler` (decoding/on-the-fly labels).
        triplets_per_anchor: ``None`` (all) or an int ≥ 1.
        violating_only: keep only order-violating triplets (default False: the paper trains on
            all ordered triplets, the loss being a regression target for each).
        seed: seed of the sampler (``None``: the global torch RNG).

    Raises:
        ValueError: ``pseudo_labeler`` of another type, ``triplets_per_anchor`` not an integer ≥ 1,
            ``seed`` < 0; at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) / (N, K) with one row per embedding, ``ref_emb`` of another dimension or without
            ``ref_labels``, or no labels and no ``pseudo_labeler``.
        TypeError: ``violating_only`` not a bool or ``seed`` not an integer; at call time,
            embeddings that are not floating-point tensors or labels that are not tensors.

    Design note: docs/design/miners.md
    """

    def __init__(
        self,
        distance: BaseDistance | None = None,
        pseudo_labeler: HierarchicalPseudoLabeler | None = None,
        triplets_per_anchor: int | None = None,
        violating_only: bool = False,
        seed: int | None = None,
        **kwargs,
    ):
        if distance is None:
            distance = PoincareDistance()
        super().__init__(distance=distance, **kwargs)
        if pseudo_labeler is not None and not isinstance(pseudo_labeler, HierarchicalPseudoLabeler):
            raise ValueError("pseudo_labeler must be a HierarchicalPseudoLabeler or None")
        if triplets_per_anchor is not None and (
            isinstance(triplets_per_anchor, bool)
            or not isinstance(triplets_per_anchor, numbers.Integral)
            or triplets_per_anchor < 1
        ):
            raise ValueError(f"triplets_per_anchor must be None or an integer >= 1, got {triplets_per_anchor!r}")
        self.pseudo_labeler = pseudo_labeler
        self.triplets_per_anchor = triplets_per_anchor
        self.violating_only = check_bool(violating_only, "violating_only")
        self.seed = None if seed is None else check_int(seed, "seed", 0)
        self._generator = None
        check_miner_inputs_on_call(self, hierarchical=True, labels_optional=True)

    # ------------------------------------------------------------------------------------------
    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None,
                ref_emb: torch.Tensor | None = None, ref_labels: torch.Tensor | None = None):
        """As ``BaseMiner.forward`` but labels may be N × K (or ``None`` with a pseudo-labeler)."""
        self.reset_stats()
        with torch.no_grad():
            if labels is not None and labels.shape[0] != embeddings.shape[0]:
                raise ValueError(
                    f"labels must have one row per embedding: got {labels.shape[0]} labels for {embeddings.shape[0]} embeddings"
                )
            if ref_emb is not None and ref_labels is not None and ref_labels.shape[0] != ref_emb.shape[0]:
                raise ValueError(
                    f"ref_labels must have one row per ref_emb row: got {ref_labels.shape[0]} for {ref_emb.shape[0]}"
                )
            if ref_emb is None:
                ref_emb, ref_labels = embeddings, labels
            labels, ref_labels = self._hierarchical_labels(embeddings, labels, ref_emb, ref_labels)
            output = self.mine(embeddings, labels, ref_emb, ref_labels)
        self.output_assertion(output)
        return output

    def _decode(self, labels, name):
        h = as_hierarchical_labels(labels, name)
        table = getattr(self.pseudo_labeler, "fine_to_hierarchy_", None)
        if labels.ndim == 1 and table is not None:
            if labels.numel() and (labels.min() < 0 or labels.max() >= table.shape[0]):
                raise ValueError(f"1-D {name} must be finest-level ids in [0, {table.shape[0]}) of the pseudo_labeler")
            h = table.to(labels.device)[labels]
        return h

    def _hierarchical_labels(self, embeddings, labels, ref_emb, ref_labels):
        same_ref = ref_emb is embeddings
        if labels is None or ref_labels is None:
            if self.pseudo_labeler is None:
                raise ValueError("labels is None: pass labels or a pseudo_labeler to cluster the batch")
            both = embeddings if same_ref else torch.cat([embeddings, ref_emb.to(embeddings)], 0)
            h = self.pseudo_labeler.fit_predict(both.float()).to(embeddings.device)
            return (h, h) if same_ref else (h[: len(embeddings)], h[len(embeddings) :])
        labels = c_f.to_device(labels, embeddings)
        h = self._decode(labels, "labels")
        hr = h if (same_ref and ref_labels is labels) else self._decode(c_f.to_device(ref_labels, embeddings), "ref_labels")
        if hr.shape[1] != h.shape[1]:
            raise ValueError(f"ref_labels must have the same number of levels as labels ({h.shape[1]}), got {hr.shape[1]}")
        return h, hr

    # ------------------------------------------------------------------------------------------
    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb: torch.Tensor,
             ref_labels: torch.Tensor):
        s = pairwise_first_shared_level(labels, ref_labels)
        is_self = self_match_mask(embeddings, ref_emb, s == 1)
        s = s.masked_fill(is_self, 0)  # level 0 marks "not a candidate"
        order_dist = None
        if self.violating_only:
            order_dist = self.distance(embeddings, ref_emb).float()
            if self.distance.is_inverted:
                order_dist = -order_dist
        if self.triplets_per_anchor is None:
            return self._all_triplets(s, order_dist)
        return self._sampled_triplets(s, order_dist)

    def _all_triplets(self, s, order_dist):
        b, r = s.shape
        chunk = max(1, (1 << 26) // max(1, r * r))
        out = [], [], []
        for start in range(0, b, chunk):
            sc = s[start : start + chunk]
            ok = (sc[:, :, None] < sc[:, None, :]) & (sc[:, :, None] > 0)
            if order_dist is not None:
                dc = order_dist[start : start + chunk]
                ok &= dc[:, :, None] >= dc[:, None, :]
            i, j, l = ok.nonzero(as_tuple=True)
            out[0].append(i + start)
            out[1].append(j)
            out[2].append(l)
        if not out[0]:
            e = torch.empty(0, dtype=torch.long, device=s.device)
            return e, e.clone(), e.clone()
        return tuple(torch.cat(t) for t in out)

    def _rng(self, device):
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != torch.device(device):
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(int(self.seed))
        return self._generator

    def _sampled_triplets(self, s, order_dist):
        """T triplets per anchor, uniform over its valid (j, l) pairs.

        Per anchor: level counts h_v (v = 1..K+1) and g_v = Σ_{w>v} h_w; the level of j is drawn
        with probability ∝ h_v g_v, then j uniformly among the h_v samples at that level and l
        uniformly among the g_v samples at a coarser level, so every valid pair has probability
        1 / Σ_v h_v g_v. With ``violating_only`` the draw is followed by a filter (fewer than T
        may remain).
        """
        device = s.device
        b, r = s.shape
        t = self.triplets_per_anchor
        levels = int(s.max()) + 1 if s.numel() else 1
        hist = torch.zeros(b, levels, dtype=torch.long, device=device)
        hist.scatter_add_(1, s, torch.ones_like(s))
        hist[:, 0] = 0  # non-candidates
        greater = hist.flip(1).cumsum(1).flip(1) - hist
        weight = (hist * greater).double()
        has = weight.sum(1) > 0
        e = torch.empty(0, dtype=torch.long, device=device)
        if not bool(has.any()):
            return e, e.clone(), e.clone()
        anchors = has.nonzero(as_tuple=True)[0]
        gen = self._rng(device)
        level = torch.multinomial(weight[anchors], t, replacement=True, generator=gen)  # A × T
        order = torch.sort(s, dim=1, stable=True).indices
        start = torch.cumsum(hist, 1) - hist  # position of level v's first entry in the sorted row
        start[:, 0] = 0
        # entries of level 0 sort first; shift by their count
        n_invalid = (s == 0).sum(1, keepdim=True)
        start = start + n_invalid
        a_rows = anchors[:, None].expand(-1, t)
        h_v = hist[a_rows, level]
        g_v = greater[a_rows, level]
        u1 = torch.rand(level.shape, generator=gen, device=device, dtype=torch.float64)
        u2 = torch.rand(level.shape, generator=gen, device=device, dtype=torch.float64)
        pos_j = start[a_rows, level] + (u1 * h_v).long().clamp_max(h_v - 1)
        pos_l = start[a_rows, level] + h_v + (u2 * g_v).long().clamp_max(g_v - 1)
        j = order[a_rows, pos_j]
        l = order[a_rows, pos_l]
        i = a_rows.reshape(-1)
        j, l = j.reshape(-1), l.reshape(-1)
        if order_dist is not None:
            keep = order_dist[i, j] >= order_dist[i, l]
            i, j, l = i[keep], j[keep], l[keep]
        return i, j, l
