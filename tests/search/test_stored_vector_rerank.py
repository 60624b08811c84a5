"""HyperbolicIndex(keep_coordinates=False): the re-rank from the lifted vectors faiss stores.

Checked against a float64 brute force: every returned distance within the documented bound
2^-20 |y| / sqrt(b_y b_q) + rtol d (float32 and float64 arithmetic), the same neighbours as the
index that keeps the coordinates,
self-exclusion, a save/load round trip without coordinates, the memory it saves, and one clear
error for the factories and calls it cannot serve."""
import math

import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex
from pml_hyperbolic.search import reconstructed
from tests.search._ball_points import ball_points as points


def brute(q, x, c):
    return pb.dist(q.double()[:, None, :], x.double()[None, :, :], c=c)


def bound(q, x, idx, d, c, rtol=1e-5):
    """The documented bound 2^-20 |y| / sqrt(b_y b_q) + rtol d."""
    y = x.double()[idx]
    by = 1 - c * (y * y).sum(-1)
    bq = 1 - c * (q.double() ** 2).sum(-1)
    return 2.0 ** -20 * y.norm(dim=-1) / (by * bq[:, None]).sqrt() + rtol * d


@pytest.mark.parametrize("factory, kwargs", [("IVF8,Flat", {"nprobe": 8}), ("HNSW16", {"ef_search": 200})])
@pytest.mark.parametrize("c, max_radius", [(0.1, 0.95), (1.0, 0.999), (0.5, 0.3)])
@pytest.mark.parametrize("rtol", [1e-5, 1e-12])  # float32 differences / float64 throughout
def test_distances_within_the_bound_and_neighbours_of_the_full_index(factory, kwargs, c, max_radius, rtol):
    x, q = points(1500, 24, c, 0, max_radius), points(60, 24, c, 1, max_radius)
    lean = HyperbolicIndex(c=c, factory=factory, keep_coordinates=False, rtol=rtol, **kwargs).add(x)
    full = HyperbolicIndex(c=c, factory=factory, **kwargs).add(x)
    d, i = lean.search(q, 10)
    D = brute(q, x, c)
    exact = D.gather(1, i)
    rounding = 2.0 ** -24 * exact  # the float32 output itself
    assert torch.all((d.double() - exact).abs() <= bound(q, x, i, exact, c, rtol) + rounding)
    assert torch.all(d[:, 1:] >= d[:, :-1])
    truth = D.topk(10, dim=1, largest=False).indices
    i_full = full.search(q, 10)[1]
    if max_radius > 0.99:
        # a point this near the boundary stretches the augmented rows (M is ~1,400 here): faiss's
        # float32 candidate lists are then ranked by noise among points near the origin, for both
        return
    if factory.startswith("IVF"):  # every list visited: the exact neighbours (no ties at this size)
        assert torch.equal(i, truth) and torch.equal(i_full, truth)
    else:  # the same kind of graph: about the same recall as the index that keeps the coordinates
        recall = [np.mean([len(set(a.tolist()) & set(b.tolist())) / 10 for a, b in zip(r, truth)])
                  for r in (i, i_full)]
        assert recall[0] >= recall[1] - 0.05


def test_near_duplicates_keep_the_absolute_bound():
    c = 0.1
    x = points(600, 16, c, 2)
    x = torch.cat([x, x[:100] * (1 + 1e-6)])  # pairs a few float32 ulps apart
    lean = HyperbolicIndex(c=c, factory="IVF4,Flat", nprobe=4, keep_coordinates=False).add(x)
    d, i = lean.search(x[:100], 2)
    exact = brute(x[:100], x, c).gather(1, i)
    assert set(i[:, :2].flatten().tolist()) <= set(range(100)) | set(range(600, 700))
    assert torch.all((d.double() - exact).abs() <= bound(x[:100], x, i, exact, c))


