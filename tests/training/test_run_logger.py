"""RunLogger: the per-epoch CSV, optional TensorBoard, and the one-line note when TensorBoard is
requested but not installed (printed once by the recipes, recorded in config.json / results.json)."""
import csv
import importlib.util
import json
import os
import sys

import pytest

from pml_hyperbolic.training.run_logger import TENSORBOARD_MISSING_NOTE, RunLogger

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")


@pytest.fixture
def no_tensorboard_package(monkeypatch):
    """Make ``from torch.utils.tensorboard import SummaryWriter`` fail as on a machine without it."""
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


def test_missing_tensorboard_gives_the_note_and_keeps_the_csv(tmp_path, no_tensorboard_package):
    logger = RunLogger(str(tmp_path), enabled=True, tensorboard=True)
    assert logger.writer is None and not logger.tensorboard_active
    assert logger.tensorboard_note == TENSORBOARD_MISSING_NOTE
    assert "pml-hyperbolic[tensorboard]" in TENSORBOARD_MISSING_NOTE and "--no-tensorboard" in TENSORBOARD_MISSING_NOTE
    assert "\n" not in TENSORBOARD_MISSING_NOTE
    logger.log_epoch({"epoch": 1, "step": 2, "loss": 0.5})
    logger.close()
    with open(tmp_path / "log.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert rows == [{"epoch": "1", "step": "2", "loss": "0.5"}]
    assert not (tmp_path / "tensorboard").exists()


def test_no_note_when_tensorboard_is_not_requested_or_on_other_ranks(tmp_path, no_tensorboard_package):
    assert RunLogger(str(tmp_path / "off"), enabled=True, tensorboard=False).tensorboard_note is None
    other_rank = RunLogger(str(tmp_path / "rank1"), enabled=False, tensorboard=True)
    assert other_rank.tensorboard_note is None and other_rank.writer is None
    assert not (tmp_path / "rank1").exists()


def test_installed_tensorboard_writes_events_and_no_note(tmp_path):
    pytest.importorskip("tensorboard")
    logger = RunLogger(str(tmp_path), enabled=True, tensorboard=True)
    assert logger.tensorboard_active and logger.tensorboard_note is None
    logger.log_epoch({"epoch": 1, "step": 3, "loss": 0.25})
    logger.close()
    assert any(name.startswith("events.") for name in os.listdir(tmp_path / "tensorboard"))


def _hyp_vit():
    sys.path.insert(0, RECIPES)
    spec = importlib.util.spec_from_file_location("recipe_hyp_vit_run_logger", os.path.join(RECIPES, "hyp_vit.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HypViT


TINY = ["--dataset", "glyphs", "--backbone", "test_vit", "--pretrained", "false", "--image-size", "32",
        "--batch-size", "16", "--samples-per-class", "4", "--steps-per-epoch", "2", "--epochs", "1",
        "--max-train-samples", "400", "--max-eval-samples", "160", "--eval-batch-size", "160",
        "--quiet", "--amp", "off", "--freeze-trunk", "false", "--eval-before", "false", "--no-plots"]


def test_recipe_says_once_and_records_that_tensorboard_was_off(tmp_path, capsys, no_tensorboard_package):
    recipe = _hyp_vit()
    results = recipe.main(TINY + ["--output-dir", str(tmp_path / "missing")])
    out = capsys.readouterr().out
    assert out.count(TENSORBOARD_MISSING_NOTE) == 1
    assert out.count("TensorBoard") == 1  # nothing else about it
    config = json.loads((tmp_path / "missing" / "config.json").read_text())
    saved = json.loads((tmp_path / "missing" / "results.json").read_text())
    assert config["no_tensorboard"] is True
    assert saved["tensorboard_logging"] is False and results["tensorboard_logging"] is False
    assert not (tmp_path / "missing" / "tensorboard").exists()

    # --no-tensorboard: silent, and the very same numbers (the note changes nothing that is computed)
    silenced = recipe.main(TINY + ["--output-dir", str(tmp_path / "silenced"), "--no-tensorboard"])
    assert TENSORBOARD_MISSING_NOTE not in capsys.readouterr().out
    assert silenced["after"] == results["after"] and silenced["history"][0]["loss"] == results["history"][0]["loss"]
    assert json.loads((tmp_path / "silenced" / "config.json").read_text())["no_tensorboard"] is True
