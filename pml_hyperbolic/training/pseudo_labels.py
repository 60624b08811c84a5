"""Pseudo-labels for unsupervised training: a label-hiding dataset wrapper, the clustering policy
and the recipe mixin that re-clusters every epoch.

Design note: docs/design/pseudo-labels.md
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..geometry import DEFAULT_CURVATURE, as_geometry
from ..heads.whitening import DEFAULT_WHITENING_HEAD_INIT_SCALE, whitening_head_init  # noqa: F401 (re-exported)
from ..heads.whitening import principal_axes as _principal_axes
from .presets import DEFAULT_PSEUDO_LEVELS, PAPER_PSEUDO_LEVELS
from .presets import PSEUDO_LABEL_LINKAGES as LINKAGES
from .presets import PSEUDO_LABEL_SOURCES as SOURCES


class PseudoLabelledDataset(torch.utils.data.Dataset):
    """Returns ``(image, pseudo_labels_row)``; the true labels of ``base`` are never returned.

    ``labels`` is (N, K) int64 (finest level first) once :meth:`set_labels` has been called; before
    that every sample is its own class (so nothing can leak from the ground truth).

    Args:
        base: a dataset whose items are ``(image, label, ...)`` or ``None`` (an unreadable image).

    Design note: docs/design/pseudo-labels.md
    """

    def __init__(self, base: torch.utils.data.Dataset):
        self.base = base
        self.pseudo = np.arange(len(base), dtype=np.int64)[:, None]

    @property
    def labels(self) -> np.ndarray:
        return self.pseudo

    def set_labels(self, labels: Any) -> None:
        """Replace the pseudo-labels.

        Args:
            labels: (N,) or (N, K) integer labels (array or tensor), N = ``len(base)``.

        Raises:
            ValueError: when the number of rows is not ``len(base)``.
        """
        labels = np.asarray(labels.cpu() if torch.is_tensor(labels) else labels, dtype=np.int64)
        if labels.ndim == 1:
            labels = labels[:, None]
        if labels.shape[0] != len(self.base):
            raise ValueError(f"labels has {labels.shape[0]} rows for a dataset of {len(self.base)}")
        self.pseudo = labels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        item = self.base[index]
        if item is None:  # an unreadable image: dropped by collate_skipping_unreadable
            return None
        return item[0], torch.as_tensor(self.pseudo[index])


# PAPER_PSEUDO_LEVELS, DEFAULT_PSEUDO_LEVELS, LINKAGES and SOURCES live in ``presets`` (torch-free:
# the recipe's --help reads them too). Why the defaults are what they are: docs/design/pseudo-labels.md.
DEFAULT_WHITEN = 256


def _check_levels(levels):
    if isinstance(levels, (str, bytes)) or not hasattr(levels, "__len__") or len(levels) < 1:
        raise ValueError(f"levels must be a non-empty sequence of cluster counts, got {levels!r}")
    out = []
    for m in levels:
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or int(m) < 1:
            raise ValueError(f"levels must be integers >= 1, got {levels!r}")
        out.append(int(m))
    if any(b >= a for a, b in zip(out, out[1:])):
        raise ValueError(f"levels must be strictly decreasing (finest level first), got {levels!r}")
    return tuple(out)


def _compact(labels: np.ndarray) -> np.ndarray:
    """Renumber every column to 0..n_k-1 (order of first appearance of the sorted ids)."""
    return np.stack([np.unique(labels[:, k], return_inverse=True)[1].reshape(-1)
                     for k in range(labels.shape[1])], 1).astype(np.int64)


def linkage_levels(points: Any, levels: Sequence[int], method: str = "ward",
                   max_exact: int = 20000) -> np.ndarray:
    """Nested cluster ids of an agglomerative tree of ``points``, cut at ``levels`` clusters.

    N ≤ ``max_exact``: scipy's exact linkage (O(N²) memory). Larger N: faiss k-means into
    max(1024, 4·levels[0]) (at most N/2) fine clusters, the linkage over their centroids, every
    point labelled by its centroid (an approximation: unweighted centroids), so memory stays
    O(N·D + n_fine²).

    Args:
        points: (N, D) points in Euclidean space (array or tensor), N ≥ 2, finite.
        levels: cluster counts, strictly decreasing (finest first), ``levels[0] <= N``.
        method: ``"ward"`` or ``"average"``.
        max_exact: largest N clustered exactly.

    Returns:
        (N, K) int64 cluster ids, column k numbered 0..levels[k]-1, nested across columns.

    Raises:
        ValueError: bad ``levels`` or ``method``, points not (N ≥ 2, D), NaN/Inf, more clusters
            than points, or k-means leaving fewer non-empty clusters than ``levels[0]``.

    Design note: docs/design/pseudo-labels.md
    """
    from scipy.cluster.hierarchy import fcluster, linkage

    levels = _check_levels(levels)
    if method not in LINKAGES:
        raise ValueError(f"method must be one of {LINKAGES}, got {method!r}")
    x = np.asarray(points.detach().cpu() if torch.is_tensor(points) else points, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"points must have shape (N, D) with N >= 2, got {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("points contain NaN/Inf")
    if levels[0] > x.shape[0]:
        raise ValueError(f"levels[0] = {levels[0]} clusters requested but only {x.shape[0]} points given")
    if x.shape[0] > max_exact:
        # k-means over-segmentation, then the linkage over the (unweighted) centroids: memory
        # O(N·D + n_fine²) instead of O(N²)
        import faiss

        n_fine = max(levels[0], min(x.shape[0] // 2, max(1024, 4 * levels[0])))
        km = faiss.Kmeans(x.shape[1], n_fine, niter=15, seed=0, verbose=False)
        km.cp.min_points_per_centroid = 1
        xf = np.ascontiguousarray(x, dtype=np.float32)
        km.train(xf)
        assign = km.index.search(xf, 1)[1][:, 0]
        used, assign = np.unique(assign, return_inverse=True)
        if len(used) < levels[0]:
            raise ValueError(f"k-means left {len(used)} non-empty clusters, fewer than levels[0] = {levels[0]}")
        z = linkage(km.centroids[used].astype(np.float64), method=method)
        return _compact(np.stack([fcluster(z, k, criterion="maxclust") for k in levels], 1)[assign.reshape(-1)])
    z = linkage(x, method=method)
    return _compact(np.stack([fcluster(z, k, criterion="maxclust") for k in levels], 1))


def pca_whiten(features: Any, dim: int) -> torch.Tensor:
    """PCA whitening: the centred features on their top principal directions at unit variance.

    Args:
        features: (N, F) array or tensor.
        dim: number of directions kept (capped at the rank of the centred features).

    Returns:
        (N, min(dim, rank)) float64 tensor.

    Raises:
        ValueError: when the centred features have rank 0.
    """
    _, u, _, _, rank = _principal_axes(features)
    keep = min(dim, rank)
    if keep < 1:
        raise ValueError("features have rank 0: nothing to whiten")
    return u[:, :keep] * np.sqrt(max(u.shape[0] - 1, 1))


def merge_small_clusters(labels: Any, points: Any, min_size: int) -> np.ndarray:
    """Merge every finest-level cluster with fewer than ``min_size`` members into the nearest one.

    A small cluster takes the whole label row of the cluster with the nearest centroid among those
    with at least ``min_size`` members, so levels stay nested. Why: a class-balanced sampler draws
    small classes with replacement, and a duplicated sample is a zero distance the log-ratio loss
    cannot take the log of.

    Args:
        labels: (N,) or (N, K) integer labels, finest level first.
        points: (N, D) points the centroids are computed from.
        min_size: smallest allowed cluster (integer ≥ 1).

    Returns:
        (N, K) int64 labels renumbered 0..n_k-1 per column (``labels`` itself, copied, when no
        cluster is small).

    Raises:
        ValueError: bad ``min_size``, row counts that differ, or no cluster with ``min_size`` members.
    """
    labels = np.array(labels.cpu() if torch.is_tensor(labels) else labels, dtype=np.int64, copy=True)
    if labels.ndim == 1:
        labels = labels[:, None]
    if isinstance(min_size, bool) or not isinstance(min_size, (int, np.integer)) or min_size < 1:
        raise ValueError(f"min_size must be an integer >= 1, got {min_size!r}")
    x = np.asarray(points.detach().cpu() if torch.is_tensor(points) else points, dtype=np.float64)
    if x.shape[0] != labels.shape[0]:
        raise ValueError(f"points has {x.shape[0]} rows for {labels.shape[0]} labels")
    fine = np.unique(labels[:, 0], return_inverse=True)[1].reshape(-1)
    counts = np.bincount(fine)
    small = counts < min_size
    if not small.any():
        return labels
    if small.all():
        raise ValueError(f"no cluster has min_size = {min_size} members")
    centroids = np.zeros((len(counts), x.shape[1]))
    np.add.at(centroids, fine, x)
    centroids /= counts[:, None]
    big = np.flatnonzero(~small)
    first = np.zeros(len(counts), np.int64)
    first[fine[::-1]] = np.arange(len(fine))[::-1]  # a member of each cluster
    for c in np.flatnonzero(small):
        target = big[np.argmin(((centroids[big] - centroids[c]) ** 2).sum(1))]
        labels[fine == c] = labels[first[target]]
    return _compact(labels)


class UnsupervisedPseudoLabels:
    """What the unsupervised method clusters, how, and when: ``(features, embeddings) → (N, K)``.

    Ward on embeddings runs in the tangent space at the origin (``logmap0``); on features, in the
    Euclidean space of the unit-normalised features (cosine geometry); exact up to 20,000 points,
    k-means + linkage of the centroids above (:func:`linkage_levels`). Why Ward, the backbone
    features and one level of 512 clusters by default: average linkage chains on these features and
    the head is untrained at step 0 (the design note has the comparison).

    Args:
        levels: clusters per level, finest first. Default ``(512,)`` (one level, chosen on the glyph
            validation split); the paper's K = 4 setting is :data:`PAPER_PSEUDO_LEVELS`.
        c: the embeddings' geometry (a :class:`~pml_hyperbolic.geometry.PoincareGeometry`, by
            reference) or a curvature, given to :func:`~pml_hyperbolic.geometry.as_geometry`.
        linkage: ``"ward"`` (default) or ``"average"`` (the paper's Eq. 3; on embeddings it is
            :class:`~pml_hyperbolic.miners.HierarchicalPseudoLabeler`, the Poincaré distance).
        source: ``"features"`` (default): always the (pre-trained) backbone features, so the labels
            are computed once and reused; ``"features_then_embeddings"`` (the paper: pre-trained
            features for the initialisation, then the learned embeddings at every re-clustering);
            ``"embeddings"``: always the embeddings (at step 0 that clusters a randomly initialised
            head).
        min_cluster_size: finest clusters smaller than this are merged (:func:`merge_small_clusters`;
            1 disables). Default 4 = the class-balanced sampler's samples per class.
        whiten: cluster the backbone features after PCA whitening to this many dimensions (fit on
            the features being clustered; no label used), then L2 normalisation (default 256);
            ``None``: only L2-normalised. Embeddings are never whitened.
        seed: seed of the average-linkage labeler.

    Raises:
        ValueError: bad ``levels``, ``whiten``, ``linkage``, ``source``, ``min_cluster_size`` or ``c``.

    Design note: docs/design/pseudo-labels.md
    """

    def __init__(self, levels: Sequence[int] = DEFAULT_PSEUDO_LEVELS, c: Any = DEFAULT_CURVATURE, linkage: str = "ward",
                 source: str = "features", min_cluster_size: int = 4, whiten: Optional[int] = DEFAULT_WHITEN,
                 seed: int = 0):
        self.levels = _check_levels(levels)
        if whiten is not None and (isinstance(whiten, bool) or not isinstance(whiten, (int, np.integer))
                                   or whiten < 1):
            raise ValueError(f"whiten must be None or an integer >= 1, got {whiten!r}")
        self.whiten = None if whiten is None else int(whiten)
        if linkage not in LINKAGES:
            raise ValueError(f"linkage must be one of {LINKAGES}, got {linkage!r}")
        if source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
        if isinstance(min_cluster_size, bool) or not isinstance(min_cluster_size, (int, np.integer)) \
                or min_cluster_size < 1:
            raise ValueError(f"min_cluster_size must be an integer >= 1, got {min_cluster_size!r}")
        self.geometry = as_geometry(c)  # ValueError / TypeError naming c; a PoincareGeometry by reference
        self.linkage, self.source = linkage, source
        self.min_cluster_size, self.seed = int(min_cluster_size), int(seed)
        self.rounds_ = 0
        self._cached = None

    @property
    def c(self) -> float:
        """The current curvature magnitude of :attr:`geometry` (read at each use)."""
        return float(self.geometry.curvature(torch.float64).detach())

    @classmethod
    def paper(cls, c: Any = DEFAULT_CURVATURE, seed: int = 0, levels: Sequence[int] = PAPER_PSEUDO_LEVELS,
              min_cluster_size: int = 4) -> "UnsupervisedPseudoLabels":
        """Yan et al.'s setting: average linkage, K = 4 levels (100, 70, 40, 10), pre-trained
        features at the start, learned embeddings at every re-clustering.

        ``min_cluster_size`` is not the paper's (it has none); 4 by default because average linkage
        leaves singleton clusters, which a class-balanced sampler repeats within a batch: a
        duplicated sample is a zero Poincaré distance whose gradient is NaN (with 1 the paper's
        setting ends with NaN embeddings on the bundled glyphs).

        Args:
            c: the embeddings' geometry or a curvature (as in the class).
            seed: seed of the average-linkage labeler.
            levels: clusters per level, finest first.
            min_cluster_size: finest clusters smaller than this are merged.

        Returns:
            The policy.
        """
        return cls(levels=levels, c=c, linkage="average", source="features_then_embeddings",
                   min_cluster_size=min_cluster_size, whiten=None, seed=seed)

    def config(self) -> dict:
        """The constructor arguments (without ``c`` and ``seed``)."""
        return {"levels": self.levels, "linkage": self.linkage, "source": self.source,
                "min_cluster_size": self.min_cluster_size, "whiten": self.whiten}

    def levels_for(self, n: int) -> tuple:
        """The cluster counts used for ``n`` samples: each capped at n // min_cluster_size (a
        pseudo-class needs that many members), levels that are then no longer strictly
        decreasing dropped (so a small dataset gets fewer, coarser levels instead of an error)."""
        cap = max(1, int(n) // self.min_cluster_size)
        out = []
        for m in self.levels:
            m = min(m, cap)
            if not out or m < out[-1]:
                out.append(m)
        return tuple(out)

    def uses_embeddings(self) -> bool:
        """Whether the next call clusters the embeddings (so the caller must compute them)."""
        return self.source == "embeddings" or (self.source == "features_then_embeddings" and self.rounds_ > 0)

    def uses_features(self) -> bool:
        """Whether the next call needs the backbone features (False once the labels are cached)."""
        return not self.uses_embeddings() and self._cached is None

    def __call__(self, features: Any = None, embeddings: Any = None) -> torch.Tensor:
        """Cluster and return the pseudo-labels of the next round.

        Args:
            features: (N, F) backbone features; needed when :meth:`uses_features` is True.
            embeddings: (N, D) points of the ball; needed when :meth:`uses_embeddings` is True.

        Returns:
            (N, K) int64 pseudo-labels, finest level first.

        Raises:
            ValueError: when the input this round needs is missing or has the wrong shape.
        """
        if self.uses_embeddings():
            if embeddings is None:
                raise ValueError(f"source={self.source!r}: round {self.rounds_} clusters the embeddings; pass them")
            labels, points = self._cluster_embeddings(embeddings)
        elif self._cached is not None:
            self.rounds_ += 1
            return self._cached.clone()
        else:
            if features is None:
                raise ValueError(f"source={self.source!r}: round {self.rounds_} clusters the backbone features; "
                                 "pass them")
            f = torch.as_tensor(features).detach().cpu().double()
            if f.ndim != 2:
                raise ValueError(f"features must have shape (N, F), got {tuple(f.shape)}")
            points = torch.nn.functional.normalize(pca_whiten(f, self.whiten) if self.whiten else f, dim=1).numpy()
            labels = linkage_levels(points, self.levels_for(len(points)), self.linkage)
        if self.min_cluster_size > 1:
            labels = merge_small_clusters(labels, points, self.min_cluster_size)
        out = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
        if self.source == "features":
            self._cached = out.clone()
        self.rounds_ += 1
        return out

    def _cluster_embeddings(self, embeddings):
        from .. import poincare_ball as pb

        z = torch.as_tensor(embeddings).detach().cpu()
        if z.ndim != 2:
            raise ValueError(f"embeddings must have shape (N, D), got {tuple(z.shape)}")
        tangent = pb.logmap0(pb.project(z.double(), self.c), self.c).numpy()
        levels = self.levels_for(len(tangent))
        if self.linkage == "ward":
            return linkage_levels(tangent, levels, "ward"), tangent
        from ..miners import HierarchicalPseudoLabeler

        labeler = HierarchicalPseudoLabeler(levels=levels, c=self.geometry, seed=self.seed)
        return labeler.fit_predict(z).numpy(), tangent


class PseudoLabelTraining:
    """Recipe mixin: the unsupervised re-clustering loop (Yan et al., CVPR'21), kept in the package.

    The recipe provides ``pseudo_labels()`` (its :class:`UnsupervisedPseudoLabels` policy, built from
    its arguments) and wraps its training set in :class:`PseudoLabelledDataset`; this mixin clusters
    at step 0 and at the start of every epoch, and rebuilds the class-balanced sampler on the new
    finest-level labels. The runner warm-starts the head before the first clustering
    (``--head-init``, :meth:`~.recipe_model.RecipeModelMixin.warm_start_head`; the trunk outputs are
    computed once for both). With ``args.supervised`` it stays out of the way (real labels).

    Design note: docs/design/pseudo-labels.md
    """

    _labels_step = None

    def relabel(self, step: int) -> None:
        """Cluster the training set into the K-level pseudo-labels (once per ``step``).

        Args:
            step: the global step; a second call at the same step does nothing.
        """
        from .runner import compute_embeddings

        if self._labels_step == step:
            return
        policy = self.pseudo_labels()
        emb = feats = None
        if policy.uses_embeddings():
            emb = compute_embeddings(self.trunk, self.head, self.train_eval_set, self.device,
                                     self.args.eval_batch_size)
        if policy.uses_features():
            feats = self.training_features()
        labels = policy(features=feats, embeddings=emb)
        self.train_set.set_labels(labels)
        self._labels_step = step
        sizes = [int(labels[:, k].max()) + 1 for k in range(labels.shape[1])]
        self.say(f"[pseudo-labels] step {step}: clusters per level {sizes}")

    def build_sampler(self, labels: Any, per_rank_batch: int):
        """The class-balanced sampler over the step-0 pseudo-labels (``labels`` when supervised)."""
        if self.args.supervised:
            return super().build_sampler(labels, per_rank_batch)
        self.relabel(0)
        self._per_rank_batch = per_rank_batch
        return super().build_sampler(self.train_set.labels[:, 0], per_rank_batch)

    def trainer_kwargs(self) -> dict:
        """``start_of_epoch_hook``: re-cluster and rebuild the sampler before each epoch."""
        if self.args.supervised:
            return {}

        def start_of_epoch(trainer):
            self.relabel(trainer.global_step)
            sampler = super(PseudoLabelTraining, self).build_sampler(self.train_set.labels[:, 0],
                                                                     self._per_rank_batch)
            sampler.set_epoch(trainer.epoch)
            trainer.sampler = sampler
            trainer.initialize_dataloader()

        return {"start_of_epoch_hook": start_of_epoch}
