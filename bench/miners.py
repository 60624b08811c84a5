"""Miner timings at B = 900, D = 128 against PML's SupConLoss(CosineSimilarity) fwd+bwd, plus the
hierarchical pseudo-labeller at 60,000 × 128.

Every measurement runs in a fresh subprocess so that its peak memory can be read separately:
"peak MB" is the process's peak RSS during the measured calls minus its RSS right before them
(CPU; the peak counter is reset through /proc/self/clear_refs), or torch.cuda.max_memory_allocated (CUDA). Times are medians of --repeats
runs after one warm-up at --threads torch threads, "1t CPU" the least CPU time of the same call run
with 1 thread (the figure a busy machine distorts least; CPU device only), and the load average is
printed with the table. Usage:

    python -m bench miners [--repeats 5] [--device cpu|cuda] [--threads 2] [--skip-60k]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import sys
import time

from bench._load import cpu_1thread, load_text  # noqa: E402

B, D, PER_CLASS = 900, 128, 9


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _batch(device):
    import torch

    from pml_hyperbolic.heads import ToPoincare

    g = torch.Generator().manual_seed(0)
    feats = torch.randn(B, D, generator=g)
    labels = torch.arange(B) // PER_CLASS
    emb = ToPoincare(c=0.1, clip_r=2.3)(feats).to(device)
    return feats.to(device), emb, labels.to(device)


def _case(name, device):
    """Return a zero-argument callable doing one measured call."""
    import torch
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.losses import SupConLoss

    from pml_hyperbolic import miners as M
    from pml_hyperbolic import poincare_ball as pb

    feats, emb, labels = _batch(device)
    hier = torch.stack([labels, labels // 3, labels // 10, labels // 25], 1)
    if name == "SupConLoss(cos) fwd+bwd [baseline]":
        loss_fn = SupConLoss(distance=CosineSimilarity())

        def run():
            x = feats.detach().requires_grad_()
            loss_fn(x, labels).backward()

        return run
    miners = {
        "HardNegativeProbabilityMiner(top_k=5)": lambda: M.HardNegativeProbabilityMiner(top_k=5),
        "HardNegativeProbabilityMiner(threshold=0.01)": lambda: M.HardNegativeProbabilityMiner(threshold=0.01),
        "HardNegativeProbabilityMiner() [p > uniform]": lambda: M.HardNegativeProbabilityMiner(),
        "MixedGeometryMiner(cos+Poincare, top_k=5)": lambda: M.MixedGeometryMiner(top_k=5),
        "HierarchicalSimilarityMiner(K=4, 100/anchor)": lambda: M.HierarchicalSimilarityMiner(triplets_per_anchor=100),
    }
    if name in miners:
        miner = miners[name]()
        lab = hier if "Hierarchical" in name else labels

        def run():
            miner(emb, lab)

        return run
    if name == "HierarchicalPseudoLabeler exact, N=900":
        labeler = M.HierarchicalPseudoLabeler(levels=(100, 70, 40, 10))
        return lambda: labeler.fit_predict(emb)
    if name == "HierarchicalPseudoLabeler approx, N=60000":
        g = torch.Generator().manual_seed(0)
        centers = torch.randn(300, D, generator=g)
        x = centers[torch.randint(0, 300, (60000,), generator=g)] + 0.7 * torch.randn(60000, D, generator=g)
        x = pb.project(pb.expmap0(0.25 * x, 0.1), 0.1)
        labeler = M.HierarchicalPseudoLabeler(levels=(100, 70, 40, 10))
        return lambda: labeler.fit_predict(x)
    raise KeyError(name)


def _measure(name, device, repeats, threads, queue):
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    run = _case(name, device)
    run()  # warm-up
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    _reset_peak_rss()  # if not allowed, the figure includes import-time peaks (an upper bound)
    before = _rss_mb()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = max(0.0, _peak_rss_mb() - before)
    cpu1 = float("nan")
    if device == "cpu":
        cpu1, _ = cpu_1thread(run, repeats)
    queue.put((statistics.median(times), peak, cpu1))


def measure(name, device, repeats, threads):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_measure, args=(name, device, repeats, threads, q))
    p.start()
    result = q.get()
    p.join()
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--skip-60k", action="store_true")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads of the timed runs")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error("--threads must be >= 1")

    import torch

    print(f"torch {torch.__version__}, device {args.device}, threads {args.threads}, B={B}, D={D}; {load_text()}")
    names = [
        "SupConLoss(cos) fwd+bwd [baseline]",
        "HardNegativeProbabilityMiner(top_k=5)",
        "HardNegativeProbabilityMiner(threshold=0.01)",
        "HardNegativeProbabilityMiner() [p > uniform]",
        "MixedGeometryMiner(cos+Poincare, top_k=5)",
        "HierarchicalSimilarityMiner(K=4, 100/anchor)",
        "HierarchicalPseudoLabeler exact, N=900",
    ]
    rows = []
    base = None
    base_cpu = None
    for name in names:
        t, mem, cpu1 = measure(name, args.device, args.repeats, args.threads)
        base = t if base is None else base
        base_cpu = cpu1 if base_cpu is None else base_cpu
        rows.append((name, t, t / base, cpu1, cpu1 / base_cpu, mem))
    if not args.skip_60k:
        t, mem, cpu1 = measure("HierarchicalPseudoLabeler approx, N=60000", args.device, 1, args.threads)
        rows.append(("HierarchicalPseudoLabeler approx, N=60000 (target < 60 s)", t, t / base, cpu1,
                     cpu1 / base_cpu, mem))
    width = max(len(r[0]) for r in rows)
    print(f"{'component':<{width}}  {'wall [ms]':>10}  {'x baseline':>10}  {'1t CPU [ms]':>11}  "
          f"{'x baseline':>10}  {'peak MB':>8}")
    for name, t, ratio, cpu1, cpu_ratio, mem in rows:
        print(f"{name:<{width}}  {1000 * t:>10.1f}  {ratio:>10.2f}  {1000 * cpu1:>11.1f}  {cpu_ratio:>10.2f}  "
              f"{mem:>8.1f}")
    print(load_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
