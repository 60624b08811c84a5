r"""A per-query uncertainty that reads the search result: the class-level distance ratio.

The radius (:func:`pml_hyperbolic.uncertainty.hyperbolic_uncertainty`) needs no gallery, but once a
query has been searched the neighbours say more about whether its top-1 label is right: how close
the nearest item is, and how much closer it is than the nearest item of *another* label.
:func:`retrieval_uncertainty` is that second quantity, a class-level form of Lowe's ratio test:

.. math::

    u(q) = \frac{d(q, g_{(1)})}{d_{\mathrm{rival}}(q)}, \qquad
    d_{\mathrm{rival}}(q) = \min\{\, d(q, g_{(i)}) : i \le k,\ y_{(i)} \ne y_{(1)} \,\}

where :math:`g_{(1)}, \dots, g_{(k)}` are the k nearest gallery items in ascending distance and
:math:`y_{(i)}` their labels; when all k share the top-1 label, :math:`d_{\mathrm{rival}} = d(q,
g_{(k)})` (a lower bound of the true rival distance: the score is then an upper bound, so the
error is on the cautious side). Without labels the rival is the second neighbour,
:math:`u = d_{(1)} / d_{(2)}`. u lies in [0, 1]: 0 = the top-1 item is at distance 0 and no rival
is, 1 = a rival label is as close as the top-1 item (a tie). It is a no-grad evaluation function:
it runs under ``torch.no_grad()`` and returns a tensor without a graph.

Why a ratio: it needs no temperature and no threshold (it is invariant to scaling every distance),
so one formula serves the ball and the sphere, and it carries the two things a wrong top-1 shows:
a far nearest item (a query unlike the gallery) and a near rival (a query between two classes).
The form (and ``k``) were chosen on validation classes carved out of the training classes of every
development domain, against the top-1 distance, the top-1/top-2 gap, the top-k label agreement,
soft kNN votes and sums with the radius.

Design note: docs/design/uncertainty.md
"""
from __future__ import annotations

from numbers import Integral

import torch

from .. import poincare_ball as pb

__all__ = ["retrieval_uncertainty"]

_FROM_INDEX = object()  # the default of ``c``: required with a gallery tensor, the index's own with an index
_ROWS_PER_BLOCK = 1024  # queries per block of the brute-force search (memory: block × gallery distances)


def _is_index(obj) -> bool:
    from .hyperbolic_index import HyperbolicIndex

    return isinstance(obj, HyperbolicIndex)


def _curvature_or_none(c, name="c"):
    if c is None:
        return None
    try:
        return float(pb.as_curvature(c, torch.float64).detach())
    except (TypeError, ValueError) as err:
        raise type(err)(f"{name}: {err} (pass a curvature > 0, a PoincareGeometry, or None for the cosine "
                        "distance of a spherical model)") from None


def _search_tensor(q: torch.Tensor, g: torch.Tensor, c: float | None, k: int):
    """(M, k) ascending float64 distances and indices by brute force, block by block."""
    g64 = g.detach().to(torch.float64)
    if c is None:
        g64 = torch.nn.functional.normalize(g64, dim=1)
    else:
        g64 = pb.project(g64, c)
    dists, idxs = [], []
    for start in range(0, q.shape[0], _ROWS_PER_BLOCK):
        block = q[start:start + _ROWS_PER_BLOCK].detach().to(torch.float64)
        if c is None:
            d = (1.0 - torch.nn.functional.normalize(block, dim=1) @ g64.T).clamp_min(0.0)
        else:
            d = pb.pairwise_dist(pb.project(block, c), g64, c)
        top = torch.topk(d, k, dim=1, largest=False, sorted=True)
        dists.append(top.values)
        idxs.append(top.indices)
    return torch.cat(dists), torch.cat(idxs)


