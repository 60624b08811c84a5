import math

import pytest
import torch

from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.uncertainty import UNCERTAINTY_MODES, hyperbolic_uncertainty, uncertainty_ratio_log


def test_clip_mode_matches_tangent_norm():
    v = torch.randn(20, 8, dtype=torch.float64)
    z = ToPoincare(c=0.1, clip_r=2.3)(v)
    u = hyperbolic_uncertainty(z, c=0.1)
    r = v.norm(dim=1).clamp(max=2.3)
    assert torch.allclose(u, 1 - r / 2.3, atol=1e-6)
    assert u.shape == (20,) and not u.requires_grad


@pytest.mark.parametrize("mode", ["clip", "ball", "batch"])
def test_sound_modes_in_unit_interval_and_ordered(mode):
    radii = torch.linspace(0.0, 2.3, 7, dtype=torch.float64)
    v = torch.zeros(7, 3, dtype=torch.float64)
    v[:, 0] = radii
    z = ToPoincare(c=0.1, clip_r=2.3)(v)
    u = hyperbolic_uncertainty(z, c=0.1, mode=mode)
    assert bool(((u >= 0) & (u <= 1)).all())
    assert bool((u[1:] < u[:-1]).all())  # nearer the origin = more uncertain


def test_literal_mode_warns_and_ratio_guard_is_finite():
    z = ToPoincare(c=0.1, clip_r=2.3)(torch.randn(10, 4) * 5)
    with pytest.warns(RuntimeWarning, match="literal"):
        u = hyperbolic_uncertainty(z, c=0.1, mode="literal")
    assert bool((u < 0).all())
    f = uncertainty_ratio_log(u)
    assert bool(torch.isfinite(f).all())
    d0 = (2 / math.sqrt(0.1)) * torch.atanh(math.sqrt(0.1) * z.double().norm(dim=1))
    assert torch.allclose(u.double(), 1 - d0 / 2, atol=1e-4)


def test_detach_switch_and_gradient_finite_at_origin():
    z = torch.zeros(3, 4, requires_grad=True)
    u = hyperbolic_uncertainty(z, detach=False, mode="ball")
    u.sum().backward()
    assert torch.isfinite(z.grad).all()


def test_bad_args():
    z = torch.zeros(3, 4)
    with pytest.raises(ValueError, match="mode"):
        hyperbolic_uncertainty(z, mode="nope")
    with pytest.raises(ValueError, match="clip_r"):
        hyperbolic_uncertainty(z, clip_r=0)
    with pytest.raises(ValueError, match="c"):
        hyperbolic_uncertainty(z, c=-1.0)
    with pytest.raises(ValueError, match="embeddings"):
        hyperbolic_uncertainty(torch.zeros(3))
    assert set(UNCERTAINTY_MODES) == {"clip", "ball", "batch", "literal"}


def test_batch_mode_constant_batch():
    assert torch.equal(hyperbolic_uncertainty(torch.zeros(4, 2), mode="batch"), torch.ones(4))


def test_ratio_of_a_saturated_batch_is_log2_not_zero():
    # every embedding at the clip radius: U = 0 for all, U/max U is taken as 1 (uniformly certain)
    z = ToPoincare(c=0.1, clip_r=2.3)(torch.randn(16, 8) * 10)
    u = hyperbolic_uncertainty(z, c=0.1)
    assert torch.all(u == 0)
    f = uncertainty_ratio_log(u)
    torch.testing.assert_close(f, torch.full_like(f, math.log(2.0)))
    # mixed batch: the clipped anchors get 0, the most uncertain log 2, the rest in between
    u2 = torch.tensor([0.0, 0.25, 0.5])
    torch.testing.assert_close(uncertainty_ratio_log(u2), torch.log(torch.tensor([1.0, 1.5, 2.0])))


def test_recall_table_never_splits_ties_by_data_order():
    from pml_hyperbolic.evaluation import uncertainty_recall_table

    # first half of the data is retrievable, second half is not; all at the clip radius
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 8, generator=g) * 10
    labels = torch.arange(10).repeat_interleave(4)
    v = centers[labels] + 0.01 * torch.randn(40, 8, generator=g)
    v[20:] = torch.randn(20, 8, generator=g) * 10
    z = ToPoincare(c=0.1, clip_r=2.3)(v)
    with pytest.warns(RuntimeWarning, match="distinct uncertainty bin"):
        table = uncertainty_recall_table(z, labels, c=0.1, n_bins=5)
    assert len(table) == 1 and table[0]["count"] == 40 and table[0]["u_max"] == 0.0
    # distinct values: equal-count quantile bins as before
    u = torch.arange(40, dtype=torch.float64)
    table = uncertainty_recall_table(z, labels, c=0.1, n_bins=4, uncertainty=u)
    assert [r["count"] for r in table] == [10, 10, 10, 10]
    assert [r["u_min"] for r in table] == [0.0, 10.0, 20.0, 30.0]


def test_recall_table_leaves_lone_queries_out_like_the_calculator():
    from pml_hyperbolic.evaluation import RecallAtKAccuracyCalculator, uncertainty_recall_table

    g = torch.Generator().manual_seed(1)
    z = ToPoincare(c=0.1, clip_r=10.0)(torch.randn(60, 6, generator=g))
    labels = torch.cat([torch.arange(25).repeat_interleave(2), torch.arange(100, 110)])  # 10 lone
    u = torch.rand(60, generator=g, dtype=torch.float64)
    table = uncertainty_recall_table(z, labels, c=0.1, n_bins=5, uncertainty=u)
    assert sum(r["count"] for r in table) == 50
    pooled = sum(r["recall_at_1"] * r["count"] for r in table) / 50
    calc = RecallAtKAccuracyCalculator(k_values=(1,), c=0.1, include=("recall_at_1",))
    assert pooled == pytest.approx(calc.get_accuracy(z, labels)["recall_at_1"])
    # lone queries' uncertainties do not shape the bins
    assert max(r["u_max"] for r in table) == pytest.approx(float(u[:50].max()))
    with pytest.raises(ValueError, match="alone in its class"):
        uncertainty_recall_table(z[:5], torch.arange(5), c=0.1, uncertainty=u[:5])



