"""Property sweep of the miners' contracts on bad input: one clear ValueError/TypeError naming the
argument, or a documented result (never a crash inside torch/PML or a silent wrong mining)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pml_hyperbolic.miners import (
    HardNegativeProbabilityMiner,
    HierarchicalPseudoLabeler,
    HierarchicalSimilarityMiner,
    MixedGeometryMiner,
)

SWEEP = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
NAN, INF = float("nan"), float("inf")
BAD_SCALARS = [0, 0.0, -1, -0.5, NAN, INF, -INF, "0.2", True, False, [], 1e308, 1e-320]

MINERS = {
    "HardNegativeProbabilityMiner": (lambda **kw: HardNegativeProbabilityMiner(**kw),
                                     {"temperature": "pos", "threshold": "unit", "top_k": "int"}),
    "MixedGeometryMiner": (lambda **kw: MixedGeometryMiner(**kw),
                           {"temperatures": "pos", "threshold": "unit", "top_k": "int"}),
    "HierarchicalSimilarityMiner": (lambda **kw: HierarchicalSimilarityMiner(**kw),
                                    {"triplets_per_anchor": "int", "seed": "seed"}),
    "HierarchicalPseudoLabeler": (lambda **kw: HierarchicalPseudoLabeler(**kw),
                                  {"exact_max_samples": "int0", "n_fine_clusters": "int", "samples_per_cluster": "int",
                                   "kmeans_iterations": "int", "kmeans_points_per_cluster": "int", "seed": "seed",
                                   "c": "pos"}),
}
FLAGS = {"HardNegativeProbabilityMiner": ["include_positives"], "MixedGeometryMiner": ["include_positives"],
         "HierarchicalSimilarityMiner": ["violating_only"]}


def batch(n=12, d=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 0.3, torch.arange(n) % classes


def assert_clear(fn, *names):
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    msg = str(err.value).lower()
    assert any(n.lower() in msg for n in names), f"{err.type.__name__}: {err.value} (expected one of {names})"


def valid_for(kind, value):
    """Whether ``value`` is a valid value of a hyperparameter of ``kind``."""
    if isinstance(value, (bool, str, list)):
        return False
    if kind == "unit":
        return value is None or 0 < value <= 1
    if kind == "seed":
        return value is None or (isinstance(value, int) and value >= 0)
    if kind in ("int", "int0"):
        return value is None if kind == "int" else False
    return isinstance(value, (int, float)) and 1e-12 <= value <= 1e12  # "pos"


@pytest.mark.parametrize("name", sorted(MINERS))
@SWEEP
@given(data=st.data())
def test_bad_hyperparameter_is_a_clear_error(name, data):
    make, params = MINERS[name]
    param = data.draw(st.sampled_from(sorted(params)), label="param")
    kind = params[param]
    value = data.draw(st.sampled_from(BAD_SCALARS + ([2.5, 1.5] if kind.startswith("int") else [1.5])), label="value")
    if kind == "int0" and value == 0 and not isinstance(value, bool):
        return  # exact_max_samples = 0 is documented (always the k-means route)
    if kind == "seed" and value == 0 and not isinstance(value, bool):
        return
    if kind == "pos" and value in (1e308,):
        return  # large positive temperatures / curvatures are valid numbers
    if valid_for(kind, value):
        return
    assert_clear(lambda: make(**{param: value}), param)


@pytest.mark.parametrize("name", sorted(FLAGS))
@SWEEP
@given(data=st.data())
def test_flags_must_be_bools(name, data):
    make, _ = MINERS[name]
    flag = data.draw(st.sampled_from(FLAGS[name]))
    value = data.draw(st.sampled_from([1, 0, "yes", None, 0.5]))
    assert_clear(lambda: make(**{flag: value}), flag)


FLAT = ["HardNegativeProbabilityMiner", "MixedGeometryMiner", "HierarchicalSimilarityMiner"]
BAD_EMBEDDINGS = {
    "1-D": lambda x: x[:, 0],
    "3-D": lambda x: x[None],
    "int": lambda x: (x * 10).long(),
    "NaN": lambda x: x.index_fill(0, torch.tensor([1]), NAN),
    "Inf": lambda x: x.index_fill(0, torch.tensor([2]), INF),
    "list": lambda x: x.tolist(),
}


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("kind", sorted(BAD_EMBEDDINGS))
def test_bad_embeddings_are_a_clear_error(name, kind):
    x, y = batch()
    assert_clear(lambda: MINERS[name][0]()(BAD_EMBEDDINGS[kind](x), y), "embeddings", "NaN/Inf", "(N, D)",
                 "floating")


BAD_LABELS = {
    "short": lambda y: y[:-1],
    "float": lambda y: y.float() + 0.5,
    "bool": lambda y: y > 1,
    "3-D": lambda y: y[:, None, None],
    "list": lambda y: y.tolist(),
    "2-D": lambda y: torch.stack([y, y], 1),
}


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("kind", sorted(BAD_LABELS))
def test_bad_labels_are_a_clear_error(name, kind):
    if name == "HierarchicalSimilarityMiner" and kind == "2-D":
        pytest.skip("(N, K) labels are this miner's documented input")
    x, y = batch()
    assert_clear(lambda: MINERS[name][0]()(x, BAD_LABELS[kind](y)), "labels")


@pytest.mark.parametrize("name", FLAT)
@pytest.mark.parametrize("kind", ["short ref_labels", "ref_emb of another dimension", "NaN ref_emb",
                                  "ref_emb without ref_labels"])
def test_bad_reference_set_is_a_clear_error(name, kind):
    x, y = batch()
    r, ry = batch(seed=1)
    if kind == "short ref_labels":
        ry = ry[:-1]
    elif kind == "ref_emb of another dimension":
        r = torch.randn(len(ry), 5) * 0.3
    elif kind == "NaN ref_emb":
        r = r.index_fill(0, torch.tensor([0]), NAN)
    else:
        ry = None
    assert_clear(lambda: MINERS[name][0]()(x, y, r, ry), "ref_emb", "ref_labels", "NaN/Inf", "dimension")


@pytest.mark.parametrize("name", FLAT)
def test_empty_batch_mines_nothing(name):
    x, y = batch()
    out = MINERS[name][0]()(x[:0], y[:0])
    assert all(len(t) == 0 for t in out)


@pytest.mark.parametrize("name", FLAT)
def test_valid_call_still_mines(name):
    x, y = batch()
    out = MINERS[name][0]()(x, y)
    assert len(out) in (3, 4) and all(t.dtype == torch.long for t in out)


@pytest.mark.parametrize("kind", ["1-D", "NaN", "int", "too few"])
def test_pseudo_labeler_bad_embeddings(kind):
    x, _ = batch()
    bad = {"1-D": x[:, 0], "NaN": BAD_EMBEDDINGS["NaN"](x), "int": x.long(), "too few": x[:1]}[kind]
    assert_clear(lambda: HierarchicalPseudoLabeler(levels=(4, 2)).fit_predict(bad), "embeddings", "NaN/Inf")


# ---------------------------------------------------------------- average-linkage utilities

def _tree():
    from pml_hyperbolic.miners.hierarchy import weighted_average_linkage

    d = torch.cdist(*(batch(6)[0],) * 2).double().numpy()
    return d, weighted_average_linkage(d)


@pytest.mark.parametrize("what", ["NaN", "negative", "1-D", "str", "sizes short", "sizes zero", "sizes NaN"])
def test_weighted_average_linkage_bad_input(what):
    import numpy as np

    from pml_hyperbolic.miners.hierarchy import weighted_average_linkage

    d, _ = _tree()
    kw = {}
    name = "dist"
    if what == "NaN":
        d = np.where(d == d.max(), np.nan, d)
    elif what == "negative":
        d = -d
    elif what == "1-D":
        d = d[0]
    elif what == "str":
        d = "abc"
    else:
        name = "sizes"
        kw["sizes"] = {"sizes short": np.ones(5), "sizes zero": np.r_[np.ones(5), 0.0],
                       "sizes NaN": np.r_[np.ones(5), np.nan]}[what]
    assert_clear(lambda: weighted_average_linkage(d, **kw), name)


@pytest.mark.parametrize("kw, name", [
    ({"n": 0, "n_clusters": [2]}, "n"), ({"n": 6.0, "n_clusters": [2]}, "n"), ({"n": True, "n_clusters": [1]}, "n"),
    ({"n": 6, "n_clusters": [0]}, "n_clusters"), ({"n": 6, "n_clusters": [7]}, "n_clusters"),
    ({"n": 6, "n_clusters": [2.5]}, "n_clusters"), ({"n": 6}, "n_clusters"),
    ({"n": 6, "n_clusters": [2], "thresholds": [1.0]}, "n_clusters"),
    ({"n": 6, "thresholds": [float("nan")]}, "thresholds"), ({"n": 6, "thresholds": ["1"]}, "thresholds"),
    ({"n": 3, "n_clusters": [2]}, "merges"),
])
def test_cut_merges_bad_input(kw, name):
    from pml_hyperbolic.miners.hierarchy import cut_merges

    _, merges = _tree()
    assert_clear(lambda: cut_merges(merges, **kw), name)


def test_cut_merges_bad_merges_and_linkage():
    import numpy as np

    from pml_hyperbolic.miners.hierarchy import cut_merges, linkage_to_merges

    _, merges = _tree()
    bad = merges.copy()
    bad[0, 0] = 9
    assert_clear(lambda: cut_merges(bad, 6, n_clusters=[2]), "merges")
    assert_clear(lambda: cut_merges(merges[:, :2], 6, n_clusters=[2]), "merges")
    assert_clear(lambda: linkage_to_merges(np.zeros((3, 3))), "linkage_matrix")
    assert cut_merges(merges, 6, n_clusters=[6, 3, 1]).shape == (6, 3)
