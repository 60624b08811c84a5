"""How Hyp-UML's uncertainty relates to retrieval correctness: Recall@1 per uncertainty bin.

Hyp-UML reads an embedding's distance to the origin as confidence: queries near the origin (large
U) should be retrieved less reliably. The table, the AUROC and the bar chart of this module test
that claim on a run's own retrieval protocol.

Design note: docs/design/plots.md
"""
from __future__ import annotations

import warnings
import os
from typing import Callable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from ..geometry import DEFAULT_CLIP_R, DEFAULT_CURVATURE, as_geometry
from ..poincare_ball import CurvatureLike
from .hyperbolic_knn import HyperbolicKNN

#: Arrays the functions accept: a tensor, a numpy array or a nested sequence of numbers.
ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]


def _query_hits(embeddings, labels, c, uncertainty, mode, clip_r, knn_func, reference_embeddings,
                reference_labels):
    """(hit, uncertainty) of every query that can be retrieved at all: hit = top-1 neighbour has the
    query's label (the run's protocol), both as float64 CPU tensors (see uncertainty_recall_table)."""
    x = torch.as_tensor(embeddings).detach()
    y = torch.as_tensor(labels).detach().reshape(-1)
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"embeddings must be N x D with N >= 2, got shape {tuple(x.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError("labels must have one entry per embedding")
    if not torch.isfinite(x).all():
        raise ValueError("embeddings contains NaN/Inf values")
    if uncertainty is None:
        from ..uncertainty import hyperbolic_uncertainty

        u = hyperbolic_uncertainty(x.float(), c=c, mode=mode, clip_r=clip_r, detach=True)
    else:
        u = torch.as_tensor(uncertainty)
    u = u.detach().reshape(-1).double().cpu()
    if u.shape[0] != x.shape[0]:
        raise ValueError("uncertainty must have one entry per embedding")
    if not bool(torch.isfinite(u).all()):
        raise ValueError("uncertainty contains NaN/Inf values")
    knn = knn_func if knn_func is not None else HyperbolicKNN(c=c)
    y = y.cpu()
    if (reference_embeddings is None) != (reference_labels is None):
        raise ValueError("reference_embeddings and reference_labels go together: give both or neither")
    if reference_embeddings is None:
        _, nn = knn(x.float(), 1, x.float(), True)
        hit = (y[nn[:, 0].cpu()] == y).double()
        _, inverse, counts = torch.unique(y, return_inverse=True, return_counts=True)
        keep = counts[inverse] > 1
    else:
        ref = torch.as_tensor(reference_embeddings).detach()
        ref_y = torch.as_tensor(reference_labels).detach().reshape(-1).cpu()
        if ref.dim() != 2 or ref.shape[1] != x.shape[1] or ref.shape[0] < 1:
            raise ValueError(f"reference_embeddings must be M x {x.shape[1]} with M >= 1, got shape {tuple(ref.shape)}")
        if ref_y.shape[0] != ref.shape[0]:
            raise ValueError("reference_labels must have one entry per reference embedding")
        if not torch.isfinite(ref).all():
            raise ValueError("reference_embeddings contains NaN/Inf values")
        _, nn = knn(x.float(), 1, ref.float(), False)
        hit = (ref_y[nn[:, 0].cpu()] == y).double()
        keep = torch.isin(y, ref_y)
    if not bool(keep.any()):
        raise ValueError("every query is alone in its class: Recall@1 is undefined")
    return hit[keep], u[keep]


