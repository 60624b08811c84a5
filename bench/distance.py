"""Benchmark: all-pairs distance matrices, forward and forward+backward, on CPU.

Prints one table per size with the median time of each implementation as a ratio to PML's
``CosineSimilarity`` measured in the same run (the repeats of the fast methods are interleaved so
that load from other processes hits all of them alike), plus the peak extra memory of one
forward+backward, and the headline ratio of issue 2 (target <= 1.5). Exit code 0 either way: it
is a report, not a test.

Methods (all float32, inputs are points of the c = 0.1 ball, like HyperbolicEmbeddingHead output):
  pairwise_dist(x, x)      pml_hyperbolic.poincare_ball.pairwise_dist with one tensor twice, as PML's
                           losses call compute_mat(emb, emb)           <- the headline
  pairwise_dist(x, y)      the same kernel with two different tensors (no symmetry shortcut)
  PoincareDistance         the PML distance class (NaN check + projection + pairwise_dist)
  PoincareDistance(geometry), (learnable c)   the same on a shared PoincareGeometry, fixed / learnable c
  CosineSimilarity         PML, the baseline (normalise + one matmul)
  LpDistance               PML (torch.cdist)
  hypll cdist              hypll PoincareBall.cdist (Möbius addition broadcast over N×M×D)
  Möbius broadcast         the papers' code: artanh(sqrt(c)·‖(−x) ⊕ y‖) with x[:, None], y[None]

Peak memory: each case runs once more in a fresh subprocess, which resets the kernel's
high-water mark of resident memory (write 5 to /proc/self/clear_refs) and reports VmHWM after one
forward+backward minus VmRSS just before it. torch's CPU allocator returns large blocks to the OS, so this is the peak
of the memory the case itself needed (inputs excluded).

Usage:  python bench/distance.py            (N=M=900 and N=M=4096, D=128, ~2-3 min)
        python bench/distance.py --quick    (N=M=900 only)
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance
from pytorch_metric_learning.distances import CosineSimilarity, LpDistance

C = 0.1
BROADCAST_LIMIT_BYTES = 8e9  # skip N×M×D methods whose single N×M×D float32 tensor exceeds this


def ball_points(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return pb.expmap0(torch.randn(n, dim, generator=g) * 0.2, C)


def mobius_broadcast_dist(x: torch.Tensor, y: torch.Tensor, c: float = C) -> torch.Tensor:
    """The N×M×D implementation found in the papers' code: (−x) ⊕ y broadcast, then artanh."""
    u, v = -x[:, None, :], y[None, :, :]
    uv = (u * v).sum(-1, keepdim=True)
    u2, v2 = (u * u).sum(-1, keepdim=True), (v * v).sum(-1, keepdim=True)
    num = (1 + 2 * c * uv + c * v2) * u + (1 - c * u2) * v
    den = 1 + 2 * c * uv + c * c * u2 * v2
    norm = (num / den.clamp_min(1e-15)).norm(dim=-1)
    return 2 / math.sqrt(c) * torch.atanh((math.sqrt(c) * norm).clamp_max(1 - 1e-5))


