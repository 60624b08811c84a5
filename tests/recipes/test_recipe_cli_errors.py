"""The errors a user will hit say what to do (exit status 2, one message, no traceback)."""
import os
import subprocess
import sys

import pytest
import torch

from tests.recipes.test_recipe_end_to_end import RECIPES, TINY, load_recipe


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


# ---- out-of-range values: one ``error:`` line and exit status 2, from a flag or a --config key ----
# (recipe, flag, value(s), words the message must hold). Every case fails while the arguments are
# read or checked, before any data, model or run folder is touched.
BAD_VALUES = [
    ("hyp_uml_cars", "--grad-clip", ["-1"], "> 0"),
    ("hyp_uml_cars", "--grad-clip", ["0"], "> 0"),
    ("hyp_uml_cars", "--epochs", ["-1"], ">= 1"),
    ("hyp_uml_cars", "--epochs", ["0"], ">= 1"),
    ("hyp_uml_cars", "--epochs", ["2.5"], "whole number"),
    ("hyp_uml_cars", "--max-steps", ["-5"], ">= 1"),
    ("hyp_uml_cars", "--steps-per-epoch", ["0"], ">= 1"),
    ("hyp_uml_cars", "--stop-after-epoch", ["0"], ">= 1"),
    ("hyp_uml_cars", "--embedding-dim", ["0"], ">= 1"),
    ("hyp_uml_cars", "--lr", ["inf"], "finite number > 0"),
    ("hyp_uml_cars", "--lr", ["nan"], "finite number > 0"),
    ("hyp_uml_cars", "--weight-decay", ["-0.1"], ">= 0"),
    ("hyp_uml_cars", "--clip-r", ["0"], "> 0"),
    ("hyp_uml_cars", "--clip-r", ["-2"], "> 0"),
    ("hyp_uml_cars", "--k-values", ["0"], ">= 1"),
    ("hyp_uml_cars", "--k-values", ["1", "-2"], ">= 1"),
    ("hyp_uml_cars", "--uncertainty-scale", ["0"], "> 0"),
    ("hyp_uml_cars", "--min-temperature", ["0"], "> 0"),
    ("hyp_uml_cars", "--image-size", ["0"], ">= 1"),
    ("hyp_uml_cars", "--resize-size", ["-3"], ">= 1"),
    ("hyp_uml_cars", "--num-workers", ["-1"], ">= 0"),
    ("hyp_uml_cars", "--max-train-samples", ["-5"], ">= 0"),
    ("hyp_uml_cars", "--eval-every", ["-1"], ">= 0"),
    ("hyp_uml_cars", "--seed", ["-1"], "[0, 4294967295]"),
    ("hyp_uml_cars", "--seed", ["1180591620717411303424"], "[0, 4294967295]"),
    ("hyp_vit", "--temperature", ["0"], "> 0"),
    ("hyp_vit", "--hier-proxies", ["0"], ">= 1"),
    ("hyp_vit", "--view-pairs", ["maybe"], "boolean"),
    ("hyp_mix", "--tau-e", ["0"], "> 0"),
    ("hyp_mix", "--lam", ["-1"], ">= 0"),
    ("hcl", "--queue-size", ["0"], ">= 1"),
    ("hcl", "--momentum", ["1.5"], "[0, 1]"),
    ("hcl", "--ball-curvature", ["0"], "> 0"),
    ("hier", "--hier-proxies", ["0"], ">= 1"),
    ("hier", "--ms-scale", ["-1"], "> 0"),
    ("unsupervised_hyperbolic", "--levels", ["64", "0"], ">= 1"),
    ("unsupervised_hyperbolic", "--omega", ["1"], "> 1"),
    ("unsupervised_hyperbolic", "--whiten", ["-1"], ">= 0"),
]
CLASSES = {"hyp_uml_cars": "HypUML", "hyp_vit": "HypViT", "hyp_mix": "HypMix", "hcl": "HCL", "hier": "HIER",
           "unsupervised_hyperbolic": "UnsupervisedHyperbolic"}


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("recipe,flag,values,words", BAD_VALUES, ids=[f"{r}{f}={' '.join(v)}" for r, f, v, _ in BAD_VALUES])
def test_bad_flag_value_is_one_line(recipe, flag, values, words, tmp_path, capsys):
    err = fails(recipe, CLASSES[recipe], [flag, *values, "--output-dir", str(tmp_path / "run")], capsys)
    line = one_error_line(err)
    assert flag in line and words in line, line
    assert not (tmp_path / "run").exists()


def _yaml_value(values):
    numbers = []
    for v in values:
        try:
            numbers.append(int(v))
        except ValueError:
            try:
                numbers.append(float(v) if v not in ("inf", "nan") else v)
            except ValueError:
                numbers.append(v)
    return numbers if len(numbers) > 1 else numbers[0]


