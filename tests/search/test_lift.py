"""to_inner_product: the maximum inner product between exported queries and database vectors ranks
exactly as the Poincaré distance (float64 brute force), near the boundary too."""
import math

import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.search import to_inner_product


def near_boundary(n, d, c, lo, hi, seed):
    """float64 points at sqrt(c)|x| = 1 - 10^-u, u uniform in [lo, hi], in a few narrow cones."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, d, generator=g, dtype=torch.float64)
    v = centres[torch.randint(0, 4, (n,), generator=g)] + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64)
    u = lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return v / v.norm(dim=1, keepdim=True) * (1 - 10.0 ** -u) / math.sqrt(c)


def ranking(scores, descending):
    """Row-wise order with ties by index (stable)."""
    key = -scores if descending else scores
    return np.argsort(key, axis=1, kind="stable")


@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("lo, hi", [(0.0, 1.0), (2.0, 6.0)])  # moderate radii; up to 1 - 1e-6
def test_float64_export_ranks_exactly_as_the_poincare_distance(c, lo, hi):
    x = near_boundary(300, 8, c, lo, hi, seed=int(10 * c + hi))
    q = near_boundary(40, 8, c, lo, hi, seed=int(10 * c + hi) + 1)
    D = pb.pairwise_dist(q, x, c).numpy()
    ip = to_inner_product(q, c, side="query").numpy() @ to_inner_product(x, c, side="database").numpy().T
    by_distance, by_ip = ranking(D, False), ranking(ip, True)
    # the whole order of every row is the same (no float64 near-ties in this data)
    gaps = np.diff(np.take_along_axis(D, by_distance, 1), axis=1)
    assert gaps.min() > 1e-9
    assert np.array_equal(by_distance, by_ip)
    # and the distance is recovered from the score
    recovered = np.arccosh(np.clip(-c * ip, 1.0, None)) / math.sqrt(c)
    np.testing.assert_allclose(recovered, D, rtol=1e-6, atol=1e-6)


def test_float32_export_at_realistic_radii_finds_the_same_neighbours():
    """float32 vectors (what most engines store) at d0 in [1.5, 3.2] (c = 0.1): the top-10 sets
    equal the float64 brute force wherever the 10th and 11th distances differ by more than 1e-5
    (relative); near ties closer than float32 resolution may swap (docs/search.md)."""
    c = 0.1
    g = torch.Generator().manual_seed(7)
    v = torch.randn(2000, 32, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = 1.5 + 1.7 * torch.rand(2000, 1, generator=g, dtype=torch.float64)
    x = (v * torch.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c)).float()
    q, ref = x[:100], x[100:]
    D = pb.pairwise_dist(q.double(), ref.double(), c).numpy()
    ip = to_inner_product(q, c, side="query").numpy() @ to_inner_product(ref, c).numpy().T
    assert ip.dtype == np.float32
    order = np.sort(D, axis=1)
    clear = (order[:, 10] - order[:, 9]) > 1e-5 * order[:, 10]
    assert clear.mean() > 0.9
    truth = np.argsort(D, axis=1)[:, :10]
    found = np.argsort(-ip, axis=1)[:, :10]
    for row in np.nonzero(clear)[0]:
        assert set(truth[row]) == set(found[row])


def test_types_dtypes_and_sides():
    x = near_boundary(5, 3, 0.5, 0.0, 1.0, seed=1)
    y = to_inner_product(x, 0.5)
    qv = to_inner_product(x, 0.5, side="query")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float64 and y.shape == (5, 4)
    torch.testing.assert_close(y, pb.to_lorentz(x, 0.5), rtol=1e-15, atol=0)
    assert torch.equal(qv[:, 0], -y[:, 0]) and torch.equal(qv[:, 1:], y[:, 1:])
    # <q', y'> of a point with itself: the Lorentz norm -1/c
    torch.testing.assert_close((qv * y).sum(1), torch.full((5,), -2.0, dtype=torch.float64))
    a = to_inner_product(x.numpy(), 0.5, side="database", dtype=np.float32)
    assert isinstance(a, np.ndarray) and a.dtype == np.float32
    assert to_inner_product(x.float(), 0.5).dtype == torch.float32


@pytest.mark.parametrize("bad, match", [
    (dict(side="queries"), "side"),
    (dict(x=torch.zeros(3)), "2-D"),
    (dict(x=torch.zeros(0, 3)), "empty"),
    (dict(x=torch.tensor([[float("nan"), 0.0]])), "NaN"),
    (dict(x=torch.tensor([[float("inf"), 0.0]])), "Inf|finite"),
    (dict(x=torch.tensor([[4.0, 0.0]])), "outside the Poincaré ball"),
    (dict(c=-1.0), r"\bc\b"),
    (dict(x=[[0.1, 0.2]]), "torch.Tensor or numpy"),
])
def test_bad_input_gets_one_clear_error(bad, match):
    args = {"x": torch.tensor([[0.1, 0.2]]), "c": 1.0, "side": "database", **bad}
    error = TypeError if "numpy" in match else ValueError
    with pytest.raises(error, match=match):
        to_inner_product(**args)
