import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import RecallAtKAccuracyCalculator

CPU = torch.device("cpu")


def brute_recall(q, ql, r, rl, ks, c, self_exclude):
    D = pb.dist(q.double()[:, None], r.double()[None], c)
    if self_exclude:
        D[torch.arange(len(q)), torch.arange(len(q))] = float("inf")
    idx = np.broadcast_to(np.arange(r.shape[0]), D.shape)
    order = np.lexsort((idx, D.numpy()), axis=1)
    out = {}
    # lone queries (no other same-class reference) are left out, as in PML's precision_at_1
    counts = np.array([(rl.numpy() == v).sum() - int(self_exclude) for v in ql.numpy()])
    keep = counts > 0
    for K in ks:
        hits = [(rl.numpy()[order[i, :K]] == ql.numpy()[i]).any() for i in range(len(q))]
        out[f"recall_at_{K}"] = float(np.mean(np.array(hits)[keep]))
    return out


def data(n, d, classes, seed, c=0.1):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = pb.expmap0(torch.randn(classes, d, generator=g)[y] + torch.randn(n, d, generator=g), c)
    return x.float(), y


@pytest.mark.parametrize("ks", [(1, 2, 4, 8), (1, 10, 100), (1, 10, 20, 30)])
def test_recall_equals_brute_force_self(ks):
    x, y = data(300, 8, 25, seed=len(ks))
    calc = RecallAtKAccuracyCalculator(k_values=ks, c=0.1, device=CPU)
    acc = calc.get_accuracy(x, y)
    ref = brute_recall(x, y, x, y, ks, 0.1, True)
    for key, v in ref.items():
        assert acc[key] == pytest.approx(v, abs=1e-12)
    assert acc["recall_at_1"] == pytest.approx(acc["precision_at_1"])
    assert {"mean_average_precision_at_r", "r_precision", "NMI", "AMI"} <= set(acc)


def test_recall_query_gallery():
    q, ql = data(120, 6, 10, seed=1)
    r, rl = data(200, 6, 10, seed=1)
    calc = RecallAtKAccuracyCalculator(k_values=(1, 10, 20, 30), c=0.1, device=CPU,
                                       include=("recall_at_1", "recall_at_10", "recall_at_20", "recall_at_30"))
    acc = calc.get_accuracy(q, ql, r, rl)
    ref = brute_recall(q, ql, r, rl, (1, 10, 20, 30), 0.1, False)
    assert acc == pytest.approx(ref)


def test_recall_with_ties():
    x, y = data(100, 4, 10, seed=2)
    x[50:70] = x[3]  # duplicates with different labels: ties at distance 0, resolved by index
    y[50:70] = torch.arange(20) % 10
    calc = RecallAtKAccuracyCalculator(k_values=(1, 2, 4, 8), c=0.1, device=CPU,
                                       include=("recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8"))
    assert calc.get_accuracy(x, y) == pytest.approx(brute_recall(x, y, x, y, (1, 2, 4, 8), 0.1, True))


def brute_recall_euclidean(q, ql, r, rl, ks, self_exclude):
    """Recall@K under plain Euclidean (L2) distance: PML's default kNN (faiss ``IndexFlatL2``),
    which ``c=None`` keeps. Plain float64 loops, no pml_hyperbolic code."""
    qn, rn, qln, rln = q.double().numpy(), r.double().numpy(), ql.numpy(), rl.numpy()
    out = {K: [] for K in ks}
    for i in range(len(qn)):
        d = np.sqrt(((rn - qn[i]) ** 2).sum(axis=1)).tolist()
        cands = [j for j in range(len(rn)) if not (self_exclude and j == i)]
        if not any(rln[j] == qln[i] for j in cands):
            continue  # lone query, left out as in PML's precision_at_1
        order = sorted(cands, key=lambda j: (d[j], j))
        for K in ks:
            out[K].append(any(rln[j] == qln[i] for j in order[:K]))
    return {f"recall_at_{K}": float(np.mean(v)) for K, v in out.items()}


