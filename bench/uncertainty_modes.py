"""Choose Hyp-UML's uncertainty normalisation by experiment.

Offline: sklearn's 8x8 digits. Train an MLP + ToPoincare(c=0.1, clip_r=2.3) head on digits 0-5, evaluate
Recall@1 (hyperbolic distance, leave-one-out) on the held-out digits 6-9. Compares the uncertainty modes
of ``pml_hyperbolic.uncertainty`` inside UncertaintyAdaptiveContrastiveLoss and
UncertaintyAdaptiveTripletLoss, against fixed-temperature / fixed-margin baselines. Several seeds.

    python -m bench uncertainty_modes [--steps 300] [--seeds 3]
"""
import argparse
import statistics
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.heads import ToPoincare
from pml_hyperbolic.losses import (PairwiseCrossEntropyLoss, UncertaintyAdaptiveContrastiveLoss,
                                   UncertaintyAdaptiveTripletLoss)
from pytorch_metric_learning.losses import TripletMarginLoss
from pml_hyperbolic.distances import PoincareDistance


def recall_at_1(z, y, c):
    d = pb.pairwise_dist(z, z, c)
    d.fill_diagonal_(float("inf"))
    return float((y[d.argmin(1)] == y).float().mean())


def run(make_loss, seed, steps, X, Y, train_cls, test_cls, per_class=10):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32), ToPoincare(c=0.1, clip_r=2.3))
    loss_fn = make_loss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    tr = np.isin(Y, train_cls)
    Xtr, Ytr = X[tr], Y[tr]
    by_cls = {c: np.where(Ytr == c)[0] for c in train_cls}
    for _ in range(steps):
        idx = np.concatenate([rng.choice(by_cls[c], per_class, replace=False) for c in train_cls])
        z = model(Xtr[idx])
        loss = loss_fn(z, Ytr[idx])
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 3.0)
        opt.step()
    te = np.isin(Y, test_cls)
    with torch.no_grad():
        return recall_at_1(model(X[te]), Y[te], 0.1)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    d = load_digits()
    X = torch.tensor(d.data / 16.0, dtype=torch.float32)
    Y = torch.tensor(d.target)
    train_cls, test_cls = [0, 1, 2, 3, 4, 5], [6, 7, 8, 9]
    configs = {
        "contrastive fixed tau=0.2 (PairwiseCE)": lambda: PairwiseCrossEntropyLoss(temperature=0.2),
    }
    for mode in ("clip", "ball", "batch", "literal"):
        configs[f"contrastive mode={mode}"] = (lambda m=mode: UncertaintyAdaptiveContrastiveLoss(mode=m))
    configs["triplet fixed margin 0.3 (PML TripletMarginLoss)"] = lambda: TripletMarginLoss(margin=0.3, distance=PoincareDistance(c=0.1))
    for mode in ("clip", "ball", "batch", "literal"):
        configs[f"triplet mode={mode}"] = (lambda m=mode: UncertaintyAdaptiveTripletLoss(mode=m))
    print(f"digits: train classes {train_cls}, held-out {test_cls}; {args.steps} steps, batch 60, "
          f"seeds 0..{args.seeds - 1}; Recall@1 on held-out classes (mean ± sd)")
    for name, make in configs.items():
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            r = [run(make, s, args.steps, X, Y, train_cls, test_cls) for s in range(args.seeds)]
        sd = statistics.stdev(r) if len(r) > 1 else 0.0
        print(f"{name:50s} R@1 = {statistics.mean(r):.4f} ± {sd:.4f}  ({' '.join(f'{v:.3f}' for v in r)})  "
              f"[{time.perf_counter() - t0:.1f}s]", flush=True)


if __name__ == "__main__":
    main()
