"""Pseudo-label policy of the unsupervised recipe (pml_hyperbolic.training.pseudo_labels)."""
import numpy as np
import pytest
import torch

from pml_hyperbolic.training.pseudo_labels import (
    DEFAULT_PSEUDO_LEVELS, PAPER_PSEUDO_LEVELS, UnsupervisedPseudoLabels, linkage_levels, merge_small_clusters,
    pca_whiten)


def _blobs(n_per=6, centers=((0, 0), (10, 0), (10.5, 0.5), (40, 0)), spread=0.1, seed=0):
    rng = np.random.default_rng(seed)
    pts = np.concatenate([np.asarray(c, float) + spread * rng.standard_normal((n_per, 2)) for c in centers])
    return pts, np.repeat(np.arange(len(centers)), n_per)


def _same_partition(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return all(len(np.unique(b[a == v])) == 1 for v in np.unique(a)) and len(np.unique(a)) == len(np.unique(b))


def _nested(labels):
    labels = np.asarray(labels)
    return all(len(np.unique(labels[labels[:, k] == v, k + 1])) == 1
               for k in range(labels.shape[1] - 1) for v in np.unique(labels[:, k]))


@pytest.mark.parametrize("method", ["ward", "average"])
def test_linkage_levels_reference_partition(method):
    pts, blob = _blobs()
    out = linkage_levels(pts, (4, 3, 2), method=method)
    assert out.shape == (len(pts), 3) and out.dtype == np.int64
    assert _same_partition(out[:, 0], blob)                               # the 4 blobs
    assert _same_partition(out[:, 1], np.array([0, 1, 1, 2])[blob])       # the two close blobs merge first
    assert _same_partition(out[:, 2], np.array([0, 0, 0, 1])[blob])       # then the far one stays apart
    assert _nested(out)
    assert [int(out[:, k].max()) + 1 for k in range(3)] == [4, 3, 2]


def test_linkage_levels_bad_arguments():
    pts, _ = _blobs()
    for levels in ((), (3, 4), (0,), "4", (2.5,), (True,)):
        with pytest.raises(ValueError, match="levels"):
            linkage_levels(pts, levels)
    with pytest.raises(ValueError, match="method"):
        linkage_levels(pts, (2,), method="single")
    with pytest.raises(ValueError, match="only 24 points"):
        linkage_levels(pts, (25,))
    bad = pts.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        linkage_levels(bad, (2,))
    with pytest.raises(ValueError, match="shape"):
        linkage_levels(pts[:1], (1,))


def test_merge_small_clusters_reference():
    pts = np.array([[0.0], [0.1], [0.2], [5.0], [5.1], [5.2], [4.0], [9.0]])
    labels = np.array([[0, 0], [0, 0], [0, 0], [1, 1], [1, 1], [1, 1], [2, 1], [3, 2]])
    out = merge_small_clusters(labels, pts, 2)
    # the singleton at 4.0 joins the cluster at ~5.1; the one at 9.0 too (nearest big centroid);
    # whole rows are copied, so the coarse level follows and the ids are renumbered
    assert out.tolist() == [[0, 0], [0, 0], [0, 0], [1, 1], [1, 1], [1, 1], [1, 1], [1, 1]]
    assert merge_small_clusters(labels, pts, 1).tolist() == labels.tolist()  # nothing to merge
    assert merge_small_clusters(labels[:, 0], pts, 1).shape == (8, 1)       # 1-D labels accepted
    assert labels.tolist()[6] == [2, 1]                                      # input not modified
    with pytest.raises(ValueError, match="min_size"):
        merge_small_clusters(labels, pts, 0)
    with pytest.raises(ValueError, match="no cluster"):
        merge_small_clusters(labels, pts, 5)
    with pytest.raises(ValueError, match="rows"):
        merge_small_clusters(labels, pts[:-1], 2)


def test_pca_whiten_unit_covariance():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 6, generator=g, dtype=torch.float64) @ torch.randn(6, 6, generator=g, dtype=torch.float64)
    w = pca_whiten(x, 4)
    assert w.shape == (200, 4)
    cov = (w - w.mean(0)).T @ (w - w.mean(0)) / 199
    torch.testing.assert_close(cov, torch.eye(4, dtype=torch.float64), atol=1e-8, rtol=0)
    assert pca_whiten(x[:, :2].repeat(1, 3), 6).shape == (200, 2)  # capped at the rank
    with pytest.raises(ValueError, match="rank 0"):
        pca_whiten(torch.ones(5, 3), 2)


