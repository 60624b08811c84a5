import math
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex, HyperbolicKNN


def brute_force(q, r, k, c, self_exclude):
    """float64 reference: sort by (distance, index); self excluded when asked."""
    D = pb.dist(q.double()[:, None], r.double()[None], c)
    if self_exclude:
        D[torch.arange(len(q)), torch.arange(len(q))] = float("inf")
    idx = np.broadcast_to(np.arange(r.shape[0]), D.shape)
    order = torch.from_numpy(np.lexsort((idx, D.numpy()), axis=1)[:, :k])
    return D.gather(1, order), order


def ball_points(n, d, c, scale, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x = x / x.norm(dim=1, keepdim=True) * torch.rand(n, 1, generator=g) * scale / c ** 0.5
    return pb.project(x, c).float()


@pytest.mark.parametrize("c", [0.1, 1.0, 3.0])
@pytest.mark.parametrize("scale", [0.3, 0.95, 0.9999])
def test_self_retrieval_equals_brute_force(c, scale):
    x = ball_points(400, 12, c, scale, seed=int(c * 10) + int(scale * 100))
    for k in (1, 7, 60):
        d, i = HyperbolicKNN(c=c)(x, k, x, True)
        bd, bi = brute_force(x, x, k, c, True)
        assert d.shape == (400, k) and i.dtype == torch.int64
        assert torch.equal(i, bi)
        torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)
        assert (d[:, 1:] >= d[:, :-1]).all()
        assert not (i == torch.arange(400)[:, None]).any()


def test_ties_broken_by_index():
    x = ball_points(200, 6, 0.5, 0.9, seed=3)
    x[100:120] = x[7]  # 20 exact duplicates of point 7: a tie block at distance 0
    x[150:160] = x[30]
    for k in (3, 15, 25):
        d, i = HyperbolicKNN(c=0.5)(x, k, x, True)
        bd, bi = brute_force(x, x, k, 0.5, True)
        assert torch.equal(i, bi)
        torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-7)
    # small margin forces the certification to widen the candidate list (k' doubling)
    d, i = HyperbolicKNN(c=0.5, margin=0)(x, 25, x, True)
    assert torch.equal(i, brute_force(x, x, 25, 0.5, True)[1])


def test_separate_query_gallery_and_rigorous_mode():
    q = ball_points(150, 10, 0.1, 0.8, seed=5)
    r = ball_points(500, 10, 0.1, 0.8, seed=6)
    for model in ("typical", "rigorous"):
        d, i = HyperbolicKNN(c=0.1, error_model=model, batch_size=64)(q, 30, r, False)
        bd, bi = brute_force(q, r, 30, 0.1, False)
        assert torch.equal(i, bi)
        torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)


def test_index_add_in_parts_and_query_ids():
    r = ball_points(300, 8, 1.0, 0.9, seed=8)
    index = HyperbolicIndex(c=1.0)
    index.add(r[:100]).add(r[100:])
    assert index.ntotal == 300
    d, i = index.search(r[:50], 5, query_ids=torch.arange(50))
    assert torch.equal(i, brute_force(r[:50], r, 5, 1.0, True)[1])


def test_hnsw_option_high_recall():
    x = ball_points(1500, 16, 0.1, 0.9, seed=9)
    index = HyperbolicIndex(c=0.1, kind="hnsw", ef_search=64).add(x)
    _, i = index.search(x[:200], 10, query_ids=torch.arange(200))
    _, bi = brute_force(x[:200], x, 10, 0.1, True)
    recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / 10 for a, b in zip(i, bi)])
    assert recall > 0.9


def test_pml_accuracy_calculator_knn_interface():
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    x = ball_points(120, 4, 0.1, 0.9, seed=1)
    y = torch.arange(120) % 6
    calc = AccuracyCalculator(include=("precision_at_1",), knn_func=HyperbolicKNN(c=0.1),
                              device=torch.device("cpu"))
    acc = calc.get_accuracy(x, y)
    _, bi = brute_force(x, x, 1, 0.1, True)
    assert acc["precision_at_1"] == pytest.approx(float((y[bi[:, 0]] == y).double().mean()))


