"""How Hyp-UML's uncertainty relates to retrieval correctness: Recall@1 per uncertainty bin."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from .hyperbolic_knn import HyperbolicKNN


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
    embeddings,
    labels,
    c: float = 0.1,
    n_bins: int = 10,
    uncertainty=None,
    mode=None,
    clip_r: float = 2.3,
    knn_func=None,
    reference_embeddings=None,
    reference_labels=None,
):
    r"""Recall@1 of each query per uncertainty quantile bin.

    Query → reference retrieval when ``reference_embeddings`` / ``reference_labels`` are given (the
    protocol of the run's own Recall@1, e.g. display-font queries against a serif/sans gallery);
    otherwise self-retrieval among the queries (query = reference, self excluded).

    Hyp-UML claims that embeddings nearer the origin (larger uncertainty
    :func:`pml_hyperbolic.uncertainty.hyperbolic_uncertainty`, the rule its losses use) are retrieved
    less reliably. This helper splits the queries into ``n_bins`` uncertainty quantile bins
    (deciles by default; bin 0 = most certain) and reports per bin

    ``{"bin", "u_min", "u_max", "u_mean", "count", "recall_at_1"}``,

    where recall_at_1 = fraction of the bin's queries whose nearest neighbour (Poincaré distance,
    :class:`HyperbolicKNN`, self excluded in self-retrieval) has the same label. A falling recall
    with rising uncertainty supports the claim. Queries whose class has no other member among the
    references ("lone" queries) cannot be retrieved correctly and are left out, as in :class:`RecallAtKAccuracyCalculator` (so the
    bins' recall averages to its Recall@1); they still serve as neighbours. ``uncertainty`` may be given precomputed ((N,) tensor).
    Returns a list of dicts (one per non-empty bin).

    Equal uncertainties always share a bin (the bin of the tie's lowest rank), so a tie is never
    split by the data's order, which would invent a trend. When every embedding lies
    at the head's clip radius (common with clipping at 2.3: the "clip" uncertainty is then 0 for
    all), fewer bins than ``n_bins`` come back and a ``RuntimeWarning`` says so.
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


def uncertainty_failure_auroc(embeddings, labels, c: float = 0.1, uncertainty=None, mode=None,
                              clip_r: float = 2.3, knn_func=None, reference_embeddings=None,
                              reference_labels=None) -> float:
    r"""AUROC of the Hyp-UML uncertainty for "the top-1 neighbour is of another class".

    .. math:: \mathrm{AUROC} = P(U_{miss} > U_{hit}) + \tfrac12 P(U_{miss} = U_{hit})

    over the queries of :func:`uncertainty_recall_table` (same protocol, same exclusions): 0.5 means
    the uncertainty says nothing about failures, 1.0 that every miss is less certain than every hit.
    NaN when every query is a hit or every query a miss (the AUROC is undefined).
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


def overall_recall_at_1(table) -> float:
    r"""Recall@1 over all queries of a :func:`uncertainty_recall_table`: the count-weighted mean of
    the bins, :math:`\sum_b n_b R_b / \sum_b n_b` (the run's own Recall@1 on the same protocol)."""
    total = sum(row["count"] for row in table)
    if total == 0:
        raise ValueError("the table holds no query (every bin is empty)")
    return sum(row["count"] * row["recall_at_1"] for row in table) / total


def label_decimals(table, smallest: int = 2, largest: int = 6) -> int:
    """Fewest decimals (from ``smallest``, at most ``largest``) at which the bins' distinct
    uncertainty bounds stay distinct when printed: bins 0.5201–0.5203 and 0.5203–0.5210 must not
    both read "0.52"."""
    values = np.unique([v for row in table for v in (row["u_min"], row["u_max"])])
    for decimals in range(smallest, largest + 1):
        if len({f"{v:.{decimals}f}" for v in values}) == len(values):
            return decimals
    return largest


def bin_label(row, decimals: int = 2, stacked: Optional[bool] = None) -> str:
    """Tick label of one bin: its uncertainty range (or single value) and its query count. The
    range goes on two lines when ``stacked`` (default: beyond two decimals), so that neighbouring
    labels do not run into each other."""
    lo, hi = f"{row['u_min']:.{decimals}f}", f"{row['u_max']:.{decimals}f}"
    stacked = decimals > 2 if stacked is None else stacked
    span = f"U = {lo}" if lo == hi else f"{lo}\n–{hi}" if stacked else f"{lo}–{hi}"
    return f"{span}\n{'n=' if stacked else 'n = '}{row['count']}"


def plot_uncertainty_vs_recall(embeddings, labels, path, c: float = 0.1, n_bins: int = 10,
                               table: Optional[list] = None, figsize=(6.4, 4.2), dpi: int = 100,
                               title: Optional[str] = None, **kwargs):
    """Bar chart of :func:`uncertainty_recall_table` (Recall@1 per uncertainty bin) written to
    ``path`` (PNG). Returns the table.

    Each bar is labelled below with its uncertainty range and query count and above with its
    Recall@1; the overall Recall@1 (:func:`overall_recall_at_1`) is a dashed horizontal line with
    its value. The protocol is that of ``kwargs`` (``reference_embeddings`` / ``reference_labels``:
    queries vs gallery, as the run's Recall@1; otherwise self-retrieval among the queries) and the
    default title says which. A single bin (every embedding at the head's clip radius) is drawn as
    one narrow bar, said in the x label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if table is None:
        table = uncertainty_recall_table(embeddings, labels, c=c, n_bins=n_bins, **kwargs)
    if len(table) == 0:
        raise ValueError("the uncertainty-recall table is empty: nothing to plot")
    gallery = kwargs.get("reference_embeddings") is not None
    protocol = "queries vs gallery" if gallery else "self-retrieval among the queries"
    overall = overall_recall_at_1(table)
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    xs = np.arange(len(table))
    recalls = [row["recall_at_1"] for row in table]
    ax.bar(xs, recalls, width=0.6 if len(table) > 1 else 0.35, color="tab:blue", zorder=2)
    for x_pos, recall in zip(xs, recalls):
        ax.text(x_pos, recall + 0.015, f"{recall:.3f}", ha="center", va="bottom", fontsize=8, zorder=4,
                bbox=dict(boxstyle="round,pad=0.1", facecolor="white", edgecolor="none", alpha=0.8))
    ax.axhline(overall, color="tab:orange", linestyle="--", linewidth=1.5, zorder=3)
    ax.text(1.0, overall, f" overall\n Recall@1\n {overall:.3f}", transform=ax.get_yaxis_transform(),
            color="tab:orange", fontsize=8, va="center", ha="left")
    ax.set_xticks(xs)
    decimals = label_decimals(table)
    many = len(table) > 6
    ax.set_xticklabels([bin_label(row, decimals, stacked=many or decimals > 2) for row in table],
                       fontsize=7 if many or decimals > 3 else 8)
    ax.set_xlim(-0.6 if len(table) > 1 else -1.0, len(table) - 0.4 if len(table) > 1 else 1.0)
    if len(table) > 1:
        ax.set_xlabel("Hyp-UML uncertainty U per bin (left: most certain → right: least)", fontsize=9)
    else:
        ax.set_xlabel("one bin: every query has the same uncertainty "
                      "(as when all sit at the head's clip radius)", fontsize=9)
    ax.set_ylabel("Recall@1")
    ax.set_ylim(0, 1.08)
    ax.grid(axis="y", color="0.9", zorder=0)
    ax.set_title(title or f"Recall@1 per uncertainty bin\n({protocol})", fontsize=10)
    fig.tight_layout(rect=(0.0, 0.0, 0.88, 1.0))  # the right margin holds the overall value
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return table
