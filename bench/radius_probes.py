#!/usr/bin/env python
"""Probes (2026-11-25): can the ball's radius separate degraded queries?

What became defaults (2026-11-25, 998b977) is measured by ``bench/radius.py``: the calibration term in a ranking
form (``pml_hyperbolic.losses.RadialCalibrationLoss``; the binary cross-entropy form probed here,
``BCERadiusCalibration``, pulled the radii inward) and paired degraded copies
(``DegradedCopyRadiusLoss``; the unpaired degraded views probed here did not move the radius).

    python -m bench radius_probes                 # seed 0, 600 steps, head only (~5 min on 2 cores)
    python -m bench radius_probes --seeds 0,1,2

Same protocol, data and columns as ``bench/radius.py`` (frozen MobileNetV2 pooled features, polar
head, validation split of 32 training characters, 160 held-out test characters). Rows:

* ``pce``: the package default (polar head + Hyp-ViT's pairwise CE), the reference;
* ``pce + calibration (w)``: plus a radial calibration term, the binary cross-entropy between
  d₀/max d₀ and the batch's softmax mass on same-class samples (τ = 0.2, detached): the radius is
  trained to predict how well the sample is retrieved in its batch;
* ``pce, degraded views``: the training bank gains two views per image, each the augmented image
  under one random degradation of random strength (blur σ ∈ [0.5, 2.5], noise σ ∈ [0.1, 0.8] or an
  occluding square of 8–32 px; the test's degradations are fixed: σ 1.5, 0.5, 24 px);
* ``pce, degraded views + calibration (1)``;
* ``MS + HIER``: PML's MultiSimilarity loss + miner on the polar head's output (cosine, i.e. the
  directions) + 3·HIER on the ball.

Then, for the reference row, each degradation alone: the AUROC of −d₀ for "degraded" and the
fraction of queries whose degraded copy lies nearer the origin than the clean one (paired).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402
from bench import radius as R  # noqa: E402


class BCERadiusCalibration(torch.nn.Module):
    """BCE(d₀ / max d₀, q) with q the softmax mass (over the batch, self excluded, distances / τ) on
    the sample's own class, detached: a target for the radius only."""

    def __init__(self, geometry, temperature: float = 0.2):
        super().__init__()
        self.geometry, self.temperature = geometry, temperature

    def forward(self, embeddings, labels, indices_tuple=None):
        from pml_hyperbolic import poincare_ball as pb

        c = self.geometry.curvature()
        with torch.no_grad():
            eye = torch.eye(len(embeddings), dtype=torch.bool)
            logits = (-pb.pairwise_dist(embeddings, embeddings, c) / self.temperature).masked_fill(eye, -float("inf"))
            same = (labels[:, None] == labels[None]) & ~eye
            target = (logits.softmax(1) * same).sum(1)
        p = (pb.dist0(embeddings, c).reshape(-1) / float(self.geometry.max_dist0())).clamp(1e-4, 1 - 1e-4)
        return torch.nn.functional.binary_cross_entropy(p, target)


def with_calibration(weight):
    def builder(feature_dim):
        from pytorch_metric_learning.losses import MultipleLosses

        head, loss, geometry, max_d0 = R.build("polar", "pce", feature_dim)
        return head, MultipleLosses([loss, BCERadiusCalibration(geometry)], weights=[1.0, weight]), geometry, max_d0
    return builder


def ms_with_hier(feature_dim):
    from pytorch_metric_learning.losses import MultipleLosses, MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    head, loss, geometry, max_d0 = R.build("polar", "hier", feature_dim)
    hier = loss.losses[1]
    ms = R._Mined(MultiSimilarityLoss(alpha=2, beta=50, base=0.5), MultiSimilarityMiner(epsilon=0.1))
    return head, MultipleLosses([ms, hier], weights=[1.0, R.HIER_SETTINGS["weight"]]), geometry, max_d0


def random_degradation(image, generator):
    """One of blur / noise / occlusion at a random strength (see the module docstring)."""
    from torchvision.transforms.functional import gaussian_blur

    kind = int(torch.randint(3, (1,), generator=generator))
    if kind == 0:
        sigma = float(torch.empty(1).uniform_(0.5, 2.5, generator=generator))
        return gaussian_blur(image[None], kernel_size=2 * int(3 * sigma) + 1, sigma=sigma)[0]
    if kind == 1:
        return image + float(torch.empty(1).uniform_(0.1, 0.8, generator=generator)) * torch.randn(
            image.shape, generator=generator)
    out = image.clone()
    h, w = image.shape[-2:]
    side = min(int(torch.randint(8, 33, (1,), generator=generator)), h, w)
    y0 = int(torch.randint(0, h - side + 1, (1,), generator=generator))
    x0 = int(torch.randint(0, w - side + 1, (1,), generator=generator))
    out[:, y0:y0 + side, x0:x0 + side] = 0.0
    return out