def make_methods():
    from hypll.manifolds.poincare_ball import Curvature, PoincareBall
    from hypll.tensors import ManifoldTensor

    ball = PoincareBall(Curvature(C, constraining_strategy=lambda v: v))  # exactly c = 0.1
    from pml_hyperbolic.geometry import PoincareGeometry

    cosine, lp, poincare = CosineSimilarity(), LpDistance(), PoincareDistance(c=C)
    on_geometry = PoincareDistance(c=PoincareGeometry(c=C))  # the shared geometry object, fixed c
    on_learnable = PoincareDistance(c=PoincareGeometry(c=C, learnable_c=True))  # gradient to c as well

    def hypll_cdist(x, y):
        mx = ManifoldTensor(x[None], manifold=ball, man_dim=-1)
        my = ManifoldTensor(y[None], manifold=ball, man_dim=-1)
        return ball.cdist(mx, my)[0]

    # name -> (function of (x, y_or_None), needs an N×M×D tensor)
    return {
        "pairwise_dist(x, x)": (lambda x, y: pb.pairwise_dist(x, x, C), False),
        "pairwise_dist(x, y)": (lambda x, y: pb.pairwise_dist(x, y, C), False),
        "PoincareDistance": (lambda x, y: poincare(x, x), False),
        "PoincareDistance(geometry)": (lambda x, y: on_geometry(x, x), False),
        "PoincareDistance(learnable c)": (lambda x, y: on_learnable(x, x), False),
        "CosineSimilarity": (lambda x, y: cosine(x, x), False),
        "LpDistance": (lambda x, y: lp(x, x), False),
        "hypll cdist": (lambda x, y: hypll_cdist(x, x), True),
        "Möbius broadcast": (lambda x, y: mobius_broadcast_dist(x, x), True),
    }


def run_once(fn, x0, y0, backward: bool) -> float:
    x = x0.detach().clone().requires_grad_(True)
    y = y0.detach().clone().requires_grad_(True)
    start = time.perf_counter()
    out = fn(x, y)
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def memory_case(name: str, n: int, dim: int) -> None:
    """Subprocess entry: print the peak extra resident memory (bytes) of one forward+backward."""
    fn = make_methods()[name][0]
    x0, y0 = ball_points(n, dim, 0), ball_points(n, dim, 1)
    if n <= 1024:  # warm up code paths (lazy inits) without raising the high-water mark much
        run_once(fn, x0[:64], y0[:64], True)
    before = rss_bytes("VmRSS")
    try:  # reset the kernel's high-water mark (VmHWM) so the import-time peak does not count
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        reset = True
    except OSError:
        reset = False
    run_once(fn, x0, y0, True)
    peak = rss_bytes("VmHWM") if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(max(0, peak - before))


def measure_memory(name: str, n: int, dim: int) -> str:
    try:
        out = subprocess.run(
            [sys.executable, __file__, "--memory-case", name, str(n), str(dim)],
            capture_output=True, text=True, timeout=600, check=True,
        ).stdout.split()[-1]
        return f"{int(out) / 2**20:,.0f} MB"
    except Exception as exc:  # a report, not a test: say what failed
        return f"n/a ({type(exc).__name__})"


def bench_size(n: int, dim: int, repeats: int, slow_repeats: int, memory: bool):
    methods = make_methods()
    x0, y0 = ball_points(n, dim, 0), ball_points(n, dim, 1)
    broadcast_bytes = n * n * dim * 4
    fast = [k for k, (_, big) in methods.items() if not big]
    slow = [k for k, (_, big) in methods.items() if big]
    times = {k: {"fwd": [], "fb": []} for k in methods}
    skipped = {}
    for k in slow:
        if broadcast_bytes > BROADCAST_LIMIT_BYTES:
            skipped[k] = f"skipped (N×M×D = {broadcast_bytes / 1e9:.1f} GB)"
    for k in fast:  # warm-up
        run_once(methods[k][0], x0, y0, True)
    for _ in range(repeats):  # interleaved: every method sees the same background load
        for k in fast:
            times[k]["fwd"].append(run_once(methods[k][0], x0, y0, False))
            times[k]["fb"].append(run_once(methods[k][0], x0, y0, True))
    for k in slow:
        if k in skipped:
            continue
        for _ in range(slow_repeats):
            times[k]["fwd"].append(run_once(methods[k][0], x0, y0, False))
            times[k]["fb"].append(run_once(methods[k][0], x0, y0, True))
            # baseline re-measured next to the slow method, so its ratio is same-run too
            times["CosineSimilarity"]["fwd"].append(run_once(methods["CosineSimilarity"][0], x0, y0, False))
            times["CosineSimilarity"]["fb"].append(run_once(methods["CosineSimilarity"][0], x0, y0, True))
    med = {k: {p: statistics.median(v[p]) for p in v} for k, v in times.items() if k not in skipped}
    base = med["CosineSimilarity"]
    print(f"\nN = M = {n}, D = {dim}, float32, {torch.get_num_threads()} threads "
          f"(medians of {repeats} interleaved repeats; {slow_repeats} for the N×M×D methods)")
    header = f"| {'method':22s} | {'fwd ms':>9s} | {'fwd ratio':>9s} | {'fwd+bwd ms':>10s} | {'fwd+bwd ratio':>13s} | {'peak mem':>12s} |"
    print(header)
    print("|" + "|".join("-" * (len(col)) for col in header.split("|")[1:-1]) + "|")
    for k in methods:
        if k in skipped:
            print(f"| {k:22s} | {skipped[k]:>64s} |")
            continue
        mem = measure_memory(k, n, dim) if memory else "-"
        m = med[k]
        print(f"| {k:22s} | {m['fwd'] * 1e3:9.2f} | {m['fwd'] / base['fwd']:9.2f} | {m['fb'] * 1e3:10.2f} | "
              f"{m['fb'] / base['fb']:13.2f} | {mem:>12s} |")
    return med


