"""Private helpers shared by the losses (argument checks, pair masks, dtype handling)."""
from __future__ import annotations

import torch
from pytorch_metric_learning.reducers import MultipleReducers
from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

from .. import poincare_ball as pb
from .._checks import _HUGE, _TINY, _reject_non_numbers, check_bool, check_int, check_nonnegative, check_positive  # noqa: F401


def check_embeddings(x, name: str = "embeddings", finite: bool = True) -> torch.Tensor:
    """A 2-D (N, D) floating-point tensor, finite when ``finite``; one clear error otherwise.

    Raises:
        TypeError: not a tensor, or not floating point.
        ValueError: not 2-D, or (``finite``) with NaN/Inf entries (read where
            :func:`pml_hyperbolic.poincare_ball.values_checked` says so).
    """
    if not torch.is_tensor(x):
        raise TypeError(f"{name} must be a torch.Tensor of shape (N, D), got {type(x).__name__}")
    if not torch.is_floating_point(x):
        raise TypeError(f"{name} must be floating point, got {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (N, D), got {tuple(x.shape)}")
    if finite and x.numel() and pb.values_checked(x) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN/Inf values")
    return x


def as_compute(mat: torch.Tensor) -> torch.Tensor:
    """Half-precision distance matrices are upcast: exp/log of logits in fp16 overflow."""
    return mat.float() if mat.dtype in (torch.float16, torch.bfloat16) else mat


def check_labels(labels: torch.Tensor | None, n: int, name: str = "labels") -> None:
    if labels is not None and (labels.ndim != 1 or labels.shape[0] != n):
        raise ValueError(f"{name} must be a 1-D tensor of length {n}, got shape {tuple(labels.shape)}")


def check_labels_tensor(labels, n: int, name: str = "labels", max_ndim: int = 1) -> None:
    """``labels``: an integer tensor with ``n`` rows and at most ``max_ndim`` dimensions.

    Raises:
        TypeError: not a tensor.
        ValueError: a bool / floating-point / complex dtype (class ids are integers), more than
            ``max_ndim`` dimensions, none, or a length other than ``n``.
    """
    if not torch.is_tensor(labels):
        raise TypeError(f"{name} must be a torch.Tensor of integer class ids, got {type(labels).__name__}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"{name} must hold integer class ids, got dtype {labels.dtype}")
    shape = "(N,)" if max_ndim == 1 else "(N,) or (N, K)"
    if not 1 <= labels.ndim <= max_ndim or labels.shape[0] != n:
        raise ValueError(f"{name} must have shape {shape} with N = {n}, got {tuple(labels.shape)}")


def index_tensors(indices_tuple, n: int, r: int) -> tuple:
    """A PML pair (a1, p, a2, n) or triplet (a, p, n) ``indices_tuple`` as 1-D integer tensors (lists
    accepted), each checked before any use: anchors in [0, ``n``), positives and negatives in
    [0, ``r``), the members of a triplet (of each pair list) of one length. One device-to-host read
    for the range check when every index is in range.

    Returns:
        The tuple's members as tensors (a given tensor is returned as it is).

    Raises:
        ValueError: naming ``indices_tuple`` (and the member's position): not 3 or 4 members, a member
            that is not a 1-D integer sequence, lengths that do not pair up, or an index out of range.
    """
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        got = len(indices_tuple) if isinstance(indices_tuple, (tuple, list)) else type(indices_tuple).__name__
        raise ValueError(f"indices_tuple must be a PML triplet (3) or pair (4) tuple, got {got}")
    members = []
    for position, values in enumerate(indices_tuple):
        try:
            member = values if torch.is_tensor(values) else torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"indices_tuple[{position}] must be a 1-D sequence of integers, got "
                             f"{type(values).__name__}") from None
        if member.dtype == torch.bool or member.is_floating_point() or member.is_complex() or member.ndim != 1:
            raise ValueError(f"indices_tuple[{position}] must be a 1-D integer tensor, got dtype {member.dtype} "
                             f"and shape {tuple(member.shape)}")
        members.append(member)
    groups = ((0, 1, 2),) if len(members) == 3 else ((0, 1), (2, 3))
    for group in groups:
        if len({members[g].numel() for g in group}) != 1:
            raise ValueError(f"indices_tuple: members {group} must have one length, got "
                             f"{[members[g].numel() for g in group]}")
    bounds = (n, r, r) if len(members) == 3 else (n, r, n, r)
    bad = None
    for member, bound in zip(members, bounds):
        if member.numel():
            outside = ((member < 0) | (member >= bound)).any()
            bad = outside if bad is None else bad | outside.to(bad.device)
    if bad is not None and bool(bad):  # the detail (which member, min and max) only on failure
        for position, (member, bound) in enumerate(zip(members, bounds)):
            low, high = (int(member.min()), int(member.max())) if member.numel() else (0, 0)
            if low < 0 or high >= bound:
                raise ValueError(f"indices_tuple[{position}] has indices outside [0, {bound}) (min {low}, "
                                 f"max {high})")
    return tuple(members)


