"""Hierarchy helpers and HierarchicalPseudoLabeler (exact and approximate paths)."""
import math

import numpy as np
import pytest
import torch
from scipy.cluster.hierarchy import linkage
from scipy.spatial.distance import squareform

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.miners import HierarchicalPseudoLabeler, first_shared_level, pairwise_first_shared_level
from pml_hyperbolic.miners.hierarchy import cut_merges, linkage_to_merges, weighted_average_linkage


# ---------------------------------------------------------------- first_shared_level
def test_first_shared_level_values():
    a = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]])
    b = torch.tensor([[0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    assert first_shared_level(a, b).tolist() == [1, 2, 3, 4]
    assert first_shared_level(a, b).dtype == torch.int64


def test_pairwise_matches_loop():
    g = torch.Generator().manual_seed(0)
    h = torch.randint(0, 3, (9, 3), generator=g)
    r = torch.randint(0, 3, (7, 3), generator=g)
    s = pairwise_first_shared_level(h, r)
    for i in range(9):
        for j in range(7):
            want = next((k + 1 for k in range(3) if h[i, k] == r[j, k]), 4)
            assert s[i, j] == want
    assert pairwise_first_shared_level(torch.tensor([0, 1, 0])).tolist() == [[1, 2, 1], [2, 1, 2], [1, 2, 1]]


def test_shared_level_bad_shapes():
    with pytest.raises(ValueError, match="ref_hier_labels"):
        pairwise_first_shared_level(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="hier_labels"):
        first_shared_level(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="hier_labels"):
        pairwise_first_shared_level(torch.zeros(3, 2))


# ---------------------------------------------------------------- linkage
def test_unit_weight_linkage_equals_scipy():
    rng = np.random.default_rng(0)
    pts = rng.normal(size=(40, 3))
    d = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
    mine = weighted_average_linkage(d)
    ref = linkage_to_merges(linkage(squareform(d, checks=False), method="average"))
    np.testing.assert_allclose(mine[:, 2], ref[:, 2], rtol=1e-12)
    for counts in ([30, 20, 10, 3], [5, 2]):
        a, b = cut_merges(mine, 40, n_clusters=counts), cut_merges(ref, 40, n_clusters=counts)
        np.testing.assert_array_equal(a, b)


def test_weighted_linkage_equals_point_linkage_on_groups():
    """Average linkage over groups weighted by size = linkage over the points when groups merge first."""
    rng = np.random.default_rng(1)
    centers = rng.normal(size=(8, 2)) * 10
    sizes = rng.integers(1, 6, size=8)
    pts = np.concatenate([c + 1e-3 * rng.normal(size=(s, 2)) for c, s in zip(centers, sizes)])
    group = np.repeat(np.arange(8), sizes)
    d = np.sqrt(((pts[:, None] - pts[None]) ** 2).sum(-1))
    point_tree = linkage_to_merges(linkage(squareform(d, checks=False), method="average"))
    gd = np.array([[d[group == a][:, group == b].mean() for b in range(8)] for a in range(8)])
    group_tree = weighted_average_linkage(gd, sizes)
    np.testing.assert_allclose(group_tree[:, 2], point_tree[-7:, 2], rtol=1e-9)
    for counts in ([6, 4, 2], [3]):
        np.testing.assert_array_equal(
            cut_merges(group_tree, 8, n_clusters=counts)[group], cut_merges(point_tree, len(pts), n_clusters=counts)
        )


# ---------------------------------------------------------------- labeler
def hierarchical_blobs(c=0.1, per=12, seed=0, d=8):
    """3 super-groups × 3 groups × `per` points, well separated at two scales, in the ball."""
    g = torch.Generator().manual_seed(seed)
    supers = 6.0 * torch.randn(3, d, generator=g)
    subs = supers[:, None] + 1.5 * torch.randn(3, 3, d, generator=g)
    pts = subs.reshape(9, 1, d) + 0.05 * torch.randn(9, per, d, generator=g)
    v = pts.reshape(-1, d) / 4.0
    truth_fine = torch.arange(9).repeat_interleave(per)
    return pb.expmap0(v, c).double(), truth_fine, truth_fine // 3


def same_partition(a, b):
    a, b = np.asarray(a), np.asarray(b)
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def test_smoke_and_defaults():
    lab = HierarchicalPseudoLabeler()
    assert lab.levels == (100, 70, 40, 10) and lab.c == 0.1
    x, _, _ = hierarchical_blobs(per=12)
    y = HierarchicalPseudoLabeler(levels=(9, 3)).fit_predict(x)
    assert y.shape == (108, 2) and y.dtype == torch.int64


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(levels=()), "levels"),
        (dict(levels=(10, 10)), "levels"),
        (dict(levels=(5, 10)), "levels"),
        (dict(levels=(10, 0)), "levels"),
        (dict(levels=(10.5, 3)), "levels"),
        (dict(distance_thresholds=()), "distance_thresholds"),
        (dict(distance_thresholds=(2.0, 1.0)), "distance_thresholds"),
        (dict(distance_thresholds=(-1.0, 1.0)), "distance_thresholds"),
        (dict(levels=(4, 2), distance_thresholds=(1.0,)), "distance_thresholds"),
        (dict(c=0.0), "c"),
        (dict(c=-1.0), "c"),
        (dict(levels=(100, 10), n_fine_clusters=50), "n_fine_clusters"),
        (dict(samples_per_cluster=0), "samples_per_cluster"),
        (dict(linkage="single"), "linkage"),
        (dict(linkage=None), "linkage"),
    ],
)
def test_bad_args(kwargs, name):
    with pytest.raises(ValueError, match=name):
        HierarchicalPseudoLabeler(**kwargs)