def uncertainty_recall_table(
    embeddings: ArrayLike,
    labels: ArrayLike,
    c: CurvatureLike = DEFAULT_CURVATURE,
    n_bins: int = 10,
    uncertainty: Optional[ArrayLike] = None,
    mode: Optional[str] = None,
    clip_r: Optional[float] = None,
    knn_func: Optional[Callable] = None,
    reference_embeddings: Optional[ArrayLike] = None,
    reference_labels: Optional[ArrayLike] = None,
) -> List[dict]:
    r"""Recall@1 of the queries per uncertainty quantile bin.

    The queries are sorted by U (:func:`pml_hyperbolic.uncertainty.hyperbolic_uncertainty`, the
    rule Hyp-UML's losses use; larger = nearer the origin = less certain) and split into
    ``n_bins`` equal-count bins (bin 0 = most certain). Per bin, Recall@1 is the fraction of its
    queries whose nearest neighbour (Poincaré distance, :class:`HyperbolicKNN`) has the query's
    label. A recall falling with rising U supports Hyp-UML's claim.

    Protocol: query → reference retrieval when ``reference_embeddings`` / ``reference_labels`` are
    given (the run's own Recall@1, e.g. queries against a gallery); otherwise self-retrieval among
    the queries (self excluded). Queries whose class has no other member among the references
    ("lone" queries) cannot be retrieved correctly and are left out, as in PML's
    ``AccuracyCalculator``, so the count-weighted mean of the bins is the run's Recall@1; they still
    serve as neighbours. Equal U values always share a bin (that of the tie's lowest rank): a tie
    split by the data's order would invent a trend.

    Args:
        embeddings: (N, D) ball embeddings of the queries.
        labels: (N,) labels of the queries.
        c: the run's :class:`~pml_hyperbolic.geometry.PoincareGeometry` (its curvature and clip
            radius), or a curvature magnitude.
        n_bins: how many quantile bins (deciles by default).
        uncertainty: optional precomputed (N,) scores, used instead of computing U.
        mode: the uncertainty mode (``None`` = ``"clip"``).
        clip_r: the clip radius r of ``"clip"`` mode; None (default): the geometry's (``c`` as
            :func:`~pml_hyperbolic.geometry.as_geometry` gives it).
        knn_func: a PML-style kNN callable ``(query, k, reference, same_source)``; default
            :class:`HyperbolicKNN` with curvature ``c``.
        reference_embeddings: (M, D) gallery embeddings (with ``reference_labels``).
        reference_labels: (M,) gallery labels.

    Returns:
        one dict per non-empty bin: ``{"bin", "u_min", "u_max", "u_mean", "count",
        "recall_at_1"}``, most certain first.

    Raises:
        ValueError: ``n_bins`` is not a positive int, shapes do not match, NaN/Inf values, only one
            of the two reference arguments, or every query is alone in its class.

    Warns:
        RuntimeWarning: fewer bins than ``n_bins`` come back because of ties (as when every
            embedding sits at the head's clip radius and the "clip" U is 0 for all).

    Design note: docs/design/plots.md
    """
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    hit, u = _query_hits(embeddings, labels, c, uncertainty, mode, clip_r, knn_func, reference_embeddings,
                         reference_labels)
    un = u.numpy()
    order = np.argsort(un, kind="stable")
    sorted_u = un[order]
    # equal-count bins by rank, then every tie moved to the bin of its first (lowest-rank) member
    rank_bin = np.concatenate([np.full(len(p), b) for b, p in enumerate(np.array_split(order, n_bins))])
    bin_of = np.empty(len(un), dtype=np.int64)
    bin_of[order] = rank_bin[np.searchsorted(sorted_u, sorted_u, side="left")]
    used = np.unique(bin_of)
    if len(used) < n_bins:
        warnings.warn(
            f"uncertainty_recall_table: only {len(used)} distinct uncertainty bin(s) of {n_bins} "
            f"({len(np.unique(un))} distinct values among {len(un)} embeddings); tied values share a "
            "bin. With a clipped head this usually means the embeddings sit at the clip radius.",
            RuntimeWarning, stacklevel=2)
    table = []
    for b, code in enumerate(used):
        part = torch.from_numpy(np.flatnonzero(bin_of == code))
        ub = u[part]
        table.append(
            {
                "bin": b,
                "u_min": float(ub.min()),
                "u_max": float(ub.max()),
                "u_mean": float(ub.mean()),
                "count": int(len(part)),
                "recall_at_1": float(hit[part].mean()),
            }
        )
    return table


