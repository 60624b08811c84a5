"""Hierarchical pseudo-labels from average-linkage clustering under the hyperbolic distance."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np
import torch

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CURVATURE, as_geometry
from ..manifold_tensors import unwrap_ball_tensor
from ..kernels.threads import limited_threads, uncontended_threads
from .hierarchy import cut_merges, linkage_to_merges, weighted_average_linkage

PAPER_LEVELS = (100, 70, 40, 10)
LINKAGES = ("ward", "average")
# up to this many points the clustering runs single-threaded without asking: scipy's linkage
# (one thread) dominates there, and looking at the machine would cost more than threads gain
_SERIAL_MAX_SAMPLES = 1024


def _check_levels(levels):
    if isinstance(levels, (str, bytes)) or not hasattr(levels, "__len__"):
        raise ValueError(f"levels must be a sequence of cluster counts, got {levels!r}")
    levels = list(levels)
    if len(levels) < 1:
        raise ValueError("levels must hold at least one level (K >= 1), got an empty sequence")
    for m in levels:
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or int(m) < 1:
            raise ValueError(f"levels must be integers >= 1, got {levels!r}")
    levels = [int(m) for m in levels]
    if any(b >= a for a, b in zip(levels, levels[1:])):
        raise ValueError(f"levels must be strictly decreasing (finest level first), got {levels!r}")
    return tuple(levels)


def _check_thresholds(thresholds):
    if isinstance(thresholds, (str, bytes)) or not hasattr(thresholds, "__len__"):
        raise ValueError(f"distance_thresholds must be a sequence of distances, got {thresholds!r}")
    thresholds = list(thresholds)
    if len(thresholds) < 1:
        raise ValueError("distance_thresholds must hold at least one level (K >= 1)")
    for t in thresholds:
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (0 < float(t) < float("inf")):
            raise ValueError(f"distance_thresholds must be finite numbers > 0, got {thresholds!r}")
    thresholds = [float(t) for t in thresholds]
    if any(b <= a for a, b in zip(thresholds, thresholds[1:])):
        raise ValueError(f"distance_thresholds must be strictly increasing (finest first), got {thresholds!r}")
    return tuple(thresholds)


def _check_int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class HierarchicalPseudoLabeler:
    r"""K-level hierarchical pseudo-labels by average-linkage clustering in the Poincaré ball.

    Yan et al., "Unsupervised Hyperbolic Metric Learning" (CVPR 2021), Sec. 3.3: agglomerative
    clustering whose cluster-to-cluster distance is the mean pairwise distance (Eq. 3,
    average linkage / UPGMA; ``linkage="average"``)

    .. math:: d_{ab} = \frac{1}{n_a n_b}\sum_{z_i\in C_a,\, z_j\in C_b} d_c(z_i, z_j),

    with :math:`d_c` the Poincaré distance (the paper's Eq. 3 prints a Euclidean norm although
    it clusters "in the hyperbolic space"; we use the geodesic distance, as the text says), cut
    at K levels. ``linkage="ward"``: Ward's minimum-variance linkage of the points mapped to the
    tangent space at the origin, :math:`v_i = \log_0^c(z_i)`; a merge of A and B costs

    .. math:: \Delta(A, B) = \frac{n_A n_B}{n_A + n_B}\,\lVert \bar v_A - \bar v_B \rVert^2 .

    Why offer Ward: average linkage chains on embeddings of a pretrained network (one cluster takes a
    large share of the points, many points stay singletons); Ward's clusters stay of comparable size.
    The default stays the paper's average linkage: trained through the log-ratio loss on a randomly
    initialised head, Ward's labels did not score higher (docs/design/pseudo-labels.md).

    ``fit_predict(z)`` returns N × K int64 labels, column k = cluster id at level k,
    **finest first**; the levels are nested (every fine cluster lies inside one coarse cluster).

    Levels are given either as cluster counts, strictly decreasing (``levels``; default
    (100, 70, 40, 10), the paper's K = 4 setting of Table 2), or as linkage-distance thresholds,
    strictly increasing (``distance_thresholds``; the paper's Fig. 4 uses {5, 10, 15}).

    **Exact path** (N ≤ ``exact_max_samples``, default 4096): average linkage on the full float64
    N × N hyperbolic distance matrix (fused ``poincare_ball.pairwise_dist``); Ward on the float64
    tangent vectors (scipy, both).

    **Approximate path** (larger N; memory no longer O(N²)):

    1. map the points to the tangent space at the origin (``logmap0``) and run k-means there
       (faiss, trained on ≤ 32 random points per centroid; sklearn ``MiniBatchKMeans`` if faiss is
       missing) into ``n_fine_clusters`` fine clusters (default max(1024, 4·levels[0]), at most
       N/2); every point goes to its nearest centroid;
    2. estimate every inter-cluster average hyperbolic distance :math:`d_{ab}` from at most
       ``samples_per_cluster`` (default 8) random members of each cluster (an unbiased estimate
       of the mean over all member pairs);
    3. exact weighted average linkage over the fine clusters, each weighted by its size
       (Lance–Williams: :math:`d(A\cup B, C) = (n_A d_{AC} + n_B d_{BC})/(n_A+n_B)`), then cut;
       with Ward, steps 2–3 are Ward's linkage of the fine clusters' tangent centroids (unweighted).

    The approximation: points that k-means puts in one fine cluster are never separated (the
    tree is exact average linkage *over fine clusters*, not over points), and the initial
    inter-cluster averages are sample means. Nothing of size N × N is built: memory is
    O(N·D + n_fine² + (n_fine·samples_per_cluster)·chunk).

    Threads: the work runs with :func:`~pml_hyperbolic.kernels.threads.uncontended_threads` torch/faiss
    threads (the caller's count on an idle machine, 1 when other processes hold the cores, where
    more threads only wait at barriers), single-threaded up to 1,024
    points; the caller's thread count is restored afterwards.

    Args:
        levels: cluster counts per level, finest first (strictly decreasing, ≥ 1). ``None`` (the
            default) means (100, 70, 40, 10) unless ``distance_thresholds`` is given.
        c: the geometry of the ball, or a curvature (:func:`~pml_hyperbolic.geometry.as_geometry`);
            default :data:`~pml_hyperbolic.geometry.DEFAULT_CURVATURE`, the Hyp-ViT/HypMix head's
            (Yan et al. use c = 1).
        distance_thresholds: linkage heights per level (strictly increasing); excludes ``levels``
            (with Ward: merge heights of the tangent vectors, not hyperbolic distances).
        exact_max_samples: largest N clustered exactly.
        n_fine_clusters: k-means clusters of the approximate path (``None``: see above).
        samples_per_cluster: members per fine cluster used to estimate inter-cluster averages.
        kmeans_iterations: k-means iterations (default 15).
        kmeans_points_per_cluster: k-means is trained on at most this many random points per
            centroid (default 32; faiss path), then every point is assigned to its nearest one.
        seed: seed for k-means and the subsampling.
        linkage: ``"average"`` (default, the paper's Eq. 3) or ``"ward"``.

    Attributes (after ``fit_predict``): ``level_sizes_`` (clusters per level), ``used_exact_``,
    ``merge_heights_`` (sorted linkage heights), ``fine_to_hierarchy_`` (n_0 × K int64: the
    hierarchy row of each finest-level cluster id; since the levels are nested, the finest id
    determines the whole row; :class:`HierarchicalSimilarityMiner` uses it to decode 1-D labels).

    Raises:
        ValueError: ``levels`` / ``distance_thresholds`` malformed or both given, a bad ``c``, an
            unknown ``linkage``,
            integer arguments (``exact_max_samples``, ``n_fine_clusters``, ``samples_per_cluster``,
            ``kmeans_iterations``, ``kmeans_points_per_cluster``, ``seed``) that are not integers
            at their minimum or above (bool included).

    Design note: docs/design/miners.md
    """

    def __init__(
        self,
        levels: Sequence[int] | None = None,
        c: float | torch.Tensor | torch.nn.Module = DEFAULT_CURVATURE,
        distance_thresholds: Sequence[float] | None = None,
        exact_max_samples: int = 4096,
        n_fine_clusters: int | None = None,
        samples_per_cluster: int = 8,
        kmeans_iterations: int = 15,
        kmeans_points_per_cluster: int = 32,
        seed: int = 0,
        linkage: str = "average",
    ):
        if linkage not in LINKAGES:
            raise ValueError(f"linkage must be one of {LINKAGES} ('average' is the paper's), got {linkage!r}")
        self.linkage = linkage
        if levels is not None and distance_thresholds is not None:
            raise ValueError("give either levels (cluster counts) or distance_thresholds, not both")
        if distance_thresholds is None:
            self.levels = _check_levels(PAPER_LEVELS if levels is None else levels)
            self.distance_thresholds = None
        else:
            self.levels = None
            self.distance_thresholds = _check_thresholds(distance_thresholds)
        if c is None:
            raise TypeError("c must be a curvature or a PoincareGeometry, got None")
        self.geometry = as_geometry(c)  # ValueError / TypeError naming c; a PoincareGeometry by reference
        self.exact_max_samples = _check_int(exact_max_samples, "exact_max_samples", 0)
        if n_fine_clusters is not None:
            n_fine_clusters = _check_int(n_fine_clusters, "n_fine_clusters", 2)
            if self.levels is not None and n_fine_clusters < self.levels[0]:
                raise ValueError(
                    f"n_fine_clusters ({n_fine_clusters}) must be >= the finest level count ({self.levels[0]})"
                )
        self.n_fine_clusters = n_fine_clusters
        self.samples_per_cluster = _check_int(samples_per_cluster, "samples_per_cluster", 1)
        self.kmeans_iterations = _check_int(kmeans_iterations, "kmeans_iterations", 1)
        self.kmeans_points_per_cluster = _check_int(kmeans_points_per_cluster, "kmeans_points_per_cluster", 1)
        self.seed = _check_int(seed, "seed", 0)

    @property
    def c(self) -> float:
        """The current curvature magnitude of :attr:`geometry` (read at each use)."""
        return float(self.geometry.curvature(torch.float64).detach())

    @property
    def num_levels(self) -> int:
        return len(self.levels) if self.levels is not None else len(self.distance_thresholds)

    # ------------------------------------------------------------------------------------------
    def fit_predict(self, embeddings: torch.Tensor) -> torch.Tensor:
        """Cluster ``embeddings`` (N × D points of the ball, or a hypll ``ManifoldTensor`` of them on
        a ball of curvature ``c``; projected first) → N × K int64."""
        emb = torch.as_tensor(unwrap_ball_tensor(embeddings, self.c, "HierarchicalPseudoLabeler"))
        if emb.ndim != 2 or emb.shape[0] < 2:
            raise ValueError(f"embeddings must have shape (N, D) with N >= 2, got {tuple(emb.shape)}")
        if not emb.is_floating_point():
            raise ValueError(f"embeddings must be floating point, got {emb.dtype}")
        pb.check_finite(emb, "embeddings")
        n = emb.shape[0]
        if self.levels is not None and self.levels[0] > n:
            raise ValueError(f"levels[0] = {self.levels[0]} clusters requested but only {n} embeddings given")
        device = emb.device
        x = emb.detach().to("cpu")
        # k-means iterations and the chunked distance sums are loops of parallel ops (torch and
        # faiss share one OpenMP runtime); on a busy machine their barriers wait for descheduled
        # threads, so the thread count follows
        # the machine's load (tests check that the labels come out the same either way)
        threads = 1 if n <= _SERIAL_MAX_SAMPLES else uncontended_threads()
        with torch.no_grad(), limited_threads(threads):
            if n <= self.exact_max_samples:
                node_labels, assignment = self._exact(x), None
            else:
                node_labels, assignment = self._approximate(x)
        labels = node_labels if assignment is None else node_labels[assignment]
        self.used_exact_ = assignment is None
        self.level_sizes_ = tuple(int(labels[:, k].max()) + 1 for k in range(labels.shape[1]))
        table = np.zeros((self.level_sizes_[0], labels.shape[1]), dtype=np.int64)
        table[labels[:, 0]] = labels
        self.fine_to_hierarchy_ = torch.from_numpy(table)
        return torch.from_numpy(np.ascontiguousarray(labels)).to(device)

    def _cut(self, merges, n_nodes):
        self.merge_heights_ = merges[:, 2].copy()
        return cut_merges(merges, n_nodes, n_clusters=self.levels, thresholds=self.distance_thresholds)

    def _exact(self, x: torch.Tensor) -> np.ndarray:
        from scipy.cluster.hierarchy import linkage
        from scipy.spatial.distance import squareform

        x64 = pb.project(x.double(), self.c)
        if self.linkage == "ward":
            z = linkage(pb.logmap0(x64, self.c).numpy(), method="ward")
            return self._cut(linkage_to_merges(z), x.shape[0])
        d = pb.pairwise_dist(x64, x64, self.c).numpy()
        d = 0.5 * (d + d.T)  # exact symmetry for scipy
        np.fill_diagonal(d, 0.0)
        z = linkage(squareform(d, checks=False), method="average")
        return self._cut(linkage_to_merges(z), x.shape[0])

    def _kmeans(self, v: np.ndarray, k: int) -> np.ndarray:
        try:
            import faiss
        except ImportError:  # pragma: no cover - faiss is a declared dependency
            from sklearn.cluster import MiniBatchKMeans

            km = MiniBatchKMeans(n_clusters=k, random_state=self.seed, n_init=1, max_iter=self.kmeans_iterations)
            return km.fit_predict(v)
        km = faiss.Kmeans(v.shape[1], k, niter=self.kmeans_iterations, seed=self.seed, verbose=False)
        km.cp.min_points_per_centroid = 1  # small inputs are legitimate here; no warning spam
        # k-means only has to over-segment finely; training on a random subsample of
        # kmeans_points_per_cluster points per centroid (every point is then assigned) is ~4x
        # cheaper at 60k points than training on all of them
        km.cp.max_points_per_centroid = self.kmeans_points_per_cluster
        km.train(v)
        return km.index.search(v, 1)[1][:, 0]

    def _approximate(self, x: torch.Tensor):
        n = x.shape[0]
        if self.n_fine_clusters is not None:
            n_fine = self.n_fine_clusters
        else:
            n_fine = max(1024, 4 * self.levels[0]) if self.levels is not None else 1024
            n_fine = max(min(n_fine, n // 2), self.levels[0] if self.levels is not None else 2)
        n_fine = min(n_fine, n)
        ball = pb.project(x.float(), self.c)
        tangent = np.ascontiguousarray(pb.logmap0(ball, self.c).numpy(), dtype=np.float32)
        raw = self._kmeans(tangent, n_fine)
        _, assignment, sizes = np.unique(raw, return_inverse=True, return_counts=True)
        assignment = assignment.reshape(-1)
        n_nodes = len(sizes)
        if self.levels is not None and n_nodes < self.levels[0]:
            raise ValueError(
                f"k-means produced {n_nodes} non-empty fine clusters, fewer than levels[0] = {self.levels[0]}; "
                "increase n_fine_clusters"
            )
        if self.linkage == "ward":
            from scipy.cluster.hierarchy import linkage

            centroids = np.zeros((n_nodes, tangent.shape[1]), dtype=np.float64)
            np.add.at(centroids, assignment, tangent.astype(np.float64))
            centroids /= sizes[:, None]
            return self._cut(linkage_to_merges(linkage(centroids, method="ward")), n_nodes), assignment
        mean_dist = self._cluster_mean_distances(ball, assignment, n_nodes)
        merges = weighted_average_linkage(mean_dist, sizes)
        return self._cut(merges, n_nodes), assignment

    def _cluster_mean_distances(self, ball: torch.Tensor, assignment: np.ndarray, n_nodes: int) -> np.ndarray:
        """Sample estimate of the mean hyperbolic distance between every two fine clusters."""
        rng = np.random.default_rng(self.seed)
        order = rng.permutation(len(assignment))
        order = order[np.argsort(assignment[order], kind="stable")]
        sorted_cluster = assignment[order]
        starts = np.searchsorted(sorted_cluster, np.arange(n_nodes))
        rank = np.arange(len(order)) - starts[sorted_cluster]
        keep = order[rank < self.samples_per_cluster]
        pts = ball[torch.from_numpy(keep)]
        cl = torch.from_numpy(assignment[keep]).long()
        sums = torch.zeros(n_nodes, n_nodes, dtype=torch.float64)
        chunk = max(1, (1 << 24) // max(1, pts.shape[0]))  # ~64 MB of float32 distances per chunk
        for start in range(0, pts.shape[0], chunk):
            block = pb.pairwise_dist(pts[start : start + chunk], pts, self.c)
            per_col = torch.zeros(block.shape[0], n_nodes, dtype=block.dtype)
            per_col.index_add_(1, cl, block)  # ≤ samples_per_cluster terms per entry: float32 is enough
            sums.index_add_(0, cl[start : start + chunk], per_col.double())
        counts = torch.bincount(cl, minlength=n_nodes).double()
        mean = sums / (counts[:, None] * counts[None, :])
        return mean.numpy()
