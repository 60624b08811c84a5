"""The papers' transforms: values, not only shapes (resize/crop geometry, bicubic, flip, normalisation)."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from pml_hyperbolic.data import build_transforms
from pml_hyperbolic.data.transforms import IMAGENET_MEAN, IMAGENET_STD

MEAN = torch.tensor(IMAGENET_MEAN)[:, None, None]
STD = torch.tensor(IMAGENET_STD)[:, None, None]


def random_photo(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


def to_normalised(image):
    x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
    return (x - MEAN) / STD


def test_imagenet_eval_is_resize_256_bicubic_then_centre_crop_224():
    photo = random_photo(320, 400)  # portrait: the shorter side (width) goes to 256
    got = build_transforms("imagenet", train=False)(photo)
    # by hand with PIL: 320x400 -> 256x320 (bicubic), then the central 224x224 (offsets 16, 48)
    resized = photo.resize((256, 320), Image.BICUBIC)
    want = to_normalised(resized.crop((16, 48, 16 + 224, 48 + 224)))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_imagenet_eval_converts_greyscale_and_cmyk_like_pil():
    for mode in ("L", "CMYK"):
        photo = random_photo(256, 256, mode=mode, seed=1)
        got = build_transforms("imagenet", train=False)(photo)
        want = to_normalised(photo.convert("RGB").crop((16, 16, 240, 240)))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        if mode == "L":  # grey stays grey: the three channels carry the same pixel
            raw = got * STD + MEAN
            torch.testing.assert_close(raw[0], raw[1], rtol=0, atol=1e-5)


def test_imagenet_train_is_random_resized_crop_bicubic_and_flip():
    pipeline = build_transforms("imagenet", train=True)
    crop = next(t for t in pipeline.transforms if isinstance(t, T.RandomResizedCrop))
    assert crop.size == (224, 224) and crop.interpolation == T.InterpolationMode.BICUBIC
    assert crop.scale == (0.08, 1.0) and crop.ratio == pytest.approx((3 / 4, 4 / 3))
    # left half black, right half white: the output's orientation shows whether it was flipped
    half = np.zeros((300, 300, 3), dtype=np.uint8)
    half[:, 150:] = 255
    image = Image.fromarray(half)
    flips, crops = 0, set()
    for seed in range(120):
        torch.manual_seed(seed)
        x = pipeline(image) * STD + MEAN
        left, right = x[:, :, :112].mean().item(), x[:, :, 112:].mean().item()
        flips += left > right
        crops.add(round(x.mean().item(), 3))
    assert 30 <= flips <= 90  # p = 0.5
    assert len(crops) > 50  # the crop moves
    torch.manual_seed(0)
    a = pipeline(image)
    torch.manual_seed(0)
    assert torch.equal(a, pipeline(image))  # reproducible under torch's seed


def test_normalisation_of_a_flat_grey_image():
    grey = Image.new("RGB", (224, 224), (128, 128, 128))
    x = build_transforms("imagenet", train=False, resize_size=224)(grey)
    want = (torch.full((3, 1, 1), 128 / 255.0) - MEAN) / STD
    torch.testing.assert_close(x, want.expand(3, 224, 224), rtol=0, atol=1e-6)


def test_glyph_eval_is_a_plain_bicubic_resize():
    glyph = Image.fromarray(np.random.default_rng(2).integers(0, 256, (40, 40), dtype=np.uint8), mode="L")
    got = build_transforms("glyph", train=False)(glyph)
    want = to_normalised(glyph.convert("RGB").resize((64, 64), Image.BICUBIC))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_glyph_train_never_flips_and_pads_with_white_paper():
    pipeline = build_transforms("glyph", train=True)
    assert not any(isinstance(t, T.RandomHorizontalFlip) for t in pipeline.transforms)
    blank = Image.new("L", (40, 40), 255)  # white paper: shifts/rotations must not bring in black
    white = ((torch.ones(3, 1, 1) - MEAN) / STD).expand(3, 64, 64)
    for seed in range(10):
        torch.manual_seed(seed)
        torch.testing.assert_close(pipeline(blank), white, rtol=0, atol=1e-5)
