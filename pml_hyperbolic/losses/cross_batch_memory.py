"""PML's CrossBatchMemory, accepting this package's losses."""
from __future__ import annotations

import torch

from pytorch_metric_learning.losses import CrossBatchMemory as _PMLCrossBatchMemory
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import REFERENCE_SET_LOSSES
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

    Design note: docs/design/losses.md
    """

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
