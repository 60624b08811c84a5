"""The errors a user will hit say what to do (exit status 2, one message, no traceback)."""
import os
import subprocess
import sys

import pytest
import torch

from test_recipe_end_to_end import RECIPES, TINY, load_recipe


def fails(recipe, cls, argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        getattr(load_recipe(recipe), cls).main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_no_data_found(capsys, tmp_path, monkeypatch):
    for var in ("PML_HYPERBOLIC_CARS196", "PML_HYPERBOLIC_DATA"):
        monkeypatch.delenv(var, raising=False)
    err = fails("hyp_uml_cars", "HypUML", ["--dataset", "cars", "--output-dir", str(tmp_path)], capsys)
    assert "cars196" in err and "--data-root" in err and "--dataset glyphs" in err


def test_wrong_layout(capsys, tmp_path):
    (tmp_path / "some_images").mkdir()
    err = fails("hyp_vit", "HypViT", ["--dataset", "cub", "--data-root", str(tmp_path)], capsys)
    assert "no supported layout" in err and "Expected one of" in err and "--data-root" in err


def test_auto_with_bad_data_root_does_not_fall_back_silently(capsys, tmp_path):
    err = fails("hyp_uml_cars", "HypUML", ["--data-root", str(tmp_path)], capsys)
    assert "no supported layout" in err


def test_hub_weights_unavailable(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-torch-cache"))
    argv = TINY + ["--backbone", "vit_small_patch16_224", "--pretrained", "true", "--output-dir", str(tmp_path)]
    err = fails("hyp_vit", "HypViT", argv, capsys)
    assert "HF_HUB_OFFLINE is set" in err and "--backbone-checkpoint FILE" in err and "Traceback" not in err


def test_batch_not_divisible(capsys, tmp_path):
    argv = TINY + ["--batch-size", "18", "--output-dir", str(tmp_path)]
    err = fails("hyp_vit", "HypViT", argv, capsys)
    assert "not divisible by --samples-per-class 4" in err and "--batch-size 16" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_but_absent_cli(tmp_path):
    """The real command line: exit status 2 and a one-line fix, no traceback."""
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "hyp_uml_cars.py"), "--device", "cuda",
                           "--output-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "CUDA is not available" in proc.stderr and "--device cpu" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_documents_every_flag():
    for recipe, cls in (("hyp_uml_cars", "HypUML"), ("hyp_vit", "HypViT"), ("hyp_mix", "HypMix"),
                        ("unsupervised_hyperbolic", "UnsupervisedHyperbolic"), ("hcl", "HCL"), ("hier", "HIER")):
        parser = getattr(load_recipe(recipe), cls).make_parser()
        text = parser.format_help()
        assert "--config" in text and "--resume" in text
        for action in parser._actions:
            assert action.help, f"{recipe}: {action.dest} has no help"
