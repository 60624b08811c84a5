"""Property sweep of the losses' contracts on bad input: every bad hyperparameter or tensor gets one
clear ValueError/TypeError naming the argument, or a documented result (never a crash inside
torch/PML, a hang, or a silent NaN)."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pml_hyperbolic.geometry import PoincareGeometry
from pml_hyperbolic.losses import (
    DegradedCopyRadiusLoss,
    HierarchicalLogRatioLoss,
    HierarchicalMarginLoss,
    HyperbolicCrossBatchMemory,
    HypMixLoss,
    PairwiseCrossEntropyLoss,
    RadialCalibrationLoss,
    UncertaintyAdaptiveContrastiveLoss,
    UncertaintyAdaptiveTripletLoss,
)

SWEEP = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
NAN, INF = float("nan"), float("inf")
BAD_SCALARS = [0, 0.0, -1, -1e-3, NAN, INF, -INF, "0.2", True, False, None, [0.2], 1e308, 1e-320]


def geometry():
    return PoincareGeometry(c=0.1, clip_r=2.3)


# name -> (factory(**overrides), scalar hyperparameters)
NONNEGATIVE = {"margin", "margin_scale", "gamma", "level_gamma", "momentum"}  # 0 is valid
LOSSES = {
    "PairwiseCrossEntropyLoss": (lambda **kw: PairwiseCrossEntropyLoss(**kw), ["temperature"]),
    "HypMixLoss": (lambda **kw: HypMixLoss(**kw), ["c", "lam", "tau_e", "tau_h", "clip_r"]),
    "UncertaintyAdaptiveContrastiveLoss": (lambda **kw: UncertaintyAdaptiveContrastiveLoss(**kw),
                                           ["scale", "min_temperature", "clip_r"]),
    "UncertaintyAdaptiveTripletLoss": (lambda **kw: UncertaintyAdaptiveTripletLoss(**kw), ["margin_scale", "clip_r"]),
    "HierarchicalLogRatioLoss": (lambda **kw: HierarchicalLogRatioLoss(**kw), ["omega", "eps"]),
    "HierarchicalMarginLoss": (lambda **kw: HierarchicalMarginLoss(**{"num_classes": 4, **kw}),
                               ["num_classes", "gamma", "momentum", "level_gamma"]),
    "RadialCalibrationLoss": (lambda **kw: RadialCalibrationLoss(**{"c": geometry(), **kw}), ["temperature", "scale"]),
    "DegradedCopyRadiusLoss": (lambda **kw: DegradedCopyRadiusLoss(**{"c": geometry(), **kw}), ["margin"]),
}
FLAGS = {  # boolean switches: a non-bool is a clear error
    "PairwiseCrossEntropyLoss": ["view_pairs"],
    "HypMixLoss": ["learnable_lambda", "view_pairs"],
    "UncertaintyAdaptiveContrastiveLoss": ["detach_uncertainty"],
    "UncertaintyAdaptiveTripletLoss": ["detach_uncertainty"],
    "HierarchicalMarginLoss": ["track_inter_class"],
}


def batch(n=8, d=4, classes=4, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype) * 0.3
    y = torch.arange(n) % classes
    return x, y


def call(name, loss, x, y, **kw):
    if name == "DegradedCopyRadiusLoss":
        ref = kw.pop("ref_emb", None)
        if ref is None:
            ref = x * 0.5 if torch.is_tensor(x) else x
        return loss(x, ref_emb=ref, **kw)
    return loss(x, y, **kw)


def assert_clear(fn, *names):
    """fn raises ValueError/TypeError whose message names one of ``names`` (case-insensitive)."""
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    msg = str(err.value).lower()
    assert any(n.lower() in msg for n in names), f"{err.type.__name__}: {err.value} (expected one of {names})"


def assert_finite_or_clear(fn, *names):
    try:
        out = fn()
    except (ValueError, TypeError) as e:
        assert any(n.lower() in str(e).lower() for n in names), f"{type(e).__name__}: {e}"
        return
    assert torch.isfinite(torch.as_tensor(out)).all(), f"silent non-finite result {out}"


@pytest.mark.parametrize("name", sorted(n for n in LOSSES if LOSSES[n][1]))
@SWEEP
@given(data=st.data())
def test_bad_hyperparameter_is_a_clear_error_or_a_finite_loss(name, data):
    make, params = LOSSES[name]
    param = data.draw(st.sampled_from(params), label="param")
    value = data.draw(st.sampled_from(BAD_SCALARS), label="value")
    if param == "num_classes" and isinstance(value, float) and value >= 1 and math.isfinite(value):
        value = 2.5
    if param == "c" and value == [0.2]:
        return  # HypMix takes one or several curvatures: a list is valid
    if param == "lam" and value == [0.2]:
        value = [0.2, 0.3]  # one lam per curvature: a list longer than c's is an error
    if param == "lam" and value == 0 and not isinstance(value, bool):
        return  # lam = 0 is documented (no hyperbolic branch weight)
    if value is None and param in ("clip_r", "margin_scale", "level_gamma"):
        return  # None is documented (no clipping / the default margin / level_gamma = gamma)
    x, y = batch()
    if (param in NONNEGATIVE and value == 0 and not isinstance(value, bool)) or value == 1e-320:
        if param in NONNEGATIVE or value == 1e-320:
            # 0 is valid where documented; a denormal must be rejected or harmless
            assert_finite_or_clear(lambda: call(name, make(**{param: value}), x, y), param)
            return
    if value == 1e308 and not isinstance(value, bool):
        # extreme but valid numbers: accepted means the loss stays finite
        assert_finite_or_clear(lambda: call(name, make(**{param: value}), x, y), param)
        return
    assert_clear(lambda: make(**{param: value}), param)


@pytest.mark.parametrize("name", sorted(FLAGS))
@SWEEP
@given(data=st.data())
def test_flags_must_be_bools(name, data):
    make, _ = LOSSES[name]
    flag = data.draw(st.sampled_from(FLAGS[name]))
    value = data.draw(st.sampled_from([1, 0, "yes", None, 0.5]))
    assert_clear(lambda: make(**{flag: value}), flag)


BAD_EMBEDDINGS = {
    "1-D": lambda x: x[:, 0],
    "3-D": lambda x: x[None],
    "int": lambda x: (x * 10).long(),
    "bool": lambda x: x > 0,
    "NaN": lambda x: x.index_fill(0, torch.tensor([1]), NAN),
    "Inf": lambda x: x.index_fill(0, torch.tensor([2]), INF),
    "list": lambda x: x.tolist(),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("kind", sorted(BAD_EMBEDDINGS))
def test_bad_embeddings_are_a_clear_error(name, kind):
    make, _ = LOSSES[name]
    x, y = batch()
    bad = BAD_EMBEDDINGS[kind](x)
    assert_clear(lambda: call(name, make(), bad, y), "embeddings", "NaN/Inf", "(N, D)", "floating")


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_empty_batch_is_zero(name):
    make, _ = LOSSES[name]
    x, y = batch()
    out = call(name, make(), x[:0], y[:0])
    assert float(out) == 0.0


LABELLED = sorted(set(LOSSES) - {"DegradedCopyRadiusLoss"})
BAD_LABELS = {
    "short": lambda y: y[:-1],
    "long": lambda y: torch.cat([y, y[:1]]),
    "float": lambda y: y.float() + 0.5,
    "bool": lambda y: y > 1,
    "3-D": lambda y: y[:, None, None],
    "list": lambda y: y.tolist(),
}


@pytest.mark.parametrize("name", LABELLED)
@pytest.mark.parametrize("kind", sorted(BAD_LABELS))
def test_bad_labels_are_a_clear_error(name, kind):
    make, _ = LOSSES[name]
    x, y = batch()
    assert_clear(lambda: call(name, make(), x, BAD_LABELS[kind](y)), "labels")


def _pairs(n):
    a = torch.tensor([0, 1, 2])
    return (a, torch.tensor([4, 5, 6]), a, torch.tensor([1, 2, 3]))


BAD_TUPLES = {
    "out of range": lambda n: (torch.tensor([0]), torch.tensor([n]), torch.tensor([0]), torch.tensor([1])),
    "negative": lambda n: (torch.tensor([0]), torch.tensor([-1]), torch.tensor([0]), torch.tensor([1])),
    "float": lambda n: tuple(t.float() for t in _pairs(n)),
    "mismatched": lambda n: (torch.tensor([0, 1]), torch.tensor([4]), torch.tensor([0]), torch.tensor([1])),
    "two tensors": lambda n: _pairs(n)[:2],
    "not a tuple": lambda n: torch.tensor([0, 4]),
    "2-D": lambda n: tuple(t[None] for t in _pairs(n)),
    "triplet out of range": lambda n: (torch.tensor([0]), torch.tensor([4]), torch.tensor([n + 3])),
}


@pytest.mark.parametrize("name", sorted(set(LABELLED) - {"HypMixLoss"}))
@pytest.mark.parametrize("kind", sorted(BAD_TUPLES))
def test_bad_indices_tuple_is_a_clear_error(name, kind):
    make, _ = LOSSES[name]
    x, y = batch()
    assert_clear(lambda: call(name, make(), x, y, indices_tuple=BAD_TUPLES[kind](len(x))), "indices_tuple")


@pytest.mark.parametrize("name", sorted(set(LABELLED) - {"HypMixLoss", "HierarchicalLogRatioLoss"}))
def test_valid_indices_tuple_still_works(name):
    make, _ = LOSSES[name]
    x, y = batch()
    out = call(name, make(), x, y, indices_tuple=_pairs(len(x)))
    assert torch.isfinite(out)


@pytest.mark.parametrize("kind", ["short ref_labels", "ref_emb of another dimension", "NaN ref_emb",
                                  "ref_emb without ref_labels"])
@pytest.mark.parametrize("name", sorted(set(LABELLED) - {"HypMixLoss"}))
def test_bad_reference_set_is_a_clear_error(name, kind):
    make, _ = LOSSES[name]
    x, y = batch()
    r, ry = batch(seed=1)
    if kind == "short ref_labels":
        ry = ry[:-1]
    elif kind == "ref_emb of another dimension":
        r = torch.randn(len(ry), 5) * 0.3
    elif kind == "ref_emb without ref_labels":
        ry = None
    else:
        r = r.index_fill(0, torch.tensor([0]), NAN)
    assert_clear(lambda: make()(x, y, ref_emb=r, ref_labels=ry), "ref_emb", "ref_labels", "NaN/Inf", "dimension",
                 "size")


def test_cross_batch_memory_bad_sizes():
    for kw, name in [({"embedding_size": 0}, "embedding_size"), ({"memory_size": 0}, "memory_size"),
                     ({"embedding_size": 2.5}, "embedding_size"), ({"memory_size": True}, "memory_size")]:
        assert_clear(lambda: HyperbolicCrossBatchMemory(PairwiseCrossEntropyLoss(), **{"embedding_size": 4,
                                                                                       "memory_size": 16, **kw}),
                     name)


@pytest.mark.parametrize("what", ["1-D", "dimension", "NaN", "int", "short labels", "float labels", "no labels",
                                  "indices out of range", "enqueue_mask"])
def test_cross_batch_memory_bad_call(what):
    xbm = HyperbolicCrossBatchMemory(PairwiseCrossEntropyLoss(), embedding_size=4, memory_size=16)
    x, y = batch()
    kw = {}
    name = "embeddings"
    if what == "1-D":
        x = x[:, 0]
    elif what == "dimension":
        x = torch.randn(8, 5) * 0.3
    elif what == "NaN":
        x = BAD_EMBEDDINGS["NaN"](x)
    elif what == "int":
        x = x.long()
    elif what == "short labels":
        y, name = y[:-1], "labels"
    elif what == "float labels":
        y, name = y.float(), "labels"
    elif what == "no labels":
        y, name = None, "labels"
    elif what == "indices out of range":
        kw, name = {"indices_tuple": BAD_TUPLES["out of range"](8)}, "indices_tuple"
    else:
        kw, name = {"enqueue_mask": torch.ones(3, dtype=torch.bool)}, "enqueue_mask"
    assert_clear(lambda: xbm(x, y, **kw), name, "NaN/Inf", "floating")
    x, y = batch()
    assert torch.isfinite(xbm(x, y))  # the memory still works after the rejected calls
