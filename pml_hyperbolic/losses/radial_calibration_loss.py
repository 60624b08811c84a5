"""Radial calibration: the distance to the origin is trained to predict how well a sample is retrieved."""
from __future__ import annotations

import math

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer

from .. import poincare_ball as pb
from ..distances import PoincareDistance
from ..geometry import PoincareGeometry
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import check_positive, pair_masks


def retrieval_success_target(distances: torch.Tensor, positives: torch.Tensor, candidates: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    r"""Soft "is the top-1 neighbour of the same class": the softmax mass on the positives.

    .. math:: q_i = \sum_{j \in P(i)} \frac{\exp(-D_{ij}/\tau)}{\sum_{k \in P(i) \cup N(i)} \exp(-D_{ik}/\tau)}

    ``distances`` (B, R), ``positives`` / ``candidates`` boolean (B, R) masks (candidates ⊇ positives,
    the sample itself excluded). Returns (B,) in [0, 1]; rows without candidates give 0.
    """
    logits = (-distances / temperature).masked_fill(~candidates, -math.inf)
    weights = torch.softmax(logits, dim=1).nan_to_num(0.0)  # an all -inf row gives NaN: no candidates
    return (weights * positives).sum(dim=1)


class RadialCalibrationLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Binary cross-entropy between the relative radius and the sample's retrieval success in the batch.

    .. math::
        \ell_i = \mathrm{BCE}\Big(\frac{d_0(z_i)}{d_0^{max}},\; \operatorname{sg}(q_i)\Big),\qquad
        q_i = \sum_{j \in P(i)} \operatorname{softmax}_{k \ne i}\big(-D(z_i, z_k)/\tau\big)_j

    with :math:`d_0^{max} = 2r` the largest distance to the origin the geometry's clipping allows
    (``PoincareGeometry.max_dist0``) and ``sg`` stop-gradient: the target only moves the radius. With
    the polar head (:class:`~pml_hyperbolic.heads.HyperbolicEmbeddingHead`, ``radius="learned"``)
    :math:`d_0/d_0^{max} = \sigma(g(f))`, so this is a logistic regression of the radial confidence
    g on "a neighbour of the same class comes first". Hyp-UML reads the uncertainty off the radius;
    trained by the metric loss alone the radius ranks failures only weakly (``bench/radius.py``), this
    term makes it an explicit, calibrated predictor. Add it beside any loss (PML ``MultipleLosses``).

    Anchors without a positive in the reference set are left out (their target would be 0 by
    construction); a batch with none gives ``zero_losses()``. ``indices_tuple`` (a miner's pairs)
    restricts P(i) and the denominator to the mined pairs, as in :class:`PairwiseCrossEntropyLoss`.

    Args:
        c: the :class:`~pml_hyperbolic.geometry.PoincareGeometry` of the head (by reference): it
            owns the clip radius that fixes :math:`d_0^{max}` and the curvature. Required, and it
            must clip (``clip_r`` set): without clipping :math:`d_0` is unbounded.
        temperature: τ > 0 of the soft top-1, default 0.2 (Hyp-ViT's).
        distance: default ``PoincareDistance(c=c)``.
    """

    def __init__(self, c=None, temperature=0.2, **kwargs):
        if not isinstance(c, PoincareGeometry):
            raise ValueError("RadialCalibrationLoss needs the head's PoincareGeometry as c= (it owns the clip "
                             f"radius that bounds the distance to the origin), got {type(c).__name__}")
        if math.isinf(c.max_dist0()):
            raise ValueError("RadialCalibrationLoss needs a clipping geometry (clip_r set): without it the "
                             "distance to the origin is unbounded and d0 / max d0 is not a probability")
        kwargs.setdefault("distance", PoincareDistance(c=c))
        super().__init__(**kwargs)
        self.geometry = c
        self.temperature = check_positive(temperature, "temperature")
        self.add_to_recordable_attributes(list_of_names=["temperature"], is_stat=False)

    def get_default_reducer(self):
        return MeanReducer()

    def relative_radius(self, embeddings: torch.Tensor) -> torch.Tensor:
        """(B,) d₀(z)/d₀max, clamped into (0, 1) so that the BCE stays finite at the clip radius."""
        eps = 1e-6 if embeddings.dtype == torch.float64 else 1e-4
        return (self.geometry.dist0(embeddings).reshape(-1) / self.geometry.max_dist0()).clamp(eps, 1 - eps)

    def compute_loss(self, embeddings, labels, indices_tuple, ref_emb, ref_labels):
        pos, neg = pair_masks(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        anchors = pos.any(dim=1)
        if not bool(anchors.any()):
            return self.zero_losses()
        with torch.no_grad():
            distances = self.distance(embeddings, ref_emb)
            if self.distance.is_inverted:
                distances = -distances
            target = retrieval_success_target(distances.to(torch.promote_types(distances.dtype, torch.float32)),
                                              pos, pos | neg, self.temperature)
        idx = torch.where(anchors)[0]
        p = self.relative_radius(embeddings)[idx]
        losses = torch.nn.functional.binary_cross_entropy(p, target[idx].to(p.dtype), reduction="none")
        return {"loss": {"losses": losses, "indices": idx, "reduction_type": "element"}}
