"""Every recipe end to end on a tiny CPU configuration (random-init timm ``test_vit`` at 32 px,
a few steps, a subset of the bundled glyphs), run in-process through the recipe's ``main``."""
import importlib.util
import json
import os
import sys

import pytest
import torch

from pml_hyperbolic.training.checkpoint import read_checkpoint
from pml_hyperbolic.training.presets import HCL_GLYPH_HYPERBOLIC_WEIGHT

RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "recipes")


def load_recipe(name):
    sys.path.insert(0, RECIPES)
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", os.path.join(RECIPES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TINY = ["--dataset", "glyphs", "--backbone", "test_vit", "--pretrained", "false", "--image-size", "32",
        "--batch-size", "16", "--samples-per-class", "4", "--steps-per-epoch", "2", "--epochs", "1",
        "--max-train-samples", "400", "--max-eval-samples", "160", "--eval-batch-size", "160",
        "--quiet", "--no-tensorboard", "--amp", "off", "--freeze-trunk", "false"]


def expect_flag_error(recipe_cls, flags, message, tmp_path, capsys):
    """The recipe refuses ``flags`` with exit status 2 and ``message`` on stderr (one ``error:`` line)."""
    with pytest.raises(SystemExit) as exit_info:
        recipe_cls.main(TINY + ["--output-dir", str(tmp_path / "run")] + list(flags))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def run(name, cls, tmp_path, extra=(), before=False, instances=None):
    """Run a recipe's ``main`` on TINY; with ``instances`` (a list) the recipe object that ran is
    appended to it, so a test can inspect the loss, trainer and datasets it really built."""
    module = load_recipe(name)
    recipe_cls = getattr(module, cls)
    if instances is not None:
        base = recipe_cls

        class recipe_cls(base):  # noqa: N801 - same behaviour, only records ``self``
            def run(self):
                instances.append(self)
                return super().run()

    out = tmp_path / name
    flags = [] if before else ["--eval-before", "false"]  # one evaluation is enough for most tests
    results = recipe_cls.main(TINY + flags + ["--output-dir", str(out)] + list(extra))
    assert (out / "last.pt").is_file() and (out / "log.csv").is_file() and (out / "config.json").is_file()
    saved = json.loads((out / "results.json").read_text())
    for key in (("before", "after") if before else ("after",)):
        assert set(saved[key]) >= {"recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8"}
        assert all(0.0 <= v <= 1.0 for v in saved[key].values())
    assert saved["global_step"] == 2 and saved["epochs_completed"] == 1
    return results, out


def test_hyp_uml_contrastive(tmp_path, capsys):
    results, out = run("hyp_uml_cars", "HypUML", tmp_path, ["--no-plots"], before=True)
    text = capsys.readouterr().out
    assert "before training  Recall@1" in text and "after training   Recall@1" in text
    assert results["curvature"] == pytest.approx(0.1)


def test_hyp_uml_triplet_head_only(tmp_path):
    results, out = run("hyp_uml_cars", "HypUML", tmp_path, ["--loss", "triplet", "--no-plots", "--freeze-trunk", "true",
                                                            "--head-lr", "0.002"])
    import csv

    (row,) = csv.DictReader(open(out / "log.csv"))  # one lr column per optimiser: a frozen trunk has none
    assert float(row["lr_embedder"]) == 0.002 and "lr_trunk" not in row and "lr" not in row
    state = read_checkpoint(str(out / "last.pt"))
    assert "trunk_optimizer" not in state["optimizers"] and "embedder_optimizer" in state["optimizers"]


def test_hyp_vit_hyperbolic_and_spherical(tmp_path):
    run("hyp_vit", "HypViT", tmp_path / "h", ["--no-plots", "--view-pairs", "true"])
    results, _ = run("hyp_vit", "HypViT", tmp_path / "s", ["--model", "sph"])
    # no Poincaré plots for the sphere; the retrieval grid is drawn for every recipe
    assert set(results["plots"]) == {"retrieval_grid"} and os.path.isfile(results["plots"]["retrieval_grid"])


