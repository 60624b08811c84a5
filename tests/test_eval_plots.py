import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import plot_poincare_disk, plot_uncertainty_vs_recall, uncertainty_recall_table
from pml_hyperbolic.evaluation.poincare_disk_plot import tangent_pca_2d


def data(n=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 6, (n,), generator=g)
    v = torch.randn(6, 16, generator=g)[y] * 2 + 0.5 * torch.randn(n, 16, generator=g)
    return pb.expmap0(v * torch.rand(n, 1, generator=g), 0.1), y


def png_size(path):
    import matplotlib.image as mpimg

    return mpimg.imread(path).shape[:2]


def test_disk_plot_written_with_size(tmp_path):
    x, y = data()
    p = tmp_path / "disk.png"
    xy = plot_poincare_disk(x, y, p, c=0.1, figsize=(4, 3), dpi=50)
    assert p.stat().st_size > 1000 and png_size(p) == (150, 200)
    assert xy.shape == (240, 2) and (xy ** 2).sum(1).max() < 1.0  # inside the unit disk
    hier = torch.stack([y, y // 2], 1)
    p2 = tmp_path / "h.png"
    plot_poincare_disk(x, hier, p2, c=0.1, color_by="hierarchy", uncertainty=torch.rand(240))
    assert png_size(p2) == (600, 600)


def test_tangent_pca_preserves_radius_in_plane():
    v = torch.zeros(50, 5, dtype=torch.float64)
    v[:, :2] = torch.randn(50, 2, dtype=torch.float64)
    x = pb.expmap0(v, 0.5)
    x2 = tangent_pca_2d(x, 0.5)
    torch.testing.assert_close(pb.dist0(x2, 0.5), pb.dist0(x, 0.5))


def test_tangent_pca_keeps_every_distance_to_origin():
    # 128-d points off any 2-D plane: two principal components keep a small part of each norm,
    # yet every plotted point must keep its exact hyperbolic distance to the origin.
    torch.manual_seed(0)
    x = pb.expmap0(torch.randn(200, 128, dtype=torch.float64) * 0.2, 0.1)
    x2 = tangent_pca_2d(x, 0.1)
    torch.testing.assert_close(pb.dist0(x2, 0.1), pb.dist0(x, 0.1))
    shrunk = tangent_pca_2d(x, 0.1, keep_radius=False)
    assert float((pb.dist0(shrunk, 0.1) / pb.dist0(x, 0.1)).median()) < 0.5


def test_uncertainty_table_and_plot(tmp_path):
    x, y = data(300, 1)
    table = uncertainty_recall_table(x, y, c=0.1, n_bins=10, clip_r=10.0)  # no point beyond r: distinct U
    assert len(table) == 10 and sum(r["count"] for r in table) == 300
    assert all(0 <= r["recall_at_1"] <= 1 for r in table)
    assert all(a["u_max"] <= b["u_min"] for a, b in zip(table, table[1:]))
    # precomputed uncertainty: bin 0 holds the smallest scores
    u = torch.arange(300.0)
    t2 = uncertainty_recall_table(x, y, c=0.1, n_bins=3, uncertainty=u)
    assert [r["count"] for r in t2] == [100, 100, 100] and t2[0]["u_max"] == 99
    p = tmp_path / "u.png"
    plot_uncertainty_vs_recall(x, y, p, c=0.1, n_bins=5, clip_r=10.0, figsize=(5, 3), dpi=40)
    assert png_size(p) == (120, 200)


def test_plot_bad_inputs(tmp_path):
    x, y = data(20)
    with pytest.raises(ValueError, match="hierarchy"):
        plot_poincare_disk(x, y, tmp_path / "a.png", color_by="hierarchy")
    with pytest.raises(ValueError, match="NaN"):
        plot_poincare_disk(x * float("nan"), y, tmp_path / "a.png")
    with pytest.raises(ValueError, match="labels"):
        plot_poincare_disk(x, y[:5], tmp_path / "a.png")
    with pytest.raises(ValueError, match="n_bins"):
        uncertainty_recall_table(x, y, n_bins=0)
