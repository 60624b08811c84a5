"""Balanced coarse quantizer of IVF factories over the lift (coarse="directions"): lists as balanced
as a cosine index's on clustered data with spread radii, each point in the list of its nearest
direction, recall not below faiss's own k-means on the lift, identical results after save/load."""
import json
import struct

import faiss
import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicIndex
from pml_hyperbolic.search import approximate
from tests.search._ball_points import clustered as _clustered

C = 0.1


def clustered(n, d, seed, centres=None):
    """Ball points with clustered directions and distances from the origin spread over [0.5, 3.2]
    (the spread that makes faiss's k-means on the lift split by radius)."""
    return _clustered(n, d, C, seed, centres, d0_low=0.5, d0_high=3.2)


@pytest.fixture(scope="module")
def data():
    x, centres = clustered(6000, 16, 0)
    q, _ = clustered(200, 16, 1, centres)
    D = pb.pairwise_dist(q.double(), x.double(), C)
    return x, q, D.argsort(dim=1)[:, :10]


def recall(i, gt):
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / gt.shape[1] for a, b in zip(i, gt)]))


def list_of_each_point(index, n):
    ivf = faiss.extract_index_ivf(index._index)
    owner = np.full(n, -1)
    for lst in range(ivf.nlist):
        size = ivf.invlists.list_size(lst)
        if size:
            ids = faiss.rev_swig_ptr(ivf.invlists.get_ids(lst), size).copy()
            owner[ids] = lst
    return owner


