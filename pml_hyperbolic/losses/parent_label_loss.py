"""A metric loss applied to the parent labels of the classes (one level up a label tree)."""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .. import poincare_ball as pb
from ._common import check_embeddings


def class_parents(labels, parent_labels) -> Tensor:
    """The parent of every class, from per-sample class and parent labels: a (C,) int64 tensor.

    ``parents[k]`` is the parent label of the samples of class k, with C = max(labels) + 1; a class
    id in [0, C) with no sample gets parent -1 (no loss term reads it: no sample carries it).

    Args:
        labels: (N,) integer class labels, ≥ 0.
        parent_labels: (N,) integer parent labels, ≥ 0, one per sample.

    Returns:
        (C,) int64 tensor of parent labels.

    Raises:
        ValueError: not two 1-D integer sequences of the same length ≥ 1, a negative label, or a
            class whose samples have different parents (then the labels are no tree).
    """
    labels = _as_labels(labels, "labels").cpu()  # a table built once, on the host
    parent_labels = _as_labels(parent_labels, "parent_labels").cpu()
    if labels.shape != parent_labels.shape or labels.numel() == 0:
        raise ValueError(f"labels and parent_labels must be non-empty and of one length, got "
                         f"{labels.numel()} and {parent_labels.numel()}")
    if int(labels.min()) < 0 or int(parent_labels.min()) < 0:
        raise ValueError("labels and parent_labels must be >= 0")
    num_classes = int(labels.max()) + 1
    parents = torch.full((num_classes,), -1, dtype=torch.int64)
    parents[labels] = parent_labels
    if not torch.equal(parents[labels], parent_labels):
        bad = int(labels[parents[labels] != parent_labels][0])
        raise ValueError(f"class {bad} has samples under more than one parent: the labels must form a tree")
    return parents


def _as_labels(values, name: str) -> Tensor:
    tensor = torch.as_tensor(values)
    if not isinstance(values, Tensor) and tensor.numel() == 0:
        tensor = tensor.long()  # an empty list reads as float: its emptiness is the error to name
    if tensor.ndim != 1 or tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer sequence, got dtype {tensor.dtype}, shape "
                         f"{tuple(tensor.shape)}")
    return tensor.long()


class ParentLabelLoss(torch.nn.Module):
    r"""A PML loss on the parents of the batch's classes: :math:`L(x, \pi(y))`.

    With :math:`\pi` the class → parent table, the wrapped ``loss`` (and ``miner``, when given) see
    the parent label :math:`\pi(y_i)` of every sample instead of its class: samples of sibling
    classes are positives, samples under other parents negatives. Beside the class-level loss with a
    small weight (e.g. ``OrderedMultipleLosses([class_loss, ParentLabelLoss(...)], weights=[1, w])``)
    it groups the classes of one parent without merging them. Why: the training labels of many
    datasets come with a coarser level (a category, a radical, an icon's context); that level is
    shared by classes never seen in training, so arranging it trains a part of the embedding that
    carries over to them, and it is what a tree-faithful distance (parent-level recall, the
    correlation of distance and tree distance) asks for.

    Design note: docs/design/losses.md

    Args:
        loss: a PML loss called as ``loss(embeddings, parent_labels, indices_tuple, ref_emb,
            ref_parent_labels)``.
        parents: (C,) integer sequence, ``parents[k]`` the parent label of class k (see
            :func:`class_parents`).
        miner: a PML miner run on the parent labels before the loss, or None (every pair).

    Raises:
        ValueError: ``parents`` not a 1-D integer sequence of length ≥ 1; at a call, an
            ``indices_tuple`` together with a ``miner``, labels outside [0, C) or labels of a class
            whose parent is negative (these two read the labels back from an accelerator only where
            :func:`pml_hyperbolic.poincare_ball.values_checked` says so).
        TypeError: ``loss`` (or ``miner``) not a ``torch.nn.Module``.
    """

    def __init__(self, loss: torch.nn.Module, parents: Sequence[int] | Tensor,
                 miner: torch.nn.Module | None = None):
        super().__init__()
        if not isinstance(loss, torch.nn.Module):
            raise TypeError(f"loss must be a torch.nn.Module (a PML loss), got {type(loss).__name__}")
        if miner is not None and not isinstance(miner, torch.nn.Module):
            raise TypeError(f"miner must be a torch.nn.Module (a PML miner) or None, got {type(miner).__name__}")
        table = _as_labels(parents, "parents")
        if table.numel() == 0:
            raise ValueError("parents must hold the parent of at least one class")
        self.loss, self.miner = loss, miner
        self.register_buffer("parents", table.clone(), persistent=False)

    def parent_labels(self, labels: Tensor, name: str = "labels") -> Tensor:
        """The parent label of each class label in ``labels`` (on ``labels``' device)."""
        labels = _as_labels(labels, name)
        checked = labels.numel() > 0 and pb.values_checked(labels)  # on an accelerator: on request only
        if checked and (int(labels.min()) < 0 or int(labels.max()) >= self.parents.numel()):
            raise ValueError(f"{name} must lie in [0, {self.parents.numel()}), the classes of parents")
        out = self.parents.to(labels.device)[labels]
        if checked and int(out.min()) < 0:
            raise ValueError(f"{name} hold a class without a parent (parents[k] < 0)")
        return out

    def forward(self, embeddings: Tensor, labels: Tensor, indices_tuple: tuple | None = None,
                ref_emb: Tensor | None = None, ref_labels: Tensor | None = None) -> Tensor:
        check_embeddings(embeddings)
        parent = self.parent_labels(labels)
        ref_parent = None if ref_labels is None else self.parent_labels(ref_labels, "ref_labels")
        if self.miner is not None:
            if indices_tuple is not None:
                raise ValueError("indices_tuple must be None when ParentLabelLoss has its own miner")
            indices_tuple = self.miner(embeddings, parent, ref_emb, ref_parent)
        return self.loss(embeddings, parent, indices_tuple, ref_emb, ref_parent)
