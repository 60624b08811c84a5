#!/usr/bin/env python
"""Bad inputs against the public API: does each one get a clear error?

    python -m bench bad_inputs          # the table and the counts (a few seconds)

Every case calls one public component with one bad argument or input. Verdicts:

* ``clear``: a ``ValueError`` / ``TypeError`` (or the recipes' ``ConfigError``) whose message names
  the offending argument or input (the ``expect`` text of the case);
* ``opaque``: an exception of another type, or one whose message does not say what is wrong;
* ``silent``: no exception at all (a number came back).

``tests/project/test_bad_inputs.py`` runs the same cases and requires 0 silent and 0 opaque.
"""
from __future__ import annotations

import re

import torch

NAN, INF = float("nan"), float("inf")


def _ball(n=6, d=4, seed=0):
    from pml_hyperbolic.heads import ToPoincare

    g = torch.Generator().manual_seed(seed)
    return ToPoincare(c=0.1)(torch.randn(n, d, generator=g))


def _with(x, i, j, value):
    x = x.clone()
    x[i, j] = value
    return x


def _labels(n=6):
    return torch.arange(n) // 2


def cases():
    """(component, bad input, callable, regex the message must match)."""
    import pml_hyperbolic as ph
    from pml_hyperbolic import poincare_ball as pb
    from pml_hyperbolic.evaluation import (HyperbolicKNN, RecallAtKAccuracyCalculator, relative_delta,
                                           uncertainty_recall_table)
    from pml_hyperbolic.geometry import PoincareGeometry
    from pml_hyperbolic.miners import HardNegativeProbabilityMiner, HierarchicalPseudoLabeler

    x, y = _ball(), _labels()
    bad = _with(x, 1, 2, NAN)
    out = [
        # geometry and curvature
        ("PoincareGeometry", "c=0", lambda: PoincareGeometry(c=0.0), r"\bc\b"),
        ("PoincareGeometry", "c=-1", lambda: PoincareGeometry(c=-1.0), r"\bc\b"),
        ("PoincareGeometry", "c=nan", lambda: PoincareGeometry(c=NAN), r"\bc\b"),
        ("PoincareGeometry", "c='0.1' (a string)", lambda: PoincareGeometry(c="0.1"), r"\bc\b"),
        ("PoincareGeometry", "clip='soft'", lambda: PoincareGeometry(clip="soft"), r"clip"),
        ("PoincareGeometry", "clip_r=0", lambda: PoincareGeometry(clip_r=0.0), r"clip_r"),
        ("PoincareGeometry", "clip_r=inf", lambda: PoincareGeometry(clip_r=INF), r"clip_r"),
        ("poincare_ball.dist", "c as a 2-element tensor", lambda: pb.dist(x, x, torch.tensor([0.1, 0.2])), r"\bc\b"),
        # heads
        ("ToPoincare", "clip_r=-1", lambda: ph.ToPoincare(c=0.1, clip_r=-1.0), r"clip_r"),
        ("ToPoincare", "NaN features", lambda: ph.ToPoincare(c=0.1)(bad), r"NaN/Inf"),
        ("ToPoincare", "Inf features", lambda: ph.ToPoincare(c=0.1)(_with(x, 0, 0, INF)), r"NaN/Inf"),
        ("HyperbolicEmbeddingHead", "radius='free'", lambda: ph.HyperbolicEmbeddingHead(4, 2, radius="free"), r"radius"),
        ("HyperbolicEmbeddingHead", "NaN features", lambda: ph.HyperbolicEmbeddingHead(4, 2)(bad), r"NaN/Inf"),
        ("HyperbolicEmbeddingHead", "geometry and clip_r together",
         lambda: ph.HyperbolicEmbeddingHead(4, 2, c=PoincareGeometry(), clip_r=1.0), r"clip_r"),
        # distances
        ("PoincareDistance", "c=0", lambda: ph.PoincareDistance(c=0.0), r"\bc\b"),
        ("PoincareDistance", "is_inverted=True", lambda: ph.PoincareDistance(is_inverted=True), r"is_inverted"),
        ("PoincareDistance", "NaN embeddings", lambda: ph.PoincareDistance()(bad), r"NaN/Inf"),
        ("MixedGeometryDistance", "lam=-1", lambda: ph.MixedGeometryDistance(lam=-1.0), r"lam"),
        ("MixedGeometryDistance", "c=[]", lambda: ph.MixedGeometryDistance(c=[]), r"\bc\b"),
        ("MixedGeometryDistance", "NaN embeddings", lambda: ph.MixedGeometryDistance()(bad), r"NaN/Inf"),
        # losses
        ("PairwiseCrossEntropyLoss", "temperature=0", lambda: ph.PairwiseCrossEntropyLoss(temperature=0.0),
         r"temperature"),
        ("PairwiseCrossEntropyLoss", "NaN embeddings", lambda: ph.PairwiseCrossEntropyLoss()(bad, y), r"NaN/Inf"),
        ("HypMixLoss", "NaN embeddings", lambda: ph.HypMixLoss()(bad, y), r"NaN/Inf"),
        ("UncertaintyAdaptiveContrastiveLoss", "scale=0",
         lambda: ph.UncertaintyAdaptiveContrastiveLoss(scale=0.0), r"scale"),
        ("UncertaintyAdaptiveContrastiveLoss", "mode='x'",
         lambda: ph.UncertaintyAdaptiveContrastiveLoss(mode="x"), r"mode"),
        ("UncertaintyAdaptiveTripletLoss", "NaN embeddings",
         lambda: ph.UncertaintyAdaptiveTripletLoss()(bad, y), r"NaN/Inf"),
        ("HierarchicalLogRatioLoss", "omega=1", lambda: ph.HierarchicalLogRatioLoss(omega=1.0), r"omega|Ω"),
        ("HierarchicalLogRatioLoss", "3-D labels",
         lambda: ph.HierarchicalLogRatioLoss()(x, torch.zeros(6, 2, 2, dtype=torch.long)), r"labels"),
        ("HierarchicalMarginLoss", "float labels",
         lambda: ph.HierarchicalMarginLoss(num_classes=3)(x, y.float() + 0.5), r"labels"),
        ("HierarchicalMarginLoss", "label >= num_classes",
         lambda: ph.HierarchicalMarginLoss(num_classes=2)(x, y), r"num_classes|labels"),
        ("HierarchicalMarginLoss", "margin_form='x'",
         lambda: ph.HierarchicalMarginLoss(num_classes=3, margin_form="x"), r"margin_form"),
        ("HIERLoss", "num_proxies=0", lambda: ph.HIERLoss(embedding_size=4, num_proxies=0), r"num_proxies"),
        ("HIERLoss", "embedding size mismatch",
         lambda: ph.HIERLoss(embedding_size=8, num_proxies=4)(x, y), r"embedding"),
        ("HIERLoss", "NaN embeddings", lambda: ph.HIERLoss(embedding_size=4, num_proxies=4)(bad, y), r"NaN/Inf"),
        # miners
        ("HardNegativeProbabilityMiner", "threshold=2",
         lambda: HardNegativeProbabilityMiner(threshold=2.0), r"threshold"),
        ("HardNegativeProbabilityMiner", "top_k=0", lambda: HardNegativeProbabilityMiner(top_k=0), r"top_k"),
        ("HierarchicalPseudoLabeler", "levels not decreasing",
         lambda: HierarchicalPseudoLabeler(levels=(2, 4)), r"levels"),
        # uncertainty and evaluation
        ("hyperbolic_uncertainty", "NaN embeddings", lambda: ph.hyperbolic_uncertainty(bad), r"NaN/Inf"),
        ("hyperbolic_uncertainty", "1-D embeddings", lambda: ph.hyperbolic_uncertainty(x[0]), r"2-D"),
        ("hyperbolic_uncertainty", "mode='x'", lambda: ph.hyperbolic_uncertainty(x, mode="x"), r"mode"),
        ("HyperbolicKNN", "c=0", lambda: HyperbolicKNN(c=0.0), r"\bc\b"),
        ("HyperbolicKNN", "dimension mismatch", lambda: HyperbolicKNN(c=0.1)(x, 1, x[:, :3]), r"dimension|shape|D\b"),
        ("RecallAtKAccuracyCalculator", "k_values=(0,)",
         lambda: RecallAtKAccuracyCalculator(k_values=(0,)), r"k_values"),
        ("RecallAtKAccuracyCalculator", "NaN embeddings",
         lambda: RecallAtKAccuracyCalculator(c=0.1).get_accuracy(bad, y), r"NaN|Inf"),
        ("uncertainty_recall_table", "labels of another length",
         lambda: uncertainty_recall_table(x, y[:4], c=0.1), r"labels"),
        ("relative_delta", "all points identical", lambda: relative_delta(torch.ones(10, 3)), r"coincides"),
        ("relative_delta", "n_samples=1", lambda: relative_delta(x, n_samples=1), r"n_samples"),
    ]
    return out


def verdict(fn, pattern):
    from pml_hyperbolic.training.config import ConfigError

    try:
        fn()
    except (ValueError, TypeError, ConfigError) as err:
        return "clear" if re.search(pattern, str(err)) else f"opaque (message: {str(err)[:80]!r})"
    except Exception as err:  # noqa: BLE001 - every other exception is what this bench looks for
        return f"opaque ({type(err).__name__}: {str(err)[:60]!r})"
    return "silent"


def run():
    rows = [(comp, what, verdict(fn, pattern)) for comp, what, fn, pattern in cases()]
    counts = {k: sum(v.startswith(k) for _, _, v in rows) for k in ("clear", "opaque", "silent")}
    return rows, counts


def main(argv=None) -> list:
    """Print the verdict table; return one row per bad input."""
    import argparse
    import warnings

    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, counts = run()
    print("| component | bad input | verdict |\n|---|---|---|")
    for comp, what, v in rows:
        print(f"| `{comp}` | {what} | {v} |")
    print(f"\n{len(rows)} bad inputs: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    return [{"component": comp, "bad input": what, "verdict": v} for comp, what, v in rows]


if __name__ == "__main__":
    main()
