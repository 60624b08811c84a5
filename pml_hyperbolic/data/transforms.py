"""Train / eval image transforms of the papers (ImageNet-style) and their glyph equivalents."""

from torchvision import transforms as T

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

DEFAULT_SIZES = {"imagenet": (224, 256), "glyph": (64, 64)}


class ConvertToRGB:
    """Convert any PIL image (greyscale, CMYK, palette, RGBA) to RGB.

    The benchmarks contain greyscale and CMYK JPEGs; the datasets already
    convert, this guards pipelines fed from elsewhere.
    """

    def __call__(self, image):
        return image if image.mode == "RGB" else image.convert("RGB")

    def __repr__(self):
        return f"{self.__class__.__name__}()"


def build_transforms(kind="imagenet", train=True, image_size=None, resize_size=None,
                     mean=IMAGENET_MEAN, std=IMAGENET_STD, glyph_max_rotation=8.0):
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
    so a small CNN trains on CPU in minutes.

    Args:
        image_size / resize_size: ``None`` selects the defaults of ``kind``.
        mean / std: normalisation; ImageNet statistics by default (also right for
            the offline EfficientNet-Lite0 / MobileNetV2 weights' reference pipelines).
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

    if train:
        steps = [
            ConvertToRGB(),
            T.RandomAffine(
                degrees=glyph_max_rotation, translate=(0.08, 0.08), scale=(0.85, 1.1), shear=6,
                interpolation=T.InterpolationMode.BILINEAR, fill=255,
            ),
            T.Resize((image_size, image_size), interpolation=bicubic),
        ]
    else:
        steps = [ConvertToRGB(), T.Resize((image_size, image_size), interpolation=bicubic)]
    return T.Compose(steps + finish)
