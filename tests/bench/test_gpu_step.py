"""bench/gpu_step.py on CPU at toy sizes (1 thread): the plumbing of the GPU step benchmark, the
paper settings it resolves, and its one error when CUDA is asked for but absent."""
import json
import math
import re
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def gpu_step():
    from bench import gpu_step as module

    return module


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_cpu_smoke(gpu_step, one_thread, tmp_path, capsys):
    """Every row but hyp_uml_paper (the hyp_vit path with Hyp-UML's loss; its flags: test_paper_settings)."""
    path = tmp_path / "gpu_step.json"
    result = gpu_step.main(["--device", "cpu", "--rows", "baseline,hyp_uml,hyp_vit,hyp_mix", "--batch-size", "8",
                            "--image-size", "32", "--steps", "2", "--warmup", "1", "--threads", "1",
                            "--json", str(path)])
    out = capsys.readouterr().out
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    assert result["device"] == "cpu" and result["torch"] == torch.__version__

    rows = {row["row"]: row for row in result["rows"]}
    # one baseline per batch layout: 8 = 4 x 2 (Hyp-UML's 3/class does not divide 8), 8 = 2 x 4 (Hyp-ViT's 9)
    assert list(rows) == ["baseline 8=4x2", "hyp_uml", "baseline 8=2x4", "hyp_vit", "hyp_mix"]
    for name, row in rows.items():
        assert "error" not in row, row
        for key in ("median_ms", "min_ms", "max_ms", "images_per_s", "time_ratio"):
            assert _positive(row[key]), (name, key, row[key])
        assert math.isfinite(row["last_loss"]) and row["nonfinite_steps"] == 0
        assert row["batch_size"] == 8 and row["image_size"] == 32 and row["amp"] == "off"  # --amp auto on CPU
        if sys.platform.startswith("linux"):  # peak RSS (VmHWM) on CPU
            assert _positive(row["peak_memory_bytes"]) and _positive(row["memory_ratio"]), row
        assert re.search(rf"^\| {re.escape(name)}\s+\|", out, re.MULTILINE), name
    assert rows["baseline 8=4x2"]["time_ratio"] == 1.0 and rows["baseline 8=4x2"]["is_baseline"]
    base = rows["baseline 8=4x2"]
    assert base["head"] == "Linear" and base["losses"] == {"metric_loss": "SupConLoss"}
    assert base["trainer"] == "HyperbolicTrainer"

    uml = rows["hyp_uml"]  # the recipe's defaults: radial calibration and degraded copies
    assert uml["trainer"] == "DegradedCopyTrainer" and uml["trunk_images_per_step"] == 10  # 8 + ceil(0.25 * 8)
    assert "UncertaintyAdaptiveContrastiveLoss" in uml["losses"]["metric_loss"]
    assert "RadialCalibrationLoss" in uml["losses"]["metric_loss"]
    assert uml["losses"]["degraded_copy_loss"] == "DegradedCopyRadiusLoss"
    assert uml["baseline"] == "baseline 8=4x2" and uml["samples_per_class"] == 2
    assert uml["time_ratio"] == pytest.approx(uml["median_ms"] / base["median_ms"])
    assert rows["hyp_vit"]["losses"] == {"metric_loss": "PairwiseCrossEntropyLoss"}
    assert rows["hyp_vit"]["baseline"] == "baseline 8=2x4" and rows["hyp_vit"]["samples_per_class"] == 4
    assert rows["hyp_mix"]["losses"] == {"metric_loss": "HypMixLoss"}

    assert out.startswith("device: cpu")
    assert re.search(r"^load: loadavg", out, re.MULTILINE)
    summary = [line for line in out.splitlines() if line.startswith("summary")]
    assert len(summary) == 1 and "hyp_uml" in summary[0] and "hyp_mix" in summary[0]


