"""Forward + backward time and peak memory of each pml_hyperbolic loss at B = 900, D = 128
(100 classes x 9), as a ratio to PML's SupConLoss(CosineSimilarity) measured in the same run,
followed by the miners' table of bench/miners.py unless --no-miners.

    python -m bench losses [--reps 5] [--threads N] [--device cpu|cuda] [--no-miners] [--only SUBSTR ...]

Time: one warm-up step per case, then --reps rounds; every round runs each case once, in turn
(interleaved, so a change of machine load hits all cases alike); the table shows the median.
Input: raw N(0, 1) features -> ToPoincare(c=0.1) (hyperbolic cases) or as is (cosine / HypMix) ->
loss -> backward; the head's cost is included.

Peak memory (CPU): each case runs in a fresh subprocess with glibc's mmap threshold pinned at
64 KiB (MALLOC_MMAP_THRESHOLD_, so every freed tensor goes back to the OS instead of staying in
malloc's heap); after one warm-up step the kernel's peak-RSS counter is reset (write "5" to
/proc/self/clear_refs) and the figure is VmHWM after ONE fwd+bwd minus VmRSS right before it, i.e.
everything that step allocated at its high point (inputs and module state excluded). Where
clear_refs is refused the column reads "n/a". CUDA: torch.cuda.max_memory_allocated over one step
minus memory_allocated before it.
Target: every loss <= 2x the baseline time.
"""
import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BASELINE = "SupConLoss(CosineSimilarity) [baseline]"
BATCH, PER_CLASS = 900, 9  # 100 classes x 9 samples
ALL_TRIPLETS = BATCH * (PER_CLASS - 1) * (BATCH - PER_CLASS)  # anchor x positive x negative


def _learnable_geometry():
    from pml_hyperbolic.geometry import PoincareGeometry

    return PoincareGeometry(c=0.1, learnable_c=True)


def make(name):
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.losses import SupConLoss, TripletMarginLoss
    from pml_hyperbolic import losses as L
    from pml_hyperbolic.distances import PoincareDistance
    table = {
        BASELINE: lambda: SupConLoss(temperature=0.1, distance=CosineSimilarity()),
        "PairwiseCrossEntropyLoss": lambda: L.PairwiseCrossEntropyLoss(),
        "PairwiseCrossEntropyLoss(view_pairs=True)": lambda: L.PairwiseCrossEntropyLoss(view_pairs=True),
        "PairwiseCrossEntropyLoss(CosineSimilarity, tau=0.1)":
            lambda: L.PairwiseCrossEntropyLoss(temperature=0.1, distance=CosineSimilarity()),
        "HypMixLoss": lambda: L.HypMixLoss(),
        "HypMixLoss(c=[0.1, 1.0], lam=[3, 1])": lambda: L.HypMixLoss(c=[0.1, 1.0], lam=[3.0, 1.0]),
        "UncertaintyAdaptiveContrastiveLoss": lambda: L.UncertaintyAdaptiveContrastiveLoss(),
        f"UncertaintyAdaptiveTripletLoss (all {ALL_TRIPLETS / 1e6:.2f}M triplets)": lambda: L.UncertaintyAdaptiveTripletLoss(),
        "HierarchicalLogRatioLoss (1-D labels)": lambda: L.HierarchicalLogRatioLoss(),
        "HierarchicalLogRatioLoss (N x 2 labels)": lambda: L.HierarchicalLogRatioLoss(),
        "HierarchicalMarginLoss": lambda: L.HierarchicalMarginLoss(num_classes=100),
        "HierarchicalMarginLoss(margin_form='contrastive') [paper]":
            lambda: L.HierarchicalMarginLoss(num_classes=100, margin_form="contrastive", gamma=0.1),
        "HIERLoss (512 proxies, 8192 + 8192 triplets)": lambda: L.HIERLoss(embedding_size=128),
        "PairwiseCrossEntropyLoss(PoincareDistance(PoincareGeometry(learnable c)))":
            lambda: L.PairwiseCrossEntropyLoss(distance=PoincareDistance(c=_learnable_geometry())),
        "[ref] PML TripletMarginLoss(PoincareDistance), all triplets":
            lambda: TripletMarginLoss(distance=PoincareDistance(c=0.1)),
    }
    return table[name]() if name is not None else list(table)