def test_self_exclusion_and_float64_output():
    c = 0.3
    x = points(800, 12, c, 3, dtype=torch.float64)
    lean = HyperbolicIndex(c=c, factory="IVF4,Flat", nprobe=4, keep_coordinates=False).add(x)
    d, i = lean.search(x[:50], 5, query_ids=torch.arange(50))
    assert d.dtype == torch.float64
    assert not (i == torch.arange(50)[:, None]).any()
    D = brute(x[:50], x, c)
    D[torch.arange(50), torch.arange(50)] = math.inf
    assert torch.equal(i, D.topk(5, dim=1, largest=False).indices)


def test_holds_no_coordinates_and_round_trips_without_them(tmp_path):
    c = 0.1
    x, q = points(2000, 32, c, 4), points(50, 32, c, 5)
    lean = HyperbolicIndex(c=c, factory="IVF16,Flat", nprobe=3, keep_coordinates=False).add(x)
    full = HyperbolicIndex(c=c, factory="IVF16,Flat", nprobe=3).add(x)
    assert lean._ball is None and lean._bball is None and lean.ntotal == 2000
    lean.save(tmp_path / "lean.hidx")
    full.save(tmp_path / "full.hidx")
    lean_size = (tmp_path / "lean.hidx").stat().st_size
    # the coordinates (2000 x 32 float32) are the difference between the two files
    assert 0 <= (tmp_path / "full.hidx").stat().st_size - lean_size - 2000 * 32 * 4 < 100  # (+ header)
    loaded = HyperbolicIndex.load(tmp_path / "lean.hidx", c=c)
    assert loaded.keep_coordinates is False and loaded.ntotal == 2000
    a, b = lean.search(q, 8), loaded.search(q, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    more = points(100, 32, c, 6)
    lean.add(more)
    loaded.add(more)
    a, b = lean.search(q, 8), loaded.search(q, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and loaded.ntotal == 2100


def test_distances_function_marks_missing_candidates():
    c = 0.2
    x = points(5, 4, c, 7).double()
    from pml_hyperbolic.search.lift import _conformal_terms, _lift_parts

    cx2, den = _conformal_terms(x, c)
    y0, tail = _lift_parts(x, cx2, den, c)
    stored = torch.cat([y0[:, None], tail, torch.zeros(5, 2, dtype=torch.float64)], 1).float().numpy()
    stored = np.stack([stored, np.full_like(stored, np.nan)], 1)  # (5, 2, W): second candidate missing
    valid = torch.tensor([[True, False]] * 5)
    q = points(5, 4, c, 8).double()
    d = reconstructed.distances(q, 1 - c * (q * q).sum(1), stored, valid, c)
    assert torch.isinf(d[:, 1]).all()
    torch.testing.assert_close(d[:, 0], pb.dist(q, x, c=c), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factory", ["Flat", "IVF4,PQ4", "IVF4,SQ8", "PCA8,IVF4,Flat"])
def test_factories_whose_vectors_are_not_the_lift_are_refused(factory):
    with pytest.raises(ValueError, match="keep_coordinates=False .* not factory="):
        HyperbolicIndex(c=0.1, factory=factory, keep_coordinates=False)


@pytest.mark.parametrize("value", [0, 1, None, "no"])
def test_keep_coordinates_must_be_a_bool(value):
    with pytest.raises(ValueError, match="keep_coordinates must be True or False"):
        HyperbolicIndex(c=0.1, factory="HNSW16", keep_coordinates=value)


def test_empty_and_bad_queries_give_the_usual_errors():
    lean = HyperbolicIndex(c=0.1, factory="IVF4,Flat", keep_coordinates=False)
    with pytest.raises(ValueError, match="the index is empty"):
        lean.search(points(3, 8, 0.1, 0), 1)
    lean.add(points(300, 8, 0.1, 1))
    with pytest.raises(ValueError, match="dimension 9"):
        lean.search(points(3, 9, 0.1, 0), 1)
    with pytest.raises(ValueError, match="k=301"):
        lean.search(points(3, 8, 0.1, 0), 301)


@pytest.mark.parametrize("factory", ["IVF8,Flat", "HNSW16"])
def test_stored_rows_are_faiss_own_rows_after_incremental_adds(factory, monkeypatch):
    c = 0.1
    x, q = points(1200, 16, c, 9), points(40, 16, c, 10)
    lean = HyperbolicIndex(c=c, factory=factory, keep_coordinates=False, **({"nprobe": 8} if "IVF" in factory else {}))
    lean.add(x[:900])
    first = lean.search(q, 5)
    view = lean._stored_rows()
    assert isinstance(view, reconstructed.StoredRows)
    for start in range(900, 1200, 60):  # the lists grow and move: the view is rebuilt
        lean.add(x[start:start + 60])
    ids = np.arange(1200)
    _, _, faiss_rows = lean._index.search_and_reconstruct(
        np.zeros((1, lean._index.d), dtype=np.float32), 1)  # (warm the index: any call)
    rows = lean._stored_rows().gather(ids[None, :])[0]
    if "IVF" in factory:
        ivf = __import__("faiss").extract_index_ivf(lean._index)
        ivf.make_direct_map()
    expected = np.stack([lean._index.reconstruct(int(i)) for i in ids])
    assert np.array_equal(rows, expected)
    # the path without the view (faiss copies the rows) gives the same results
    fast = lean.search(q, 5)
    monkeypatch.setattr(lean, "_stored", False)
    slow = lean.search(q, 5)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert first[0].shape == (40, 5)


@pytest.mark.parametrize("keep", [True, False])
def test_queries_grouped_by_list_give_the_results_of_one_query_at_a_time(keep):
    """An inverted file searches a batch with its rows sorted by their first list (cache reuse);
    the results come back in the caller's order, equal to searching each query alone."""
    c = 0.1
    x, q = points(3000, 16, c, 11), points(64, 16, c, 12)
    index = HyperbolicIndex(c=c, factory="IVF32,Flat", nprobe=2, keep_coordinates=keep).add(x)
    d, i = index.search(q, 6, query_ids=torch.full((64,), 5))
    for row in range(0, 64, 7):
        d1, i1 = index.search(q[row:row + 1], 6, query_ids=torch.tensor([5]))
        assert torch.equal(d[row], d1[0]) and torch.equal(i[row], i1[0])
    assert not (i == 5).any()


@pytest.mark.parametrize("keep", [True, False])
def test_queries_split_across_threads_give_the_one_thread_results(keep, monkeypatch):
    """With several faiss threads an approximate search splits the queries into contiguous parts,
    one thread each, also while other processes keep cores busy (the parts share no barrier); the
    results equal the one-thread search."""
    import faiss

    import pml_hyperbolic.search.faiss_batches as batches

    c = 0.1
    x, q = points(3000, 16, c, 13), points(300, 16, c, 14)
    index = HyperbolicIndex(c=c, factory="IVF32,Flat", nprobe=2, keep_coordinates=keep).add(x)
    before = faiss.omp_get_max_threads()
    try:
        faiss.omp_set_num_threads(1)
        one = index.search(q, 7, query_ids=torch.arange(300))
        monkeypatch.setattr(batches, "_MIN_ROWS_PER_WORKER", 50)
        monkeypatch.setattr(batches, "uncontended_threads", lambda requested: 1)  # a busy machine
        faiss.omp_set_num_threads(3)
        calls = []
        search = batches.FaissBatchMixin._search_batch

        def spy(self, q, *args):
            calls.append((q.shape[0], args[-1]))
            return search(self, q, *args)

        monkeypatch.setattr(batches.FaissBatchMixin, "_search_batch", spy)
        split = index.search(q, 7, query_ids=torch.arange(300))
    finally:
        faiss.omp_set_num_threads(before)
    assert sorted(calls) == [(100, 1)] * 3  # three parts, each with a one-thread faiss call
    assert torch.equal(one[0], split[0]) and torch.equal(one[1], split[1])
