"""Random image degradations (blur, noise, occlusion) on batches of normalised image tensors.

Used to make degraded copies inside a training step
(:class:`~pml_hyperbolic.training.degraded_copy_trainer.DegradedCopyTrainer`), so that the
radius of a hyperbolic embedding learns to drop when the input loses information. Every strength is
drawn per image, and the sizes are fractions of the image side so that the same settings mean the
same thing at 48 px and at 224 px.

Design note: docs/design/data.md
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

DEGRADATION_KINDS = ("blur", "noise", "occlusion")

#: the widest Gaussian σ accepted, in pixels (a kernel of 6·σ taps)
MAX_SIGMA_PX = 1e6
#: the narrowest σ of :func:`gaussian_kernel1d` (its taps are computed in ``dtype``: a σ that
#: rounds to 0 there would give 0/0)
MIN_KERNEL_SIGMA_PX = 1e-3


def _check_sigma(sigma, name: str = "sigma", minimum: float = 0.0) -> float:
    if isinstance(sigma, (bool, str, bytes)) or sigma is None:
        raise TypeError(f"{name} must be a number of pixels > 0, got {sigma!r}")
    try:
        s = float(sigma)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number of pixels > 0, got {sigma!r}") from None
    if not (0 < s <= MAX_SIGMA_PX and s >= minimum):
        low = f"[{minimum:g}" if minimum > 0 else "(0"
        raise ValueError(f"{name} must lie in {low}, {MAX_SIGMA_PX:g}] pixels, got {sigma!r}")
    return s


def gaussian_kernel1d(sigma: float, dtype: torch.dtype = torch.float32,
                      device: Optional[torch.device] = None) -> torch.Tensor:
    r"""Normalised 1-D Gaussian taps :math:`k_t \propto \exp(-t^2/2\sigma^2)`, :math:`|t| \le \lceil 3\sigma \rceil`.

    Raises:
        TypeError: ``sigma`` is not a number (bool and str included).
        ValueError: ``sigma`` not in [:data:`MIN_KERNEL_SIGMA_PX`, :data:`MAX_SIGMA_PX`].
    """
    sigma = _check_sigma(sigma, minimum=MIN_KERNEL_SIGMA_PX)
    half = max(1, math.ceil(3.0 * sigma))
    t = torch.arange(-half, half + 1, dtype=dtype, device=device)
    k = torch.exp(-0.5 * (t / sigma) ** 2)
    return k / k.sum()


def gaussian_blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of one (C, H, W) image, reflect padding (no dark border).

    Raises:
        TypeError / ValueError: as :func:`gaussian_blur_batch`, and for ``sigma`` as
            :func:`gaussian_kernel1d`.
    """
    _check_images(image, "image", 3)
    sigma = _check_sigma(sigma)
    return gaussian_blur_batch(image[None], torch.tensor([float(sigma)], dtype=torch.float64))[0]


