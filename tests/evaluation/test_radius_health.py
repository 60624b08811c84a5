"""Radius health (pml_hyperbolic.evaluation.radius_health): collapse at the clip radius or onto one
radius is detected, reported once at evaluation and in the run summary / results.json."""
import json
import math
import warnings

import numpy as np
import pytest
import torch

from pml_hyperbolic import HyperbolicEmbeddingHead, PoincareDistance, PoincareGeometry
from pml_hyperbolic.evaluation import RadiusCollapseWarning, RadiusReport, check_radius, radius_collapse


def at_radius(geometry, d0, n=200, dim=16, seed=0):
    """Ball points at distance ``d0`` (a number: n points; a 1-D tensor: one point each) from the origin."""
    d0 = torch.as_tensor(d0, dtype=torch.float32)
    d0 = d0.expand(n) if d0.ndim == 0 else d0
    g = torch.Generator().manual_seed(seed)
    v = torch.nn.functional.normalize(torch.randn(len(d0), dim, generator=g), dim=-1)
    return geometry.to_ball(v * (d0 / 2).unsqueeze(1))  # d0(exp0(v)) = 2|v| below the clip


# ---- reference cases ----
def test_all_at_the_clip_radius_is_a_clip_collapse():
    geometry = PoincareGeometry(c=0.1)  # clip radius 2.3: d0 <= 4.6
    x = geometry.to_ball(50 * torch.randn(300, 16, generator=torch.Generator().manual_seed(1)))
    report = radius_collapse(x, geometry)
    assert isinstance(report, RadiusReport) and report.kind == "clip"
    assert report.clip_d0 == pytest.approx(4.6) and report.fraction_at_clip == 1.0 and report.n == 300
    assert report.d0_quantiles["median"] == pytest.approx(4.6, abs=1e-5)
    text = report.message()
    assert len(text.splitlines()) == 2
    assert "100.0% of the 300 embeddings sit at the clip radius d0 = 4.60" in text
    for name in ("margin losses on PoincareDistance such as TripletMarginLoss", "SupConLoss on PoincareSimilarity",
                 "MultiSimilarityLoss on PoincareSimilarity", "PairwiseCrossEntropyLoss", "RadialCalibrationLoss",
                 "--radial-calibration", "docs/uncertainty.md", "radius='learned'"):
        assert name in text


def test_clip_fraction_is_a_strict_threshold():
    geometry = PoincareGeometry(c=0.1)
    # 60% at the clip, 40% spread inside: a collapse at the default 0.5, not at 0.6 or 0.7
    x = at_radius(geometry, torch.cat([torch.full((60,), 4.6), torch.linspace(1.0, 3.0, 40)]))
    report = radius_collapse(x, geometry)
    assert report is not None and report.kind == "clip" and report.fraction_at_clip == pytest.approx(0.6)
    assert radius_collapse(x, geometry, clip_fraction=0.6) is None
    assert radius_collapse(x, geometry, clip_fraction=0.7) is None


def test_all_at_one_interior_radius_is_flat():
    geometry = PoincareGeometry(c=0.1)
    x = at_radius(geometry, 2.3)  # the polar head's starting radius
    report = radius_collapse(x, geometry)
    assert report is not None and report.kind == "flat"
    assert report.fraction_at_clip == 0.0 and report.spread < 1e-5
    assert report.flat_tolerance == pytest.approx(1e-3 * 2.3, rel=1e-6)
    assert "all 200 embeddings sit at d0 = 2.300" in report.message()


def test_spread_radii_are_healthy():
    geometry = PoincareGeometry(c=0.1)
    d0 = torch.linspace(0.5, 4.5, 200)
    assert radius_collapse(at_radius(geometry, d0), geometry) is None
    # a spread just above the tolerance is healthy, just below is flat
    d0 = 3.0 + torch.linspace(-2.5e-3, 2.5e-3, 201)  # p95 − p5 = 4.5e-3: tolerance 3e-3 at rtol 1e-3, 6e-3 at 2e-3
    assert radius_collapse(at_radius(geometry, d0), geometry, rtol=1e-3) is None
    assert radius_collapse(at_radius(geometry, d0), geometry, rtol=2e-3).kind == "flat"


