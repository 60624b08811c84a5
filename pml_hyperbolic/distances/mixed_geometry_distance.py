"""HypMix's mixed spherical + hyperbolic "distance" (Yue et al.) as a PML distance."""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Real

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import BaseDistance

from .. import poincare_ball as pb
from ..geometry import _UNSET, DEFAULT_CURVATURE, PoincareGeometry, _Unset, as_geometry, map_to_ball


#: Accepted range of the temperatures, the clip radius and λ (λ may also be 0): the logits
#: d/τ and λ·d stay finite in float32.
SCALAR_RANGE = (1e-12, 1e12)


def _positive(value, name):
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number > 0, got {type(value).__name__} {value!r}")
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    if not SCALAR_RANGE[0] <= v <= SCALAR_RANGE[1]:
        raise ValueError(f"{name} must lie in [{SCALAR_RANGE[0]:g}, {SCALAR_RANGE[1]:g}], got {value!r}")
    return v


# Cosine distances at most this many machine epsilons are recomputed from explicit differences
# (the Gram product's absolute error is a few ulps); above, the absolute error of the hyperbolic
# logit λβκ(√(x+e) − √x) ≤ λβκ e / (2√x) stays below ~2e-3 (λ = 8, c of one tenth, float32) and the
# gradient matches the general path's accuracy (a threshold of 64 ulps did not; 1024 leaves a margin).
_CLOSE_COS_DIST_ULPS = 1024
# More explicit work than this (elements of the (pairs, D) difference) -> general path.
_MAX_EXPLICIT_ELEMENTS = 1 << 22


def _geometry_of(c, clip_r):
    """``c`` as a geometry; ``clip_r`` (unset: the default) builds a new one, or (deprecated)
    re-clips a given ``PoincareGeometry`` with its curvature by reference."""
    if c is None:  # every mixed branch needs its own curvature
        raise TypeError("c must be a curvature or a PoincareGeometry (or a sequence of them), got None")
    if not isinstance(c, PoincareGeometry):
        return as_geometry(c) if clip_r is _UNSET else as_geometry(c, clip_r=clip_r)
    if clip_r is _UNSET:
        return c
    import warnings

    warnings.warn("MixedGeometryDistance/HypMixLoss(clip_r=...) together with a PoincareGeometry is deprecated and "
                  "will be an error in the next release: the geometry owns the clip radius (set it when building "
                  "the geometry)", DeprecationWarning, stacklevel=4)
    return PoincareGeometry._sharing(c, None if clip_r is None else "hard", clip_r)