def min_relative_gap(q, r, kmax, self_exclude):
    """Smallest relative gap between consecutive L2 distances among each query's kmax + 1 nearest."""
    D = torch.cdist(q.double(), r.double())
    if self_exclude:
        D.fill_diagonal_(float("inf"))
    top = D.sort(dim=1).values[:, :kmax + 1]
    return float(((top[:, 1:] - top[:, :-1]) / top[:, 1:]).min())


def test_euclidean_default_matches_brute_force_l2():
    # float64 draws cast to float32; classes overlap so that Recall@K is neither 0 nor 1
    g = torch.Generator().manual_seed(18)
    y = torch.randint(0, 12, (150,), generator=g)
    centres = torch.randn(12, 6, generator=g, dtype=torch.float64)
    x = (0.12 * (centres[y] + 1.2 * torch.randn(150, 6, generator=g, dtype=torch.float64))).float()
    ks = (1, 2, 4, 8)
    names = tuple(f"recall_at_{K}" for K in ks)
    calc = RecallAtKAccuracyCalculator(k_values=ks, device=CPU, include=names)
    assert calc.c is None
    acc = calc.get_accuracy(x, y)
    ref = brute_recall_euclidean(x, y, x, y, ks, True)
    # no near-ties at the ranks that matter (gaps ~1000x float32 eps), so faiss's order is exact
    assert min_relative_gap(x, x, max(ks), True) > 5e-5
    assert set(acc) == set(ref)
    for key, v in ref.items():
        assert acc[key] == pytest.approx(v, abs=1e-12), key
    assert 0.0 < ref["recall_at_1"] < ref["recall_at_8"] < 1.0  # a non-degenerate comparison
    # the default really is Euclidean: the Poincaré (c = 0.1) ranking gives other values here
    assert brute_recall(x, y, x, y, ks, 0.1, True) != ref
    # query/gallery split: the same L2 brute force
    q, ql, r, rl = x[:60], y[:60], x[60:], y[60:]
    assert min_relative_gap(q, r, max(ks), False) > 5e-5
    acc_qg = RecallAtKAccuracyCalculator(k_values=ks, device=CPU, include=names).get_accuracy(q, ql, r, rl)
    assert acc_qg == pytest.approx(brute_recall_euclidean(q, ql, r, rl, ks, False), abs=1e-12)


def test_euclidean_default_and_bad_args():
    x, y = data(80, 4, 5, seed=3)
    acc = RecallAtKAccuracyCalculator(device=CPU, include=("recall_at_1",)).get_accuracy(x, y)
    assert 0.0 <= acc["recall_at_1"] <= 1.0
    assert min_relative_gap(x, x, 1, True) > 1e-3
    assert acc["recall_at_1"] == pytest.approx(brute_recall_euclidean(x, y, x, y, (1,), True)["recall_at_1"],
                                               abs=1e-12)
    with pytest.raises(ValueError, match="k_values"):
        RecallAtKAccuracyCalculator(k_values=(0, 1))
    with pytest.raises(ValueError, match="k_values"):
        RecallAtKAccuracyCalculator(k_values=())
    with pytest.raises(ValueError, match="K=100"):
        RecallAtKAccuracyCalculator(k_values=(1, 100), c=0.1, device=CPU).get_accuracy(x, y)


def test_recall_only_calculator_uses_the_set_exact_search():
    from pml_hyperbolic.evaluation import HyperbolicKNN, RecallAtKAccuracyCalculator

    only_recall = RecallAtKAccuracyCalculator(k_values=(1, 4), c=0.1, include=("recall_at_1", "recall_at_4"))
    assert only_recall.knn_func.index_kwargs.get("exact_ranks") == (1, 4)
    with_map = RecallAtKAccuracyCalculator(k_values=(1, 4), c=0.1)  # MAP@R needs the full order
    assert with_map.knn_func.index_kwargs.get("exact_ranks") is None
    mine = HyperbolicKNN(c=0.1)
    given = RecallAtKAccuracyCalculator(k_values=(1,), c=0.1, include=("recall_at_1",), knn_func=mine)
    assert given.knn_func is mine
    # same Recall@K either way
    g = torch.Generator().manual_seed(0)
    x = 0.3 * torch.nn.functional.normalize(torch.randn(300, 16, generator=g), dim=1) * torch.rand(300, 1, generator=g)
    y = torch.randint(0, 30, (300,), generator=g)
    a, b = only_recall.get_accuracy(x, y), with_map.get_accuracy(x, y)
    assert a["recall_at_1"] == b["recall_at_1"] and a["recall_at_4"] == b["recall_at_4"]


