"""The bundled icon-theme dataset (``IconDataset``) and its builder (``build_icons``)."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from PIL import Image, ImageDraw

from pml_hyperbolic.data import BUNDLED_ICONS_PATH, IconDataset, build_dataset, find_dataset_root
from pml_hyperbolic.data import build_icons
from pml_hyperbolic.data.icons import read_icon_archive


@pytest.fixture(scope="module")
def archive():
    return read_icon_archive(BUNDLED_ICONS_PATH)


def test_bundled_file_is_small_and_complete(archive):
    assert os.path.getsize(BUNDLED_ICONS_PATH) <= 8.5e6
    images = archive["images"]
    assert images.dtype == np.uint8 and images.ndim == 4 and images.shape[-1] == 3
    assert images.shape[1] == images.shape[2] == json.loads(str(archive["metadata"]))["image_size"]
    n, c = len(images), len(archive["class_names"])
    assert archive["item_classes"].shape == archive["item_themes"].shape == (n,)
    assert archive["item_classes"].min() == 0 and archive["item_classes"].max() == c - 1
    assert len(set(archive["class_names"].tolist())) == c >= 300
    assert set(archive["theme_groups"].tolist()) == {"query", "gallery"}
    # every parent index names a kept freedesktop context; emotes are never classes
    assert set(archive["parent_names"][archive["class_parents"]].tolist()) <= set(build_icons.PARENTS)
    assert not any(name.startswith("face-") for name in archive["class_names"].tolist())
    # no (class, theme) pair twice
    pairs = archive["item_classes"].astype(np.int64) * 1000 + archive["item_themes"]
    assert len(np.unique(pairs)) == n


def test_white_background_not_black(archive):
    corners = archive["images"][:, [0, 0, -1, -1], [0, -1, 0, -1]]
    assert (corners.min(axis=-1) >= 200).mean() > 0.9


def test_splits_disjoint_and_consistent():
    train, test = IconDataset("train"), IconDataset("test")
    query, gallery = IconDataset("query"), IconDataset("gallery")
    assert set(train.class_names.tolist()).isdisjoint(test.class_names.tolist())
    assert len(train) + len(test) == len(read_icon_archive(BUNDLED_ICONS_PATH)["images"])
    assert len(query) + len(gallery) == len(test)
    assert set(query.theme_names.tolist()).isdisjoint(gallery.theme_names.tolist())
    assert set(query.theme_groups.tolist()) == {"query"} and set(gallery.theme_groups.tolist()) == {"gallery"}
    # query and gallery share a label space; every query class has gallery items
    assert query.num_classes == gallery.num_classes == test.num_classes
    assert list(query.class_names) == list(gallery.class_names)
    assert set(query.labels.tolist()) <= set(gallery.labels.tolist())
    # the parent level exists on both sides
    assert train.num_super_classes == test.num_super_classes >= 6
    for ds in (train, test, query, gallery):
        assert ds.labels.dtype == np.int64 and ds.labels.min() >= 0 and ds.labels.max() < ds.num_classes
        assert ds.super_labels.max() < ds.num_super_classes
        assert ds.hierarchical_labels.shape == (len(ds), 2)
        # one parent per class
        pairs = np.unique(ds.hierarchical_labels, axis=0)
        assert len(pairs) == len(np.unique(ds.labels))


def test_getitem_returns_pil_or_transformed():
    ds = IconDataset("query")
    image, label = ds[0]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (ds.image_size,) * 2
    assert isinstance(label, int) and label == ds.labels[0]
    np.testing.assert_array_equal(np.asarray(image), ds.pixel_array()[0])
    shaped = IconDataset("query", transform=lambda im: np.asarray(im).shape)
    assert shaped[0] == ((ds.image_size, ds.image_size, 3), label)
    assert "IconDataset(split='query'" in repr(ds)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="split"):
        IconDataset("validation")
    with pytest.raises(ValueError, match="transform"):
        IconDataset("train", transform="resize")
    with pytest.raises(FileNotFoundError, match="build_icons"):
        IconDataset("train", root=tmp_path)
    bad = tmp_path / "icon_themes.npz"
    np.savez(bad, images=np.zeros((1, 4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match="lacks"):
        IconDataset("train", root=tmp_path)
    for argv in (["--size", "2"], ["--min-themes", "1"], ["--max-classes", "0"]):
        with pytest.raises(SystemExit):
            build_icons.main(argv)


def test_registry_finds_bundled_icons():
    assert os.path.samefile(find_dataset_root("icons"), os.path.dirname(BUNDLED_ICONS_PATH))
    ds = build_dataset("icon-themes", "gallery")
    assert isinstance(ds, IconDataset) and ds.split == "gallery"
    with pytest.raises(ValueError):
        build_dataset("icons", "val")


def test_same_icon_across_themes_is_closer_in_pixels():
    # frozen-feature sanity: raw pixels of one icon drawn by two themes are closer than two icons
    ds = IconDataset("test")
    x = ds.pixel_array().reshape(len(ds), -1).astype(np.float32) / 255
    x = x - x.mean(axis=1, keepdims=True)
    x /= np.linalg.norm(x, axis=1, keepdims=True) + 1e-6
    sim = x @ x.T
    same = ds.labels[:, None] == ds.labels[None, :]
    off_diag = ~np.eye(len(ds), dtype=bool)
    assert sim[same & off_diag].mean() > sim[~same].mean()


# ---- builder on a tiny synthetic theme tree ---------------------------------------------------------

_SHAPES = ("ellipse", "rectangle", "triangle", "cross", "bar", "ring")


def _draw(shape: str, colour, offset: int, size: int = 32) -> Image.Image:
    image = Image.new("RGBA", (size, size), (0, 0, 0, 0))
    draw = ImageDraw.Draw(image)
    a, b = 4 + offset, size - 5 + offset // 2
    if shape == "ellipse":
        draw.ellipse([a, a, b, b], fill=colour)
    elif shape == "rectangle":
        draw.rectangle([a, a, b, b], fill=colour)
    elif shape == "triangle":
        draw.polygon([(a, b), (b, b), ((a + b) // 2, a)], fill=colour)
    elif shape == "cross":
        draw.line([a, a, b, b], fill=colour, width=5)
        draw.line([a, b, b, a], fill=colour, width=5)
    elif shape == "bar":
        draw.rectangle([a, size // 2 - 4, b, size // 2 + 4], fill=colour)
    else:
        draw.ellipse([a, a, b, b], outline=colour, width=5)
    return image


def _write_theme(root, folder, colour, offset, names, svg=False, copy_from=None):
    theme = root / folder
    directories = {"32x32/apps": "Applications", "32x32/actions": "Actions"}
    if svg:
        directories["scalable/places"] = "Places"
    lines = ["[Icon Theme]", f"Name={folder}", "Directories=" + ",".join(directories), ""]
    for directory, context in directories.items():
        kind = "Scalable" if directory.startswith("scalable") else "Fixed"
        lines += [f"[{directory}]", "Size=32", f"Context={context}", f"Type={kind}", ""]
        (theme / directory).mkdir(parents=True)
    (theme / "index.theme").write_text("\n".join(lines))
    if copy_from is not None:
        for directory in directories:
            for path in sorted((root / copy_from / directory).glob("*")):
                shutil.copy(path, theme / directory / path.name)
        return
    for i, name in enumerate(names):
        context = "32x32/apps" if i % 2 == 0 else "32x32/actions"
        _draw(_SHAPES[i % len(_SHAPES)], colour, offset).save(theme / context / f"{name}.png")
    # an alias: the same drawing linked under a second name, in every theme
    os.symlink(f"{names[0]}.png", theme / "32x32/apps" / "alias-of-first.png")
    if svg:
        (theme / "scalable/places" / "folder-symbolic.svg").write_text(
            '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16">'
            f'<rect x="2" y="4" width="{10 + offset}" height="9" fill="#555"/></svg>')
        (theme / "scalable/places" / "folder.svg").write_text(
            '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16">'
            f'<path d="M1 3h6l2 2h6v{8 + offset // 2}H1z" fill="rgb({colour[0]},{colour[1]},{colour[2]})"/></svg>')


def _tiny_tree(tmp_path, svg=False):
    root = tmp_path / "icons"
    names = [f"icon-{k}" for k in range(6)]
    specs = []
    palette = [((200, 30, 30, 255), 0), ((30, 140, 30, 255), 2), ((30, 30, 200, 255), 4),
               ((120, 60, 160, 255), 1)]
    for t, (colour, offset) in enumerate(palette):
        folder = f"Theme{t}"
        _write_theme(root, folder, colour, offset, names, svg=svg)
        specs.append(build_icons.ThemeSpec(f"theme{t}", f"no-such-package-{t}", folder,
                                           "query" if t % 2 == 0 else "gallery"))
    _write_theme(root, "Copycat", None, 0, names, svg=svg, copy_from="Theme0")
    specs.append(build_icons.ThemeSpec("copycat", "no-such-package-c", "Copycat", "gallery"))
    return root, specs, names


def _build(root, specs, out, **kwargs):
    return build_icons.build(str(out), size=24, min_themes=3, seed=0, icon_root=str(root), themes=specs,
                             license_output=str(out) + ".md", workers=1, verbose=False, **kwargs)


def test_builder_on_tiny_png_tree_is_deterministic(tmp_path):
    root, specs, names = _tiny_tree(tmp_path)
    meta = _build(root, specs, tmp_path / "a.npz")
    _build(root, specs, tmp_path / "b.npz")
    with np.load(tmp_path / "a.npz") as a, np.load(tmp_path / "b.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for key in a.files:
            np.testing.assert_array_equal(a[key], b[key])
        classes = a["class_names"].tolist()
        # six names; the alias loses every drawing to the class it copies
        assert sorted(classes) == sorted(names)
        parents = dict(zip(classes, a["parent_names"][a["class_parents"]].tolist()))
        assert parents["icon-0"] == "apps" and parents["icon-1"] == "actions"
        # the copycat theme's drawings are copies of theme0's: all dropped
        assert "copycat" not in set(a["theme_names"][a["item_themes"]].tolist())
        assert a["images"].shape == (len(classes) * 4, 24, 24, 3)
        assert (a["images"][:, 0, 0] == 255).all()  # transparent corner -> white
        # half of each parent's classes held out (rounded half up, never all of them)
        for p in np.unique(a["class_parents"]):
            members = a["class_is_test"][a["class_parents"] == p]
            assert members.sum() == min((len(members) + 1) // 2, len(members) - 1)
    assert meta["num_classes"] == len(names) and meta["themes"]["copycat"]["images"] == 0
    assert "theme0" in open(str(tmp_path / "a.npz") + ".md").read().lower()
    ds = IconDataset("query", root=tmp_path / "a.npz")
    assert set(ds.theme_names.tolist()) == {"theme0", "theme2"}


def test_builder_max_classes_and_too_few_themes(tmp_path):
    root, specs, names = _tiny_tree(tmp_path)
    meta = _build(root, specs, tmp_path / "c.npz", max_classes=3)
    assert meta["num_classes"] == 3
    with pytest.raises(ValueError, match="two"):
        _build(root, specs[:1], tmp_path / "d.npz")


def test_choose_source_prefers_full_colour_vector():
    C = build_icons.Candidate
    options = [C("a/16/x.png", "apps", 16, False, False), C("a/64/x.png", "apps", 64, False, False),
               C("a/128/x.png", "apps", 128, False, False), C("a/scalable/x-symbolic.svg", "apps", 16, True, True)]
    assert build_icons.choose_source(options, 48).path == "a/64/x.png"
    options.append(C("a/scalable/x.svg", "apps", 48, True, False))
    assert build_icons.choose_source(options, 48).path == "a/scalable/x.svg"
    assert build_icons.normalise_name("edit-copy-symbolic.svg") == ("edit-copy", True)
    assert build_icons.normalise_context("MimeTypes") == "mimetypes"
    assert build_icons.normalise_context("Legacy") is None


@pytest.mark.skipif(shutil.which("rsvg-convert") is None, reason="rsvg-convert (librsvg2-bin) not installed")
def test_builder_rasterises_svg(tmp_path):
    root, specs, names = _tiny_tree(tmp_path, svg=True)
    _build(root, specs, tmp_path / "s.npz")
    with np.load(tmp_path / "s.npz") as a:
        classes = a["class_names"].tolist()
        assert "folder" in classes and "folder-symbolic" not in classes
        k = classes.index("folder")
        assert a["parent_names"][a["class_parents"][k]] == "places"
        images = a["images"][a["item_classes"] == k]
        # the full-colour drawing was chosen over the grey symbolic one: a saturated colour appears
        spread = images.max(axis=-1).astype(int) - images.min(axis=-1)
        assert (spread.reshape(len(images), -1).max(axis=1) >= 90).all()  # the symbolic one is grey (0)
