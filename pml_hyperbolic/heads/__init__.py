from .embedding_heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead
from .to_poincare import ToPoincare
from .whitening import whitening_head_init

__all__ = ["ToPoincare", "HyperbolicEmbeddingHead", "SphericalEmbeddingHead", "whitening_head_init"]
