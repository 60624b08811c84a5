"""Evaluation and geometry analysis: Recall@K, exact hyperbolic kNN, δ-hyperbolicity,
uncertainty-vs-recall, radius health, HCL's scene → object check, Poincaré-disk plots, retrieval grids.

Design note: docs/design/evaluation.md
"""
from __future__ import annotations

from .delta_hyperbolicity import gromov_delta, relative_delta, suggest_curvature
from .hyperbolic_index import HyperbolicIndex
from .hyperbolic_knn import HyperbolicKNN
from .poincare_disk_plot import plot_poincare_disk
from .radius_health import RadiusCollapseWarning, RadiusReport, check_radius, radius_collapse
from .recall_at_k import RecallAtKAccuracyCalculator
from .retrieval_confidence import retrieval_uncertainty
from .retrieval_grid import plot_retrieval_grid, plot_retrieval_grid_from_embeddings
from .scene_object_recall import scene_object_recall
from .uncertainty_recall import plot_uncertainty_vs_recall, uncertainty_failure_auroc, uncertainty_recall_table

__all__ = [
    "RecallAtKAccuracyCalculator",
    "HyperbolicKNN",
    "HyperbolicIndex",
    "gromov_delta",
    "relative_delta",
    "suggest_curvature",
    "uncertainty_recall_table",
    "uncertainty_failure_auroc",
    "retrieval_uncertainty",
    "scene_object_recall",
    "plot_uncertainty_vs_recall",
    "radius_collapse",
    "check_radius",
    "RadiusReport",
    "RadiusCollapseWarning",
    "plot_poincare_disk",
    "plot_retrieval_grid",
    "plot_retrieval_grid_from_embeddings",
]
