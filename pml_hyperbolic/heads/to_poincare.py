"""Map Euclidean features into the Poincaré ball."""
from __future__ import annotations

import torch
from torch import nn

from .. import poincare_ball as pb


class ToPoincare(nn.Module):
    r"""Feature clipping, then the exponential map at the origin, then projection:

    .. math:: x \mapsto \operatorname{proj}\Big(\exp_0^c\big(x\cdot\min(1, r/\|x\|)\big)\Big)

    The clipping (Guo et al., "Clipped hyperbolic classifiers", CVPR'22) bounds the Euclidean
    norm by ``clip_r`` so that embeddings stay away from the boundary where gradients vanish.

    Args:
        c: curvature magnitude (float, tensor or hypll object; see :mod:`pml_hyperbolic.poincare_ball`).
        clip_r: clipping radius; ``None`` disables clipping. ``clip_r <= 0`` is an error (one public
            implementation treats 0 as "off" but actually maps every feature to the origin).
        learnable_c: make c an ``nn.Parameter`` (stored as log c so it stays positive).
    """

    def __init__(self, c=0.1, clip_r: float | None = 2.3, learnable_c: bool = False):
        super().__init__()
        if clip_r is not None and not (float(clip_r) > 0.0):
            raise ValueError(f"clip_r must be > 0 or None (no clipping), got {clip_r}")
        self.clip_r = None if clip_r is None else float(clip_r)
        c_value = pb.as_curvature(c)
        if learnable_c:
            self.log_c = nn.Parameter(c_value.detach().clone().log())
            self._c = None
        else:
            self.log_c = None
            self._c = c
            if isinstance(c, nn.Module):
                self.curvature_module = c

    @property
    def c(self) -> torch.Tensor:
        """Current curvature magnitude (a 0-d tensor; differentiable when learnable)."""
        return self.log_c.exp() if self.log_c is not None else pb.as_curvature(self._c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        if self.clip_r is not None:
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
            x = x * torch.clamp(self.clip_r / norm, max=1.0)
        c = self.c.to(x.dtype) if self.log_c is not None else pb.as_curvature(self._c, x.dtype, x.device)
        return pb.project(pb.expmap0(x, c), c)

    def extra_repr(self) -> str:
        return f"c={float(self.c.detach()):.6g}, clip_r={self.clip_r}, learnable_c={self.log_c is not None}"
