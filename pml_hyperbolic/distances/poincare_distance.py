"""Geodesic distance of the Poincaré ball as a PML distance."""
from __future__ import annotations

import torch
from pytorch_metric_learning.distances import BaseDistance

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CURVATURE, PoincareGeometry, as_geometry
from ..manifold_tensors import unwrap_ball_tensor


class PoincareDistance(BaseDistance):
    r"""Geodesic distance on the Poincaré ball of curvature :math:`-c`, for PML losses and miners
    (those that accept a non-cosine distance; docs/design/distances.md lists which).

    .. math:: d_c(x, y) = \frac{2}{\sqrt{c}}\operatorname{artanh}\big(\sqrt{c}\,\|{-x}\oplus_c y\|\big)

    (computed in the equivalent arsinh form of :func:`pml_hyperbolic.poincare_ball.dist`).

    Args:
        c: the geometry: a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (shared by reference
            with the head), or a curvature magnitude (> 0) turned into one by
            :func:`~pml_hyperbolic.geometry.as_geometry`: a float, a 0-d tensor (e.g. an
            ``nn.Parameter``; gradients reach it), or a hypll ``Curvature``/``PoincareBall``. Default
            :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`, as the heads, losses and miners. hypll's ``Curvature(1.0)`` is c = softplus(1) ≈
            1.313, not 1: see :mod:`pml_hyperbolic.poincare_ball`.
        normalize_embeddings: **False** by default, unlike PML's ``BaseDistance``. L2-normalising
            puts every point at Euclidean norm 1, i.e. on (c = 1) or outside (c > 1) the ball's
            boundary, where all distances are infinite or meaningless. Leave it off for ball points.
        project: project inputs into the open ball first (norm ≤ (1 − ε)/√c, see
            :func:`~pml_hyperbolic.poincare_ball.project`). Points on or outside the boundary are
            thus moved just inside rather than producing Inf/NaN.
        check_finite: raise ``ValueError`` if the embeddings hold NaN/Inf (costs one reduction).

    Raises:
        ValueError: ``is_inverted=True``, or an invalid ``c`` (see
            :func:`~pml_hyperbolic.geometry.as_geometry`). At call time: embeddings holding
            NaN/Inf (with ``check_finite``) or on the meta device.
        TypeError: at call time, embeddings that are not a ``torch.Tensor`` (or ``ManifoldTensor``)
            or not floating point (integer, boolean and complex tensors are not cast silently).

    The curvature is read in float64 for every input dtype (the kernels form the c-dependent terms
    1 − c‖x‖² in float64), so a float ``c`` is never rounded to float32 on the way.

    ``is_inverted`` is False: smaller means more similar, like ``LpDistance``. Under autocast the
    distance is computed and returned in float32.

    hypll: ``forward``, ``compute_mat`` and ``pairwise_distance`` also take a hypll ``ManifoldTensor``
    on a Poincaré ball (points along the last dimension); its curvature must equal this distance's
    ``c`` (see :func:`pml_hyperbolic.manifold_tensors.unwrap_ball_tensor`).

    Design note: docs/design/distances.md
    """

    def __init__(self, c: float | torch.Tensor | torch.nn.Module = DEFAULT_CURVATURE,
                 normalize_embeddings: bool = False, project: bool = True, check_finite: bool = True,
                 **kwargs):
        if kwargs.pop("is_inverted", False):
            raise ValueError("is_inverted must be False: a Poincaré distance grows with dissimilarity")
        super().__init__(normalize_embeddings=normalize_embeddings, is_inverted=False, **kwargs)
        geometry = as_geometry(c)  # validates now: a bad c fails at construction, naming c
        if isinstance(c, torch.nn.Module):
            self.curvature_module = c  # registers a hypll Curvature/PoincareBall's parameters
            self._modules["_c"] = c  # the state dict's keys of earlier versions
        elif isinstance(c, torch.nn.Parameter):
            self.c_param = c
        # held outside the module tree: registered (above) only where the caller gave a module or a
        # parameter, so the state dict keeps its keys
        self.__dict__["_geometry"] = geometry
        self.use_projection = project
        self.check_finite = check_finite

    @property
    def geometry(self) -> PoincareGeometry:
        """The geometry in use (the object passed as ``c``, or the one built from it)."""
        return self._geometry

    @property
    def _c(self) -> PoincareGeometry:
        # the name older code and pickles used for the curvature source
        return self._geometry

    @property
    def c(self) -> torch.Tensor:
        """The current curvature magnitude as a 0-d tensor (evaluates hypll's constraint)."""
        return self._geometry.curvature()

    def __setstate__(self, state: dict) -> None:
        # modules pickled before the geometry was held: rebuild it from the stored curvature source
        if "_geometry" not in state:
            source = state.pop("_c", None)
            state["_geometry"] = as_geometry(state["_modules"].get("_c") if source is None else source)
        super().__setstate__(state)

    def _unwrap(self, emb, name: str = "embeddings"):
        emb = unwrap_ball_tensor(emb, self._geometry, type(self).__name__)
        return emb if emb is None else pb.check_tensor(emb, name)

    def forward(self, query_emb: torch.Tensor, ref_emb: torch.Tensor | None = None):
        return super().forward(self._unwrap(query_emb, "query_emb"), self._unwrap(ref_emb, "ref_emb"))

    def _prepare(self, emb: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        if self.check_finite:
            pb.check_finite(emb, "embeddings")
        return pb.project(emb, c) if self.use_projection else emb

    def _curvature_for(self, emb: torch.Tensor) -> torch.Tensor:
        # float64 (the kernels' scalar dtype) whatever the embeddings' dtype: c is not rounded
        return self._geometry.curvature(pb._wide_dtype(emb), emb.device)

    def compute_mat(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        query_emb, ref_emb = self._unwrap(query_emb, "query_emb"), self._unwrap(ref_emb, "ref_emb")
        c = self._curvature_for(query_emb)
        query = self._prepare(query_emb, c)
        ref = query if ref_emb is query_emb else self._prepare(ref_emb, c)
        return pb.pairwise_dist(query, ref, c)

    def pairwise_distance(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        query_emb, ref_emb = self._unwrap(query_emb, "query_emb"), self._unwrap(ref_emb, "ref_emb")
        c = self._curvature_for(query_emb)
        return pb.dist(self._prepare(query_emb, c), self._prepare(ref_emb, c), c)

    def extra_repr(self) -> str:
        return f"c={float(self.c):.6g}, project={self.use_projection}"
