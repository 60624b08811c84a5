import math

import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import gromov_delta, relative_delta, suggest_curvature


def naive_delta(D, base=0, rows=None):
    """δ = max_ij (max_k min(G_ik, G_kj) - G_ij), the (max, min) product by broadcasting (in slices
    of ``rows`` rows when given, so that large n fits in memory)."""
    G = 0.5 * (D[base][:, None] + D[base][None, :] - D)
    rows = rows or G.shape[0]
    best = 0.0
    for a in range(0, G.shape[0], rows):
        mm = torch.minimum(G[a:a + rows, :, None], G[None, :, :]).amax(1)
        best = max(best, float((mm - G[a:a + rows]).max()))
    return best


@pytest.mark.parametrize("n", [3, 17, 64, 130])
def test_equals_cubic_reference(n):
    x = torch.randn(n, 5, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    D = torch.cdist(x, x)
    assert gromov_delta(x) == pytest.approx(naive_delta(D), rel=1e-12, abs=1e-12)
    assert gromov_delta(x, base=n // 2) == pytest.approx(naive_delta(D, n // 2), rel=1e-12, abs=1e-12)
    assert gromov_delta(x, dtype=torch.float32) == pytest.approx(naive_delta(D), rel=1e-5)
    assert gromov_delta(distances=D, block_rows=3, block_cols=5) == pytest.approx(naive_delta(D), rel=1e-12)


def test_tree_metric_is_zero():
    g = torch.Generator().manual_seed(0)
    n = 60
    parent = [0] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.1
    depth = torch.zeros(n, dtype=torch.float64)
    anc = [[0] for _ in range(n)]
    for i in range(1, n):
        depth[i] = depth[parent[i]] + w[i]
        anc[i] = anc[parent[i]] + [i]
    D = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in range(n):
            lca = max(set(anc[i]) & set(anc[j]), key=lambda a: depth[a])
            D[i, j] = depth[i] + depth[j] - 2 * depth[lca]
    assert gromov_delta(distances=D) == pytest.approx(0.0, abs=1e-12)
    assert relative_delta(distances=D) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("n", [4, 8, 9, 12, 20])
def test_cycle_graph(n):
    i = torch.arange(n)
    D = torch.minimum((i[:, None] - i[None]).abs(), n - (i[:, None] - i[None]).abs()).double()
    # four-point δ of the cycle C_n: n/4 for n divisible by 4 (opposite quarters), checked below
    # against the O(n^4) four-point brute force for the others
    import itertools

    best = 0.0
    for a, b, c, d in itertools.combinations(range(n), 4):
        s = sorted([D[a, b] + D[c, d], D[a, c] + D[b, d], D[a, d] + D[b, c]])
        best = max(best, float(s[2] - s[1]) / 2)
    assert gromov_delta(distances=D) == pytest.approx(best)
    if n % 4 == 0:
        assert gromov_delta(distances=D) == pytest.approx(n / 4)


def test_hyperbolic_plane_is_more_hyperbolic_than_euclidean_plane():
    g = torch.Generator().manual_seed(1)
    # points spread over a large disk of the hyperbolic plane (c = 1), radius 8
    v = torch.randn(300, 2, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True) * 8 * torch.rand(300, 1, generator=g, dtype=torch.float64).sqrt()
    x = pb.expmap0(v / 2, 1.0)  # dist0 = 2 artanh(tanh(|v|/2)) = |v|
    d_h = gromov_delta(x, metric="poincare", c=1.0)
    # H^2 satisfies the four-point condition with δ <= log(1 + sqrt 2) (+ slack for float error);
    # the same set with Euclidean distances (diameter 16) has a much larger δ
    assert d_h <= math.log(1 + math.sqrt(2)) + 1e-9
    assert d_h == pytest.approx(naive_delta(pb.pairwise_dist(x, x, 1.0).fill_diagonal_(0)), rel=1e-12)
    assert d_h > 0.1  # not a degenerate (tree-like) sample
    assert relative_delta(x, metric="poincare", c=1.0) < 0.5 * relative_delta(v)
    # scaling the metric scales δ
    D = pb.pairwise_dist(x, x, 1.0)
    assert gromov_delta(distances=3 * D) == pytest.approx(3 * gromov_delta(distances=D), rel=1e-10)


def test_sampled_estimate_and_suggest_curvature():
    x = torch.randn(500, 8, generator=torch.Generator().manual_seed(2))
    mean, std = relative_delta(x, n_samples=100, n_draws=4, seed=0, return_std=True)
    assert 0 < mean < 1 and std >= 0
    c = suggest_curvature(x, n_samples=100, n_draws=3)
    d_rel = relative_delta(x, n_samples=100, n_draws=3)
    assert c == pytest.approx(min(10.0, (0.144 / d_rel) ** 2))
    with pytest.warns(UserWarning):
        suggest_curvature(torch.tensor([[0.0], [1.0], [3.0]]), n_samples=100)  # a line: δ = 0


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        gromov_delta(torch.zeros(0, 3))
    with pytest.raises(ValueError, match="NaN"):
        gromov_delta(torch.tensor([[0.0, float("nan")], [1.0, 2.0]]))
    with pytest.raises(ValueError, match="square"):
        gromov_delta(distances=torch.zeros(3, 4))
    with pytest.raises(ValueError, match="exactly one"):
        gromov_delta()
    with pytest.raises(ValueError, match="metric"):
        gromov_delta(torch.zeros(3, 2), metric="manhattan")
    with pytest.raises(ValueError, match="base"):
        gromov_delta(torch.zeros(3, 2), base=5)
    D = torch.cdist(torch.randn(6, 2), torch.randn(6, 2).add(0)).double()
    with pytest.raises(ValueError, match="not symmetric"):
        gromov_delta(distances=D)
    with pytest.raises(ValueError, match="negative"):
        gromov_delta(distances=-torch.ones(3, 3).fill_diagonal_(0))
    x = torch.randn(40, 3)
    assert gromov_delta(distances=torch.cdist(x, x)) >= 0  # float32 cdist rounding is accepted
    with pytest.raises(ValueError, match="n_draws"):
        relative_delta(torch.zeros(3, 2), n_draws=0)


def test_large_set_blocks_and_pruning_equal_the_reference():
    # n = 600 ball points: many (16 x 64) tiles, most of them skipped by the pruning bound; the
    # result must still be the reference's maximum, at every base point tried
    v = torch.randn(600, 16, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = pb.expmap0(v * (2.0 / v.norm(dim=1, keepdim=True)) * torch.rand(600, 1, dtype=torch.float64,
                   generator=torch.Generator().manual_seed(4)), 0.5)
    D = pb.pairwise_dist(x, x, 0.5).fill_diagonal_(0)
    for base in (0, 299):
        want = naive_delta(D, base, rows=25)
        assert gromov_delta(x, metric="poincare", c=0.5, base=base) == pytest.approx(want, rel=1e-12)
        assert gromov_delta(distances=D, base=base, block_rows=7, block_cols=33) == pytest.approx(want, rel=1e-12)


def test_sampled_estimate_is_the_mean_and_spread_of_the_draws():
    # the documented sampling: n_draws seeded random subsets (torch.randperm with one generator),
    # each subset's relative δ at its first point, then mean and standard deviation
    x = torch.randn(300, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    gen = torch.Generator().manual_seed(11)
    values = []
    for _ in range(5):
        sel = torch.randperm(300, generator=gen)[:60]
        D = torch.cdist(x[sel], x[sel])
        values.append(2 * naive_delta(D, 0) / float(D.max()))
    mean, std = relative_delta(x, n_samples=60, n_draws=5, seed=11, return_std=True)
    assert mean == pytest.approx(float(torch.tensor(values, dtype=torch.float64).mean()), rel=1e-12)
    assert std == pytest.approx(float(torch.tensor(values, dtype=torch.float64).std(unbiased=False)), rel=1e-9)
    assert std > 0  # the draws differ
    # as many samples as points: one exact value, no spread
    exact = 2 * naive_delta(torch.cdist(x, x), 0) / float(torch.cdist(x, x).max())
    assert relative_delta(x, n_samples=300, n_draws=4, return_std=True) == pytest.approx((exact, 0.0))


def test_coincident_points_are_an_error_not_a_curvature():
    import pytest
    import torch

    from pml_hyperbolic.evaluation import relative_delta, suggest_curvature

    same = torch.ones(50, 4)
    with pytest.raises(ValueError, match="coincides"):
        relative_delta(same)
    with pytest.raises(ValueError, match="coincides"):
        suggest_curvature(same, n_samples=20, n_draws=2)


def test_tiles_and_threads_do_not_change_delta(monkeypatch):
    """The 16 x 16 default tiles and the load-aware thread count give exactly the value
    of the former 16 x 64 tiles, which was 1.9016457764770043 on this set (float64) and
    1.9016457796096802 (float32) before the change."""
    import pml_hyperbolic.evaluation.delta_hyperbolicity as dh

    x = torch.randn(400, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    want64 = gromov_delta(x, block_rows=16, block_cols=64)
    assert want64 == pytest.approx(1.9016457764770043, rel=1e-12)
    assert gromov_delta(x, dtype=torch.float32) == pytest.approx(1.9016457796096802, rel=1e-9)
    seen = []
    tiles = dh._delta_tiles
    monkeypatch.setattr(dh, "_delta_tiles", lambda *a: seen.append(torch.get_num_threads()) or tiles(*a))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for forced in (1, 2):
            monkeypatch.setattr(dh, "uncontended_threads", lambda forced=forced: forced)
            assert gromov_delta(x) == want64  # bit-identical: every step is an exact min/max
            assert seen[-1] == forced and torch.get_num_threads() == 2
        gromov_delta(x[:300])  # small sets: single-threaded without asking
        assert seen[-1] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="block_rows"):
        gromov_delta(x, block_rows=0)
    with pytest.raises(ValueError, match="block_cols"):
        gromov_delta(x, block_cols=-3)