def cosine_imbalance(x, nlist):
    dirs = (x / x.norm(dim=1, keepdim=True)).numpy()
    cos = faiss.index_factory(dirs.shape[1], f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    cos.train(dirs)
    cos.add(dirs)
    return approximate.imbalance(cos)


def test_lists_are_as_balanced_as_a_cosine_index(data):
    x, _, _ = data
    lift = HyperbolicIndex(c=C, factory="IVF64,Flat", coarse="lift").add(x)
    balanced = HyperbolicIndex(c=C, factory="IVF64,Flat").add(x)
    cosine = cosine_imbalance(x, 64)
    assert balanced.coarse == "directions"
    assert approximate.imbalance(balanced._index) <= 1.1 * cosine
    # the data shows the problem the option solves: k-means on the lift splits by radius too
    assert approximate.imbalance(lift._index) > 1.3 * approximate.imbalance(balanced._index)
    assert list_of_each_point(balanced, x.shape[0]).min() >= 0  # every point in one list


def test_each_point_and_query_goes_to_its_nearest_direction(data):
    x, q, _ = data
    index = HyperbolicIndex(c=C, factory="IVF64,Flat").add(x)
    ivf = faiss.extract_index_ivf(index._index)
    centroids = np.asarray(ivf.quantizer.reconstruct_n(0, ivf.nlist), dtype=np.float64)
    u = centroids[:, 1:17] / np.linalg.norm(centroids[:, 1:17], axis=1, keepdims=True)
    # every centroid shares the radial coordinates and the tail length: only the direction differs
    assert np.ptp(centroids[:, 0]) == 0 and np.ptp(centroids[:, 17]) == 0
    np.testing.assert_allclose(np.linalg.norm(centroids[:, 1:17], axis=1), np.linalg.norm(centroids[0, 1:17]),
                               rtol=1e-5)
    dirs = (x / x.norm(dim=1, keepdim=True)).double().numpy()
    scores = dirs @ u.T
    owner = list_of_each_point(index, x.shape[0])
    chosen = scores[np.arange(len(owner)), owner]
    # the list faiss chose is the nearest direction (up to float32 ties)
    assert np.all(chosen >= scores.max(axis=1) - 1e-5)
    # queries: the first list visited is the nearest direction as well
    qdirs = (q / q.norm(dim=1, keepdim=True)).double().numpy()
    Q = pb.to_lorentz(q.double(), C)
    Q = Q / Q[:, :1]
    Q[:, 0] = -1.0
    Qa = approximate.augment_query(Q.float().numpy(), index._pad)
    Qa *= index._mips_m / np.linalg.norm(Qa, axis=1, keepdims=True)
    _, first = ivf.quantizer.search(np.ascontiguousarray(Qa, dtype=np.float32), 1)
    qs = qdirs @ u.T
    assert np.all(qs[np.arange(len(q)), first[:, 0]] >= qs.max(axis=1) - 1e-5)


@pytest.mark.parametrize("factory, nprobe", [("IVF64,Flat", 1), ("IVF64,Flat", 4), ("IVF32,SQ8", 2)])
def test_recall_does_not_drop(data, factory, nprobe):
    x, q, gt = data
    found = {}
    for coarse in ("lift", "directions"):
        index = HyperbolicIndex(c=C, factory=factory, nprobe=nprobe, coarse=coarse)
        index.train(x[::2]).add(x)
        d, i = index.search(q, 10)
        # distances are still the exact ones of the returned points
        torch.testing.assert_close(d.double(), pb.pairwise_dist(q.double(), x.double(), C).gather(1, i),
                                   rtol=1e-5, atol=1e-6)
        found[coarse] = recall(i, gt)
    assert found["directions"] >= found["lift"] - 0.01
    assert found["directions"] >= 0.85


def test_save_load_round_trip_keeps_the_balanced_lists(tmp_path, data):
    x, q, _ = data
    index = HyperbolicIndex(c=C, factory="IVF64,PQ8", nprobe=4).train(x[::3]).add(x)
    before = index.search(q, 10)
    index.save(tmp_path / "g.hidx")
    loaded = HyperbolicIndex.load(tmp_path / "g.hidx", c=C)
    assert loaded.coarse == "directions"
    after = loaded.search(q, 10)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    a, b = faiss.extract_index_ivf(index._index), faiss.extract_index_ivf(loaded._index)
    assert np.array_equal(np.asarray(a.quantizer.reconstruct_n(0, 64)), np.asarray(b.quantizer.reconstruct_n(0, 64)))
    lift = HyperbolicIndex(c=C, factory="IVF64,Flat", coarse="lift").add(x)
    lift.save(tmp_path / "l.hidx")
    assert HyperbolicIndex.load(tmp_path / "l.hidx").coarse == "lift"


def test_a_file_without_the_option_loads_as_trained_on_the_lift(tmp_path, data):
    x, q, _ = data
    index = HyperbolicIndex(c=C, factory="IVF64,Flat", coarse="lift").add(x)
    index.save(tmp_path / "a.hidx")
    raw = (tmp_path / "a.hidx").read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16:16 + hlen])
    del header["options"]["coarse"]  # the header as files written before the option have it
    head = json.dumps(header, sort_keys=True).encode()
    (tmp_path / "old.hidx").write_bytes(raw[:8] + struct.pack("<Q", len(head)) + head + raw[16 + hlen:])
    old = HyperbolicIndex.load(tmp_path / "old.hidx")
    assert old.coarse == "lift"
    a, b = index.search(q, 10), old.search(q, 10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_training_is_reproducible(data):
    x, q, _ = data
    a = HyperbolicIndex(c=C, factory="IVF64,Flat", nprobe=2).add(x).search(q, 10)
    b = HyperbolicIndex(c=C, factory="IVF64,Flat", nprobe=2).add(x).search(q, 10)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_points_at_the_origin_and_factories_faiss_trains_alone(data):
    x, q, gt = data
    with_origin = torch.cat([torch.zeros(5, 16), x])
    index = HyperbolicIndex(c=C, factory="IVF64,Flat", nprobe=4).add(with_origin)
    d, i = index.search(torch.zeros(1, 16), 5)
    torch.testing.assert_close(d, torch.zeros(1, 5))
    assert sorted(i[0].tolist()) == [0, 1, 2, 3, 4]
    # a transform before the IVF (here a lossless rotation of the 18 augmented coordinates): faiss
    # trains it alone; every list visited, the search is the exact one
    pca = HyperbolicIndex(c=C, factory="PCA18,IVF16,Flat", nprobe=16)
    assert approximate.balanced_quantizer(approximate.new_index(pca.factory, 17)[0]) is None
    _, i = pca.add(x).search(q, 10)
    assert recall(i, gt) >= 0.99


def test_bad_coarse_is_one_clear_error():
    with pytest.raises(ValueError, match="coarse must be 'directions' or 'lift'"):
        HyperbolicIndex(c=C, factory="IVF64,Flat", coarse="radius")
