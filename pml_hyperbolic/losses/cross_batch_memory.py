"""PML's CrossBatchMemory, accepting this package's losses."""
from __future__ import annotations

from pytorch_metric_learning.losses import CrossBatchMemory as _PMLCrossBatchMemory
from ..manifold_tensors import AcceptsManifoldTensors
from ._common import REFERENCE_SET_LOSSES



class HyperbolicCrossBatchMemory(AcceptsManifoldTensors, _PMLCrossBatchMemory):
    """PML ``CrossBatchMemory`` (XBM) whose whitelist also holds this package's losses.

    PML 2.x refuses any loss whose class name is not in a hard-coded list; this subclass only
    extends that list, behaviour is PML's (the batch is scored against the memory through
    ``indices_tuple`` pairs, self-pairs excluded). It is a ``CrossBatchMemory``, so PML's
    ``DistributedLossWrapper`` handles it as one. ``HierarchicalLogRatioLoss`` is supported with
    1-D labels only (the memory stores 1-D labels).
    """

    @staticmethod
    def supported_losses():
        # HypMix maps one Euclidean output to both geometries: a memory of those outputs is a valid
        # reference set (unlike HCL's queue of ball keys, training.hcl_trainer.KeyQueue, which is why
        # it is not in the shared list)
        return _PMLCrossBatchMemory.supported_losses() + list(REFERENCE_SET_LOSSES) + ["HypMixLoss"]