def test_policy_features_are_clustered_once_and_cached():
    pts, blob = _blobs()
    # features are compared by direction (L2-normalised): put the blobs on a circle
    feats = torch.as_tensor(np.c_[np.cos(pts[:, 0] / 20), np.sin(pts[:, 0] / 20), pts[:, 1] / 20])
    policy = UnsupervisedPseudoLabels(levels=(4, 2), source="features", min_cluster_size=1, whiten=None)
    assert policy.uses_features() and not policy.uses_embeddings()
    first = policy(features=feats)
    assert first.dtype == torch.int64 and first.shape == (len(pts), 2) and _nested(first.numpy())
    assert not policy.uses_features() and not policy.uses_embeddings()
    again = policy()  # cached: nothing to pass
    assert torch.equal(first, again) and policy.rounds_ == 2
    again[0, 0] = 99  # a copy: the cache is not modified through it
    assert torch.equal(first, policy())


def test_policy_sources_and_paper_setting():
    pts, blob = _blobs()
    z = torch.as_tensor(pts / 100.0, dtype=torch.float32)  # inside the ball of c = 0.1 (radius 3.16)
    feats = torch.as_tensor(np.c_[pts, np.ones(len(pts))])
    paper = UnsupervisedPseudoLabels.paper(levels=(4, 2), min_cluster_size=4)
    assert paper.config() == {"levels": (4, 2), "linkage": "average", "source": "features_then_embeddings",
                              "min_cluster_size": 4, "whiten": None}
    assert UnsupervisedPseudoLabels.paper().levels == PAPER_PSEUDO_LEVELS == (100, 70, 40, 10)
    default = UnsupervisedPseudoLabels()
    assert default.levels == DEFAULT_PSEUDO_LEVELS == (512,)  # chosen on validation (0.1.0 used (128,))
    assert default.config() == {"levels": (512,), "linkage": "ward", "source": "features", "min_cluster_size": 4,
                                "whiten": 256}
    assert paper.uses_features() and not paper.uses_embeddings()
    paper(features=feats)
    assert paper.uses_embeddings() and not paper.uses_features()
    with pytest.raises(ValueError, match="pass them"):
        paper(features=feats)
    out = paper(embeddings=z)  # HierarchicalPseudoLabeler: Poincaré average linkage
    assert _same_partition(out[:, 0].numpy(), blob) and _nested(out.numpy())
    emb = UnsupervisedPseudoLabels(levels=(4,), source="embeddings", min_cluster_size=1, whiten=None)
    assert emb.uses_embeddings()
    assert _same_partition(emb(embeddings=z)[:, 0].numpy(), blob)  # ward in the tangent space
    with pytest.raises(ValueError, match="pass them"):
        UnsupervisedPseudoLabels(levels=(4,))(embeddings=z)
    white = UnsupervisedPseudoLabels(levels=(4,), whiten=2, min_cluster_size=1)
    assert white(features=feats).shape == (len(pts), 1)


def test_policy_min_cluster_size_merges_outliers():
    pts, _ = _blobs(n_per=5, centers=((0, 0), (10, 0), (20, 0)))
    pts = np.r_[pts, [[50.0, 0.0]]]  # an outlier: its own cluster at 4 levels
    feats = torch.as_tensor(np.c_[pts / 60, np.ones(len(pts))])
    plain = UnsupervisedPseudoLabels(levels=(4,), min_cluster_size=1, whiten=None)(features=feats)
    assert np.bincount(plain[:, 0].numpy()).min() == 1
    merged = UnsupervisedPseudoLabels(levels=(4,), min_cluster_size=4, whiten=None)(features=feats)
    assert np.bincount(merged[:, 0].numpy()).min() >= 4 and int(merged.max()) + 1 == 3


@pytest.mark.parametrize("kwargs, match", [
    ({"levels": (2, 4)}, "levels"), ({"levels": ()}, "levels"), ({"linkage": "single"}, "linkage"),
    ({"source": "labels"}, "source"), ({"min_cluster_size": 0}, "min_cluster_size"),
    ({"min_cluster_size": True}, "min_cluster_size"), ({"whiten": 0}, "whiten"), ({"whiten": 2.0}, "whiten"),
    ({"c": -1.0}, "c"),
])
def test_policy_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        UnsupervisedPseudoLabels(**kwargs)


