"""The unsupervised recipe's ``--train-radius``: parsed as a boolean, default true (the paper's full
gradient), and passed to ``HierarchicalLogRatioLoss(train_radius=…)``; a non-boolean exits with one error."""
import importlib.util
import os
from types import SimpleNamespace

import pytest

from pml_hyperbolic.geometry import PoincareGeometry
from pml_hyperbolic.losses import HierarchicalLogRatioLoss

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")


def recipe_class():
    spec = importlib.util.spec_from_file_location("recipe_unsupervised_hyperbolic_loss_flags",
                                                  os.path.join(RECIPES, "unsupervised_hyperbolic.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.UnsupervisedHyperbolic


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
