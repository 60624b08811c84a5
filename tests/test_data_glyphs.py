"""The bundled glyph dataset: shape, split disjointness, hierarchy, protocol, transforms."""

import os
from collections import Counter

import numpy as np
import pytest
import torch

from pml_hyperbolic.data import BUNDLED_GLYPHS_PATH, GlyphDataset, build_dataset, build_transforms


@pytest.fixture(scope="module")
def splits():
    return {split: GlyphDataset(split=split) for split in GlyphDataset.SPLITS}


def test_bundled_file_is_small_and_licensed():
    assert os.path.getsize(BUNDLED_GLYPHS_PATH) < 8e6
    licence_file = os.path.join(os.path.dirname(BUNDLED_GLYPHS_PATH), "GLYPHS_LICENSES.md")
    text = open(licence_file, encoding="utf-8").read()
    assert "Noto" in text and "unicode-data" in text


def test_shapes_and_label_arrays(splits):
    train = splits["train"]
    assert len(train) == train.num_classes * len(set(train.font_names))
    image, label = train[0]
    assert image.mode == "RGB" and image.size == (train.image_size, train.image_size)
    assert 32 <= train.image_size <= 64
    assert label == train.labels[0]
    for dataset in splits.values():
        assert dataset.labels.dtype == np.int64 and dataset.super_labels.dtype == np.int64
        assert dataset.hierarchical_labels.shape == (len(dataset), 2)
        assert np.array_equal(dataset.hierarchical_labels[:, 0], dataset.labels)
        assert np.array_equal(dataset.hierarchical_labels[:, 1], dataset.super_labels)
        assert set(dataset.super_labels.tolist()) == set(range(dataset.num_super_classes))
    assert set(train.labels.tolist()) == set(range(train.num_classes))
    assert train.num_classes >= 100 and train.num_super_classes >= 20


def test_class_split_is_disjoint_and_radicals_shared(splits):
    train_chars = set(splits["train"].characters.tolist())
    test_chars = set(splits["test"].characters.tolist())
    assert not train_chars & test_chars
    assert set(splits["train"].radicals.tolist()) == set(splits["test"].radicals.tolist())


def test_hierarchy_is_a_tree(splits):
    for dataset in splits.values():
        pairs = set(map(tuple, dataset.hierarchical_labels.tolist()))
        assert len(pairs) == dataset.num_classes  # each character has exactly one radical
        characters_per_radical = Counter(radical for _, radical in pairs)
        assert min(characters_per_radical.values()) >= 2  # a real two-level hierarchy


@pytest.mark.slow
def test_radicals_agree_with_unihan(splits):
    """Where Debian's unicode-data is installed, check the radicals against kRSUnicode."""
    from pml_hyperbolic.data.build_glyphs import read_unihan_field

    try:
        radical_strokes = read_unihan_field("kRSUnicode")
    except (FileNotFoundError, OSError):
        pytest.skip("unicode-data not installed")
    train = splits["train"]
    for character_label, radical_label in set(map(tuple, train.hierarchical_labels.tolist())):
        code = ord(train.characters[character_label])
        radical = int(radical_strokes[code].split()[0].split(".")[0].rstrip("'\""))
        assert radical == train.radical_numbers[radical_label]


def test_query_gallery_protocol(splits):
    query, gallery, test = splits["query"], splits["gallery"], splits["test"]
    assert len(query) + len(gallery) == len(test)
    assert set(query.font_families.tolist()) == {"display"}
    assert "display" not in set(gallery.font_families.tolist())
    assert not set(query.font_names.tolist()) & set(gallery.font_names.tolist())
    # one label space: the same label means the same character in both
    assert np.array_equal(query.characters, gallery.characters)
    assert query.num_classes == gallery.num_classes == test.num_classes
    for label in (0, query.num_classes - 1):
        assert (gallery.labels == label).sum() == len(set(gallery.font_names))


def test_raw_pixels_do_not_solve_the_protocol(splits):
    query, gallery = splits["query"], splits["gallery"]

    def centred(dataset):
        x = dataset.pixel_array().reshape(len(dataset), -1).astype(np.float32)
        x -= x.mean(axis=1, keepdims=True)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    nearest = (centred(query) @ centred(gallery).T).argmax(axis=1)
    recall_at_1 = (gallery.labels[nearest] == query.labels).mean()
    assert 1.0 / query.num_classes < recall_at_1 < 0.4


def test_transforms_and_build_dataset():
    train = build_dataset("glyphs", "train", transform=build_transforms("glyph", train=True))
    image, label = train[3]
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32
    evaluation = build_dataset("glyphs", "gallery", transform=build_transforms("glyph", False, image_size=48))
    assert evaluation[0][0].shape == (3, 48, 48)
    torch.manual_seed(0)
    a = build_transforms("glyph", train=True)(GlyphDataset("train")[0][0])
    b = build_transforms("glyph", train=True)(GlyphDataset("train")[0][0])
    assert not torch.equal(a, b)  # augmentation is random


def test_imagenet_transforms_shapes_and_rgb():
    from PIL import Image

    grey = Image.new("L", (300, 280), 128)
    cmyk = Image.new("CMYK", (260, 400), (0, 50, 100, 0))
    for image in (grey, cmyk):
        assert build_transforms("imagenet", train=True)(image).shape == (3, 224, 224)
        assert build_transforms("imagenet", train=False)(image).shape == (3, 224, 224)
    with pytest.raises(ValueError):
        build_transforms("mnist")


def test_bad_split_and_missing_file(tmp_path):
    with pytest.raises(ValueError):
        GlyphDataset(split="validation")
    with pytest.raises(FileNotFoundError, match="build_glyphs"):
        GlyphDataset(root=str(tmp_path))