@pytest.mark.parametrize("recipe,flag,values,words", BAD_VALUES, ids=[f"{r}{f}={' '.join(v)}" for r, f, v, _ in BAD_VALUES])
def test_bad_config_value_is_one_line(recipe, flag, values, words, tmp_path, capsys):
    """The same check for the same setting given in a --config file (YAML numbers, not strings)."""
    import yaml

    key = flag.lstrip("-").replace("-", "_")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({key: _yaml_value(values)}))
    line = one_error_line(fails(recipe, CLASSES[recipe], ["--config", str(path), "--output-dir",
                                                           str(tmp_path / "run")], capsys))
    assert "--config" in line and key in line and words in line, line


@pytest.mark.parametrize("text,words", [
    ("epochs: -2\n", ">= 1"),
    ("max_steps: -3\n", ">= 1"),
    ("grad_clip: -1\n", "> 0"),
    ("k_values: [1, -2]\n", ">= 1"),
    ("k_values: []\n", "at least one value"),
    ("epochs: [1, 2]\n", "expected one value"),
    ("epochs: true\n", "whole number"),
    ("amp: fp32\n", "invalid choice"),
    ("overwrite: maybe\n", "boolean"),
])
def test_bad_config_entries(text, words, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--config", str(path), "--output-dir",
                                                            str(tmp_path / "run")], capsys))
    assert words in line and text.split(":")[0] in line, line


@pytest.mark.parametrize("text,words", [
    ("1: 3\n", "setting names are text"),
    ("null: 3\n", "setting names are text"),
    ("lr: [1]\n", "expected one value"),
    ("lr: {a: 1}\n", "expected a finite number"),
    ("backbone: true\n", "expected text"),
    ("data_root: [a]\n", "expected one value"),
    ("device: {cuda: 0}\n", "expected text"),
])
def test_config_keys_and_text_values_of_the_wrong_type(text, words, tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--config", str(path), "--output-dir",
                                                            str(tmp_path / "run")], capsys))
    assert words in line and "--config" in line, line
    assert not (tmp_path / "run").exists()


def test_config_number_for_a_text_setting_reads_as_the_command_line_would(tmp_path):
    HypUML = load_recipe("hyp_uml_cars").HypUML
    path = tmp_path / "c.yaml"
    path.write_text("backbone: 3\ndevice: cpu\n")
    args = HypUML.parse(["--config", str(path), "--output-dir", str(tmp_path / "run")])
    assert args.backbone == "3" and args.device == "cpu"


def test_config_that_is_a_folder(tmp_path, capsys):
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--config", str(tmp_path), "--output-dir",
                                                            str(tmp_path / "run")], capsys))
    assert line == f"error: --config {tmp_path} is a folder; give the YAML or JSON file of settings."


def test_config_scalar_for_a_list_is_a_one_element_list(tmp_path):
    HypUML = load_recipe("hyp_uml_cars").HypUML
    path = tmp_path / "c.yaml"
    path.write_text("k_values: 1\nseed: 4294967295\ngrad_clip: none\nmax_train_samples: 0\n")
    args = HypUML.parse(["--config", str(path), "--output-dir", str(tmp_path / "run")])
    assert args.k_values == [1] and args.seed == 2 ** 32 - 1 and args.grad_clip is None
    assert args.max_train_samples == 0  # 0 keeps every image, as 'none'


def test_valid_edge_values_are_accepted(tmp_path):
    HypUML = load_recipe("hyp_uml_cars").HypUML
    args = HypUML.parse(["--grad-clip", "none", "--seed", "0", "--eval-every", "0", "--num-workers", "0",
                         "--k-values", "1", "--epochs", "1", "--max-steps", "1", "--clip-r", "none",
                         "--weight-decay", "0", "--output-dir", str(tmp_path / "run")])
    assert args.grad_clip is None and args.clip_r is None and args.k_values == [1] and args.weight_decay == 0.0
    HypUML.preflight(args)


def test_samples_per_class_one_needs_a_self_supervised_recipe(tmp_path, capsys):
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--samples-per-class", "1", "--output-dir",
                                                            str(tmp_path / "run")], capsys))
    assert "--samples-per-class must be >= 2" in line
    HCL = load_recipe("hcl").HCL  # MoCo's positives are two views of one image
    HCL.preflight(HCL.parse(["--samples-per-class", "1", "--freeze-trunk", "false", "--output-dir",
                             str(tmp_path / "hcl")]))


def test_output_dir_that_is_a_file_or_under_one(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--output-dir", str(target)], capsys))
    assert f"--output-dir {target} is a file" in line
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--output-dir", str(target / "sub" / "run")], capsys))
    assert "which is a file" in line and str(target) in line
    assert target.read_text() == "x"


def test_output_dir_not_writable(tmp_path, capsys, monkeypatch):
    import pml_hyperbolic.training.cli as cli

    parent = tmp_path / "locked"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(cli.os, "access", lambda path, mode: False if str(path) == str(parent) else
                        real_access(path, mode))
    line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--output-dir", str(parent / "run")], capsys))
    assert f"{parent} is not writable" in line
    if os.geteuid() != 0:  # the real permission bits (root may write anywhere)
        monkeypatch.setattr(cli.os, "access", real_access)
        parent.chmod(0o500)
        try:
            line = one_error_line(fails("hyp_uml_cars", "HypUML", ["--output-dir", str(parent / "run")], capsys))
            assert "not writable" in line
        finally:
            parent.chmod(0o700)