def uncertainty_failure_auroc(embeddings: ArrayLike, labels: ArrayLike, c: CurvatureLike = DEFAULT_CURVATURE,
                              uncertainty: Optional[ArrayLike] = None, mode: Optional[str] = None,
                              clip_r: Optional[float] = None, knn_func: Optional[Callable] = None,
                              reference_embeddings: Optional[ArrayLike] = None,
                              reference_labels: Optional[ArrayLike] = None) -> float:
    r"""AUROC of the Hyp-UML uncertainty for "the top-1 neighbour is of another class".

    .. math:: \mathrm{AUROC} = P(U_{miss} > U_{hit}) + \tfrac12 P(U_{miss} = U_{hit})

    over the queries of :func:`uncertainty_recall_table` (same protocol, same exclusions), computed
    from average ranks (the Mann–Whitney U statistic). One number for "does U flag failures?", free
    of the binning.

    Args:
        embeddings: (N, D) ball embeddings of the queries.
        labels: (N,) labels of the queries.
        c: the run's :class:`~pml_hyperbolic.geometry.PoincareGeometry` (its curvature and clip
            radius), or a curvature magnitude.
        uncertainty: optional precomputed (N,) scores.
        mode: the uncertainty mode (``None`` = ``"clip"``).
        clip_r: the clip radius r of ``"clip"`` mode; None (default): the geometry's (``c`` as
            :func:`~pml_hyperbolic.geometry.as_geometry` gives it).
        knn_func: kNN callable, as in :func:`uncertainty_recall_table`.
        reference_embeddings: (M, D) gallery embeddings (with ``reference_labels``).
        reference_labels: (M,) gallery labels.

    Returns:
        the AUROC in [0, 1]: 0.5 = U says nothing about failures, 1.0 = every miss is less certain
        than every hit; NaN when every query is a hit or every query a miss.

    Raises:
        ValueError: as :func:`uncertainty_recall_table`.
    """
    hit, u = _query_hits(embeddings, labels, c, uncertainty, mode, clip_r, knn_func, reference_embeddings,
                         reference_labels)
    miss = hit.numpy() < 0.5
    n_miss, n_hit = int(miss.sum()), int((~miss).sum())
    if n_miss == 0 or n_hit == 0:
        return float("nan")
    from scipy.stats import rankdata

    ranks = rankdata(u.numpy())  # average ranks: ties count one half (Mann-Whitney U)
    return float((ranks[miss].sum() - n_miss * (n_miss + 1) / 2) / (n_miss * n_hit))


def overall_recall_at_1(table: List[dict]) -> float:
    r"""Recall@1 over all queries of a :func:`uncertainty_recall_table`.

    .. math:: R = \sum_b n_b R_b / \sum_b n_b

    (the run's own Recall@1 on the same protocol).

    Args:
        table: the bins, as returned by :func:`uncertainty_recall_table`.

    Returns:
        the count-weighted mean of the bins' Recall@1.

    Raises:
        ValueError: the table holds no query.
    """
    total = sum(row["count"] for row in table)
    if total == 0:
        raise ValueError("the table holds no query (every bin is empty)")
    return sum(row["count"] * row["recall_at_1"] for row in table) / total


def label_decimals(table: List[dict], smallest: int = 2, largest: int = 6) -> int:
    """Decimals for the bins' tick labels.

    Args:
        table: the bins, as returned by :func:`uncertainty_recall_table`.
        smallest: the fewest decimals.
        largest: the most decimals.

    Returns:
        the fewest decimals (from ``smallest``, at most ``largest``) at which the bins' distinct
        bounds stay distinct when printed: bins 0.5201–0.5203 and 0.5203–0.5210 must not both
        read "0.52".
    """
    values = np.unique([v for row in table for v in (row["u_min"], row["u_max"])])
    for decimals in range(smallest, largest + 1):
        if len({f"{v:.{decimals}f}" for v in values}) == len(values):
            return decimals
    return largest


def bin_label(row: dict, decimals: int = 2, stacked: Optional[bool] = None) -> str:
    """Tick label of one bin.

    Args:
        row: one bin of :func:`uncertainty_recall_table`.
        decimals: decimals of the bounds.
        stacked: put the range on two lines (default: beyond two decimals), so that neighbouring
            labels do not run into each other.

    Returns:
        its uncertainty range (or single value) and its query count, on two or three lines.
    """
    lo, hi = f"{row['u_min']:.{decimals}f}", f"{row['u_max']:.{decimals}f}"
    stacked = decimals > 2 if stacked is None else stacked
    span = f"U = {lo}" if lo == hi else f"{lo}\n–{hi}" if stacked else f"{lo}–{hi}"
    return f"{span}\n{'n=' if stacked else 'n = '}{row['count']}"


def describe_uncertainty(mode: Optional[str] = None, clip_r: float = DEFAULT_CLIP_R, given: bool = False) -> str:
    r"""One line saying what the plotted U is, in the terms of :func:`pml_hyperbolic.uncertainty.hyperbolic_uncertainty`.

    Args:
        mode: the uncertainty mode (``None`` = ``"clip"``, the default).
        clip_r: the head's clip radius r used by ``"clip"`` mode.
        given: the scores were passed in precomputed (their definition is the caller's).

    Returns:
        the explanation, e.g. ``"U = clamp(1 − d₀ / (2·r), 0, 1): 1 at the origin, 0 at the clip
        sphere d₀ = 2r"`` with the number r written out.

    Raises:
        ValueError: ``mode`` is not one of the uncertainty modes.
    """
    if given:
        return "U: the uncertainty scores given to the plot (larger = less certain)"
    from ..uncertainty import UNCERTAINTY_MODES, DEFAULT_MODE

    mode = DEFAULT_MODE if mode is None else mode
    if mode not in UNCERTAINTY_MODES:
        raise ValueError(f"mode must be None or one of {UNCERTAINTY_MODES}, got {mode!r}")
    if mode == "clip":
        r = float(clip_r)
        return f"U = clamp(1 − d₀ / (2·{r:g}), 0, 1): 1 at the origin, 0 at the clip sphere d₀ = {2 * r:g}"
    if mode == "ball":
        return "U = 1 − √c·‖x‖: 1 at the origin, towards 0 at the rim of the ball"
    if mode == "batch":
        return "U = (max d₀ − d₀) / (max d₀ − min d₀) over these queries: 1 nearest the origin, 0 farthest"
    return "U = 1 − d₀/2 (Hyp-UML's formula as printed; negative beyond d₀ = 2)"


