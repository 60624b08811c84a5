"""Private helpers shared by the losses (argument checks, pair masks, dtype handling)."""
from __future__ import annotations

import math

import torch
from pytorch_metric_learning.reducers import MultipleReducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu


def check_positive(value: float, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return v


def check_nonnegative(value: float, name: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    return v


def as_compute(mat: torch.Tensor) -> torch.Tensor:
    """Half-precision distance matrices are upcast: exp/log of logits in fp16 overflow."""
    return mat.float() if mat.dtype in (torch.float16, torch.bfloat16) else mat


def check_labels(labels: torch.Tensor | None, n: int, name: str = "labels") -> None:
    if labels is not None and (labels.ndim != 1 or labels.shape[0] != n):
        raise ValueError(f"{name} must be a 1-D tensor of length {n}, got shape {tuple(labels.shape)}")


def pair_masks(embeddings: torch.Tensor, labels: torch.Tensor, indices_tuple: tuple | None,
               ref_emb: torch.Tensor, ref_labels: torch.Tensor):
    """Boolean (B, R) masks of positive and negative pairs, PML style.

    Without ``indices_tuple``: label equality, the diagonal excluded when ``ref_emb`` is the batch
    itself. With a PML pair (4-) or triplet (3-) tuple: exactly the pairs it names.
    """
    B, R = embeddings.shape[0], ref_emb.shape[0]
    dev = embeddings.device
    if indices_tuple is None:
        if labels is None:
            raise ValueError("labels or indices_tuple is required")
        check_labels(labels, B, "labels")
        check_labels(ref_labels, R, "ref_labels")
        pos = labels.view(-1, 1) == ref_labels.view(1, -1)
        neg = ~pos
        if ref_emb is embeddings:
            pos.fill_diagonal_(False)
        return pos, neg
    a1, p, a2, n = lmu.convert_to_pairs(indices_tuple, labels, ref_labels)
    pos = torch.zeros(B, R, dtype=torch.bool, device=dev)
    neg = torch.zeros(B, R, dtype=torch.bool, device=dev)
    pos[a1.to(dev), p.to(dev)] = True
    neg[a2.to(dev), n.to(dev)] = True
    return pos, neg


def similarity_logits(mat: torch.Tensor, is_inverted: bool) -> torch.Tensor:
    """Larger = more similar: −D for distances, the similarity itself for inverted distances."""
    mat = as_compute(mat)
    return mat if is_inverted else -mat


def sub_loss_reducer_type(loss_fn: torch.nn.Module, name: str = "loss") -> type:
    """Type of the reducer PML will apply to sub-loss ``name`` (looks inside ``MultipleReducers``,
    which PML builds as soon as a loss has several sub-losses, e.g. with an embedding regularizer).

    Losses use it to reduce dense formulations themselves ("already_reduced") when the reducer
    is exactly a plain mean (``MeanReducer``) or mean-over-non-zero (``AvgNonZeroReducer``), and to
    list every element for any other reducer (subclasses included: they may weight elements).
    """
    reducer = loss_fn.reducer
    if isinstance(reducer, MultipleReducers):
        reducer = reducer.reducers[name] if name in reducer.reducers else reducer.default_reducer
    return type(reducer)


#: This package's losses that score a batch against a reference set (``ref_emb`` / ``ref_labels``):
#: the one list PML's name-based checks are extended with (``HyperbolicCrossBatchMemory``, HCL's
#: ``KeyQueue``).
REFERENCE_SET_LOSSES = (
    "PairwiseCrossEntropyLoss",
    "UncertaintyAdaptiveContrastiveLoss",
    "UncertaintyAdaptiveTripletLoss",
    "HierarchicalLogRatioLoss",
    "HierarchicalMarginLoss",
    "HIERLoss",
)