def degraded_training_views(cfg, views=2, use_cache=True):
    """Pooled features of every training image, augmented then randomly degraded: (N, views, 1280).
    (The torchvision ops of the probe, one image at a time: not the package's ``RandomDegradation``.)"""
    def degrade(images, generator):
        return torch.stack([random_degradation(image, generator) for image in images])

    return R.degraded_view_features(cfg, degrade, f"degraded-train-views|{views}", views, use_cache)


def with_degraded_views(data, extra_views):
    """The training split of ``data`` with ``extra_views`` (of the whole training set) appended."""
    train = data["train"]
    return qc.Split(torch.cat([train.acts, R.aligned_views(data, extra_views)], 1), train.labels,
                    train.super_labels, train.font_families)


def per_degradation(cfg, data, seed, steps):
    """Reference row, each degradation alone: AUROC of −d₀ for 'degraded' and the paired fraction."""
    from pml_hyperbolic import poincare_ball as pb

    torch.manual_seed(seed)
    head, loss, geometry, _ = R.build("polar", "pce", data["bank"].feature_dim)
    qc.train_with_labels(cfg, data["train"], torch.nn.Identity(), head, loss, seed=seed, steps=steps)
    c = float(geometry.curvature())
    clean = pb.dist0(R.embed(head, data["bank"].query.acts).double(), c).numpy()
    out = {}
    for kind, feats in data["degraded"].items():
        degraded = pb.dist0(R.embed(head, feats).double(), c).numpy()
        auroc = R.auroc(np.r_[np.zeros(len(clean), bool), np.ones(len(degraded), bool)], -np.r_[clean, degraded])
        out[kind] = (auroc, float((degraded < clean).mean()), float(np.median(clean)), float(np.median(degraded)))
    return out


COLUMNS = [("val R@1", "val_r1", True), ("val AUROC fail", "val_auroc_fail", False),
           ("val AUROC degraded", "val_auroc_degraded", False), ("R@1", "r1", True),
           ("parent R@1", "parent_r1", True), ("AUROC fail", "auroc_fail", False),
           ("AUROC degraded", "auroc_degraded", False)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache", action="store_true")
    a = p.parse_args(argv)
    qc.set_threads(a.threads)
    seeds = [int(s) for s in a.seeds.split(",")]
    cfg = qc.BenchConfig(steps=a.steps, seeds=tuple(seeds), trainable="head")
    t0 = time.perf_counter()
    data = R.load_data(cfg, use_cache=not a.no_cache)
    degraded_train = with_degraded_views(data, degraded_training_views(cfg, use_cache=not a.no_cache))
    print(f"# {qc.machine_line()}\n# {cfg.describe()}\n# {data['bank'].note}; validation: 32 training characters")
    rows = [("pce (reference)", None, None), ("pce + calibration (1)", with_calibration(1.0), None),
            ("pce + calibration (3)", with_calibration(3.0), None),
            ("pce, degraded views", lambda dim: R.build("polar", "pce", dim), degraded_train),
            ("pce, degraded views + calibration (1)", with_calibration(1.0), degraded_train),
            ("MS + HIER", ms_with_hier, None)]
    print("| polar head | " + " | ".join(name for name, _, _ in COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for name, builder, train in rows:
        runs = [R.run_cell(cfg, data, "polar", "pce", s, a.steps, builder=builder, train=train) for s in seeds]
        print(f"| {name} | " + " | ".join(R.fmt([r.get(key) for r in runs], pct=pct) for _, key, pct in COLUMNS)
              + " |", flush=True)
    print("\nReference row, each test degradation alone (seed %d):" % seeds[0])
    print("| degradation | AUROC degraded | degraded copy nearer the origin (paired) | median d₀ clean / degraded |")
    print("|---|---|---|---|")
    for kind, (auroc, paired, med_clean, med_deg) in per_degradation(cfg, data, seeds[0], a.steps).items():
        print(f"| {kind} | {auroc:.3f} | {100 * paired:.0f} % | {med_clean:.2f} / {med_deg:.2f} |")
    print(f"# {time.perf_counter() - t0:.0f} s wall; {qc.machine_line()}")


if __name__ == "__main__":
    main()
