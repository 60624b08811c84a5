"""The recipes' optional radius terms: radial calibration and degraded copies (``--radial-calibration``,
``--degraded-copies``), added beside whatever metric loss a recipe builds.

Design note: docs/design/training.md
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple, Type

from .config import ConfigError


def check_radius_terms(args: Any, geometry: Any) -> None:
    """One clear error when a radius term cannot act: it needs a hyperbolic head whose radius is learned.

    Args:
        args: the recipe's parsed arguments (``radial_calibration``, ``degraded_copies``, ``head_radius``).
        geometry: the run's :class:`~pml_hyperbolic.geometry.PoincareGeometry`, or None (not hyperbolic).

    Raises:
        ConfigError: a term is requested without a hyperbolic head or with ``--head-radius`` other
            than ``learned``.
    """
    wanted = [flag for flag, value in (("--radial-calibration", getattr(args, "radial_calibration", 0.0)),
                                       ("--degraded-copies", getattr(args, "degraded_copies", 0.0))) if value]
    if not wanted:
        return
    if geometry is None:
        raise ConfigError(f"{' and '.join(wanted)} need a hyperbolic head (the radius is what they train)")
    if getattr(args, "head_radius", "learned") != "learned":
        raise ConfigError(f"{' and '.join(wanted)} need --head-radius learned: with the papers' head every "
                          "embedding sits at the clip radius, so there is no radius to train (with --head-radius norm, "
                          "pass --radial-calibration 0 --degraded-copies 0)")


def add_radius_terms(args: Any, geometry: Any, loss_funcs: Dict) -> Tuple[Dict, Optional[Type], Dict]:
    """``(loss_funcs, trainer_class or None, trainer_kwargs)`` with the requested terms added:

    * ``--radial-calibration W`` > 0: the metric loss becomes ``MultipleLosses([metric,
      RadialCalibrationLoss], weights=[1, W])``;
    * ``--degraded-copies F`` > 0: a ``degraded_copy_loss`` (:class:`DegradedCopyRadiusLoss`, margin
      ``--degraded-copy-margin``) and :class:`DegradedCopyTrainer` with ``copy_fraction=F``.

    Args:
        args: the recipe's parsed arguments.
        geometry: the run's geometry, or None (not hyperbolic).
        loss_funcs: the recipe's loss functions (``metric_loss`` at least); not modified.

    Raises:
        ConfigError: see :func:`check_radius_terms`.
    """
    check_radius_terms(args, geometry)
    loss_funcs = dict(loss_funcs)
    calibration = float(getattr(args, "radial_calibration", 0.0) or 0.0)
    copies = float(getattr(args, "degraded_copies", 0.0) or 0.0)
    if calibration > 0:
        from pytorch_metric_learning.losses import MultipleLosses

        from ..losses import RadialCalibrationLoss

        loss_funcs["metric_loss"] = MultipleLosses([loss_funcs["metric_loss"], RadialCalibrationLoss(c=geometry)],
                                                   weights=[1.0, calibration])
    if copies <= 0:
        return loss_funcs, None, {}
    from ..losses import DegradedCopyRadiusLoss
    from .degraded_copy_trainer import DEGRADED_COPY_LOSS, DegradedCopyTrainer

    loss_funcs[DEGRADED_COPY_LOSS] = DegradedCopyRadiusLoss(c=geometry, margin=args.degraded_copy_margin)
    return loss_funcs, DegradedCopyTrainer, {"copy_fraction": copies}
