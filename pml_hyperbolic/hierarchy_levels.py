r"""Hierarchical labels: the one similarity-level helper shared by losses and miners.

Convention used across the package (labels N × K, column k = cluster id at level k, **finest
first**): the similarity level of two samples is

.. math:: s_{ij} = 1 + \min\{k : H_{ik} = H_{jk}\}\quad(\text{0-based }k),\qquad
          s_{ij} = K + 1 \text{ if they never share a cluster},

so s = 1 means "same finest cluster" (merged earliest = most similar) and larger s means less
similar. This is the reading under which Yan et al.'s :math:`\Omega^{s_{ij}-s_{il}}` (CVPR'21,
Eq. 4–5) makes more similar pairs closer for Ω > 1. The losses (``HierarchicalLogRatioLoss``,
``HierarchicalMarginLoss``) and the miner (``HierarchicalSimilarityMiner``) all use
:func:`first_shared_level` / :func:`pairwise_first_shared_level` from this module (below both
losses and miners), so they agree by construction.

Design note: docs/design/miners.md
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_hierarchical_labels", "first_shared_level", "pairwise_first_shared_level"]


def as_hierarchical_labels(labels: Tensor, name: str = "labels", n: int | None = None) -> Tensor:
    """(N,) or (N, K) integer labels as an (N, K) tensor (a view of 1-D labels as K = 1).

    Raises ``ValueError`` naming ``name`` for missing labels, a float / complex / bool dtype, 0-d or
    ≥ 3-d input, K = 0, or (with ``n``) a row count other than ``n``.
    """
    if labels is None:
        raise ValueError(f"{name} are required (1-D or N x K hierarchical labels)")
    if not isinstance(labels, Tensor):
        labels = torch.as_tensor(labels)
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got dtype {labels.dtype}")
    if labels.ndim == 1:
        labels = labels[:, None]
    if labels.ndim != 2 or labels.shape[1] < 1 or (n is not None and labels.shape[0] != n):
        rows = "N" if n is None else str(n)
        raise ValueError(f"{name} must have shape ({rows},) or ({rows}, K) with K >= 1, got {tuple(labels.shape)}")
    return labels


def first_shared_level(hier_labels_i: Tensor, hier_labels_j: Tensor) -> Tensor:
    """Similarity level s of row-aligned (broadcastable) hierarchical labels ``(..., K)``.

    Returns int64 ``(...)`` with values in 1..K+1: 1 + the first (finest-first) level at which
    the two label rows agree, K + 1 if they agree at no level. The last dimension is always the
    level axis (flat labels need a trailing ``[..., None]``; :func:`pairwise_first_shared_level`
    accepts 1-D labels directly).
    """
    if hier_labels_i.shape[-1] != hier_labels_j.shape[-1]:
        raise ValueError(
            "hier_labels_i and hier_labels_j must have the same number of levels K, got "
            f"{hier_labels_i.shape[-1]} and {hier_labels_j.shape[-1]}"
        )
    k = hier_labels_i.shape[-1]
    equal = hier_labels_i == hier_labels_j
    shared = equal.any(dim=-1)
    first = equal.to(torch.uint8).argmax(dim=-1)  # first True along the levels
    return torch.where(shared, first + 1, torch.full_like(first, k + 1)).long()


def pairwise_first_shared_level(hier_labels: Tensor, ref_hier_labels: Tensor | None = None) -> Tensor:
    """N × M matrix of similarity levels s (see module doc) between all rows of two label sets.

    Accepts N × K / M × K (or 1-D, K = 1) labels. Memory O(NM): levels are processed from the
    coarsest to the finest, each overwriting the pairs it joins, so no N × M × K tensor is built.
    """
    h = as_hierarchical_labels(hier_labels, "hier_labels")
    r = h if ref_hier_labels is None else as_hierarchical_labels(ref_hier_labels, "ref_hier_labels")
    if h.shape[1] != r.shape[1]:
        raise ValueError(
            f"hier_labels and ref_hier_labels must have the same number of levels, got {h.shape[1]} and {r.shape[1]}"
        )
    r = r.to(h.device)
    k = h.shape[1]
    s = torch.full((h.shape[0], r.shape[0]), k + 1, dtype=torch.long, device=h.device)
    for level in range(k - 1, -1, -1):
        s.masked_fill_(h[:, level, None] == r[None, :, level], level + 1)
    return s
