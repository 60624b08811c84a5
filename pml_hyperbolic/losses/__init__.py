"""Hyperbolic metric-learning losses as PML ``BaseMetricLossFunction`` subclasses."""
from .cross_batch_memory import HyperbolicCrossBatchMemory
from .degraded_copy_radius_loss import DegradedCopyRadiusLoss
from .hierarchical_log_ratio_loss import HierarchicalLogRatioLoss
from .hierarchical_margin_loss import HierarchicalMarginLoss
from .hier_loss import HIERLoss
from .hyp_mix_loss import HypMixLoss
from .ordered_multiple_losses import OrderedMultipleLosses
from .pairwise_cross_entropy_loss import PairwiseCrossEntropyLoss
from .parent_label_loss import ParentLabelLoss, class_parents
from .radial_calibration_loss import RadialCalibrationLoss
from .uncertainty_adaptive_contrastive_loss import UncertaintyAdaptiveContrastiveLoss
from .uncertainty_adaptive_triplet_loss import UncertaintyAdaptiveTripletLoss

__all__ = [
    "PairwiseCrossEntropyLoss",
    "HypMixLoss",
    "UncertaintyAdaptiveContrastiveLoss",
    "UncertaintyAdaptiveTripletLoss",
    "HierarchicalLogRatioLoss",
    "HierarchicalMarginLoss",
    "HyperbolicCrossBatchMemory",
    "HIERLoss",
    "RadialCalibrationLoss",
    "DegradedCopyRadiusLoss",
    "OrderedMultipleLosses",
    "ParentLabelLoss",
    "class_parents",
]
