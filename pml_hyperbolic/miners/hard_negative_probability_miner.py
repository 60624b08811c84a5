"""Geometry-aware hard-negative miner: triplets weighted by the contrastive loss's softmax."""
from __future__ import annotations

import torch
from pytorch_metric_learning.distances import BaseDistance
from pytorch_metric_learning.miners import BaseMiner

from ..distances import PoincareDistance
from ..manifold_tensors import AcceptsManifoldTensors
from ..losses._common import check_bool, check_miner_inputs_on_call, check_positive
from .._batch_utils import (
    check_threshold,
    check_top_k,
    join_pairs_to_triplets,
    self_match_mask,
)


class HardNegativeProbabilityMiner(AcceptsManifoldTensors, BaseMiner):
    r"""Mine the triplets (a, p, n) that carry the most gradient in a pairwise cross-entropy.

    HypMix (Yue et al., "Understanding Hyperbolic Metric Learning through Hard Negative
    Sampling", Sec. 3.2, Eq. 9) writes the gradient of the hyperbolic pairwise cross-entropy of
    anchor a as :math:`\frac1\tau\sum_{k\ne a} p(x^-)\,\nabla(D_{a,+} - D_{a,k})` with

    .. math:: p(x^-_k) = \frac{\exp(-D_{a,k}/\tau)}{\exp(-D_{a,+}/\tau) + \sum_{k'\ne a}
              \exp(-D_{a,k'}/\tau)} = \operatorname{softmax}_{k \in C(a)}\big(-D_{a,k}/\tau\big),

    i.e. each negative's weight is its share of the softmax over the anchor's row. This miner
    computes that softmax and keeps the negatives whose weight is large.

    Candidates C(a) (the softmax's support): every reference sample except the anchor itself,
    **positives included** (``include_positives=True``, default). That is the denominator of the
    paper's Eq. 9 and of the Hyp-ViT pairwise cross-entropy (Σ_{k≠i}), so p(n) is exactly the
    gradient weight that loss gives n; it does not depend on which positive is paired with a.
    ``include_positives=False`` normalises over the negatives only (p then measures hardness
    relative to the other negatives and ignores how close the positives are).

    Selection per anchor (over its negatives, i.e. reference samples with another label):

    * ``threshold`` t ∈ (0, 1]: keep n with p(n) ≥ t (at most ⌊1/t⌋ negatives per anchor,
      since the weights sum to ≤ 1);
    * ``top_k`` k ≥ 1: keep the k negatives with the largest p(n) (all if fewer);
    * both: the top-k negatives that also reach the threshold;
    * neither: keep the negatives whose weight is above uniform, p(n) > 1/|C(a)| (i.e. closer
      than the "average" candidate in the softmax sense; a parameter-free default).

    Output: every (a, p, n) with p a positive of a (same label, not a itself) and n a selected
    negative of a, as three int64 index tensors (a into ``embeddings``, p and n into ``ref_emb``).

    Similarities work too: if ``distance.is_inverted`` (e.g. ``CosineSimilarity``), the logit is
    ``+sim/τ`` instead of ``-D/τ``. The softmax is computed in float32 (float64 kept), so fp16
    distances under autocast are fine.

    Self matches: when ``ref_emb`` is not ``embeddings`` a reference entry with the anchor's label
    and a bit-identical embedding is taken to be the anchor itself (``CrossBatchMemory`` and
    ``DistributedMinerWrapper(efficient=True)`` put the batch inside the reference set) and is left
    out of both the softmax and the positives.

    Args:
        distance: any PML distance; default ``PoincareDistance()`` (the package's default curvature,
            Hyp-ViT/HypMix's).
        temperature: τ > 0; default 0.2 (the hyperbolic τ of Hyp-ViT and HypMix; HypMix uses
            0.05 for the cosine branch).
        threshold: weight threshold in (0, 1] or ``None``.
        top_k: negatives kept per anchor (int ≥ 1) or ``None``.
        include_positives: whether positives are part of the softmax (see above).

    Raises:
        ValueError: ``temperature`` not in [1e-12, 1e12], ``threshold`` outside (0, 1], ``top_k``
            not an integer ≥ 1; at call time, embeddings not (N, D) or with NaN/Inf, missing
            labels, labels not integer (N,), ``ref_emb`` of another dimension or without
            ``ref_labels``.
        TypeError: ``include_positives`` not a bool; at call time, embeddings that are not
            floating-point tensors or labels that are not tensors.

    Design note: docs/design/miners.md
    """

    def __init__(
        self,
        distance: BaseDistance | None = None,
        temperature: float = 0.2,
        threshold: float | None = None,
        top_k: int | None = None,
        include_positives: bool = True,
        **kwargs,
    ):
        if distance is None:
            distance = PoincareDistance()
        super().__init__(distance=distance, **kwargs)
        self.temperature = check_positive(temperature, "temperature")
        self.threshold = check_threshold(threshold, "threshold")
        self.top_k = check_top_k(top_k, "top_k")
        self.include_positives = check_bool(include_positives, "include_positives")
        self.add_to_recordable_attributes(
            list_of_names=["temperature", "threshold"], is_stat=False
        )
        check_miner_inputs_on_call(self)

    # ----------------------------------------------------------------------------------------
    def _masks(self, embeddings, labels, ref_emb, ref_labels):
        if labels is None or ref_labels is None:
            raise ValueError("labels are required: HardNegativeProbabilityMiner mines by class")
        same = labels[:, None] == ref_labels[None, :]
        is_self = self_match_mask(embeddings, ref_emb, same)
        pos = same & ~is_self
        neg = ~same
        return pos, neg, is_self

    def _weights(self, embeddings, ref_emb, pos, neg, is_self):
        """B×R softmax weights p (0 outside the candidate set) and the candidate mask."""
        mat = self.distance(embeddings, ref_emb)
        mat = mat.float() if mat.dtype not in (torch.float32, torch.float64) else mat
        logits = mat / self.temperature if self.distance.is_inverted else -mat / self.temperature
        candidates = (pos | neg) if self.include_positives else neg.clone()
        candidates &= ~is_self
        logits = logits.masked_fill(~candidates, float("-inf"))
        has_candidate = candidates.any(dim=1, keepdim=True)
        # rows without any candidate would give 0/0; give them an all-zero weight row
        logits = torch.where(has_candidate, logits, torch.zeros_like(logits))
        weights = torch.softmax(logits, dim=1) * candidates
        return weights, candidates

    def negative_weights(self, embeddings: torch.Tensor, labels: torch.Tensor,
                         ref_emb: torch.Tensor | None = None, ref_labels: torch.Tensor | None = None):
        """The B×R matrix of weights p(x⁻) (HypMix Eq. 9; 0 for non-candidates), without mining.

        Useful to inspect how a geometry spreads the gradient over negatives (HypMix Fig. 3).
        """
        with torch.no_grad():
            labels = labels.to(embeddings.device)
            if ref_emb is None:
                ref_emb, ref_labels = embeddings, labels
            pos, neg, is_self = self._masks(embeddings, labels, ref_emb, ref_labels)
            return self._weights(embeddings, ref_emb, pos, neg, is_self)[0]

    def selection_masks(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb: torch.Tensor,
                        ref_labels: torch.Tensor):
        """(positive-pair mask, selected-negative mask), both B×R bool: the mining decision."""
        pos, neg, is_self = self._masks(embeddings, labels, ref_emb, ref_labels)
        weights, candidates = self._weights(embeddings, ref_emb, pos, neg, is_self)
        selected = neg.clone()
        if self.threshold is not None:
            selected &= weights >= self.threshold
        if self.top_k is not None:
            k = min(self.top_k, weights.shape[1])
            neg_scores = weights.masked_fill(~neg, -1.0)
            top = torch.topk(neg_scores, k, dim=1).indices
            in_top = torch.zeros_like(selected)
            in_top.scatter_(1, top, True)
            selected &= in_top
        if self.threshold is None and self.top_k is None:
            n_candidates = candidates.sum(dim=1, keepdim=True).clamp_min(1)
            selected &= weights > (1.0 / n_candidates.to(weights.dtype))
        return pos, selected

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb: torch.Tensor,
             ref_labels: torch.Tensor):
        pos, selected = self.selection_masks(embeddings, labels, ref_emb, ref_labels)
        return join_pairs_to_triplets(pos, selected)
