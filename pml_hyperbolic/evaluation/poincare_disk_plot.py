"""Poincaré-disk scatter plots of ball embeddings (matplotlib, Agg backend)."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from .. import poincare_ball as pb


def tangent_pca_2d(embeddings, c: float, keep_radius: bool = True) -> torch.Tensor:
    r"""Hyperbolic-aware 2-D reduction: :math:`v = \log_0(x)` (tangent space at the origin), PCA of
    v to 2 dimensions (centred only for the fit, so the origin stays the origin), then
    :math:`\exp_0` back into the 2-D ball of curvature c.

    With ``keep_radius`` (default) each 2-D tangent vector is rescaled to the norm of the full
    :math:`v`, so every point keeps its exact distance to the origin :math:`d_c(0, x)` (the quantity
    Hyp-UML reads as uncertainty) and only its direction comes from the PCA. Without it, points off
    the PCA plane shrink towards the origin: for 128-d embeddings two components keep a small part
    of each norm and the whole set collapses into a blob at the centre."""
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
    """(n_groups × 4) RGBA colours, one per group: up to 10 the ten distinct hues of ``tab10``; up to
    20 those ten hues dark, then light (``tab20`` reordered: ``tab20`` itself puts each dark/light
    pair next to each other, so groups 0 and 1 would differ only in lightness); beyond, ``viridis``."""
    import matplotlib

    if n_groups <= 10:
        return matplotlib.colormaps["tab10"](np.arange(n_groups))
    if n_groups <= 20:
        order = np.r_[np.arange(0, 20, 2), np.arange(1, 20, 2)]
        return matplotlib.colormaps["tab20"](order[:n_groups])
    return matplotlib.colormaps["viridis"](np.linspace(0.0, 1.0, n_groups))


def disk_radius_of_distance(d0, c: float):
    r"""Radius in the drawn unit disk of a point at hyperbolic distance ``d0`` from the origin:
    :math:`\rho = \sqrt{c}\,\lVert x\rVert = \tanh(\sqrt{c}\, d_0 / 2)` (the ball of radius
    :math:`1/\sqrt{c}` is drawn as the unit disk). ``d0 = inf`` gives the boundary, 1."""
    return np.tanh(math.sqrt(c) * np.asarray(d0, dtype=np.float64) / 2.0)


def ring_distances(max_d0: float, n_rings: int = 4) -> np.ndarray:
    """Round hyperbolic distances (> 0, ≤ ``max_d0``) for the labelled rings of the disk: about
    ``n_rings`` steps of 1, 2, 2.5 or 5 times a power of ten."""
    if not (math.isfinite(max_d0) and max_d0 > 0):
        return np.zeros(0)
    raw = max_d0 / n_rings
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * power >= raw)
    return np.arange(1, int(math.floor(max_d0 / step + 1e-9)) + 1) * step


def clip_distance(c, clip_r: Optional[float] = None) -> float:
    r"""Distance to the origin of the head's clip sphere: :math:`d_0 = 2r` (since
    :math:`d_0(\exp_0(v)) = 2\lVert v\rVert` for every c). ``clip_r`` if given, else the clip radius
    of a :class:`~pml_hyperbolic.geometry.PoincareGeometry` passed as ``c``; ``inf`` when there is none."""
    if clip_r is not None:
        if not (math.isfinite(float(clip_r)) and float(clip_r) > 0):
            raise ValueError(f"clip_r must be a finite number > 0 (the head's tangent clip radius), got {clip_r!r}")
        return 2.0 * float(clip_r)
    max_dist0 = getattr(c, "max_dist0", None)
    return float(max_dist0()) if callable(max_dist0) else math.inf


def _emptiest_direction(points: np.ndarray) -> float:
    """Angle (radians) for the ring labels: of the near-vertical directions (60°–120° and
    240°–300°, where labels of neighbouring rings stack instead of running into each other), the one
    whose sector holds the fewest points, so the labels hide as little data as possible."""
    angles = np.deg2rad(np.array([90, 75, 105, 60, 120, 270, 255, 285, 240, 300], dtype=np.float64))
    if len(points) == 0:
        return float(angles[0])
    point_angles = np.arctan2(points[:, 1], points[:, 0])
    gap = np.abs((point_angles[None, :] - angles[:, None] + math.pi) % (2 * math.pi) - math.pi)
    crowding = (gap < math.radians(8)).sum(axis=1)
    return float(angles[int(np.argmin(crowding))])  # ties: the first listed (straight up)


def plot_poincare_disk(
    embeddings,
    labels,
    path,
    c: float = 0.1,
    reduction: str = "tangent_pca",
    color_by: str = "auto",
    uncertainty=None,
    hierarchy_level: Optional[int] = None,
    figsize=None,
    dpi: int = 100,
    point_size: float = 8.0,
    title: Optional[str] = None,
    radius_histogram: bool = False,
    legend: bool = True,
    rings: bool = True,
    clip_r: Optional[float] = None,
    max_legend_entries: int = 12,
):
    """Scatter plot of ball embeddings in the unit Poincaré disk, saved as a PNG at ``path``.

    Points are reduced to 2-D with ``reduction="tangent_pca"`` (:func:`tangent_pca_2d`: direction
    from a PCA of the tangent vectors at the origin, exact distance to the origin kept), then scaled
    by √c so that the ball of radius 1/√c is drawn as the unit disk (boundary circle drawn).

    The scale: grey rings at round hyperbolic distances to the origin d₀ (labelled, drawn at
    :func:`disk_radius_of_distance`), and the head's clip sphere (d₀ = 2·clip_r, dashed red) when
    there is one, read from ``clip_r`` or from the :class:`~pml_hyperbolic.geometry.PoincareGeometry`
    passed as ``c``. A legend beside the disk names the colours (a colour bar beyond
    ``max_legend_entries`` groups).

    Args:
        labels: (N,) class labels, or (N × K) hierarchical labels (finest first).
        color_by: ``"auto"`` (the finest labels for (N,) labels, the parent level for N × K
            labels), ``"label"`` (finest labels) or ``"hierarchy"`` (column ``hierarchy_level``).
        hierarchy_level: the column of N × K labels to colour by; ``None`` = the parent level
            (column 1, the level just above the finest).
        uncertainty: optional (N,) scores; shading = transparency (more uncertain = fainter).
        radius_histogram: add a panel below the disk with the histogram of the exact distances to
            the origin d₀ (a spread of a few tenths is invisible in the disk itself).
        legend / rings: draw the legend column / the labelled d₀ rings.
        clip_r: the head's tangent clip radius (overrides the geometry's); the sphere d₀ = 2·clip_r
            is marked.
        figsize: ``None`` = 7.6 × 6 inches with the legend, 6 × 6 without (× 1.3 in height with
            the histogram); the PNG has figsize × dpi pixels.
    Returns:
        the (N × 2) disk coordinates (unit disk) as a numpy array.
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
        group_name = "parent class" if level == 1 else f"level-{level} class"
        legend_title = f"colour: {group_name}\n(hierarchy level {level} of {lab.shape[1]}; 0 = finest)"
    else:
        colour_ids = lab if lab.dim() == 1 else lab[:, 0]
        group_name, legend_title = "class", "colour: class"
    c_val = float(pb.as_curvature(c, torch.float64).detach())
    clip_d0 = clip_distance(c, clip_r)
    p2 = (tangent_pca_2d(x, c_val) * math.sqrt(c_val)).numpy()
    d0 = pb.dist0(x.double().cpu(), c_val).numpy()
    group_values, codes = np.unique(colour_ids.numpy(), return_inverse=True)
    palette = group_colours(len(group_values))
    colours = palette[codes]
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
                            wspace=0.02, left=0.03, right=0.97, top=0.92 if radius_histogram else 0.93,
                            bottom=0.08 if radius_histogram else 0.03)
    ax = fig.add_subplot(grid[0, 0])
    ring_colour, clip_colour, label_colour = "0.72", "tab:red", "0.35"
    ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color="black", linewidth=1.0))
    label_angle = _emptiest_direction(p2)
    along = np.array([math.cos(label_angle), math.sin(label_angle)])
    ring_d = ring_distances(float(max(d0.max(), clip_d0 if math.isfinite(clip_d0) else 0.0)))
    if rings:
        for d in ring_d:
            rho = float(disk_radius_of_distance(d, c_val))
            ax.add_patch(plt.Circle((0, 0), rho, fill=False, color=ring_colour, linewidth=0.8, zorder=0))
    if math.isfinite(clip_d0):
        rho = float(disk_radius_of_distance(clip_d0, c_val))
        ax.add_patch(plt.Circle((0, 0), rho, fill=False, color=clip_colour, linewidth=1.2, linestyle="--",
                                zorder=3))
    ax.scatter(p2[:, 0], p2[:, 1], s=point_size, c=colours, linewidths=0, zorder=2)
    if rings:
        # labels after the points, on a light box, in the sector with the fewest points
        for i, d in enumerate(ring_d):
            rho = float(disk_radius_of_distance(d, c_val))
            if math.isfinite(clip_d0) and abs(rho - float(disk_radius_of_distance(clip_d0, c_val))) < 0.045:
                continue  # the clip label says it
            ax.text(*(along * rho), f"d₀ = {d:g}" if i == 0 else f"{d:g}", color=label_colour, fontsize=7,
                    ha="center", va="center", zorder=4,
                    bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.75))
        ax.text(*(along * 1.0), "∞", color=label_colour, fontsize=8, ha="center", va="center", zorder=4,
                bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.9))
    if math.isfinite(clip_d0):
        rho = float(disk_radius_of_distance(clip_d0, c_val))
        ax.text(*(along * rho), f"clip {clip_d0:g}", color=clip_colour, fontsize=7, ha="center", va="center",
                zorder=4, bbox=dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8))
    ax.set_xlim(-1.05, 1.05)
    ax.set_ylim(-1.05, 1.05)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"Poincaré disk (c = {c_val:g}, {len(d0)} points)", fontsize=11)

    if legend:
        legend_ax = fig.add_subplot(grid[0, 1])
        legend_ax.axis("off")
        scale_handles, scale_labels = [], []
        if rings:
            scale_handles.append(Line2D([], [], color=ring_colour, linewidth=1.0))
            scale_labels.append("ring: hyperbolic\ndistance to the\norigin d₀")
        if math.isfinite(clip_d0):
            scale_handles.append(Line2D([], [], color=clip_colour, linewidth=1.2, linestyle="--"))
            scale_labels.append(f"head's clip radius\n(d₀ = {clip_d0:g})")
        n_groups = len(group_values)
        if n_groups <= max_legend_entries:
            handles = [Line2D([], [], linestyle="none", marker="o", markersize=6, markerfacecolor=palette[i],
                              markeredgewidth=0) for i in range(n_groups)]
            names = [f"{group_name} {v}" for v in group_values]
            groups = legend_ax.legend(handles, names, title=legend_title, loc="upper left", fontsize=8,
                                      title_fontsize=8, frameon=False, borderaxespad=0.0)
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
            bar.set_label(f"{n_groups} {group_name}es", fontsize=8)
        if scale_handles:
            legend_ax.legend(scale_handles, scale_labels, loc="lower left", fontsize=7.5, frameon=False,
                             borderaxespad=0.0, handlelength=1.8)

    if radius_histogram:
        hist_ax = fig.add_subplot(grid[1, :])
        box = hist_ax.get_position()  # the disk row has thin margins; the histogram needs room for its ticks
        hist_ax.set_position([0.11, box.y0, 0.85, box.height])
        hist_ax.hist(d0, bins=40, color="tab:gray")
        summary = f"d₀: min {d0.min():.2f}, median {np.median(d0):.2f}, max {d0.max():.2f}"
        # the clip line only when it is near the data: far beyond, it would squeeze the bars to a sliver
        reach = d0.max() + max(d0.max() - d0.min(), 0.05 * d0.max())
        if math.isfinite(clip_d0) and clip_d0 <= reach:
            hist_ax.axvline(clip_d0, color=clip_colour, linestyle="--", linewidth=1.2,
                            label=f"clip (d₀ = {clip_d0:g})")
            hist_ax.legend(fontsize=7, frameon=False, loc="upper left")
        elif math.isfinite(clip_d0):
            summary += f"; clip d₀ = {clip_d0:g} (off the axis, beyond every point)"
        hist_ax.set_xlabel("distance to the origin d₀ (larger = more certain)", fontsize=9)
        hist_ax.set_ylabel("count", fontsize=9)
        hist_ax.tick_params(labelsize=8)
        hist_ax.set_title(summary, fontsize=9)
    fig.savefig(path, dpi=dpi)  # no tight bbox: the PNG keeps figsize*dpi pixels
    plt.close(fig)
    return p2
