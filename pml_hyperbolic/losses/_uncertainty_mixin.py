"""Shared construction of the Hyp-UML uncertainty factor log(U_i / max_B U + 1).

The uncertainty reads the curvature and the clip radius from one
:class:`~pml_hyperbolic.geometry.PoincareGeometry` (the loss's ``c``, else its distance's geometry):
the loss keeps no clip radius of its own. Design note: docs/design/geometry.md
"""
from __future__ import annotations

import warnings

import torch

from ..geometry import _UNSET, PoincareGeometry, as_geometry, default_geometry
from ..uncertainty import _check_mode, hyperbolic_uncertainty, uncertainty_ratio_log
from ._common import check_bool, check_positive

#: The deprecation text of the losses' former ``clip_r=`` keyword.
CLIP_R_DEPRECATED = ("clip_r= of the uncertainty-adaptive losses is deprecated and will be removed in the next "
                     "release: the clip radius belongs to the geometry. Pass c=PoincareGeometry(..., clip_r=r) "
                     "(the head's geometry) instead.")


class UncertaintyFactorMixin:
    def _init_uncertainty(self, mode, c, clip_r, detach_uncertainty):
        self.uncertainty_mode = _check_mode(mode)
        if c is not None:
            geometry = as_geometry(c)  # ValueError / TypeError naming c
            if isinstance(c, torch.nn.Module):
                self.uncertainty_c = c  # registered by reference (the state dict's keys)
        else:
            # the distance's geometry (a PoincareDistance's), else the package's defaults
            geometry = getattr(self.distance, "geometry", None)
            geometry = geometry if isinstance(geometry, PoincareGeometry) else default_geometry()
        if clip_r is not _UNSET:
            warnings.warn(CLIP_R_DEPRECATED, DeprecationWarning, stacklevel=3)
            if clip_r is not None:
                # the former behaviour: U's own radius, the curvature still read from the geometry
                geometry = PoincareGeometry._sharing(geometry, "hard", check_positive(clip_r, "clip_r"))
        self.__dict__["_uncertainty_geometry"] = geometry  # held, not registered: the state dict keeps its keys
        self.detach_uncertainty = check_bool(detach_uncertainty, "detach_uncertainty")

    @property
    def uncertainty_geometry(self) -> PoincareGeometry:
        """The geometry U is computed on (its curvature and clip radius are read at every call)."""
        return self.__dict__["_uncertainty_geometry"]

    @property
    def clip_r(self) -> float | None:
        """The clip radius U uses: the geometry's (read only; set it on the geometry)."""
        return self.uncertainty_geometry.clip_r

    def __setstate__(self, state: dict) -> None:
        # losses pickled when they kept their own clip radius and curvature source
        if "_uncertainty_geometry" not in state:
            source = state.get("uncertainty_c", state.get("_modules", {}).get("uncertainty_c"))
            distance = state.get("_modules", {}).get("distance")
            geometry = as_geometry(source) if source is not None else getattr(distance, "geometry", None)
            geometry = geometry if isinstance(geometry, PoincareGeometry) else default_geometry()
            clip_r = state.pop("clip_r", None)
            if clip_r is not None and clip_r != geometry.clip_r:
                geometry = PoincareGeometry._sharing(geometry, "hard", clip_r)
            state["_uncertainty_geometry"] = geometry
        super().__setstate__(state)

    def uncertainty_factor(self, embeddings: torch.Tensor):
        """(B,) log(U_i / max_B U + 1) (guarded; see ``uncertainty_ratio_log``)."""
        with warnings.catch_warnings():
            # the literal-mode warning is re-issued below once per call with the loss's context
            warnings.simplefilter("ignore", RuntimeWarning)
            u = hyperbolic_uncertainty(embeddings, c=self.uncertainty_geometry, mode=self.uncertainty_mode,
                                       detach=self.detach_uncertainty)
        if self.uncertainty_mode == "literal" and bool((u <= 0).any()):
            warnings.warn(f"{type(self).__name__}(mode='literal'): 1 - D(x, 0) <= 0 for some embeddings; "
                          "log(U/max U + 1) is guarded (clamped), the result is not meaningful there",
                          RuntimeWarning, stacklevel=3)
        return uncertainty_ratio_log(u)