def test_bad_inputs():
    x = ball_points(10, 4, 1.0, 0.5, seed=0)
    knn = HyperbolicKNN(c=1.0)
    with pytest.raises(ValueError, match="k="):
        knn(x, 10, x, True)  # only 9 others
    with pytest.raises(ValueError, match="k="):
        knn(x, 11, x, False)
    with pytest.raises(ValueError, match="k must"):
        knn(x, 0, x, False)
    with pytest.raises(ValueError, match="dimension"):
        knn(x, 2, torch.zeros(5, 3), False)
    with pytest.raises(ValueError, match="non-empty"):
        knn(x[:0], 1, x, False)
    with pytest.raises(ValueError, match="empty"):
        HyperbolicIndex(c=1.0).add(torch.zeros(0, 4))
    with pytest.raises(ValueError, match="index is empty"):
        HyperbolicIndex(c=1.0).search(x, 1)
    bad = x.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        knn(bad, 1, x, False)
    with pytest.raises(ValueError, match="c"):
        HyperbolicKNN(c=-1.0)
    with pytest.raises(ValueError, match="kind"):
        HyperbolicIndex(kind="ivf")


@pytest.mark.parametrize("model", ["typical", "rigorous"])
def test_float64_inputs_take_the_float64_paths(model):
    # float64 points are not float32 numbers: no float32 distance shortcut may be used
    q = ball_points(120, 9, 0.3, 0.99, seed=11).double() * (1 - 1e-9)
    r = ball_points(400, 9, 0.3, 0.99, seed=12).double() * (1 - 1e-9)
    d, i = HyperbolicIndex(c=0.3, error_model=model).add(r).search(q, 20)
    bd, bi = brute_force(q, r, 20, 0.3, False)
    assert torch.equal(i, bi)
    torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)


def test_post_threads_restores_thread_counts_and_validates():
    import faiss

    x = ball_points(300, 8, 0.1, 0.9, seed=13)
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    results = [HyperbolicKNN(c=0.1, post_threads=threads)(x, 5, x, True) for threads in (1, None, "auto", 2)]
    assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == before
    for d, i in results[1:]:  # the thread count of the work around faiss does not change the result
        assert torch.equal(d, results[0][0]) and torch.equal(i, results[0][1])
    for bad in (0, -1, "two", 1.5, True):
        with pytest.raises(ValueError, match="post_threads"):
            HyperbolicIndex(c=0.1, post_threads=bad)


def test_self_query_cache_sees_in_place_edits():
    x = ball_points(200, 6, 0.5, 0.9, seed=14)
    index = HyperbolicIndex(c=0.5).add(x)
    d0, i0 = index.search(x, 4, query_ids=torch.arange(200))
    assert torch.equal(i0, brute_force(x, x, 4, 0.5, True)[1])
    y = x.clone()
    x.mul_(0.5)  # the index holds the old points; the query is now different
    d1, i1 = index.search(x, 4)
    assert torch.equal(i1, brute_force(x, y, 4, 0.5, False)[1])



def assert_matches_brute_force(d, i, bd, bi, ranks, k):
    """Neighbours equal to the float64 brute force: the whole order without ``exact_ranks``, the
    neighbour sets at every listed rank and at k with it; distances position-wise within 1e-5."""
    if ranks is None:
        assert torch.equal(i, bi)
    else:
        for K in ranks + (k,):
            assert torch.equal(i[:, :K].sort(dim=1).values, bi[:, :K].sort(dim=1).values), K
    torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)

@pytest.mark.parametrize("scale", [0.95, 0.9999])
def test_exact_ranks_keeps_sets_exact_at_the_listed_ranks(scale):
    # high-dimensional random points: the top-k distances are crowded, many near-ties
    x = ball_points(1500, 64, 0.1, scale, seed=21)
    x[700:705] = x[3]  # exact duplicates: a tie block that must still go by index
    ranks = (1, 2, 4, 8, 50)
    k = 100
    d, i = HyperbolicKNN(c=0.1, exact_ranks=ranks)(x, k, x, True)
    bd, bi = brute_force(x, x, k, 0.1, True)
    assert_matches_brute_force(d, i, bd, bi, ranks, k)  # sets at the listed ranks, distances position-wise
    assert torch.equal(i[:, 0], bi[:, 0])  # rank 1 listed: the nearest neighbour itself is exact
    assert (d[:, 1:] >= d[:, :-1]).all()