def test_hyp_mix(tmp_path):
    from pml_hyperbolic.distances import MixedGeometryDistance
    from pml_hyperbolic.heads import SphericalEmbeddingHead
    from pml_hyperbolic.losses import HypMixLoss

    recipes = []
    results, out = run("hyp_mix", "HypMix", tmp_path, ["--lam", "8"], instances=recipes)
    (recipe,) = recipes
    # --lam 8 replaces the glyph preset's λ = 3 in the loss the trainer actually used
    loss = recipe.trainer.loss_funcs["metric_loss"]
    assert isinstance(loss, HypMixLoss) and isinstance(loss.distance, MixedGeometryDistance)
    assert loss.distance.lam.tolist() == [8.0] and loss.distance.log_lam is None  # fixed, not learnable
    assert (loss.distance.tau_e, loss.distance.tau_h) == (0.05, 0.2)
    assert loss.distance.curvatures == [pytest.approx(results["curvature"])]
    assert isinstance(recipe.head, SphericalEmbeddingHead) and recipe.eval_curvature() is None  # cosine kNN
    # ... and is what the run saved: the loss's λ buffer in the checkpoint and the config
    state = read_checkpoint(str(out / "last.pt"))
    assert state["loss_funcs"]["metric_loss"]["distance.fixed_lam"].tolist() == [8.0]
    assert json.loads((out / "config.json").read_text())["lam"] == 8.0


def test_unsupervised_pseudo_labels(tmp_path, capsys):
    run("unsupervised_hyperbolic", "UnsupervisedHyperbolic", tmp_path,
        ["--levels", "20", "10", "4", "--no-plots"])
    assert "[pseudo-labels]" in capsys.readouterr().out


def test_unsupervised_supervised_variant(tmp_path, capsys):
    from pml_hyperbolic.data import GlyphDataset
    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.losses import HierarchicalMarginLoss
    from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset

    recipes = []
    results, out = run("unsupervised_hyperbolic", "UnsupervisedHyperbolic", tmp_path, ["--supervised", "--no-plots"],
                       instances=recipes)
    (recipe,) = recipes
    # the real labels, not the pseudo-label path: no clustering, no relabelling hook, one label level
    assert not isinstance(recipe.train_set, PseudoLabelledDataset) and recipe.label_hierarchy_level == 0
    assert recipe._labels_step is None and recipe.trainer.start_of_epoch_hook is None
    assert "[pseudo-labels]" not in capsys.readouterr().out
    # the hierarchical-margin loss over the true classes (margins are adaptive: learnt in the loss, no miner)
    loss = recipe.trainer.loss_funcs["metric_loss"]
    assert isinstance(loss, HierarchicalMarginLoss) and recipe.trainer.mining_funcs == {}
    assert loss.num_classes == GlyphDataset("train").num_classes and loss.gamma == pytest.approx(0.05)
    assert isinstance(loss.distance, PoincareDistance)
    assert float(loss.distance.c) == pytest.approx(results["curvature"])
    # its running class-distance estimates (the margins) were updated by training on real classes:
    # 2 steps × 16 images / 4 per class = 8 classes, all of them labels of the training subset
    saved = read_checkpoint(str(out / "last.pt"))["loss_funcs"]["metric_loss"]
    seen = saved["intra_seen"].nonzero().flatten().tolist()
    assert len(seen) == 8 and set(seen) <= set(recipe.train_set.labels.tolist())
    assert (saved["intra_mean"][seen] > 0).all()
    # class pairs met within a batch: two disjoint 4 × 4 blocks
    assert saved["inter_seen"].diagonal()[seen].all() and int(saved["inter_seen"].sum()) == 2 * 4 * 4


def test_supervised_margin_head_rate_preset(tmp_path):
    """``--supervised`` on the bundled glyphs trains the head at the validation-chosen rate; an explicit
    ``--head-lr`` wins, the unsupervised run and a real benchmark keep their own rates."""
    from pml_hyperbolic.training.presets import HIER_MARGIN_GLYPH_HEAD_LR

    cls = load_recipe("unsupervised_hyperbolic").UnsupervisedHyperbolic
    assert cls.parse(["--supervised"]).head_lr == HIER_MARGIN_GLYPH_HEAD_LR == 3e-4
    assert cls.parse(["--supervised", "--head-lr", "0.01"]).head_lr == 0.01
    assert cls.parse([]).head_lr == cls.glyph_preset["head_lr"] != HIER_MARGIN_GLYPH_HEAD_LR
    real = cls.parse(["--supervised", "--dataset", "cub", "--data-root", str(tmp_path)])
    assert real.head_lr != HIER_MARGIN_GLYPH_HEAD_LR and real.backbone == "vit_small_patch16_224"