def test_bad_inputs():
    with pytest.raises(ValueError, match="levels"):
        HierarchicalPseudoLabeler(levels=(50, 5)).fit_predict(torch.zeros(10, 3))
    with pytest.raises(ValueError, match="embeddings"):
        HierarchicalPseudoLabeler(levels=(2,)).fit_predict(torch.zeros(10))
    with pytest.raises(ValueError, match="embeddings"):
        HierarchicalPseudoLabeler(levels=(2,)).fit_predict(torch.full((4, 3), float("nan")))


@pytest.mark.parametrize("exact", [True, False])
def test_nested_counts_and_recovers_truth(exact):
    x, fine, coarse = hierarchical_blobs(per=20)
    kwargs = {} if exact else dict(exact_max_samples=0, n_fine_clusters=36)
    lab = HierarchicalPseudoLabeler(levels=(9, 5, 3), **kwargs)
    y = lab.fit_predict(x)
    assert lab.used_exact_ is exact
    assert [len(torch.unique(y[:, k])) for k in range(3)] == [9, 5, 3] and lab.level_sizes_ == (9, 5, 3)
    for k in range(2):  # nested: each cluster at level k lies inside one cluster at level k+1
        assert len(set(zip(y[:, k].tolist(), y[:, k + 1].tolist()))) == len(torch.unique(y[:, k]))
    assert same_partition(y[:, 0], fine) and same_partition(y[:, 2], coarse)
    np.testing.assert_array_equal(lab.fine_to_hierarchy_[y[:, 0]].numpy(), y.numpy())


@pytest.mark.parametrize("linkage_name", ["average"])  # Ward's approximate path: unweighted centroids
def test_exact_and_approximate_agree(linkage_name):
    x, _, _ = hierarchical_blobs(per=25, seed=3)
    exact = HierarchicalPseudoLabeler(levels=(9, 6, 3), linkage=linkage_name).fit_predict(x)
    approx = HierarchicalPseudoLabeler(levels=(9, 6, 3), exact_max_samples=0, n_fine_clusters=40,
                                       linkage=linkage_name).fit_predict(x)
    for k in range(3):
        assert same_partition(exact[:, k], approx[:, k])


def test_exact_matches_scipy_on_explicit_hyperbolic_matrix():
    x, _, _ = hierarchical_blobs(per=5, seed=4)
    c = 0.1
    n = len(x)
    xs = x.tolist()

    def dist(u, v):
        num = 2 * c * sum((a - b) ** 2 for a, b in zip(u, v))
        den = (1 - c * sum(a * a for a in u)) * (1 - c * sum(b * b for b in v))
        return math.acosh(1 + num / den) / math.sqrt(c)

    d = np.array([[dist(xs[i], xs[j]) if i != j else 0.0 for j in range(n)] for i in range(n)])
    ref = cut_merges(linkage_to_merges(linkage(squareform(d, checks=False), method="average")), n, n_clusters=[12, 6, 2])
    got = HierarchicalPseudoLabeler(levels=(12, 6, 2), c=c, linkage="average").fit_predict(x)  # the paper's
    for k in range(3):
        assert same_partition(got[:, k], ref[:, k])


def test_ward_matches_scipy_on_the_tangent_vectors():
    x, _, _ = hierarchical_blobs(per=5, seed=4)
    c = 0.1
    tangent = [[a * math.atanh(math.sqrt(c) * math.sqrt(sum(v * v for v in u))) / (math.sqrt(c) * math.sqrt(
        sum(v * v for v in u))) for a in u] for u in x.tolist()]  # log_0^c(x) = artanh(√c‖x‖) x / (√c‖x‖)
    ref = cut_merges(linkage_to_merges(linkage(np.array(tangent), method="ward")), len(x), n_clusters=[12, 6, 2])
    assert HierarchicalPseudoLabeler().linkage == "average"  # the paper's, the default
    got = HierarchicalPseudoLabeler(levels=(12, 6, 2), c=c, linkage="ward").fit_predict(x)
    for k in range(3):
        assert same_partition(got[:, k], ref[:, k])



