"""Small helpers shared by the losses and the miners (private; below both)."""
from __future__ import annotations

import numbers

import torch
from torch import Tensor


def check_threshold(value: float | None, name: str = "threshold"):
    """``None`` or a float in (0, 1]; ``ValueError`` naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
    value = float(value)
    if not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must lie in (0, 1], got {value!r}")
    return value


def check_top_k(value: int | None, name: str = "top_k"):
    """``None`` or an int >= 1; ``ValueError`` naming ``name`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if int(value) < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def self_match_mask(embeddings: Tensor, ref_emb: Tensor, same_label: Tensor) -> Tensor:
    """B×R bool mask of the reference entries that ARE the query sample itself.

    If ``ref_emb`` is ``embeddings`` (PML's convention when no reference set is given) this is
    the diagonal. Otherwise the query batch may still sit inside the reference set:
    ``CrossBatchMemory`` enqueues the batch before mining against the memory, and
    ``DistributedMinerWrapper(efficient=True)`` prepends the local batch to the gathered one.
    Those copies have the same label and a bit-identical embedding, so an entry with the same
    label and an identical embedding is treated as the anchor itself. Only same-label pairs
    (``same_label``, few) are compared, so this costs O(#same-label pairs × D), never B×R×D.
    """
    b, r = same_label.shape
    if ref_emb is embeddings:
        mask = torch.zeros(b, r, dtype=torch.bool, device=same_label.device)
        mask.fill_diagonal_(True)
        return mask
    mask = torch.zeros(b, r, dtype=torch.bool, device=same_label.device)
    rows, cols = same_label.nonzero(as_tuple=True)
    if rows.numel():
        q, k = embeddings[rows], ref_emb[cols].to(embeddings.dtype)
        identical = (q == k).all(dim=1)
        mask[rows[identical], cols[identical]] = True
    return mask


def join_pairs_to_triplets(pos_mask: Tensor, neg_mask: Tensor):
    """All (a, p, n) with ``pos_mask[a, p]`` and ``neg_mask[a, n]`` (both B×R bool).

    Built from the two pair lists without a B×R×R tensor: each positive pair (a, p) is repeated
    once per selected negative of a, and the negatives are read from a's (contiguous, since
    ``nonzero`` is row-major) block of the negative-pair list.
    """
    device = pos_mask.device
    pa, pp = pos_mask.nonzero(as_tuple=True)
    na, nn = neg_mask.nonzero(as_tuple=True)
    empty = torch.empty(0, dtype=torch.long, device=device)
    if pa.numel() == 0 or na.numel() == 0:
        return empty, empty.clone(), empty.clone()
    b = pos_mask.shape[0]
    neg_count = torch.bincount(na, minlength=b)
    neg_start = torch.cumsum(neg_count, 0) - neg_count
    reps = neg_count[pa]
    total = int(reps.sum())
    if total == 0:
        return empty, empty.clone(), empty.clone()
    anchors = torch.repeat_interleave(pa, reps)
    positives = torch.repeat_interleave(pp, reps)
    # position of each output row inside its positive pair's block of negatives
    block_start = torch.repeat_interleave(torch.cumsum(reps, 0) - reps, reps)
    within = torch.arange(total, device=device) - block_start
    negatives = nn[neg_start[anchors] + within]
    return anchors, positives, negatives