def test_hcl_composed_scenes(tmp_path, monkeypatch):
    from pml_hyperbolic.training.hcl_trainer import HCLTrainer, KeyQueue

    raw, weighted = [], []  # each step's losses as computed, and as back-propagated (PML weights in place)
    real_calculate_loss, real_backward = HCLTrainer.calculate_loss, HCLTrainer.backward

    def recording_calculate_loss(self, batch):
        real_calculate_loss(self, batch)
        raw.append({k: float(v.detach()) for k, v in self.losses.items() if k != "total_loss"})

    def recording_backward(self):
        weighted.append({k: float(v.detach()) for k, v in self.losses.items()})
        return real_backward(self)

    monkeypatch.setattr(HCLTrainer, "calculate_loss", recording_calculate_loss)
    monkeypatch.setattr(HCLTrainer, "backward", recording_backward)
    recipes = []
    # 2 steps enqueue 2 × 16 keys: more than a 24-key queue holds, far fewer than the default 65536
    results, out = run("hcl", "HCL", tmp_path, ["--queue-size", "24"], instances=recipes)
    (recipe,) = recipes
    trainer = recipe.trainer
    assert isinstance(trainer, HCLTrainer) and set(trainer.loss_funcs) == {"metric_loss", "hyperbolic_loss"}
    for queue in trainer.loss_funcs.values():
        assert isinstance(queue, KeyQueue) and queue.memory_size == 24
        assert tuple(queue.embedding_memory.shape) == (24, 128)
        # FIFO of size 24: the first 8 keys (pair labels 0..7 of step 1) were pushed out by step 2's
        assert queue.has_been_filled and queue.queue_idx == 8
        assert sorted(queue.label_memory.tolist()) == list(range(8, 32))
    saved = read_checkpoint(str(out / "last.pt"))
    assert saved["extra"]["queues"] == {k: {"queue_idx": 8, "has_been_filled": True} for k in trainer.loss_funcs}
    # the default hyperbolic weight 0.1 (and c = 0.05) is what the trained loss used
    assert trainer.loss_weights == {"metric_loss": 1.0, "hyperbolic_loss": 0.1}
    assert float(trainer.loss_funcs["hyperbolic_loss"].loss.distance.c) == pytest.approx(0.05)
    # evaluated like MoCo / HCL: on the trunk's representation, not on the loss's projection MLP
    assert recipe.evaluator.tester.use_trunk_output is True
    q = recipe.evaluator.last_embeddings[0]
    assert q.shape[1] == recipe.feature_dim != recipe.args.embedding_dim
    assert len(raw) == len(weighted) == 2
    weight = HCL_GLYPH_HYPERBOLIC_WEIGHT  # the glyph preset's (chosen on validation, see recipes/hcl.py)
    for r, w in zip(raw, weighted):
        assert r["hyperbolic_loss"] > 0.0  # otherwise its weight would not show in the total
        assert w["hyperbolic_loss"] == pytest.approx(weight * r["hyperbolic_loss"], rel=1e-6)
        assert w["total_loss"] == pytest.approx(r["metric_loss"] + weight * r["hyperbolic_loss"], rel=1e-6)
    config = json.loads((out / "config.json").read_text())
    assert config["queue_size"] == 24 and config["hyperbolic_weight"] == weight


def test_curvature_auto_and_plots(tmp_path, capsys, monkeypatch):
    """--curvature auto (suggest_curvature on backbone features) and the end-of-run plots."""
    import pml_hyperbolic.evaluation as evaluation

    seen = []
    real = evaluation.suggest_curvature
    monkeypatch.setattr(evaluation, "suggest_curvature", lambda feats, **kw: seen.append(feats) or real(feats, **kw))
    results, out = run("hyp_uml_cars", "HypUML", tmp_path, ["--curvature", "auto"])
    assert "--curvature auto" in capsys.readouterr().out
    # the recipe's curvature is Hyp-ViT's rule on the untrained backbone's features of training images
    (feats,) = seen
    assert feats.shape[0] == 400 and torch.isfinite(feats).all()  # --max-train-samples 400
    d_rel = evaluation.relative_delta(feats, n_samples=2000)
    assert results["curvature"] == pytest.approx(min(10.0, max(1e-4, (0.144 / d_rel) ** 2)), rel=1e-9)
    assert os.path.isfile(out / "poincare_disk.png") and os.path.isfile(out / "uncertainty_vs_recall.png")
    assert os.path.isfile(out / "retrieval_grid.png")
    assert results["uncertainty_vs_recall"]  # the table behind the plot is in results.json
    assert 0.0 <= results["uncertainty_failure_auroc"] <= 1.0  # and the AUROC of the summary


