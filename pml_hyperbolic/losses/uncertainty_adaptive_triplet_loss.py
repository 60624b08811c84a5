"""Hyp-UML uncertainty-adaptive triplet loss (Yan, Liu, Xu), Eq. (7)."""
from __future__ import annotations

import math

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import AvgNonZeroReducer
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from ..distances import PoincareDistance
from ._common import as_compute, check_nonnegative, pair_masks
from ._uncertainty_mixin import UncertaintyFactorMixin


class UncertaintyAdaptiveTripletLoss(UncertaintyFactorMixin, BaseMetricLossFunction):
    r"""Triplet loss with a per-anchor margin from the anchor's hyperbolic uncertainty.

    .. math::
        \ell_{apn} = [D(z_a, z_p) - D(z_a, z_n) + \alpha_a]_+, \qquad
        \alpha_a = \log(U_a / \max_B U + 1) \cdot \mathrm{margin\_scale}

    with margin_scale = exp(c) by default (Hyp-UML Eq. (7): "* exp(Curvature)"). U as in
    :class:`UncertaintyAdaptiveContrastiveLoss` (``mode``, detached by default; the paper's literal
    U only with ``mode="literal"``, guarded, with a warning). For sound modes α_a ∈ [0, log 2·e^c].
    The max runs over the batch's anchors (``embeddings``).

    Triplets: ``indices_tuple`` (PML triplet tuple, or pair tuple converted by PML's
    ``convert_to_triplets``) or else every (a, p, n) with a ≠ p, y_a = y_p, y_n ≠ y_a, built as a
    (positive pairs × R) matrix: O(B²·m) memory for m samples per class, never PML's B³ mask.
    Default reducer: ``AvgNonZeroReducer`` (as PML's ``TripletMarginLoss``).

    Args:
        margin_scale: ≥ 0 multiplier of the log factor; None = exp(c) (paper).
        mode, c, clip_r, detach_uncertainty: see :class:`UncertaintyAdaptiveContrastiveLoss`.
        distance: default ``PoincareDistance(c=0.1)``; an inverted one uses S(a, n) − S(a, p) + α.
    """

    def __init__(self, margin_scale=None, mode=None, c=None, clip_r=2.3, detach_uncertainty=True, **kwargs):
        super().__init__(**kwargs)
        self.margin_scale = None if margin_scale is None else check_nonnegative(margin_scale, "margin_scale")
        self._init_uncertainty(mode, c, clip_r, detach_uncertainty)

    def get_default_distance(self):
        return PoincareDistance(c=0.1)

    def get_default_reducer(self):
        return AvgNonZeroReducer()

    def margins(self, embeddings):
        """(B,) per-anchor margins α_a."""
        f = self.uncertainty_factor(embeddings)
        if self.margin_scale is not None:
            return f * self.margin_scale
        c = self._curvature()
        c = float(c) if not isinstance(c, torch.Tensor) else float(c.detach())
        return f * math.exp(c)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        mat = as_compute(self.distance(embeddings, ref_emb))
        if not self.distance.is_inverted:
            gap_sign = 1.0  # D(a,p) - D(a,n)
        else:
            gap_sign = -1.0  # S(a,n) - S(a,p)
        alpha = self.margins(embeddings).to(mat.dtype)
        if indices_tuple is not None:
            a, p, n = lmu.convert_to_triplets(indices_tuple, labels, ref_labels)
            if a.numel() == 0:
                return self.zero_losses()
            losses = torch.relu(gap_sign * (mat[a, p] - mat[a, n]) + alpha[a])
            return {"loss": {"losses": losses, "indices": (a, p, n), "reduction_type": "triplet"}}
        pos, neg = pair_masks(embeddings, labels, None, ref_emb, ref_labels)
        pa, pp = torch.where(pos)
        if pa.numel() == 0 or not bool(neg.any()):
            return self.zero_losses()
        # (P, R): one row per positive pair, one column per candidate negative
        gap = gap_sign * (mat[pa, pp].unsqueeze(1) - mat[pa]) + alpha[pa].unsqueeze(1)
        valid = neg[pa]
        row, n = torch.where(valid)
        if row.numel() == 0:
            return self.zero_losses()
        losses = torch.relu(gap[row, n])
        return {"loss": {"losses": losses, "indices": (pa[row], pp[row], n), "reduction_type": "triplet"}}
