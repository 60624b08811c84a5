"""An affine similarity from the Poincaré distance, for PML losses and miners written for cosine."""
from __future__ import annotations

import math
from numbers import Real

import torch

from ..geometry import PoincareGeometry, default_geometry
from .poincare_distance import PoincareDistance

_SCALE_RANGE = (torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max)


def _check_scale(value: float, what: str) -> float:
    """``value`` if T is finite and 1/T is finite in float32; ValueError naming ``what`` otherwise."""
    if not (_SCALE_RANGE[0] <= value <= _SCALE_RANGE[1]):
        hint = " (the geometry has no clipping: pass scale explicitly)" if value == math.inf else ""
        raise ValueError(f"{what} must be a number in [{_SCALE_RANGE[0]:.3g}, {_SCALE_RANGE[1]:.3g}] "
                         f"(1/T finite in float32), got {value!r}{hint}")
    return value


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
            :func:`~pml_hyperbolic.geometry.default_geometry` (the package defaults, as a default
            head's); pass the head's geometry so that both follow one curvature and clip radius.
        scale: :math:`T`, a real number in [1.2e-38, 3.4e38] (float32's normal range, so that
            :math:`1/T` is finite in float32). ``None`` (default): the geometry's ``max_dist0()``,
            read at each call; a bare curvature or a geometry without clipping has no such bound,
            and then ``scale`` must be given.
        **kwargs: as :class:`PoincareDistance` (``project``, ``check_finite``, PML's ``power``, ...).

    Returns (``compute_mat`` / ``pairwise_distance``): with ``scale=None`` the similarity is
    clamped to exactly ``[-1, 1]`` (float32 rounding of d near :math:`T` otherwise leaves it by a
    few 1e-5); the clamp passes the gradient of :math:`1 - d/T` through unchanged. With an explicit
    ``scale``, :math:`1 - d/T` is returned as is (below −1 where d > 2T).

    Raises:
        ValueError: ``scale`` is not a real number (a bool or a string included) or outside the
            range above; ``scale=None`` with no clip bound at
            construction, or at call time when the geometry's clipping was switched off since
            (``clip_r = None``) or gives a :math:`T` outside the range.

    ``is_inverted`` is True: larger means more similar, like PML's ``CosineSimilarity``.

    Design note: docs/design/distances.md
    """

    def __init__(self, c: float | torch.Tensor | torch.nn.Module | None = None, scale: float | None = None,
                 **kwargs):
        if kwargs.pop("is_inverted", True) is not True:
            raise ValueError("is_inverted must be True: PoincareSimilarity grows with similarity")
        bare_curvature = c is not None and not isinstance(c, PoincareGeometry)
        super().__init__(c=default_geometry() if c is None else c, **kwargs)
        self.is_inverted = True  # PoincareDistance fixes False; the affine map reverses the order
        if scale is None:
            # a bare curvature has no clip radius of its own (as_geometry would give it the default)
            max_dist0 = math.inf if bare_curvature else self.geometry.max_dist0()
            if not math.isfinite(max_dist0):
                raise ValueError("scale=None takes T from a clipping PoincareGeometry's max_dist0(); "
                                 f"got c={c!r}: pass scale (> 0) explicitly")
        else:
            if isinstance(scale, bool) or not isinstance(scale, Real):
                raise ValueError(f"scale must be a real number, got {type(scale).__name__} {scale!r}")
            _check_scale(float(scale), "scale")
        # None: read from the geometry at each use (the clip radius has one owner)
        self._scale = None if scale is None else float(scale)

    @property
    def scale(self) -> float:
        """T: the given scale, or the geometry's current ``max_dist0()`` (validated at each read)."""
        if self._scale is not None:
            return self._scale
        return _check_scale(self.geometry.max_dist0(), "scale=None: the geometry's max_dist0() = 2·clip_r")

    def _to_similarity(self, dist: torch.Tensor) -> torch.Tensor:
        s = 1.0 - dist / self.scale
        if self._scale is None:
            # [-1, 1] exactly; in place under no_grad: the gradient of 1 - d/T passes unchanged
            with torch.no_grad():
                s.clamp_(-1.0, 1.0)
        return s

    def compute_mat(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        return self._to_similarity(super().compute_mat(query_emb, ref_emb))

    def pairwise_distance(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        return self._to_similarity(super().pairwise_distance(query_emb, ref_emb))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"
