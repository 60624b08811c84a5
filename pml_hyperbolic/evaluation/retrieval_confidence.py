r"""A per-query uncertainty that reads the search result: a soft kNN vote and the class prototypes.

The radius (:func:`pml_hyperbolic.uncertainty.hyperbolic_uncertainty`) needs no gallery, but once a
query has been searched, the gallery says more about whether its top-1 label is right: do the
nearest items agree with the top-1 item, and is the query nearer the top-1 label's class as a whole
than any other class? :func:`retrieval_uncertainty` adds the two answers:

.. math::

    u(q) = \frac{v(q) + a\,\rho(q)}{1 + a} \in [0, 1], \qquad
    v(q) = 1 - \frac{\sum_{i \le k,\ y_{(i)} = y_{(1)}} w_i}{\sum_{i \le k} w_i},\quad
    w_i = \Big(\frac{d_{(1)}}{d_{(i)}}\Big)^{p}, \qquad
    \rho(q) = \frac{d(q, P_{y_{(1)}})}{d(q, P_{y_{(1)}}) + \min_{y \ne y_{(1)}} d(q, P_y)}

with :math:`d_{(1)} \le \dots \le d_{(k)}` the distances of the k nearest gallery items and
:math:`y_{(i)}` their labels; v is a soft vote against the top-1 label (0 when the k nearest all
share it), weighted by how near each neighbour is relative to the nearest; :math:`P_y` is the
prototype of class y in the gallery (the mean of its items: in the tangent space at the origin,
mapped back with ``expmap0``, for the ball; the normalised mean direction on the sphere), and ρ the
share of the top-1 class's prototype distance in the sum with the nearest other prototype (½: the
query lies as near another class as the top-1 class). Constants: k = 20, p = 8
(:data:`VOTE_POWER`), a = 4 (:data:`PROTOTYPE_WEIGHT`). Larger = more uncertain.

Why these two: the vote is what a kNN classifier knows (a query between two classes draws
neighbours of both), the prototypes average the noise of single gallery items away and also see a
query far from every class; both are ratios of distances, so the score needs no temperature and
serves the ball and the sphere alike. The form and the constants were chosen on validation classes
carved out of the training classes of every development domain, against the radius, the top-1
distance, the top-1/top-2 gap, the top-k label agreement, distance ratios and sums with the radius
(the figures: the design note). It is an evaluation function: no gradient.

Design note: docs/design/uncertainty.md
"""
from __future__ import annotations

from numbers import Integral

import torch

from .. import poincare_ball as pb

__all__ = ["retrieval_uncertainty", "VOTE_POWER", "PROTOTYPE_WEIGHT", "DEFAULT_K"]

#: p, the power of the vote's weights (d₁/dᵢ)^p: how fast a farther neighbour's vote fades
VOTE_POWER = 8
#: a, the weight of the prototype term ρ beside the vote v
PROTOTYPE_WEIGHT = 4.0
#: k, the neighbours that vote
DEFAULT_K = 20

_UNSET = object()  # the default of ``c``: required without an index, the index's own with one
_ROWS_PER_BLOCK = 1024  # queries per block (memory: block × gallery distances)


def _curvature_or_none(c):
    if c is None:
        return None
    try:
        return float(pb.as_curvature(c, torch.float64).detach())
    except (TypeError, ValueError) as err:
        raise type(err)(f"c: {err} (pass a curvature > 0, a PoincareGeometry, or None for the cosine "
                        "distance of a spherical model)") from None


def _distances(q: torch.Tensor, points: torch.Tensor, c: float | None) -> torch.Tensor:
    """(M, N) float64 distances: geodesic in the ball (inputs projected), 1 − cos for c=None."""
    if c is None:
        return (1.0 - torch.nn.functional.normalize(q, dim=1) @ torch.nn.functional.normalize(points, dim=1).T
                ).clamp_min(0.0)
    return pb.pairwise_dist(pb.project(q, c), pb.project(points, c), c)


