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
    assert "unicode-data" in text and "Unicode License" in text
    # one row per bundled typeface, in the file's order, each with a package, licence and holder
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "`fonts-" in line]
    bundled = np.load(BUNDLED_GLYPHS_PATH)["font_names"].tolist()
    assert [row[0].lstrip("| ") for row in rows] == bundled
    for row in rows:
        package, licence, holders = row[2], row[3], row[4].rstrip(" |")
        assert package.startswith("`fonts-") and holders
        # a licence name that says nothing by itself must come with its terms
        assert licence and licence != "Original" and "not found" not in licence


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


# Kangxi radical number -> the bundled characters under it, from Unihan kRSUnicode (unicode-data
# 15.0.0, Debian bookworm), so the hierarchy is checked on every run, unicode-data or not:
#   rs = read_unihan_field("kRSUnicode"); z = np.load(BUNDLED_GLYPHS_PATH)
#   by_radical[int(rs[ord(ch)].split()[0].split(".")[0].rstrip("'\\""))] += ch  for ch in z["characters"]
UNIHAN_RADICALS = {
    9: "仁介付企伸位侶俵側傘",
    18: "刀刊判刷刺削前割創劇",
    19: "力功助勅勇勉動勘勝募",
    30: "史含哀品哲唄唾喉喚噴",
    32: "地型城埼堅堪塔塗墾壇",
    37: "大夫央奇奈奉契奔奪奮",
    38: "奴妄妊妹姓委姿威媒嫌",
    40: "宇安完宛宰宴宵家寄密",
    46: "山岡岩岬岳峰崇崎崖嵐",
    50: "市布希帝師席帳常幅幣",
    60: "彼往待律後御復循微徹",
    61: "忌念性恭悟悼意慈慶憩",
    64: "扶承抑抽挑振接搬搾擬",
    72: "旬昆昇春普暗暫暮曇曖",
    75: "本析某染柔柵校桑棺植",
    85: "氾汁汽洗混滑漬漸潮潰",
    86: "灰炎炭焦煎照煩燃燥爆",
    96: "玉玩珍珠現球琴璃環璽",
    102: "田甲申男畏畑略番異畿",
    109: "目盲直眉看眺眼睡督睦",
    115: "私秒租秩移程種穀積穫",
    118: "符第筆筋答算管箱箸籠",
    120: "約純索紳結網綻線編縮",
    130: "肖股肢肯脇脚腕腸腹膝",
    140: "芋花苛苦英荷菓菜葉蓄",
    145: "衣衰袋袖被裁裂裕製襟",
    149: "計討詣詮該誓諾謀識議",
    154: "負貫賃賄資賊賓賜賞質",
    162: "巡返述途通造連週遜適",
    167: "金鉛銀銃錦鍋鍛鎖鏡鐘",
    170: "防降陰陳陸陽隊隔隙障",
    181: "頃順須頑領頻顎願類顧",
}


def test_radicals_match_unihan_reference(splits):
    expected = {ch: radical for radical, chars in UNIHAN_RADICALS.items() for ch in chars}
    seen = set()
    for dataset in splits.values():
        for character_label, radical_label in set(map(tuple, dataset.hierarchical_labels.tolist())):
            character = dataset.characters[character_label]
            assert dataset.radical_numbers[radical_label] == expected[character], character
            seen.add(character)
    assert seen == set(expected)  # all 320 characters, each checked


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


def _bench_glyph_floor():
    from bench import glyph_floor

    return glyph_floor


