from .embedding_heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead
from .to_poincare import ToPoincare

__all__ = ["ToPoincare", "HyperbolicEmbeddingHead", "SphericalEmbeddingHead"]
