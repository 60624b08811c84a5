"""Config precedence (defaults < dataset preset < --config file < command line) and --help."""
import argparse
import json

import pytest

from pml_hyperbolic.training import config as cfg


def factory():
    parser = argparse.ArgumentParser()
    cfg.add_common_arguments(parser)
    parser.add_argument("--lam", type=float, default=3.0, help="λ")
    return parser


def preset(args):
    return {"batch_size": 294, "lr": 1e-4, "lam": 8.0}


def test_defaults_then_preset():
    args = cfg.parse_config(factory, [], presets=preset)
    assert args.batch_size == 294 and args.lr == 1e-4 and args.lam == 8.0
    assert args.weight_decay == 0.01 and args.curvature == 0.1 and args.clip_r == 2.3


def test_config_file_beats_preset_and_cli_beats_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch-size: 120\nlr: 0.002\nclip_r: none\nk-values: [1, 10]\n")
    args = cfg.parse_config(factory, ["--config", str(path), "--lr", "5e-5"], presets=preset)
    assert args.batch_size == 120          # file over preset
    assert args.lr == 5e-5                 # command line over file
    assert args.clip_r is None             # file values go through the flag's type
    assert args.k_values == [1, 10]
    assert args.lam == 8.0                 # untouched: preset
    assert {"batch_size", "lr", "clip_r", "k_values", "config"} <= args._explicit


def test_json_config(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"curvature": "auto", "epochs": 3}))
    args = cfg.parse_config(factory, ["--config", str(path)])
    assert args.curvature == "auto" and args.epochs == 3


def test_unknown_config_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("batch-sise: 3\n")
    with pytest.raises(cfg.ConfigError, match="batch_sise"):
        cfg.parse_config(factory, ["--config", str(path)])


def test_missing_config_file():
    with pytest.raises(cfg.ConfigError, match="not found"):
        cfg.parse_config(factory, ["--config", "/nonexistent/cfg.yaml"])


@pytest.mark.parametrize("bad", ["0", "-1", "abc"])
def test_bad_curvature_flag(bad, capsys):
    with pytest.raises(SystemExit):
        cfg.parse_config(factory, ["--curvature", bad])
    assert "--curvature" in capsys.readouterr().err


def test_every_flag_has_help():
    for action in factory()._actions:
        if action.dest != "help":
            assert action.help, action.dest


def test_fingerprint_ignores_run_only_settings():
    a = cfg.config_to_dict(cfg.parse_config(factory, ["--epochs", "2", "--output-dir", "x"]))
    b = cfg.config_to_dict(cfg.parse_config(factory, ["--epochs", "5", "--num-workers", "2"]))
    assert cfg.config_fingerprint(a) == cfg.config_fingerprint(b)
    c = cfg.config_to_dict(cfg.parse_config(factory, ["--lr", "1"]))
    assert cfg.config_fingerprint(a) != cfg.config_fingerprint(c)
