"""Hyp-UML uncertainty-adaptive contrastive loss (Yan, Liu, Xu), Eq. (5)-(6)."""
from __future__ import annotations

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer

from ..distances import PoincareDistance
from ..geometry import _UNSET, _Unset
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import check_inputs_on_call, check_positive, pair_masks, similarity_logits
from ._uncertainty_mixin import UncertaintyFactorMixin


class UncertaintyAdaptiveContrastiveLoss(AcceptsManifoldTensors, UncertaintyFactorMixin, BaseMetricLossFunction):
    r"""Pairwise cross-entropy whose temperature is set per anchor by its hyperbolic uncertainty.

    .. math::
        \ell_{ij} = -\log \frac{\exp(-D(z_i, z_j)/\tau_i)}{\sum_{k \ne i} \exp(-D(z_i, z_k)/\tau_i)},
        \qquad \tau_i = \max\!\big(\tau_{min},\ g(\log(U_i / \max_B U + 1))\big)

    Hyp-UML Eq. (6) writes :math:`\tau = \log(U_i/\max U + 1)/\mathrm{scale}` with :math:`U = 1 - D(x, 0)`.
    Both parts are unusable as written (see :mod:`pml_hyperbolic.uncertainty`): ``mode`` picks U
    (default: the sound ``"clip"`` normalisation;
    ``"literal"`` = the paper's U with a guard and a warning). ``scale_rule`` says whether g
    multiplies (default) or divides by ``scale`` — the paper does not say; with its scale 0.02 a
    division would give τ up to log 2 / 0.02 ≈ 35, so we multiply. The default scale 0.3 makes the
    most uncertain anchor of a batch get τ = 0.3·log 2 ≈ 0.21, i.e. Hyp-ViT's τ = 0.2, which the
    paper's uncertainty-τ results match. ``min_temperature`` (default 0.05, HypMix's τ_e) keeps
    τ away from 0 for the most certain anchor (U = 0 ⇒ log 1 = 0).

    Pairs, denominators, ``indices_tuple``/``ref_emb`` handling and reduction are those of
    :class:`PairwiseCrossEntropyLoss`; U is computed from the anchors (``embeddings``), max over the
    batch. U is detached by default (``detach_uncertainty=False`` lets gradients reach the norms).

    Args:
        scale: > 0, default 0.3 (the paper reports 0.22 / 0.12 / 0.02 per dataset and curvature with
            an unspecified rule).
        scale_rule: ``"multiply"`` (default) or ``"divide"``: how g applies ``scale``.
        min_temperature: τ_min > 0, default 0.05.
        mode: the uncertainty normalisation, ``None`` (= ``"clip"``), ``"clip"``, ``"ball"``,
            ``"batch"`` or ``"literal"`` (see :mod:`pml_hyperbolic.uncertainty`).
        c: the geometry U is computed on (its curvature and, in ``"clip"`` mode, its clip radius):
            a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (the head's, by reference) or a
            curvature given to :func:`~pml_hyperbolic.geometry.as_geometry`. None (default): the
            distance's geometry (a ``PoincareDistance``'s), else
            :func:`~pml_hyperbolic.geometry.default_geometry`.
        clip_r: **deprecated** (a ``DeprecationWarning``; removed in the next release): a clip radius
            for U other than the geometry's. Set it on the geometry instead.
        detach_uncertainty: compute U without gradient (default).
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``distance``, default
            ``PoincareDistance()``; the paper tests c ∈ {0.05, 0.1, 0.3}).

    Raises:
        ValueError: ``scale`` or ``min_temperature`` ≤ 0, an unknown ``scale_rule`` or ``mode``.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) with one row per embedding, a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors; at
            construction, a boolean flag that is not a bool.

    Design note: docs/design/losses.md
    """

    def __init__(self, scale: float = 0.3, scale_rule: str = "multiply", min_temperature: float = 0.05,
                 mode: str | None = None, c: float | torch.Tensor | torch.nn.Module | None = None,
                 clip_r: float | None | _Unset = _UNSET, detach_uncertainty: bool = True, **kwargs):
        super().__init__(**kwargs)
        self.scale = check_positive(scale, "scale")
        if scale_rule not in ("multiply", "divide"):
            raise ValueError(f"scale_rule must be 'multiply' or 'divide', got {scale_rule!r}")
        self.scale_rule = scale_rule
        self.min_temperature = check_positive(min_temperature, "min_temperature")
        self._init_uncertainty(mode, c, clip_r, detach_uncertainty)
        self.add_to_recordable_attributes(list_of_names=["scale", "min_temperature"], is_stat=False)
        check_inputs_on_call(self)

    def get_default_distance(self):
        return PoincareDistance()

    def get_default_reducer(self):
        return MeanReducer()

    def temperatures(self, embeddings: torch.Tensor):
        """(B,) per-anchor temperatures τ_i."""
        f = self.uncertainty_factor(embeddings)
        tau = f * self.scale if self.scale_rule == "multiply" else f / self.scale
        return tau.clamp_min(self.min_temperature)

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        pos, neg = pair_masks(embeddings, labels, indices_tuple, ref_emb, ref_labels)
        if not bool(pos.any()):
            return self.zero_losses()
        sim = similarity_logits(self.distance(embeddings, ref_emb), self.distance.is_inverted)
        tau = self.temperatures(embeddings).to(sim.dtype)
        logits = sim / tau.view(-1, 1)
        keep = pos | neg
        log_den = torch.logsumexp(logits.masked_fill(~keep, float("-inf")), dim=1)
        a, p = torch.where(pos)
        losses = log_den[a] - logits[a, p]
        return {"loss": {"losses": losses, "indices": (a, p), "reduction_type": "pos_pair"}}
