"""Random image degradations (blur, noise, occlusion) on batches of normalised image tensors.

Used to make degraded copies inside a training step
(:class:`~pml_hyperbolic.training.degraded_copy_trainer.DegradedCopyTrainer`), so that the
radius of a hyperbolic embedding learns to drop when the input loses information. Every strength is
drawn per image, and the sizes are fractions of the image side so that the same settings mean the
same thing at 48 px and at 224 px.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

DEGRADATION_KINDS = ("blur", "noise", "occlusion")


def gaussian_kernel1d(sigma: float, dtype=torch.float32, device=None) -> torch.Tensor:
    r"""Normalised 1-D Gaussian taps :math:`k_t \propto \exp(-t^2/2\sigma^2)`, :math:`|t| \le \lceil 3\sigma \rceil`."""
    half = max(1, math.ceil(3.0 * sigma))
    t = torch.arange(-half, half + 1, dtype=dtype, device=device)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of one (C, H, W) image, reflect padding (no dark border)."""
    c, h, w = image.shape
    k = gaussian_kernel1d(sigma, image.dtype, image.device)
    half = len(k) // 2
    x = image[None]
    pad_mode = "reflect" if half < min(h, w) else "replicate"
    x = torch.nn.functional.pad(x, (half, half, 0, 0), mode=pad_mode)
    x = torch.nn.functional.conv2d(x, k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    x = torch.nn.functional.pad(x, (0, 0, half, half), mode=pad_mode)
    x = torch.nn.functional.conv2d(x, k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)
    return x[0]


def _check_range(name: str, value, low_ok: float, high_ok: float) -> Tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {value!r}") from None
    if not (low_ok <= lo <= hi <= high_ok):
        raise ValueError(f"{name} must satisfy {low_ok} <= low <= high <= {high_ok}, got {value!r}")
    return lo, hi


class RandomDegradation:
    r"""Degrade each image of a batch by one randomly chosen kind at a random strength.

    * ``"blur"``: Gaussian blur, σ uniform in ``blur_sigma`` × image side (default 0.8–4 % of the
      side: σ 0.5–2.5 px at 64 px);
    * ``"noise"``: additive Gaussian noise, std uniform in ``noise_std`` (in the units of the
      normalised tensor, i.e. ImageNet-standardised pixels: default 0.1–0.8);
    * ``"occlusion"``: a square of side uniform in ``occlusion_side`` × the shorter side (default
      1/8–1/2) set to ``occlusion_value`` (0 = the dataset mean after standardisation).

    Call on a (B, C, H, W) tensor; returns a new tensor (the input is not modified). Random draws
    come from ``generator`` when given, else from torch's global generator (so that a run seeded
    and resumed by the recipes draws the same degradations).
    """

    def __init__(self, kinds: Sequence[str] = DEGRADATION_KINDS, blur_sigma=(0.008, 0.04), noise_std=(0.1, 0.8),
                 occlusion_side=(0.125, 0.5), occlusion_value: float = 0.0):
        kinds = tuple(kinds)
        unknown = [k for k in kinds if k not in DEGRADATION_KINDS]
        if not kinds or unknown:
            raise ValueError(f"kinds must be a non-empty subset of {DEGRADATION_KINDS}, got {kinds!r}")
        self.kinds = kinds
        self.blur_sigma = _check_range("blur_sigma", blur_sigma, 1e-6, 1.0)
        self.noise_std = _check_range("noise_std", noise_std, 0.0, math.inf)
        self.occlusion_side = _check_range("occlusion_side", occlusion_side, 1e-6, 1.0)
        self.occlusion_value = float(occlusion_value)

    def _uniform(self, bounds, generator) -> float:
        lo, hi = bounds
        return lo + (hi - lo) * float(torch.rand((), generator=generator))

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        if images.ndim != 4:
            raise ValueError(f"RandomDegradation expects a (B, C, H, W) batch, got shape {tuple(images.shape)}")
        out = images.clone()
        _, _, h, w = images.shape
        for i in range(len(images)):
            kind = self.kinds[int(torch.randint(len(self.kinds), (), generator=generator))]
            if kind == "blur":
                out[i] = gaussian_blur(images[i], max(1e-3, self._uniform(self.blur_sigma, generator) * min(h, w)))
            elif kind == "noise":
                std = self._uniform(self.noise_std, generator)
                noise = torch.randn(images[i].shape, generator=generator, dtype=images.dtype)
                out[i] = images[i] + std * noise.to(images.device)
            else:
                side = max(1, min(h, w, round(self._uniform(self.occlusion_side, generator) * min(h, w))))
                y0 = int(torch.randint(h - side + 1, (), generator=generator))
                x0 = int(torch.randint(w - side + 1, (), generator=generator))
                out[i, :, y0:y0 + side, x0:x0 + side] = self.occlusion_value
        return out

    def __repr__(self) -> str:
        return (f"RandomDegradation(kinds={self.kinds}, blur_sigma={self.blur_sigma}, noise_std={self.noise_std}, "
                f"occlusion_side={self.occlusion_side})")