def test_hyp_vit_with_hier_regulariser(tmp_path):
    from pytorch_metric_learning.losses import MultipleLosses

    from pml_hyperbolic.losses import HIERLoss, PairwiseCrossEntropyLoss

    instances = []
    _, out = run("hyp_vit", "HypViT", tmp_path, ["--no-plots", "--hier-weight", "3", "--hier-proxies", "16"],
                 instances=instances)
    recipe = instances[0]
    loss = recipe.trainer.loss_funcs["metric_loss"]
    assert isinstance(loss, MultipleLosses) and list(loss.weights) == [1.0, 3.0]
    main, hier = loss.losses
    assert isinstance(main, PairwiseCrossEntropyLoss) and isinstance(hier, HIERLoss)
    assert hier._c is recipe.geometry and main.distance._c is recipe.geometry  # one geometry, by reference
    # the proxies are trained (their own optimiser) and checkpointed
    saved = read_checkpoint(str(out / "last.pt"))["loss_funcs"]["metric_loss"]
    proxies = [v for k, v in saved.items() if k.endswith("proxies")]
    assert len(proxies) == 1 and proxies[0].shape == (16, 128)
    optimiser = recipe.trainer.optimizers["metric_loss_optimizer"]
    assert any(p is hier.proxies for group in optimiser.param_groups for p in group["params"])
    assert optimiser.state[hier.proxies]["step"] == 2  # two training steps moved them
    # without --loss-lr the proxies learn at the head's rate
    assert [g["lr"] for g in optimiser.param_groups] == [recipe.args.head_lr]


def test_hier_recipe_multisimilarity_plus_regulariser(tmp_path):
    from pytorch_metric_learning.losses import MultipleLosses, MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    from pml_hyperbolic.losses import HIERLoss, RadialCalibrationLoss

    instances = []
    results, out = run("hier", "HIER", tmp_path, ["--no-plots", "--hier-weight", "0.5", "--hier-proxies", "16",
                                                  "--hier-positives", "labels+mutual_nn", "--loss-lr", "0.05"],
                       instances=instances)
    recipe = instances[0]
    outer = recipe.trainer.loss_funcs["metric_loss"]
    # the glyph default adds the radial calibration (weight 0.03) around MultiSimilarity + λ·HIER
    assert isinstance(outer, MultipleLosses) and list(outer.weights) == [1.0, 0.03]
    loss, calibration = outer.losses
    assert isinstance(calibration, RadialCalibrationLoss) and calibration.geometry is recipe.geometry
    assert isinstance(loss, MultipleLosses) and list(loss.weights) == [1.0, 0.5]
    main, hier = loss.losses
    assert isinstance(main, MultiSimilarityLoss) and isinstance(hier, HIERLoss)
    # the MultiSimilarity miner serves the main loss only; HIER draws its own triplets
    assert isinstance(loss.miners[0], MultiSimilarityMiner) and loss.miners[1] is None
    assert recipe.trainer.mining_funcs == {}
    assert hier._c is recipe.geometry and hier.positives == "labels+mutual_nn" and hier.proxies.shape == (16, 128)
    assert results["curvature"] == pytest.approx(0.1)  # evaluated with the Poincaré kNN of the geometry
    optimiser = recipe.trainer.optimizers["metric_loss_optimizer"]
    assert optimiser.state[hier.proxies]["step"] == 2
    assert [g["lr"] for g in optimiser.param_groups] == [0.05]  # --loss-lr
    assert recipe.trainer.optimizers["embedder_optimizer"].param_groups[0]["lr"] == recipe.args.head_lr


