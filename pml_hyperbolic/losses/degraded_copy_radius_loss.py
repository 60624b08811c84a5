"""A degraded copy of an image must not look more certain than the image itself."""
from __future__ import annotations

import torch
from pytorch_metric_learning.losses import BaseMetricLossFunction
from pytorch_metric_learning.reducers import MeanReducer

from ..geometry import PoincareGeometry
from ..manifold_tensors import AcceptsManifoldTensors, is_manifold_tensor, unwrap_ball_tensor
from ._common import check_embeddings, check_inputs_on_call, check_nonnegative


def radius_order_hinge(d0_clean: torch.Tensor, d0_degraded: torch.Tensor, margin: float) -> torch.Tensor:
    r"""Per-pair hinge :math:`\max\big(0,\ m + d_0(\tilde z_i) - d_0(z_i)\big)`: zero once the degraded
    copy sits at least ``margin`` nearer the origin (more uncertain) than its clean source.

    Raises:
        ValueError: ``margin`` not a number in [0, 1e12].
    """
    margin = check_nonnegative(margin, "margin")
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
        margin: m ≥ 0 in units of d₀, default 0.2 (with the default geometry's clip radius r, d₀ ≤ 2r ≈ 4.6).
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``reducer``, ...).

    Raises:
        ValueError: at construction, ``c`` is not a ``PoincareGeometry`` or ``margin`` is not a
            finite number ≥ 0. At the call: ``ref_emb`` missing or of another shape than
            ``embeddings``, embeddings not of shape (N, D), NaN/Inf entries, an ``indices_tuple``,
            or a hypll ``ManifoldTensor`` on a ball whose curvature differs from ``c``'s (the
            message names both).
        TypeError: embeddings that are not floating-point tensors.

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
        # before the generic unwrapping hook, which knows no curvature here (no PoincareDistance)
        self.register_forward_pre_hook(_check_manifold_curvature, with_kwargs=True, prepend=True)
        check_inputs_on_call(self)

    def get_default_reducer(self):
        return MeanReducer()

    def compute_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
                     ref_emb: torch.Tensor, ref_labels: torch.Tensor):
        check_embeddings(embeddings, "embeddings")
        if ref_emb is embeddings:
            raise ValueError("DegradedCopyRadiusLoss needs ref_emb: the degraded copies, row-aligned with "
                             "embeddings (loss(clean, ref_emb=degraded))")
        if ref_emb.shape != embeddings.shape:
            raise ValueError(f"ref_emb (degraded copies) must have the shape of embeddings {tuple(embeddings.shape)}, "
                             f"got {tuple(ref_emb.shape)}")
        check_embeddings(ref_emb, "ref_emb")
        if indices_tuple is not None:
            raise ValueError("DegradedCopyRadiusLoss takes no indices_tuple: its pairs are the rows")
        if len(embeddings) == 0:
            return self.zero_losses()
        losses = radius_order_hinge(self.geometry.dist0(embeddings).reshape(-1),
                                    self.geometry.dist0(ref_emb).reshape(-1), self.margin)
        idx = torch.arange(len(embeddings), device=embeddings.device)
        return {"loss": {"losses": losses, "indices": idx, "reduction_type": "element"}}


def _check_manifold_curvature(module, args, kwargs):
    """ManifoldTensor arguments must lie on a ball of the loss's curvature (ValueError otherwise)."""
    for a in (*args, *kwargs.values()):
        if is_manifold_tensor(a):
            unwrap_ball_tensor(a, module.geometry, type(module).__name__)
    return None
