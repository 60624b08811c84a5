"""HyperbolicIndex with faiss index_factory strings: exact distances of approximate candidates,
training, search parameters, GPU and sharding paths (CPU here), bad input."""
import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex, HyperbolicKNN
from tests.search._ball_points import clustered


def truth(q, x, k, c):
    D = pb.pairwise_dist(q.double(), x.double(), c)
    return D, D.argsort(dim=1)[:, :k]


def recall(i, gt):
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / gt.shape[1] for a, b in zip(i, gt)]))


@pytest.fixture(scope="module")
def data():
    x, centres = clustered(4000, 16, 0.1, 0)
    q, _ = clustered(100, 16, 0.1, 1, centres)
    D, gt = truth(q, x, 10, 0.1)
    return x, q, D, gt


@pytest.mark.parametrize("factory, params, floor", [
    ("HNSW32", {}, 0.9),
    ("IVF64,Flat", {"nprobe": 8}, 0.9),
    ("IVF16,PQ8", {"nprobe": 16}, 0.3),  # 8 bytes a point: coarse candidates, distances still exact
])
def test_factory_distances_are_exact_and_recall_is_high(data, factory, params, floor):
    x, q, D, gt = data
    index = HyperbolicIndex(c=0.1, factory=factory, **params).add(x)
    d, i = index.search(q, 10)
    assert d.dtype == torch.float32 and i.dtype == torch.int64 and d.shape == (100, 10)
    # every returned distance is the true Poincaré distance of the returned point, sorted
    torch.testing.assert_close(d.double(), D.gather(1, i), rtol=1e-5, atol=1e-6)
    assert (d[:, 1:] >= d[:, :-1]).all()
    assert recall(i, gt) >= floor


def test_flat_factory_is_the_exact_index_bit_for_bit(data):
    x, q, _, gt = data
    a = HyperbolicIndex(c=0.1).add(x).search(q, 10)
    b = HyperbolicIndex(c=0.1, factory="Flat").add(x).search(q, 10)
    c = HyperbolicIndex(c=0.1, factory="flat").add(x).search(q, 10)
    for other in (b, c):
        assert torch.equal(a[0], other[0]) and torch.equal(a[1], other[1])
    assert torch.equal(a[1], gt)


def test_hnsw_kind_is_an_alias_of_the_factory(data):
    x, q, _, _ = data
    a = HyperbolicIndex(c=0.1, kind="hnsw", hnsw_m=16).add(x)
    b = HyperbolicIndex(c=0.1, factory="HNSW16").add(x)
    assert a.factory == "HNSW16" and a._index.hnsw.efConstruction == b._index.hnsw.efConstruction == 40
    with pytest.raises(ValueError, match="not both"):
        HyperbolicIndex(c=0.1, kind="hnsw", factory="IVF8,Flat")


def test_train_then_add_and_nprobe_raises_recall(data):
    x, q, _, gt = data
    index = HyperbolicIndex(c=0.1, factory="IVF64,Flat")
    assert index.train(x[::4])._index.is_trained  # trained on a sample
    index.add(x)
    recalls = []
    for nprobe in (1, 64):
        index.set_search_parameters(nprobe=nprobe)
        recalls.append(recall(index.search(q, 10)[1], gt))
    assert recalls[1] == 1.0 and recalls[0] < recalls[1]  # all lists probed: every true neighbour found
    with pytest.raises(ValueError, match="already holds"):
        index.train(x[:100])


def test_efsearch_reaches_faiss(data):
    x, q, _, _ = data
    index = HyperbolicIndex(c=0.1, factory="HNSW8").add(x)
    index.set_search_parameters(ef_search=77)
    index.search(q[:3], 5)
    assert index._index.hnsw.efSearch == 77
    with pytest.raises(ValueError, match="nprobe applies"):
        index.set_search_parameters(nprobe=4)
    with pytest.raises(ValueError, match="ef_search applies"):
        HyperbolicIndex(c=0.1, factory="IVF4,Flat").set_search_parameters(ef_search=4)
    with pytest.raises(ValueError, match="ef_search must"):
        index.set_search_parameters(ef_search=0)


