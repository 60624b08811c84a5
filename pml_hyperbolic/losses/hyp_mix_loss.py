"""HypMix mixed-geometry cross-entropy (Yue et al., "Understanding Hyperbolic Metric Learning
through Hard Negative Sampling")."""
from __future__ import annotations

from collections.abc import Sequence

from ..distances.mixed_geometry_distance import MixedGeometryDistance
from ..geometry import _UNSET, DEFAULT_CURVATURE, PoincareGeometry, _Unset
from ._common import check_bool
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

    ``c``, ``lam``, ``tau_e``, ``tau_h``, ``learnable_lambda`` and ``clip_r`` build the distance and
    are used only when ``distance`` is None; a given ``distance`` is used as is.

    Args:
        c: the geometry or a curvature, or a sequence of them to mix (as
            :class:`~pml_hyperbolic.distances.MixedGeometryDistance`); default
            :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`.
        lam: λ ≥ 0 (one, or one per curvature); default 3.0 (paper: 3 on CUB, 8 on Cars/SOP).
        tau_e: spherical temperature, default 0.05 (paper, Sec. 4).
        tau_h: hyperbolic temperature, default 0.2 (paper, Sec. 4).
        learnable_lambda: make λ a parameter of the distance.
        clip_r: clip radius of geometries built from curvatures (unset:
            :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`; ``None``: no clipping); deprecated with a
            ``PoincareGeometry`` (its own radius is used), as in ``MixedGeometryDistance``.
        view_pairs: as in :class:`PairwiseCrossEntropyLoss`.
        distance: a ready :class:`~pml_hyperbolic.distances.MixedGeometryDistance`.
        **kwargs: passed to PML's ``BaseMetricLossFunction`` (``reducer``, ...).

    Raises:
        ValueError: as :class:`~pml_hyperbolic.distances.MixedGeometryDistance` for invalid
            curvatures, λ or temperatures.
        ValueError: at call time, embeddings not (N, D) or with NaN/Inf, labels not integer
            (N,) with one row per embedding, a ``ref_emb`` of another dimension, or an
            ``indices_tuple`` that is malformed or indexes out of range. Numeric
            hyperparameters above 1e12, or positive ones below 1e-12, are rejected at construction.
        TypeError: at call time, embeddings that are not floating-point tensors, labels that are
            not tensors, or an ``indices_tuple`` that is not a tuple of integer tensors; at
            construction, a boolean flag that is not a bool.

    Design note: docs/design/losses.md
    """

    def __init__(self, c: float | PoincareGeometry | Sequence[float | PoincareGeometry] = DEFAULT_CURVATURE,
                 lam: float | Sequence[float] = 3.0,
                 tau_e: float = 0.05, tau_h: float = 0.2, learnable_lambda: bool = False,
                 clip_r: float | None | _Unset = _UNSET, view_pairs: bool = False,
                 distance: MixedGeometryDistance | None = None, **kwargs):
        check_bool(learnable_lambda, "learnable_lambda")
        if distance is None:
            distance = MixedGeometryDistance(c=c, lam=lam, tau_e=tau_e, tau_h=tau_h,
                                             learnable_lambda=learnable_lambda, clip_r=clip_r)
        super().__init__(temperature=1.0, view_pairs=view_pairs, distance=distance, **kwargs)
