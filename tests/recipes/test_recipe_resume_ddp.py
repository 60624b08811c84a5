"""--resume reproduces an uninterrupted run exactly; torchrun with 2 CPU processes (gloo) trains."""
import csv
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.recipes.test_recipe_end_to_end import RECIPES, TINY, load_recipe

TWO_EPOCHS = [a if a != "1" or TINY[i - 1] != "--epochs" else "2" for i, a in enumerate(TINY)]


DUMP_RANKS_LAUNCHER = '''import os
import sys

import torch

sys.path.insert(0, {recipes!r})
from hyp_vit import HypViT  # noqa: E402


def weights(recipe):
    return {{"trunk": {{k: v.detach().clone() for k, v in recipe.trunk.state_dict().items()}},
            "embedder": {{k: v.detach().clone() for k, v in recipe.head.state_dict().items()}}}}


class RecordingTrainer(HypViT.trainer_class):
    def calculate_loss(self, curr_batch):
        self.batch_labels = getattr(self, "batch_labels", []) + [curr_batch[1].tolist()]
        return super().calculate_loss(curr_batch)


class DumpRanks(HypViT):
    trainer_class = RecordingTrainer

    def setup_model(self):
        super().setup_model()
        self.initial_weights = weights(self)

    def run(self):
        results = super().run()
        torch.save({{"initial": self.initial_weights, "final": weights(self),
                    "batch_labels": self.trainer.batch_labels}},
                   os.path.join(self.run_dir, "rank%d_weights.pt" % self.ctx.rank))
        return results


if __name__ == "__main__":
    DumpRanks.main(sys.argv[1:])
'''


def final_state(out):
    from pml_hyperbolic.training.checkpoint import read_checkpoint

    return read_checkpoint(str(out / "last.pt"))


def test_resume_after_interruption_matches_straight_run(tmp_path, monkeypatch):
    from pml_hyperbolic.training.trainer import HyperbolicTrainer

    HypViT = load_recipe("hyp_vit").HypViT
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    common = TWO_EPOCHS + ["--no-plots", "--eval-before", "false"]
    HypViT.main(common + ["--output-dir", str(straight)])
    HypViT.main(common + ["--output-dir", str(interrupted), "--stop-after-epoch", "1"])
    assert final_state(interrupted)["epoch"] == 1 and final_state(interrupted)["global_step"] == 2

    # The resumed run continues from the saved step: it trains epoch 2 only, starting at step 2
    # (restarting from scratch with the same seed would also end at step 4 with identical weights).
    steps = []
    real_step = HyperbolicTrainer.forward_and_backward

    def recording_step(self):
        steps.append((self.epoch, self.global_step))
        return real_step(self)

    monkeypatch.setattr(HyperbolicTrainer, "forward_and_backward", recording_step)
    resumed = HypViT.main(common + ["--output-dir", str(interrupted), "--resume"])
    assert steps == [(2, 2), (2, 3)]
    assert resumed["global_step"] == 4 and resumed["epochs_completed"] == 2
    assert [h["epoch"] for h in resumed["history"]] == [1, 2]  # epoch 1's record comes from the checkpoint

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


def test_a_checkpoint_from_before_a_flag_resumes_at_the_flags_default(tmp_path, capsys):
    """A checkpoint that does not record a flag (written before the flag existed) resumes when the run
    leaves that flag at its default, and is refused when the run sets it to another value."""
    from pml_hyperbolic.training.checkpoint import atomic_torch_save, read_checkpoint

    HypViT = load_recipe("hyp_vit").HypViT
    out = tmp_path / "run"
    HypViT.main(TINY + ["--no-plots", "--eval-before", "false", "--output-dir", str(out)])
    old = read_checkpoint(str(out / "last.pt"))
    assert old["config_fingerprint"]["hier_weight"] == 0.0  # the flag's default
    del old["config_fingerprint"]["hier_weight"]
    atomic_torch_save(old, str(out / "last.pt"))
    with pytest.raises(SystemExit) as exit_info:
        HypViT.main(TWO_EPOCHS + ["--no-plots", "--eval-before", "false", "--output-dir", str(out), "--resume",
                                  "--hier-weight", "0.5"])
    assert exit_info.value.code == 2 and "hier_weight" in capsys.readouterr().err
    HypViT.main(TWO_EPOCHS + ["--no-plots", "--eval-before", "false", "--output-dir", str(out), "--resume"])
    assert read_checkpoint(str(out / "last.pt"))["epoch"] == 2


def test_torchrun_two_processes_gloo(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    out = tmp_path / "ddp"
    args = [a if a != "16" else "32" for a in TINY]  # global batch 32 = 2 ranks × 16
    # recipes/hyp_vit.py's HypViT, run through a launcher that also has every rank save its own
    # initial and final weights (only rank 0 writes checkpoints), so the ranks can be compared
    launcher = tmp_path / "hyp_vit_dump_ranks.py"
    launcher.write_text(DUMP_RANKS_LAUNCHER.format(recipes=RECIPES))
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", str(launcher), *args,
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

    # DDP keeps the ranks in sync: rank 1's final weights equal rank 0's checkpoint, bit for bit,
    # although the ranks trained on different batches and the weights moved away from the initial ones
    checkpoint = final_state(out)["models"]
    ranks = [torch.load(out / f"rank{r}_weights.pt", map_location="cpu") for r in (0, 1)]
    assert [len(r["batch_labels"]) for r in ranks] == [2, 2]  # 2 steps of 16 images on each rank
    assert all(len(labels) == 16 for r in ranks for labels in r["batch_labels"])
    assert ranks[0]["batch_labels"] != ranks[1]["batch_labels"]
    for model in ("trunk", "embedder"):
        assert set(ranks[1]["final"][model]) == set(checkpoint[model])
        for key, value in checkpoint[model].items():
            assert torch.equal(ranks[1]["final"][model][key], value), f"{model}.{key} differs between ranks"
            assert torch.equal(ranks[0]["final"][model][key], value)
        assert any(not torch.equal(ranks[1]["initial"][model][k], v) for k, v in checkpoint[model].items()), \
            f"{model} did not train"
