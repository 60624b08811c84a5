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
    assert png_size(p2) == (600, 760)  # default: 7.6 x 6 inches (disk + legend column)
    p3 = tmp_path / "no_legend.png"
    plot_poincare_disk(x, y, p3, c=0.1, legend=False, radius_histogram=True)
    assert png_size(p3) == (780, 600)


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
    hier = torch.stack([y, y // 2, y // 4], 1)
    with pytest.raises(ValueError, match="hierarchy_level 3"):
        plot_poincare_disk(x, hier, tmp_path / "a.png", hierarchy_level=3)
    with pytest.raises(ValueError, match="clip_r"):
        plot_poincare_disk(x, y, tmp_path / "a.png", clip_r=-1.0)
    with pytest.raises(ValueError, match="color_by"):
        plot_poincare_disk(x, y, tmp_path / "a.png", color_by="radius")
    with pytest.raises(ValueError, match="max_legend_entries"):
        plot_poincare_disk(x, y, tmp_path / "a.png", max_legend_entries=0)
    with pytest.raises(ValueError, match="empty"):
        plot_uncertainty_vs_recall(x, y, tmp_path / "u.png", table=[])


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
    plot_poincare_disk(x, y, path, c=1.0, figsize=(4, 4), dpi=100, title=" ", point_size=30, legend=False)
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
    plot_poincare_disk(x, y, shaded, c=1.0, figsize=(4, 4), dpi=100, title=" ", point_size=30, uncertainty=u,
                       legend=False)
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


def _disk_geometry_px(image, width_fraction=1.0):
    """Centre (row, col) and radius in pixels of the drawn unit circle: the bounding box of the dark
    pixels in the left ``width_fraction`` of the image (the legend's text lies to the right)."""
    import numpy as np

    dark = image[:, : int(image.shape[1] * width_fraction), :3].max(axis=2) < 0.25
    rows, cols = np.nonzero(dark)
    return (rows.min() + rows.max()) / 2, (cols.min() + cols.max()) / 2, (rows.max() - rows.min()) / 2


def _pixels_at_radius(image, centre, radius, rgb, tol=0.08, band=2.0):
    """How many pixels of colour ``rgb`` lie within ``band`` px of the circle of ``radius`` px."""
    import numpy as np

    rr, cc = np.mgrid[: image.shape[0], : image.shape[1]]
    ring = np.abs(np.hypot(rr - centre[0], cc - centre[1]) - radius) <= band
    colour = np.abs(image[:, :, :3] - np.asarray(rgb)[None, None]).max(axis=2) < tol
    return int((ring & colour).sum())


def test_disk_rings_and_clip_radius_are_drawn_where_they_belong(tmp_path):
    import matplotlib.image as mpimg
    from matplotlib.colors import to_rgb

    from pml_hyperbolic.evaluation.poincare_disk_plot import clip_distance, disk_radius_of_distance, ring_distances
    from pml_hyperbolic.geometry import PoincareGeometry

    geometry = PoincareGeometry(c=0.1, clip="hard", clip_r=2.3)
    x = geometry.to_ball(torch.randn(80, 8, generator=torch.Generator().manual_seed(0)) * 0.4)
    path = tmp_path / "rings.png"
    plot_poincare_disk(x, torch.arange(80) % 3, path, c=geometry, legend=False, title=" ", figsize=(5, 5))
    image = mpimg.imread(path)
    centre_r, centre_c, radius = _disk_geometry_px(image)
    assert clip_distance(geometry) == pytest.approx(4.6)
    clip_px = radius * float(disk_radius_of_distance(4.6, 0.1))
    # the clip sphere: a dashed red circle at d0 = 2 r, and no red at a wrong radius
    assert _pixels_at_radius(image, (centre_r, centre_c), clip_px, to_rgb("tab:red")) > 60
    assert _pixels_at_radius(image, (centre_r, centre_c), clip_px * 0.8, to_rgb("tab:red")) < 5
    for d in ring_distances(4.6):  # the grey d0 rings at tanh(sqrt(c) d / 2)
        ring_px = radius * float(disk_radius_of_distance(d, 0.1))
        assert _pixels_at_radius(image, (centre_r, centre_c), ring_px, (0.72, 0.72, 0.72), tol=0.1) > 80
    plain = tmp_path / "plain.png"  # no rings, no clip (a float c has no clip radius)
    plot_poincare_disk(x, torch.arange(80) % 3, plain, c=0.1, legend=False, title=" ", figsize=(5, 5), rings=False)
    image = mpimg.imread(plain)
    ring_px = radius * float(disk_radius_of_distance(ring_distances(4.6)[0], 0.1))
    assert _pixels_at_radius(image, (centre_r, centre_c), ring_px, (0.72, 0.72, 0.72), tol=0.1) < 5
    assert _pixels_at_radius(image, (centre_r, centre_c), clip_px, to_rgb("tab:red")) < 5


def test_ring_distance_functions_reference_values():
    import numpy as np

    from pml_hyperbolic.evaluation.poincare_disk_plot import disk_radius_of_distance, ring_distances

    np.testing.assert_allclose(ring_distances(4.6), [2.0, 4.0])
    np.testing.assert_allclose(ring_distances(10.0), [2.5, 5.0, 7.5, 10.0])
    np.testing.assert_allclose(ring_distances(0.9), [0.25, 0.5, 0.75])
    assert len(ring_distances(0.0)) == 0 and len(ring_distances(float("inf"))) == 0
    # a point at hyperbolic distance d from the origin of the c-ball: Euclidean radius tanh(sqrt(c) d/2)/sqrt(c)
    x = pb.expmap0(torch.tensor([[1.7, 0.0]], dtype=torch.float64), 0.1)
    d = float(pb.dist0(x, 0.1))
    assert float(disk_radius_of_distance(d, 0.1)) == pytest.approx(float(x.norm()) * 0.1 ** 0.5)
    assert float(disk_radius_of_distance(float("inf"), 0.1)) == 1.0


def test_disk_legend_column_and_hierarchy_colouring(tmp_path):
    import matplotlib.image as mpimg

    from pml_hyperbolic.evaluation.poincare_disk_plot import group_colours

    x, y = data(240, 2)
    with_legend, without = tmp_path / "legend.png", tmp_path / "none.png"
    plot_poincare_disk(x, y, with_legend, c=0.1)
    plot_poincare_disk(x, y, without, c=0.1, legend=False, figsize=(7.6, 6.0))
    right = mpimg.imread(with_legend)[:, int(760 * 0.69):, :3]
    bare = mpimg.imread(without)[:, int(760 * 0.88):, :3]  # right of the (centred) circle
    assert (right.max(axis=2) < 0.3).sum() > 300  # legend text
    assert (bare.max(axis=2) < 0.3).sum() == 0
    for rgb in group_colours(6)[:, :3]:  # one marker per class in the legend column
        assert _pixels_near(right, rgb) > 10
    # N x K labels: coloured by the parent level (3 parents) by default, in the disk and the legend
    hier = torch.stack([y, y // 2], 1)
    parent = tmp_path / "parent.png"
    plot_poincare_disk(x, hier, parent, c=0.1)
    image = mpimg.imread(parent)
    for rgb in group_colours(3)[:, :3]:
        assert _pixels_near(image, rgb) > 20
    for rgb in group_colours(6)[3:, :3]:  # finest-level colours beyond the three parents: absent
        assert _pixels_near(image, rgb) == 0
    # many classes, every one coloured (highlight=None): a colour bar instead of a list
    many = tmp_path / "many.png"
    plot_poincare_disk(x, torch.arange(240) % 40, many, c=0.1, highlight=None)
    column = mpimg.imread(many)[:, int(760 * 0.69):, :3]
    viridis = group_colours(40)[:, :3]
    assert sum(_pixels_near(column, rgb, tol=0.02) > 0 for rgb in viridis) > 30


def test_uncertainty_plot_overall_line_and_bin_labels(tmp_path):
    import matplotlib.image as mpimg
    import numpy as np
    from matplotlib.colors import to_rgb

    from pml_hyperbolic.evaluation.uncertainty_recall import bin_label, label_decimals, overall_recall_at_1

    table = [
        {"bin": 0, "u_min": 0.0, "u_max": 0.1, "u_mean": 0.05, "count": 1, "recall_at_1": 1.0},
        {"bin": 1, "u_min": 0.1, "u_max": 0.4, "u_mean": 0.2, "count": 3, "recall_at_1": 0.6},
    ]
    assert overall_recall_at_1(table) == pytest.approx(0.7)  # (1 * 1.0 + 3 * 0.6) / 4
    assert bin_label(table[1]) == "0.10–0.40\nn = 3"
    assert bin_label({"u_min": 0.0, "u_max": 0.0, "count": 7}) == "U = 0.00\nn = 7"
    narrow = [{"u_min": 0.5201, "u_max": 0.5203, "count": 2}, {"u_min": 0.5203, "u_max": 0.5210, "count": 2}]
    assert label_decimals(narrow) == 4 and label_decimals(table) == 2  # bounds stay distinct when printed
    assert bin_label(narrow[0], 4) == "0.5201\n–0.5203\nn=2"  # stacked: narrow enough for 10 bins
    path = tmp_path / "u.png"
    plot_uncertainty_vs_recall(None, None, path, table=table, dpi=100)
    image = mpimg.imread(path)[:, :, :3]
    blue_rows = np.nonzero(np.abs(image - np.asarray(to_rgb("tab:blue"))).max(axis=2) < 0.05)[0]
    top_of_full_bar, zero = blue_rows.min(), blue_rows.max()  # the recall-1.0 bar spans 0..1
    orange = np.abs(image - np.asarray(to_rgb("tab:orange"))).max(axis=2) < 0.08
    line_row = np.argmax(orange.sum(axis=1))
    assert orange.sum(axis=1).max() > 150  # a horizontal line across the axes
    assert (zero - line_row) / (zero - top_of_full_bar) == pytest.approx(0.7, abs=0.02)
    # one bin: a narrow bar in the middle of a wide axis (not one bar filling -0.4 .. 0.4)
    single = tmp_path / "one.png"
    one = [dict(table[0], count=4, recall_at_1=0.5)]
    plot_uncertainty_vs_recall(None, None, single, table=one, dpi=100)
    image = mpimg.imread(single)[:, :, :3]
    blue_cols = np.nonzero((np.abs(image - np.asarray(to_rgb("tab:blue"))).max(axis=2) < 0.05).any(axis=0))[0]
    assert 0.05 * image.shape[1] < len(blue_cols) < 0.2 * image.shape[1]
    assert abs((blue_cols.min() + blue_cols.max()) / 2 - image.shape[1] * 0.47) < 0.1 * image.shape[1]


def test_uncertainty_plot_protocol_and_overall_match_the_run(tmp_path):
    import matplotlib

    from pml_hyperbolic.evaluation.uncertainty_recall import overall_recall_at_1

    x, y = data(300, 3)
    queries, gallery = x[:100], x[100:]
    titles = []
    original = matplotlib.axes.Axes.set_title

    def spy(self, label, *args, **kwargs):
        titles.append(label)
        return original(self, label, *args, **kwargs)

    matplotlib.axes.Axes.set_title = spy
    try:
        table = plot_uncertainty_vs_recall(queries, y[:100], tmp_path / "g.png", c=0.1, n_bins=4, clip_r=10.0,
                                           reference_embeddings=gallery, reference_labels=y[100:])
        plot_uncertainty_vs_recall(queries, y[:100], tmp_path / "s.png", c=0.1, n_bins=4, clip_r=10.0)
    finally:
        matplotlib.axes.Axes.set_title = original
    assert "queries vs gallery" in titles[0] and "self-retrieval" in titles[1]
    # the overall line is the run's own Recall@1 on that protocol
    d = pb.pairwise_dist(queries.double(), gallery.double(), 0.1)
    run_recall = float((y[100:][d.argmin(1)] == y[:100]).double().mean())
    assert overall_recall_at_1(table) == pytest.approx(run_recall)


# ---- readability: few highlighted classes, labels off the points, U explained -----------------

def _capture_saved_figures(monkeypatch):
    """Keep every figure the plot functions save, to inspect their artists after the call."""
    import matplotlib.figure

    saved = []
    original = matplotlib.figure.Figure.savefig

    def spy(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return saved


def _ring_of_points(n=960, n_classes=160, seed=0):
    """Clipped embeddings in a thin annulus (d0 1.6 .. 2.8) crossed by the d0 = 2 ring, as a head on
    pretrained features gives: a label put on that ring would sit on the points."""
    from pml_hyperbolic.geometry import PoincareGeometry

    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, n_classes, (n,), generator=g)
    v = torch.randn(n_classes, 64, generator=g)[y] + 1.2 * torch.randn(n, 64, generator=g)
    v = v / v.norm(dim=1, keepdim=True) * (1.1 + 0.1 * torch.randn(n, 1, generator=g))
    geometry = PoincareGeometry(c=0.1, clip="hard", clip_r=2.3)
    return geometry.to_ball(v), y, geometry


def _disk_axes(fig):
    return next(ax for ax in fig.axes if any(t.get_gid() == "ring-label" for t in ax.texts))


def test_disk_plot_colours_at_most_highlight_classes_plus_grey(tmp_path, monkeypatch):
    import numpy as np

    from pml_hyperbolic.evaluation.poincare_disk_plot import OTHER_COLOUR

    x, y, geometry = _ring_of_points()
    saved = _capture_saved_figures(monkeypatch)
    for highlight in (10, 4):
        plot_poincare_disk(x, y, tmp_path / "disk.png", c=geometry, highlight=highlight)
        ax = _disk_axes(saved[-1])
        colours = np.concatenate([col.get_facecolors()[:, :3] for col in ax.collections])
        assert len(colours) == 960  # every point drawn once
        distinct = {tuple(np.round(rgb, 4)) for rgb in colours}
        assert len(distinct) == highlight + 1 and tuple(np.round(OTHER_COLOUR[:3], 4)) in distinct
        # the grey ones first (underneath), the highlighted ones on top
        grey, front = ax.collections
        assert grey.get_zorder() < front.get_zorder()
        assert {tuple(np.round(rgb, 4)) for rgb in grey.get_facecolors()[:, :3]} == {tuple(np.round(OTHER_COLOUR[:3], 4))}
        # the legend names the highlighted classes and the rest
        legend_ax = saved[-1].axes[1]
        texts = [t.get_text() for legend in legend_ax.get_children() if hasattr(legend, "get_texts")
                 for t in legend.get_texts()]
        assert sum(t.startswith("class ") for t in texts) == highlight
        assert f"{len(set(y.tolist())) - highlight} other classes" in texts


def test_highlighted_groups_are_the_largest_ties_by_label_or_the_given_list():
    import numpy as np

    from pml_hyperbolic.evaluation.poincare_disk_plot import highlighted_groups

    values = np.array([3, 5, 7, 9, 11])
    counts = np.array([4, 9, 4, 9, 1])
    # the three largest: 5 and 9 (9 each), then 3 before 7 (a tie at 4: the smaller label)
    assert values[highlighted_groups(values, counts, 3)].tolist() == [3, 5, 9]
    assert values[highlighted_groups(values, counts, 10)].tolist() == [3, 5, 7, 9, 11]
    assert values[highlighted_groups(values, counts, [11, 3])].tolist() == [11, 3]
    assert len(highlighted_groups(values, counts, None)) == 5
    for bad, match in ((0, "between 1"), (21, "between 1"), ([4], "no point"), ([3, 3], "repeats"),
                       ("3", "an int")):
        with pytest.raises(ValueError, match=match):
            highlighted_groups(values, counts, bad)


def test_disk_plot_ring_labels_cover_no_point(tmp_path, monkeypatch):
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from pml_hyperbolic.evaluation.poincare_disk_plot import disk_radius_of_distance

    saved = _capture_saved_figures(monkeypatch)
    x, y, geometry = _ring_of_points()
    spread = pb.expmap0(torch.randn(400, 8, generator=torch.Generator().manual_seed(1)) * 1.2, 0.1)
    for emb, lab, c in ((x, y, geometry), (spread, torch.arange(400) % 6, 0.1)):
        xy = plot_poincare_disk(emb, lab, tmp_path / "disk.png", c=c, radius_histogram=True)
        fig = saved[-1]
        ax = _disk_axes(fig)
        renderer = FigureCanvasAgg(fig).get_renderer()  # the figure was closed after saving
        labels = [t for t in ax.texts if t.get_gid() == "ring-label"]
        assert len(labels) >= 3  # d0 rings, the clip sphere or the rim
        points_px = ax.transData.transform(xy)
        for text in labels:
            box = text.get_window_extent(renderer)  # the text with its white box
            inside = ((points_px[:, 0] > box.x0 - 2) & (points_px[:, 0] < box.x1 + 2)
                      & (points_px[:, 1] > box.y0 - 2) & (points_px[:, 1] < box.y1 + 2))
            assert not inside.any(), f"ring label {text.get_text()!r} covers {int(inside.sum())} point(s)"
        boxes = [t.get_window_extent(renderer) for t in labels]
        for i in range(len(boxes)):
            for j in range(i + 1, len(boxes)):
                assert not boxes[i].overlaps(boxes[j])  # nor one another
    # the annulus is crossed by the d0 = 2 ring: its label was pushed off the points, with a leader line
    xy = plot_poincare_disk(x, y, tmp_path / "disk.png", c=geometry)
    ax = _disk_axes(saved[-1])
    first = next(t for t in ax.texts if t.get_text().startswith("d₀ ="))
    ring = float(disk_radius_of_distance(2.0, 0.1))
    assert np.hypot(*first.get_position()) > ring + 0.01
    leaders = [line for line in ax.lines if len(line.get_xdata()) == 2]
    assert leaders and any(np.hypot(line.get_xdata()[0], line.get_ydata()[0]) == pytest.approx(ring)
                           for line in leaders)  # a leader line starts on the d0 = 2 ring


def test_disk_plot_says_what_the_points_are_and_the_projection(tmp_path, monkeypatch):
    saved = _capture_saved_figures(monkeypatch)
    x, y = data(120)
    plot_poincare_disk(x, y, tmp_path / "d.png", c=0.1)
    ax = _disk_axes(saved[-1])
    assert ax.get_title() == "120 test queries in the Poincaré disk (c = 0.1)"
    assert any("projection" in t.get_text() and "tangent" in t.get_text() for t in ax.texts)
    plot_poincare_disk(x, y, tmp_path / "d.png", c=0.1, points_label="gallery images", caption="")
    ax = _disk_axes(saved[-1])
    assert "gallery images" in ax.get_title()
    assert not any("projection" in t.get_text() for t in ax.texts)


def test_uncertainty_plot_without_radius_information_draws_a_message_and_no_bars(tmp_path, monkeypatch):
    import warnings

    from pml_hyperbolic.geometry import PoincareGeometry

    saved = _capture_saved_figures(monkeypatch)
    g = torch.Generator().manual_seed(0)
    y = torch.arange(200) % 20
    geometry = PoincareGeometry(c=0.1, clip="hard", clip_r=2.3)
    x = geometry.to_ball(torch.randn(200, 16, generator=g) * 5)  # every norm beyond r: all on the clip sphere
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = plot_uncertainty_vs_recall(x, y, tmp_path / "flat.png", c=geometry, n_bins=5)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "the radius carries no information" in messages[0].lower()
    assert len(table) == 1 and table[0]["count"] == 200  # the table still comes back
    fig = saved[-1]
    ax = fig.axes[0]
    assert not ax.containers and not [p for p in ax.patches if p.get_height() > 0]  # no bars
    shown = " ".join(t.get_text() for t in ax.texts)
    assert "The radius carries no information: every embedding has d₀ ≈ 4.600" in shown
    assert "Overall Recall@1" in shown
    caption = " ".join(t.get_text() for t in fig.texts)
    assert "U = clamp(1 − d₀ / (2·2.3), 0, 1)" in caption and "far from the origin = confident" in caption


def test_uncertainty_plot_with_spread_radii_draws_bins_and_marks_small_ones(tmp_path, monkeypatch):
    import warnings

    saved = _capture_saved_figures(monkeypatch)
    x, y = data(300, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # distinct radii: no warning at all
        table = plot_uncertainty_vs_recall(x, y, tmp_path / "u.png", c=0.1, n_bins=5, clip_r=10.0)
    ax = saved[-1].axes[0]
    bars = ax.containers[0]
    assert len(bars) == len(table) == 5
    assert [b.get_height() for b in bars] == pytest.approx([r["recall_at_1"] for r in table])
    assert not any(b.get_hatch() for b in bars)  # 60 queries per bin: none marked
    assert "U = clamp(1 − d₀ / (2·10), 0, 1)" in " ".join(t.get_text() for t in saved[-1].texts)
    plot_uncertainty_vs_recall(x, y, tmp_path / "u.png", c=0.1, n_bins=5, clip_r=10.0, min_count=61)
    bars = saved[-1].axes[0].containers[0]
    assert all(b.get_hatch() == "///" for b in bars)
    assert any("fewer than 61 queries" in t.get_text() for t in saved[-1].axes[0].texts)


def test_describe_uncertainty_follows_the_mode():
    from pml_hyperbolic.evaluation.uncertainty_recall import describe_uncertainty

    assert describe_uncertainty() == describe_uncertainty("clip", 2.3)
    assert "d₀ = 4.6" in describe_uncertainty()
    assert "√c" in describe_uncertainty("ball")
    assert "max d₀" in describe_uncertainty("batch")
    assert "1 − d₀/2" in describe_uncertainty("literal")
    assert "given" in describe_uncertainty(given=True)
    with pytest.raises(ValueError, match="mode"):
        describe_uncertainty("radius")
