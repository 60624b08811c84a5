"""bench/uncertainty.py: its metrics on reference values and its plumbing on a synthetic bank."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bench import _quality_common as qc
from bench import uncertainty as bu


def test_auroc_matches_scikit_learn_with_ties():
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    positive = rng.random(200) < 0.3
    score = np.round(rng.random(200) + positive * 0.3, 1)  # many ties
    assert bu.auroc(positive, score) == pytest.approx(roc_auc_score(positive, score), abs=1e-12)
    assert np.isnan(bu.auroc(np.zeros(5, bool), np.arange(5.0)))


def test_aurc_reference_values():
    wrong = np.array([0, 1, 0, 1])
    # perfect order (the two right ones first): risks 0, 0, 1/3, 1/2
    assert bu.aurc(wrong, np.array([0.1, 0.9, 0.2, 0.8])) == pytest.approx((5 / 24, 0.0))
    # reversed order: risks 1, 1, 2/3, 1/2; E-AURC = AURC − the perfect order's
    value, excess = bu.aurc(wrong, np.array([0.9, 0.1, 0.8, 0.2]))
    assert value == pytest.approx((1 + 1 + 2 / 3 + 1 / 2) / 4)
    assert excess == pytest.approx(value - 5 / 24)


def test_public_function_is_the_vote_plus_the_prototype_term():
    from pml_hyperbolic import poincare_ball as pb
    from pml_hyperbolic.evaluation import retrieval_uncertainty
    from pml_hyperbolic.evaluation.retrieval_confidence import PROTOTYPE_WEIGHT

    gen = torch.Generator().manual_seed(0)
    q = pb.expmap0(torch.randn(30, 4, generator=gen, dtype=torch.float64), 0.1)
    g = pb.expmap0(torch.randn(80, 4, generator=gen, dtype=torch.float64), 0.1)
    y = torch.arange(80) % 5
    dist, idx = bu.neighbours(q, g, 0.1)
    scores = bu.candidate_scores(dist, y[idx])
    rho = bu.prototype_ratio(q, g, y, idx[:, 0], 0.1)
    expected = (scores["vote@20,p8"] + PROTOTYPE_WEIGHT * rho) / (1 + PROTOTYPE_WEIGHT)
    np.testing.assert_allclose(retrieval_uncertainty(q, g, y, c=0.1).numpy(), expected, rtol=1e-9)
    assert scores["top1_dist"] == pytest.approx(dist[:, 0].numpy())
    assert ((scores["agree@10"] >= 0) & (scores["agree@10"] <= 1)).all()


def _synthetic_bank(dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def points(n_classes, per, spread=0.8):
        centers = torch.randn(n_classes, dim, generator=gen) * spread
        labels = torch.arange(n_classes).repeat_interleave(per)
        return centers, labels, centers[labels] + torch.randn(len(labels), dim, generator=gen)

    _, yt, xt = points(16, 6)
    xt = torch.stack([xt, xt + 0.1 * torch.randn(xt.shape, generator=gen)], 1)
    families = np.array(["display" if i % 3 == 0 else "serif" for i in range(len(yt))])
    centers, yq, xq = points(8, 3)
    yg = torch.arange(8).repeat_interleave(4)
    xg = centers[yg] + torch.randn(len(yg), dim, generator=gen)
    return qc.Bank("glyphs", qc.Split(xt, yt, torch.zeros_like(yt), families), qc.Split(xq, yq), qc.Split(xg, yg),
                   torch.nn.Identity(), dim)


def test_bench_runs_every_model_on_a_synthetic_bank(monkeypatch):
    bank = _synthetic_bank()
    monkeypatch.setattr(bu.qc, "build_bank", lambda cfg, dataset, **kw: bank)
    monkeypatch.setattr(bu.qc, "pooled_bank", lambda b, cfg, **kw: b)
    noisy = {kind: bank.query.acts + 2 * torch.randn(bank.query.acts.shape, generator=torch.Generator().manual_seed(1))
             for kind in bu.DEGRADATIONS}
    monkeypatch.setattr(bu, "degraded_query_features", lambda cfg, dataset, **kw: noisy)
    results, _ = bu.run_bench(["--datasets", "glyphs", "--steps", "3", "--seeds", "0", "--val-classes", "4",
                               "--threads", "1"])
    dom = results["domains"]["glyphs"]
    assert [r["model"] for r in dom["runs"]] == list(bu.MODELS)
    for run in dom["runs"]:
        scores = run["test"]["scores"]
        assert set(bu.SINGLE[1:]) | {bu.PUBLIC} <= set(scores)
        assert ("radius" in scores) == run["model"].startswith("ball")
        for name in (bu.PUBLIC, "top1_dist"):
            assert {"auroc_fail", "aurc", "e_aurc", "auroc_blur", "auroc_noise", "auroc_occlude",
                    "auroc_degraded"} <= set(scores[name])
            assert scores[name]["aurc"] >= scores[name]["aurc"] - scores[name]["e_aurc"] >= 0
        assert run["val"] is not None and 0 <= run["val"]["r1"] <= 1
    summary = results["summary"]["glyphs"]
    assert summary["test"]["target_a"] in (True, False, None)
    assert set(summary["test"]["public_minus_best_single_same_model"]) == set(bu.MODELS)
    rows = bu.flat_rows(results)
    public = [r for r in rows if r["split"] == "test" and r["score"] == bu.PUBLIC]
    assert [r["model"] for r in public] == list(bu.MODELS)
    assert all(0 <= r["auroc_fail"] <= 1 and len(r["auroc_fail_per_seed"]) == 1 for r in public)
    assert {r["split"] for r in rows if r["model"] == "targets"} == {"val", "test"}


def test_bad_arguments():
    with pytest.raises(SystemExit, match="unknown model"):
        bu.run_bench(["--models", "ball_ms,nope"])
    with pytest.raises(SystemExit, match="--splits"):
        bu.run_bench(["--splits", "train"])