@torch.no_grad()
def retrieval_uncertainty(query_embeddings: torch.Tensor, gallery, gallery_labels: torch.Tensor | None = None,
                          *, c=_FROM_INDEX, k: int = 10) -> torch.Tensor:
    r"""Per-query uncertainty (M,) of a retrieval's top-1 label: the class-level distance ratio.

    .. math::

        u(q) = d(q, g_{(1)}) \,/\, d_{\mathrm{rival}}(q) \in [0, 1]

    with :math:`d_{\mathrm{rival}}` the distance to the nearest of the k nearest gallery items whose
    label differs from the top-1 item's (:math:`d(q, g_{(k)})` when none of them does; the second
    neighbour when ``gallery_labels`` is ``None``). :math:`0/0` (the top-1 item and the rival both
    at distance 0) is 1 when a rival label sits at distance 0, else 0. Larger = more uncertain.
    Distances: the exact geodesic distance of the Poincaré ball of curvature −c, or, with
    ``c=None``, the cosine distance 1 − cos (the embeddings of a spherical model, L2-normalised
    here). Evaluation only: computed without gradient.

    Args:
        query_embeddings: (M, D) floating-point query embeddings (ball points, or any vectors with
            ``c=None``).
        gallery: the (N, D) gallery embeddings, or a
            :class:`~pml_hyperbolic.evaluation.HyperbolicIndex` holding them (searched with its
            own curvature; exact for ``kind="flat"``).
        gallery_labels: (N,) integer labels of the gallery items, or ``None`` (label-free: the
            rival is the second neighbour).
        c: with a gallery tensor, required: a curvature > 0 (float, 0-d tensor, hypll curvature or
            :class:`~pml_hyperbolic.geometry.PoincareGeometry`) for the ball, or ``None`` for the
            cosine distance. With an index: omit it, or pass the index's curvature.
        k: neighbours searched for a rival label, an int >= 2 (default 10); a gallery of fewer
            items is searched whole.

    Returns:
        (M,) float32 tensor (float64 for float64 queries) in [0, 1], on the query's device.

    Raises:
        TypeError: ``query_embeddings`` or a gallery tensor is not a floating-point tensor,
            ``gallery`` is neither a tensor nor a ``HyperbolicIndex``, ``gallery_labels`` is not an
            integer tensor, ``k`` is not an int, or ``c`` is of no curvature type.
        ValueError: embeddings not 2-D, of different widths, empty, or holding NaN/Inf; a gallery
            of fewer than 2 items; labels not (N,); ``k`` < 2; ``c`` missing with a gallery tensor,
            invalid, or different from an index's curvature.
    """
    pb.check_tensor(query_embeddings, "query_embeddings")
    if query_embeddings.ndim != 2 or query_embeddings.shape[0] == 0:
        raise ValueError(f"query_embeddings must be a non-empty 2-D (M, D) tensor, got shape "
                         f"{tuple(query_embeddings.shape)}")
    pb.check_finite(query_embeddings, "query_embeddings")
    if _is_index(gallery):
        n, dim = gallery.ntotal, gallery._dim
        if n == 0:
            raise ValueError("gallery: the HyperbolicIndex is empty; add() the gallery embeddings first")
        if c is not _FROM_INDEX:
            given = _curvature_or_none(c)
            if given is None or abs(given - gallery.c) > 1e-12 * max(1.0, gallery.c):
                raise ValueError(f"c={given!r} differs from the index's curvature {gallery.c!r}; omit c with an index")
        c_value = gallery.c
    elif isinstance(gallery, torch.Tensor):
        pb.check_tensor(gallery, "gallery")
        if gallery.ndim != 2 or gallery.shape[0] == 0:
            raise ValueError(f"gallery must be a non-empty 2-D (N, D) tensor, got shape {tuple(gallery.shape)}")
        pb.check_finite(gallery, "gallery")
        if c is _FROM_INDEX:
            raise ValueError("c is required with a gallery tensor: a curvature > 0 (or the model's "
                             "PoincareGeometry) for ball embeddings, or c=None for the cosine distance")
        c_value = _curvature_or_none(c)
        n, dim = gallery.shape
    else:
        raise TypeError(f"gallery must be a (N, D) tensor or a HyperbolicIndex, got {type(gallery).__name__}")
    if query_embeddings.shape[1] != dim:
        raise ValueError(f"query_embeddings have {query_embeddings.shape[1]} dimensions, the gallery {dim}")
    if isinstance(k, bool) or not isinstance(k, Integral):
        raise TypeError(f"k must be an int >= 2, got {type(k).__name__} {k!r}")
    if k < 2:
        raise ValueError(f"k must be >= 2 (the top-1 item and at least one more), got {k}")
    if n < 2:
        raise ValueError(f"the gallery must hold at least 2 items (a top-1 item and a rival), got {n}")
    k = min(int(k), n)
    if gallery_labels is not None:
        if not isinstance(gallery_labels, torch.Tensor) or gallery_labels.dtype.is_floating_point \
                or gallery_labels.dtype.is_complex or gallery_labels.dtype == torch.bool:
            raise TypeError("gallery_labels must be an integer tensor (N,) or None, got "
                            f"{getattr(gallery_labels, 'dtype', type(gallery_labels).__name__)}")
        if gallery_labels.shape != (n,):
            raise ValueError(f"gallery_labels must have shape ({n},) (one per gallery item), got "
                             f"{tuple(gallery_labels.shape)}")

    if _is_index(gallery):
        dist, idx = gallery.search(query_embeddings.detach(), k)
        dist = dist.to(torch.float64)
    else:
        dist, idx = _search_tensor(query_embeddings, gallery, c_value, k)
    dist = dist.clamp_min(0.0)
    d1 = dist[:, 0]
    if gallery_labels is None:
        rival = dist[:, 1]
        has_rival = torch.ones_like(d1, dtype=torch.bool)
    else:
        labels = gallery_labels.to(idx.device)[idx]
        other = labels != labels[:, :1]
        has_rival = other.any(1)
        first = torch.where(other, torch.arange(k, device=idx.device).expand_as(idx), torch.full_like(idx, k - 1))
        rival = dist.gather(1, first.min(1, keepdim=True).values)[:, 0]
    ratio = torch.where(rival > 0, d1 / rival.clamp_min(torch.finfo(torch.float64).tiny),
                        has_rival.to(torch.float64))
    out_dtype = torch.float64 if query_embeddings.dtype == torch.float64 else torch.float32
    return ratio.clamp(0.0, 1.0).to(device=query_embeddings.device, dtype=out_dtype)