def test_exact_ranks_bad_values():
    with pytest.raises(ValueError, match="exact_ranks"):
        HyperbolicIndex(exact_ranks=(0, 3))
    with pytest.raises(ValueError, match="exact_ranks"):
        HyperbolicIndex(exact_ranks=())


def test_collapsed_embeddings_stay_bounded_and_exact(monkeypatch):
    # a collapsed model: thousands of identical points (ties go by index) must not grow the
    # candidate list towards N; rows fall back to the chunked exact scan
    from pml_hyperbolic.evaluation import hyperbolic_index as hi

    asked, scanned = [], []
    search, scan = hi.HyperbolicIndex._faiss_search, hi.HyperbolicIndex._exact_scan
    monkeypatch.setattr(hi.HyperbolicIndex, "_faiss_search",
                        lambda self, Q, kk: asked.append(kk) or search(self, Q, kk))
    monkeypatch.setattr(hi.HyperbolicIndex, "_exact_scan",
                        lambda self, q, k, ids: scanned.append(len(q)) or scan(self, q, k, ids))
    x = torch.zeros(3000, 16)
    x[:, 0] = 0.5
    x[2500:] = ball_points(500, 16, 0.1, 0.9, seed=2)
    d, i = HyperbolicKNN(c=0.1)(x, 4, x, True)
    bd, bi = brute_force(x, x, 4, 0.1, True)
    assert torch.equal(i, bi)
    torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-7)
    # the guarded bug doubled k' up to N = 3000 (minutes, GBs): k' stays at the cap, the 2500
    # collapsed rows go to the exact scan
    assert max(asked) <= 256 and sum(scanned) >= 2500


def test_exact_ties_split_across_the_general_loop():
    # regression: 28 identical points straddling rank k in a row that the fast path cannot
    # certify; the general loop sorted them by cosh(d), and torch's vectorised and scalar
    # float64 cosh differ in the last bit, so equal distances were ordered 26, 457, 0, 1, ...
    x = ball_points(571, 2, 0.1, 0.3, seed=3)
    x[:27] = x[457]
    d, i = HyperbolicKNN(c=0.1, batch_size=104)(x, 495, x, True)
    bd, bi = brute_force(x, x, 495, 0.1, True)
    assert torch.equal(i, bi)
    torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("ranks", [None, (1, 50)])
def test_long_tie_block_across_a_rank_boundary(ranks):
    # 300 identical points: their cluster is far longer than the first window around rank 50
    x = ball_points(900, 8, 1.0, 0.9, seed=4)
    x[200:500] = x[10]
    k = 120
    d, i = HyperbolicKNN(c=1.0, exact_ranks=ranks)(x, k, x, True)
    bd, bi = brute_force(x, x, k, 1.0, True)
    if ranks is None:
        assert torch.equal(i, bi)
    for K in (ranks or ()) + (k,):
        assert torch.equal(i[:, :K].sort(dim=1).values, bi[:, :K].sort(dim=1).values), K
    torch.testing.assert_close(d.double(), bd, rtol=1e-5, atol=1e-6)
    assert (d[:, 1:] >= d[:, :-1]).all()


def test_exact_pairs_in_chunks_match_the_ball_distance():
    # more pairs than one chunk (2^15): the chunked loop must cover all of them
    x = ball_points(300, 6, 0.5, 0.99, seed=5)
    index = HyperbolicIndex(c=0.5).add(x)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 40, (70_000,), generator=g)
    cols = torch.randint(0, 300, (70_000,), generator=g)
    q = index._ball[:40]
    got = index._exact_pairs(q, rows, cols)
    want = pb.dist(q[rows], index._ball[cols], 0.5)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(20, 400), dim=st.sampled_from([2, 5, 16, 48]),
       c=st.sampled_from([0.1, 1.0, 2.0]), scale=st.sampled_from([0.3, 0.9, 0.999, 0.99999]),
       dup=st.integers(0, 60), kfrac=st.floats(0.0, 0.95), batch=st.integers(5, 300),
       use_ranks=st.booleans(), seed=st.integers(0, 10_000))
