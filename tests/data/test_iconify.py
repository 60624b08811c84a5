"""The bundled Iconify icon-set dataset (``IconifyDataset``) and its builder (``build_iconify``)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image

from pml_hyperbolic.data import BUNDLED_ICONIFY_PATH, IconifyDataset, build_dataset, find_dataset_root
from pml_hyperbolic.data import build_iconify
from pml_hyperbolic.data.iconify import read_iconify_archive


@pytest.fixture(scope="module")
def archive():
    return read_iconify_archive(BUNDLED_ICONIFY_PATH)


def test_bundled_file_is_small_and_complete(archive):
    assert os.path.getsize(BUNDLED_ICONIFY_PATH) <= 8.5e6
    images = archive["images"]
    assert images.dtype == np.uint8 and images.ndim == 3
    meta = json.loads(str(archive["metadata"]))
    assert images.shape[1] == images.shape[2] == meta["image_size"]
    n, c = len(images), len(archive["class_names"])
    assert archive["item_classes"].shape == archive["item_sets"].shape == archive["item_icons"].shape == (n,)
    assert archive["item_classes"].min() == 0 and archive["item_classes"].max() == c - 1
    assert len(set(archive["class_names"].tolist())) == c >= 500
    assert set(archive["set_groups"].tolist()) == {"query", "gallery"}
    # every set is pinned to a version, permissively licensed, and none is emoji/flag/logo artwork
    sets = meta["sets"]
    assert set(sets) == set(archive["set_names"].tolist())
    for prefix, info in sets.items():
        assert info["version"] and info["license"] in build_iconify.PERMISSIVE_LICENSES
        assert not any(word in prefix for word in ("emoji", "flag", "logo", "brand"))
    assert not any(build_iconify.is_brand_name(name) for name in archive["class_names"].tolist())
    # no (class, set) pair twice; at least min_sets sets per class, from both groups
    pairs = archive["item_classes"].astype(np.int64) * 1000 + archive["item_sets"]
    assert len(np.unique(pairs)) == n
    per_class = np.bincount(archive["item_classes"].astype(np.int64))
    assert per_class.min() >= meta["min_sets"]
    groups = archive["set_groups"][archive["item_sets"]]
    for k in range(0, c, 37):
        assert set(groups[archive["item_classes"] == k].tolist()) == {"query", "gallery"}


def test_black_ink_on_white(archive):
    images = archive["images"]
    corners = images[:, [0, 0, -1, -1], [0, -1, 0, -1]]
    assert (corners.min(axis=-1) >= 200).mean() > 0.9
    # every drawing has ink, and is not a filled square
    ink = (images < 128).reshape(len(images), -1).mean(axis=1)
    assert ink.min() > 0.0 and np.median(ink) < 0.5
    assert images.min() == 0


def test_splits_disjoint_and_consistent(archive):
    train, test = IconifyDataset("train"), IconifyDataset("test")
    query, gallery = IconifyDataset("query"), IconifyDataset("gallery")
    assert set(train.class_names.tolist()).isdisjoint(test.class_names.tolist())
    assert len(train) + len(test) == len(archive["images"])
    assert len(query) + len(gallery) == len(test)
    assert set(query.set_names.tolist()).isdisjoint(gallery.set_names.tolist())
    assert set(query.set_groups.tolist()) == {"query"} and set(gallery.set_groups.tolist()) == {"gallery"}
    # query and gallery share a label space; every query class has gallery items
    assert query.num_classes == gallery.num_classes == test.num_classes
    assert list(query.class_names) == list(gallery.class_names)
    assert set(query.labels.tolist()) <= set(gallery.labels.tolist())
    # the topic level exists on both sides, with at least two classes each
    assert list(train.parent_names) == list(test.parent_names) and train.num_super_classes >= 10
    for ds in (train, test):
        per_topic = np.bincount(np.unique(ds.hierarchical_labels, axis=0)[:, 1])
        assert per_topic.min() >= 2
    for ds in (train, test, query, gallery):
        assert ds.labels.dtype == np.int64 and ds.labels.min() >= 0 and ds.labels.max() < ds.num_classes
        assert ds.super_labels.max() < ds.num_super_classes
        assert ds.hierarchical_labels.shape == (len(ds), 2)
        assert ds.parent_labels is ds.super_labels
        # one parent per class, and the parent is the topic of the class name
        pairs = np.unique(ds.hierarchical_labels, axis=0)
        assert len(pairs) == len(np.unique(ds.labels))
        for label, parent in pairs:
            topic = build_iconify.topic_of(str(ds.class_names[label]))
            assert ds.parent_names[parent] in (topic, build_iconify.OTHER_TOPIC)


def test_getitem_returns_pil_or_transformed():
    ds = IconifyDataset("query")
    image, label = ds[0]
    assert isinstance(image, Image.Image) and image.mode == "L" and image.size == (ds.image_size,) * 2
    assert isinstance(label, int) and label == ds.labels[0]
    np.testing.assert_array_equal(np.asarray(image), ds.pixel_array()[0])
    assert ds.pixel_array().shape == (len(ds), ds.image_size, ds.image_size)
    shaped = IconifyDataset("query", transform=lambda im: np.asarray(im).shape)
    assert shaped[0] == ((ds.image_size, ds.image_size), label)
    assert "IconifyDataset(split='query'" in repr(ds)
    assert ds.icon_names.shape == ds.set_names.shape == (len(ds),)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="split"):
        IconifyDataset("validation")
    with pytest.raises(ValueError, match="transform"):
        IconifyDataset("train", transform="resize")
    with pytest.raises(FileNotFoundError, match="build_iconify"):
        IconifyDataset("train", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="build_iconify"):
        IconifyDataset("train", root=tmp_path / "nowhere.npz")
    # another dataset's file (here the bundled freedesktop icons) is refused with one message
    foreign = tmp_path / "iconify_sets.npz"
    np.savez(foreign, images=np.zeros((1, 4, 4, 3), np.uint8), item_themes=np.zeros(1, np.int16))
    with pytest.raises(ValueError, match="lacks"):
        IconifyDataset("train", root=tmp_path)
    from pml_hyperbolic.data import BUNDLED_ICONS_PATH

    with pytest.raises(ValueError, match="Iconify.*lacks"):
        IconifyDataset("test", root=BUNDLED_ICONS_PATH)
    for argv in (["--size", "2"], ["--min-sets", "1"], ["--max-classes", "0"]):
        with pytest.raises(SystemExit):
            build_iconify.main(argv)


def test_registry_finds_bundled_iconify():
    assert os.path.samefile(find_dataset_root("iconify"), os.path.dirname(BUNDLED_ICONIFY_PATH))
    ds = build_dataset("iconify", "gallery")
    assert isinstance(ds, IconifyDataset) and ds.split == "gallery"
    assert isinstance(build_dataset("iconify-sets", "query"), IconifyDataset)
    with pytest.raises(ValueError):
        build_dataset("iconify", "val")
    from pml_hyperbolic.training.config import BUNDLED_DATASETS, DATASET_ALIASES
    from pml_hyperbolic.training.evaluation import eval_protocol

    assert "iconify" in BUNDLED_DATASETS and DATASET_ALIASES["iconify"] == "iconify"
    assert eval_protocol("iconify") == [("query", ["gallery"])]


def test_same_icon_across_sets_is_closer_in_pixels():
    # frozen-feature sanity: raw pixels of one concept drawn by two sets are closer than two concepts
    ds = IconifyDataset("test")
    x = ds.pixel_array().reshape(len(ds), -1).astype(np.float32) / 255
    x = x - x.mean(axis=1, keepdims=True)
    x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-6
    sim = x @ x.T
    same = ds.labels[:, None] == ds.labels[None, :]
    off_diag = ~np.eye(len(ds), dtype=bool)
    assert sim[same & off_diag].mean() > sim[~same].mean()


# ---- builder pieces and a tiny synthetic set of packages ------------------------------------------------

def test_normalise_names_keeps_one_style_per_set():
    spec = build_iconify.SetSpec("demo", "1.0.0", "query", ("line", "fill"), ("line", ""))
    names = ["home-line", "home-fill", "bell-fill", "bell", "chart-line-line", "star-01", "star-02",
             "user-2", "user", "ad-2"]
    got = build_iconify.normalise_names(names, spec)
    assert got["home"] == "home-line"          # the preferred style
    assert got["bell"] == "bell"               # the fill variant is never used
    assert got["chart-line"] == "chart-line-line"  # only the style suffix is stripped
    assert got["star"] == "star-01"            # numbered variant stands for the base, lowest number
    assert got["user"] == "user" and got["user-2"] == "user-2"  # the base exists: number kept
    assert got["ad"] == "ad-2"
    fluent = next(s for s in build_iconify.SET_SPECS if s.prefix == "fluent")
    assert build_iconify.normalise_names(["mail-20-regular", "mail-24-regular", "mail-24-filled"],
                                         fluent) == {"mail": "mail-24-regular"}


def test_topics_and_brands():
    assert build_iconify.topic_of("arrow-left") == "arrows"
    assert build_iconify.topic_of("file-text") == "files"
    assert build_iconify.topic_of("cloud-upload") == "nature"
    assert build_iconify.topic_of("zzz-qqq") == build_iconify.OTHER_TOPIC
    assert build_iconify.is_brand_name("brand-github") and build_iconify.is_brand_name("google")
    assert not build_iconify.is_brand_name("bell-off")


def test_excluded_sets_are_refused():
    ok = {"license": {"spdx": "MIT"}, "category": "UI 24px"}
    build_iconify.check_set_allowed(ok, "tabler")
    with pytest.raises(ValueError, match="emoji"):
        build_iconify.check_set_allowed({"license": {"spdx": "MIT"}, "category": "Emoji"}, "anything")
    with pytest.raises(ValueError, match="emoji"):
        build_iconify.check_set_allowed(ok, "fluent-emoji-flat")
    with pytest.raises(ValueError, match="emoji"):
        build_iconify.check_set_allowed(ok, "twemoji")
    with pytest.raises(ValueError, match="licence"):
        build_iconify.check_set_allowed({"license": {"spdx": "GPL-3.0"}, "category": "UI 24px"}, "demo")
    for spec in build_iconify.SET_SPECS:  # the pinned sets pass the name rule
        assert not any(word in spec.prefix for word in ("emoji", "flag", "logo", "brand"))


def test_icon_svg_viewbox_and_flip():
    icon_set = {"width": 24, "height": 24, "icons": {"a": {"body": "<path d='M0 0h1v1z'/>"},
                                                     "b": {"body": "<g/>", "width": 32, "left": -4, "hFlip": True}}}
    text = build_iconify.icon_svg(icon_set, "a")
    assert 'viewBox="0 0 24 24"' in text and "M0 0h1v1z" in text and "#000000" in text
    flipped = build_iconify.icon_svg(icon_set, "b")
    assert 'viewBox="-4 0 32 24"' in flipped and "scale(-1 1)" in flipped


_SHAPES = {
    "ring": "<circle cx='12' cy='12' r='8' fill='none' stroke='currentColor' stroke-width='{w}'/>",
    "bar": "<rect x='3' y='{o}' width='18' height='6' fill='currentColor'/>",
    "cross": "<path d='M4 4L20 20M20 4L4 20' stroke='currentColor' stroke-width='{w}'/>",
    "tri": "<path d='M12 3L21 21H3z' fill='none' stroke='currentColor' stroke-width='{w}'/>",
    "slash": "<path d='M4 20L20 4' stroke='currentColor' stroke-width='{w}'/>",
}


def _fake_sets(root, count=4):
    specs = []
    for k in range(count):
        prefix = f"demo{k}"
        icons = {}
        for shape, body in _SHAPES.items():
            icons[f"{shape}-line"] = {"body": body.format(w=1 + k, o=3 + 2 * k)}
            icons[f"{shape}-fill"] = {"body": "<rect width='24' height='24' fill='currentColor'/>"}
        icons["brand-github-line"] = {"body": _SHAPES["ring"].format(w=3, o=0)}
        icons["ring-alias-line"] = dict(icons["ring-line"])  # a second name for the same drawing
        icons["hidden-line"] = {"body": _SHAPES["bar"].format(w=1, o=3), "hidden": True}
        folder = root / prefix
        folder.mkdir(parents=True)
        (folder / "icons.json").write_text(json.dumps({"prefix": prefix, "icons": icons, "width": 24, "height": 24}))
        (folder / "info.json").write_text(json.dumps({
            "name": f"Demo {k}", "license": {"spdx": "MIT", "url": "https://example.org/LICENSE"},
            "author": {"name": f"Artist {k}"}, "category": "UI 24px", "version": "1.0"}))
        specs.append(build_iconify.SetSpec(prefix, "0.0.1", "query" if k % 2 == 0 else "gallery",
                                           ("line", "fill"), ("line",)))
    # a copycat set: the same artwork as demo0 under the same names
    copy = root / "copycat"
    shutil.copytree(root / "demo0", copy)
    specs.append(build_iconify.SetSpec("copycat", "0.0.1", "gallery", ("line", "fill"), ("line",)))
    return specs


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="rsvg-convert (librsvg2-bin) not installed")
def test_builder_on_tiny_sets_is_deterministic(tmp_path):
    specs = _fake_sets(tmp_path / "src")

    def run(out, **kwargs):
        return build_iconify.build(str(out), str(tmp_path / "src"), size=24, min_sets=3, seed=0, specs=specs,
                                   license_output=str(out) + ".md", workers=1, verbose=False,
                                   min_topic_classes=1, **kwargs)

    meta = run(tmp_path / "a.npz")
    run(tmp_path / "b.npz")
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key])
        classes = a["class_names"].tolist()
        # the brand name never becomes a class, the alias loses its drawings, the hidden icon is skipped
        assert sorted(classes) == sorted(_SHAPES)
        assert a["images"].shape[1:] == (24, 24) and a["images"].dtype == np.uint8
        assert (a["images"][:, 0, 0] == 255).all()
        # the line style was used, never the filled square
        assert (a["images"] < 128).reshape(len(a["images"]), -1).mean(axis=1).max() < 0.6
        # the copycat's drawings copy demo0's: all dropped
        assert "copycat" not in set(a["set_names"][a["item_sets"]].tolist())
        assert json.loads(str(a["metadata"]))["sets"]["demo1"]["version"] == "0.0.1"
    assert meta["num_classes"] == len(_SHAPES) and meta["sets"]["copycat"]["images"] == 0
    text = open(str(tmp_path / "a.npz") + ".md").read()
    assert "Artist 0" in text and "MIT" in text
    ds = IconifyDataset("query", root=tmp_path / "a.npz")
    assert set(ds.set_names.tolist()) == {"demo0", "demo2"}
    assert run(tmp_path / "c.npz", max_classes=2)["num_classes"] == 2
    with pytest.raises(ValueError, match="two"):
        build_iconify.build(str(tmp_path / "d.npz"), str(tmp_path / "src"), specs=specs[:1], verbose=False)


def test_builder_refuses_wrong_version(tmp_path):
    specs = _fake_sets(tmp_path / "src", count=2)
    (tmp_path / "src" / "demo0" / "package.json").write_text(json.dumps({"version": "9.9.9"}))
    with pytest.raises(ValueError, match="pinned"):
        build_iconify.load_set(str(tmp_path / "src"), specs[0])
