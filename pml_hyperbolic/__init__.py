"""Hyperbolic deep metric learning components for pytorch-metric-learning.

Light, always-imported parts live at the top level (math, distances, heads, losses, miners).
Evaluation (faiss, matplotlib), data (torchvision, PIL) and the training machinery are
subpackages: ``pml_hyperbolic.evaluation``, ``pml_hyperbolic.data``, ``pml_hyperbolic.training``.
"""
from . import poincare_ball
from .distances import MixedGeometryDistance, PoincareDistance
from .heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead, ToPoincare
from .losses import (
    HierarchicalLogRatioLoss,
    HierarchicalMarginLoss,
    HyperbolicCrossBatchMemory,
    HypMixLoss,
    PairwiseCrossEntropyLoss,
    UncertaintyAdaptiveContrastiveLoss,
    UncertaintyAdaptiveTripletLoss,
)
from .miners import (
    HardNegativeProbabilityMiner,
    HierarchicalPseudoLabeler,
    HierarchicalSimilarityMiner,
    MixedGeometryMiner,
)
from .uncertainty import hyperbolic_uncertainty

__version__ = "0.1.0"

__all__ = [
    "poincare_ball",
    "PoincareDistance",
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
    "HardNegativeProbabilityMiner",
    "MixedGeometryMiner",
    "HierarchicalPseudoLabeler",
    "HierarchicalSimilarityMiner",
    "hyperbolic_uncertainty",
]