def test_a_geometry_without_clip_or_a_plain_curvature_only_tests_flat():
    no_clip = PoincareGeometry(c=0.1, clip=None)
    far = no_clip.to_ball(torch.nn.functional.normalize(torch.randn(100, 8), dim=-1)
                          * torch.linspace(2.2, 2.4, 100).unsqueeze(1))  # near 4.6, spread: no collapse
    assert radius_collapse(far, no_clip) is None
    clipped = PoincareGeometry(c=0.1)
    x = clipped.to_ball(50 * torch.randn(100, 8))
    for c in (no_clip, 0.1, torch.tensor(0.1)):
        report = radius_collapse(x, c)
        assert report.kind == "flat" and report.clip_d0 is None and report.fraction_at_clip is None


def test_the_projection_margin_caps_the_clip_radius():
    # clip radius 50 at c = 1: float32 points cannot reach d0 = 100, they stop at the projection margin
    geometry = PoincareGeometry(c=1.0, clip_r=50.0)
    x = geometry.to_ball(1e3 * torch.randn(100, 8))
    report = radius_collapse(x, geometry)
    assert report.kind == "clip" and report.fraction_at_clip == 1.0
    assert report.clip_d0 == pytest.approx(2 * math.atanh(1 - 1e-5))


def test_dtypes_numpy_and_a_single_point():
    geometry = PoincareGeometry(c=0.1)
    x = geometry.to_ball(50 * torch.randn(64, 8))
    for y in (x.double(), x.half(), x.numpy()):
        assert radius_collapse(y, geometry).kind == "clip"
    # one point: the flat test needs two, the clip test still applies
    assert radius_collapse(x[:1], geometry).kind == "clip"
    assert radius_collapse(at_radius(geometry, 2.0, n=1), geometry) is None


def test_the_plots_flat_radius_rule_implies_a_collapse_report():
    # plot_uncertainty_vs_recall draws no bars when max − min of d0 < 1e-3: then this module reports too
    geometry = PoincareGeometry(c=0.1)
    for d in (0.3, 2.3, 4.0):
        d0 = d + torch.linspace(0, 0.9e-3, 100)
        assert radius_collapse(at_radius(geometry, d0), geometry) is not None


# ---- bad arguments ----
@pytest.mark.parametrize("embeddings, error, words", [
    (torch.zeros(0, 4), ValueError, "embeddings must hold at least one point"),
    (torch.zeros(5, 0), ValueError, "embeddings must hold at least one point"),
    (torch.zeros(4), ValueError, "embeddings must be 2-D"),
    (torch.zeros(2, 3, 4), ValueError, "embeddings must be 2-D"),
    (torch.tensor([[0.1, float("nan")]]), ValueError, "embeddings"),
    (torch.tensor([[0.1, float("inf")]]), ValueError, "embeddings"),
    (torch.zeros(3, 4, dtype=torch.long), TypeError, "embeddings must be a floating-point tensor"),
    ([[0.1, 0.2]], TypeError, "embeddings"),
])
def test_bad_embeddings(embeddings, error, words):
    with pytest.raises(error, match=words):
        radius_collapse(embeddings, PoincareGeometry(c=0.1))


@pytest.mark.parametrize("c, error", [(-1.0, ValueError), (float("nan"), ValueError), (0.0, ValueError),
                                      ("0.1", TypeError), (None, TypeError), (torch.ones(2), ValueError)])
