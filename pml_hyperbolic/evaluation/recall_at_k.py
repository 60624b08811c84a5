"""Recall@K on PML's :class:`AccuracyCalculator`.

Design note: docs/design/evaluation.md
"""
from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import torch
from pytorch_metric_learning.utils.accuracy_calculator import (
    EQUALITY,
    AccuracyCalculator,
    maybe_get_avg_of_avgs,
    nan_accuracy,
    try_getting_not_lone_labels,
)

from .hyperbolic_knn import HyperbolicKNN

_R_METRICS = ("r_precision", "mean_average_precision_at_r")


class RecallAtKAccuracyCalculator(AccuracyCalculator):
    r"""PML ``AccuracyCalculator`` that also reports deep-metric-learning Recall@K.

    .. math:: \text{Recall@}K = \frac{1}{|Q|}\sum_{q \in Q}
              \mathbb{1}\big[\exists\, j \in \text{NN}_K(q):\ y_j = y_q\big]

    the fraction of queries with at least one same-class reference among their K nearest
    neighbours (the query itself excluded when the query set is the reference set). Metric keys are
    ``"recall_at_1"``, ``"recall_at_2"``, ... one per K, next to PML's own metrics
    (``precision_at_1``, ``mean_average_precision_at_r``, ``r_precision``, ``NMI``, ``AMI`` ...);
    ``include``/``exclude`` accept the ``recall_at_K`` names.

    Conventions (the same as PML's ``precision_at_1``, so ``recall_at_1 == precision_at_1``):
    queries whose class has no other member in the reference set ("lone" queries) are left out;
    ``avg_of_avgs`` / ``return_per_class`` work as in PML. Neighbours come from ``knn_func``;
    with ``c`` given that is :class:`HyperbolicKNN` (exact Poincaré distance, ties broken by the
    smaller reference index), otherwise PML's default (faiss L2) unless you pass ``knn_func``.

    Usual K: CUB/Cars 1, 2, 4, 8 (default); SOP 1, 10, 100, 1000; In-Shop 1, 10, 20, 30 with
    ``get_accuracy(query, query_labels, gallery, gallery_labels)``.

    Args:
        k_values: the K of Recall@K (positive ints).
        c: curvature of the Poincaré ball the embeddings live in; ``None`` = Euclidean (PML default).
        k: as in PML. If ``None`` (default), this class fetches only as many neighbours as needed:
            ``max(k_values)``, or PML's ``max_bin_count`` when R-precision / MAP@R are computed
            (PML's own default would fetch *every* reference). ``mean_average_precision`` is then
            MAP over those neighbours.
        check_radius: with ``c`` given, check the first queries evaluated for a collapsed radius
            and warn once (:func:`~pml_hyperbolic.evaluation.radius_health.check_radius`): ranking
            still works then, but the radius carries no uncertainty.
        **kwargs: PML ``AccuracyCalculator`` arguments (include, exclude, avg_of_avgs, knn_func...).

    Raises:
        ValueError: empty or non-positive ``k_values``; at evaluation, a K larger than the number of
            references, or bad embeddings (see :meth:`get_accuracy`).

    Design note: docs/design/evaluation.md
    """

    def __init__(self, k_values: Iterable[int] = (1, 2, 4, 8), c: Optional[float] = None,
                 k: Optional[Any] = None, check_radius: bool = True, **kwargs: Any):
        if isinstance(k_values, int) and not isinstance(k_values, bool):
            k_values = (k_values,)
        try:
            k_values = tuple(k_values)
        except TypeError:
            raise ValueError(f"k_values must be a positive int or an iterable of them, got {k_values!r}") from None
        if len(k_values) == 0:
            raise ValueError("k_values must contain at least one K")
        for kv in k_values:
            if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1:
                raise ValueError(f"k_values must be positive integers, got {k_values!r}")
        self.k_values = tuple(sorted(set(k_values)))
        self.c = c
        if not isinstance(check_radius, bool):
            raise TypeError(f"check_radius must be True or False, got {check_radius!r}")
        self._radius_unchecked = check_radius and c is not None
        auto_knn = c is not None and kwargs.get("knn_func") is None
        if auto_knn:
            kwargs["knn_func"] = HyperbolicKNN(c=c)
        # one bound method per K, so that PML discovers "recall_at_K" as ordinary metrics
        for kv in self.k_values:
            setattr(self, f"calculate_recall_at_{kv}", self._make_recall_fn(kv))
        self._auto_k = k is None
        super().__init__(k=k, **kwargs)
        rank_metrics = {f"recall_at_{kv}" for kv in self.k_values}
        if 1 in self.k_values:
            rank_metrics.add("precision_at_1")
        if auto_knn and set(self.get_curr_metrics()) <= rank_metrics:
            # only the neighbour *sets* at the K of Recall@K matter (not the order inside them):
            # the exact search may leave near-ties between those ranks in faiss's order, which
            # skips most of its float64 work at large K
            self.knn_func = HyperbolicKNN(c=c, exact_ranks=self.k_values)

    def _make_recall_fn(self, K):
        def calculate(knn_labels, query_labels, not_lone_query_mask, label_counts, **kwargs):
            return self._recall_at_k(knn_labels, query_labels, not_lone_query_mask, label_counts, K)

        calculate.__name__ = f"calculate_recall_at_{K}"
        return calculate

    def requires_knn(self):
        return super().requires_knn() + ["mean_reciprocal_rank"] + [
            f"recall_at_{kv}" for kv in self.k_values
        ]

    def _recall_at_k(self, knn_labels, query_labels, not_lone_query_mask, label_counts, K):
        if K > knn_labels.shape[1]:
            raise ValueError(
                f"k_values contains K={K} but only {knn_labels.shape[1]} neighbours were retrieved"
            )
        knn_labels, query_labels = try_getting_not_lone_labels(
            knn_labels, query_labels, not_lone_query_mask
        )
        if knn_labels is None:
            return nan_accuracy(label_counts[0], self.return_per_class)
        same = self.label_comparison_fn(query_labels[:, None], knn_labels[:, :K])
        hit = same.reshape(same.shape[0], -1).any(dim=1).to(torch.float64)
        return maybe_get_avg_of_avgs(hit, query_labels, self.avg_of_avgs, self.return_per_class)

    def get_accuracy(self, query: Any, query_labels: Any, reference: Any = None, reference_labels: Any = None,
                     ref_includes_query: bool = False, include: Sequence[str] = (),
                     exclude: Sequence[str] = ()) -> dict:
        """PML's ``get_accuracy``, after checks that turn bad input into one clear error (PML
        itself fails deep inside with a reshape error on empty sets, a misleading "reference must
        start with query" on NaN, or silently ranks NaN / Inf embeddings in Euclidean mode).

        Args:
            query: (Nq, D) query embeddings.
            query_labels: (Nq,) class ids; (Nq, 1) is read as (Nq,). (Nq, L > 1) labels only with
                a custom ``label_comparison_fn`` (PML's default compares one id per sample).
            reference: (Nr, D) reference embeddings (None: the queries themselves).
            reference_labels: labels of ``reference``.
            ref_includes_query: whether the queries are part of ``reference`` (as in PML).
            include: metric names to compute only.
            exclude: metric names to skip.

        Returns:
            ``{metric name: value}``, with ``recall_at_K`` among them.

        Raises:
            ValueError: embeddings not 2-D, not floating point, empty, or with NaN/Inf; missing or
                mismatched labels, labels of shape (N, L > 1) or more dimensions with the default
                label comparison; query and reference dimensions that differ.
        """
        _check_embeddings(query, query_labels, "query")
        query_labels = self._labels_for_pml(query_labels, "query_labels")
        if reference is not None:
            _check_embeddings(reference, reference_labels, "reference")
            reference_labels = self._labels_for_pml(reference_labels, "reference_labels")
            if reference.shape[1] != query.shape[1]:
                raise ValueError(f"query has dimension {query.shape[1]} but reference has dimension "
                                 f"{reference.shape[1]}")
        if getattr(self, "_radius_unchecked", False):
            from .radius_health import check_radius

            self._radius_unchecked = False  # once per calculator: a warning, not a stream of them
            check_radius(query, self.c, what="queries", stacklevel=3)
        return super().get_accuracy(query, query_labels, reference, reference_labels,
                                    ref_includes_query, include=include, exclude=exclude)

    def _labels_for_pml(self, labels: Any, name: str) -> Any:
        """(N, 1) labels squeezed to (N,); other multi-column labels need a custom comparison."""
        shape = tuple(labels.shape) if hasattr(labels, "shape") else (len(labels),)
        if len(shape) == 2 and shape[1] == 1:
            return labels.reshape(-1)
        if len(shape) == 0 or (len(shape) > 1 and self.label_comparison_fn is EQUALITY):
            raise ValueError(f"{name} must be 1-D (N,) class ids (or (N, 1)), got shape {shape}; labels with "
                             "several columns need a custom label_comparison_fn")
        return labels

    def determine_k(self, bin_counts: Any, num_reference_embeddings: int, ref_includes_query: bool) -> int:
        available = num_reference_embeddings - int(ref_includes_query)
        wanted_recall = [
            kv for kv in self.k_values if f"recall_at_{kv}" in self.get_curr_metrics()
        ]
        if wanted_recall and max(wanted_recall) > available:
            raise ValueError(
                f"k_values contains K={max(wanted_recall)} but there are only {available} "
                "references to retrieve (query itself excluded)"
            )
        if not self._auto_k:
            return super().determine_k(bin_counts, num_reference_embeddings, ref_includes_query)
        need = max(wanted_recall) if wanted_recall else 1
        if set(self.get_curr_metrics()) & set(_R_METRICS):
            need = max(need, int(torch.max(bin_counts).item()) - int(ref_includes_query))
        return max(1, min(need, available))


def _check_embeddings(embeddings, labels, name: str) -> None:
    if not hasattr(embeddings, "shape") or len(embeddings.shape) != 2:
        raise ValueError(f"{name} must be a 2-D (N x D) array, got shape {getattr(embeddings, 'shape', None)}")
    if embeddings.shape[0] == 0:
        raise ValueError(f"{name} is empty (0 embeddings): nothing to evaluate")
    x = torch.as_tensor(embeddings)
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must hold floating-point embeddings, got {x.dtype}")
    if not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).any(dim=1).sum())
        raise ValueError(f"{name} contains NaN/Inf values in {bad} of {x.shape[0]} embeddings "
                         "(a diverged model or an empty batch upstream?)")
    if labels is None:
        raise ValueError(f"{name} labels are missing")
    if len(labels) != embeddings.shape[0]:
        raise ValueError(f"{name} has {embeddings.shape[0]} embeddings but {len(labels)} labels")
