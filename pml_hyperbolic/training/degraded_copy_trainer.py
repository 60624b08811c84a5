r"""A training step that also embeds degraded copies of some images and orders their radius.

.. math::
    \mathcal{L} = w_m\,\mathcal{L}_{metric}(z_{1..B}, y) + w_d\,\frac{1}{k}\sum_{i \in S}
                  \max\big(0,\ m + d_0(\tilde z_i) - d_0(z_i)\big)

with S a random subset of k = ⌈f·B⌉ images of the batch (f = ``copy_fraction``) and
:math:`\tilde z_i` the embedding of a degraded copy of image i (``degradation``, default
:class:`~pml_hyperbolic.data.degradations.RandomDegradation`). The metric loss (and the miner) see
only the B clean embeddings, so retrieval training is unchanged; the copies share the trunk and head
forward pass with them (one batch of B + k images).

Design note: docs/design/training.md
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
from pytorch_metric_learning.utils import common_functions as c_f

from .trainer import HyperbolicTrainer

DEGRADED_COPY_LOSS = "degraded_copy_loss"


class DegradedCopyTrainer(HyperbolicTrainer):
    """:class:`HyperbolicTrainer` whose step adds degraded copies (see the module docstring).

    Loss funcs: ``metric_loss`` and ``degraded_copy_loss`` (a
    :class:`~pml_hyperbolic.losses.DegradedCopyRadiusLoss`, called as ``loss(clean, ref_emb=copies)``),
    weighted by ``loss_weights`` as in every PML trainer.

    The arguments below come on top of :class:`HyperbolicTrainer`'s.

    Args:
        degradation: ``callable(images (k, C, H, W)) -> degraded images``; random draws should come
            from torch's global generator, which the recipes seed and checkpoint.
        copy_fraction: f in (0, 1], the fraction of each batch that gets a degraded copy (default 0.25:
            the trunk sees 1.25 B images per step).
        *args: :class:`HyperbolicTrainer` positional arguments.
        **kwargs: :class:`HyperbolicTrainer` keyword arguments.

    Raises:
        ValueError: ``copy_fraction`` not a number in (0, 1] (bool and str included), or no
            ``degraded_copy_loss`` in ``loss_funcs``.
        TypeError: ``degradation`` is neither None nor callable.

    Design note: docs/design/training.md
    """

    def __init__(self, *args: Any, degradation: Optional[Callable] = None, copy_fraction: float = 0.25,
                 **kwargs: Any):
        try:
            if isinstance(copy_fraction, (bool, str, bytes)):
                raise TypeError
            copy_fraction = float(copy_fraction)
        except (TypeError, ValueError):
            raise ValueError(f"copy_fraction must be a number in (0, 1], got {copy_fraction!r}") from None
        if not 0.0 < copy_fraction <= 1.0:
            raise ValueError(f"copy_fraction must be in (0, 1], got {copy_fraction}")
        if degradation is not None and not callable(degradation):
            raise TypeError(f"degradation must be a callable (images -> degraded images) or None, got "
                            f"{type(degradation).__name__}")
        if degradation is None:
            from ..data.degradations import RandomDegradation

            degradation = RandomDegradation()
        self.degradation = degradation
        self.copy_fraction = copy_fraction
        super().__init__(*args, **kwargs)
        if DEGRADED_COPY_LOSS not in self.loss_funcs:
            raise ValueError(f"DegradedCopyTrainer needs loss_funcs[{DEGRADED_COPY_LOSS!r}] "
                             "(a DegradedCopyRadiusLoss) beside 'metric_loss'")

    def modify_schema(self):
        self.schema["loss_funcs"].keys = ["metric_loss", DEGRADED_COPY_LOSS]

    def copy_indices(self, batch_size: int) -> torch.Tensor:
        """The k = ⌈f·B⌉ batch rows that get a degraded copy (torch's global generator, CPU)."""
        k = min(batch_size, max(1, math.ceil(self.copy_fraction * batch_size)))
        return torch.randperm(batch_size)[:k]

    def calculate_loss(self, curr_batch: Any) -> None:
        data, labels = curr_batch
        if not torch.is_tensor(data) or data.ndim != 4:
            raise ValueError("DegradedCopyTrainer needs image batches (B, C, H, W); got "
                             f"{type(data).__name__} {tuple(getattr(data, 'shape', ()))}")
        batch = len(data)
        rows = self.copy_indices(batch)
        # degrade where the model runs: a loader's batch arrives on the host, and blurring it there
        # would cost a GPU step more than the trunk's pass over the copies
        data = c_f.to_device(data, device=self.data_device, dtype=self.dtype)
        copies = self.degradation(data[rows.to(data.device)])
        embeddings = self.compute_embeddings(torch.cat([data, copies.to(data.dtype)]))
        clean, degraded = embeddings[:batch], embeddings[batch:]
        indices_tuple = self.maybe_mine_embeddings(clean, labels)
        self.losses["metric_loss"] = self.maybe_get_metric_loss(clean, labels, indices_tuple)
        if self.loss_weights.get(DEGRADED_COPY_LOSS, 0) > 0:
            self.losses[DEGRADED_COPY_LOSS] = self.loss_funcs[DEGRADED_COPY_LOSS](
                clean[rows.to(clean.device)], ref_emb=degraded)
        else:
            self.losses[DEGRADED_COPY_LOSS] = 0
