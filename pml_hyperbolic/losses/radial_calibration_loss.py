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
from ._common import check_inputs_on_call, check_positive, pair_masks


def retrieval_success_target(distances: torch.Tensor, positives: torch.Tensor, candidates: torch.Tensor,
                             temperature: float) -> torch.Tensor:
    r"""Soft "is the top-1 neighbour of the same class": the softmax mass on the positives.

    .. math:: q_i = \sum_{j \in P(i)} \frac{\exp(-D_{ij}/\tau)}{\sum_{k \in P(i) \cup N(i)} \exp(-D_{ik}/\tau)}

    ``distances`` (B, R), ``positives`` / ``candidates`` boolean (B, R) masks (candidates ⊇ positives,
    the sample itself excluded). Returns (B,) in [0, 1]; rows without candidates give 0.

    Raises:
        ValueError: ``temperature`` not a number in [1e-12, 1e12].
    """
    temperature = check_positive(temperature, "temperature")
    logits = (-distances / temperature).masked_fill(~candidates, -math.inf)
    weights = torch.softmax(logits, dim=1).nan_to_num(0.0)  # an all -inf row gives NaN: no candidates
    return (weights * positives).sum(dim=1)


def targets_tolerance(target: torch.Tensor) -> float:
    """Spread below which targets count as equal: 32 ulps of 1 in ``target``'s dtype (float32 at
    least), above the rounding of a softmax mass summed over thousands of candidates."""
    return 32.0 * torch.finfo(torch.promote_types(target.dtype, torch.float32)).eps


def targets_carry_no_information(target: torch.Tensor) -> bool:
    """True when ``target`` has fewer than two entries or all are equal up to :func:`targets_tolerance`."""
    if target.numel() < 2:
        return True
    return bool((target.max() - target.min()) <= targets_tolerance(target))


