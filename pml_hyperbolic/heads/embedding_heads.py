"""Embedding heads: a Linear layer followed by the ball map (Hyp-) or L2 normalisation (Sph-).

Design note: docs/design/heads.md
"""
from __future__ import annotations

import math
from numbers import Integral, Real

import torch
from torch import Tensor, nn

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CLIP_R, DEFAULT_CURVATURE, PoincareGeometry
from ..manifold_tensors import to_manifold_tensor
from .to_poincare import _UNSET, ToPoincare, _Unset


def _orthogonal_linear(in_features: int, out_features: int) -> nn.Linear:
    # (Semi-)orthogonal weights and zero bias, as in the Hyp-ViT head.
    linear = nn.Linear(in_features, out_features)
    nn.init.orthogonal_(linear.weight)
    nn.init.zeros_(linear.bias)
    return linear


RADIUS_MODES = ("learned", "norm")


def _check_width(value, name: str) -> int:
    """``value`` if it is an int >= 1 (not a bool); TypeError/ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _autocast_on(x: torch.Tensor) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except TypeError:  # torch < 2.4 takes no device type
        return torch.is_autocast_enabled()


def _check_features(x, linear: nn.Linear, head: str) -> torch.Tensor:
    """One clear error for input a head's ``Linear`` cannot take (instead of a torch traceback)."""
    x = pb.check_tensor(x, f"{head} input")
    if x.ndim < 1 or x.shape[-1] != linear.in_features:
        raise ValueError(f"{head} expects input of shape (..., {linear.in_features}) (in_features), "
                         f"got {tuple(x.shape)}")
    if x.dtype != linear.weight.dtype and not _autocast_on(x):
        raise TypeError(f"{head} has dtype {linear.weight.dtype}, got input of dtype {x.dtype}: "
                        f"cast one of them (e.g. head.to({x.dtype}) or x.to({linear.weight.dtype}))")
    return x


class RadialConfidence(nn.Module):
    r"""The learned tangent norm of the polar head: :math:`\rho(f) = \rho_{max}\,\sigma(g(\hat f))`.

    :math:`\hat f = \sqrt{D_{in}}\,f/\|f\|` (scale-free input, unit mean square), g a two-layer MLP
    (``in → hidden → 1``, ReLU) whose last layer starts at zero weight and bias ``init_logit``, so
    every sample starts at the same radius :math:`\rho_{max}\sigma(\text{init\_logit})`.

    Args:
        in_features: :math:`D_{in}`, the width of the backbone features.
        hidden: width of the MLP's hidden layer (>= 1).
        init_logit: the starting logit of every sample.

    Raises:
        TypeError: ``hidden`` is not an int, or ``init_logit`` not a real number.
        ValueError: ``hidden < 1``, or ``init_logit`` is not finite in float32.
    """

    def __init__(self, in_features: int, hidden: int = 64, init_logit: float = 0.0):
        super().__init__()
        _check_width(hidden, "radial_hidden")
        if isinstance(init_logit, bool) or not isinstance(init_logit, Real):
            raise TypeError(f"radial_init_logit must be a real number, got {type(init_logit).__name__} "
                            f"{init_logit!r}")
        if not abs(float(init_logit)) <= torch.finfo(torch.float32).max:
            raise ValueError(f"radial_init_logit must be finite (in float32), got {init_logit!r}")
        self.mlp = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.constant_(self.mlp[2].bias, float(init_logit))

    def forward(self, f: torch.Tensor, max_norm: float) -> torch.Tensor:
        f_hat = nn.functional.normalize(f, dim=-1) * f.shape[-1] ** 0.5
        return max_norm * torch.sigmoid(self.mlp(f_hat))


