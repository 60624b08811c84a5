"""Property sweep of RecallAtKAccuracyCalculator and the δ-hyperbolicity functions on bad input: one
clear ValueError/TypeError naming the argument, never a crash inside PML/torch or a silent number."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pml_hyperbolic.evaluation import RecallAtKAccuracyCalculator
from pml_hyperbolic.evaluation.delta_hyperbolicity import gromov_delta, relative_delta, suggest_curvature

SWEEP = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
NAN, INF = float("nan"), float("inf")
BAD = [0, -1, NAN, INF, -INF, "2", True, False, None, [], 1.5, 1e308, 1e-320, -1e-3]


def points(n=24, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 0.3, torch.arange(n) % 4


def assert_clear(fn, *names):
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    msg = str(err.value).lower()
    assert any(n.lower() in msg for n in names), f"{err.type.__name__}: {err.value} (expected one of {names})"


# ---------------------------------------------------------------- RecallAtKAccuracyCalculator

@SWEEP
@given(value=st.sampled_from(BAD + [(1, 0), (1, 2.5), ("1",), (True,)]))
def test_recall_bad_k_values(value):
    if value is None:
        return  # k_values=None is not an iterable: checked below
    assert_clear(lambda: RecallAtKAccuracyCalculator(k_values=value), "k_values")


@SWEEP
@given(value=st.sampled_from([0, -1, NAN, INF, -INF, "0.1", True, [0.1]]))
def test_recall_bad_curvature(value):
    assert_clear(lambda: RecallAtKAccuracyCalculator(c=value), "c", "curvature")


BAD_QUERY = {
    "1-D": lambda x: x[:, 0],
    "3-D": lambda x: x[None],
    "empty": lambda x: x[:0],
    "NaN": lambda x: x.index_fill(0, torch.tensor([1]), NAN),
    "Inf": lambda x: x.index_fill(0, torch.tensor([1]), INF),
    "int": lambda x: (x * 10).long(),
}


@pytest.mark.parametrize("c", [None, 0.1])
@pytest.mark.parametrize("kind", sorted(BAD_QUERY))
def test_recall_bad_embeddings(c, kind):
    x, y = points()
    calc = RecallAtKAccuracyCalculator(k_values=(1, 2), c=c, include=("recall_at_1",))
    bad = BAD_QUERY[kind](x)
    n = bad.shape[0] if bad.ndim else 0
    assert_clear(lambda: calc.get_accuracy(bad, y[:n] if kind != "empty" else y[:0]), "query", "floating")


@pytest.mark.parametrize("c", [None, 0.1])
@pytest.mark.parametrize("kind", ["short", "2 columns", "3-D", "none", "reference short", "reference 2 columns"])
def test_recall_bad_labels(c, kind):
    x, y = points()
    calc = RecallAtKAccuracyCalculator(k_values=(1, 2), c=c, include=("recall_at_1",))
    if kind.startswith("reference"):
        ry = y[12:-1] if kind == "reference short" else torch.stack([y[12:], y[12:]], 1)
        assert_clear(lambda: calc.get_accuracy(x[:12], y[:12], x[12:], ry), "reference")
        return
    bad = {"short": y[:-1], "2 columns": torch.stack([y, y], 1), "3-D": y[:, None, None],
           "none": None}[kind]
    assert_clear(lambda: calc.get_accuracy(x, bad), "query", "labels")


def test_recall_reference_dimension_and_k_too_large():
    x, y = points()
    calc = RecallAtKAccuracyCalculator(k_values=(1, 2), c=0.1, include=("recall_at_1",))
    assert_clear(lambda: calc.get_accuracy(x[:12], y[:12], torch.randn(12, 5) * 0.3, y[12:]), "dimension")
    big = RecallAtKAccuracyCalculator(k_values=(1, 64), c=0.1)
    assert_clear(lambda: big.get_accuracy(x, y), "k_values")


# ---------------------------------------------------------------- δ-hyperbolicity

BAD_SETS = {
    "1-D": lambda x: x[:, 0],
    "3-D": lambda x: x[None],
    "empty": lambda x: x[:0],
    "NaN": lambda x: x.index_fill(0, torch.tensor([1]), NAN),
    "Inf": lambda x: x.index_fill(0, torch.tensor([1]), INF),
    "str": lambda x: "points",
}


@pytest.mark.parametrize("fn", [gromov_delta, relative_delta])
@pytest.mark.parametrize("kind", sorted(BAD_SETS))
def test_delta_bad_embeddings(fn, kind):
    x, _ = points()
    assert_clear(lambda: fn(BAD_SETS[kind](x)), "embeddings", "empty", "NaN")


@pytest.mark.parametrize("kind", ["not square", "negative", "asymmetric", "NaN", "empty", "1-D"])
def test_delta_bad_distances(kind):
    x, _ = points(8)
    D = torch.cdist(x, x)
    bad = {"not square": D[:, :5], "negative": -D, "asymmetric": D + torch.triu(torch.ones(8, 8), 1),
           "NaN": D.index_fill(0, torch.tensor([1]), NAN), "empty": D[:0, :0], "1-D": D[0]}[kind]
    assert_clear(lambda: gromov_delta(distances=bad), "distances")


GROMOV_PARAMS = ["base", "block_rows", "block_cols"]
RELATIVE_PARAMS = ["base", "n_samples", "n_draws", "seed"]


@SWEEP
@given(data=st.data())
def test_delta_bad_scalars(data):
    x, _ = points(16)
    which = data.draw(st.sampled_from(["gromov", "relative", "metric", "c", "suggest"]))
    value = data.draw(st.sampled_from(BAD))
    if which == "gromov":
        param = data.draw(st.sampled_from(GROMOV_PARAMS))
        if param == "base" and value in (0,) and not isinstance(value, bool):
            return
        if param != "base" and value == 1e308:
            return  # a huge block is clamped to the set: valid
        assert_clear(lambda: gromov_delta(x, **{param: value}), param)
    elif which == "relative":
        param = data.draw(st.sampled_from(RELATIVE_PARAMS))
        if (param in ("base", "seed") and value == 0 and not isinstance(value, bool)) or (
                param == "n_samples" and value is None):
            return
        if param == "n_samples" and value == 1e308:
            return
        assert_clear(lambda: relative_delta(x, **{param: value}), param)
    elif which == "metric":
        assert_clear(lambda: gromov_delta(x, metric=value), "metric")
    elif which == "c":
        if value in (1.5, 1e-320) or value == 1e308:
            return
        assert_clear(lambda: gromov_delta(x * 0.1, metric="poincare", c=value), "c", "curvature")
    else:
        param = data.draw(st.sampled_from(["n_samples", "n_draws", "seed", "max_curvature", "min_curvature"]))
        if param == "seed" and value == 0 and not isinstance(value, bool):
            return  # seed 0 is a valid seed
        if value in (1.5, 1e308, 1e-320) and param in ("max_curvature", "min_curvature", "n_samples"):
            return
        if param == "n_draws" and value == 1e308:
            return
        assert_clear(lambda: suggest_curvature(x, **{param: value}), param, "curvature")
