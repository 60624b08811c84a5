"""Hyperbolic deep metric learning components for pytorch-metric-learning.

Light, always-imported parts live at the top level (math, distances, heads, losses, miners).
Evaluation (faiss, matplotlib), data (torchvision, PIL) and the training machinery are
subpackages: ``pml_hyperbolic.evaluation``, ``pml_hyperbolic.data``, ``pml_hyperbolic.training``.
"""
from . import poincare_ball
from .geometry import PoincareGeometry
from .distances import MixedGeometryDistance, PoincareDistance
from .manifold_tensors import accept_manifold_tensors, to_manifold_tensor, unwrap_ball_tensor
from .heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead, ToPoincare
from .losses import (
    HierarchicalLogRatioLoss,
    HierarchicalMarginLoss,
    HIERLoss,
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
    "PoincareGeometry",
    "HIERLoss",
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
    "unwrap_ball_tensor",
    "to_manifold_tensor",
    "accept_manifold_tensors",
]
