"""Forward + backward time and peak memory of each pml_hyperbolic loss at B = 900, D = 128
(100 classes x 9), as a ratio to PML's SupConLoss(CosineSimilarity) measured in the same run.

    .venv/bin/python bench/losses.py [--reps 5] [--device cpu|cuda]

Time: median over --reps of forward+backward, rounds interleaved with the baseline. Peak memory: on CUDA
torch.cuda.max_memory_allocated; on CPU the increase of the process's max RSS while computing one
forward+backward, each loss in a fresh subprocess (so the numbers do not mask each other).
Target (issue 3): every loss <= 2x the baseline time.
"""
import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch


def make(name):
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.losses import SupConLoss, TripletMarginLoss, NTXentLoss
    from pml_hyperbolic import losses as L
    from pml_hyperbolic.distances import PoincareDistance
    table = {
        "SupConLoss(CosineSimilarity) [baseline]": lambda: SupConLoss(temperature=0.1, distance=CosineSimilarity()),
        "PairwiseCrossEntropyLoss": lambda: L.PairwiseCrossEntropyLoss(),
        "PairwiseCrossEntropyLoss(view_pairs=True)": lambda: L.PairwiseCrossEntropyLoss(view_pairs=True),
        "PairwiseCrossEntropyLoss(CosineSimilarity, tau=0.1)": lambda: L.PairwiseCrossEntropyLoss(temperature=0.1, distance=CosineSimilarity()),
        "HypMixLoss": lambda: L.HypMixLoss(),
        "UncertaintyAdaptiveContrastiveLoss": lambda: L.UncertaintyAdaptiveContrastiveLoss(),
        "UncertaintyAdaptiveTripletLoss (all 6.4M triplets)": lambda: L.UncertaintyAdaptiveTripletLoss(),
        "HierarchicalLogRatioLoss (1-D labels)": lambda: L.HierarchicalLogRatioLoss(),
        "HierarchicalLogRatioLoss (N x 2 labels)": lambda: L.HierarchicalLogRatioLoss(),
        "HierarchicalMarginLoss": lambda: L.HierarchicalMarginLoss(num_classes=100),
        "[ref] PML TripletMarginLoss(PoincareDistance) all triplets": lambda: TripletMarginLoss(distance=PoincareDistance(c=0.1)),
    }
    return table[name]() if name is not None else list(table)


def inputs(name, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    from pml_hyperbolic.heads import ToPoincare
    raw = torch.randn(900, 128, generator=g).to(device)
    y = torch.arange(100, device=device).repeat_interleave(9)
    if "N x 2" in name:
        y = torch.stack([y, y // 10], 1)
    hyperbolic = not ("Cosine" in name or "HypMix" in name)
    return raw, y, (ToPoincare(c=0.1) if hyperbolic else None)


def step(loss_fn, raw, y, head):
    x = raw.clone().requires_grad_()
    z = head(x) if head is not None else x
    loss_fn(z, y).backward()


def time_all(names, reps, device):
    prepared = {n: (make(n).to(device), *inputs(n, device)) for n in names}
    times = {n: [] for n in names}
    for n in names:
        step(*prepared[n])  # warm-up
    for _ in range(reps):
        for n in names:
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(*prepared[n])
            if device == "cuda":
                torch.cuda.synchronize()
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def peak_memory_child(name, device):
    loss, raw, y, head = make(name).to(device), *inputs(name, device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(loss, raw, y, head)
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(loss, raw, y, head)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # KiB -> MiB (Linux)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child is not None:
        print(json.dumps(peak_memory_child(args.child, args.device)))
        return
    names = make(None)
    t = time_all(names, args.reps, args.device)
    base = t[names[0]]
    print(f"B=900 (100 classes x 9), D=128, device={args.device}, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, median of {args.reps}")
    print(f"{'loss':62s} {'fwd+bwd ms':>10s} {'x SupCon':>9s} {'peak MiB':>9s}")
    for n in names:
        out = subprocess.run([sys.executable, __file__, "--child", n, "--device", args.device],
                             capture_output=True, text=True)
        mem = f"{json.loads(out.stdout.strip().splitlines()[-1]):9.1f}" if out.returncode == 0 else "     fail"
        print(f"{n:62s} {1000 * t[n]:10.1f} {t[n] / base:9.2f} {mem}", flush=True)


if __name__ == "__main__":
    main()
