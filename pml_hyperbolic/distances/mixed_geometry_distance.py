"""HypMix's mixed spherical + hyperbolic "distance" (Yue et al.) as a PML distance."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from pytorch_metric_learning.distances import BaseDistance

from .. import poincare_ball as pb


def _positive(value, name):
    v = float(value)
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{name} must be > 0 and finite, got {value!r}")
    return v


class MixedGeometryDistance(BaseDistance):
    r"""One Euclidean head output seen on the sphere and in the ball(s) at once (HypMix, Eq. (12)).

    With :math:`u = f / \|f\|` (the normalised head output Wf):

    .. math::
        D_{mix}(f, f') = \frac{1 - \langle u, u' \rangle}{\tau_e}
            + \sum_k \lambda_k \frac{d_{c_k}(h_k(f), h_k(f'))}{\tau_h},
        \qquad h_k(f) = \mathrm{expmap}_0^{c_k}(\mathrm{clip}_r(u))

    i.e. :math:`z_e = \mathrm{normalize}(Wf)` and :math:`z_h = \mathrm{ToPoincare}(\mathrm{normalize}(Wf))`
    exactly as the authors' model does (the clip at r = 2.3 is a no-op on unit vectors). It is
    **not** inverted (smaller = more similar) and already divided by the temperatures, so a
    cross-entropy over :math:`-D_{mix}` with temperature 1 is the HypMix loss
    (:class:`~pml_hyperbolic.losses.HypMixLoss`); any other PML loss or miner can use it as well.
    :math:`1 - \cos` differs from the paper's :math:`-\cos` by a constant, which cancels in a softmax
    and makes :math:`D_{mix}(f, f) = 0`. Since every :math:`z_h` lies on one sphere of the ball,
    :math:`D_{mix}` is a monotone function of the cosine alone (noted in the papers README).

    Args:
        c: curvature (> 0) or a sequence of curvatures to mix (beyond the paper: its stated future
            work). Default 0.1 (paper).
        lam: λ ≥ 0, a float or one per curvature. Paper: 3 (CUB), 8 (Cars, SOP); default 3.
        tau_e: spherical temperature, default 0.05 (paper; the authors' code default is 0.1).
        tau_h: hyperbolic temperature, default 0.2 (paper and code).
        learnable_lambda: make λ a parameter (λ = exp(ρ), so λ stays > 0; needs λ > 0). Beyond the
            paper (its Limitation section suggests it). Put the distance's (or the loss's)
            parameters in the optimiser.
        clip_r: the head's clip radius applied before expmap0 (None: no clipping).
    """

    def __init__(self, c=0.1, lam=3.0, tau_e=0.05, tau_h=0.2, learnable_lambda=False, clip_r=2.3, **kwargs):
        if kwargs.pop("is_inverted", False):
            raise ValueError("is_inverted must be False: the mixed distance grows with dissimilarity")
        kwargs.pop("normalize_embeddings", None)  # normalisation is part of the model here
        super().__init__(normalize_embeddings=False, is_inverted=False, **kwargs)
        cs = list(c) if isinstance(c, (list, tuple)) else [c]
        if len(cs) == 0:
            raise ValueError("c must hold at least one curvature")
        for ck in cs:
            pb.as_curvature(ck)  # ValueError naming c
        self.curvatures = [float(ck) for ck in cs]
        lams = list(lam) if isinstance(lam, (list, tuple)) else [lam] * len(cs)
        if len(lams) != len(cs):
            raise ValueError(f"lam must be a float or have one entry per curvature ({len(cs)}), got {len(lams)}")
        for lk in lams:
            lk = float(lk)
            if not (lk >= 0 and math.isfinite(lk)):
                raise ValueError(f"lam must be >= 0 and finite, got {lam!r}")
            if learnable_lambda and lk == 0:
                raise ValueError("lam must be > 0 when learnable_lambda=True (λ = exp(ρ))")
        self.tau_e = _positive(tau_e, "tau_e")
        self.tau_h = _positive(tau_h, "tau_h")
        if clip_r is not None:
            clip_r = _positive(clip_r, "clip_r")
        self.clip_r = clip_r
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

    def _views(self, emb):
        emb = emb.float() if emb.dtype in (torch.float16, torch.bfloat16) else emb
        u = F.normalize(emb, dim=-1, eps=1e-12)
        tangent = u
        if self.clip_r is not None:
            norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp_min(torch.finfo(u.dtype).tiny)
            tangent = u * torch.clamp(self.clip_r / norm, max=1.0)
        balls = []
        for ck in self.curvatures:
            c_t = pb.as_curvature(ck, u.dtype, u.device)
            balls.append(pb.project(pb.expmap0(tangent, c_t), c_t))
        return u, balls

    def _combine(self, cos_dist, hyp_dists, dtype):
        lam = self.lam.to(dtype)
        out = cos_dist / self.tau_e
        for k, d in enumerate(hyp_dists):
            out = out + lam[k] * d / self.tau_h
        return out

    def compute_mat(self, query_emb, ref_emb):
        uq, hq = self._views(query_emb)
        if ref_emb is query_emb:
            ur, hr = uq, hq
        else:
            ur, hr = self._views(ref_emb)
        cos_dist = (1 - uq @ ur.T).clamp_min(0)
        hyp = [pb.pairwise_dist(q, r, ck) for q, r, ck in zip(hq, hr, self.curvatures)]
        return self._combine(cos_dist, hyp, uq.dtype)

    def pairwise_distance(self, query_emb, ref_emb):
        uq, hq = self._views(query_emb)
        ur, hr = self._views(ref_emb)
        cos_dist = (1 - (uq * ur).sum(-1)).clamp_min(0)
        hyp = [pb.dist(q, r, ck) for q, r, ck in zip(hq, hr, self.curvatures)]
        return self._combine(cos_dist, hyp, uq.dtype)

    def extra_repr(self) -> str:
        return (f"c={self.curvatures}, lam={[round(float(v), 6) for v in self.lam]}, tau_e={self.tau_e}, "
                f"tau_h={self.tau_h}, learnable_lambda={self.log_lam is not None}, clip_r={self.clip_r}")
