"""The newcomer's command: `python recipes/hyp_uml_cars.py` with no arguments and no Cars196
(bundled glyphs, frozen ImageNet EfficientNet-Lite0 + hyperbolic head). Minutes on 2 cores: slow."""
import json
import os
import subprocess
import sys

import pytest

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")


@pytest.mark.slow
def test_no_argument_run_improves_recall(tmp_path):
    from pml_hyperbolic.backbones import offline_weights_available

    if not offline_weights_available("efficientnet_lite0"):
        pytest.skip("the `pretrained` extra (offline ImageNet weights) is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PML_HYPERBOLIC_")}
    proc = subprocess.run([sys.executable, os.path.join(RECIPES, "hyp_uml_cars.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "using the bundled glyph dataset" in proc.stdout
    assert "before training  Recall@1" in proc.stdout and "after training   Recall@1" in proc.stdout
    results = json.loads((tmp_path / "runs" / "hyp_uml-glyphs" / "results.json").read_text())
    before, after = results["before"], results["after"]
    # a margin a newcomer sees; "before" is the head's whitened start, already above a random head's
    assert after["recall_at_1"] > before["recall_at_1"] + 0.03, (before, after)
    assert after["recall_at_4"] > before["recall_at_4"] + 0.05, (before, after)
    table = results["uncertainty_vs_recall"]  # query -> gallery, quintiles of the Hyp-UML uncertainty
    assert len(table) >= 4
    assert table[0]["recall_at_1"] > table[-1]["recall_at_1"]  # most certain retrieved more often
    for name in ("poincare_disk.png", "uncertainty_vs_recall.png", "log.csv", "last.pt", "best.pt"):
        assert (tmp_path / "runs" / "hyp_uml-glyphs" / name).is_file()