def gaussian_blur_batch(images: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    r"""Separable Gaussian blur of each (C, H, W) image of a batch with its own σ (``sigmas``: (B,)).

    Every image gets the taps of :func:`gaussian_kernel1d` for its σ, zero-extended to the widest
    kernel of the batch, so that one grouped convolution per axis blurs the whole batch (on the
    batch's device): zero taps read only reflect-padded pixels that the narrower kernel does not
    reach, so the result equals blurring each image alone. Reflect padding (no dark border);
    replicate padding when the kernel is wider than the image.

    Raises:
        TypeError: ``images`` not a floating-point tensor, or ``sigmas`` not a tensor.
        ValueError: ``images`` not (B, C, H, W), or ``sigmas`` not one σ in (0,
            :data:`MAX_SIGMA_PX`] per image.
    """
    _check_images(images, "images", 4)
    if not torch.is_tensor(sigmas):
        raise TypeError(f"sigmas must be a tensor of one σ per image, got {type(sigmas).__name__}")
    b, c, h, w = images.shape
    sig = sigmas.to(device=images.device, dtype=torch.float64)
    if sig.ndim > 1:
        raise ValueError(f"sigmas must hold one positive σ per image ({b}), got shape {tuple(sigmas.shape)}")
    sig = sig.reshape(-1)
    if sig.numel() != b or not bool(((sig > 0) & (sig <= MAX_SIGMA_PX)).all()):
        raise ValueError(f"sigmas must hold one positive σ per image ({b}), each at most {MAX_SIGMA_PX:g}, "
                         f"got shape {tuple(sigmas.shape)}")
    halves = torch.ceil(3.0 * sig).clamp_min(1)
    half = int(halves.max())
    t = torch.arange(-half, half + 1, dtype=torch.float64, device=images.device)
    taps = torch.exp(-0.5 * (t[None] / sig[:, None]) ** 2) * (t[None].abs() <= halves[:, None])
    taps = (taps / taps.sum(dim=1, keepdim=True)).to(images.dtype)  # (B, K), per-image normalised
    weight = taps.repeat_interleave(c, dim=0)  # (B·C, K): one filter per (image, channel) group
    x = images.reshape(1, b * c, h, w)
    pad_mode = "reflect" if half < min(h, w) else "replicate"
    x = torch.nn.functional.pad(x, (half, half, 0, 0), mode=pad_mode)
    x = torch.nn.functional.conv2d(x, weight.view(b * c, 1, 1, -1), groups=b * c)
    x = torch.nn.functional.pad(x, (0, 0, half, half), mode=pad_mode)
    x = torch.nn.functional.conv2d(x, weight.view(b * c, 1, -1, 1), groups=b * c)
    return x.reshape(b, c, h, w)


def _check_images(images, name: str, ndim: int) -> None:
    shape = "(B, C, H, W)" if ndim == 4 else "(C, H, W)"
    if not torch.is_tensor(images):
        raise TypeError(f"{name} must be a floating-point tensor {shape}, got {type(images).__name__}")
    if not torch.is_floating_point(images):
        raise TypeError(f"{name} must be a floating-point tensor {shape}, got dtype {images.dtype}")
    if images.ndim != ndim:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(images.shape)}")


