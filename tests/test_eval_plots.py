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


def test_group_colours_are_distinct_hues():
    import numpy as np

    from pml_hyperbolic.evaluation.poincare_disk_plot import group_colours

    for n in (2, 6, 10, 12, 20):
        rgb = group_colours(n)[:, :3]
        assert rgb.shape == (n, 3)
        gaps = np.linalg.norm(rgb[:, None] - rgb[None], axis=2) + np.eye(n) * 9
        # neighbouring group ids (e.g. two sibling classes) never differ in lightness only
        assert min(np.linalg.norm(rgb[i] - rgb[i + 1]) for i in range(n - 1)) > 0.2
        if n <= 10:
            assert gaps.min() > 0.25
        assert len({tuple(c) for c in rgb}) == n
    assert group_colours(50).shape == (50, 4)


def _pixels_near(image, rgb, tol=0.06):
    import numpy as np

    return int((np.abs(image[:, :, :3] - np.asarray(rgb)[None, None]).max(axis=2) < tol).sum())


def test_disk_plot_pixels_show_the_disk_the_groups_and_the_shading(tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    from pml_hyperbolic.evaluation.poincare_disk_plot import group_colours

    # three well separated groups along the first axis
    centres = torch.tensor([[-2.0, 0.0], [0.0, 1.5], [2.0, 0.0]], dtype=torch.float64)
    y = torch.arange(3).repeat_interleave(20)
    v = centres[y] + 0.05 * torch.randn(60, 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = pb.expmap0(v, 1.0)
    path = tmp_path / "disk.png"
    plot_poincare_disk(x, y, path, c=1.0, figsize=(4, 4), dpi=100, title=" ", point_size=30)
    image = mpimg.imread(path)
    dark = image[:, :, :3].max(axis=2) < 0.25
    rows, cols = np.nonzero(dark)
    # the unit circle: a square bounding box, centred, and hollow in the middle
    height, width = rows.max() - rows.min(), cols.max() - cols.min()
    assert abs(height - width) <= 3 and height > 200
    centre = (rows.min() + height // 2, cols.min() + width // 2)
    assert not dark[centre[0] - 20:centre[0] + 20, centre[1] - 20:centre[1] + 20].any()
    colours = group_colours(3)[:, :3]
    for rgb in colours:
        assert _pixels_near(image, rgb) > 50  # each group's colour is on the canvas
    # shading: the most uncertain group is drawn faint (blended towards white), the others full
    u = (y == 2).double()
    shaded = tmp_path / "shaded.png"
    plot_poincare_disk(x, y, shaded, c=1.0, figsize=(4, 4), dpi=100, title=" ", point_size=30, uncertainty=u)
    image = mpimg.imread(shaded)
    # (overlapping faint markers add up, so a few pixels of the full colour may remain)
    assert _pixels_near(image, colours[2]) < 0.2 * _pixels_near(image, colours[0])
    # the faint group: green-tinted pixels (green channel on top) lighter than the full colour
    rgb = image[:, :, :3]
    greenish_pale = (rgb[:, :, 1] > rgb[:, :, 0] + 0.03) & (rgb[:, :, 1] > rgb[:, :, 2] + 0.03) & (rgb.min(axis=2) > 0.3)
    assert greenish_pale.sum() > 50


def test_disk_plot_radius_histogram_panel(tmp_path):
    import numpy as np
    from PIL import Image

    from pml_hyperbolic.evaluation import plot_poincare_disk
    from pml_hyperbolic.heads import ToPoincare

    g = torch.Generator().manual_seed(0)
    emb = ToPoincare(c=0.1, clip_r=2.3)(torch.randn(50, 8, generator=g) * 0.3)
    plain, with_hist = tmp_path / "plain.png", tmp_path / "hist.png"
    plot_poincare_disk(emb, torch.arange(50) % 5, str(plain), c=0.1)
    plot_poincare_disk(emb, torch.arange(50) % 5, str(with_hist), c=0.1, radius_histogram=True)
    w0, h0 = Image.open(plain).size
    w1, h1 = Image.open(with_hist).size
    assert w1 == w0 and h1 > h0  # the histogram panel is added below the disk
    bottom = np.asarray(Image.open(with_hist).convert("L"))[int(h1 * 0.8):]
    assert (bottom < 200).mean() > 0.01  # the panel holds drawn bars and axes, not blank space
