from .poincare_distance import PoincareDistance

__all__ = ["PoincareDistance"]
