"""Average-linkage utilities of the pseudo-labeller. The similarity-level helper and its label
convention live in :mod:`pml_hyperbolic.hierarchy_levels` and are re-exported here.

Design note: docs/design/miners.md
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..hierarchy_levels import as_hierarchical_labels, first_shared_level, pairwise_first_shared_level

__all__ = [
    "as_hierarchical_labels",
    "first_shared_level",
    "pairwise_first_shared_level",
    "weighted_average_linkage",
    "linkage_to_merges",
    "cut_merges",
]


# ------------------------------------------------------------------------------------------------
# Average linkage with initial cluster weights (nearest-neighbour chain) and tree cuts
# ------------------------------------------------------------------------------------------------
def weighted_average_linkage(dist: np.ndarray, sizes: np.ndarray | None = None) -> np.ndarray:
    r"""UPGMA (average linkage) over n nodes that may already be clusters of ``sizes`` points.

    ``dist[a, b]`` must be the average point-to-point distance between nodes a and b. Merging
    uses the Lance–Williams average update

    .. math:: d(A\cup B, C) = \frac{n_A\, d(A, C) + n_B\, d(B, C)}{n_A + n_B},

    which keeps every entry equal to the mean over all underlying point pairs, so the tree is the
    exact average-linkage tree of the points given that each node stays together. With unit
    sizes this is scipy's ``linkage(method="average")``. Nearest-neighbour chain: O(n²) time and
    memory (average linkage is reducible, so the chain finds the same merges as the naive
    algorithm).

    Returns an (n − 1) × 3 float64 array of merges ``(a, b, height)`` sorted by height, where
    a and b are *leaf* indices, one from each merged cluster (the format :func:`cut_merges` takes).

    Raises:
        ValueError: ``dist`` not a square matrix of finite numbers ≥ 0, or ``sizes`` not n finite
            numbers > 0.
    """
    try:
        d = np.array(dist, dtype=np.float64, copy=True)
    except (TypeError, ValueError):
        raise ValueError(f"dist must be a square matrix of numbers, got {type(dist).__name__}") from None
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"dist must be square, got shape {d.shape}")
    n = d.shape[0]
    if not np.isfinite(d).all() or (d < 0).any():
        raise ValueError("dist must hold finite distances >= 0 (NaN, Inf or negative entries found)")
    if sizes is None:
        w = np.ones(n)
    else:
        try:
            w = np.asarray(sizes, dtype=np.float64).copy()
        except (TypeError, ValueError):
            raise ValueError(f"sizes must be {n} numbers > 0, got {sizes!r}") from None
        if w.shape != (n,) or not (np.isfinite(w).all() and (w > 0).all()):
            raise ValueError(f"sizes must be {n} finite numbers > 0 (one per node), got shape {w.shape}")
    if n <= 1:
        return np.zeros((0, 3))
    np.fill_diagonal(d, np.inf)
    active = np.ones(n, dtype=bool)
    merges = []
    chain: list[int] = []
    remaining = n
    while remaining > 1:
        if not chain:
            chain.append(int(np.flatnonzero(active)[0]))
        a = chain[-1]
        row = d[a]
        b = int(np.argmin(row))
        # prefer the previous chain element on ties, otherwise the chain can cycle
        if len(chain) > 1 and row[chain[-2]] <= row[b]:
            b = chain[-2]
        if len(chain) > 1 and b == chain[-2]:
            chain.pop()
            chain.pop()
            height = row[b]
            merges.append((a, b, height))
            # the merged cluster lives in slot a (a is one of its leaves); b is retired
            new = (w[a] * d[a] + w[b] * d[b]) / (w[a] + w[b])
            d[a, :] = new
            d[:, a] = new
            d[a, a] = np.inf
            d[b, :] = np.inf
            d[:, b] = np.inf
            w[a] += w[b]
            active[b] = False
            remaining -= 1
        else:
            chain.append(b)
    out = np.array(merges, dtype=np.float64)
    order = np.argsort(out[:, 2], kind="stable")
    return out[order]


def linkage_to_merges(linkage_matrix: np.ndarray) -> np.ndarray:
    """Convert a scipy linkage matrix (cluster ids ≥ n are merges) to ``(leaf_a, leaf_b, h)``.

    Raises:
        ValueError: ``linkage_matrix`` is not an (n − 1) × 4 array.
    """
    z = np.asarray(linkage_matrix)
    if z.ndim != 2 or z.shape[1] != 4:
        raise ValueError(f"linkage_matrix must be a scipy linkage matrix ((n - 1) x 4), got shape {z.shape}")
    n = z.shape[0] + 1
    rep = np.arange(2 * n - 1)
    out = np.empty((n - 1, 3))
    for step, (a, b, h, _) in enumerate(z):
        ra, rb = rep[int(a)], rep[int(b)]
        out[step] = (ra, rb, h)
        rep[n + step] = ra
    return out


def _find(parent: np.ndarray, i: int) -> int:
    root = i
    while parent[root] != root:
        root = parent[root]
    while parent[i] != root:  # path compression
        parent[i], i = root, parent[i]
    return root


def cut_merges(merges: np.ndarray, n: int, n_clusters: Sequence[int] | None = None,
               thresholds: Sequence[float] | None = None) -> np.ndarray:
    """Flat clusterings of one tree at several levels, finest first: n × K int64 labels.

    ``merges`` (from :func:`weighted_average_linkage` / :func:`linkage_to_merges`) are sorted by
    height. Level k keeps the first ``n - n_clusters[k]`` merges (counts, decreasing) or the
    merges of height ≤ ``thresholds[k]`` (increasing). Both are prefixes of one merge sequence,
    so the levels are nested. Cluster ids at each level are 0..n_k − 1 in order of the smallest
    leaf they contain.

    Raises:
        ValueError: ``merges`` not an m × 3 array with m < ``n``, leaf indices outside [0, ``n``)
            or non-finite heights; ``n`` not an integer ≥ 1; neither
            or both of ``n_clusters`` / ``thresholds``; cluster counts that are not integers in
            [1, ``n``]; thresholds that are not finite numbers.
    """
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"n must be an integer >= 1, got {n!r}")
    merges = np.asarray(merges)
    if merges.ndim != 2 or merges.shape[1] != 3 or merges.shape[0] > n - 1:
        raise ValueError(f"merges must be an m x 3 array (leaf_a, leaf_b, height) with m < n = {n}, "
                         f"got shape {merges.shape}")
    if len(merges) and not (np.isfinite(merges).all() and (merges[:, :2] >= 0).all() and (merges[:, :2] < n).all()):
        raise ValueError(f"merges must hold leaf indices in [0, n = {n}) and finite heights")
    if (n_clusters is None) == (thresholds is None):
        raise ValueError("give exactly one of n_clusters or thresholds")
    parent = np.arange(n)
    if n_clusters is not None:
        for m in n_clusters:
            if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or not 1 <= m <= n:
                raise ValueError(f"n_clusters must hold integers in [1, n = {n}], got {list(n_clusters)!r}")
        stops = [n - int(m) for m in n_clusters]
    else:
        for t in thresholds:
            if isinstance(t, bool) or not isinstance(t, (int, float, np.floating, np.integer)) or not np.isfinite(t):
                raise ValueError(f"thresholds must hold finite numbers, got {list(thresholds)!r}")
        heights = merges[:, 2] if len(merges) else np.zeros(0)
        stops = [int(np.searchsorted(heights, t, side="right")) for t in thresholds]
    labels = np.empty((n, len(stops)), dtype=np.int64)
    done = 0
    for level, stop in enumerate(stops):
        for a, b, _ in merges[done:stop]:
            ra, rb = _find(parent, int(a)), _find(parent, int(b))
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)  # root = smallest leaf of the cluster
        done = max(done, stop)
        roots = np.array([_find(parent, i) for i in range(n)])
        labels[:, level] = np.unique(roots, return_inverse=True)[1]
    return labels
