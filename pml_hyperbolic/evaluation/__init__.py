"""Evaluation and geometry analysis: Recall@K, exact hyperbolic kNN, δ-hyperbolicity,
uncertainty-vs-recall, Poincaré-disk plots."""
from .hyperbolic_index import HyperbolicIndex
from .hyperbolic_knn import HyperbolicKNN
from .recall_at_k import RecallAtKAccuracyCalculator

__all__ = [
    "RecallAtKAccuracyCalculator",
    "HyperbolicKNN",
    "HyperbolicIndex",
]