def check_indices_tuple(indices_tuple, n: int, r: int) -> None:
    """:func:`index_tensors` for the losses that hand ``indices_tuple`` on to PML, which needs tensors.

    Raises:
        TypeError: a member that is not an integer tensor.
        ValueError: as :func:`index_tensors`.
    """
    def integer_tensor(t) -> bool:
        return torch.is_tensor(t) and not (t.dtype == torch.bool or t.is_floating_point() or t.is_complex())

    if isinstance(indices_tuple, (tuple, list)) and not all(integer_tensor(t) for t in indices_tuple):
        raise TypeError("indices_tuple must be a tuple of integer index tensors (a, p, n) or (a1, p, a2, n), "
                        f"got {[t.dtype if torch.is_tensor(t) else type(t).__name__ for t in indices_tuple]}")
    index_tensors(indices_tuple, n, r)


def require_ref_labels(ref_emb, ref_labels, labels, indices_tuple) -> None:
    """A reference set scored by labels needs its own labels.

    Raises:
        ValueError: ``ref_emb`` and ``labels`` given, no ``ref_labels`` and no ``indices_tuple``.
    """
    if ref_emb is not None and ref_labels is None and labels is not None and indices_tuple is None:
        raise ValueError("ref_labels is required with ref_emb (the positives are pairs of equal labels "
                         "across the batch and the reference set)")


def _checked_batch_and_reference(given: dict) -> tuple:
    """``embeddings`` and ``ref_emb`` (or None) of a forward call, checked by :func:`check_embeddings`,
    of one dimension D."""
    emb = check_embeddings(given.get("embeddings"), "embeddings")
    ref = given.get("ref_emb")
    if ref is not None:
        check_embeddings(ref, "ref_emb")
        if ref.shape[1] != emb.shape[1]:
            raise ValueError(f"ref_emb must have the dimension of embeddings ({emb.shape[1]}), "
                             f"got shape {tuple(ref.shape)}")
    return emb, ref


def check_loss_call(module, args, kwargs, hierarchical: bool = False) -> None:
    """The arguments of a loss's ``forward(embeddings, labels, indices_tuple, ref_emb, ref_labels)``
    (positional or keyword): see :func:`check_embeddings`, :func:`check_labels_tensor`,
    :func:`check_indices_tuple`; ``ref_emb`` must have the dimension of ``embeddings``."""
    names = ("embeddings", "labels", "indices_tuple", "ref_emb", "ref_labels")
    given = dict(zip(names, args))
    given.update({k: v for k, v in kwargs.items() if k in names})
    emb, ref = _checked_batch_and_reference(given)
    max_ndim = 2 if hierarchical else 1
    require_ref_labels(ref, given.get("ref_labels"), given.get("labels"), given.get("indices_tuple"))
    if given.get("labels") is not None:
        check_labels_tensor(given["labels"], emb.shape[0], "labels", max_ndim)
    if ref is not None and given.get("ref_labels") is not None:
        check_labels_tensor(given["ref_labels"], ref.shape[0], "ref_labels", max_ndim)
    if given.get("indices_tuple") is not None:
        check_indices_tuple(given["indices_tuple"], emb.shape[0], emb.shape[0] if ref is None else ref.shape[0])


def _check_call_hook(module, args, kwargs):
    check_loss_call(module, args, kwargs, getattr(module, "_input_check_hierarchical", False))
    return None


def check_inputs_on_call(loss: torch.nn.Module, hierarchical: bool = False) -> None:
    """Register :func:`check_loss_call` as a forward pre-hook of ``loss`` (after the hook that
    unwraps hypll ``ManifoldTensor`` arguments); ``hierarchical`` allows (N, K) labels."""
    loss._input_check_hierarchical = hierarchical
    loss.register_forward_pre_hook(_check_call_hook, with_kwargs=True)


def check_miner_call(module, args, kwargs, hierarchical: bool = False, labels_optional: bool = False) -> None:
    """The arguments of a miner's ``forward(embeddings, labels, ref_emb, ref_labels)`` (positional
    or keyword): embeddings and ``ref_emb`` as in :func:`check_embeddings` with one dimension D,
    labels as in :func:`check_labels_tensor`; ``ref_labels`` required with ``ref_emb`` when labels
    are given. ``labels_optional``: labels may be None (a pseudo-labeler clusters the batch)."""
    names = ("embeddings", "labels", "ref_emb", "ref_labels")
    given = dict(zip(names, args))
    given.update({k: v for k, v in kwargs.items() if k in names})
    emb, ref = _checked_batch_and_reference(given)
    max_ndim = 2 if hierarchical else 1
    labels, ref_labels = given.get("labels"), given.get("ref_labels")
    if labels is None:
        if not labels_optional:
            raise ValueError(f"labels are required: {type(module).__name__} mines by class")
        return
    check_labels_tensor(labels, emb.shape[0], "labels", max_ndim)
    if ref is not None:
        if ref_labels is None:
            raise ValueError("ref_labels are required with ref_emb (one label per reference row)")
        check_labels_tensor(ref_labels, ref.shape[0], "ref_labels", max_ndim)


def check_miner_inputs_on_call(miner: torch.nn.Module, hierarchical: bool = False,
                               labels_optional: bool = False) -> None:
    """Register :func:`check_miner_call` as a forward pre-hook of ``miner`` (a module-level hook
    and plain attributes, so that the miner still pickles)."""
    miner._input_check_hierarchical = hierarchical
    miner._input_check_labels_optional = labels_optional
    miner.register_forward_pre_hook(_check_miner_hook, with_kwargs=True)


def _check_miner_hook(module, args, kwargs):
    check_miner_call(module, args, kwargs, getattr(module, "_input_check_hierarchical", False),
                     getattr(module, "_input_check_labels_optional", False))
    return None


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
