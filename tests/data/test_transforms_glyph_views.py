"""Glyph views for self-supervised contrast (HCL's object views): ``RandomStrokeWeight`` and
``glyph_view_transform``: values, bad arguments, shapes, and the recipe's ``--view-augmentation``."""
import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from pml_hyperbolic.data.transforms import RandomStrokeWeight, glyph_view_transform
from pml_hyperbolic.training.presets import GLYPH_VIEW_AUGMENTATIONS, HCL_GLYPH_VIEW_AUGMENTATION
from pml_hyperbolic.training.scene_objects import ComposedGlyphScenes, default_view_transform


def glyph(mode="L", size=64):
    """A black cross of 4-pixel strokes on white paper."""
    a = np.full((size, size), 255, dtype=np.uint8)
    a[size // 2 - 2:size // 2 + 2, 8:-8] = 0
    a[8:-8, size // 2 - 2:size // 2 + 2] = 0
    image = Image.fromarray(a)
    return image if mode == "L" else image.convert(mode)


def dark_pixels(image):
    return int((np.asarray(image.convert("L")) < 128).sum())


def ink(image):
    """Total darkness: sum of (255 - grey value)."""
    return int((255 - np.asarray(image.convert("L"), dtype=np.int64)).sum())


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_stroke_weight_is_the_blend_with_a_3x3_min_or_max_filter(mode):
    image = glyph(mode)
    for seed in range(12):
        torch.manual_seed(seed)
        draw = torch.rand(3).tolist()  # what the transform draws: apply?, direction, strength
        torch.manual_seed(seed)
        got = RandomStrokeWeight(bolder=0.9, lighter=0.4, p=0.7)(image)
        if draw[0] >= 0.7:
            want = image
        else:
            bolder = draw[1] < 0.5
            alpha = draw[2] * (0.9 if bolder else 0.4)
            filtered = image.filter(ImageFilter.MinFilter(3) if bolder else ImageFilter.MaxFilter(3))
            want = Image.blend(image, filtered, alpha)
        assert got.mode == mode and got.size == image.size
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_full_strength_widens_or_narrows_every_stroke_by_one_pixel_per_side():
    image = glyph()
    bolder = Image.blend(image, image.filter(ImageFilter.MinFilter(3)), 1.0)
    # a 4-px stroke becomes 6 px wide: the cross's arms gain 2 px of width each (48-px arms, 4 arm ends)
    assert dark_pixels(bolder) > dark_pixels(image)
    torch.manual_seed(0)
    seen = {ink(RandomStrokeWeight(p=1.0)(image)) for _ in range(40)}
    assert min(seen) < ink(image) < max(seen)  # both directions occur
    assert max(seen) <= ink(bolder)


def test_stroke_weight_identity_settings():
    image = glyph("RGB")
    torch.manual_seed(0)
    for transform in (RandomStrokeWeight(p=0.0), RandomStrokeWeight(bolder=0.0, lighter=0.0, p=1.0)):
        np.testing.assert_array_equal(np.asarray(transform(image)), np.asarray(image))


def test_stroke_weight_always_draws_three_numbers():
    torch.manual_seed(3)
    RandomStrokeWeight(p=0.0)(glyph())
    after_identity = torch.rand(1)
    torch.manual_seed(3)
    RandomStrokeWeight(p=1.0)(glyph())
    assert torch.equal(after_identity, torch.rand(1))


@pytest.mark.parametrize("kwargs", [{"bolder": 1.5}, {"lighter": -0.1}, {"p": 2}, {"p": True}, {"bolder": "1"}])
def test_stroke_weight_refuses_bad_arguments(kwargs):
    with pytest.raises(ValueError, match="must be a number in"):
        RandomStrokeWeight(**kwargs)


def test_stroke_weight_refuses_non_images():
    with pytest.raises(ValueError, match="greyscale .* or RGB PIL image"):
        RandomStrokeWeight()(torch.zeros(3, 8, 8))
    with pytest.raises(ValueError, match="mode 'CMYK'"):
        RandomStrokeWeight()(glyph().convert("CMYK"))


@pytest.mark.parametrize("augmentation", GLYPH_VIEW_AUGMENTATIONS)
def test_glyph_views_shape_and_range(augmentation):
    torch.manual_seed(0)
    transform = glyph_view_transform(48, augmentation=augmentation)
    views = [transform(glyph("RGB", 40)) for _ in range(4)]
    for v in views:
        assert v.shape == (3, 48, 48) and v.dtype == torch.float32 and torch.isfinite(v).all()
    assert not torch.equal(views[0], views[1])  # random


def test_font_views_keep_the_glyph_and_white_paper():
    torch.manual_seed(1)
    transform = glyph_view_transform(64, augmentation="font")
    image = glyph("RGB", 40)
    for _ in range(10):
        v = transform(image)
        grey = v[0] * 0.229 + 0.485  # back to [0, 1] (channel 0)
        corners = torch.stack([grey[0, 0], grey[0, -1], grey[-1, 0], grey[-1, -1]])
        assert (corners > 0.95).all()  # paper stays white: the affine fills with 255
        assert (grey < 0.5).float().mean() > 0.03  # strokes survive (no hairline erased, no crop-away)
    # greyscale input gives the RGB input's output, bit for bit
    torch.manual_seed(2)
    from_rgb = transform(image)
    torch.manual_seed(2)
    from_grey = transform(image.convert("L"))
    torch.testing.assert_close(from_grey, from_rgb, rtol=0, atol=0)


def test_crop_views_are_the_old_random_resized_crop():
    from torchvision import transforms as T

    image = glyph("RGB", 40)
    old = T.Compose([T.RandomResizedCrop(64, scale=(0.5, 1.0), antialias=True), T.ToTensor(),
                     T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    torch.manual_seed(5)
    want = old(image)
    torch.manual_seed(5)
    got = default_view_transform(64, "glyph", "crop")(image)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_glyph_view_transform_refuses_bad_arguments():
    with pytest.raises(ValueError, match="augmentation must be one of"):
        glyph_view_transform(64, augmentation="mocov2")
    with pytest.raises(ValueError, match="at least 8 pixels"):
        glyph_view_transform(4)
    with pytest.raises(ValueError, match="augmentation must be one of"):
        ComposedGlyphScenes([], glyph_augmentation="jitter")


def test_recipe_flag_default_choices_and_coco_conflict(tmp_path):
    from tests.recipes.test_recipe_end_to_end import load_recipe
    from pml_hyperbolic.training.cli import ConfigError

    HCL = load_recipe("hcl").HCL
    args = HCL.parse(["--output-dir", str(tmp_path / "a")])
    assert args.view_augmentation == HCL_GLYPH_VIEW_AUGMENTATION
    assert HCL.parse(["--output-dir", str(tmp_path / "b"), "--view-augmentation", "crop"]).view_augmentation == "crop"
    with pytest.raises(SystemExit):
        HCL.parse(["--output-dir", str(tmp_path / "c"), "--view-augmentation", "blur"])
    coco = HCL.parse(["--output-dir", str(tmp_path / "d"), "--annotations", "a.json", "--images-dir", "i",
                      "--view-augmentation", "font"])
    with pytest.raises(ConfigError, match="--view-augmentation font applies to the bundled glyph scenes"):
        HCL.preflight(coco)


def test_hcl_scene_data_glyph_scenes_and_bad_annotations():
    """The HCL recipe's data: composed glyph scenes (said once) with the glyph query/gallery splits
    capped at --max-eval-samples; --annotations without --images-dir is one clear error."""
    from types import SimpleNamespace

    import pytest

    from pml_hyperbolic.training.config import ConfigError
    from pml_hyperbolic.training.scene_objects import hcl_scene_data

    args = SimpleNamespace(annotations=None, images_dir=None, image_size=32, resize_size=None, max_objects=2,
                           canvas_size=64, max_train_samples=5, max_eval_samples=7, view_augmentation="crop", seed=0)
    said = []
    data = hcl_scene_data(args, said.append)
    assert len(said) == 1 and "no --annotations" in said[0]
    assert data["dataset_name"] == "glyphs" and data["data_root"] is None
    assert isinstance(data["train_set"], ComposedGlyphScenes) and len(data["train_set"]) == 5
    assert set(data["eval_sets"]) == {"query", "gallery"} and all(len(ds) == 7 for ds in data["eval_sets"].values())
    with pytest.raises(ConfigError, match="--images-dir"):
        hcl_scene_data(SimpleNamespace(**{**vars(args), "annotations": "a.json"}), said.append)


def test_scene_object_check_data_and_report(monkeypatch):
    """The held-out scenes of the HCL recipe's scene → object check: each scene with all its objects,
    unaugmented (the same tensors twice); the report embeds them with the model in eval mode, puts
    the mode back, and hands each object with the index of its own scene to scene_object_recall."""
    from types import SimpleNamespace

    import torch

    from pml_hyperbolic.training.scene_objects import SCENE_CHECK_SCENES, hcl_scene_data, scene_object_report

    args = SimpleNamespace(annotations=None, images_dir=None, image_size=32, resize_size=None, max_objects=3,
                           canvas_size=96, max_train_samples=5, max_eval_samples=7, view_augmentation="crop", seed=0)
    scenes = hcl_scene_data(args, lambda line: None)["scene_check_set"]
    assert isinstance(scenes, ComposedGlyphScenes) and len(scenes) == SCENE_CHECK_SCENES
    scene, objects = scenes.scene_and_objects(3)
    members, boxes, _ = scenes.layout(3)
    assert len(objects) == len(boxes) == len(members) and 2 <= len(objects) <= 3
    assert scene.shape == objects[0].shape == (3, 32, 32)
    again = scenes.scene_and_objects(3)
    assert torch.equal(again[0], scene) and all(torch.equal(a, b) for a, b in zip(again[1], objects))

    trunk = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 16), torch.nn.Dropout(0.5))
    head = torch.nn.Linear(16, 4)
    trunk.train()
    head.eval()
    small = ComposedGlyphScenes(scenes.glyphs, num_scenes=6, canvas_size=96, max_objects=3, image_size=32, seed=1)
    out = scene_object_report(trunk, head, small, curvature=0.05, device="cpu", batch_size=5)
    assert trunk.training and not head.training  # modes restored
    assert out["scenes"] == 6 and 12 <= out["objects"] <= 18 and 0.0 <= out["recall_at_1"] <= 1.0
    assert out["name"] == "scene→object R@1" and out["value"] == out["recall_at_1"]
    assert out["line"].startswith(f"scene→object R@1 {out['recall_at_1']:.4f} (chance {out['chance']:.4f}, 6 ")

    import sys

    module = sys.modules["pml_hyperbolic.evaluation.scene_object_recall"]  # (the package's name is the function)

    seen = {}
    real = module.scene_object_recall

    def spy(scene_embeddings, object_embeddings, object_scene, c):
        seen.update(scenes=scene_embeddings, objects=object_embeddings, owner=object_scene)
        return real(scene_embeddings, object_embeddings, object_scene, c)

    monkeypatch.setattr(module, "scene_object_recall", spy)
    scene_object_report(trunk, head, small, curvature=0.05, device="cpu")
    assert torch.bincount(seen["owner"]).tolist() == [len(small.layout(i)[1]) for i in range(6)]
    from pml_hyperbolic.geometry import map_to_ball

    key_head = torch.nn.Linear(16, 4)  # the objects go through the object encoder, the scenes do not
    scene_object_report(trunk, head, small, curvature=0.05, device="cpu", object_encoder=(trunk, key_head))
    first_scene, first_objects = small.scene_and_objects(0)
    c = torch.tensor(0.05)
    trunk.eval()
    with torch.no_grad():
        want_objects = map_to_ball(key_head(trunk(torch.stack(first_objects))), c)
        want_scene = map_to_ball(head(trunk(first_scene[None])), c)
    assert torch.allclose(seen["objects"][:len(first_objects)], want_objects, atol=1e-6)
    assert torch.allclose(seen["scenes"][:1], want_scene, atol=1e-6)
    assert seen["owner"].tolist() == sorted(seen["owner"].tolist())
    assert seen["scenes"].norm(dim=1).max() < 1 / 0.05 ** 0.5  # points of the ball of c = 0.05


def test_a_check_set_smaller_than_its_glyphs_samples_its_chosen_objects_across_classes():
    from pml_hyperbolic.data import GlyphDataset

    glyphs = GlyphDataset("query")  # ordered by class: 6 fonts per character
    labels = np.asarray(glyphs.labels)
    check = ComposedGlyphScenes(glyphs, num_scenes=256, seed=0)
    firsts = [check.layout(i)[0][0] for i in range(256)]
    assert len(set(firsts)) == 256  # each glyph image chosen at most once
    assert len(set(labels[firsts].tolist())) > 100  # in dataset order 256 scenes would cover 43 characters
    assert np.array_equal(check.labels, labels[firsts])
    assert firsts == [ComposedGlyphScenes(glyphs, num_scenes=256, seed=0).layout(i)[0][0] for i in range(256)]
    assert firsts != [ComposedGlyphScenes(glyphs, num_scenes=256, seed=1).layout(i)[0][0] for i in range(256)]
    full = ComposedGlyphScenes(glyphs, seed=0)  # one scene per glyph image: each is chosen once, in order
    assert [full.layout(i)[0][0] for i in range(len(glyphs))] == list(range(len(glyphs)))
