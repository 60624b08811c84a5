"""A user's first hour: instant --help and argument errors, one-line errors (exit 2),
warnings for flags without effect, Ctrl-C (exit 130 + the --resume command), run folders that are
refused or overwritten, and the end-of-run summary."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.recipes.test_recipe_end_to_end import RECIPES, TINY, load_recipe

ALL_RECIPES = (("hyp_vit", "HypViT"), ("hyp_mix", "HypMix"), ("hyp_uml_cars", "HypUML"),
               ("unsupervised_hyperbolic", "UnsupervisedHyperbolic"), ("hcl", "HCL"), ("hier", "HIER"))
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("PML_HYPERBOLIC_")}


def cli(recipe, *argv, cwd=None):
    """Run a recipe script in a fresh interpreter (the real command line)."""
    return subprocess.run([sys.executable, os.path.join(RECIPES, f"{recipe}.py"), *map(str, argv)],
                          capture_output=True, text=True, timeout=120, env=CLEAN_ENV, cwd=cwd)


def one_line_error(proc):
    """Exit status 2 and exactly one ``error: ...`` line on stderr, no traceback; returns that line."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


# ---- start-up: nothing heavy before the command line is checked ----
@pytest.mark.parametrize("recipe,cls", ALL_RECIPES)
def test_help_and_checks_import_no_torch(recipe, cls, tmp_path):
    code = (f"import sys; sys.path.insert(0, {RECIPES!r}); import {recipe} as m; "
            f"args = m.{cls}.parse(['--output-dir', {str(tmp_path)!r}]); m.{cls}.preflight(args); "
            "m.{cls}.make_parser().format_help(); "
            "heavy = sorted(n for n in ('torch', 'timm', 'pytorch_metric_learning', 'hypll', 'faiss', "
            "'pml_hyperbolic.training.runner', 'pml_hyperbolic.poincare_ball') if n in sys.modules); print(heavy)").replace("{cls}", cls)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=CLEAN_ENV)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_help_exits_zero_and_mentions_new_flags():
    proc = cli("hyp_vit", "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for flag in ("--threads", "--overwrite", "--resume", "--quiet"):
        assert flag in proc.stdout


# ---- one-line errors ----
def test_unknown_dataset_is_one_line():
    line = one_line_error(cli("hyp_vit", "--dataset", "foo"))
    assert "invalid choice: 'foo'" in line and "--help" in line


def test_missing_data_root_says_does_not_exist(tmp_path):
    missing = tmp_path / "nowhere"
    line = one_line_error(cli("hyp_uml_cars", "--data-root", missing, "--output-dir", tmp_path / "run"))
    assert f"--data-root {missing} does not exist" in line and "no supported layout" not in line
    assert "find_dataset_root" not in line and "--dataset glyphs" in line
    assert not (tmp_path / "run").exists()  # checked before the run folder is created


def test_named_dataset_without_any_root(tmp_path):
    line = one_line_error(cli("hyp_vit", "--dataset", "cars", "--output-dir", tmp_path / "run"))
    assert "cars196" in line and "--data-root" in line and "PML_HYPERBOLIC_CARS196" in line


def test_resume_without_checkpoint_fails_before_anything_is_written(tmp_path):
    line = one_line_error(cli("hyp_vit", "--resume", "--output-dir", tmp_path / "run"))
    assert f"no checkpoint at {tmp_path / 'run' / 'last.pt'}" in line
    assert not (tmp_path / "run").exists()
    line = one_line_error(cli("hyp_vit", "--resume", tmp_path / "x.pt", "--output-dir", tmp_path / "run"))
    assert "x.pt" in line


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: 3\nlr: [0.1\nbatch-size: 8\n")
    line = one_line_error(cli("hyp_vit", "--config", bad))
    assert str(bad) in line and "line 3" in line and "YAML syntax error" in line


def test_json_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "epochs": 3,\n  "lr": 0.1,\n}\n')
    line = one_line_error(cli("hyp_mix", "--config", bad))
    assert str(bad) in line and "line 4" in line and "JSON syntax error" in line


def test_config_file_unknown_key_and_missing_file(tmp_path):
    good = tmp_path / "c.yaml"
    good.write_text("epochz: 3\n")
    assert "epochz" in one_line_error(cli("hcl", "--config", good))
    assert "file not found" in one_line_error(cli("hcl", "--config", tmp_path / "none.yaml"))


def test_batch_size_suggestions_are_accepted():
    from pml_hyperbolic.training.config import ConfigError, check_batch_settings

    line = one_line_error(cli("hyp_vit", "--batch-size", "7"))
    assert "--batch-size 8 or --batch-size 12" in line and "--batch-size 4 " not in line
    for batch, per_class, world in ((7, 4, 1), (18, 4, 1), (3, 2, 1), (10, 3, 2), (5, 1, 2), (1, 4, 1)):
        with pytest.raises(ConfigError) as info:
            check_batch_settings(batch, per_class, world)
        suggested = [int(w) for w in str(info.value).replace(".", " ").split() if w.isdigit()
                     and f"--batch-size {w}" in str(info.value) and int(w) != batch]
        assert suggested, str(info.value)
        for size in suggested:  # every suggestion passes the very same check
            assert check_batch_settings(size, per_class, world) == size // world


@pytest.mark.parametrize("argv,words", [
    (["--threads", "0"], ["--threads", ">= 1"]),
    (["--threads", "two"], ["--threads", "'auto'"]),
    (["--lr", "-1"], ["--lr", "> 0"]),
    (["--head-lr", "0"], ["--head-lr", "> 0"]),
])
def test_bad_numbers_are_one_line(argv, words):
    line = one_line_error(cli("hyp_vit", *argv))
    assert all(w in line for w in words), line


def test_hcl_scene_and_annotation_checks(tmp_path):
    from pml_hyperbolic.data import GlyphDataset

    assert GlyphDataset("train")[0][0].size == (load_recipe("hcl").BUNDLED_GLYPH_SIDE,) * 2
    line = one_line_error(cli("hcl", "--canvas-size", "64", "--output-dir", tmp_path / "run"))
    assert "--canvas-size 80" in line and "--max-objects 4" in line
    assert "does not exist" in one_line_error(cli("hcl", "--annotations", tmp_path / "a.json", "--images-dir",
                                                  tmp_path, "--output-dir", tmp_path / "run"))
    assert "--images-dir" in one_line_error(cli("hcl", "--annotations", tmp_path / "a.json"))


def test_garbage_annotation_files_are_one_line(tmp_path, capsys):
    HypUML = load_recipe("hyp_uml_cars").HypUML
    cars = tmp_path / "cars"
    (cars / "car_ims").mkdir(parents=True)
    (cars / "cars_annos.mat").write_bytes(b"this is not a mat file")
    pml = tmp_path / "cars_pml"
    (pml / "car_data" / "car_data").mkdir(parents=True)
    (pml / "names.csv").write_text("A/1\n")
    (pml / "anno_train.csv").write_text("not,a\nvalid\n")
    (pml / "anno_test.csv").write_text("")
    for root, word in ((cars, "cars_annos.mat"), (pml, "malformed")):
        with pytest.raises(SystemExit) as info:
            HypUML.main(TINY + ["--dataset", "cars", "--data-root", str(root), "--output-dir", str(tmp_path / "run")])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and str(root) in err[0] and word in err[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_amp_fp16_on_cpu_is_one_line(tmp_path, capsys):
    HypViT = load_recipe("hyp_vit").HypViT
    with pytest.raises(SystemExit) as info:
        HypViT.main(TINY + ["--amp", "fp16", "--output-dir", str(tmp_path / "run")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--amp fp16 needs a CUDA device" in err[0] and "--amp bf16" in err[0]


# ---- warnings for flags that take no effect ----
def test_lr_with_frozen_trunk_warns(tmp_path, capsys):
    HypViT = load_recipe("hyp_vit").HypViT
    args = HypViT.parse(["--dataset", "glyphs", "--lr", "0.1", "--output-dir", str(tmp_path)])
    assert args.freeze_trunk and args.head_lr == pytest.approx(3e-3)  # the glyph preset
    HypViT.preflight(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --lr 0.1 has no effect") and "--head-lr 0.003" in err[0]
    # no warning when --lr is used (trunk trained) or not given
    for argv in (["--lr", "0.1", "--freeze-trunk", "false"], []):
        HypViT.preflight(HypViT.parse(["--dataset", "glyphs", "--output-dir", str(tmp_path)] + argv))
        assert capsys.readouterr().err == ""


def test_hcl_with_a_frozen_trunk_warns_that_its_scores_cannot_move(tmp_path, capsys):
    HCL = load_recipe("hcl").HCL
    assert HCL.evaluate_head is False  # scored on the trunk's representation
    HCL.preflight(HCL.parse(["--output-dir", str(tmp_path), "--freeze-trunk", "true"]))
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: HCL is scored on the trunk") and "--freeze-trunk false" in line
    HCL.preflight(HCL.parse(["--output-dir", str(tmp_path)]))  # the glyph preset trains the trunk's tail
    assert capsys.readouterr().err == ""


def test_unsupervised_recipe_does_not_report_hyp_uml_uncertainty():
    from pml_hyperbolic.training import pseudo_labels

    module = load_recipe("unsupervised_hyperbolic")
    assert module.UnsupervisedHyperbolic.reports_uncertainty is False
    assert load_recipe("hyp_uml_cars").HypUML.reports_uncertainty is True
    # the help text and the package read the pseudo-label settings from one place
    for name in ("DEFAULT_PSEUDO_LEVELS", "PAPER_PSEUDO_LEVELS", "LINKAGES", "SOURCES"):
        assert getattr(module, name) is getattr(pseudo_labels, name), name


# ---- run folders ----
def test_existing_run_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.csv").write_text("epoch\n1\n")
    line = one_line_error(cli("hyp_vit", "--output-dir", run))
    assert str(run) in line and "--resume" in line and "--overwrite" in line and "log.csv" in line
    line = one_line_error(cli("hyp_vit", "--output-dir", run, "--overwrite", "--resume"))
    assert "contradict" in line
    assert (run / "log.csv").read_text() == "epoch\n1\n"  # nothing touched


def test_clear_previous_run_deletes_only_run_files(tmp_path):
    from pml_hyperbolic.training.cli import clear_previous_run, previous_run_files

    for name in ("last.pt", "best.pt", "log.csv", "before.json", "config.json", "poincare_disk.png",
                 "my_notes.txt", ".tmp-last.pt-123"):
        (tmp_path / name).write_text("x")
    (tmp_path / "results.json").write_text(json.dumps({"plots": {"grid": str(tmp_path / "extra_plot.png")}}))
    (tmp_path / "extra_plot.png").write_text("x")
    (tmp_path / "tensorboard").mkdir()
    (tmp_path / "tensorboard" / "events").write_text("x")
    assert previous_run_files(str(tmp_path)) == ["last.pt", "best.pt", "results.json", "log.csv", "before.json"]
    clear_previous_run(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["my_notes.txt"]


def test_overwrite_starts_afresh_with_threads_and_summary(tmp_path, capsys):
    HypViT = load_recipe("hyp_vit").HypViT
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.csv").write_text("epoch,step,loss\n1,2,3.0\n2,4,2.0\n3,6,1.0\n")
    (run / "before.json").write_text("{}")
    (run / "poincare_disk.png").write_text("old")
    threads = torch.get_num_threads()
    try:
        results = HypViT.main(TINY + ["--no-plots", "--eval-before", "false", "--output-dir", str(run),
                                      "--overwrite", "--threads", "1"])
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    assert not (run / "before.json").exists() and not (run / "poincare_disk.png").exists()
    rows = (run / "log.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and rows[1].startswith("1,")  # header + this run's single epoch, nothing mixed
    out = capsys.readouterr().out
    summary = out[out.index("[pml-hyperbolic] summary:"):].splitlines()
    assert summary[1].split() == ["R@1", "R@2", "R@4", "R@8"]
    assert summary[2].split()[0] == "after" and float(summary[2].split()[1]) == pytest.approx(
        results["after"]["recall_at_1"], abs=5e-4)
    assert any(line.strip().startswith("time    data") and "training" in line for line in summary)
    assert any(str(run / "results.json") in line for line in summary)
    assert not any(line.strip().startswith("plots") for line in summary)  # --no-plots: no claim of plots
    # reusing the run's settings (--config run/config.json) works and does not delete the run again
    assert "overwrite" not in json.loads((run / "config.json").read_text())
    args = HypViT.parse(["--config", str(run / "config.json"), "--resume"])
    HypViT.preflight(args)
    assert args.output_dir == str(run) and args.threads == 1 and not args.overwrite


def test_format_summary_reference():
    from pml_hyperbolic.training.runner import format_summary

    results = {"recipe": "hyp_uml", "dataset": "glyphs", "epochs_completed": 2, "global_step": 30,
               "wall_seconds": 61.4, "before": {"recall_at_1": 0.1, "recall_at_2": 0.2},
               "after": {"recall_at_1": 0.25, "recall_at_2": 0.5},
               "phase_seconds": {"training": 40.0, "data": 1.25, "plots": 2.0},
               "plots": {"poincare_disk": "r/poincare_disk.png"},
               "uncertainty_vs_recall": [{"recall_at_1": 0.4, "count": 10}, {"recall_at_1": 0.1, "count": 10}]}
    text = format_summary(results, [1, 2], "r/results.json", ["r/last.pt"], uncertainty_bins=True)
    assert text.splitlines() == [
        "[pml-hyperbolic] summary: hyp_uml on glyphs, 2 epochs, 30 steps, 61 s",
        "              R@1    R@2",
        "  before    0.100  0.200",
        "  after     0.250  0.500",
        "  uncertainty bins, most certain first: R@1 0.40 0.10 (n = 10 per bin)",
        "  time    data 1.2 s | training 40.0 s | plots 2.0 s",
        "  results     r/results.json",
        "  checkpoints r/last.pt",
        "  plots       r/poincare_disk.png",
    ]
    no_plots = format_summary({**results, "plots": {}}, [1], None, []).splitlines()
    assert not any(line.startswith("  plots") for line in no_plots)  # hcl / hyp_mix: no claim of plots
    check = {"name": "scene→object R@1", "value": 0.25, "line": "..."}
    with_check = {**results, "before": {**results["before"], "method_check": {**check, "value": 0.0}},
                  "method_check": {"after": check}}
    assert "  scene→object R@1: 0.000 -> 0.250" in format_summary(with_check, [1], None, []).splitlines()
    with_check["before"] = None  # --eval-before false: the after figure alone
    assert "  scene→object R@1: 0.250" in format_summary(with_check, [1], None, []).splitlines()


def test_resume_command_and_interrupted_message(tmp_path):
    from pml_hyperbolic.training.cli import interrupted_message, resume_command

    cmd = resume_command(["--epochs", "3", "--overwrite", "--output-dir", "my run"], "recipes/hyp_vit.py")
    assert cmd.endswith("recipes/hyp_vit.py --epochs 3 --output-dir 'my run' --resume")
    assert resume_command(["--resume"], "x.py").count("--resume") == 1
    assert "before the first checkpoint" in interrupted_message(str(tmp_path), [])
    (tmp_path / "last.pt").write_text("x")
    assert f"{tmp_path / 'last.pt'}" in interrupted_message(str(tmp_path), ["--epochs", "3"])


# ---- Ctrl-C ----
def test_ctrl_c_prints_resume_command_and_exits_130(tmp_path):
    run = tmp_path / "run"
    argv = [a if a != "1" or TINY[i - 1] != "--epochs" else "500" for i, a in enumerate(TINY)]
    argv += ["--max-eval-samples", "40", "--eval-before", "false", "--no-plots", "--output-dir", str(run)]
    env = {**CLEAN_ENV, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, os.path.join(RECIPES, "hyp_vit.py"), *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        start = time.time()
        while not (run / "last.pt").exists() and proc.poll() is None and time.time() - start < 120:
            time.sleep(0.1)
        assert (run / "last.pt").exists(), "no checkpoint was written"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-2000:]
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("interrupted: the last checkpoint is ")
    assert str(run / "last.pt") in lines[-1]
    assert lines[-1].endswith(f"--output-dir {run} --resume")
