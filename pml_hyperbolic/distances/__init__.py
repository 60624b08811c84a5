from .poincare_distance import PoincareDistance
from .mixed_geometry_distance import MixedGeometryDistance

__all__ = ["PoincareDistance", "MixedGeometryDistance"]
