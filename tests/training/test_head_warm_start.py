"""The head's warm start shared by every recipe (``--head-init`` / ``--head-init-scale``,
``RecipeModelMixin.warm_start_head``)."""
import argparse
import copy
import importlib.util
import os

import pytest
import torch

from pml_hyperbolic.heads import HyperbolicEmbeddingHead, whitening_head_init
from pml_hyperbolic.training import pseudo_labels
from pml_hyperbolic.training.config import ConfigError
from pml_hyperbolic.training.recipe_model import RecipeModelMixin
from tests.recipes.test_recipe_unsupervised_head_init import TINY  # the tiny end-to-end run settings

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")


def recipe_class(script, name):
    spec = importlib.util.spec_from_file_location(f"recipe_{script}_warm_start", os.path.join(RECIPES, f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


class _Stub(RecipeModelMixin):
    def __init__(self, head, features, init="whiten", scale=2.0):
        self.args = argparse.Namespace(head_init=init, head_init_scale=scale)
        self.head, self._step0_features, self.lines = head, features, []

    def status(self, message):
        self.lines.append(message)

    def say(self, message):
        self.lines.append(message)


def test_warm_start_sets_the_whitening_of_the_training_features():
    assert pseudo_labels.whitening_head_init is whitening_head_init  # still importable from its old home
    torch.manual_seed(0)
    features = torch.randn(50, 12) @ torch.randn(12, 12) + 3.0
    head = HyperbolicEmbeddingHead(12, 4, c=0.1)
    reference = copy.deepcopy(head.linear)
    assert whitening_head_init(reference, features, scale=2.0) == 4
    stub = _Stub(head, features)
    stub.warm_start_head()
    torch.testing.assert_close(head.linear.weight, reference.weight)
    torch.testing.assert_close(head.linear.bias, reference.bias)
    # the head's outputs are the features' top principal directions at equal variance: uncorrelated
    v = head.linear(features).detach().double()
    cov = torch.cov(v.T)
    off_diagonal = cov - torch.diag(torch.diagonal(cov))
    assert off_diagonal.abs().max() < 1e-6 * cov.diagonal().max()
    assert torch.allclose(cov.diagonal(), cov.diagonal()[0].expand(4), rtol=1e-6)
    assert any("head warm start: PCA whitening" in line for line in stub.lines)


def test_random_init_leaves_the_head_as_built():
    head = HyperbolicEmbeddingHead(12, 4, c=0.1)
    before = copy.deepcopy(head.state_dict())
    stub = _Stub(head, None, init="random")
    stub.warm_start_head()  # features are never computed (None would fail)
    for key, value in head.state_dict().items():
        assert torch.equal(value, before[key])
    assert stub.lines == []


def test_a_head_without_a_linear_layer_is_one_clear_error():
    with pytest.raises(ConfigError, match=r"--head-init whiten needs a head with a \.linear layer"):
        _Stub(torch.nn.Sequential(torch.nn.Linear(12, 4)), torch.randn(20, 12)).warm_start_head()
    head = HyperbolicEmbeddingHead(12, 4, c=0.1)
    head.linear = torch.nn.Linear(12, 4, bias=False)
    with pytest.raises(ConfigError, match="with a bias"):
        _Stub(head, torch.randn(20, 12)).warm_start_head()


def test_flags_on_every_recipe_and_their_defaults():
    from pml_hyperbolic.training.presets import (DEFAULT_HEAD_INIT_SCALE, DEFAULT_UNSUPERVISED_HEAD_INIT,
                                                 DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE)
    from pml_hyperbolic.heads.whitening import DEFAULT_WHITENING_HEAD_INIT_SCALE

    assert DEFAULT_HEAD_INIT_SCALE == DEFAULT_WHITENING_HEAD_INIT_SCALE  # the torch-free copy of the function's default

    for script, name in (("hyp_vit", "HypViT"), ("hyp_mix", "HypMix")):
        a = recipe_class(script, name).parse(["--dataset", "glyphs"])
        assert (a.head_init, a.head_init_scale) == ("random", DEFAULT_HEAD_INIT_SCALE)
    for script, name in (("hier", "HIER"), ("hyp_uml_cars", "HypUML")):
        recipe = recipe_class(script, name)
        a = recipe.parse(["--dataset", "glyphs"])  # the bundled-data preset starts whitened
        assert (a.head_init, a.head_init_scale) == ("whiten", DEFAULT_HEAD_INIT_SCALE)
        assert recipe.parse(["--dataset", "icons", "--head-init", "random"]).head_init == "random"
        assert all("head_init" not in preset for preset in recipe.paper_presets.values())  # the papers' random head
        assert recipe.make_parser().get_default("head_init") == "random"
    unsupervised = recipe_class("unsupervised_hyperbolic", "UnsupervisedHyperbolic")
    a = unsupervised.parse(["--dataset", "glyphs"])
    assert (a.head_init, a.head_init_scale) == (DEFAULT_UNSUPERVISED_HEAD_INIT, DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE)
    assert unsupervised.parse(["--dataset", "glyphs", "--supervised"]).head_init == "random"  # real labels
    assert unsupervised.parse(["--dataset", "glyphs", "--supervised", "--head-init", "whiten"]).head_init == "whiten"


@pytest.mark.parametrize("flags", [["--head-init", "pca"], ["--head-init-scale", "0"], ["--head-init-scale", "nan"]])
def test_bad_flags_exit_with_a_message(flags, capsys):
    with pytest.raises(SystemExit) as err:
        recipe_class("hier", "HIER").parse(["--dataset", "glyphs"] + flags)
    assert err.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_supervised_recipe_end_to_end(tmp_path, capsys):
    base = recipe_class("hier", "HIER")
    seen = []

    class Recorded(base):
        def run(self):
            seen.append(self)
            return super().run()

    results = Recorded.main(TINY + ["--output-dir", str(tmp_path / "run"), "--head-init", "whiten",
                                    "--head-init-scale", "40", "--hier-weight", "0"])
    assert "head warm start: PCA whitening" in capsys.readouterr().out
    assert 0.0 <= results["after"]["recall_at_1"] <= 1.0
    (recipe,) = seen
    assert recipe._step0_features is None  # released after the set-up
    linear = recipe.head.linear
    # two steps leave the warm start's norm (scale × √min(D, F)) and its centring bias
    assert float(linear.weight.detach().norm()) == pytest.approx(40 * min(linear.in_features, linear.out_features) ** 0.5,
                                                                 rel=0.02)
    assert torch.count_nonzero(linear.bias) > 0