def radius_ranking_loss(d0: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
    r"""Weighted pairwise logistic ranking of the radii by the targets:

    .. math:: \ell = \frac{\sum_{i,j} w_{ij}\, s\,\operatorname{softplus}\big(-(d_0^i - d_0^j)/s\big)}{\sum_{i,j} w_{ij}},
              \qquad w_{ij} = \max(0,\ q_i - q_j)

    (a smooth surrogate of "the better retrieved sample sits farther from the origin", weighted by how
    much better). ``d0`` (B,), ``target`` q (B,), no gradient through q.

    Returns exactly 0 (connected to ``d0``, zero gradient) when the targets carry no information:
    all equal up to :func:`targets_tolerance` (a softmax mass that is 1 in exact arithmetic differs
    by rounding only, and the weights are normalised by their sum, so that rounding noise would
    otherwise be scaled up to a full-size loss).

    Raises:
        ValueError: ``scale`` not a number in [1e-12, 1e12].
    """
    scale = check_positive(scale, "scale")
    if targets_carry_no_information(target):
        return d0.sum() * 0.0
    w = (target[:, None] - target[None, :]).clamp_min(0)
    margin = (d0[:, None] - d0[None, :]) / scale
    total = w.sum()
    if not bool(total > 0):
        return d0.sum() * 0.0
    return scale * (w * torch.nn.functional.softplus(-margin)).sum() / total


class RadialCalibrationLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Order the distances to the origin by how well each sample is retrieved in its batch.

    .. math::
        \mathcal{L} = \frac{\sum_{i,j} w_{ij}\, s\,\operatorname{softplus}\big(-(d_0(z_i) - d_0(z_j))/s\big)}
                            {\sum_{i,j} w_{ij}},\qquad
        w_{ij} = \max\big(0,\ \operatorname{sg}(q_i) - \operatorname{sg}(q_j)\big),\qquad
        q_i = \sum_{j \in P(i)} \operatorname{softmax}_{k \ne i}\big(-D(z_i, z_k)/\tau\big)_j

    q is the soft "a neighbour of the same class comes first" (softmax mass on the positives; ``sg``:
    no gradient, the target only moves the radius). Hyp-UML reads the uncertainty off the distance to
    the origin d₀; trained by a metric loss alone the radius ranks failures only weakly. This term
    asks, for every pair of anchors, that the better retrieved one sit farther from the origin (more
    certain). Only the *order* of the radii is trained, not their level, so the metric loss keeps
    the scale of the distances.

    Why a ranking and not a regression of d₀/d₀max on q: a regression pulls every radius inward
    (early in training most q are small), which shrinks all distances and costs recall.

    Anchors without a positive in the reference set are left out (their q would be 0 by construction);
    a batch with fewer than two anchors gives ``zero_losses()``, and a batch whose targets are all
    equal up to rounding (e.g. every label the same: every q is 1) gives exactly 0 with zero gradient. ``indices_tuple`` (a miner's pairs)
    restricts P(i) and the softmax to the mined pairs, as in :class:`PairwiseCrossEntropyLoss`.

    Args:
        c: the head's :class:`~pml_hyperbolic.geometry.PoincareGeometry` (by reference: its curvature
            gives d₀ and the distances).
        temperature: τ > 0 of the soft top-1, default 0.2 (Hyp-ViT's).
        scale: s > 0, the radius gap (in units of d₀) over which the logistic saturates, default 0.1.
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance(c=c)``; ``reducer``, ...).

    Raises:
        ValueError: ``c`` is not a ``PoincareGeometry``, or ``temperature`` / ``scale`` ≤ 0.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) or (N, K) with one row per embedding (of (N, K) hierarchical labels, finest level
            first, the finest column defines the positives), a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors.

    Design note: docs/design/losses.md
    """

    def __init__(self, c: PoincareGeometry | None = None, temperature: float = 0.2, scale: float = 0.1,
                 **kwargs):
        if not isinstance(c, PoincareGeometry):
            raise ValueError("RadialCalibrationLoss needs the head's PoincareGeometry as c= (shared by reference "
                             f"with the head), got {type(c).__name__}")
        kwargs.setdefault("distance", PoincareDistance(c=c))
        super().__init__(**kwargs)
        self.geometry = c
        self.temperature = check_positive(temperature, "temperature")
        self.scale = check_positive(scale, "scale")
        self.add_to_recordable_attributes(list_of_names=["temperature", "scale"], is_stat=False)
        check_inputs_on_call(self, hierarchical=True)

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None,
                indices_tuple: tuple | None = None, ref_emb: torch.Tensor | None = None,
                ref_labels: torch.Tensor | None = None):
        """As PML's forward; (N, K) hierarchical labels (finest level first, as the unsupervised
        recipe passes them to every loss of its ``MultipleLosses``) count by their finest column."""
        if labels is not None and labels.ndim == 2:
            labels = labels[:, 0]
        if ref_labels is not None and ref_labels.ndim == 2:
            ref_labels = ref_labels[:, 0]
        return super().forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)

    def get_default_reducer(self):
        return MeanReducer()

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        pos, neg = pair_masks(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        anchors = torch.where(pos.any(dim=1))[0]
        if len(anchors) < 2:
            return self.zero_losses()
        with torch.no_grad():
            distances = self.distance(embeddings, ref_emb)
            if self.distance.is_inverted:
                distances = -distances
            distances = distances.to(torch.promote_types(distances.dtype, torch.float32))
            target = retrieval_success_target(distances, pos, pos | neg, self.temperature)
        d0 = self.geometry.dist0(embeddings).reshape(-1)[anchors]
        target = target[anchors]
        if targets_carry_no_information(target):  # checked before a cast to a half-precision d0
            loss = d0.sum() * 0.0
        else:
            loss = radius_ranking_loss(d0, target.to(d0.dtype), self.scale)
        return {"loss": {"losses": loss, "indices": None, "reduction_type": "already_reduced"}}
