#!/usr/bin/env python
"""Which PML losses and miners work with ``PoincareDistance`` and ``PoincareSimilarity``? Runs every one
and prints the table.

    python -m bench pml_compatibility            # the Markdown table of docs/plug-into-pml.md (about 20 s)

Each loss / miner is built with its default arguments plus ``distance=PoincareDistance(c=0.1)``, and
again with ``distance=PoincareSimilarity(c=PoincareGeometry(c=0.1))`` (1 − d/T, T = 2·clip_r: an
inverted distance, as the cosine-only losses demand), and the sizes a classification loss needs (4
classes, 8-d embeddings), then called on 16 points of the c = 0.1 ball (4 classes × 4) with a
backward pass. Verdicts:

* ``works``: finite loss and finite gradients (a miner: returns index tuples);
* ``refused``: PML refuses the distance at construction (its own asserts: the loss needs an inverted
  similarity such as the cosine, or a specific distance);
* ``crashes``: construction passes but the call raises;
* ``non-finite``: the loss or its gradient is NaN/Inf.

``tests/distances/test_poincare_distance_pml_compatibility.py`` regenerates this table and checks docs/plug-into-pml.md holds it.
"""
from __future__ import annotations

import inspect
import math

import torch

SKIP = {"BaseMetricLossFunction", "GenericPairLoss", "BaseMiner", "CrossBatchMemory",
        "EmbeddingsAlreadyPackagedAsTriplets"}  # abstract bases / wrappers, not losses of their own
NUM_CLASSES, DIM = 4, 8


def _points(seed=0):
    from pml_hyperbolic.heads import ToPoincare

    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(NUM_CLASSES).repeat_interleave(4)
    protos = torch.randn(NUM_CLASSES, DIM, generator=g)
    x = ToPoincare(c=0.1)(protos[labels] + 0.5 * torch.randn(len(labels), DIM, generator=g))
    return x, labels


def _build(cls, distance):
    params = inspect.signature(cls.__init__).parameters
    kwargs = {"distance": distance}
    for name, value in (("num_classes", NUM_CLASSES), ("embedding_size", DIM)):
        if name in params:
            kwargs[name] = value
    return cls(**kwargs)


def _poincare_distance():
    from pml_hyperbolic.distances import PoincareDistance

    return PoincareDistance(c=0.1)


def _poincare_similarity():
    from pml_hyperbolic import PoincareGeometry
    from pml_hyperbolic.distances import PoincareSimilarity

    return PoincareSimilarity(c=PoincareGeometry(c=0.1))


DISTANCES = (("PoincareDistance", _poincare_distance), ("PoincareSimilarity", _poincare_similarity))


def loss_verdict(cls, make_distance=_poincare_distance) -> str:
    try:
        loss_fn = _build(cls, make_distance())
    except Exception:  # PML's own asserts (and any other refusal) at construction
        return "refused"
    x, labels = _points()
    x = x.detach().requires_grad_()
    try:
        loss = loss_fn(x, labels)
        loss.backward()
    except Exception:
        return "crashes"
    if not math.isfinite(float(loss.detach())) or x.grad is None or not torch.isfinite(x.grad).all():
        return "non-finite"
    return "works"


def miner_verdict(cls, make_distance=_poincare_distance) -> str:
    try:
        miner = _build(cls, make_distance())
    except Exception:
        return "refused"
    x, labels = _points()
    try:
        out = miner(x, labels)
    except Exception:
        return "crashes"
    return "works" if isinstance(out, tuple) and all(torch.is_tensor(t) for t in out) else "crashes"


def table() -> str:
    """The Markdown compatibility table (PML version in the header)."""
    import pytorch_metric_learning
    from pytorch_metric_learning import losses, miners

    rows = []
    for kind, module, base, verdict in (("loss", losses, losses.BaseMetricLossFunction, loss_verdict),
                                        ("miner", miners, miners.BaseMiner, miner_verdict)):
        for name, cls in sorted(inspect.getmembers(module, inspect.isclass)):
            if name in SKIP or not issubclass(cls, base):
                continue
            verdicts = []
            for _, make_distance in DISTANCES:
                torch.manual_seed(0)
                verdicts.append(verdict(cls, make_distance))
            rows.append((kind, name, verdicts))
    lines = [f"PML {pytorch_metric_learning.__version__}, {len(rows)} losses and miners."]
    for column, (distance_name, _) in enumerate(DISTANCES):
        counts = {v: sum(r[2][column] == v for r in rows) for v in ("works", "refused", "crashes", "non-finite")}
        lines.append(f"With `{distance_name}`: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".")
    lines += ["", "| kind | PML class | " + " | ".join(f"with `{d}`" for d, _ in DISTANCES) + " |",
              "|---|---|" + "---|" * len(DISTANCES)]
    lines += [f"| {k} | `{n}` | " + " | ".join(v) + " |" for k, n, v in rows]
    return "\n".join(lines)


def main(argv=None) -> list:
    """Print the table; return one row per PML class (its verdict with each distance)."""
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    text = table()
    print(text)
    header = [c.strip() for c in text.splitlines()[text.splitlines().index("") + 1].strip("|").split("|")]
    rows = []
    for line in text.splitlines():
        if line.startswith("| loss ") or line.startswith("| miner "):
            cells = [c.strip().strip("`") for c in line.strip("|").split("|")]
            rows.append(dict(zip(header, cells)))
    return rows


if __name__ == "__main__":
    main()