def test_paper_settings(gpu_step):
    """No override: the recipes' paper presets (ViT-S/16 random init, 224 px, 128-d, AMP auto), batch
    294 = 98 x 3 for Hyp-UML on Cars196 and 882 = 98 x 9 for Hyp-ViT / HypMix; the baseline copies them."""
    opts = gpu_step.parse_arguments([])
    assert opts.device == "cuda" and opts.steps == 20 and opts.warmup == 5
    expected = {"hyp_uml": (294, 3), "hyp_uml_paper": (294, 3), "hyp_vit": (882, 9), "hyp_mix": (882, 9),
                "hier": (882, 9)}
    for name, (batch, per_class) in expected.items():
        _, args, notes = gpu_step.parse_row(name, opts)
        assert (args.batch_size, args.samples_per_class) == (batch, per_class) and notes == []
        assert args.backbone == "vit_small_patch16_224" and args.pretrained is False
        assert args.image_size == 224 and args.embedding_dim == 128 and args.amp == "auto"
        assert args.lr == 3e-5 and args.weight_decay == 0.01 and args.curvature == 0.1
        _, base = gpu_step.parse_baseline(args, opts)
        assert gpu_step.baseline_key(base) == gpu_step.baseline_key(args)
    _, uml, _ = gpu_step.parse_row("hyp_uml", opts)
    assert (uml.head_radius, uml.radial_calibration, uml.degraded_copies) == ("learned", 1.0, 0.25)
    _, paper, _ = gpu_step.parse_row("hyp_uml_paper", opts)
    assert (paper.head_radius, paper.radial_calibration, paper.degraded_copies) == ("norm", 0.0, 0.0)
    _, vit, _ = gpu_step.parse_row("hyp_vit", opts)
    assert vit.freeze_patch_embed is True and vit.grad_clip == 3.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_requested_without_cuda(gpu_step):
    from pml_hyperbolic.training.config import ConfigError

    with pytest.raises(ConfigError, match="CUDA is not available"):
        gpu_step.main(["--device", "cuda", "--steps", "1"])


def test_profile_reports_host_waits_per_step(gpu_step, one_thread, capsys):
    result = gpu_step.main(["--device", "cpu", "--rows", "hyp_vit", "--batch-size", "8", "--image-size", "32",
                            "--steps", "1", "--warmup", "1", "--threads", "1", "--profile", "2"])
    out = capsys.readouterr().out
    assert result["settings"]["profile_steps"] == 2 and result["settings"]["pairwise"] == "torch"  # CPU: torch path
    for row in result["rows"]:
        profile = row["profile"]
        assert profile["steps"] == 2 and _positive(profile["wall_ms_per_step"])
        assert profile["kernels"] == [] and profile["kernel_ms_per_step"] == 0  # no device kernels on a CPU
        assert profile["synchronising_lines"] == {}  # CUDA's sync debug mode only
        # the trainer reads the loss back once per step at least (its finiteness, the logged value)
        assert profile["host_waits_per_step"].get("aten::_local_scalar_dense", 0) >= 1
    assert out.count("profile over 2 steps") == 2  # the row and its baseline


def test_the_record_holds_the_rows_and_the_run_settings(one_thread, tmp_path, capsys):
    from bench.__main__ import run
    from tests.bench.test_suite import _schema, validate

    path = tmp_path / "record.json"
    assert run("gpu_step", ["--device", "cpu", "--rows", "hyp_vit", "--batch-size", "8", "--image-size", "32",
                            "--steps", "1", "--warmup", "1", "--threads", "1"], output=str(path)) == 0
    rec = json.loads(path.read_text())
    assert validate(rec, _schema()) == []
    assert [row["row"] for row in rec["results"]] == ["baseline 8=2x4", "hyp_vit"]
    assert rec["settings"]["device"] == "cpu" and rec["settings"]["pairwise"] == "torch"
    assert rec["summary"].startswith("summary") and "hyp_vit" in rec["summary"]


def test_rounds_interleave_the_rows_and_report_medians(gpu_step, one_thread, capsys):
    """--rounds 3: the plan runs three times; each row's time is the median of its rounds, its ratio
    the median of its per-round ratios to the same round's baseline; profiled in the last round only."""
    result = gpu_step.main(["--device", "cpu", "--rows", "hyp_vit", "--batch-size", "8", "--image-size", "32",
                            "--steps", "1", "--warmup", "0", "--threads", "1", "--rounds", "3", "--profile", "1"])
    out = capsys.readouterr().out
    assert out.count("round ") == 3 and out.count("  hyp_vit: ") == 3 and out.count("profile over 1 steps") == 2
    base, row = result["rows"]
    assert result["settings"]["rounds"] == 3 and base["is_baseline"] and base["time_ratio"] == 1.0
    for r in (base, row):
        assert len(r["per_round_ms"]) == 3 and r["median_ms"] == pytest.approx(sorted(r["per_round_ms"])[1])
        assert r["min_ms"] <= min(r["per_round_ms"]) and r["max_ms"] >= max(r["per_round_ms"])
        assert "profile" in r
    assert len(row["per_round_ratio"]) == 3 and row["time_ratio"] == pytest.approx(sorted(row["per_round_ratio"])[1])
    assert row["baseline"] == base["row"]


def test_bad_rounds_is_an_argument_error(gpu_step):
    with pytest.raises(SystemExit):
        gpu_step.main(["--device", "cpu", "--rounds", "0"])