def log1p_from_log_(u: torch.Tensor, block_elements: int = 1 << 16) -> torch.Tensor:
    """In-place log1p(u), u >= 0, as u·log(v)/(v − 1) with v = 1 + u rounded (Goldberg's form), in row
    blocks: the kernel's choice before 2026-11-25, when aten's CPU log1p measured as a scalar loop."""
    rows = max(1, block_elements // max(1, u.shape[-1]))
    for start in range(0, u.shape[0], rows):
        blk = u[start:start + rows]
        v = blk + 1.0
        den = v - 1.0  # before v is overwritten by its log
        blk.mul_(torch.nan_to_num_(v.log_().div_(den), nan=1.0))
    return u


def compare_log1p(repeats: int) -> None:
    """Which in-place log1p is fastest (and most accurate) on the installed torch: the kernel uses aten's."""
    print("\nlog1p on the kernel's elementwise tail (u = W + √2·S >= 0), 1-thread medians:")
    print("| n × n | aten log1p_ ms | log-based ms | ratio | max rel err aten | max rel err log-based |")
    print("|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for n in (900, 4096):
        u = torch.rand(n, n, generator=g) * 3
        ref = u.double().log1p()
        times = {"aten": [], "log": []}
        for _ in range(repeats):
            for name, fn in (("aten", lambda t: t.log1p_()), ("log", log1p_from_log_)):
                t = u.clone()
                start = time.perf_counter()
                fn(t)
                times[name].append(time.perf_counter() - start)
        err = {name: float(((fn(u.clone()).double() - ref) / ref.clamp_min(1e-30)).abs().max())
               for name, fn in (("aten", lambda t: t.log1p_()), ("log", log1p_from_log_))}
        a, b = statistics.median(times["aten"]), statistics.median(times["log"])
        print(f"| {n} × {n} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} | {err['aten']:.1e} | {err['log']:.1e} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only N = M = 900")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--log1p", action="store_true", help="also compare the kernel's log1p with a log-based form")
    parser.add_argument("--memory-case", nargs=3, metavar=("NAME", "N", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_case:
        name, n, dim = args.memory_case
        memory_case(name, int(n), int(dim))
        return 0
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, c = {C}")
    med = bench_size(900, 128, args.repeats, 3, not args.no_memory)
    if not args.quick:
        bench_size(4096, 128, max(5, args.repeats // 6), 2, not args.no_memory)
    ratio = med["pairwise_dist(x, x)"]["fb"] / med["CosineSimilarity"]["fb"]
    print(f"\npairwise_dist fwd+bwd / CosineSimilarity = {ratio:.2f} (target ≤ 1.5)")
    if args.log1p:
        compare_log1p(max(5, args.repeats // 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
