"""Evaluation and geometry analysis: Recall@K, exact hyperbolic kNN, δ-hyperbolicity,
uncertainty-vs-recall, Poincaré-disk plots."""
from .delta_hyperbolicity import gromov_delta, relative_delta, suggest_curvature
from .hyperbolic_index import HyperbolicIndex
from .hyperbolic_knn import HyperbolicKNN
from .poincare_disk_plot import plot_poincare_disk
from .recall_at_k import RecallAtKAccuracyCalculator
from .uncertainty_recall import plot_uncertainty_vs_recall, uncertainty_recall_table

__all__ = [
    "RecallAtKAccuracyCalculator",
    "HyperbolicKNN",
    "HyperbolicIndex",
    "gromov_delta",
    "relative_delta",
    "suggest_curvature",
    "uncertainty_recall_table",
    "plot_uncertainty_vs_recall",
    "plot_poincare_disk",
]
