"""A degraded copy of an image must not look more certain than the image itself."""
from __future__ import annotations

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer

from ..geometry import PoincareGeometry
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import check_nonnegative


def radius_order_hinge(d0_clean: torch.Tensor, d0_degraded: torch.Tensor, margin: float) -> torch.Tensor:
    r"""Per-pair hinge :math:`\max\big(0,\ m + d_0(\tilde z_i) - d_0(z_i)\big)`: zero once the degraded
    copy sits at least ``margin`` nearer the origin (more uncertain) than its clean source."""
    return torch.relu(margin + d0_degraded - d0_clean)


class DegradedCopyRadiusLoss(AcceptsManifoldTensors, BaseMetricLossFunction):
    r"""Order the radius by input quality: degraded copies nearer the origin than their sources.

    .. math::
        \ell_i = \max\big(0,\; m + d_0(\tilde z_i) - d_0(z_i)\big)

    for row-aligned pairs: ``embeddings[i]`` = :math:`z_i` of a clean image, ``ref_emb[i]`` =
    :math:`\tilde z_i` of a degraded copy of the same image (blur, noise, occlusion:
    :class:`~pml_hyperbolic.data.degradations.RandomDegradation`), :math:`d_0` the distance to the
    origin (the Hyp-UML uncertainty's input). Called as ``loss(clean, ref_emb=degraded)``; labels
    are not used. :class:`~pml_hyperbolic.training.degraded_copy_trainer.DegradedCopyTrainer` makes
    the pairs inside the training step.

    Why: trained by a metric loss alone, the radius of a corrupted query drops only slightly
    against the spread between images, so the radius separates clean from degraded inputs poorly.
    This hinge asks for a fixed gap. It teaches the corruption families it sees, not unseen ones.

    Args:
        c: the head's :class:`~pml_hyperbolic.geometry.PoincareGeometry` (by reference; its
            curvature gives d₀).
        margin: m ≥ 0 in units of d₀, default 0.2 (with c = 0.1 and clip radius 2.3, d₀ ≤ 4.6).

    Design note: docs/design/losses.md
    """

    def __init__(self, c: PoincareGeometry | None = None, margin: float = 0.2, **kwargs):
        if not isinstance(c, PoincareGeometry):
            raise ValueError("DegradedCopyRadiusLoss needs the head's PoincareGeometry as c=, got "
                             f"{type(c).__name__}")
        super().__init__(**kwargs)
        self.geometry = c
        self.margin = check_nonnegative(margin, "margin")
        self.add_to_recordable_attributes(list_of_names=["margin"], is_stat=False)

    def get_default_reducer(self):
        return MeanReducer()

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        if ref_emb is embeddings:
            raise ValueError("DegradedCopyRadiusLoss needs ref_emb: the degraded copies, row-aligned with "
                             "embeddings (loss(clean, ref_emb=degraded))")
        if ref_emb.shape != embeddings.shape:
            raise ValueError(f"ref_emb (degraded copies) must have the shape of embeddings {tuple(embeddings.shape)}, "
                             f"got {tuple(ref_emb.shape)}")
        if indices_tuple is not None:
            raise ValueError("DegradedCopyRadiusLoss takes no indices_tuple: its pairs are the rows")
        if len(embeddings) == 0:
            return self.zero_losses()
        losses = radius_order_hinge(self.geometry.dist0(embeddings).reshape(-1),
                                    self.geometry.dist0(ref_emb).reshape(-1), self.margin)
        idx = torch.arange(len(embeddings), device=embeddings.device)
        return {"loss": {"losses": losses, "indices": idx, "reduction_type": "element"}}
