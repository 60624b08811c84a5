"""Shared construction of the Hyp-UML uncertainty factor log(U_i / max_B U + 1)."""
from __future__ import annotations

import warnings

import torch

from .. import poincare_ball as pb
from ..uncertainty import _check_mode, hyperbolic_uncertainty, uncertainty_ratio_log
from ._common import check_bool, check_positive


class UncertaintyFactorMixin:
    def _init_uncertainty(self, mode, c, clip_r, detach_uncertainty):
        self.uncertainty_mode = _check_mode(mode)
        if c is not None:
            pb.as_curvature(c)  # ValueError naming c; a PoincareGeometry is kept by reference
        self.uncertainty_c = c
        self.clip_r = None if clip_r is None else check_positive(clip_r, "clip_r")
        self.detach_uncertainty = check_bool(detach_uncertainty, "detach_uncertainty")

    def _curvature(self):
        if self.uncertainty_c is not None:
            return self.uncertainty_c
        c = getattr(self.distance, "c", None)
        if c is None:
            return 0.1
        return c.detach() if isinstance(c, torch.Tensor) else c

    def uncertainty_factor(self, embeddings: torch.Tensor):
        """(B,) log(U_i / max_B U + 1) (guarded; see ``uncertainty_ratio_log``)."""
        with warnings.catch_warnings():
            # the literal-mode warning is re-issued below once per call with the loss's context
            warnings.simplefilter("ignore", RuntimeWarning)
            u = hyperbolic_uncertainty(embeddings, c=self._curvature(), mode=self.uncertainty_mode,
                                       clip_r=self.clip_r, detach=self.detach_uncertainty)
        if self.uncertainty_mode == "literal" and bool((u <= 0).any()):
            warnings.warn(f"{type(self).__name__}(mode='literal'): 1 - D(x, 0) <= 0 for some embeddings; "
                          "log(U/max U + 1) is guarded (clamped), the result is not meaningful there",
                          RuntimeWarning, stacklevel=3)
        return uncertainty_ratio_log(u)
