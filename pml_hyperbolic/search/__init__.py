"""Hyperbolic retrieval at scale: the hyperboloid lift as an inner-product export
(:func:`to_inner_product`), faiss factory indexes, persistence and GPUs for
:class:`~pml_hyperbolic.evaluation.HyperbolicIndex`.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

from .lift import to_inner_product

__all__ = ["to_inner_product", "HyperbolicIndex"]


def __getattr__(name: str):
    # the index lives in pml_hyperbolic.evaluation (which imports this package): resolved on use
    if name == "HyperbolicIndex":
        from ..evaluation.hyperbolic_index import HyperbolicIndex

        return HyperbolicIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
