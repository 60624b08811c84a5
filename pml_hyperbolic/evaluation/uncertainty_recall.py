"""How Hyp-UML's uncertainty relates to retrieval correctness: Recall@1 per uncertainty bin."""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np
import torch

from .hyperbolic_knn import HyperbolicKNN


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
    x = torch.as_tensor(embeddings).detach()
    y = torch.as_tensor(labels).detach().reshape(-1)
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"embeddings must be N x D with N >= 2, got shape {tuple(x.shape)}")
    if y.shape[0] != x.shape[0]:
        raise ValueError("labels must have one entry per embedding")
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
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
    hit, u = hit[keep], u[keep]
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


def plot_uncertainty_vs_recall(embeddings, labels, path, c: float = 0.1, n_bins: int = 10,
                               table: Optional[list] = None, figsize=(6.0, 4.0), dpi: int = 100,
                               title: Optional[str] = None, **kwargs):
    """Bar chart of :func:`uncertainty_recall_table` (Recall@1 per uncertainty bin) written to
    ``path`` (PNG). Returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if table is None:
        table = uncertainty_recall_table(embeddings, labels, c=c, n_bins=n_bins, **kwargs)
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    xs = [row["bin"] for row in table]
    ax.bar(xs, [row["recall_at_1"] for row in table], color="tab:blue")
    for row in table:
        ax.text(row["bin"], row["recall_at_1"], f"n={row['count']}", ha="center", va="bottom", fontsize=7)
    ax.set_xlabel("uncertainty bin (0 = most certain)")
    ax.set_ylabel("Recall@1")
    ax.set_ylim(0, 1.05)
    ax.set_title(title or "Recall@1 per uncertainty bin")
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return table