def _prototypes(g: torch.Tensor, inverse: torch.Tensor, n_classes: int, c: float | None) -> torch.Tensor:
    """(C, D) class means: of the unit directions (sphere), or in the tangent space at the origin (ball)."""
    x = torch.nn.functional.normalize(g, dim=1) if c is None else pb.logmap0(pb.project(g, c), c)
    sums = torch.zeros(n_classes, g.shape[1], dtype=g.dtype, device=g.device).index_add_(0, inverse, x)
    counts = torch.bincount(inverse, minlength=n_classes).to(g.dtype)[:, None]
    means = sums / counts
    return torch.nn.functional.normalize(means, dim=1) if c is None else pb.expmap0(means, c)


def _check_embeddings(x, name: str) -> None:
    pb.check_tensor(x, name)
    if x.ndim != 2 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor, got shape {tuple(x.shape)}")
    pb.check_finite(x, name)


@torch.no_grad()
def retrieval_uncertainty(query_embeddings: torch.Tensor, gallery_embeddings: torch.Tensor,
                          gallery_labels: torch.Tensor, *, c=_UNSET, k: int = DEFAULT_K,
                          index=None) -> torch.Tensor:
    r"""Per-query uncertainty (M,) of a retrieval's top-1 label: soft kNN vote + class prototypes.

    .. math::

        u(q) = \frac{v(q) + a\,\rho(q)}{1 + a}, \quad
        v = 1 - \frac{\sum_{i \le k:\, y_{(i)} = y_{(1)}} (d_{(1)}/d_{(i)})^p}{\sum_{i \le k} (d_{(1)}/d_{(i)})^p},
        \quad \rho = \frac{d(q, P_{y_{(1)}})}{d(q, P_{y_{(1)}}) + \min_{y \ne y_{(1)}} d(q, P_y)}

    (module docstring: the terms, p = :data:`VOTE_POWER`, a = :data:`PROTOTYPE_WEIGHT`). u lies in
    [0, 1]; larger = more uncertain. Distances: the exact geodesic distance of the Poincaré ball of
    curvature −c, or, with ``c=None``, the cosine distance 1 − cos (a spherical model's
    embeddings, L2-normalised here). A weight 0/0 (the top-1 item and neighbour i both at distance
    0) counts 1; ρ's 0/0 (the query on two prototypes) counts ½. Computed without gradient.

    Why: the search result knows more about a wrong top-1 label than the gallery-free radius; the
    vote and the prototypes are ratios of distances, so no temperature is needed in either geometry.

    Design note: docs/design/uncertainty.md

    Args:
        query_embeddings: (M, D) floating-point query embeddings (ball points, or any vectors with
            ``c=None``).
        gallery_embeddings: (N, D) floating-point gallery embeddings (the prototypes are their
            class means).
        gallery_labels: (N,) integer labels of the gallery items, at least two distinct ones.
        c: a curvature > 0 (float, 0-d tensor, hypll curvature or
            :class:`~pml_hyperbolic.geometry.PoincareGeometry`) for ball embeddings, or ``None`` for
            the cosine distance. Required without ``index``; with one, omit it or pass its curvature.
        k: neighbours that vote, an int >= 2 (default 20); a gallery of fewer items votes whole.
        index: optional :class:`~pml_hyperbolic.evaluation.HyperbolicIndex` holding exactly
            ``gallery_embeddings`` (in order): the k nearest items then come from it (for large
            galleries) instead of a brute-force scan.

    Returns:
        (M,) float32 tensor (float64 for float64 queries) in [0, 1], on the query's device.

    Raises:
        TypeError: an embedding tensor that is not floating-point, labels that are not an integer
            tensor, ``k`` not an int, ``index`` not a ``HyperbolicIndex``, or ``c`` of no
            curvature type.
        ValueError: embeddings not 2-D, empty, of different widths, or holding NaN/Inf; labels not
            (N,) or all equal; ``k`` < 2; ``c`` missing without an index, invalid, or different
            from the index's curvature; an index whose size differs from the gallery's.
    """
    _check_embeddings(query_embeddings, "query_embeddings")
    _check_embeddings(gallery_embeddings, "gallery_embeddings")
    n, dim = gallery_embeddings.shape
    if query_embeddings.shape[1] != dim:
        raise ValueError(f"query_embeddings have {query_embeddings.shape[1]} dimensions, gallery_embeddings {dim}")
    if not isinstance(gallery_labels, torch.Tensor) or gallery_labels.dtype.is_floating_point \
            or gallery_labels.dtype.is_complex or gallery_labels.dtype == torch.bool:
        raise TypeError("gallery_labels must be an integer tensor (N,), got "
                        f"{getattr(gallery_labels, 'dtype', type(gallery_labels).__name__)}")
    if gallery_labels.shape != (n,):
        raise ValueError(f"gallery_labels must have shape ({n},) (one per gallery item), got "
                         f"{tuple(gallery_labels.shape)}")
    if isinstance(k, bool) or not isinstance(k, Integral):
        raise TypeError(f"k must be an int >= 2, got {type(k).__name__} {k!r}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the top-1 item and at least one more), got {k}")
    if index is not None:
        from .hyperbolic_index import HyperbolicIndex

        if not isinstance(index, HyperbolicIndex):
            raise TypeError(f"index must be None or a HyperbolicIndex, got {type(index).__name__}")
        if index.ntotal != n:
            raise ValueError(f"index holds {index.ntotal} items, gallery_embeddings {n}: add() exactly the "
                             "gallery embeddings, in order")
        if c is not _UNSET:
            given = _curvature_or_none(c)
            if given is None or abs(given - index.c) > 1e-12 * max(1.0, index.c):
                raise ValueError(f"c={given!r} differs from the index's curvature {index.c!r}; omit c with an index")
        c_value = index.c
    elif c is _UNSET:
        raise ValueError("c is required (without an index): a curvature > 0 (or the model's PoincareGeometry) "
                         "for ball embeddings, or c=None for the cosine distance")
    else:
        c_value = _curvature_or_none(c)
    classes, inverse = torch.unique(gallery_labels, return_inverse=True)
    if len(classes) < 2:
        raise ValueError("gallery_labels must hold at least 2 distinct labels (with one, no top-1 label can be wrong)")
    k = min(int(k), n)

    device = gallery_embeddings.device
    g = gallery_embeddings.detach().to(torch.float64)
    inverse = inverse.to(device)
    protos = _prototypes(g, inverse, len(classes), c_value)
    tiny = torch.finfo(torch.float64).tiny
    out = []
    for start in range(0, query_embeddings.shape[0], _ROWS_PER_BLOCK):
        q = query_embeddings[start:start + _ROWS_PER_BLOCK].detach().to(device=device, dtype=torch.float64)
        if index is not None:
            dist, idx = index.search(q, k)
            dist, idx = dist.to(device=device, dtype=torch.float64), idx.to(device)
        else:
            dist, idx = torch.topk(_distances(q, g, c_value), k, dim=1, largest=False, sorted=True)
        dist = dist.clamp_min(0.0)
        lab = inverse[idx]
        top = lab[:, 0]
        d1 = dist[:, :1]
        weight = torch.where(dist > d1, (d1 / dist.clamp_min(tiny)) ** VOTE_POWER, torch.ones_like(dist))
        vote = 1.0 - (weight * (lab == top[:, None])).sum(1) / weight.sum(1)
        dp = _distances(q, protos, c_value)
        own = dp.gather(1, top[:, None])[:, 0]
        rival = dp.scatter(1, top[:, None], float("inf")).min(1).values
        total = own + rival
        rho = torch.where(total > 0, own / total.clamp_min(tiny), torch.full_like(own, 0.5))
        out.append(((vote + PROTOTYPE_WEIGHT * rho) / (1.0 + PROTOTYPE_WEIGHT)).clamp(0.0, 1.0))
    out_dtype = torch.float64 if query_embeddings.dtype == torch.float64 else torch.float32
    return torch.cat(out).to(device=query_embeddings.device, dtype=out_dtype)