def test_hier_recipe_main_loss_alone_and_presets(tmp_path):
    from pytorch_metric_learning.losses import MultipleLosses
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

    module = load_recipe("hier")
    glyphs = module.HIER.parse([])  # the bundled-glyph preset (validation-chosen weight and proxies)
    assert (glyphs.hier_weight, glyphs.hier_proxies) == (module.GLYPH_HIER["hier_weight"], module.GLYPH_HIER["hier_proxies"])
    assert glyphs.radial_calibration == 0.03 and glyphs.head_radius == "learned"  # the radius off the clip
    assert module.HIER.parse(["--radial-calibration", "0"]).radial_calibration == 0.0  # a given flag wins
    paper = module.HIER.parse(["--dataset", "cub", "--data-root", str(tmp_path)])
    assert (paper.hier_weight, paper.hier_proxies, paper.backbone) == (1.0, 512, "vit_small_patch16_224")
    assert paper.radial_calibration == 0.0  # the paper's setting on the real benchmarks
    # MultiSimilarity on the Poincaré similarity on the glyphs (chosen on validation), the paper's cosine elsewhere
    assert glyphs.ms_similarity == "poincare" and paper.ms_similarity == "cosine"
    assert module.HIER.parse(["--ms-similarity", "cosine"]).ms_similarity == "cosine"
    instances = []
    run("hier", "HIER", tmp_path, ["--no-plots", "--hier-weight", "0", "--radial-calibration", "0"], instances=instances)
    assert isinstance(instances[0].trainer.mining_funcs["tuple_miner"], MultiSimilarityMiner)
    assert not isinstance(instances[0].trainer.loss_funcs["metric_loss"], MultipleLosses)
    instances = []
    run("hier", "HIER", tmp_path / "pce", ["--no-plots", "--main-loss", "pce", "--hier-proxies", "8",
                                           "--radial-calibration", "0"], instances=instances)
    main, _ = instances[0].trainer.loss_funcs["metric_loss"].losses
    assert isinstance(main, PairwiseCrossEntropyLoss) and main.distance._c is instances[0].geometry


def test_hier_recipe_multi_similarity_on_the_poincare_similarity(tmp_path):
    """``--ms-similarity poincare`` (the glyph default): MultiSimilarity and its miner share one
    PoincareSimilarity on the recipe's geometry (by reference), T = 2·clip_r by default or --ms-scale;
    with HIER and alone. The preset's similarity does not stop --main-loss pa (its own test)."""
    from pytorch_metric_learning.losses import MultiSimilarityLoss

    from pml_hyperbolic.distances import PoincareSimilarity

    instances = []
    run("hier", "HIER", tmp_path, ["--no-plots", "--hier-proxies", "8"], instances=instances)  # the glyph default
    recipe = instances[0]
    losses = recipe.trainer.loss_funcs["metric_loss"].losses[0]  # [MS + HIER, glyph radial calibration]
    main, miner = losses.losses[0], losses.miners[0]
    assert isinstance(main, MultiSimilarityLoss) and (main.alpha, main.beta, main.base) == (2, 50, 0.5)
    assert isinstance(main.distance, PoincareSimilarity) and main.distance is miner.distance
    assert main.distance._c is recipe.geometry and main.distance.scale == recipe.geometry.max_dist0()
    instances = []
    run("hier", "HIER", tmp_path / "alone", ["--no-plots", "--hier-weight", "0", "--ms-similarity", "poincare",
                                             "--ms-scale", "2", "--radial-calibration", "0"], instances=instances)
    recipe = instances[0]
    main, miner = recipe.trainer.loss_funcs["metric_loss"], recipe.trainer.mining_funcs["tuple_miner"]
    assert main.distance.scale == 2.0 and miner.distance is main.distance and miner.distance._c is recipe.geometry


def test_hier_recipe_multi_similarity_hyperparameters(tmp_path):
    """``--ms-alpha/--ms-beta/--ms-base/--ms-epsilon`` reach MultiSimilarity, its miner and the parent
    term's copies of both."""
    instances = []
    run("hier", "HIER", tmp_path, ["--no-plots", "--hier-weight", "0", "--parent-weight", "0.1",
                                   "--radial-calibration", "0", "--ms-alpha", "1.5", "--ms-beta", "20",
                                   "--ms-base", "0.3", "--ms-epsilon", "0.25"], instances=instances)
    main, parent = instances[0].trainer.loss_funcs["metric_loss"].losses
    main_miner = instances[0].trainer.loss_funcs["metric_loss"].miners[0]
    for loss, miner in ((main, main_miner), (parent.loss, parent.miner)):
        assert (loss.alpha, loss.beta, loss.base) == (1.5, 20.0, 0.3) and miner.epsilon == 0.25


