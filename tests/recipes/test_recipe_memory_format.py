"""``--memory-format``: the backbone's convolutions in channels-last on CPU ('auto'), or contiguous;
the same run either way up to the convolutions' rounding."""
import pytest
import torch

from tests.recipes.test_recipe_end_to_end import load_recipe, run


def conv_weights(module):
    return [m.weight for m in module.modules() if isinstance(m, torch.nn.Conv2d)]


@pytest.mark.parametrize("choice, channels_last", [("auto", True), ("channels_last", True), ("contiguous", False)])
def test_trunk_layout_follows_the_flag(tmp_path, choice, channels_last):
    ran = []
    results, _ = run("hyp_vit", "HypViT", tmp_path, ["--no-plots", "--memory-format", choice], instances=ran)
    recipe = ran[0]
    assert recipe.device.type == "cpu" and recipe.channels_last() is channels_last
    weights = conv_weights(recipe.trunk)
    assert weights, "the test backbone has a patch-embedding convolution"
    for w in weights:
        assert w.is_contiguous(memory_format=torch.channels_last) is channels_last or w.shape[-2:] == (1, 1)
    assert recipe.config["memory_format"] == choice  # recorded in the run's config (and its fingerprint)


def test_layouts_give_the_same_run(tmp_path):
    fast, _ = run("hyp_vit", "HypViT", tmp_path / "a", ["--no-plots", "--memory-format", "channels_last"])
    plain, _ = run("hyp_vit", "HypViT", tmp_path / "b", ["--no-plots", "--memory-format", "contiguous"])
    for k in ("recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8"):
        assert fast["after"][k] == pytest.approx(plain["after"][k], abs=1 / 160 + 1e-9)  # at most one query


def test_bad_choice_is_refused(tmp_path, capsys):
    HypViT = load_recipe("hyp_vit").HypViT
    with pytest.raises(SystemExit) as exc:
        HypViT.parse(["--output-dir", str(tmp_path), "--memory-format", "nhwc"])
    assert exc.value.code == 2
    assert "--memory-format" in capsys.readouterr().err
