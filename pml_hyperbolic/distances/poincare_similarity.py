"""An affine similarity from the Poincaré distance, for PML losses and miners written for cosine."""
from __future__ import annotations

import math

import torch

from .poincare_distance import PoincareDistance


class PoincareSimilarity(PoincareDistance):
    r"""Similarity on the Poincaré ball of curvature :math:`-c`: the geodesic distance mapped
    affinely onto the range of a cosine,

    .. math:: s_c(x, y) = 1 - \frac{d_c(x, y)}{T},

    so that PML's similarity-based losses and miners (``MultiSimilarityLoss`` and its miner,
    ``SupConLoss``, ``NTXentLoss``, ``ContrastiveLoss`` with similarity margins, ...) run on the ball
    with the hyperparameters they were tuned with on the sphere. With the default
    :math:`T = d_{0,\max}` (the largest distance to the origin the head produces, ``2·clip_r``) the
    similarity lies in ``[-1, 1]`` for every pair of head outputs, as a cosine does: 1 for equal
    points, −1 for two points at the clip radius on opposite sides of the origin. Ranking is
    unchanged (it is the Poincaré distance's order); what changes against a cosine is the shape the
    loss sees: the distance grows with both radii, and logarithmically fast at small angles.

    ``MultiSimilarityLoss(alpha, beta, base)`` on this similarity is ``1/T`` times
    ``MultiSimilarityLoss(alpha / T, beta / T, T · (1 − base))`` on the distance itself, with the
    miner's ``epsilon`` as ``epsilon · T`` there: the similarity keeps the sphere's numbers for both.

    Args:
        c: the geometry (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`, shared by reference
            with the head), or any curvature :class:`PoincareDistance` accepts. Default: a new
            ``PoincareGeometry()`` (the package defaults, c = 0.1 and clip radius 2.3, as a default
            head's); pass the head's geometry so that both follow one curvature.
        scale: :math:`T` (> 0). ``None`` (default): the geometry's ``max_dist0()``; a bare curvature
            or a geometry without clipping has no such bound, and then ``scale`` must be given.
        **kwargs: as :class:`PoincareDistance` (``project``, ``check_finite``, PML's ``power``, ...).

    ``is_inverted`` is True: larger means more similar, like PML's ``CosineSimilarity``.

    Design note: docs/design/distances.md
    """

    def __init__(self, c: float | torch.Tensor | torch.nn.Module | None = None, scale: float | None = None,
                 **kwargs):
        if kwargs.pop("is_inverted", True) is not True:
            raise ValueError("is_inverted must be True: PoincareSimilarity grows with similarity")
        if c is None:
            from ..geometry import PoincareGeometry

            c = PoincareGeometry()
        super().__init__(c=c, **kwargs)
        self.is_inverted = True  # PoincareDistance fixes False; the affine map reverses the order
        if scale is None:
            max_dist0 = c.max_dist0() if hasattr(c, "max_dist0") else math.inf
            if not math.isfinite(max_dist0):
                raise ValueError("scale=None takes T from a clipping PoincareGeometry's max_dist0(); "
                                 f"got c={c!r}: pass scale (> 0) explicitly")
        elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        # None: read from the geometry at each use (the clip radius has one owner)
        self._scale = None if scale is None else float(scale)

    @property
    def scale(self) -> float:
        """T: the given scale, or the geometry's current ``max_dist0()``."""
        return self._c.max_dist0() if self._scale is None else self._scale

    def _to_similarity(self, dist: torch.Tensor) -> torch.Tensor:
        return 1.0 - dist / self.scale

    def compute_mat(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        return self._to_similarity(super().compute_mat(query_emb, ref_emb))

    def pairwise_distance(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        return self._to_similarity(super().pairwise_distance(query_emb, ref_emb))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"