def test_bad_curvature(c, error):
    with pytest.raises(error, match="c "):
        radius_collapse(torch.zeros(3, 4), c)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"rtol": 0.0}, ValueError, "rtol must be in"), ({"rtol": 1.0}, ValueError, "rtol must be in"),
    ({"rtol": float("nan")}, ValueError, "rtol"), ({"rtol": "1e-3"}, TypeError, "rtol must be a real number"),
    ({"clip_fraction": 1.0}, ValueError, "clip_fraction must be in"),
    ({"clip_fraction": -0.1}, ValueError, "clip_fraction"), ({"clip_fraction": True}, TypeError, "clip_fraction"),
])
def test_bad_tolerances(kwargs, error, words):
    with pytest.raises(error, match=words):
        radius_collapse(torch.zeros(3, 4), 0.1, **kwargs)


# ---- the warning ----
def test_check_radius_warns_once_and_only_on_collapse():
    geometry = PoincareGeometry(c=0.1)
    x = geometry.to_ball(50 * torch.randn(64, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = check_radius(x, geometry, what="test queries")
        assert check_radius(at_radius(geometry, torch.linspace(0.5, 4.0, 64)), geometry) is None
    collapse = [w for w in caught if issubclass(w.category, RadiusCollapseWarning)]
    assert len(collapse) == 1 and len(caught) == 1
    assert str(collapse[0].message) == report.message()
    assert "of the 64 test queries sit at the clip radius" in report.message()
    assert collapse[0].filename == __file__  # stacklevel 2: the caller's line
    assert issubclass(RadiusCollapseWarning, UserWarning)


def test_report_as_dict_is_json_ready():
    geometry = PoincareGeometry(c=0.1)
    report = radius_collapse(geometry.to_ball(50 * torch.randn(64, 8)), geometry)
    saved = json.loads(json.dumps(report.as_dict()))
    assert saved["kind"] == "clip" and saved["fraction_at_clip"] == 1.0 and saved["n"] == 64
    assert saved["message"] == report.message() and saved["summary"] == report.summary_line()
    assert set(saved["d0_quantiles"]) == {"min", "p05", "median", "p95", "max"}


# ---- the recipes' evaluator and summary ----
class FakeTester:
    """What Evaluator needs of a PML tester: ``test`` fills ``embeddings_and_labels`` and calls the hook."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.end_of_testing_hook = None

    def test(self, eval_sets, epoch, trunk, embedder, splits_to_eval, collate_fn):
        emb = self.batches.pop(0)
        self.embeddings_and_labels = {"test": (emb, torch.zeros(len(emb), 1, dtype=torch.long))}
        self.end_of_testing_hook(self)
        return {"test": {"recall_at_1_level0": 0.5}}


def test_evaluator_warns_once_per_run_and_skips_epoch_zero():
    from pml_hyperbolic.training.evaluation import Evaluator

    geometry = PoincareGeometry(c=0.1)
    collapsed = geometry.to_ball(50 * torch.randn(40, 8))
    healthy = at_radius(geometry, torch.linspace(0.5, 4.0, 40))
    tester = FakeTester([collapsed, collapsed, collapsed, healthy])
    evaluator = Evaluator(tester, {}, [("test", ["test"])], [1], geometry=geometry).install()
    trunk, head = torch.nn.Identity(), torch.nn.Identity()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluator(trunk, head, 0)  # before training: not checked
        assert evaluator.radius_report is None
        evaluator(trunk, head, 1)
        assert evaluator.radius_report.kind == "clip"
        evaluator(trunk, head, 2)  # still collapsed: reported, not warned again
        assert evaluator.radius_report.kind == "clip"
        evaluator(trunk, head, 3)
        assert evaluator.radius_report is None  # the last evaluation decides the summary
    assert [w.category for w in caught] == [RadiusCollapseWarning]
    assert "of the 40 test queries sit at the clip radius" in str(caught[0].message)
    # no geometry (Euclidean or trunk-scored recipes): never checked
    plain = Evaluator(FakeTester([collapsed]), {}, [("test", ["test"])], [1]).install()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain(trunk, head, 1)
    assert plain.radius_report is None and not caught


def test_summary_line_and_a_healthy_summary_unchanged():
    from pml_hyperbolic.training.runner import format_summary

    geometry = PoincareGeometry(c=0.1)
    report = radius_collapse(geometry.to_ball(50 * torch.randn(64, 8)), geometry, what="test queries")
    results = {"recipe": "hyp_vit", "dataset": "glyphs", "epochs_completed": 1, "global_step": 2,
               "wall_seconds": 3.0, "after": {"recall_at_1": 0.25}, "radius_collapse": None}
    healthy = format_summary(results, [1], "r/results.json", [])
    collapsed = format_summary({**results, "radius_collapse": report.as_dict()}, [1], "r/results.json", [])
    extra = [line for line in collapsed.splitlines() if line not in healthy.splitlines()]
    assert extra == ["  " + report.summary_line()]
    assert extra[0].startswith("  radius collapsed: 100.0% of the test queries at the clip radius d0 = 4.60")
    assert "radius" not in healthy


@pytest.fixture
def tiny_recipe():
    from tests.recipes.test_recipe_end_to_end import TINY, load_recipe

    return TINY, load_recipe("hyp_vit").HypViT


def test_recipe_run_reports_a_collapse_once(tmp_path, capsys, tiny_recipe):
    """The papers' head (radius='norm') on a ViT's features: every test embedding at the clip radius."""
    tiny, recipe = tiny_recipe
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = recipe.main(tiny + ["--eval-before", "false", "--no-plots", "--head-radius", "norm",
                                      "--output-dir", str(tmp_path / "run")])
    collapse = [w for w in caught if issubclass(w.category, RadiusCollapseWarning)]
    assert len(collapse) == 1 and "sit at the clip radius d0 = 4.60" in str(collapse[0].message)
    out = capsys.readouterr().out
    assert out.count("radius collapsed:") == 1
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["radius_collapse"]["kind"] == "clip" and saved["radius_collapse"]["fraction_at_clip"] > 0.5
    assert results["radius_collapse"]["summary"] in out


def test_recipe_run_with_a_spread_radius_says_nothing(tmp_path, capsys, tiny_recipe):
    tiny, recipe = tiny_recipe
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the polar head; a head learning rate that spreads its radius well past the tolerance in two steps
        recipe.main(tiny + ["--eval-before", "false", "--no-plots", "--head-lr", "0.01",
                            "--output-dir", str(tmp_path / "run")])
    assert not [w for w in caught if issubclass(w.category, RadiusCollapseWarning)]
    assert "radius collapsed" not in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "results.json").read_text())["radius_collapse"] is None


# ---- a real collapse ----
def test_triplet_loss_with_the_papers_head_collapses_and_is_flagged():
    """PML's TripletMarginLoss on PoincareDistance with the papers' head (radius='norm') on features of
    pretrained-like norm: every embedding stays at the clip radius through training."""
    from pytorch_metric_learning import losses

    torch.manual_seed(0)
    centers = 3 * torch.randn(8, 32)

    def batch(per_class=4):
        labels = torch.arange(8).repeat_interleave(per_class)
        return centers[labels] + 3 * torch.randn(len(labels), 32), labels

    geometry = PoincareGeometry(c=0.1)
    head = HyperbolicEmbeddingHead(32, 8, c=geometry, radius="norm")
    loss_fn = losses.TripletMarginLoss(margin=0.1, distance=PoincareDistance(c=geometry))
    optimizer = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(100):
        features, labels = batch()
        loss = loss_fn(head(features), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        embeddings = head(batch(16)[0])
    report = radius_collapse(embeddings, geometry)
    assert report is not None and report.kind == "clip" and report.fraction_at_clip > 0.9
    # the polar head on the same data keeps its radius spread: not flagged
    polar = HyperbolicEmbeddingHead(32, 8, c=geometry)
    optimizer = torch.optim.Adam(polar.parameters(), lr=1e-2)
    for _ in range(100):
        features, labels = batch()
        loss = loss_fn(polar(features), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        assert radius_collapse(polar(batch(16)[0]), geometry) is None
