"""Hyperbolic deep metric learning components for pytorch-metric-learning.

The components live at the top level (math, geometry, distances, heads, losses, miners), imported
on first use. Evaluation (faiss, matplotlib), data (torchvision, PIL) and the training machinery
are subpackages: ``pml_hyperbolic.evaluation``, ``pml_hyperbolic.data``, ``pml_hyperbolic.training``.
"""
__version__ = "0.1.0"

# Public names → the module that defines them, imported on first access (see ``_lazy``): a
# light submodule such as ``pml_hyperbolic.training.cli`` can then be imported without torch.
_EXPORTS = {
    "poincare_ball": ".poincare_ball",
    "PoincareGeometry": ".geometry",
    "MixedGeometryDistance": ".distances",
    "PoincareDistance": ".distances",
    "PoincareSimilarity": ".distances",
    "accept_manifold_tensors": ".manifold_tensors",
    "to_manifold_tensor": ".manifold_tensors",
    "unwrap_ball_tensor": ".manifold_tensors",
    "HyperbolicEmbeddingHead": ".heads",
    "SphericalEmbeddingHead": ".heads",
    "ToPoincare": ".heads",
    "HierarchicalLogRatioLoss": ".losses",
    "HierarchicalMarginLoss": ".losses",
    "HIERLoss": ".losses",
    "RadialCalibrationLoss": ".losses",
    "DegradedCopyRadiusLoss": ".losses",
    "HyperbolicCrossBatchMemory": ".losses",
    "HypMixLoss": ".losses",
    "PairwiseCrossEntropyLoss": ".losses",
    "UncertaintyAdaptiveContrastiveLoss": ".losses",
    "UncertaintyAdaptiveTripletLoss": ".losses",
    "HardNegativeProbabilityMiner": ".miners",
    "HierarchicalPseudoLabeler": ".miners",
    "HierarchicalSimilarityMiner": ".miners",
    "MixedGeometryMiner": ".miners",
    "hyperbolic_uncertainty": ".uncertainty",
    "to_inner_product": ".search",
    "retrieval_uncertainty": ".evaluation",
}

__all__ = [
    "poincare_ball",
    "PoincareGeometry",
    "HIERLoss",
    "PoincareDistance",
    "PoincareSimilarity",
    "MixedGeometryDistance",
    "ToPoincare",
    "HyperbolicEmbeddingHead",
    "SphericalEmbeddingHead",
    "PairwiseCrossEntropyLoss",
    "HypMixLoss",
    "UncertaintyAdaptiveContrastiveLoss",
    "UncertaintyAdaptiveTripletLoss",
    "HierarchicalLogRatioLoss",
    "HierarchicalMarginLoss",
    "HyperbolicCrossBatchMemory",
    "RadialCalibrationLoss",
    "DegradedCopyRadiusLoss",
    "HardNegativeProbabilityMiner",
    "MixedGeometryMiner",
    "HierarchicalPseudoLabeler",
    "HierarchicalSimilarityMiner",
    "hyperbolic_uncertainty",
    "retrieval_uncertainty",
    "unwrap_ball_tensor",
    "to_manifold_tensor",
    "accept_manifold_tensors",
    "to_inner_product",
]

from ._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