class _CosineMix(torch.autograd.Function):
    r"""Elementwise :math:`M(x) = x/\tau_e + \sum_k \lambda_k \beta_k \operatorname{arsinh}(\kappa_k\sqrt x)`
    of the cosine distance matrix :math:`x = 1 - \cos`, with a closed-form backward.

    arsinh is evaluated as :math:`\log(\kappa\sqrt x + \sqrt{1 + \kappa^2 x})` (aten's ``asinh`` is
    a scalar libm call, much slower than these vectorised passes). :math:`x < 0` (rounding) counts
    as 0. The derivative :math:`\lambda_k\beta_k\kappa_k / (2\sqrt x\sqrt{1+\kappa_k^2 x})` is
    unbounded at :math:`x \to 0`; the gradient with respect to the embeddings is bounded (the
    :math:`1/\sqrt x` meets :math:`\partial x/\partial u = u - u'` of size :math:`\sqrt x`) provided
    x is accurate there, which the caller ensures (near-duplicates recomputed explicitly). At
    exactly :math:`x = 0` (the diagonal, exact duplicates) the hyperbolic part's gradient is 0.
    """

    @staticmethod
    def forward(ctx, x, lam, tau_e, kappas, betas):
        x = x.clamp_min(0.0)
        s = x.sqrt()
        out = x * (1.0 / tau_e)
        qs, arsinhs = [], []
        for k, (kappa, beta) in enumerate(zip(kappas, betas)):
            q = torch.add(1.0, x, alpha=kappa * kappa).sqrt_()  # sqrt(1 + κ²x)
            a = torch.add(q, s, alpha=kappa).log_()  # arsinh(κ√x)
            out.add_(a, alpha=float(lam[k]) * beta)
            qs.append(q)
            arsinhs.append(a if ctx.needs_input_grad[1] else None)
        ctx.save_for_backward(x, s, lam, *qs)
        ctx.arsinhs, ctx.tau_e, ctx.kappas, ctx.betas = arsinhs, tau_e, kappas, betas
        return out

    @staticmethod
    def backward(ctx, grad):
        x, s, lam, *qs = ctx.saved_tensors
        grad_x = grad_lam = None
        if ctx.needs_input_grad[0]:
            # Σ_k λ_k β_k κ_k / (2 q_k), then / √x where x > 0, else 0
            slope = None
            for k, q in enumerate(qs):
                term = q.reciprocal().mul_(0.5 * float(lam[k]) * ctx.betas[k] * ctx.kappas[k])
                slope = term if slope is None else slope.add_(term)
            slope = torch.where(x > 0, slope.div_(s.clamp_min(torch.finfo(s.dtype).tiny)), 0.0)
            grad_x = grad * slope.add_(1.0 / ctx.tau_e)
        if ctx.needs_input_grad[1]:
            grad_lam = torch.stack([(grad * a).sum() * beta for a, beta in zip(ctx.arsinhs, ctx.betas)])
            grad_lam = grad_lam.to(lam.dtype)
        return grad_x, grad_lam, None, None, None