def _check_range(name: str, value, low_ok: float, high_ok: float) -> Tuple[float, float]:
    try:
        if isinstance(value, (str, bytes)) or any(isinstance(v, (bool, str, bytes)) for v in value):
            raise TypeError
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a (low, high) pair of numbers, got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name} must be finite, got {value!r}")
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

    Args:
        kinds: a non-empty subset of :data:`DEGRADATION_KINDS`.
        blur_sigma: (low, high) of σ as a fraction of the image side.
        noise_std: (low, high) of the noise standard deviation, in normalised-tensor units.
        occlusion_side: (low, high) of the square's side as a fraction of the shorter side.
        occlusion_value: the occluded pixels' value.

    Raises:
        ValueError: ``kinds`` empty, with an unknown or repeated kind; a range that is not a
            (low, high) pair of finite numbers within its bounds; a non-finite ``occlusion_value``.

    Design note: docs/design/data.md
    """

    def __init__(self, kinds: Sequence[str] = DEGRADATION_KINDS, blur_sigma: Tuple[float, float] = (0.008, 0.04),
                 noise_std: Tuple[float, float] = (0.1, 0.8), occlusion_side: Tuple[float, float] = (0.125, 0.5),
                 occlusion_value: float = 0.0):
        if isinstance(kinds, str) or not hasattr(kinds, "__iter__"):
            raise ValueError(f"kinds must be a non-empty sequence of names from {DEGRADATION_KINDS}, got {kinds!r}")
        kinds = tuple(kinds)
        unknown = [k for k in kinds if k not in DEGRADATION_KINDS]
        if not kinds or unknown or len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds must be a non-empty subset of {DEGRADATION_KINDS} without repeats, "
                             f"got {kinds!r}")
        self.kinds = kinds
        self.blur_sigma = _check_range("blur_sigma", blur_sigma, 1e-6, 1.0)
        self.noise_std = _check_range("noise_std", noise_std, 0.0, math.inf)
        self.occlusion_side = _check_range("occlusion_side", occlusion_side, 1e-6, 1.0)
        if isinstance(occlusion_value, (bool, str, bytes)) or occlusion_value is None:
            raise ValueError(f"occlusion_value must be a finite number, got {occlusion_value!r}")
        try:
            self.occlusion_value = float(occlusion_value)
        except (TypeError, ValueError):
            raise ValueError(f"occlusion_value must be a finite number, got {occlusion_value!r}") from None
        if not math.isfinite(self.occlusion_value):
            raise ValueError(f"occlusion_value must be a finite number, got {occlusion_value!r}")

    @staticmethod
    def _uniform(bounds, u: torch.Tensor) -> torch.Tensor:
        lo, hi = bounds
        return lo + (hi - lo) * u

    def __call__(self, images: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Degraded copy of ``images`` (B, C, H, W).

        Raises:
            TypeError: ``images`` not a floating-point tensor, or ``generator`` not a
                ``torch.Generator``.
            ValueError: ``images`` not 4-D.
        """
        _check_images(images, "images", 4)
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        out = images.clone()
        b, _, h, w = images.shape
        if b == 0:
            return out
        side_px = min(h, w)
        # every draw from the CPU generator, a few vectors per batch: the kind, the strength and the
        # occlusion's corner of each image, and one seed for the noise drawn on the batch's device
        # (a GPU batch is degraded where it lies, with no per-image loop or host copy)
        kind = torch.randint(len(self.kinds), (b,), generator=generator)
        strength = torch.rand(b, generator=generator, dtype=torch.float64)
        corner = torch.rand(b, 2, generator=generator, dtype=torch.float64)
        noise_seed = int(torch.randint(2 ** 62, (), generator=generator))
        dev = images.device

        def rows_of(name):
            """(CPU, device) indices of the images drawn for ``name``; None when there are none."""
            idx = (kind == self.kinds.index(name)).nonzero().squeeze(1) if name in self.kinds else kind[:0]
            return (idx, idx.to(dev)) if len(idx) else None

        blur = rows_of("blur")
        if blur is not None:
            idx, on_device = blur
            sigmas = (self._uniform(self.blur_sigma, strength[idx]) * side_px).clamp_min(1e-3)
            out[on_device] = gaussian_blur_batch(images[on_device], sigmas)

        noise = rows_of("noise")
        if noise is not None:
            idx, on_device = noise
            device_gen = torch.Generator(device=dev).manual_seed(noise_seed)
            std = self._uniform(self.noise_std, strength[idx]).to(dev, images.dtype)
            eps = torch.randn((len(idx), *images.shape[1:]), generator=device_gen, device=dev, dtype=images.dtype)
            out[on_device] = images[on_device] + std.view(-1, 1, 1, 1) * eps

        occlusion = rows_of("occlusion")
        if occlusion is not None:
            idx, on_device = occlusion
            side = torch.round(self._uniform(self.occlusion_side, strength[idx]) * side_px).clamp(1, side_px).long()
            y0 = torch.minimum((corner[idx, 0] * (h - side + 1)).long(), h - side).to(dev)
            x0 = torch.minimum((corner[idx, 1] * (w - side + 1)).long(), w - side).to(dev)
            side = side.to(dev)
            ys, xs = torch.arange(h, device=dev), torch.arange(w, device=dev)
            inside = (((ys[None] >= y0[:, None]) & (ys[None] < (y0 + side)[:, None]))[:, :, None]
                      & ((xs[None] >= x0[:, None]) & (xs[None] < (x0 + side)[:, None]))[:, None, :])
            out[on_device] = out[on_device].masked_fill(inside[:, None], self.occlusion_value)
        return out

    def __repr__(self) -> str:
        return (f"RandomDegradation(kinds={self.kinds}, blur_sigma={self.blur_sigma}, noise_std={self.noise_std}, "
                f"occlusion_side={self.occlusion_side})")
