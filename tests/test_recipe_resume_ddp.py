"""--resume reproduces an uninterrupted run exactly; torchrun with 2 CPU processes (gloo) trains."""
import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from test_recipe_end_to_end import RECIPES, TINY, load_recipe

TWO_EPOCHS = [a if a != "1" or TINY[i - 1] != "--epochs" else "2" for i, a in enumerate(TINY)]


def final_state(out):
    return torch.load(out / "last.pt", map_location="cpu", weights_only=False)


def test_resume_after_interruption_matches_straight_run(tmp_path):
    HypViT = load_recipe("hyp_vit").HypViT
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    common = TWO_EPOCHS + ["--no-plots", "--eval-before", "false"]
    HypViT.main(common + ["--output-dir", str(straight)])
    HypViT.main(common + ["--output-dir", str(interrupted), "--stop-after-epoch", "1"])
    assert final_state(interrupted)["epoch"] == 1
    HypViT.main(common + ["--output-dir", str(interrupted), "--resume"])

    a, b = final_state(straight), final_state(interrupted)
    assert a["epoch"] == b["epoch"] == 2 and a["global_step"] == b["global_step"] == 4
    for model in ("trunk", "embedder"):
        for key, value in a["models"][model].items():
            assert torch.equal(value, b["models"][model][key]), f"{model}.{key} differs after resume"
    ra = json.loads((straight / "results.json").read_text())["after"]
    rb = json.loads((interrupted / "results.json").read_text())["after"]
    assert ra == rb
    rows = list(csv.DictReader(open(interrupted / "log.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"]  # no duplicated epoch after the resume


def test_resume_with_a_different_config_is_refused(tmp_path, capsys):
    HypViT = load_recipe("hyp_vit").HypViT
    out = tmp_path / "run"
    HypViT.main(TINY + ["--no-plots", "--eval-before", "false", "--output-dir", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        HypViT.main(TINY + ["--no-plots", "--eval-before", "false", "--output-dir", str(out), "--resume",
                            "--lr", "0.5"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "different configuration" in err and "lr" in err and "--output-dir" in err


def test_torchrun_two_processes_gloo(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    out = tmp_path / "ddp"
    args = [a if a != "16" else "32" for a in TINY]  # global batch 32 = 2 ranks × 16
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", os.path.join(RECIPES, "hyp_vit.py"), *args,
           "--no-plots", "--eval-before", "false", "--dist-backend", "gloo", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["world_size"] == 2 and results["global_step"] == 2
    assert 0.0 <= results["after"]["recall_at_1"] <= 1.0
    rows = list(csv.DictReader(open(out / "log.csv")))
    assert len(rows) == 1  # rank 0 alone writes the log
    assert proc.stdout.count("after training") == 1  # and prints the summary
