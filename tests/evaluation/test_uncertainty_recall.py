"""uncertainty_failure_auroc: the AUROC of the Hyp-UML uncertainty for "top-1 is wrong"."""
import math

import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import uncertainty_failure_auroc, uncertainty_recall_table


def _queries_and_gallery():
    # Gallery: two classes at opposite directions. Queries: class-0 points at radii 0.2..2.4 (tangent
    # norm) along directions tilted towards class 1; the near-origin ones are retrieved wrongly.
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.0]]) * 2.0
    gl = torch.tensor([0, 1])
    angles = torch.linspace(0.3, 2.8, 8)  # from near class 0 to near class 1
    radii = torch.linspace(2.2, 0.3, 8)   # the ones tilted towards class 1 also sit near the origin
    q = torch.stack([torch.cos(angles), torch.sin(angles)], 1) * radii[:, None]
    ql = torch.zeros(8, dtype=torch.long)
    return pb.expmap0(q, 0.1), ql, pb.expmap0(g, 0.1), gl


def test_failures_nearer_the_origin_give_auroc_one():
    q, ql, g, gl = _queries_and_gallery()
    auroc = uncertainty_failure_auroc(q, ql, c=0.1, reference_embeddings=g, reference_labels=gl)
    assert auroc == pytest.approx(1.0)


def test_matches_sklearn_on_random_data_and_agrees_with_the_table():
    from sklearn.metrics import roc_auc_score

    from pml_hyperbolic.evaluation.uncertainty_recall import _query_hits
    from pml_hyperbolic.uncertainty import hyperbolic_uncertainty

    gen = torch.Generator().manual_seed(0)
    x = pb.expmap0(torch.randn(300, 8, generator=gen) * torch.rand(300, 1, generator=gen) * 2, 0.1)
    y = torch.randint(0, 10, (300,), generator=gen)
    auroc = uncertainty_failure_auroc(x, y, c=0.1)
    hit, u = _query_hits(x, y, 0.1, None, None, 2.3, None, None, None)
    assert auroc == pytest.approx(roc_auc_score(hit.numpy() < 0.5, u.numpy()))
    # the same queries and hits as the per-bin table
    table = uncertainty_recall_table(x, y, c=0.1, n_bins=3)
    assert sum(r["count"] for r in table) == len(hit)
    assert sum(r["count"] * r["recall_at_1"] for r in table) == pytest.approx(float(hit.sum()))
    assert u.shape == hyperbolic_uncertainty(x, c=0.1).shape


def test_undefined_when_every_query_is_a_hit():
    q, ql, g, gl = _queries_and_gallery()
    auroc = uncertainty_failure_auroc(q[:2], ql[:2], c=0.1, reference_embeddings=g, reference_labels=gl)
    assert math.isnan(auroc)


def test_bad_arguments():
    q, ql, g, gl = _queries_and_gallery()
    with pytest.raises(ValueError, match="go together"):
        uncertainty_failure_auroc(q, ql, c=0.1, reference_embeddings=g)
    with pytest.raises(ValueError, match="NaN"):
        uncertainty_failure_auroc(q * float("nan"), ql, c=0.1)
    with pytest.raises(ValueError, match="one entry per embedding"):
        uncertainty_failure_auroc(q, ql[:3], c=0.1)
