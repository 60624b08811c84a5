"""Train / eval image transforms of the papers (ImageNet-style) and their glyph equivalents.

Design note: docs/design/data.md
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import numpy as np
import torch
from torchvision import transforms as T

from .registry import GLYPH_VIEW_AUGMENTATIONS  # torch-free: the recipes' command line lists them too

if TYPE_CHECKING:
    from PIL import Image

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DEFAULT_SIZES = {"imagenet": (224, 256), "glyph": (64, 64)}


class ConvertToRGB:
    """Convert any PIL image (greyscale, CMYK, palette, RGBA) to RGB.

    The benchmarks contain greyscale and CMYK JPEGs; the datasets already
    convert, this guards pipelines fed from elsewhere.

    Args:
        keep_greyscale: let greyscale ("L") images through unchanged. For a
            pipeline whose steps treat the three equal channels of a grey RGB
            image alike and which ends in :class:`ToNormalizedTensor` (which
            repeats the grey channel): the same output as converting first, for
            a third of the pixels in the PIL steps.
    """

    def __init__(self, keep_greyscale: bool = False):
        if not isinstance(keep_greyscale, bool):
            raise ValueError(f"keep_greyscale must be True or False, got {keep_greyscale!r}")
        self.keep_greyscale = keep_greyscale

    def __call__(self, image: Image.Image):
        if image.mode == "RGB" or (self.keep_greyscale and image.mode == "L"):
            return image
        return image.convert("RGB")

    def __repr__(self):
        return f"{self.__class__.__name__}({'keep_greyscale=True' if self.keep_greyscale else ''})"


class ToNormalizedTensor:
    """A greyscale ("L") or RGB PIL image as a normalised ``(3, H, W)`` float32 tensor:

        out[c] = (pixel[c] / 255 - mean[c]) / std[c]

    with each operation rounded to float32 as torchvision's ``ToTensor()`` then
    ``Normalize(mean, std)`` round it, so the result is the same bit for bit
    (for a greyscale image: as for its RGB conversion, every channel reading the
    grey value). One step instead of two, and the division by 255 is done once
    per grey pixel rather than once per channel.

    Args:
        mean: per-channel means, three values or one for all channels.
        std: per-channel standard deviations, three values or one (non-zero).
    """

    def __init__(self, mean: Union[float, Sequence[float]] = IMAGENET_MEAN,
                 std: Union[float, Sequence[float]] = IMAGENET_STD):
        mean_t = torch.as_tensor(mean, dtype=torch.float32).reshape(-1)
        std_t = torch.as_tensor(std, dtype=torch.float32).reshape(-1)
        if mean_t.numel() not in (1, 3) or std_t.numel() not in (1, 3):
            raise ValueError(f"mean and std need one value per RGB channel (3 each) or one for all, got {mean!r} "
                             f"and {std!r}")
        mean_t, std_t = mean_t.expand(3).clone(), std_t.expand(3).clone()
        if bool((std_t == 0).any()) or not bool(torch.isfinite(std_t).all() and torch.isfinite(mean_t).all()):
            raise ValueError(f"std must be finite and non-zero and mean finite, got mean {mean!r}, std {std!r}")
        self.mean, self.std = tuple(mean_t.tolist()), tuple(std_t.tolist())
        self._mean = mean_t.numpy()[:, None, None]
        self._std = std_t.numpy()[:, None, None]

    def __call__(self, image: Image.Image):
        mode = getattr(image, "mode", None)
        if mode not in ("L", "RGB"):
            raise ValueError(f"ToNormalizedTensor takes a greyscale ('L') or RGB PIL image, got "
                             f"{type(image).__name__} with mode {mode!r}; put ConvertToRGB() before it")
        # float32, / 255, - mean, / std: ToTensor's and Normalize's operations in their order, each
        # rounded to float32 (numpy's and torch's float32 division and subtraction are both IEEE, and
        # numpy's per-call cost is a third of torch's on a 48 px image)
        scaled = np.asarray(image, dtype=np.float32) / np.float32(255)
        channels_first = scaled[None] if mode == "L" else scaled.transpose(2, 0, 1)
        out = np.empty((3, *scaled.shape[:2]), dtype=np.float32)
        np.subtract(channels_first, self._mean, out=out)  # a grey channel broadcasts to all three
        out /= self._std
        return torch.from_numpy(out)

    def __repr__(self):
        return f"{self.__class__.__name__}(mean={self.mean}, std={self.std})"


def glyph_affine(max_rotation: float = 8.0) -> Callable:
    """The glyph pipelines' mild random affine on white paper: rotation ≤ ``max_rotation`` degrees,
    shift ≤ 8 % of the side, scale 0.85–1.1, shear ≤ 6°, bilinear, fill 255."""
    return T.RandomAffine(degrees=max_rotation, translate=(0.08, 0.08), scale=(0.85, 1.1), shear=6,
                          interpolation=T.InterpolationMode.BILINEAR, fill=255)


def build_transforms(kind: str = "imagenet", train: bool = True, image_size: Optional[int] = None,
                     resize_size: Optional[int] = None, mean: Sequence[float] = IMAGENET_MEAN,
                     std: Sequence[float] = IMAGENET_STD, glyph_max_rotation: float = 8.0) -> Callable:
    """Build the torchvision pipeline producing normalized float tensors ``(3, S, S)``.

    ``kind="imagenet"`` (Hyp-ViT / Hyp-UML protocol for Cars, CUB, SOP, In-Shop):

    * train: ``RandomResizedCrop(image_size, bicubic)`` + horizontal flip;
    * eval: ``Resize(resize_size, bicubic)`` + ``CenterCrop(image_size)``.
      Defaults 224 / 256.

    ``kind="glyph"`` (the bundled :class:`GlyphDataset`, 40 px source images):
    no flip (a mirrored character is another symbol) and no aggressive crop
    (cropping can remove the strokes that distinguish two characters); instead
    a mild random affine (rotation, shift, scale, shear) on white paper, then a
    bicubic upsample to ``image_size``. Eval is a plain resize to ``image_size``
    (``resize_size`` is unused). Default 64
    so a small CNN trains on CPU in minutes. The glyph pipelines take greyscale
    images as they are (``accepts_greyscale = True`` on the returned pipeline:
    the output equals that for the image's RGB conversion, bit for bit, at a third
    of the PIL work; :class:`~pml_hyperbolic.data.GlyphDataset` then skips the
    conversion).

    Args:
        kind: ``"imagenet"`` or ``"glyph"``.
        train: the training (random) pipeline, else the evaluation one.
        image_size: output side; ``None`` selects the default of ``kind``.
        resize_size: evaluation resize before the centre crop (``"imagenet"`` only); ``None``
            selects the default.
        mean: normalisation means; ImageNet statistics by default (also right for the offline
            EfficientNet-Lite0 / MobileNetV2 weights' reference pipelines).
        std: normalisation standard deviations.
        glyph_max_rotation: largest rotation of the glyph training affine, in degrees.

    Returns:
        A callable from a PIL image to a ``(3, S, S)`` float32 tensor.

    Raises:
        ValueError: an unknown ``kind``.

    Design note: docs/design/data.md
    """
    if kind not in DEFAULT_SIZES:
        raise ValueError(f"kind must be one of {sorted(DEFAULT_SIZES)}, got {kind!r}")
    default_image, default_resize = DEFAULT_SIZES[kind]
    image_size = default_image if image_size is None else int(image_size)
    resize_size = default_resize if resize_size is None else int(resize_size)
    bicubic = T.InterpolationMode.BICUBIC
    finish = [T.ToTensor(), T.Normalize(mean, std)]

    if kind == "imagenet":
        if train:
            steps = [ConvertToRGB(), T.RandomResizedCrop(image_size, interpolation=bicubic), T.RandomHorizontalFlip()]
        else:
            steps = [ConvertToRGB(), T.Resize(resize_size, interpolation=bicubic), T.CenterCrop(image_size)]
        return T.Compose(steps + finish)

    # PIL's affine warp and resampling treat each channel alone, so a grey image's one channel gives
    # exactly each channel of its RGB conversion (tests/data/test_transforms.py checks it, bit for bit)
    steps = [ConvertToRGB(keep_greyscale=True)]
    if train:
        steps.append(glyph_affine(glyph_max_rotation))
    steps.append(T.Resize((image_size, image_size), interpolation=bicubic))
    pipeline = T.Compose(steps + [ToNormalizedTensor(mean, std)])
    pipeline.accepts_greyscale = True
    return pipeline


class RandomStrokeWeight:
    """Make the dark strokes of a glyph on light paper bolder or lighter, as another weight of a typeface:

        out = (1 − α)·image + α·filter(image),   filter = min over 3×3 (bolder) or max over 3×3 (lighter)

    With probability ``p`` one direction is drawn (bolder or lighter, even odds) and α uniformly from
    ``[0, bolder]`` or ``[0, lighter]``; otherwise the image passes unchanged. A 3×3 minimum widens every
    stroke by one pixel on each side; blending by α < 1 makes that a partial, sub-pixel change. The
    lighter direction has the smaller default range because a full 3×3 maximum erases strokes two pixels
    wide (hairline typefaces at 64 px). Apply it after the resize to the network's input size, where one
    pixel is a fixed fraction of the glyph. Random draws come from torch's global RNG, like torchvision's
    transforms (seed it with ``torch.manual_seed``).

    Args:
        bolder: largest α of the bolder direction, in [0, 1].
        lighter: largest α of the lighter direction, in [0, 1].
        p: probability of changing the weight at all, in [0, 1].

    Raises:
        ValueError: a value outside [0, 1].
    """

    def __init__(self, bolder: float = 1.0, lighter: float = 0.5, p: float = 0.8):
        for name, value in (("bolder", bolder), ("lighter", lighter), ("p", p)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
        self.bolder, self.lighter, self.p = float(bolder), float(lighter), float(p)

    def __call__(self, image: Image.Image):
        from PIL import Image, ImageFilter

        if not isinstance(image, Image.Image) or image.mode not in ("L", "RGB"):
            raise ValueError(f"RandomStrokeWeight takes a greyscale ('L') or RGB PIL image, got {type(image).__name__}"
                             f" with mode {getattr(image, 'mode', None)!r}")
        draw = torch.rand(3).tolist()  # apply?, direction, strength: always three draws, so streams stay aligned
        if draw[0] >= self.p:
            return image
        bolder = draw[1] < 0.5
        alpha = draw[2] * (self.bolder if bolder else self.lighter)
        filtered = image.filter(ImageFilter.MinFilter(3) if bolder else ImageFilter.MaxFilter(3))
        return Image.blend(image, filtered, alpha)

    def __repr__(self):
        return f"{self.__class__.__name__}(bolder={self.bolder}, lighter={self.lighter}, p={self.p})"


def glyph_view_transform(image_size: int = 64, augmentation: str = "crop", mean: Sequence[float] = IMAGENET_MEAN,
                         std: Sequence[float] = IMAGENET_STD) -> Callable:
    """The augmentation of one view of a glyph for self-supervised contrastive learning (MoCo, HCL).

    Two views of the same glyph must differ the way one character differs between typefaces, which is
    what glyph retrieval has to ignore, while keeping every stroke that tells two characters apart.

    * ``"crop"`` (default): MoCo's random resized crop (scale 0.5–1) alone. A crop can cut off a stroke
      that distinguishes two characters, but on the bundled glyphs it is the better of the two for HCL
      (design note: docs/design/data.md).
    * ``"font"``: the supervised glyph pipeline's mild affine (rotation ≤ 8°, shift ≤ 8 %,
      scale 0.85–1.1, shear ≤ 6°, white fill), bicubic resize to ``image_size``, a stroke-weight change
      (:class:`RandomStrokeWeight`, p = 0.8) and, with p = 0.5, a Gaussian blur (σ ∈ [0.1, 1] px, MoCo v2's
      blur scaled to the glyph size). No flip (a mirrored glyph is another symbol), no colour jitter
      (glyphs are black on white).

    Args:
        image_size: output side in pixels (at least 8).
        augmentation: ``"crop"`` or ``"font"``.
        mean: normalisation means.
        std: normalisation standard deviations.

    Returns:
        A callable from a PIL image to a ``(3, image_size, image_size)`` float32 tensor.

    Raises:
        ValueError: an unknown ``augmentation`` or ``image_size < 8``.
    """
    if augmentation not in GLYPH_VIEW_AUGMENTATIONS:
        raise ValueError(f"augmentation must be one of {GLYPH_VIEW_AUGMENTATIONS}, got {augmentation!r}")
    image_size = int(image_size)
    if image_size < 8:
        raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")
    if augmentation == "crop":
        return T.Compose([T.RandomResizedCrop(image_size, scale=(0.5, 1.0), antialias=True), T.ToTensor(),
                          T.Normalize(mean, std)])
    pipeline = T.Compose([
        ConvertToRGB(keep_greyscale=True),
        glyph_affine(),
        T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BICUBIC),
        RandomStrokeWeight(),
        T.RandomApply([T.GaussianBlur(5, sigma=(0.1, 1.0))], p=0.5),
        ToNormalizedTensor(mean, std),
    ])
    pipeline.accepts_greyscale = True
    return pipeline