def test_self_exclusion_and_knn_func_with_a_factory(data):
    x, _, _, _ = data
    d, i = HyperbolicKNN(c=0.1, factory="IVF32,Flat", nprobe=32)(x[:300], 5, x, True)
    assert not (i == torch.arange(300)[:, None]).any()
    D, gt = truth(x[:300], x, 6, 0.1)
    D[torch.arange(300), torch.arange(300)] = float("inf")
    gt = D.argsort(dim=1)[:, :5]
    assert recall(i, gt) == 1.0  # every list probed


def test_untrained_or_too_small_ivf_gets_one_clear_error():
    x, _ = clustered(50, 8, 0.1, 2)
    with pytest.raises(ValueError, match="needs at least 256 points"):
        HyperbolicIndex(c=0.1, factory="IVF256,Flat").add(x)
    with pytest.raises(ValueError, match="index is empty"):
        HyperbolicIndex(c=0.1, factory="IVF256,Flat").search(x, 1)
    with pytest.raises(ValueError, match="factory"):
        HyperbolicIndex(c=0.1, factory="NotAnIndex")
    with pytest.raises(ValueError, match="factory"):
        HyperbolicIndex(c=0.1, factory="")
    with pytest.raises(ValueError, match="nprobe applies"):
        HyperbolicIndex(c=0.1, factory="HNSW32", nprobe=3)


def test_pq_factory_gets_padding_for_its_code_size():
    x, _ = clustered(600, 16, 0.1, 3)
    index = HyperbolicIndex(c=0.1, factory="IVF4,PQ8", nprobe=4).add(x)
    assert (16 + 2 + index._pad) % 8 == 0
    d, i = index.search(x[:10], 3)
    D = pb.pairwise_dist(x[:10].double(), x.double(), 0.1)
    torch.testing.assert_close(d.double(), D.gather(1, i), rtol=1e-5, atol=1e-6)


def test_to_gpu_without_a_gpu_is_one_clear_error(data, monkeypatch):
    import faiss

    x = data[0]
    index = HyperbolicIndex(c=0.1, factory="IVF8,Flat").add(x[:500])
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 0, raising=False)
    with pytest.raises(RuntimeError, match="no GPU"):
        index.to_gpu()


def test_to_gpu_moves_with_the_cloner_options(data, monkeypatch):
    import faiss

    x, q = data[0][:500], data[1]
    import types

    moved = []
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 2, raising=False)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", types.SimpleNamespace, raising=False)
    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus",
                        lambda index, co=None: moved.append(co.shard) or index, raising=False)
    index = HyperbolicIndex(c=0.1, factory="IVF8,Flat", nprobe=8).add(x)
    before = index.search(q, 4)
    assert index.to_gpu(shard=True) is index and moved == [True]
    after = index.search(q, 4)
    assert torch.equal(before[1], after[1])
    # a GPU index takes one search at a time: no split of the queries across threads there
    import pml_hyperbolic.search.faiss_batches as batches

    monkeypatch.setattr(batches, "_MIN_ROWS_PER_WORKER", 1)
    monkeypatch.setattr(batches, "uncontended_threads", lambda requested: requested)
    threads = []
    search = batches.FaissBatchMixin._search_batch
    monkeypatch.setattr(batches.FaissBatchMixin, "_search_batch",
                        lambda self, *args: threads.append(args[-1]) or search(self, *args))
    before_threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        again = index.search(q, 4)
    finally:
        faiss.omp_set_num_threads(before_threads)
    assert threads and all(t is None for t in threads) and torch.equal(again[1], after[1])
    with pytest.raises(ValueError, match="no GPU version"):
        HyperbolicIndex(c=0.1, factory="HNSW8").add(x).to_gpu()


def test_cpu_sharding_of_the_exported_lift_equals_the_exact_index(data):
    """The docs' recipe for a gallery larger than one device: faiss IndexShards over the exported
    vectors gives the exact index's neighbours."""
    import faiss

    from pml_hyperbolic.search import to_inner_product

    x, q, _, gt = data
    database = to_inner_product(x.numpy(), 0.1, side="database", dtype=np.float32)
    queries = to_inner_product(q.numpy(), 0.1, side="query", dtype=np.float32)
    shards = faiss.IndexShards(database.shape[1], True, True)  # threaded, successive ids
    parts = [faiss.IndexFlatIP(database.shape[1]) for _ in range(3)]
    for part in parts:
        shards.add_shard(part)
    shards.add(database)
    _, i = shards.search(queries, 10)
    assert recall(i, gt.numpy()) == 1.0
