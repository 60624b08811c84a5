"""The recipes on the bundled icons (``--dataset icons``): the name resolves without a data folder,
the glyph preset applies, the runner builds IconDataset splits with the RGB (ImageNet) transforms and
the query/gallery protocol, and a tiny run ends with a results file."""
import json

import pytest

from pml_hyperbolic.data import IconDataset, build_transforms
from pml_hyperbolic.data.registry import ROOT_ENVIRONMENT_VARIABLES, SHARED_DATA_VARIABLE
from pml_hyperbolic.training.cli import light_dataset_name
from pml_hyperbolic.training.config import DATASET_ALIASES
from pml_hyperbolic.training.distributed import DistributedContext
from pml_hyperbolic.training.evaluation import eval_protocol
from pml_hyperbolic.training.runner import resolve_dataset
from tests.recipes.test_recipe_end_to_end import TINY, load_recipe

# every recipe that runs on --dataset glyphs (HCL composes its scenes from glyphs: tested apart)
RECIPES = [("hyp_uml_cars", "HypUML"), ("hyp_vit", "HypViT"), ("hyp_mix", "HypMix"),
           ("unsupervised_hyperbolic", "UnsupervisedHyperbolic"), ("hier", "HIER")]


@pytest.fixture
def no_data_variables(monkeypatch):
    for name in [SHARED_DATA_VARIABLE, *ROOT_ENVIRONMENT_VARIABLES.values()]:
        monkeypatch.delenv(name, raising=False)


def test_icons_is_a_bundled_name(no_data_variables):
    assert DATASET_ALIASES["icons"] == "icons"
    assert light_dataset_name("icons", None, "cars196") == "icons"
    assert resolve_dataset("icons", None, "cub200") == ("icons", None, None)
    assert eval_protocol("icons") == [("query", ["gallery"])]
    # the default is unchanged: no benchmark found -> the glyphs, not the icons
    assert light_dataset_name("auto", None, "cars196") == "glyphs"
    assert resolve_dataset("auto", None, "cars196")[0] == "glyphs"


@pytest.mark.parametrize("recipe,cls_name", RECIPES)
def test_parse_applies_the_bundled_preset(recipe, cls_name, tmp_path, no_data_variables):
    cls = getattr(load_recipe(recipe), cls_name)
    args = cls.parse(["--dataset", "icons", "--output-dir", str(tmp_path / "run")])
    assert cls.resolved_dataset(args) == "icons"
    assert cls.presets(args) == cls.presets(cls.parse(["--dataset", "glyphs", "--output-dir", str(tmp_path)]))
    for key, value in cls.glyph_preset.items():
        assert getattr(args, key) == value, key
    assert cls.run_folder(cls.parse(["--dataset", "icons"])).endswith(f"{cls.name}-icons")
    cls.preflight(args)  # no error: nothing to find


def test_unsupervised_supervised_head_rate_applies_to_icons(tmp_path, no_data_variables):
    from pml_hyperbolic.training.presets import HIER_MARGIN_GLYPH_HEAD_LR

    cls = load_recipe("unsupervised_hyperbolic").UnsupervisedHyperbolic
    args = cls.parse(["--dataset", "icons", "--supervised", "--output-dir", str(tmp_path)])
    assert args.head_lr == HIER_MARGIN_GLYPH_HEAD_LR


def test_hcl_refuses_icons(tmp_path, capsys):
    cls = load_recipe("hcl").HCL
    with pytest.raises(SystemExit) as exit_info:
        cls.main(["--dataset", "icons", "--output-dir", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "--dataset icons is not supported by hcl" in err
    assert not (tmp_path / "run").exists()


def test_setup_data_builds_icon_splits_with_rgb_transforms(tmp_path, no_data_variables):
    cls = load_recipe("hyp_uml_cars").HypUML
    recipe = cls(cls.parse(["--dataset", "icons", "--quiet", "--output-dir", str(tmp_path)]))
    recipe.ctx = DistributedContext()
    recipe.setup_data()
    assert (recipe.dataset_name, recipe.data_root) == ("icons", None)
    assert recipe.splits_to_eval == [("query", ["gallery"])]
    assert sorted(recipe.eval_sets) == ["gallery", "query"]
    sets = {"train": recipe.train_set, "train_eval": recipe.train_eval_set, **recipe.eval_sets}
    for name, ds in sets.items():
        assert isinstance(ds, IconDataset), name
        split = "train" if name.startswith("train") else name
        assert ds.split == split and len(ds) == len(IconDataset(split)), name
    # the ImageNet pipelines at the preset's 48 px, not the greyscale glyph ones
    for ds, train in ((recipe.train_set, True), (recipe.train_eval_set, False), (recipe.eval_sets["query"], False)):
        expected = build_transforms("imagenet", train=train, image_size=48, resize_size=48)
        assert repr(ds.transform) == repr(expected)
        assert not getattr(ds.transform, "accepts_greyscale", False)
    raw = IconDataset("query")
    image, label = recipe.eval_sets["query"][0]
    assert tuple(image.shape) == (3, 48, 48) and label == int(raw.labels[0])
    assert image.equal(build_transforms("imagenet", train=False, image_size=48, resize_size=48)(raw[0][0]))
    # the colour survives: some pixel's channels differ
    assert (image[0] - image[1]).abs().max() > 0.1 or (image[1] - image[2]).abs().max() > 0.1


def test_tiny_run_writes_results(tmp_path, capsys, no_data_variables):
    cls = load_recipe("hyp_uml_cars").HypUML
    flags = [a if a != "glyphs" else "icons" for a in TINY]
    out = tmp_path / "run"
    results = cls.main(flags + ["--eval-before", "false", "--no-plots", "--output-dir", str(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["dataset"] == "icons" and saved["global_step"] == 2 and saved["epochs_completed"] == 1
    assert set(saved["after"]) >= {"recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8"}
    assert all(0.0 <= v <= 1.0 for v in saved["after"].values())
    assert results["after"] == saved["after"]
    assert json.loads((out / "config.json").read_text())["dataset_resolved"] == "icons"