def test_hier_recipe_parent_level_term(tmp_path):
    """``--parent-weight w``: MultiSimilarity and its miner on the glyphs' radical labels (the
    dataset's ``super_labels``), on the same similarity as the main loss, weight w; beside HIER,
    HIER is still computed first and the state-dict keys of MS + HIER are unchanged."""
    import numpy as np
    from pytorch_metric_learning.losses import MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    from pml_hyperbolic.losses import HIERLoss, ParentLabelLoss

    instances = []
    run("hier", "HIER", tmp_path, ["--no-plots", "--hier-weight", "0", "--parent-weight", "0.2",
                                   "--radial-calibration", "0"], instances=instances)
    recipe = instances[0]
    loss = recipe.trainer.loss_funcs["metric_loss"]
    assert recipe.trainer.mining_funcs == {} and list(loss.weights) == [1.0, 0.2]
    main, parent = loss.losses
    assert isinstance(main, MultiSimilarityLoss) and isinstance(parent, ParentLabelLoss)
    assert isinstance(parent.loss, MultiSimilarityLoss) and isinstance(parent.miner, MultiSimilarityMiner)
    assert parent.loss.distance is main.distance and parent.miner.distance is main.distance
    labels, supers = np.asarray(recipe.train_set.labels), np.asarray(recipe.train_set.super_labels)
    assert parent.parents[labels].tolist() == supers.tolist()
    instances = []
    run("hier", "HIER", tmp_path / "hier", ["--no-plots", "--hier-proxies", "8", "--parent-weight", "0.2",
                                            "--radial-calibration", "0"], instances=instances)
    loss = instances[0].trainer.loss_funcs["metric_loss"]
    assert [type(t) for t in loss.losses] == [MultiSimilarityLoss, HIERLoss, ParentLabelLoss]
    assert list(loss.weights) == [1.0, instances[0].args.hier_weight, 0.2] and loss.compute_order == [1, 0, 2]
    assert "losses.1.proxies" in loss.state_dict()  # HIER keeps its place in a checkpoint


def test_training_class_parents_needs_a_parent_level():
    from pml_hyperbolic.training.config import ConfigError
    from pml_hyperbolic.training.recipe_data import training_class_parents

    class Flat:
        labels = [0, 1, 1]

    class Tree(Flat):
        super_labels = [[5, 0], [2, 0], [2, 0]]  # (N, K) parent levels: the first is the parent

    class NoTree(Flat):
        super_labels = [5, 2, 3]

    assert training_class_parents(Tree()).tolist() == [5, 2]
    with pytest.raises(ConfigError, match="no parent labels"):
        training_class_parents(Flat())
    with pytest.raises(ConfigError, match="more than one parent"):
        training_class_parents(NoTree())


@pytest.mark.parametrize("flags, message", [
    (["--ms-similarity", "poincare", "--main-loss", "pce"], "needs --main-loss ms"),
    (["--ms-similarity", "cosine", "--ms-scale", "2"], "--ms-scale needs"),
    (["--main-loss", "pce", "--ms-scale", "2"], "--ms-scale needs"),
    (["--ms-similarity", "poincare", "--ms-scale", "0"], "--ms-scale"),
    (["--ms-similarity", "euclid"], "invalid choice"),
    (["--main-loss", "pce", "--parent-weight", "0.1"], "--parent-weight needs --main-loss ms"),
    (["--parent-weight", "-1"], "--parent-weight"),
    (["--main-loss", "pce", "--ms-beta", "20"], "--ms-beta needs --main-loss ms"),
    (["--main-loss", "pa", "--ms-alpha", "1", "--ms-epsilon", "0"], "--ms-alpha --ms-epsilon need --main-loss ms"),
    (["--ms-base", "1.5"], "[-1, 1]"),
    (["--ms-beta", "0"], "> 0"),
    (["--ms-epsilon", "-0.1"], ">= 0"),
])
def test_hier_recipe_ms_similarity_flag_errors(flags, message, tmp_path, capsys):
    expect_flag_error(load_recipe("hier").HIER, flags, message, tmp_path, capsys)


def test_hier_recipe_proxy_anchor_main_loss(tmp_path):
    """``--main-loss pa``: PML's ProxyAnchorLoss with one proxy per training class beside HIER, no miner,
    and both losses' proxies in the loss optimiser, stepped by the run."""
    from pytorch_metric_learning.losses import ProxyAnchorLoss

    from pml_hyperbolic.losses import HIERLoss
    from pml_hyperbolic.training.runner import training_class_count

    instances = []
    run("hier", "HIER", tmp_path, ["--no-plots", "--main-loss", "pa", "--hier-proxies", "8",
                                     "--radial-calibration", "0"], instances=instances)
    recipe = instances[0]
    main, hier = recipe.trainer.loss_funcs["metric_loss"].losses
    assert isinstance(main, ProxyAnchorLoss) and isinstance(hier, HIERLoss)
    assert main.proxies.shape == (training_class_count(recipe.train_set), recipe.args.embedding_dim)
    assert "tuple_miner" not in recipe.trainer.mining_funcs
    state = recipe.trainer.optimizers["metric_loss_optimizer"].state
    assert state[main.proxies]["step"] == 2 and state[hier.proxies]["step"] == 2