def test_raw_pixels_do_not_solve_the_protocol(splits):
    # the floor recorded in bench/README.md (python bench/glyph_floor.py): raw pixels, display-family
    # queries vs serif + sans gallery, 160 held-out characters (chance 1/160)
    floor = _bench_glyph_floor()
    test = splits["test"]
    is_query = test.font_families == "display"
    pixels = floor.pixel_features(test)
    recall = floor.recall_at_k(pixels[is_query], pixels[~is_query], test.labels[is_query], test.labels[~is_query])
    assert recall[1] == pytest.approx(0.1125, abs=1e-6)
    assert recall[8] == pytest.approx(0.278125, abs=1e-6)
    # the same Recall@1 by an independent brute force (numpy, float64 cosine, argmax)
    raw = test.pixel_array().reshape(len(test), -1).astype(np.float64)
    raw -= raw.mean(axis=1, keepdims=True)
    raw /= np.linalg.norm(raw, axis=1, keepdims=True)
    nearest = (raw[is_query] @ raw[~is_query].T).argmax(axis=1)
    assert (test.labels[~is_query][nearest] == test.labels[is_query]).mean() == pytest.approx(0.1125, abs=1e-6)
    # the easy protocol (every held-out image against all others, same typeface families on both
    # sides) is easier for pixels: "test R@1" in the same table
    easy = floor.recall_at_k(pixels, pixels, test.labels, test.labels, exclude_self=True)
    assert easy[1] == pytest.approx(0.1771551724137931, abs=1e-6)


def test_untrained_network_floor(splits):
    # an untrained (random-init) CNN is near chance under the protocol: the floor for trained models
    from pml_hyperbolic.backbones import build_backbone

    floor = _bench_glyph_floor()
    test = GlyphDataset(split="test")
    is_query = test.font_families == "display"
    torch.manual_seed(0)
    model, _ = build_backbone("mobilenetv2_100", pretrained=False)
    features = floor.network_features(model, test, image_size=32, batch_size=256)
    recall = floor.recall_at_k(features[is_query], features[~is_query], test.labels[is_query],
                               test.labels[~is_query])
    assert features.shape == (len(test), 1280)
    assert 0.0 < recall[1] < 0.05 and recall[8] < 0.15


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


def test_glyph_pipelines_get_greyscale_and_other_transforms_rgb():
    seen = []

    def record(image):
        seen.append(image.mode)
        return image

    GlyphDataset("query", transform=record)[0]
    record.accepts_greyscale = True  # a transform that says grey in = its RGB conversion in
    GlyphDataset("query", transform=record)[0]
    assert seen == ["RGB", "L"]
    assert GlyphDataset("query")[0][0].mode == "RGB"  # no transform: RGB, as documented
    # the package's glyph pipeline: the same tensors either way
    pipeline = build_transforms("glyph", train=False, image_size=48)
    dataset = GlyphDataset("query", transform=pipeline)
    assert torch.equal(dataset[5][0], pipeline(GlyphDataset("query")[5][0]))


def test_glyph_archive_is_read_once_per_file_version(tmp_path):
    import shutil

    from pml_hyperbolic.data import glyphs

    first, second = GlyphDataset("train"), GlyphDataset("gallery")
    archive = glyphs.read_glyph_archive(BUNDLED_GLYPHS_PATH)
    assert archive is glyphs.read_glyph_archive(BUNDLED_GLYPHS_PATH)  # decoded once
    assert not archive["images"].flags.writeable  # shared between datasets: read-only
    assert first._pixels.flags.writeable  # each split's own pixel array
    with np.load(BUNDLED_GLYPHS_PATH) as z:
        assert np.array_equal(second.pixel_array(), 255 - z["images"][np.ix_(z["char_is_test"], ~np.isin(
            z["font_families"], ["display"]))].reshape(-1, *z["images"].shape[2:]))
    copy = tmp_path / "cjk_glyphs.npz"
    shutil.copy(BUNDLED_GLYPHS_PATH, copy)
    other = glyphs.read_glyph_archive(str(copy))
    assert other is not archive and np.array_equal(other["images"], archive["images"])
    # a rewritten file (new size / time) is read again
    with np.load(copy) as z:
        data = {k: z[k] for k in z.files}
    data["images"] = data["images"][:, :5]
    data["font_names"], data["font_families"] = data["font_names"][:5], data["font_families"][:5]
    os.remove(copy)
    np.savez_compressed(copy, **data)
    assert glyphs.read_glyph_archive(str(copy))["images"].shape[1] == 5
    # an archive without one of its arrays: one clear error
    del data["metadata"]
    broken = tmp_path / "broken.npz"
    np.savez_compressed(broken, **data)
    with pytest.raises(ValueError, match="metadata"):
        GlyphDataset("train", root=str(broken))
