"""PML's ``MultipleLosses`` with the order in which its terms are computed chosen by the caller."""
from __future__ import annotations

from collections.abc import Sequence

from pytorch_metric_learning.losses import MultipleLosses


class OrderedMultipleLosses(MultipleLosses):
    r"""A weighted sum of losses, :math:`\sum_i w_i L_i`, computed in a chosen order.

    PML's :class:`~pytorch_metric_learning.losses.MultipleLosses` (the same arguments, submodules and
    state-dict keys; the same value, for two terms bit for bit, else up to the order of the additions,
    and the same gradients up to that order),
    with the terms computed in ``compute_order``. Why: on an accelerator, a term whose forward reads
    the device back (PML's miners size their lists from the data) makes the host wait for every
    queued kernel, and each term computed after it is launched while the device idles; a term that
    reads nothing back, computed first, is queued behind the trunk's kernels instead.

    Design note: docs/design/gpu-kernel.md

    Args:
        losses: a list or dict of PML losses (as ``MultipleLosses``).
        miners: the miner of each loss or None, in the same layout (as ``MultipleLosses``).
        weights: the weight of each loss (default 1), in the same layout (as ``MultipleLosses``).
        compute_order: the losses' indices (a list) or keys (a dict), each once, in the order to
            compute them; None (default): as given.

    Raises:
        ValueError: ``compute_order`` is not an ordering of the losses' indices or keys; at a call,
            an ``indices_tuple`` given while the losses have miners.
    """

    def __init__(self, losses, miners=None, weights=None, compute_order: Sequence | None = None):
        super().__init__(losses, miners=miners, weights=weights)
        names = list(self.losses.keys()) if self.is_dict else list(range(len(self.losses)))
        if compute_order is None:
            order = names
        else:
            if isinstance(compute_order, (str, bytes)) or not isinstance(compute_order, Sequence):
                raise ValueError(f"compute_order must be a list of the losses' "
                                 f"{'keys' if self.is_dict else 'indices'}, got {compute_order!r}")
            order = list(compute_order)
            if any(isinstance(i, bool) for i in order) or len(order) != len(names) or set(order) != set(names):
                raise ValueError(f"compute_order must hold each of the losses' "
                                 f"{'keys' if self.is_dict else 'indices'} {names} once, got {order}")
        self.compute_order = order

    def forward(self, embeddings, labels, indices_tuple=None):
        if self.miners and indices_tuple is not None:
            raise ValueError("indices_tuple must be None when the losses have miners (each loss gets its "
                             "miner's tuples)")
        total = 0
        for i in self.compute_order:
            tuples = self.get_indices_tuple(i, embeddings, labels, indices_tuple)
            total += self.losses[i](embeddings, labels, tuples) * self.weights[i]
        return total