@pytest.mark.parametrize("c", [None, 0.1])
def test_calculator_bad_inputs_give_clear_errors(c):
    calc = RecallAtKAccuracyCalculator(k_values=(1,), c=c, include=("recall_at_1",))
    x = 0.3 * torch.nn.functional.normalize(torch.randn(20, 4), dim=1)
    y = torch.arange(20) % 4
    with pytest.raises(ValueError, match="query is empty"):
        calc.get_accuracy(x[:0], y[:0])
    with pytest.raises(ValueError, match="reference is empty"):
        calc.get_accuracy(x, y, x[:0], y[:0])
    for bad_value in (float("nan"), float("inf")):
        bad = x.clone()
        bad[3, 1] = bad_value
        with pytest.raises(ValueError, match="NaN/Inf values in 1 of 20"):
            calc.get_accuracy(bad, y)  # query = reference
        with pytest.raises(ValueError, match="reference contains NaN/Inf"):
            calc.get_accuracy(x, y, bad, y)
    with pytest.raises(ValueError, match="dimension 4 but reference has dimension 3"):
        calc.get_accuracy(x, y, torch.zeros(5, 3), torch.zeros(5))
    with pytest.raises(ValueError, match="20 embeddings but 19 labels"):
        calc.get_accuracy(x, y[:19])
    with pytest.raises(ValueError, match="2-D"):
        calc.get_accuracy(x[0], y[:1])


def test_column_labels_are_squeezed_and_multi_column_labels_rejected():
    x, y = data(60, 4, 5, seed=3)
    calc = RecallAtKAccuracyCalculator(k_values=(1, 2), c=0.1, include=("recall_at_1", "recall_at_2"))
    flat = calc.get_accuracy(x, y)
    assert calc.get_accuracy(x, y[:, None]) == flat
    assert calc.get_accuracy(x[:30], y[:30, None], x[30:], y[30:, None]) == calc.get_accuracy(x[:30], y[:30], x[30:], y[30:])
    with pytest.raises(ValueError, match=r"query_labels.*\(60, 2\)"):
        calc.get_accuracy(x, torch.stack([y, y // 2], 1))
    with pytest.raises(ValueError, match=r"reference_labels.*\(30, 1, 1\)"):
        calc.get_accuracy(x[:30], y[:30], x[30:], y[30:, None, None])


def test_collapsed_queries_warn_once_per_calculator():
    import warnings

    from pml_hyperbolic.evaluation import RadiusCollapseWarning, RecallAtKAccuracyCalculator
    from pml_hyperbolic.geometry import PoincareGeometry

    geometry = PoincareGeometry(c=0.1)
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(40) % 10
    on_clip = geometry.to_ball(50 * torch.randn(40, 8, generator=g))  # every tangent norm far beyond r
    calculator = RecallAtKAccuracyCalculator(k_values=(1,), c=geometry)
    with pytest.warns(RadiusCollapseWarning, match="radius collapsed"):
        calculator.get_accuracy(on_clip, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RadiusCollapseWarning)
        calculator.get_accuracy(on_clip, labels)  # once per calculator
        spread = geometry.to_ball(torch.randn(40, 8, generator=g) * torch.linspace(0.05, 0.25, 40)[:, None])
        RecallAtKAccuracyCalculator(k_values=(1,), c=geometry).get_accuracy(spread, labels)
        RecallAtKAccuracyCalculator(k_values=(1,), c=geometry, check_radius=False).get_accuracy(on_clip, labels)
    with pytest.raises(TypeError, match="check_radius"):
        RecallAtKAccuracyCalculator(c=geometry, check_radius="yes")
