from .poincare_distance import PoincareDistance
from .poincare_similarity import PoincareSimilarity
from .mixed_geometry_distance import MixedGeometryDistance

__all__ = ["PoincareDistance", "PoincareSimilarity", "MixedGeometryDistance"]