def test_linkage_levels_approximate_path_matches_separated_blobs():
    pts, blob = _blobs(n_per=30)
    out = linkage_levels(pts, (4, 2), method="ward", max_exact=50)  # 120 points > 50: k-means + centroids
    assert _same_partition(out[:, 0], blob) and _same_partition(out[:, 1], np.array([0, 0, 0, 1])[blob])
    assert _nested(out)


def test_policy_levels_capped_for_small_datasets():
    assert UnsupervisedPseudoLabels(levels=(128,)).levels_for(116) == (29,)        # 116 // 4
    assert UnsupervisedPseudoLabels(levels=(100, 70, 40, 10)).levels_for(200) == (50, 40, 10)
    assert UnsupervisedPseudoLabels(levels=(100, 70), min_cluster_size=1).levels_for(1000) == (100, 70)
    pts, blob = _blobs(n_per=3)  # 12 points, 4 per cluster at most 3 clusters
    out = UnsupervisedPseudoLabels(levels=(8, 2), whiten=None)(features=np.c_[pts, np.ones(len(pts))])
    assert out.shape == (12, 2) and int(out[:, 0].max()) + 1 <= 3 and np.bincount(out[:, 0].numpy()).min() >= 4


# ------------------------------------------------------------------ warm start of the head (whitening)


def _correlated_features(n=300, f=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, f, generator=g, dtype=torch.float64) @ torch.randn(f, f, generator=g, dtype=torch.float64)
    return (x + 5.0).float()  # a large common offset, like pooled ReLU features


def test_whitening_head_init_reference():
    from pml_hyperbolic.training.pseudo_labels import whitening_head_init

    x = _correlated_features()
    linear = torch.nn.Linear(12, 5)
    weight_before = linear.weight
    assert whitening_head_init(linear, x, scale=2.0) == 5
    assert linear.weight is weight_before                       # in place: optimisers keep their parameters
    with torch.no_grad():
        y = linear(x).double()
    assert torch.allclose(y.mean(0), torch.zeros(5, dtype=torch.float64), atol=1e-4)   # centred
    cov = (y.T @ y) / (len(y) - 1)
    assert torch.allclose(cov, cov[0, 0] * torch.eye(5, dtype=torch.float64), atol=1e-3 * float(cov[0, 0]))
    assert float(linear.weight.detach().norm()) == pytest.approx(2.0 * np.sqrt(5), rel=1e-5)     # scale × √min(D, F)
    # the same directions as pca_whiten, up to the overall scale (and each axis' sign)
    w = pca_whiten(x, 5)
    ratio = (y * w).sum(0) / (w * w).sum(0)
    assert torch.allclose(ratio.abs(), ratio.abs()[0].expand(5), rtol=1e-3)


def test_whitening_head_init_more_rows_than_rank():
    from pml_hyperbolic.training.pseudo_labels import whitening_head_init

    x = _correlated_features(n=40, f=3)
    linear = torch.nn.Linear(3, 8)
    assert whitening_head_init(linear, x) == 3
    assert torch.count_nonzero(linear.weight[3:]) == 0 and torch.count_nonzero(linear.bias[3:]) == 0
    # the default scale, 1 × the orthogonal init's norm √min(D, F) = √3
    assert float(linear.weight.detach().norm()) == pytest.approx(np.sqrt(3), rel=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(linear=torch.nn.Conv1d(12, 4, 1)), "Linear"),
    (dict(linear=torch.nn.Linear(12, 4, bias=False)), "bias"),
    (dict(scale=0.0), "scale"), (dict(scale=-1.0), "scale"), (dict(scale=float("inf")), "scale"),
    (dict(scale=True), "scale"), (dict(scale="3"), "scale"),
    (dict(features=torch.zeros(10, 7)), "shape"), (dict(features=torch.zeros(1, 12)), "shape"),
    (dict(features=torch.full((10, 12), float("nan"))), "NaN"),
    (dict(features=torch.ones(10, 12)), "rank 0"),
])
def test_whitening_head_init_bad_arguments(kwargs, match):
    from pml_hyperbolic.training.pseudo_labels import whitening_head_init

    args = dict(linear=torch.nn.Linear(12, 4), features=_correlated_features(), scale=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        whitening_head_init(args["linear"], args["features"], scale=args["scale"])
