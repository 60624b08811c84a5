"""PML's CrossBatchMemory, accepting this package's losses."""
from __future__ import annotations

import torch

from pytorch_metric_learning.losses import CrossBatchMemory as _PMLCrossBatchMemory
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import (
    REFERENCE_SET_LOSSES,
    check_embeddings,
    check_indices_tuple,
    check_int,
    check_labels_tensor,
)
from .pairwise_cross_entropy_loss import PairwiseCrossEntropyLoss


class HyperbolicCrossBatchMemory(AcceptsManifoldTensors, _PMLCrossBatchMemory):
    """PML ``CrossBatchMemory`` (XBM) whose whitelist also holds this package's losses.

    PML 2.x refuses any loss whose class name is not in a hard-coded list; this subclass only
    extends that list, behaviour is PML's (the batch is scored against the memory through
    ``indices_tuple`` pairs, self-pairs excluded). It is a ``CrossBatchMemory``, so PML's
    ``DistributedLossWrapper`` handles it as one. ``HierarchicalLogRatioLoss`` is supported with
    1-D labels only (the memory stores 1-D labels).

    One shortcut, same results bit for bit: with ``enqueue_mask`` (no self-pairs to remove), no miner
    and no given pairs, a :class:`PairwiseCrossEntropyLoss` gets no pair list. PML would list every
    (query, memory entry) pair, four index tensors of B × memory entries (4.2 million each at batch 64
    and HCL's queue of 65,536), which that loss turns back into the label-equality masks it builds
    without them.

    Args:
        loss: the wrapped loss (PML's supported losses and this package's reference-set losses).
        embedding_size: D of the embeddings stored, an int ≥ 1.
        memory_size: entries the memory holds, an int ≥ 1.
        miner: optional PML miner run against the memory.
        **kwargs: passed to PML's ``CrossBatchMemory``.

    Raises:
        TypeError: ``embedding_size`` / ``memory_size`` not an integer (bool and fractions included);
            at the call, embeddings or labels of a wrong type (see ``forward``).
        ValueError: ``embedding_size`` / ``memory_size`` < 1; at the call, embeddings not of shape
            (N, ``embedding_size``) or with NaN/Inf, labels not (N,), a bad ``indices_tuple`` or
            ``enqueue_mask``.

    Design note: docs/design/losses.md
    """

    def __init__(self, loss: torch.nn.Module, embedding_size: int, memory_size: int = 1024,
                 miner: torch.nn.Module | None = None, **kwargs):
        embedding_size = check_int(embedding_size, "embedding_size", 1)
        memory_size = check_int(memory_size, "memory_size", 1)
        super().__init__(loss, embedding_size, memory_size=memory_size, miner=miner, **kwargs)
        self.register_forward_pre_hook(_check_memory_call, with_kwargs=True)

    def create_indices_tuple(self, embeddings: torch.Tensor, labels: torch.Tensor, E_mem: torch.Tensor,
                             L_mem: torch.Tensor, input_indices_tuple: tuple | None,
                             do_remove_self_comparisons: bool):
        if (self.miner is None and input_indices_tuple is None and not do_remove_self_comparisons
                and isinstance(self.loss, PairwiseCrossEntropyLoss) and not self.loss.view_pairs):
            return None
        return super().create_indices_tuple(embeddings, labels, E_mem, L_mem, input_indices_tuple,
                                            do_remove_self_comparisons)

    @staticmethod
    def supported_losses():
        # HypMix maps one Euclidean output to both geometries: a memory of those outputs is a valid
        # reference set (unlike HCL's queue of ball keys, training.hcl_trainer.KeyQueue, which is why
        # it is not in the shared list)
        return _PMLCrossBatchMemory.supported_losses() + list(REFERENCE_SET_LOSSES) + ["HypMixLoss"]


def _check_memory_call(module, args, kwargs):
    """``forward(embeddings, labels, indices_tuple=None, enqueue_mask=None)``: one clear error for
    bad arguments instead of a failure inside PML's memory update."""
    names = ("embeddings", "labels", "indices_tuple", "enqueue_mask")
    given = dict(zip(names, args))
    given.update({k: v for k, v in kwargs.items() if k in names})
    emb = check_embeddings(given.get("embeddings"), "embeddings")
    if emb.shape[1] != module.embedding_size:
        raise ValueError(f"embeddings must have shape (N, embedding_size={module.embedding_size}), "
                         f"got {tuple(emb.shape)}")
    if given.get("labels") is None:
        raise ValueError("labels are required: the memory stores them with the embeddings")
    check_labels_tensor(given["labels"], emb.shape[0], "labels")
    if given.get("indices_tuple") is not None:
        check_indices_tuple(given["indices_tuple"], emb.shape[0], emb.shape[0])
    mask = given.get("enqueue_mask")
    if mask is not None and (not torch.is_tensor(mask) or mask.dtype != torch.bool
                             or tuple(mask.shape) != (emb.shape[0],)):
        raise ValueError(f"enqueue_mask must be a bool tensor of shape ({emb.shape[0]},), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)} {tuple(getattr(mask, 'shape', ()))}")
    return None