def test_recall_table_per_bin_equals_brute_force():
    import numpy as np

    from pml_hyperbolic import poincare_ball as pb
    from pml_hyperbolic.evaluation import uncertainty_recall_table

    g = torch.Generator().manual_seed(3)
    z = ToPoincare(c=0.1, clip_r=10.0)(torch.randn(90, 5, generator=g) * 2)
    labels = torch.arange(90) % 9
    u = torch.randperm(90, generator=g).double()  # distinct values: 3 bins of 30 by rank
    table = uncertainty_recall_table(z, labels, c=0.1, n_bins=3, uncertainty=u)
    D = pb.pairwise_dist(z.double(), z.double(), 0.1).fill_diagonal_(float("inf"))
    hit = (labels[D.argmin(dim=1)] == labels).double().numpy()
    order = np.argsort(u.numpy())
    for row, part in zip(table, np.array_split(order, 3)):
        assert row["count"] == 30
        assert row["recall_at_1"] == pytest.approx(hit[part].mean())
        assert row["u_min"] == float(u[part].min()) and row["u_max"] == float(u[part].max())
    bad = u.clone()
    bad[4] = float("nan")
    with pytest.raises(ValueError, match="uncertainty contains NaN"):
        uncertainty_recall_table(z, labels, c=0.1, uncertainty=bad)


def test_recall_table_query_to_reference_equals_brute_force():
    import numpy as np

    from pml_hyperbolic import poincare_ball as pb
    from pml_hyperbolic.evaluation import uncertainty_recall_table

    g = torch.Generator().manual_seed(4)
    to_ball = ToPoincare(c=0.1, clip_r=10.0)
    q, ref = to_ball(torch.randn(60, 5, generator=g) * 2), to_ball(torch.randn(80, 5, generator=g) * 2)
    q_labels, ref_labels = torch.arange(60) % 12, torch.arange(80) % 10  # classes 10, 11: no reference
    u = torch.randperm(60, generator=g).double()
    table = uncertainty_recall_table(q, q_labels, c=0.1, n_bins=2, uncertainty=u,
                                     reference_embeddings=ref, reference_labels=ref_labels)
    D = pb.pairwise_dist(q.double(), ref.double(), 0.1)
    hit = (ref_labels[D.argmin(dim=1)] == q_labels).double().numpy()
    keep = (q_labels < 10).numpy()
    order = np.argsort(u.numpy()[keep])
    for row, part in zip(table, np.array_split(order, 2)):
        assert row["count"] == len(part)
        assert row["recall_at_1"] == pytest.approx(hit[keep][part].mean())
    with pytest.raises(ValueError, match="go together"):
        uncertainty_recall_table(q, q_labels, c=0.1, reference_embeddings=ref)
    with pytest.raises(ValueError, match="reference_embeddings must be"):
        uncertainty_recall_table(q, q_labels, c=0.1, reference_embeddings=ref[:, :3], reference_labels=ref_labels)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_inputs_raise_instead_of_passing_through(bad):
    from pml_hyperbolic.losses import HypMixLoss

    z = ToPoincare(c=0.1)(torch.randn(6, 4))
    z[2, 1] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        hyperbolic_uncertainty(z, c=0.1)
    feats = torch.randn(6, 4)
    feats[0, 0] = bad
    with pytest.raises(ValueError, match="NaN/Inf"):
        HypMixLoss()(feats, torch.tensor([0, 0, 1, 1, 2, 2]))
    with pytest.raises(ValueError, match="NaN/Inf"):
        ToPoincare(c=0.1)(feats)


def test_bad_embeddings_and_clip_r_are_rejected_naming_them():
    import numpy as np

    from pml_hyperbolic.uncertainty import hyperbolic_uncertainty

    with pytest.raises(TypeError, match="embeddings: expected a torch.Tensor"):
        hyperbolic_uncertainty(np.zeros((3, 2)), 0.1)
    with pytest.raises(TypeError, match="embeddings must be a floating-point tensor"):
        hyperbolic_uncertainty(torch.zeros(3, 2, dtype=torch.int64), 0.1)
    for bad, error in (("2.3", TypeError), (True, TypeError), (math.inf, ValueError), (0.0, ValueError)):
        with pytest.raises(error, match="clip_r"):
            hyperbolic_uncertainty(torch.zeros(3, 2), 0.1, clip_r=bad)


def test_float32_uncertainty_reads_the_curvature_in_float64():
    """U's distance to the origin near the boundary uses the unrounded c = 0.1 (as float64 does)."""
    from pml_hyperbolic.uncertainty import hyperbolic_uncertainty

    x32 = torch.tensor([[(1 - 2e-5) / math.sqrt(0.1), 0.0]], dtype=torch.float64).float()
    u32 = hyperbolic_uncertainty(x32, 0.1, mode="clip", clip_r=100.0)
    u64 = hyperbolic_uncertainty(x32.double(), 0.1, mode="clip", clip_r=100.0)
    assert u32.dtype == torch.float32
    assert abs(u32.item() - u64.item()) <= 2e-7
