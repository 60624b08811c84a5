"""Miners: geometry-aware hard negatives (HypMix) and hierarchical pseudo-labels (Yan et al.)."""
from .hard_negative_probability_miner import HardNegativeProbabilityMiner
from .hierarchical_pseudo_labeler import HierarchicalPseudoLabeler
from .hierarchical_similarity_miner import HierarchicalSimilarityMiner
from ..hierarchy_levels import first_shared_level, pairwise_first_shared_level
from .mixed_geometry_miner import MixedGeometryMiner

__all__ = [
    "HardNegativeProbabilityMiner",
    "MixedGeometryMiner",
    "HierarchicalPseudoLabeler",
    "HierarchicalSimilarityMiner",
    "first_shared_level",
    "pairwise_first_shared_level",
]