class MixedGeometryDistance(BaseDistance):
    r"""One Euclidean head output seen on the sphere and in the ball(s) at once (HypMix, Eq. (12)).

    With :math:`u = f / \|f\|` (the normalised head output Wf):

    .. math::
        D_{mix}(f, f') = \frac{1 - \langle u, u' \rangle}{\tau_e}
            + \sum_k \lambda_k \frac{d_{c_k}(h_k(f), h_k(f'))}{\tau_h},
        \qquad h_k(f) = \mathrm{expmap}_0^{c_k}(\mathrm{clip}_r(u))

    i.e. :math:`z_e = \mathrm{normalize}(Wf)` and :math:`z_h = \mathrm{ToPoincare}(\mathrm{normalize}(Wf))`
    exactly as the authors' model does (the clip at their r > 1 is a no-op on unit vectors), each
    :math:`h_k` by the geometry's own map into the ball (:meth:`~pml_hyperbolic.geometry.PoincareGeometry.to_ball`). It is
    **not** inverted (smaller = more similar) and already divided by the temperatures, so a
    cross-entropy over :math:`-D_{mix}` with temperature 1 is the HypMix loss
    (:class:`~pml_hyperbolic.losses.HypMixLoss`); any other PML loss or miner can use it as well.
    :math:`1 - \cos` differs from the paper's :math:`-\cos` by a constant, which cancels in a softmax
    and makes :math:`D_{mix}(f, f) = 0`. Since every :math:`z_h` lies on one sphere of the ball,
    :math:`D_{mix}` is a monotone function of the cosine alone (noted in the papers README).

    **Fast path** (``compute_mat``, used whenever every row is non-zero, i.e. always for a real head):
    every :math:`h_k(f)` has the same Euclidean norm :math:`r_k = \tanh(\sqrt{c_k}\,t)/\sqrt{c_k}`
    (t = min(1, clip_r), capped by the ball projection; taken from the very map applied to a unit
    vector), so with :math:`x = 1 - \cos`: :math:`\|h_k - h_k'\|^2 = 2 r_k^2 x`, both conformal
    terms are :math:`a_k = 1 - c_k r_k^2`, and

    .. math:: d_{c_k} = \frac{2}{\sqrt{c_k}}\operatorname{arsinh}(\kappa_k \sqrt{x}), \qquad
              \kappa_k = \frac{\sqrt{2 c_k}\, r_k}{1 - c_k r_k^2}.

    One cosine matrix product forward and two backward (like ``SupConLoss``), plus a few elementwise
    passes, for any number of curvatures. When the query is the reference set the diagonal is set
    to exactly 0 (zero gradient). Cancellation: the product gives :math:`1 - \cos` with an absolute
    error of a few ulps (~1e-7 in float32), and :math:`\sqrt{x}` magnifies it near 0 (an exact
    duplicate would read :math:`d_c \approx 3\cdot10^{-4}` instead of 0). So pairs with
    :math:`x \le 1024\,\epsilon_{mach}` (angle below ~0.016 rad in float32) are recomputed as
    :math:`\|u - u'\|^2/2` from explicit differences: exact value, finite gradient (0 for exact
    duplicates); above that the hyperbolic logit's absolute error is below ~2e-3 (λ = 8) and
    shrinks like :math:`1/\sqrt{x}`. General path (per-curvature fused Poincaré kernels): a row of
    all zeros (norm ≤ 1e-12, which ``normalize`` leaves at the origin) or a (nearly) collapsed
    batch with more than 2^22 explicit-difference elements.

    Args:
        c: the geometry (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`, e.g. the head's, by
            reference: its curvature and clipping are used) or a curvature, or a sequence of them to
            mix (beyond the paper: its stated future work); each goes through
            :func:`~pml_hyperbolic.geometry.as_geometry`. Default
            :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE` (the paper's).
        lam: λ ≥ 0, a float or one per curvature. Paper: 3 (CUB), 8 (Cars, SOP); default 3.
        tau_e: spherical temperature, default 0.05 (paper; the authors' code default is 0.1).
        tau_h: hyperbolic temperature, default 0.2 (paper and code).
        learnable_lambda: make λ a parameter (λ = exp(ρ), so λ stays > 0; needs λ > 0). Beyond the
            paper (its Limitation section suggests it). Put the distance's (or the loss's)
            parameters in the optimiser.
        clip_r: the clip radius of the geometries built from curvatures (unset:
            :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`; None: no clipping). With a
            ``PoincareGeometry`` it is **deprecated** (a ``DeprecationWarning``; removed in the next
            release): that geometry's curvature is then used with this radius.

    Raises:
        TypeError: ``lam``, ``tau_e``, ``tau_h`` or ``clip_r`` is not a number; at call time,
            embeddings that are not a floating-point ``torch.Tensor``.
        ValueError: an invalid curvature, a ``lam`` that is neither 0 nor in ``SCALAR_RANGE``
            (1e-12 to 1e12), a ``tau`` or ``clip_r`` outside ``SCALAR_RANGE``; at call time,
            embeddings holding NaN/Inf.

    Design note: docs/design/distances.md
    """

    #: takes the Euclidean head output, not ball points (read by the hypll ManifoldTensor hook)
    takes_ball_points = False

    def __init__(self, c: float | PoincareGeometry | Sequence[float | PoincareGeometry] = DEFAULT_CURVATURE,
                 lam: float | Sequence[float] = 3.0, tau_e: float = 0.05, tau_h: float = 0.2,
                 learnable_lambda: bool = False, clip_r: float | None | _Unset = _UNSET, **kwargs):
        if kwargs.pop("is_inverted", False):
            raise ValueError("is_inverted must be False: the mixed distance grows with dissimilarity")
        kwargs.pop("normalize_embeddings", None)  # normalisation is part of the model here
        super().__init__(normalize_embeddings=False, is_inverted=False, **kwargs)
        cs = list(c) if isinstance(c, (list, tuple)) else [c]
        if len(cs) == 0:
            raise ValueError("c must hold at least one curvature")
        if clip_r is not _UNSET and clip_r is not None:
            clip_r = _positive(clip_r, "clip_r")
        # one geometry per curvature (a PoincareGeometry by reference), read at use; the closed-form
        # fast path needs Python floats, so a tensor curvature gets no gradient here
        self.geometries = [_geometry_of(ck, clip_r) for ck in cs]
        lams = list(lam) if isinstance(lam, (list, tuple)) else [lam] * len(cs)
        if len(lams) != len(cs):
            raise ValueError(f"lam must be a float or have one entry per curvature ({len(cs)}), got {len(lams)}")
        for lk in lams:
            if isinstance(lk, bool) or not isinstance(lk, Real):
                raise TypeError(f"lam must be a real number >= 0 (or one per curvature), got {lam!r}")
            lk = float(lk)
            if not (lk >= 0 and math.isfinite(lk)):
                raise ValueError(f"lam must be >= 0 and finite, got {lam!r}")
            if lk > SCALAR_RANGE[1] or 0 < lk < SCALAR_RANGE[0]:
                raise ValueError(f"lam must be 0 or lie in [{SCALAR_RANGE[0]:g}, {SCALAR_RANGE[1]:g}], got {lam!r}")
            if learnable_lambda and lk == 0:
                raise ValueError("lam must be > 0 when learnable_lambda=True (λ = exp(ρ))")
        self.tau_e = _positive(tau_e, "tau_e")
        self.tau_h = _positive(tau_h, "tau_h")
        lam_t = torch.tensor([float(lk) for lk in lams], dtype=torch.float32)
        if learnable_lambda:
            self.log_lam = torch.nn.Parameter(lam_t.log())
        else:
            self.log_lam = None
            self.register_buffer("fixed_lam", lam_t)

    @property
    def lam(self) -> torch.Tensor:
        """Current λ per curvature (1-D tensor; differentiable when learnable)."""
        return self.log_lam.exp() if self.log_lam is not None else self.fixed_lam

    @property
    def curvatures(self):
        """The current curvature magnitudes (floats)."""
        return [float(g.curvature(torch.float64).detach()) for g in self.geometries]

    @property
    def clip_r(self) -> float | None:
        """The clip radius of the first geometry (each geometry's own is used for its branch)."""
        return self.geometries[0].clip_r

    def __setstate__(self, state: dict) -> None:
        # distances pickled when they kept their curvature sources and clip radius themselves
        if "geometries" not in state and "_curvature_sources" in state:
            clip_r = state.pop("clip_r", None)
            state["geometries"] = [_geometry_of(ck, clip_r) for ck in state.pop("_curvature_sources")]
        super().__setstate__(state)

    def _views(self, emb):
        emb = emb.float() if emb.dtype in (torch.float16, torch.bfloat16) else emb
        u = F.normalize(emb, dim=-1, eps=1e-12)
        # each geometry's own overflow-safe map into the ball (clip, expmap0, project)
        balls = [map_to_ball(u, g.curvature(torch.float64, u.device), g.clip_r, g.clip) for g in self.geometries]
        return u, balls

    def _combine(self, cos_dist, hyp_dists, dtype):
        lam = self.lam.to(dtype)
        out = cos_dist / self.tau_e
        for k, d in enumerate(hyp_dists):
            out = out + lam[k] * d / self.tau_h
        return out

    def _radii(self, dtype, device):
        """Euclidean norm of h_k(u) for a unit vector u, per curvature, through ``_views`` itself."""
        _, balls = self._views(torch.ones(1, 1, dtype=dtype, device=device))
        return [float(torch.linalg.vector_norm(b)) for b in balls]

    def _unit_rows(self, emb):
        """(u, all rows had a norm > 1e-12, i.e. ``normalize`` put every row on the unit sphere)."""
        emb = emb.float() if emb.dtype in (torch.float16, torch.bfloat16) else emb
        norm = torch.linalg.vector_norm(emb, dim=-1, keepdim=True)
        return emb / norm.clamp_min(1e-12), bool((norm > 1e-12).all())

    def forward(self, query_emb: torch.Tensor, ref_emb: torch.Tensor | None = None):
        pb.check_tensor(query_emb, "query_emb")
        if ref_emb is not None:
            pb.check_tensor(ref_emb, "ref_emb")
        return super().forward(query_emb, ref_emb)

    def compute_mat(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        pb.check_tensor(query_emb, "query_emb")
        pb.check_tensor(ref_emb, "ref_emb")
        pb.check_finite(query_emb, "embeddings")
        if ref_emb is not query_emb:
            pb.check_finite(ref_emb, "ref_emb")
        # float32 at least throughout: an autocast (bf16/fp16) product would leave 1 − cos with
        # ~1e-3 absolute error, which √(1 − cos) turns into large errors for close pairs
        with torch.autocast(device_type=query_emb.device.type, enabled=False):
            return self._cosine_identity_mat(query_emb, ref_emb)

    def _cosine_identity_mat(self, query_emb, ref_emb):
        uq, unit_q = self._unit_rows(query_emb)
        same = ref_emb is query_emb
        ur, unit_r = (uq, unit_q) if same else self._unit_rows(ref_emb)
        if not (unit_q and unit_r):
            return self._general_mat(query_emb, ref_emb)
        x = 1 - uq @ ur.T  # cosine distance; = ‖u − u'‖²/2 on the unit sphere
        if same:
            x.diagonal().zero_()
        # Pairs the product cannot resolve (1 − cos within 1024 ulps of 0: near-duplicates) are
        # recomputed as ‖u − u'‖²/2 from explicit differences, exact in value and gradient.
        close = x <= _CLOSE_COS_DIST_ULPS * torch.finfo(x.dtype).eps
        if same:
            close.diagonal().fill_(False)
        if bool(close.any()):
            rows, cols = close.nonzero(as_tuple=True)
            if rows.numel() * uq.shape[1] > _MAX_EXPLICIT_ELEMENTS:
                return self._general_mat(query_emb, ref_emb)  # (nearly) collapsed batch
            diff = uq[rows] - ur[cols]
            x = x.index_put((rows, cols), 0.5 * torch.linalg.vecdot(diff, diff))
        kappas, betas = [], []
        for ck, rk in zip(self.curvatures, self._radii(uq.dtype, uq.device)):
            kappas.append(math.sqrt(2 * ck) * rk / (1 - ck * rk * rk))
            betas.append(2 / math.sqrt(ck) / self.tau_h)
        return _CosineMix.apply(x, self.lam.to(x.dtype), self.tau_e, kappas, betas)

    def _general_mat(self, query_emb, ref_emb):
        uq, hq = self._views(query_emb)
        if ref_emb is query_emb:
            ur, hr = uq, hq
        else:
            ur, hr = self._views(ref_emb)
        cos_dist = (1 - uq @ ur.T).clamp_min(0)
        hyp = [pb.pairwise_dist(q, r, ck) for q, r, ck in zip(hq, hr, self.curvatures)]
        return self._combine(cos_dist, hyp, uq.dtype)

    def pairwise_distance(self, query_emb: torch.Tensor, ref_emb: torch.Tensor):
        pb.check_tensor(query_emb, "query_emb")
        pb.check_tensor(ref_emb, "ref_emb")
        pb.check_finite(query_emb, "embeddings")  # a NaN loss is worse than an error
        pb.check_finite(ref_emb, "ref_emb")
        with torch.autocast(device_type=query_emb.device.type, enabled=False):
            return self._general_rowwise(query_emb, ref_emb)

    def _general_rowwise(self, query_emb, ref_emb):
        uq, hq = self._views(query_emb)
        ur, hr = self._views(ref_emb)
        cos_dist = (1 - (uq * ur).sum(-1)).clamp_min(0)
        hyp = [pb.dist(q, r, ck) for q, r, ck in zip(hq, hr, self.curvatures)]
        return self._combine(cos_dist, hyp, uq.dtype)

    def extra_repr(self) -> str:
        return (f"c={self.curvatures}, lam={[round(float(v), 6) for v in self.lam]}, tau_e={self.tau_e}, "
                f"tau_h={self.tau_h}, learnable_lambda={self.log_lam is not None}, clip_r={self.clip_r}")
