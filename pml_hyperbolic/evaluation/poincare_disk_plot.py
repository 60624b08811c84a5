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


def plot_poincare_disk(
    embeddings,
    labels,
    path,
    c: float = 0.1,
    reduction: str = "tangent_pca",
    color_by: str = "label",
    uncertainty=None,
    hierarchy_level: int = -1,
    figsize=(6.0, 6.0),
    dpi: int = 100,
    point_size: float = 8.0,
    title: Optional[str] = None,
    radius_histogram: bool = False,
):
    """Scatter plot of ball embeddings in the unit Poincaré disk, saved as a PNG at ``path``.

    Points are reduced to 2-D with ``reduction="tangent_pca"`` (:func:`tangent_pca_2d`: direction
    from a PCA of the tangent vectors at the origin, exact distance to the origin kept), then scaled
    by √c so that the ball of radius 1/√c is drawn as the unit disk (boundary circle drawn).

    Args:
        labels: (N,) class labels, or (N × K) hierarchical labels (finest first).
        color_by: ``"label"`` (finest labels) or ``"hierarchy"`` (column ``hierarchy_level`` of
            N × K labels, default the coarsest).
        uncertainty: optional (N,) scores; shading = transparency (more uncertain = fainter).
        radius_histogram: add a panel below the disk with the histogram of the exact distances to
            the origin d₀ (a spread of a few tenths is invisible in the disk itself).
    Returns:
        the (N × 2) disk coordinates (unit disk) as a numpy array.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = torch.as_tensor(embeddings).detach()
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"embeddings must be a non-empty N x D array, got shape {tuple(x.shape)}")
    if not torch.isfinite(x).all():
        raise ValueError("embeddings contains NaN/Inf values")
    lab = torch.as_tensor(labels).detach().cpu()
    if lab.shape[0] != x.shape[0]:
        raise ValueError("labels must have one row per embedding")
    if reduction != "tangent_pca":
        raise ValueError(f"reduction must be 'tangent_pca', got {reduction!r}")
    if color_by == "label":
        colour_ids = lab if lab.dim() == 1 else lab[:, 0]
    elif color_by == "hierarchy":
        if lab.dim() != 2:
            raise ValueError("color_by='hierarchy' needs N x K hierarchical labels")
        colour_ids = lab[:, hierarchy_level]
    else:
        raise ValueError(f"color_by must be 'label' or 'hierarchy', got {color_by!r}")
    c_val = float(pb.as_curvature(c, torch.float64).detach())
    p2 = (tangent_pca_2d(x, c_val) * math.sqrt(c_val)).numpy()
    _, codes = np.unique(colour_ids.numpy(), return_inverse=True)
    colours = group_colours(int(codes.max()) + 1)[codes]
    if uncertainty is not None:
        u = torch.as_tensor(uncertainty).detach().double().reshape(-1).cpu().numpy()
        if u.shape[0] != x.shape[0]:
            raise ValueError("uncertainty must have one entry per embedding")
        span = u.max() - u.min()
        un = (u - u.min()) / span if span > 0 else np.zeros_like(u)
        colours[:, 3] = 1.0 - 0.85 * un  # more uncertain -> fainter
    if radius_histogram:
        fig = plt.figure(figsize=(figsize[0], figsize[1] * 1.3), dpi=dpi)
        grid = fig.add_gridspec(2, 1, height_ratios=(4, 1.2), hspace=0.25)
        ax, hist_ax = fig.add_subplot(grid[0]), fig.add_subplot(grid[1])
        d0 = pb.dist0(x.double().cpu(), c_val).numpy()
        hist_ax.hist(d0, bins=40, color="tab:gray")
        hist_ax.set_xlabel("distance to the origin d₀ (larger = more certain)")
        hist_ax.set_ylabel("count")
        hist_ax.set_title(f"d₀: min {d0.min():.2f}, median {np.median(d0):.2f}, max {d0.max():.2f}", fontsize=9)
    else:
        fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    ax.add_patch(plt.Circle((0, 0), 1.0, fill=False, color="black", linewidth=1.0))
    ax.scatter(p2[:, 0], p2[:, 1], s=point_size, c=colours, linewidths=0)
    ax.set_xlim(-1.05, 1.05)
    ax.set_ylim(-1.05, 1.05)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title or f"Poincaré disk (c={c_val:g}, {reduction}, colour: {color_by})")
    fig.savefig(path, dpi=dpi)  # no tight bbox: the PNG keeps figsize*dpi pixels
    plt.close(fig)
    return p2