def test_property_equals_brute_force(n, dim, c, scale, dup, kfrac, batch, use_ranks, seed):
    # identical points (a tie block, ties by index) of random size, random k and batch size,
    # both modes: full order = the brute-force list; exact_ranks = the brute-force sets at K
    x = ball_points(n, dim, c, scale, seed=seed)
    dup = min(dup, n // 2)
    if dup > 1:
        x[:dup] = x[n - 1]
    k = max(1, min(n - 2, int(kfrac * n)))
    ranks = tuple(sorted({1, max(1, k // 3), max(1, k // 2)})) if use_ranks else None
    d, i = HyperbolicKNN(c=c, exact_ranks=ranks, batch_size=batch)(x, k, x, True)
    bd, bi = brute_force(x, x, k, c, True)
    assert_matches_brute_force(d, i, bd, bi, ranks, k)
    assert (d[:, 1:] >= d[:, :-1]).all()


def test_flat_index_goes_to_gpu_when_faiss_has_one(monkeypatch):
    import faiss

    moved = []
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", lambda index: moved.append(index) or index,
                        raising=False)
    x = ball_points(50, 4, 0.1, 0.8, seed=0)
    HyperbolicIndex(c=0.1).add(x)
    assert len(moved) == 1
    HyperbolicIndex(c=0.1, use_gpu=False).add(x)
    HyperbolicIndex(c=0.1, kind="hnsw").add(x)
    HyperbolicIndex(c=0.1, kind="hnsw", use_gpu=True).add(x)  # no GPU HNSW in faiss: stays on CPU
    assert len(moved) == 1
    HyperbolicIndex(c=0.1, use_gpu=True).add(x)
    assert len(moved) == 2


# --- inputs are projected with the margin of their own dtype, as PoincareDistance does -------


def _poincare_distance_brute_force(q, r, k, c):
    """float64 reference through PoincareDistance (projection with the input dtype's margin)."""
    from pml_hyperbolic.distances import PoincareDistance

    D = PoincareDistance(c=c)(q, r)
    idx = np.broadcast_to(np.arange(r.shape[0]), D.shape)
    order = torch.from_numpy(np.lexsort((idx, D.numpy()), axis=1)[:, :k])
    return D.gather(1, order), order


def test_near_boundary_float64_ranks_like_poincare_distance():
    # query at radius 1 - 1e-5; reference 0 on the same ray at 1 - 1e-7, reference 1 at the
    # query's radius, slightly rotated. The float32 margin (1e-5) used to move reference 0 onto
    # the query (distance 0.0, ranked first); PoincareDistance gives [4.605, 0.1997].
    from pml_hyperbolic.distances import PoincareDistance

    r, theta = 1 - 1e-5, 2e-6
    q = torch.tensor([[r, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[1 - 1e-7, 0.0], [r * np.cos(theta), r * np.sin(theta)]], dtype=torch.float64)
    want = PoincareDistance(c=1.0)(q, ref)[0]
    assert want[0] > 4.6 and 0.19 < want[1] < 0.21
    for knn_out in (HyperbolicKNN(c=1.0)(q, 2, ref, False),
                    HyperbolicIndex(c=1.0).add(ref).search(q, 2)):
        d, i = knn_out
        assert i.tolist() == [[1, 0]]
        torch.testing.assert_close(d[0], want[[1, 0]], rtol=1e-5, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_output_dtype_follows_the_input(dtype):
    x = ball_points(60, 5, 0.5, 0.9, seed=7).to(dtype)
    for d, _ in (HyperbolicKNN(c=0.5)(x, 3, x, True),
                 HyperbolicKNN(c=0.5, exact_ranks=(1, 2))(x, 3, x, True),
                 HyperbolicKNN(c=0.5, kind="hnsw")(x, 3, x, True),
                 HyperbolicIndex(c=0.5).add(x).search(x[:7], 3)):
        assert d.dtype == dtype
    d, _ = HyperbolicIndex(c=0.5).add(x.float()).search(x[:7].double(), 3)
    assert d.dtype == torch.float64  # mixed: the wider dtype


@settings(max_examples=30, deadline=None)
@given(n=st.integers(5, 120), dim=st.sampled_from([2, 3, 8]), c=st.sampled_from([0.1, 1.0, 2.0]),
       lo=st.floats(2.0, 6.0), spread=st.floats(0.0, 4.0), kfrac=st.floats(0.0, 0.9),
       use_ranks=st.booleans(), seed=st.integers(0, 10_000))
def test_property_near_boundary_float64_equals_poincare_distance(n, dim, c, lo, spread, kfrac,
                                                                  use_ranks, seed):
    # float64 points at sqrt(c)|x| = 1 - 10^-u, u in [lo, lo + spread] (up to 1 - 1e-10), in a
    # few narrow cones so that close neighbours exist near the boundary
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, dim, generator=g, dtype=torch.float64)
    v = centres[torch.randint(0, 3, (n,), generator=g)] + 1e-3 * torch.randn(n, dim, generator=g,
                                                                              dtype=torch.float64)
    u = lo + spread * torch.rand(n, 1, generator=g, dtype=torch.float64)
    x = v / v.norm(dim=1, keepdim=True) * (1 - 10.0 ** -u) / c ** 0.5
    k = max(1, min(n - 1, int(kfrac * n)))
    ranks = tuple(sorted({1, max(1, k // 2)})) if use_ranks else None
    d, i = HyperbolicKNN(c=c, exact_ranks=ranks)(x, k, x, False)
    bd, bi = _poincare_distance_brute_force(x, x, k, c)
    assert_matches_brute_force(d, i, bd, bi, ranks, k)
    assert d.dtype == torch.float64


def test_faiss_threads_follow_the_load_and_results_do_not_depend_on_them(monkeypatch):
    """faiss gets the caller's count on an idle machine and 1 thread when the cores are
    taken (uncontended_threads); the neighbours and distances are the same either way."""
    import faiss

    import pml_hyperbolic.evaluation.hyperbolic_index as hi
    import pml_hyperbolic.search.faiss_batches as batches

    x = ball_points(2000, 16, 0.1, 0.9, seed=21)
    seen = []
    search = hi.HyperbolicIndex._faiss_search

    def spy(self, Q32, kk):
        out = search(self, Q32, kk)
        seen.append(self._faiss_threads)
        return out

    monkeypatch.setattr(hi.HyperbolicIndex, "_faiss_search", spy)
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    try:
        results = []
        for forced in (1, 2):
            monkeypatch.setattr(batches, "uncontended_threads", lambda requested, forced=forced: min(requested, forced))
            results.append(HyperbolicKNN(c=0.1, exact_ranks=(1, 4))(x, 8, x, True))
            assert seen[-1] == forced
            assert (torch.get_num_threads(), faiss.omp_get_max_threads()) == (2, 2)
        assert torch.equal(results[0][1], results[1][1])
        assert torch.equal(results[0][0], results[1][0])
        bd, bi = brute_force(x[:200], x, 8, 0.1, True)  # a prefix of the queries: small memory
        assert torch.equal(results[0][1][:200], bi)
    finally:
        torch.set_num_threads(before[0])
        faiss.omp_set_num_threads(before[1])


def test_self_retrieval_reuses_the_lift_and_equals_a_fresh_query():
    """Searching the added tensor itself (the lift add() kept, divided in place) gives what a copy of
    it gives as an ordinary query, bit for bit; a second self search (lift consumed) too."""
    x = ball_points(700, 12, 0.3, 0.95, seed=21)
    index = HyperbolicIndex(c=0.3).add(x)
    assert index._pending_self_lift is not None
    first = index.search(x, 6, query_ids=torch.arange(700))
    assert index._pending_self_lift is None and index._query_cache is None
    again = index.search(x, 6, query_ids=torch.arange(700))
    copy = HyperbolicIndex(c=0.3).add(x).search(x.clone(), 6, query_ids=torch.arange(700))
    for got in (again, copy):
        assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
    assert torch.equal(first[1], brute_force(x, x, 6, 0.3, True)[1])


def test_max_lifted_norm_equals_the_full_maximum():
    """The error bound's max_j |Y_j| from the few rows that can hold it equals the maximum over every
    float32 lifted row, bit for bit: random radii, near the boundary, and many rows of one exact norm
    (different directions round differently)."""
    from pml_hyperbolic.evaluation import hyperbolic_index as H

    g = torch.Generator().manual_seed(5)
    for c, radius_scale in ((0.1, 0.5), (1.0, 0.999), (0.3, 0.9)):
        v = torch.randn(3000, 24, generator=g, dtype=torch.float64)
        same_norm = v[:1000] / v[:1000].norm(dim=1, keepdim=True)  # 1,000 rows of one norm
        v = torch.cat([same_norm, v[1000:] / v[1000:].norm(dim=1, keepdim=True) * torch.rand(2000, 1, generator=g)])
        x = (v * radius_scale / math.sqrt(c)).float().double()
        cx2, den = H._conformal_terms(x, c)
        Y32, y0, _ = H._lift32(x, cx2, den, c)
        full = torch.linalg.vector_norm(Y32.double(), dim=1).max()
        assert torch.equal(H._max_lifted_norm(Y32, y0, cx2, den, c), full.reshape(1))


_BAD_INDEX_ARGUMENTS = [
    (dict(kind="hnsw", hnsw_m=0), "hnsw_m"),  # faiss aborted the process
    (dict(kind="hnsw", hnsw_m=1), "hnsw_m"),  # faiss segfaulted
    (dict(kind="hnsw", hnsw_m=-1), "hnsw_m"),  # faiss never returned
    (dict(kind="hnsw", hnsw_m=10 ** 6), "hnsw_m"),
    (dict(hnsw_m=2.5), "hnsw_m"),
    (dict(ef_search=-1), "ef_search"),  # was accepted silently
    (dict(ef_search=0), "ef_search"),
    (dict(ef_search="128"), "ef_search"),
    (dict(ef_construction=0), "ef_construction"),
    (dict(rtol="a"), "rtol"),
    (dict(rtol=float("nan")), "rtol"),
    (dict(batch_size="a"), "batch_size"),
    (dict(batch_size=0), "batch_size"),
    (dict(margin=-1), "margin"),
    (dict(margin=1.5), "margin"),
    (dict(use_gpu="yes"), "use_gpu"),
    (dict(project=None), "project"),
    (dict(exact_ranks=["a"]), "exact_ranks"),
    (dict(exact_ranks=[0]), "exact_ranks"),
    (dict(c="x"), r"\bc\b"),
    (dict(c=0.0), r"\bc\b"),
    (dict(c=float("inf")), r"\bc\b"),
    (dict(kind=3), "kind"),
    (dict(error_model=[1]), "error_model"),
    (dict(post_threads=0), "post_threads"),
]


@pytest.mark.parametrize("kwargs, name", _BAD_INDEX_ARGUMENTS)
@pytest.mark.parametrize("cls", [HyperbolicIndex, HyperbolicKNN])
def test_every_constructor_argument_is_checked_by_name(cls, kwargs, name):
    kwargs = {"c": 0.1, **kwargs}
    if name in ("hnsw_m",) and kwargs.get("hnsw_m") in (0, 1, -1):
        # faiss crashed or hung on these: checked in a child process so that a regression fails the
        # test instead of killing the test run
        import subprocess
        import sys

        code = (f"from pml_hyperbolic.evaluation import {cls.__name__}\n"
                f"try:\n    {cls.__name__}(**{kwargs!r})\nexcept ValueError as e:\n    print('ValueError:', e)\n")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.startswith("ValueError: hnsw_m must be"), done
        return
    with pytest.raises(ValueError, match=name):
        cls(**kwargs)


def test_hnsw_parameters_reach_faiss():
    x = ball_points(300, 8, 0.1, 0.9, 3)
    index = HyperbolicIndex(c=0.1, kind="hnsw", hnsw_m=2, ef_search=7, ef_construction=11)
    index.add(x)
    assert index._index.hnsw.efConstruction == 11
    d, i = index.search(x[:20], 5)
    assert index._index.hnsw.efSearch >= 7
    ref_d, _ = brute_force(x[:20], x, 5, 0.1, False)
    assert torch.isfinite(d).all() and (d.double() >= ref_d - 1e-4).all()  # exact distances of real points
