"""The unsupervised recipe's ``--train-radius``: parsed as a boolean, default true (the paper's full
gradient), and passed to ``HierarchicalLogRatioLoss(train_radius=…)``; a non-boolean exits with one error.
Its head rate on the bundled data: the pseudo-label training's, or the margin loss's with ``--supervised``."""
from types import SimpleNamespace

import pytest

from pml_hyperbolic.geometry import PoincareGeometry
from pml_hyperbolic.losses import HierarchicalLogRatioLoss
from pml_hyperbolic.training.presets import HIER_MARGIN_GLYPH_HEAD_LR, UNSUPERVISED_BUNDLED_HEAD_LR


def recipe_class():
    from bench._recipe_rows import load_recipe_class

    return load_recipe_class("unsupervised_hyperbolic", "UnsupervisedHyperbolic")


@pytest.mark.parametrize("flags, expected", [([], True), (["--train-radius", "false"], False),
                                             (["--train-radius", "true"], True)])
def test_train_radius_reaches_the_loss(flags, expected):
    cls = recipe_class()
    args = cls.parse(["--dataset", "glyphs"] + flags)
    assert args.train_radius is expected
    geometry = PoincareGeometry(c=0.1)
    loss = cls.build_loss(SimpleNamespace(args=args, geometry=geometry))
    assert isinstance(loss, HierarchicalLogRatioLoss)
    assert loss.train_radius is expected
    assert loss.omega == args.omega and loss.distance.geometry is geometry


def test_train_radius_rejects_a_non_boolean(capsys):
    with pytest.raises(SystemExit) as err:
        recipe_class().parse(["--dataset", "glyphs", "--train-radius", "maybe"])
    assert err.value.code == 2
    assert "--train-radius" in capsys.readouterr().err


@pytest.mark.parametrize("dataset", ["glyphs", "icons", "iconify"])
def test_bundled_head_rate_of_each_variant(dataset):
    cls = recipe_class()
    assert cls.parse(["--dataset", dataset]).head_lr == UNSUPERVISED_BUNDLED_HEAD_LR
    assert cls.parse(["--dataset", dataset, "--supervised"]).head_lr == HIER_MARGIN_GLYPH_HEAD_LR
    assert cls.parse(["--dataset", dataset, "--head-lr", "5e-4"]).head_lr == 5e-4  # a flag wins