@pytest.mark.parametrize("exact", [True, False])
def test_thresholds(exact):
    x, fine, coarse = hierarchical_blobs(per=20, seed=5)
    kwargs = {} if exact else dict(exact_max_samples=0, n_fine_clusters=36)
    probe = HierarchicalPseudoLabeler(levels=(9, 3), **kwargs)
    probe.fit_predict(x)
    h = probe.merge_heights_
    t_fine, t_coarse = (h[-9] + h[-8]) / 2, (h[-3] + h[-2]) / 2  # between the 9→8 / 3→2 gaps
    lab = HierarchicalPseudoLabeler(distance_thresholds=(t_fine, t_coarse), **kwargs)
    y = lab.fit_predict(x)
    assert lab.level_sizes_ == (9, 3)
    assert same_partition(y[:, 0], fine) and same_partition(y[:, 1], coarse)


@pytest.mark.parametrize("exact", [True, False])
def test_no_nan_boundary_origin_duplicates(exact):
    c = 0.1
    g = torch.Generator().manual_seed(0)
    v = torch.randn(30, 6, generator=g)
    on_boundary = v[:10] / v[:10].norm(dim=1, keepdim=True) / math.sqrt(c)
    clipped = pb.expmap0(v[10:20] / v[10:20].norm(dim=1, keepdim=True) * 2.3, c)
    x = torch.cat([on_boundary, clipped, torch.zeros(5, 6), clipped[:5].clone(), clipped[:5].clone()])
    kwargs = {} if exact else dict(exact_max_samples=0, n_fine_clusters=12)
    lab = HierarchicalPseudoLabeler(levels=(8, 4, 2), c=c, **kwargs)
    y = lab.fit_predict(x)
    assert np.isfinite(lab.merge_heights_).all()
    assert lab.level_sizes_ == (8, 4, 2)
    assert bool((y[10:15] == y[25:30]).all()) and bool((y[25:30] == y[30:35]).all())  # duplicates together


def test_half_precision_input():
    x, fine, _ = hierarchical_blobs(per=10, seed=6)
    for dtype in (torch.float16, torch.bfloat16):
        y = HierarchicalPseudoLabeler(levels=(9, 3)).fit_predict(x.to(dtype))
        assert same_partition(y[:, 0], fine)


@pytest.mark.slow
def test_sixty_thousand_points():
    """The issue's scale target (time is reported by bench/miners.py, not asserted)."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(200, 128, generator=g)
    x = centers[torch.randint(0, 200, (60000,), generator=g)] + 0.5 * torch.randn(60000, 128, generator=g)
    x = pb.expmap0(0.3 * x, 0.1)
    lab = HierarchicalPseudoLabeler()
    y = lab.fit_predict(x)
    assert y.shape == (60000, 4) and not lab.used_exact_
    assert lab.level_sizes_ == (100, 70, 40, 10)
    for k in range(3):
        assert len(set(zip(y[:, k].tolist(), y[:, k + 1].tolist()))) == lab.level_sizes_[k]


def test_thread_count_follows_the_load_and_labels_do_not_depend_on_it(monkeypatch):
    """The clustering runs with uncontended_threads() (1 on a busy machine), 1 thread up
    to 1,024 points, and restores the caller's count; the labels are the same either way."""
    import pml_hyperbolic.miners.hierarchical_pseudo_labeler as hpl

    g = torch.Generator().manual_seed(5)
    centers = torch.randn(30, 16, generator=g)
    x = pb.expmap0(0.3 * (centers[torch.randint(0, 30, (3000,), generator=g)]
                          + 0.4 * torch.randn(3000, 16, generator=g)), 0.1)
    seen = []
    approx = hpl.HierarchicalPseudoLabeler._approximate
    monkeypatch.setattr(hpl.HierarchicalPseudoLabeler, "_approximate",
                        lambda self, v: seen.append(torch.get_num_threads()) or approx(self, v))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = []
        for forced in (1, 2):
            monkeypatch.setattr(hpl, "uncontended_threads", lambda forced=forced: forced)
            lab = HierarchicalPseudoLabeler(levels=(20, 10, 4), exact_max_samples=0, n_fine_clusters=120)
            runs.append(lab.fit_predict(x))
            assert seen[-1] == forced and torch.get_num_threads() == 2
        assert torch.equal(runs[0], runs[1])
        HierarchicalPseudoLabeler(levels=(20, 10, 4), exact_max_samples=0).fit_predict(x[:1000])
        assert seen[-1] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
