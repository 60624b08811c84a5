"""The papers' transforms: values, not only shapes (resize/crop geometry, bicubic, flip, normalisation)."""

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms as T

from pml_hyperbolic.data import build_transforms
from pml_hyperbolic.data.transforms import IMAGENET_MEAN, IMAGENET_STD, ConvertToRGB, ToNormalizedTensor

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


# ---- the greyscale glyph pipeline: same tensors as torchvision's, bit for bit --------

def torchvision_glyph_pipeline(train, image_size=48):
    """The glyph pipeline as it was in 0.1.0: RGB first, torchvision's ToTensor + Normalize."""
    steps = [T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BICUBIC)]
    if train:
        steps.insert(0, T.RandomAffine(degrees=8.0, translate=(0.08, 0.08), scale=(0.85, 1.1), shear=6,
                                       interpolation=T.InterpolationMode.BILINEAR, fill=255))
    return T.Compose([ConvertToRGB(), *steps, T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])


def random_glyphs(n, seed=0, side=40):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8), mode="L") for _ in range(n)]


def test_to_normalized_tensor_equals_to_tensor_then_normalize_bit_for_bit():
    reference = T.Compose([T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    fused = ToNormalizedTensor(IMAGENET_MEAN, IMAGENET_STD)
    for grey in random_glyphs(20, seed=3, side=33):
        colour = random_photo(31, 17, seed=int(np.asarray(grey)[0, 0]))
        for image in (grey, colour):
            got = fused(image)
            assert got.shape == (3, image.size[1], image.size[0]) and got.dtype == torch.float32
            assert got.is_contiguous()
            assert torch.equal(got, reference(image.convert("RGB")))
    # reference values: paper white and black ink
    white, black = Image.new("L", (2, 2), 255), Image.new("L", (2, 2), 0)
    torch.testing.assert_close(fused(white)[:, 0, 0], (1 - MEAN[:, 0, 0]) / STD[:, 0, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(fused(black)[:, 0, 0], -MEAN[:, 0, 0] / STD[:, 0, 0], rtol=0, atol=1e-6)


def test_to_normalized_tensor_refuses_bad_input():
    with pytest.raises(ValueError, match="ConvertToRGB"):
        ToNormalizedTensor()(Image.new("CMYK", (4, 4)))
    with pytest.raises(ValueError, match="mode"):
        ToNormalizedTensor()(torch.zeros(3, 4, 4))
    with pytest.raises(ValueError, match="3 each"):
        ToNormalizedTensor(mean=(0.5, 0.5), std=(0.5, 0.5))
    one_for_all = ToNormalizedTensor(mean=(0.5,), std=(0.25,))  # as Normalize broadcasts one value
    assert torch.equal(one_for_all(Image.new("L", (2, 2), 255)), torch.full((3, 2, 2), 2.0))
    with pytest.raises(ValueError, match="non-zero"):
        ToNormalizedTensor(mean=(0.5, 0.5, 0.5), std=(0.5, 0.0, 0.5))


def test_convert_to_rgb_keeps_greyscale_only_when_asked():
    grey, cmyk = Image.new("L", (3, 3), 7), Image.new("CMYK", (3, 3))
    assert ConvertToRGB()(grey).mode == "RGB"
    assert ConvertToRGB(keep_greyscale=True)(grey) is grey
    assert ConvertToRGB(keep_greyscale=True)(cmyk).mode == "RGB"
    with pytest.raises(ValueError, match="keep_greyscale"):
        ConvertToRGB(keep_greyscale="yes")


@pytest.mark.parametrize("train", [True, False])
def test_glyph_pipeline_on_grey_images_equals_the_torchvision_pipeline_on_rgb(train):
    pipeline, before = build_transforms("glyph", train=train, image_size=48), torchvision_glyph_pipeline(train)
    assert pipeline.accepts_greyscale is True
    for i, glyph in enumerate(random_glyphs(60, seed=4)):
        for image in (glyph, glyph.convert("RGB")):  # grey (the fast path) and RGB input alike
            torch.manual_seed(i)  # the same augmentation draws
            got = pipeline(image)
            torch.manual_seed(i)
            assert torch.equal(got, before(glyph.convert("RGB")))
    assert not hasattr(build_transforms("imagenet", train=False), "accepts_greyscale")
