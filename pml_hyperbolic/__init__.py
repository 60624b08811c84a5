"""Hyperbolic deep metric learning components for pytorch-metric-learning."""
from . import poincare_ball
from .distances import PoincareDistance
from .heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead, ToPoincare

__version__ = "0.1.0"

__all__ = [
    "poincare_ball",
    "PoincareDistance",
    "ToPoincare",
    "HyperbolicEmbeddingHead",
    "SphericalEmbeddingHead",
]
