"""Pairwise cross-entropy (Hyp-ViT, Ermolov et al. CVPR'22; the hyperbolic loss of HCL)."""
from __future__ import annotations

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer

from ..distances import PoincareDistance
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import check_bool, check_inputs_on_call, check_positive, pair_masks, similarity_logits


class PairwiseCrossEntropyLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Pairwise cross-entropy over every positive pair, O(B²) memory.

    For each positive pair (i, j) (both orders):

    .. math::
        \ell_{ij} = -\log \frac{\exp(-D(z_i, z_j)/\tau)}{\sum_{k \ne i} \exp(-D(z_i, z_k)/\tau)}

    (Hyp-ViT Eq. (5); HypMix Eq. (6); HCL's hyperbolic branch uses the same form with a queue).
    The denominator runs over all k ≠ i of the reference set; with an ``indices_tuple`` (PML miner,
    CrossBatchMemory) it runs over the anchor's mined positives and negatives instead, the way PML's
    ``SupConLoss`` does. With the default ``MeanReducer`` the loss returns the mean over positive
    pairs itself ("already_reduced": no list of pairs, whose length would have to be read back from
    the device); any other reducer receives one element per positive pair ("pos_pair"). A batch
    without positive pairs gives 0. A batch of one class is valid (positives only in the denominator).

    For an inverted distance (a similarity, e.g. ``CosineSimilarity`` for the "Sph-" baseline), the
    logits are sim/τ (Hyp-ViT's sphere baseline uses τ = 0.1).

    Args:
        temperature: τ > 0, default 0.2 (Hyp-ViT at the default curvature, Sec. 4 / authors' code).
        view_pairs: the authors' multi-view formulation. The batch is seen as (classes, m): each class
            must occur exactly m ≥ 2 times (view v of a class = its v-th occurrence in batch order).
            For every ordered pair of views (v, w), v ≠ w, a cross-entropy with anchor view v of each
            class, positive view w of the same class, negatives views v and w of the other classes
            (denominator: all of views v and w except the anchor); each term is averaged over
            classes and the m(m−1) terms are **summed**. Each sample's element loss is
            m·Σ_w ℓ(v→w), so the default MeanReducer returns exactly that sum. With m = 2 this is
            exactly 2 × the default (mean) formulation. ``ref_emb`` and ``indices_tuple`` are not
            supported in this mode (ValueError). Computed without a loop over view pairs: with
            :math:`L_{a,u} = \log\sum_{k \in \text{view } u,\, k \ne a} e^{\text{logit}_{ak}}`
            (one (B, m) per-view log-sum-exp after one regrouping copy of the logits), the
            denominator of (v → w) for anchor a is ``logaddexp(L[a, v], L[a, w])``: O(B²) + O(B·m).
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance()`` (default geometry) as Hyp-ViT; ``reducer``, ...).

    Raises:
        ValueError: ``temperature`` ≤ 0; at call time with ``view_pairs``, a batch whose classes do
            not all occur the same number m ≥ 2 of times, or a ``ref_emb`` / ``indices_tuple``.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) with one row per embedding, a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors; at
            construction, a boolean flag that is not a bool.

    Memory: one (B, R) logit matrix (PML's ``NTXentLoss`` builds O(B³)); two with ``view_pairs``.

    Design note: docs/design/losses.md
    """

    def __init__(self, temperature: float = 0.2, view_pairs: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.temperature = check_positive(temperature, "temperature")
        self.view_pairs = check_bool(view_pairs, "view_pairs")
        self.add_to_recordable_attributes(list_of_names=["temperature"], is_stat=False)
        check_inputs_on_call(self)

    def get_default_distance(self):
        return PoincareDistance()

    def get_default_reducer(self):
        return MeanReducer()

    def logits(self, embeddings: torch.Tensor, ref_emb: torch.Tensor):
        """(B, R) similarity logits, larger = more similar, float32 or wider."""
        return similarity_logits(self.distance(embeddings, ref_emb), self.distance.is_inverted) / self.temperature

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        if self.view_pairs:
            if ref_emb is not embeddings or indices_tuple is not None:
                raise ValueError("view_pairs=True supports neither ref_emb nor indices_tuple")
            return self._view_pair_loss(embeddings, labels)
        pos, neg = pair_masks(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if type(self.reducer) is MeanReducer:
            # the mean over positive pairs without listing them: no data-dependent shape, so the host
            # never waits for the device in this loss (the list below needs the pair count first)
            return self._mean_pair_loss(self.logits(embeddings, ref_emb), pos, pos | neg)
        if not bool(pos.any()):
            return self.zero_losses()
        logits = self.logits(embeddings, ref_emb)
        return self._pair_losses(logits, pos, pos | neg)

    def _mean_pair_loss(self, logits, pos, keep):
        """The default ``MeanReducer``'s value of :meth:`_pair_losses` (0 without positive pairs),
        already reduced."""
        zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
        per_pair = torch.where(pos, self._log_denominator(logits, keep) - logits, zero)
        loss = per_pair.sum() / pos.sum().clamp_min(1).to(per_pair.dtype)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}

    @staticmethod
    def _log_denominator(logits, keep):
        # masked log-sum-exp over the anchor's candidates (rows with a positive always keep ≥ 1)
        return torch.logsumexp(logits.masked_fill(~keep, float("-inf")), dim=1, keepdim=True)

    def _pair_losses(self, logits, pos, keep):
        log_denominator = self._log_denominator(logits, keep)
        a, p = torch.where(pos)
        losses = log_denominator[a, 0] - logits[a, p]
        return {"loss": {"losses": losses, "indices": (a, p), "reduction_type": "pos_pair"}}

    def _view_pair_loss(self, embeddings, labels):
        if labels is None:
            raise ValueError("labels are required for view_pairs=True")
        B = embeddings.shape[0]
        if labels.ndim != 1 or labels.shape[0] != B:
            raise ValueError(f"labels must be a 1-D tensor of length {B}")
        classes, inverse, counts = torch.unique(labels, return_inverse=True, return_counts=True)
        if classes.numel() < 1:
            return self.zero_losses()
        m = int(counts[0])
        if not bool((counts == m).all()) or m < 2:
            raise ValueError("labels: view_pairs=True needs every class exactly m >= 2 times, "
                             f"got counts {counts.tolist()}")
        # view index of each sample = its occurrence rank within its class (stable batch order)
        order = torch.sort(inverse, stable=True).indices
        view_of = torch.empty_like(inverse)
        view_of[order] = torch.arange(B, device=labels.device) % m
        member = torch.empty(classes.numel(), m, dtype=torch.long, device=labels.device)
        member[inverse[order], view_of[order]] = order
        C = classes.numel()
        logits = self.logits(embeddings, embeddings)
        # Columns regrouped view-major: grouped[a, u, k] = logits[a, member[k, u]], one copy of
        # the (B, B) matrix; the anchor itself is then masked out of its own view.
        grouped = logits[:, member.T.reshape(-1)].view(B, m, C)
        rows = torch.arange(B, device=logits.device)
        grouped[rows, view_of, inverse] = float("-inf")
        # (B, m) per-view log-sum-exp of each row, self excluded: O(B²) once.
        view_lse = torch.logsumexp(grouped, dim=2)
        # Anchor a (view v), positive view w: denominator = views v and w minus a, i.e.
        # logaddexp(view_lse[a, v], view_lse[a, w]); positive logit = grouped[a, w, class(a)].
        # Column w = v is no pair: its inputs are neutralised before use (a class alone in the
        # batch has an empty own view, logaddexp(-inf, -inf) would give a NaN gradient).
        is_own = view_of.view(-1, 1) == torch.arange(m, device=logits.device)
        own = view_lse.gather(1, view_of.view(-1, 1))
        other = view_lse.masked_fill(is_own, 0.0)
        positive = grouped.gather(2, inverse.view(B, 1, 1).expand(B, m, 1)).squeeze(2).masked_fill(is_own, 0.0)
        terms = (torch.logaddexp(own, other) - positive).masked_fill(is_own, 0.0)  # (B, m)
        per_sample = m * terms.sum(dim=1)
        idx = torch.arange(B, device=embeddings.device)
        return {"loss": {"losses": per_sample, "indices": idx, "reduction_type": "element"}}
