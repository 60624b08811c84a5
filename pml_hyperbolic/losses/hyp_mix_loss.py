"""HypMix mixed-geometry cross-entropy (Yue et al., "Understanding Hyperbolic Metric Learning
through Hard Negative Sampling")."""
from __future__ import annotations

from ..distances.mixed_geometry_distance import MixedGeometryDistance
from .pairwise_cross_entropy_loss import PairwiseCrossEntropyLoss


class HypMixLoss(PairwiseCrossEntropyLoss):
    r"""Cross-entropy over mixed spherical + hyperbolic logits (HypMix Eq. (12)):

    .. math::
        \ell_{ij} = -\log \frac{\exp(-D_{cos}(z_i, z_j)/\tau_e - \lambda D_{hyp}(z_i, z_j)/\tau_h)}
            {\sum_{k \ne i} \exp(-D_{cos}(z_i, z_k)/\tau_e - \lambda D_{hyp}(z_i, z_k)/\tau_h)}

    over every positive pair, as :class:`PairwiseCrossEntropyLoss` with temperature 1 and the
    :class:`~pml_hyperbolic.distances.MixedGeometryDistance` (which carries τ_e, τ_h, λ, c). Feed it
    the **Euclidean** head output Wf (e.g. ``SphericalEmbeddingHead`` or a plain Linear): the
    distance normalises it and maps it into the ball itself.

    Args (used only when ``distance`` is None): c = 0.1, lam = 3.0 (paper: 3 CUB, 8 Cars/SOP; tested
    1–10), tau_e = 0.05, tau_h = 0.2 (paper, Sec. 4), learnable_lambda = False, clip_r = 2.3.
    ``view_pairs`` as in :class:`PairwiseCrossEntropyLoss`. A given ``distance`` is used as is.
    """

    def __init__(self, c=0.1, lam=3.0, tau_e=0.05, tau_h=0.2, learnable_lambda=False, clip_r=2.3,
                 view_pairs=False, distance=None, **kwargs):
        if distance is None:
            distance = MixedGeometryDistance(c=c, lam=lam, tau_e=tau_e, tau_h=tau_h,
                                             learnable_lambda=learnable_lambda, clip_r=clip_r)
        super().__init__(temperature=1.0, view_pairs=view_pairs, distance=distance, **kwargs)