def _radius_spread(embeddings: ArrayLike, c: CurvatureLike) -> Tuple[float, float]:
    """(median, max − min) of the distances to the origin d₀ of ``embeddings``."""
    from .. import poincare_ball as pb

    x = torch.as_tensor(embeddings).detach().double().cpu()
    c_val = float(pb.as_curvature(c, torch.float64).detach())
    d0 = pb.dist0(pb.project(x, c_val), c_val)
    return float(d0.median()), float(d0.max() - d0.min())


def plot_uncertainty_vs_recall(embeddings: Optional[ArrayLike], labels: Optional[ArrayLike],
                               path: Union[str, os.PathLike], c: CurvatureLike = DEFAULT_CURVATURE, n_bins: int = 10,
                               table: Optional[list] = None, figsize: Tuple[float, float] = (6.4, 4.6),
                               dpi: int = 100, title: Optional[str] = None, min_count: int = 25,
                               radius_tol: float = 1e-3, explain: Optional[str] = None, **kwargs) -> List[dict]:
    r"""Bar chart of :func:`uncertainty_recall_table` (Recall@1 per uncertainty bin), written as a PNG.

    Each bar is labelled below with its uncertainty range and query count and above with its
    Recall@1; bars of fewer than ``min_count`` queries are hatched and pale (their Recall@1 is
    noise). The overall Recall@1 (:func:`overall_recall_at_1`) is a dashed horizontal line with its
    value. A caption under the axes says what U is (:func:`describe_uncertainty`) and that small U
    (far from the origin) means confident. The default title names the protocol (``kwargs``
    ``reference_embeddings`` / ``reference_labels``: queries vs gallery, as the run's Recall@1;
    otherwise self-retrieval among the queries).

    When the radius carries no information, no bar is drawn: if every embedding's distance to the
    origin :math:`d_0` lies within ``radius_tol`` of the others (as when a clipped head puts every
    embedding on its clip sphere), or every query has the same U, the axes hold a message saying
    so (with :math:`d_0` and the overall Recall@1) and one ``RuntimeWarning`` is issued.

    Args:
        embeddings: (N, D) ball embeddings of the queries (may be ``None`` with ``table``).
        labels: (N,) labels of the queries (may be ``None`` with ``table``).
        path: where to write the PNG.
        c: curvature magnitude, or the run's :class:`~pml_hyperbolic.geometry.PoincareGeometry`.
        n_bins: how many uncertainty quantile bins.
        table: a precomputed :func:`uncertainty_recall_table` (then nothing is retrieved).
        figsize: figure size in inches (the PNG has figsize × dpi pixels).
        dpi: pixels per inch.
        title: replaces the default title.
        min_count: bins with fewer queries are marked (hatched, pale).
        radius_tol: spread of :math:`d_0` (max − min) below which the radius is taken to carry no
            information.
        explain: replaces the caption line that defines U; ``""`` = no caption.
        **kwargs: passed to :func:`uncertainty_recall_table` (``uncertainty``, ``mode``,
            ``clip_r``, ``knn_func``, ``reference_embeddings``, ``reference_labels``).

    Returns:
        the table (list of dicts, one per non-empty bin), computed even when no bar is drawn.

    Raises:
        ValueError: the table is empty, or the inputs are rejected by
            :func:`uncertainty_recall_table`.

    Warns:
        RuntimeWarning: once, when no bar is drawn (the table's own tie warning is then silenced).

    Design note: docs/design/plots.md
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    given = kwargs.get("uncertainty") is not None
    flat_radius = None  # (median d0, spread) when every embedding sits at one radius
    if embeddings is not None and not given:
        median_d0, spread = _radius_spread(embeddings, c)
        if spread < radius_tol:
            flat_radius = (median_d0, spread)
    if table is None:
        with warnings.catch_warnings():
            if flat_radius is not None:  # said once, below, in plainer words than the table's
                warnings.simplefilter("ignore", RuntimeWarning)
            table = uncertainty_recall_table(embeddings, labels, c=c, n_bins=n_bins, **kwargs)
    if len(table) == 0:
        raise ValueError("the uncertainty-recall table is empty: nothing to plot")
    one_value = len(table) == 1 and table[0]["u_min"] == table[0]["u_max"]
    gallery = kwargs.get("reference_embeddings") is not None
    protocol = "queries vs gallery" if gallery else "self-retrieval among the queries"
    overall = overall_recall_at_1(table)
    if explain is None:
        from ..uncertainty import uncertainty_clip_radius

        radius = uncertainty_clip_radius(as_geometry(c), kwargs.get("clip_r"))  # the radius U used
        explain = (describe_uncertainty(kwargs.get("mode"), radius, given)
                   + "\nsmall U = far from the origin = confident; left bin: the most confident queries")
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    if flat_radius is not None or one_value:
        if flat_radius is not None:
            message = (f"The radius carries no information: every embedding has d₀ ≈ {flat_radius[0]:.3f}\n"
                       f"(spread {flat_radius[1]:.1e} < {radius_tol:g}), so U is the same for every query\n"
                       "and there is nothing to bin.")
        else:
            message = f"U is the same for every query (U = {table[0]['u_min']:.4g}): nothing to bin."
        message += f"\n\nOverall Recall@1: {overall:.3f} ({sum(row['count'] for row in table)} queries)"
        first_line = message.splitlines()[0]
        warnings.warn(f"plot_uncertainty_vs_recall: {first_line[0].lower() + first_line[1:]}; no bins drawn", RuntimeWarning,
                      stacklevel=2)
        ax.text(0.5, 0.5, message, transform=ax.transAxes, ha="center", va="center", fontsize=9,
                bbox=dict(boxstyle="round,pad=0.6", facecolor="#fff4e0", edgecolor="tab:orange"))
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_color("0.85")
        right = 1.0
    else:
        xs = np.arange(len(table))
        recalls = [row["recall_at_1"] for row in table]
        few = np.array([row["count"] < min_count for row in table])
        bars = ax.bar(xs, recalls, width=0.6 if len(table) > 1 else 0.35, color="tab:blue", zorder=2)
        for bar, is_few in zip(bars, few):
            if is_few:
                bar.set_facecolor((0.12, 0.47, 0.71, 0.35))
                bar.set_hatch("///")
                bar.set_edgecolor("tab:blue")
        for x_pos, recall in zip(xs, recalls):
            ax.text(x_pos, recall + 0.015, f"{recall:.3f}", ha="center", va="bottom", fontsize=8, zorder=4,
                    bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
        ax.axhline(overall, color="tab:orange", linestyle="--", linewidth=1.5, zorder=3)
        ax.text(1.0, overall, f" overall\n Recall@1\n {overall:.3f}", transform=ax.get_yaxis_transform(),
                color="tab:orange", fontsize=8, va="center", ha="left")
        if few.any():
            ax.text(0.99, 0.98, f"hatched: fewer than {min_count} queries (noisy)", transform=ax.transAxes,
                    ha="right", va="top", fontsize=7, color="0.3")
        ax.set_xticks(xs)
        decimals = label_decimals(table)
        many = len(table) > 6
        ax.set_xticklabels([bin_label(row, decimals, stacked=many or decimals > 2) for row in table],
                           fontsize=7 if many or decimals > 3 else 8)
        ax.set_xlim(-0.6 if len(table) > 1 else -1.0, len(table) - 0.4 if len(table) > 1 else 1.0)
        if len(table) > 1:
            ax.set_xlabel("uncertainty U per bin (left: most certain → right: least)", fontsize=9)
        else:
            ax.set_xlabel("one bin: ties in U leave a single bin", fontsize=9)
        ax.set_ylabel("Recall@1")
        ax.set_ylim(0, 1.08)
        ax.grid(axis="y", color="0.9", zorder=0)
        right = 0.88  # the right margin holds the overall value
    ax.set_title(title or f"Recall@1 per uncertainty bin\n({protocol})", fontsize=10)
    bottom = 0.0
    if explain:
        lines = explain.count("\n") + 1
        fig.text(0.5, 0.012, explain, ha="center", va="bottom", fontsize=8, color="0.25")
        bottom = min(0.3, (lines * 8 * 1.35 + 8) / 72 / figsize[1])
    fig.tight_layout(rect=(0.0, bottom, right, 1.0))
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return table
