"""PML ``knn_func`` returning Poincaré-distance neighbours (see :mod:`.hyperbolic_index`)."""
from __future__ import annotations

from typing import Any

import torch

from ..geometry import DEFAULT_CURVATURE, PoincareGeometry, as_geometry
from .hyperbolic_index import HyperbolicIndex


class HyperbolicKNN:
    r"""Exact k-NN under the Poincaré distance :math:`d_c`, with PML's ``knn_func`` interface.

    ``knn(query, k, reference=None, ref_includes_query=False) -> (distances, indices)``, both
    ``len(query) × k``, ascending distance (ties: smaller reference index first), on the query's
    device; float64 distances for float64 input (float32 otherwise). Inputs are projected with the
    boundary margin of their own dtype, as :class:`~pml_hyperbolic.distances.PoincareDistance`
    does, so the neighbours are those of a float64 brute force with it. With
    ``ref_includes_query=True`` (PML's convention: ``reference[:len(query)]`` is the query) query i
    never gets reference i as a neighbour. Plug into PML with
    ``AccuracyCalculator(knn_func=HyperbolicKNN(c=geometry))``.

    Design note: docs/design/knn-index.md

    Args:
        c: the geometry (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`, by reference) or a
            curvature magnitude (float, tensor, hypll object) given to
            :func:`~pml_hyperbolic.geometry.as_geometry`; its curvature is read at every search.
            Default :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`.
        **index_kwargs: passed to :class:`HyperbolicIndex` (``factory="HNSW32"``, ``"IVF4096,Flat"``,
            ``nprobe``... for an approximate index; ``batch_size``, ``rtol``, ``margin``,
            ``use_gpu``...).

    Raises:
        ValueError: a bad ``c`` or index argument, naming it (checked here, not at the first search).
        TypeError: an unknown index argument.
    """

    def __init__(self, c: float | torch.Tensor | object = DEFAULT_CURVATURE, **index_kwargs: Any):
        self.index_kwargs = dict(index_kwargs)
        # build one index now so that bad arguments fail here (as the index reports them), not at the
        # first evaluation
        HyperbolicIndex(c=c, **self.index_kwargs)
        self.geometry: PoincareGeometry = as_geometry(c)  # a shared (learnable) one is read at every search

    def __setstate__(self, state: dict) -> None:
        # objects pickled when the curvature source was kept as given
        if "geometry" not in state:
            state["geometry"] = as_geometry(state.pop("_c"))
        self.__dict__.update(state)

    @property
    def c(self) -> float:
        """The current curvature magnitude (read from the geometry / tensor given at construction)."""
        return float(self.geometry.curvature(torch.float64).detach())

    def __call__(self, query: torch.Tensor, k: int, reference: torch.Tensor | None = None,
                 ref_includes_query: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if reference is None:
            reference = query
            ref_includes_query = True if ref_includes_query is None else ref_includes_query
        if query.dim() != 2 or reference.dim() != 2:
            raise ValueError("query and reference must be 2-D (N x D)")
        if query.shape[1] != reference.shape[1]:
            raise ValueError(
                f"query has dimension {query.shape[1]} but reference has dimension {reference.shape[1]}"
            )
        if query.shape[0] == 0 or reference.shape[0] == 0:
            raise ValueError("query and reference must be non-empty")
        index = HyperbolicIndex(c=self.c, **self.index_kwargs)
        index.add(reference)
        query_ids = None
        if ref_includes_query:
            if query.shape[0] > reference.shape[0]:
                raise ValueError("ref_includes_query=True needs len(query) <= len(reference)")
            query_ids = torch.arange(query.shape[0])
        return index.search(query, k, query_ids=query_ids)
