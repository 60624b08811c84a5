"""The unsupervised recipe's head warm start (``--head-init`` / ``--head-init-scale``)."""
import importlib.util
import os

import pytest
import torch

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")
TINY = ["--dataset", "glyphs", "--backbone", "test_vit", "--pretrained", "false", "--image-size", "32",
        "--batch-size", "16", "--samples-per-class", "4", "--steps-per-epoch", "2", "--epochs", "1",
        "--max-train-samples", "400", "--max-eval-samples", "160", "--eval-batch-size", "160",
        "--quiet", "--no-tensorboard", "--amp", "off", "--freeze-trunk", "false", "--eval-before", "false",
        "--no-plots"]


def recipe_class():
    spec = importlib.util.spec_from_file_location("recipe_unsupervised_hyperbolic_head_init",
                                                  os.path.join(RECIPES, "unsupervised_hyperbolic.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UnsupervisedHyperbolic


def test_head_init_flags_defaults_and_paper_setting():
    from pml_hyperbolic.training.presets import (DEFAULT_UNSUPERVISED_HEAD_INIT,
                                                 DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE, UNSUPERVISED_HEAD_INITS)

    cls = recipe_class()
    a = cls.parse(["--dataset", "glyphs"])
    assert a.head_init == DEFAULT_UNSUPERVISED_HEAD_INIT and a.head_init_scale == DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE
    assert "random" in UNSUPERVISED_HEAD_INITS  # the paper's head init stays reachable
    a = cls.parse(["--dataset", "glyphs", "--head-init", "random", "--head-init-scale", "3"])
    assert a.head_init == "random" and a.head_init_scale == 3.0


@pytest.mark.parametrize("flags", [["--head-init", "pca"], ["--head-init-scale", "0"], ["--head-init-scale", "-1"],
                                   ["--head-init-scale", "inf"], ["--head-init-scale", "nan"],
                                   ["--head-init-scale", "big"]])
def test_head_init_bad_flags_exit_with_a_message(flags, capsys):
    with pytest.raises(SystemExit) as err:
        recipe_class().parse(["--dataset", "glyphs"] + flags)
    assert err.value.code == 2
    assert flags[0] in capsys.readouterr().err


@pytest.mark.parametrize("init", ["whiten", "random"])
def test_head_init_end_to_end(tmp_path, capsys, init):
    base = recipe_class()
    seen = []

    class Recorded(base):
        def run(self):
            seen.append(self)
            return super().run()

    out = tmp_path / init
    results = Recorded.main(TINY + ["--output-dir", str(out), "--levels", "20", "--head-init", init,
                                    "--head-init-scale", "40"])
    text = capsys.readouterr().out
    assert ("head warm start: PCA whitening" in text) == (init == "whiten")
    assert "[pseudo-labels] step 0" in text
    assert 0.0 <= results["after"]["recall_at_1"] <= 1.0
    (recipe,) = seen
    linear = recipe.head.linear
    norm = float(linear.weight.detach().norm())
    reference = 40 * min(linear.in_features, linear.out_features) ** 0.5
    if init == "whiten":  # 2 steps at lr 3e-5 leave the warm start's norm (scale × √min(D, F))
        assert norm == pytest.approx(reference, rel=0.02)
        assert torch.count_nonzero(linear.bias) > 0  # centring bias
    else:  # the head's own (semi-)orthogonal init: norm √min(D, F), the scale is unused
        assert norm == pytest.approx(reference / 40, rel=0.05)


def _bench():
    from bench import unsupervised_pseudo_labels

    return unsupervised_pseudo_labels


def test_bench_recipe_settings_parse_and_the_chosen_one_is_the_default():
    bench, cls = _bench(), recipe_class()
    parsed = {name: cls.parse(["--dataset", "glyphs"] + flags) for name, flags in bench.RECIPE_SETTINGS.items()}
    keys = ("head_init", "head_init_scale", "levels", "omega", "linkage", "pseudo_source", "whiten")

    def resolved(a):
        levels = tuple(a.levels) if a.levels is not None else None
        return (a.head_init, a.head_init_scale, levels or (512,), a.omega, a.linkage, a.pseudo_source, a.whiten)

    assert len(keys) == len(resolved(parsed["r_default"]))
    assert resolved(parsed["r_whiten_s10_512"]) == resolved(parsed["r_default"])      # the validation winner
    assert resolved(parsed["r_previous_default"])[:3] == ("random", 10.0, (128,))    # the scale is unused there
    assert parsed["r_paper"].paper_pseudo_labels and parsed["r_paper"].omega == 10.0


def test_bench_report_test_needs_the_recipe_protocol():
    with pytest.raises(SystemExit, match="--protocol recipe"):
        _bench().main(["--report-test", "r_default"])
    with pytest.raises(SystemExit, match="unknown settings"):
        _bench().main(["--protocol", "recipe", "--settings", "r_nope"])