class HyperbolicEmbeddingHead(nn.Module):
    r"""Linear head into the Poincaré ball; the distance to the origin is learned to mean confidence.

    ``radius="learned"`` (**default**, the *polar head*): the direction comes from the Hyp-ViT
    ``Linear`` (orthogonal init, zero bias), the tangent norm from :class:`RadialConfidence`:

    .. math:: v = \rho(f)\,\frac{Wf + b}{\|Wf + b\|},\qquad x = \operatorname{proj}(\exp_0^c(\operatorname{clip}(v)))

    with :math:`\rho \le r` (the geometry's clip radius), so d₀(x) = 2ρ(f) spreads with the loss's
    radial pull (confident samples outward, ambiguous ones inward) instead of sitting at the clip.
    Why: the Hyp-ViT head maps pretrained features to tangent norms far above r, so clipping puts
    every embedding on one sphere and d₀ is the same for all of them.

    ``radius="norm"``: the papers' exact head, ``ToPoincare(Linear(f))`` (Ermolov et al., CVPR'22:
    128-d, :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE` and
    :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R`).

    Pass a :class:`~pml_hyperbolic.geometry.PoincareGeometry` as ``c`` to share the curvature and
    the clipping with the distance, losses and evaluation (by reference); ``head.geometry`` is the
    object in use either way. Returns a plain tensor of ball points, or a hypll ``ManifoldTensor`` on
    ``head.geometry`` with ``return_manifold_tensor=True`` (for hypll layers downstream).

    Args:
        in_features: width of the backbone features.
        out_features: embedding dimension, default 128.
        c: a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (shared by reference) or a curvature
            magnitude; default :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`. See
            :class:`ToPoincare`.
        clip_r: clip radius; unset: :data:`~pml_hyperbolic.geometry.DEFAULT_CLIP_R` (``None``: no
            clipping). Not with a geometry.
        learnable_c: learn the curvature; unset: False. Not with a geometry.
        clip: ``"hard"`` (unset), ``"tanh"`` or ``None``. Not with a geometry.
        radius: ``"learned"`` (the polar head, default) or ``"norm"`` (the papers' head).
        radial_hidden: hidden width of :class:`RadialConfidence` (``radius="learned"`` only).
        radial_init_logit: starting logit of :class:`RadialConfidence`.
        return_manifold_tensor: return a hypll ``ManifoldTensor`` instead of a plain tensor.

    Raises:
        TypeError: ``in_features``, ``out_features`` or ``radial_hidden`` not an int,
            ``radial_init_logit`` not a number, or any type error of :class:`ToPoincare`. At call
            time: input that is not a floating-point tensor, or whose dtype differs from the
            head's (outside autocast).
        ValueError: an unknown ``radius``, a width < 1, a non-finite ``radial_init_logit``, or any
            error of :class:`ToPoincare`. At call time: input whose last dimension is not
            ``in_features``, or that holds NaN/Inf.

    Design note: docs/design/heads.md
    """

    def __init__(self, in_features: int, out_features: int = 128,
                 c: float | Tensor | PoincareGeometry | nn.Module = DEFAULT_CURVATURE,
                 clip_r: float | None | _Unset = _UNSET, learnable_c: bool | _Unset = _UNSET,
                 clip: str | None | _Unset = _UNSET, radius: str = "learned", radial_hidden: int = 64,
                 radial_init_logit: float = 0.0, return_manifold_tensor: bool = False):
        super().__init__()
        if radius not in RADIUS_MODES:
            raise ValueError(f"radius must be one of {RADIUS_MODES}, got {radius!r}")
        _check_width(in_features, "in_features")
        _check_width(out_features, "out_features")
        self.linear = _orthogonal_linear(in_features, out_features)
        self.to_poincare = ToPoincare(c=c, clip_r=clip_r, learnable_c=learnable_c, clip=clip)
        self.radius = radius
        self.radial = RadialConfidence(in_features, radial_hidden, radial_init_logit) if radius == "learned" else None
        self.return_manifold_tensor = bool(return_manifold_tensor)

    @property
    def geometry(self) -> PoincareGeometry:
        """The geometry in use (the one passed as ``c``, or the head's own)."""
        return self.to_poincare.geometry

    @property
    def c(self) -> torch.Tensor:
        return self.to_poincare.c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_features(x, self.linear, "HyperbolicEmbeddingHead")
        v = self.linear(x)
        if self.radial is not None:
            x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
            v = v.to(x.dtype)
            max_norm = self.geometry.clip_r if self.geometry.clip_r is not None else DEFAULT_CLIP_R
            v = nn.functional.normalize(v, dim=-1) * self.radial(x, max_norm)
        out = self.to_poincare(v)
        return to_manifold_tensor(out, self.geometry) if self.return_manifold_tensor else out

    def extra_repr(self) -> str:
        return f"radius={self.radius!r}"


class SphericalEmbeddingHead(nn.Module):
    """The "Sph-" baseline head: the same ``Linear`` then L2 normalisation onto the unit sphere.

    Args:
        in_features: width of the backbone features.
        out_features: embedding dimension, default 128.

    Raises:
        TypeError: a width that is not an int; at call time, input that is not a floating-point
            tensor of the head's dtype.
        ValueError: a width < 1; at call time, input whose last dimension is not ``in_features``,
            or that holds NaN/Inf.
    """

    def __init__(self, in_features: int, out_features: int = 128):
        super().__init__()
        _check_width(in_features, "in_features")
        _check_width(out_features, "out_features")
        self.linear = _orthogonal_linear(in_features, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_features(x, self.linear, "SphericalEmbeddingHead")
        pb.check_finite(x, "features")
        return nn.functional.normalize(self.linear(x).float(), dim=-1)
