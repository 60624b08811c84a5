"""Union ("fusion pool") of the hard triplets selected under several geometries (HypMix)."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from pytorch_metric_learning.distances import BaseDistance, CosineSimilarity
from pytorch_metric_learning.miners import BaseMiner

from ..distances import PoincareDistance
from ..manifold_tensors import AcceptsManifoldTensors
from ..losses._common import check_bool, check_miner_inputs_on_call, check_positive
from .._batch_utils import join_pairs_to_triplets
from .hard_negative_probability_miner import HardNegativeProbabilityMiner


def _per_distance(value, n: int, name: str):
    """Broadcast a scalar (or None) to n values; a list/tuple must have length n."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} must be a scalar or have one entry per distance ({n}), got {len(value)}")
        return list(value)
    if value is not None and not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, None, or a list with one entry per distance, got {value!r}")
    return [value] * n


class MixedGeometryMiner(AcceptsManifoldTensors, BaseMiner):
    r"""The union of the triplets that :class:`HardNegativeProbabilityMiner` selects under two or
    more distances, without duplicates: HypMix's "fusion pool" (Yue et al., Sec. 3.3).

    For every distance :math:`D^{(g)}` with temperature :math:`\tau_g` the negative weights

    .. math:: p_g(x^-_k) = \operatorname{softmax}_{k\in C(a)}\big(-D^{(g)}_{a,k}/\tau_g\big)

    (``+sim/τ_g`` for similarities) are computed, negatives are selected per geometry by
    ``threshold``/``top_k`` exactly as in :class:`HardNegativeProbabilityMiner`, and a triplet
    (a, p, n) is returned if n is selected in **any** geometry (each triplet once). HypMix's
    argument: an instance with a small weight in one geometry but a large one in the other is
    still trained on; instances small in both are dropped.

    Args:
        distances: list of PML distances (≥ 2 for a fusion; 1 is allowed and equals
            :class:`HardNegativeProbabilityMiner`). Default ``[CosineSimilarity(),
            PoincareDistance()]``: the paper's Euclidean (sphere) and hyperbolic branches.
            All are applied to the same embeddings; to reproduce HypMix's single head that maps
            one Euclidean output onto both the sphere and the ball, pass distances that perform
            that mapping (e.g. distances built from ``MixedGeometryDistance``'s parts).
        temperatures: one τ per distance, or one shared τ. Default ``(0.05, 0.2)``: the paper's
            τ_e = 0.05 (sphere) and τ_h = 0.2 (ball).
        threshold: as in :class:`HardNegativeProbabilityMiner`; a scalar is used for every
            geometry, a list gives one value per geometry.
        top_k: as in :class:`HardNegativeProbabilityMiner`; a scalar or one value per geometry.
        include_positives: as in :class:`HardNegativeProbabilityMiner` (default True).

    Raises:
        ValueError: an empty ``distances`` list, per-distance lists of another length, a
            temperature not in [1e-12, 1e12], or the call-time errors of
            :class:`HardNegativeProbabilityMiner`.
        TypeError: ``include_positives`` not a bool, or the call-time errors of
            :class:`HardNegativeProbabilityMiner`.

    Design note: docs/design/miners.md
    """

    def __init__(
        self,
        distances: Sequence[BaseDistance] | None = None,
        temperatures: float | Sequence[float] = (0.05, 0.2),
        threshold: float | Sequence[float | None] | None = None,
        top_k: int | Sequence[int | None] | None = None,
        include_positives: bool = True,
        **kwargs,
    ):
        if distances is None:
            distances = [CosineSimilarity(), PoincareDistance()]
        if not isinstance(distances, (list, tuple)) or len(distances) == 0:
            raise ValueError("distances must be a non-empty list of PML distances")
        n = len(distances)
        temperatures = _per_distance(temperatures, n, "temperatures")
        temperatures = [check_positive(t, f"temperatures[{i}]") for i, t in enumerate(temperatures)]
        check_bool(include_positives, "include_positives")
        thresholds = _per_distance(threshold, n, "threshold")
        top_ks = _per_distance(top_k, n, "top_k")
        super().__init__(**kwargs)
        self.geometry_miners = torch.nn.ModuleList(
            HardNegativeProbabilityMiner(
                distance=d, temperature=t, threshold=th, top_k=k, include_positives=include_positives
            )
            for d, t, th, k in zip(distances, temperatures, thresholds, top_ks)
        )
        self.distances = [m.distance for m in self.geometry_miners]
        self.add_to_recordable_attributes(
            list_of_names=["num_triplets_per_geometry"], is_stat=True
        )
        self.num_triplets_per_geometry = [0] * n
        check_miner_inputs_on_call(self)

    def mine(self, embeddings: torch.Tensor, labels: torch.Tensor, ref_emb: torch.Tensor,
             ref_labels: torch.Tensor):
        pool = None
        pos = None
        counts = []
        for miner in self.geometry_miners:
            pos, selected = miner.selection_masks(embeddings, labels, ref_emb, ref_labels)
            counts.append(int((pos.sum(1) * selected.sum(1)).sum()))
            pool = selected if pool is None else pool | selected
        self.num_triplets_per_geometry = counts
        return join_pairs_to_triplets(pos, pool)
