"""Argument checks shared across the package (private, torch-free): each returns the checked value
or raises one error naming the argument."""
from __future__ import annotations

import math
import numbers

import numpy as np

__all__ = ["check_positive", "check_nonnegative", "check_bool", "check_int"]


def _reject_non_numbers(value, name: str, what: str) -> None:
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise ValueError(f"{name} must be {what}, got {value!r}")


#: hyperparameters outside [_TINY, _HUGE] overflow float32 once divided or multiplied by a distance
#: (the bounds the curvature and the mixed-geometry temperatures use too)
_TINY, _HUGE = 1e-12, 1e12


def check_positive(value: float, name: str) -> float:
    """``value`` as a float in [1e-12, 1e12]; ValueError naming ``name`` otherwise (bool and str
    included: they are not numbers here)."""
    _reject_non_numbers(value, name, "a positive number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a positive number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    if not (_TINY <= v <= _HUGE):
        raise ValueError(f"{name} must lie in [{_TINY:g}, {_HUGE:g}] (beyond, float32 arithmetic "
                         f"overflows), got {value!r}")
    return v


def check_nonnegative(value: float, name: str) -> float:
    """``value`` as a float in [0, 1e12]; ValueError naming ``name`` otherwise."""
    _reject_non_numbers(value, name, "a non-negative number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a non-negative number, got {value!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be >= 0 and finite, got {value!r}")
    if v > _HUGE:
        raise ValueError(f"{name} must be <= {_HUGE:g} (beyond, float32 arithmetic overflows), got {value!r}")
    return v


def check_bool(value, name: str) -> bool:
    """``value`` if it is a bool (numpy's included); TypeError naming ``name`` otherwise."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_int(value, name: str, minimum: int = 1, maximum: int = 2 ** 63 - 1) -> int:
    """``value`` as an int in [``minimum``, ``maximum``] (an integral float such as 8.0 is read as 8).

    Raises:
        TypeError: a bool, str, non-number, or a float that is not an exact integer (beyond 2**53
            floats are not).
        ValueError: outside [``minimum``, ``maximum``].
    """
    if isinstance(value, (bool, str, bytes)) or not isinstance(value, numbers.Number):
        raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if not isinstance(value, numbers.Integral):
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
        if not (math.isfinite(f) and f.is_integer() and abs(f) <= 2 ** 53):
            raise TypeError(f"{name} must be an integer >= {minimum}, got {value!r}")
    v = int(value)
    if v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if v > maximum:
        raise ValueError(f"{name} must be an integer <= {maximum}, got {value!r}")
    return v