def inputs(name, device, seed=0):
    from pml_hyperbolic.heads import ToPoincare
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(BATCH, 128, generator=g).to(device)
    y = torch.arange(BATCH // PER_CLASS, device=device).repeat_interleave(PER_CLASS)
    if "N x 2" in name:
        y = torch.stack([y, y // 10], 1)
    hyperbolic = not ("Cosine" in name or "HypMix" in name)
    return raw, y, (ToPoincare(c=0.1).to(device) if hyperbolic else None)


def step(loss_fn, raw, y, head):
    x = raw.clone().requires_grad_()
    z = head(x) if head is not None else x
    loss_fn(z, y).backward()


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_all(names, reps, device):
    prepared = {n: (make(n).to(device), *inputs(n, device)) for n in names}
    times = {n: [] for n in names}
    for n in names:
        step(*prepared[n])  # warm-up
    for _ in range(reps):
        for n in names:
            _sync(device)
            t0 = time.perf_counter()
            step(*prepared[n])
            _sync(device)
            times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(v) for n, v in times.items()}


def _status_mib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024  # kB -> MiB
    raise KeyError(key)


def peak_memory_child(name, device):
    """MiB allocated at the high point of one fwd+bwd (see the module docstring), or None."""
    loss, raw, y, head = make(name).to(device), *inputs(name, device)
    step(loss, raw, y, head)  # warm-up: lazy initialisation, thread pools
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(loss, raw, y, head)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    before = _status_mib("VmRSS")
    step(loss, raw, y, head)
    return _status_mib("VmHWM") - before


def peak_memory(name, device):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")  # fixed threshold: freed tensors are unmapped
    out = subprocess.run([sys.executable, "-m", "bench.losses", "--child", name, "--device", device,
                          "--threads", str(torch.get_num_threads())],
                         capture_output=True, text=True, env=env, cwd=str(Path(__file__).resolve().parents[1]))
    if out.returncode != 0:
        return "fail"
    value = json.loads(out.stdout.strip().splitlines()[-1])
    return "n/a" if value is None else f"{value:.1f}"


def miners_table(reps, device):
    """Print bench/miners.py's table (run as is in a child process: it spawns
    its own measurement processes, which need an importable module)."""
    path = Path(__file__).with_name("miners.py")
    if not path.exists():
        print("(no bench/miners.py: miners not benchmarked)")
        return
    print("\nMiners (`python -m bench miners --skip-60k`, same baseline; the 60k "
          "pseudo-labeller row: run it without --skip-60k):", flush=True)
    # Its measurements run in spawned subprocesses: pin glibc's mmap threshold there too (sound
    # RSS peaks) and give them our thread count.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(torch.get_num_threads()))
    out = subprocess.run([sys.executable, "-m", "bench.miners", "--repeats", str(reps), "--device", device, "--skip-60k"],
                         capture_output=True, text=True, env=env, cwd=str(path.parents[1]))
    print(out.stdout.rstrip())
    if out.returncode != 0:
        print(f"(bench/miners.py failed, exit {out.returncode}; run `python -m bench miners`)")
        print(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-miners", action="store_true", help="skip the miners' table")
    ap.add_argument("--only", nargs="*", default=None, help="substrings selecting cases (baseline always)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads; default: 1 when the 1-min load average exceeds the CPU count "
                         "(oversubscribed OpenMP barriers then dominate every op), else torch's default")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    if args.threads is None and load0 > (os.cpu_count() or 1):
        args.threads = 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.child is not None:
        print(json.dumps(peak_memory_child(args.child, args.device)))
        return
    names = make(None)
    if args.only:
        names = [BASELINE] + [n for n in names[1:] if any(s in n for s in args.only)]
    t_start = time.perf_counter()
    t = time_all(names, args.reps, args.device)
    base = t[BASELINE]
    print(f"B=900 (100 classes x 9), D=128, device={args.device}, torch {torch.__version__}, "
          f"threads={torch.get_num_threads()}, cpus={os.cpu_count()}, median of {args.reps} interleaved rounds, "
          f"1-min load average {load0:.1f} at start")
    print("peak MiB = one fwd+bwd's high point over the RSS before it (fresh subprocess after a warm-up step, "
          "VmHWM reset via /proc/self/clear_refs, MALLOC_MMAP_THRESHOLD_=65536)" if args.device == "cpu"
          else "peak MiB = torch.cuda.max_memory_allocated over one fwd+bwd minus the allocation before it")
    print(f"{'loss':62s} {'fwd+bwd ms':>10s} {'x SupCon':>9s} {'peak MiB':>9s}")
    rows = []
    for n in names:
        peak = peak_memory(n, args.device)
        print(f"{n:62s} {1000 * t[n]:10.1f} {t[n] / base:9.2f} {peak:>9s}", flush=True)
        rows.append({"loss": n, "baseline": BASELINE, "device": args.device, "fwd+bwd ms": round(1000 * t[n], 2),
                     "ratio": round(t[n] / base, 3), "peak MiB": peak})
    print(f"(losses: {time.perf_counter() - t_start:.0f} s, 1-min load average {os.getloadavg()[0]:.1f} at end)")
    if not args.no_miners:
        miners_table(args.reps, args.device)
    return rows


if __name__ == "__main__":
    main()
