r"""Poincaré-disk scatter plots of ball embeddings (matplotlib, Agg backend).

The plot answers "where do the embeddings sit in the ball?" at a glance: each point is one
embedding (by default the run's test queries), its direction taken from a PCA of the tangent
vectors at the origin and its radius its exact hyperbolic distance to the origin :math:`d_0`
(the quantity Hyp-UML reads as certainty). Only a few classes get a colour, so that they can be
told apart; the rest are drawn light grey underneath.

Design note: docs/design/plots.md
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CURVATURE
from ..poincare_ball import CurvatureLike

#: Arrays the plots accept: a tensor, a numpy array or a nested sequence of numbers.
ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]

#: Colour of the points outside the highlighted classes (drawn underneath them).
OTHER_COLOUR = (0.80, 0.80, 0.80, 1.0)
#: Most classes :func:`plot_poincare_disk` can highlight with distinct hues.
MAX_HIGHLIGHT = 20


def tangent_pca_2d(embeddings: ArrayLike, c: float, keep_radius: bool = True) -> torch.Tensor:
    r"""Hyperbolic-aware 2-D reduction of ball embeddings.

    :math:`v = \log_0(x)` (tangent space at the origin), PCA of :math:`v` to 2 dimensions (centred
    only for the fit, so the origin stays the origin), then :math:`\exp_0` back into the 2-D ball of
    curvature c.

    Args:
        embeddings: (N, D) points of the Poincaré ball of curvature −c.
        c: curvature magnitude (> 0).
        keep_radius: rescale each 2-D tangent vector to the norm of the full :math:`v`, so every
            point keeps its exact distance to the origin :math:`d_c(0, x)` and only its direction
            comes from the PCA.

    Returns:
        (N, 2) float64 points of the 2-D ball of curvature −c.

    Why ``keep_radius``: without it, points off the PCA plane shrink towards the origin (two
    components keep a small part of a 128-d norm) and the set collapses into a blob at the centre.
    """
    x = pb.project(torch.as_tensor(embeddings).detach().double(), c)
    v = pb.logmap0(x, c)
    if v.shape[1] <= 2:
        v2 = torch.nn.functional.pad(v, (0, 2 - v.shape[1]))
    else:
        centred = v - v.mean(0, keepdim=True)
        _, _, vh = torch.linalg.svd(centred, full_matrices=False)
        v2 = v @ vh[:2].T
        if keep_radius:
            norm2 = v2.norm(dim=1, keepdim=True)
            scale = torch.where(norm2 > 0, v.norm(dim=1, keepdim=True) / norm2.clamp_min(1e-300),
                                torch.zeros_like(norm2))
            v2 = v2 * scale
    return pb.project(pb.expmap0(v2, c), c)


def group_colours(n_groups: int) -> np.ndarray:
    """Distinct RGBA colours, one per group.

    Args:
        n_groups: how many colours.

    Returns:
        (n_groups, 4) RGBA array: up to 10 the ten hues of ``tab10``; up to 20 those ten hues dark,
        then light (``tab20`` reordered); beyond, ``viridis`` samples.

    Why reordered: ``tab20`` puts each dark/light pair side by side, so groups 0 and 1 (often
    sibling classes) would differ in lightness only.
    """
    import matplotlib

    if n_groups <= 10:
        return matplotlib.colormaps["tab10"](np.arange(n_groups))
    if n_groups <= 20:
        order = np.r_[np.arange(0, 20, 2), np.arange(1, 20, 2)]
        return matplotlib.colormaps["tab20"](order[:n_groups])
    return matplotlib.colormaps["viridis"](np.linspace(0.0, 1.0, n_groups))


def disk_radius_of_distance(d0: Union[float, ArrayLike], c: float) -> np.ndarray:
    r"""Radius in the drawn unit disk of a point at hyperbolic distance ``d0`` from the origin.

    .. math:: \rho = \sqrt{c}\,\lVert x\rVert = \tanh(\sqrt{c}\, d_0 / 2)

    Args:
        d0: distance(s) to the origin (float or array; ``inf`` gives the boundary, 1).
        c: curvature magnitude (> 0); the ball of radius :math:`1/\sqrt{c}` is drawn as the unit disk.

    Returns:
        float64 array (0-d for a scalar) of radii in [0, 1].
    """
    return np.tanh(math.sqrt(c) * np.asarray(d0, dtype=np.float64) / 2.0)


def ring_distances(max_d0: float, n_rings: int = 4) -> np.ndarray:
    """Round hyperbolic distances for the labelled rings of the disk.

    Args:
        max_d0: the largest distance to show (> 0, finite).
        n_rings: about how many rings.

    Returns:
        increasing distances in (0, ``max_d0``], steps of 1, 2, 2.5 or 5 times a power of ten;
        empty when ``max_d0`` is not a finite number > 0.
    """
    if not (math.isfinite(max_d0) and max_d0 > 0):
        return np.zeros(0)
    raw = max_d0 / n_rings
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= raw)
    return np.arange(1, int(math.floor(max_d0 / step + 1e-9)) + 1) * step


def clip_distance(c: CurvatureLike, clip_r: Optional[float] = None) -> float:
    r"""Distance to the origin of the head's clip sphere, :math:`d_0 = 2r`.

    (:math:`d_0(\exp_0(v)) = 2\lVert v\rVert` for every c.)

    Args:
        c: a curvature, or a :class:`~pml_hyperbolic.geometry.PoincareGeometry` whose clip radius
            is used when ``clip_r`` is None.
        clip_r: the head's tangent clip radius r, overriding the geometry's.

    Returns:
        :math:`2r`, or ``inf`` when there is no clip radius.

    Raises:
        ValueError: ``clip_r`` is not a finite number > 0.
    """
    if clip_r is not None:
        if not (math.isfinite(float(clip_r)) and float(clip_r) > 0):
            raise ValueError(f"clip_r must be a finite number > 0 (the head's tangent clip radius), got {clip_r!r}")
        return 2.0 * float(clip_r)
    max_dist0 = getattr(c, "max_dist0", None)
    return float(max_dist0()) if callable(max_dist0) else math.inf


def highlighted_groups(group_values: np.ndarray, counts: np.ndarray,
                       highlight: Union[int, Sequence, None]) -> np.ndarray:
    """Which groups of a disk plot get a colour.

    Args:
        group_values: (G,) the distinct group labels, sorted.
        counts: (G,) how many points each group has.
        highlight: an int n (the n largest groups; ties: the smaller label first), a sequence of
            labels (in the order given), or None (every group).

    Returns:
        indices into ``group_values`` of the highlighted groups, in colour order: the n largest
        sorted by label, or the given labels in their order.

    Raises:
        ValueError: n is not an integer in [1, ``MAX_HIGHLIGHT``], the list is empty, longer than
            ``MAX_HIGHLIGHT``, repeats a label, or names a label that is not among the groups.
    """
    if highlight is None:
        return np.arange(len(group_values))
    if isinstance(highlight, (int, np.integer)) and not isinstance(highlight, bool):
        if not 1 <= int(highlight) <= MAX_HIGHLIGHT:
            raise ValueError(f"highlight must be between 1 and {MAX_HIGHLIGHT} (distinct hues), a list of "
                             f"labels, or None for every class; got {highlight!r}")
        by_size = np.lexsort((group_values, -np.asarray(counts)))  # largest first, ties: smaller label
        return np.sort(by_size[: int(highlight)])
    if isinstance(highlight, (str, bytes, bool)):
        raise ValueError(f"highlight must be an int, a list of labels or None, got {highlight!r}")
    wanted = list(np.asarray(highlight).reshape(-1).tolist())
    if not 1 <= len(wanted) <= MAX_HIGHLIGHT:
        raise ValueError(f"highlight lists 1 to {MAX_HIGHLIGHT} labels (distinct hues), got {len(wanted)}")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"highlight repeats a label: {wanted}")
    position = {v: i for i, v in enumerate(group_values.tolist())}
    missing = [v for v in wanted if v not in position]
    if missing:
        raise ValueError(f"highlight names label(s) {missing} that no point has")
    return np.array([position[v] for v in wanted], dtype=np.int64)


# the directions tried for the ring labels: near-vertical first (labels of neighbouring rings stack
# instead of running into each other), then the diagonals (room outside the rim in the corners)
_LABEL_ANGLES_DEG = (90, 75, 105, 60, 120, 270, 255, 285, 240, 300, 45, 135, 315, 225)


def _place_ring_labels(ax, renderer, points: np.ndarray, point_pad: float, items, limit: float):
    """Positions (data units) for the ring labels ``items`` = [(rho, text artist), ...]: along one
    ray from the centre, each on its ring when its box holds no point and overlaps no other label,
    else pushed outwards along the ray to the first free spot (a leader line then joins it to its
    ring). The ray is the candidate angle with the fewest pushed labels, then the least pushing."""
    to_px = ax.transData.transform
    unit_px = abs(to_px((1.0, 0.0))[0] - to_px((0.0, 0.0))[0])
    sizes = []
    for _, text in items:
        box = text.get_window_extent(renderer)
        sizes.append((box.width / unit_px / 2 + point_pad, box.height / unit_px / 2 + point_pad))
    best = None
    for angle in np.deg2rad(_LABEL_ANGLES_DEG):
        along = np.array([math.cos(angle), math.sin(angle)])
        # how far the ray stays inside the axes (a square of half-side ``limit``)
        reach = limit / max(abs(along[0]), abs(along[1]))
        placed, moved, pushed = [], 0, 0.0
        for (rho, _), (hw, hh) in zip(items, sizes):
            r = rho
            while True:
                centre = along * r
                free_of_points = not bool(((np.abs(points[:, 0] - centre[0]) < hw)
                                           & (np.abs(points[:, 1] - centre[1]) < hh)).any())
                free_of_labels = all(abs(centre[0] - p[0]) >= hw + q[0] - point_pad
                                     or abs(centre[1] - p[1]) >= hh + q[1] - point_pad
                                     for p, q in placed)
                inside = abs(centre[0]) + hw <= limit and abs(centre[1]) + hh <= limit
                if (free_of_points and free_of_labels) or not inside or r > reach:
                    break
                r += 0.01
            if r != rho:
                moved += 1
                pushed += r - rho
            placed.append((along * r, (hw, hh)))
        score = (moved, pushed)
        if best is None or score < best[0]:
            best = (score, along, [p for p, _ in placed])
    return best[1], best[2]


def plot_poincare_disk(
    embeddings: ArrayLike,
    labels: ArrayLike,
    path: Union[str, os.PathLike],
    c: CurvatureLike = DEFAULT_CURVATURE,
    reduction: str = "tangent_pca",
    color_by: str = "auto",
    uncertainty: Optional[ArrayLike] = None,
    hierarchy_level: Optional[int] = None,
    figsize: Optional[Tuple[float, float]] = None,
    dpi: int = 100,
    point_size: float = 8.0,
    title: Optional[str] = None,
    radius_histogram: bool = False,
    legend: bool = True,
    rings: bool = True,
    clip_r: Optional[float] = None,
    max_legend_entries: int = 12,
    highlight: Union[int, Sequence, None] = 10,
    points_label: str = "test queries",
    caption: Optional[str] = None,
) -> np.ndarray:
    r"""Scatter plot of ball embeddings in the unit Poincaré disk, saved as a PNG at ``path``.

    Each point is one embedding, reduced to 2-D by :func:`tangent_pca_2d` (direction from a PCA of
    the tangent vectors at the origin, exact distance to the origin :math:`d_0` kept) and scaled by
    :math:`\sqrt{c}` so that the ball of radius :math:`1/\sqrt{c}` is the unit disk. Grey rings
    mark round distances :math:`d_0` (drawn at :func:`disk_radius_of_distance`); their labels sit
    on one ray, each on its ring where no point lies there, else pushed outwards along the ray
    with a leader line, so no label covers a point. The head's clip sphere
    (:math:`d_0 = 2\,r`) is a dashed red circle when there is one. Only the ``highlight`` classes
    get a colour (``tab10``: told apart at a glance), named in the legend; the others are light
    grey and drawn underneath. The title says what the points are (``points_label``), the caption
    under it the projection.

    Args:
        embeddings: (N, D) points of the ball of curvature −c.
        labels: (N,) class labels, or (N, K) hierarchical labels (finest first).
        path: where to write the PNG.
        c: curvature magnitude, or a :class:`~pml_hyperbolic.geometry.PoincareGeometry` (whose
            clip radius is then marked).
        reduction: ``"tangent_pca"`` (the only one).
        color_by: ``"auto"`` (the finest labels for (N,) labels, the parent level for (N, K)
            labels), ``"label"`` (finest labels) or ``"hierarchy"`` (column ``hierarchy_level``).
        uncertainty: optional (N,) scores; more uncertain points are drawn fainter.
        hierarchy_level: the column of (N, K) labels to colour by; ``None`` = the parent level
            (column 1).
        figsize: ``None`` = 7.6 × 6 inches with the legend, 6 × 6 without (× 1.3 in height with
            the histogram); the PNG has figsize × dpi pixels.
        dpi: pixels per inch of the PNG.
        point_size: marker area in points².
        title: replaces the default title ("N test queries in the Poincaré disk (c = …)").
        radius_histogram: add a panel below the disk with the histogram of :math:`d_0` (a spread
            of a few tenths is invisible in the disk itself).
        legend: draw the legend column.
        rings: draw the labelled :math:`d_0` rings.
        clip_r: the head's tangent clip radius (overrides the geometry's); the sphere
            :math:`d_0 = 2\,r` is marked.
        max_legend_entries: with ``highlight=None``, more groups than this get a colour bar
            instead of a list.
        highlight: an int n: the n largest groups get a colour (ties: smaller label first; all of
            them when there are at most n); a list of labels: those groups, in that order; None:
            every group (``viridis`` colour bar beyond 20). At most ``MAX_HIGHLIGHT``.
        points_label: what the points are, for the title and the legend (e.g. ``"gallery
            images"``); the default fits the recipes, which plot their test queries.
        caption: the line under the title; ``None`` = the projection used, ``""`` = none.

    Returns:
        the (N, 2) disk coordinates (unit disk) as a numpy array.

    Raises:
        ValueError: malformed embeddings / labels / uncertainty, NaN or Inf values, an unknown
            ``reduction`` or ``color_by``, ``color_by="hierarchy"`` without (N, K) labels, an
            out-of-range ``hierarchy_level``, a bad ``clip_r``, ``max_legend_entries`` or
            ``highlight`` (see :func:`highlighted_groups`).

    Design note: docs/design/plots.md
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    x = torch.as_tensor(embeddings).detach()
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty N x D array, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("embeddings contains NaN/Inf values")
    lab = torch.as_tensor(labels).detach().cpu()
    if lab.dim() not in (1, 2) or lab.shape[0] != x.shape[0]:
        raise ValueError(f"labels must have one row per embedding ((N,) or (N, K) with N = {x.shape[0]}), "
                         f"got shape {tuple(lab.shape)}")
    if reduction != "tangent_pca":
        raise ValueError(f"reduction must be 'tangent_pca', got {reduction!r}")
    if color_by not in ("auto", "label", "hierarchy"):
        raise ValueError(f"color_by must be 'auto', 'label' or 'hierarchy', got {color_by!r}")
    if color_by == "hierarchy" and lab.dim() != 2:
        raise ValueError("color_by='hierarchy' needs N x K hierarchical labels")
    if not isinstance(max_legend_entries, int) or max_legend_entries < 1:
        raise ValueError(f"max_legend_entries must be a positive integer, got {max_legend_entries!r}")
    by_hierarchy = lab.dim() == 2 and lab.shape[1] > 1 and color_by != "label"
    if by_hierarchy:
        level = (1 if hierarchy_level is None else hierarchy_level)
        if not -lab.shape[1] <= level < lab.shape[1]:
            raise ValueError(f"hierarchy_level {level} is out of range for labels with {lab.shape[1]} levels")
        level %= lab.shape[1]
        colour_ids = lab[:, level]
        group_name, group_plural = ("parent class", "parent classes") if level == 1 else \
            (f"level-{level} class", f"level-{level} classes")
        level_note = f"\n(hierarchy level {level} of {lab.shape[1]}; 0 = finest)"
    else:
        colour_ids = lab if lab.dim() == 1 else lab[:, 0]
        group_name, group_plural, level_note = "class", "classes", ""
    c_val = float(pb.as_curvature(c, torch.float64).detach())
    clip_d0 = clip_distance(c, clip_r)
    p2 = (tangent_pca_2d(x, c_val) * math.sqrt(c_val)).numpy()
    d0 = pb.dist0(x.double().cpu(), c_val).numpy()
    group_values, codes, counts = np.unique(colour_ids.numpy(), return_inverse=True, return_counts=True)
    codes = codes.reshape(-1)
    chosen = highlighted_groups(group_values, counts, highlight)
    n_groups, n_chosen = len(group_values), len(chosen)
    palette = group_colours(n_chosen)
    if n_chosen < n_groups and n_chosen <= 20:
        # tab10's grey (and tab20's light grey) would read as "one of the other classes"
        for slot, replacement in ((7, (0.1, 0.1, 0.1, 1.0)), (17, (0.0, 0.0, 0.5, 1.0))):
            if slot < n_chosen:
                palette[slot] = replacement
    colour_of_group = np.tile(np.asarray(OTHER_COLOUR), (n_groups, 1))
    colour_of_group[chosen] = palette
    colours = colour_of_group[codes]
    is_highlighted = np.zeros(n_groups, dtype=bool)
    is_highlighted[chosen] = True
    in_front = is_highlighted[codes]
    if highlight is None:
        legend_title = f"colour: {group_name}"
    elif n_chosen == n_groups:
        legend_title = f"colour: {group_name} (all {n_groups})"
    elif isinstance(highlight, (int, np.integer)) and counts[chosen].min() == counts.max():
        # every group as large as the largest: the size picks nothing, the labels do
        legend_title = f"colour: {n_chosen} of {n_groups} {group_plural}\n(equal sizes: the first labels)"
    elif isinstance(highlight, (int, np.integer)):
        legend_title = f"colour: the {n_chosen} largest\n{group_plural} (of {n_groups})"
    else:
        legend_title = f"colour: {n_chosen} chosen\n{group_plural} (of {n_groups})"
    legend_title += level_note
    if uncertainty is not None:
        u = torch.as_tensor(uncertainty).detach().double().reshape(-1).cpu().numpy()
        if u.shape[0] != x.shape[0]:
            raise ValueError("uncertainty must have one entry per embedding")
        if not np.isfinite(u).all():
            raise ValueError("uncertainty contains NaN/Inf values")
        span = u.max() - u.min()
        un = (u - u.min()) / span if span > 0 else np.zeros_like(u)
        colours[:, 3] = 1.0 - 0.85 * un  # more uncertain -> fainter
        legend_title += "\nfainter = more uncertain"

    if figsize is None:
        figsize = (7.6, 6.0) if legend else (6.0, 6.0)
    height = figsize[1] * (1.3 if radius_histogram else 1.0)
    fig = plt.figure(figsize=(figsize[0], height), dpi=dpi)
    rows = (4, 1.2) if radius_histogram else (1,)
    cols = (4, 1.6) if legend else (1,)
    grid = fig.add_gridspec(len(rows), len(cols), height_ratios=rows, width_ratios=cols, hspace=0.25,
                            wspace=0.02, left=0.03, right=0.97, top=0.90 if radius_histogram else 0.91,
                            bottom=0.08 if radius_histogram else 0.03)
    ax = fig.add_subplot(grid[0, 0])
    limit = 1.08  # the axes show [-limit, limit]^2: room for ring labels pushed past the rim
    ax.set_xlim(-limit, limit)
    ax.set_ylim(-limit, limit)
    ax.set_aspect("equal")
    ax.axis("off")
    ring_colour, clip_colour, label_colour = "0.72", "tab:red", "0.35"
    ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color="black", linewidth=1.0))
    clip_rho = float(disk_radius_of_distance(clip_d0, c_val)) if math.isfinite(clip_d0) else None
    ring_d = ring_distances(float(max(d0.max(), clip_d0 if math.isfinite(clip_d0) else 0.0)))
    if rings:
        for d in ring_d:
            rho = float(disk_radius_of_distance(d, c_val))
            ax.add_patch(plt.Circle((0, 0), rho, fill=False, color=ring_colour, linewidth=0.8, zorder=0))
    if clip_rho is not None:
        ax.add_patch(plt.Circle((0, 0), clip_rho, fill=False, color=clip_colour, linewidth=1.2, linestyle="--",
                                zorder=3))
    # the grey classes first and underneath, the highlighted ones on top
    if (~in_front).any():
        ax.scatter(p2[~in_front, 0], p2[~in_front, 1], s=point_size, c=colours[~in_front], linewidths=0,
                   zorder=1)
    if in_front.any():
        ax.scatter(p2[in_front, 0], p2[in_front, 1], s=point_size, c=colours[in_front], linewidths=0, zorder=2)

    items = []  # (rho, text artist) of every label on the scale, innermost first
    box = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.9)
    if rings:
        first = True
        for d in ring_d:
            rho = float(disk_radius_of_distance(d, c_val))
            if clip_rho is not None and abs(rho - clip_rho) < 0.045:
                continue  # the clip label says it
            text = ax.text(0, 0, f"d₀ = {d:g}" if first else f"{d:g}", color=label_colour, fontsize=7,
                           ha="center", va="center", zorder=5, bbox=box)
            items.append((rho, text))
            first = False
    if clip_rho is not None:
        items.append((clip_rho, ax.text(0, 0, f"clip {clip_d0:g}", color=clip_colour, fontsize=7, ha="center",
                                        va="center", zorder=5, bbox=box)))
    if rings:
        items.append((1.0, ax.text(0, 0, "∞", color=label_colour, fontsize=8, ha="center", va="center",
                                   zorder=5, bbox=box)))
    items.sort(key=lambda item: item[0])
    for _, text in items:
        text.set_gid("ring-label")
    if items:
        renderer = fig.canvas.get_renderer()
        ax.apply_aspect()
        to_px = ax.transData.transform
        unit_px = abs(to_px((1.0, 0.0))[0] - to_px((0.0, 0.0))[0])
        marker_pad = (math.sqrt(point_size) / 2 * dpi / 72 + 1.0) / unit_px  # marker radius + 1 px
        along, spots = _place_ring_labels(ax, renderer, p2, marker_pad, items, limit)
        for (rho, text), spot in zip(items, spots):
            text.set_position(tuple(spot))
            if np.linalg.norm(spot) - rho > 1e-9:  # pushed off its ring: a leader line back to it
                ax.plot([along[0] * rho, spot[0]], [along[1] * rho, spot[1]], color=text.get_color(),
                        linewidth=0.7, linestyle=(0, (2, 1)), zorder=4)
    n_points = len(d0)
    ax.set_title(title or f"{n_points} {points_label} in the Poincaré disk (c = {c_val:g})", fontsize=11,
                 pad=16 if caption != "" else 6)
    if caption != "":
        ax.text(0.5, 1.0, caption if caption is not None else
                "2-D projection: PCA of the tangent vectors at the origin; every point keeps its exact d₀",
                transform=ax.transAxes, ha="center", va="bottom", fontsize=8, color="0.3")

    if legend:
        legend_ax = fig.add_subplot(grid[0, 1])
        legend_ax.axis("off")
        scale_handles, scale_labels = [], []
        if rings:
            scale_handles.append(Line2D([], [], color=ring_colour, linewidth=1.0))
            scale_labels.append("ring: hyperbolic\ndistance to the\norigin d₀")
        if clip_rho is not None:
            scale_handles.append(Line2D([], [], color=clip_colour, linewidth=1.2, linestyle="--"))
            scale_labels.append(f"head's clip radius\n(d₀ = {clip_d0:g})")
        if highlight is not None or n_groups <= max_legend_entries:
            handles = [Line2D([], [], linestyle="none", marker="o", markersize=6, markerfacecolor=palette[i],
                              markeredgewidth=0) for i in range(n_chosen)]
            names = [f"{group_name} {group_values[g]} (n = {counts[g]})" for g in chosen]
            if n_chosen < n_groups:
                handles.append(Line2D([], [], linestyle="none", marker="o", markersize=6,
                                      markerfacecolor=OTHER_COLOUR, markeredgewidth=0))
                names.append(f"{n_groups - n_chosen} other {group_plural if n_groups - n_chosen > 1 else group_name}")
            groups = legend_ax.legend(handles, names, title=legend_title,
                                      loc="upper left", fontsize=8, title_fontsize=8, frameon=False,
                                      borderaxespad=0.0)
            groups._legend_box.align = "left"
            legend_ax.add_artist(groups)
        else:
            from matplotlib.colors import BoundaryNorm, ListedColormap

            legend_ax.text(0.0, 1.0, legend_title, fontsize=8, va="top", transform=legend_ax.transAxes)
            bar_ax = legend_ax.inset_axes((0.05, 0.42, 0.12, 0.42))
            cmap = ListedColormap(palette[:, :3])
            mappable = matplotlib.cm.ScalarMappable(norm=BoundaryNorm(np.arange(n_groups + 1), n_groups), cmap=cmap)
            bar = fig.colorbar(mappable, cax=bar_ax)
            ticks = np.unique(np.linspace(0, n_groups - 1, 5).round().astype(int))
            bar.set_ticks(ticks + 0.5)
            bar.set_ticklabels([str(group_values[t]) for t in ticks])
            bar.ax.tick_params(labelsize=7)
            bar.ax.minorticks_off()
            bar.set_label(f"{n_groups} {group_plural}", fontsize=8)
        if scale_handles:
            legend_ax.legend(scale_handles, scale_labels, loc="lower left", fontsize=7.5, frameon=False,
                             borderaxespad=0.0, handlelength=1.8)

    if radius_histogram:
        hist_ax = fig.add_subplot(grid[1, :])
        hbox = hist_ax.get_position()  # the disk row has thin margins; the histogram needs room for its ticks
        hist_ax.set_position([0.11, hbox.y0, 0.85, hbox.height])
        hist_ax.hist(d0, bins=40, color="tab:gray")
        summary = f"d₀ of the {points_label}: min {d0.min():.2f}, median {np.median(d0):.2f}, max {d0.max():.2f}"
        # the clip line only when it is near the data: far beyond, it would squeeze the bars to a sliver
        reach = d0.max() + max(d0.max() - d0.min(), 0.05 * d0.max())
        if math.isfinite(clip_d0) and clip_d0 <= reach:
            hist_ax.axvline(clip_d0, color=clip_colour, linestyle="--", linewidth=1.2,
                            label=f"clip (d₀ = {clip_d0:g})")
            hist_ax.legend(fontsize=7, frameon=False, loc="upper left")
        elif math.isfinite(clip_d0):
            summary += f"; clip d₀ = {clip_d0:g} (off the axis)"
        hist_ax.set_xlabel("distance to the origin d₀ (larger = more certain)", fontsize=9)
        hist_ax.set_ylabel("count", fontsize=9)
        hist_ax.tick_params(labelsize=8)
        hist_ax.set_title(summary, fontsize=9)
    fig.savefig(path, dpi=dpi)  # no tight bbox: the PNG keeps figsize*dpi pixels
    plt.close(fig)
    return p2
