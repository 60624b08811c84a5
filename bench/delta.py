"""δ-hyperbolicity: blocked (max, min) product (gromov_delta) vs a naive n×n×n broadcast.

    python -m bench delta            # n = 2000 (ours) and the naive baseline on n = 400/600
    python -m bench delta --n 1000

Same run, CPU, --threads threads (gromov_delta itself drops to 1 thread when the machine's cores
are taken; see pml_hyperbolic.kernels.threads). Each time is the wall time at --threads with the 1-thread
CPU time of the same call beside it (the figure a busy machine distorts least); the load average
is printed with the table. Peak memory: tracemalloc cannot see torch buffers, so the bench
reports the analytical size of the largest temporary (ours: G + one tile; naive: n³ floats), the
process peak RSS after each step (a running maximum), and for n the measured peak RSS growth of one
gromov_delta call in a fresh process.
"""
import argparse
import resource
import sys
import time
from pathlib import Path

import torch

from bench._load import cpu_1thread, load_text  # noqa: E402

from pml_hyperbolic.evaluation import gromov_delta, relative_delta, suggest_curvature  # noqa: E402
from pml_hyperbolic.evaluation.delta_hyperbolicity import BLOCK_COLS, BLOCK_ROWS  # noqa: E402


def naive(D):
    G = 0.5 * (D[0][:, None] + D[0][None, :] - D)
    return float((torch.minimum(G[:, :, None], G[None, :, :]).amax(1) - G).max())


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


_PEAK_SNIPPET = """
import re, torch
from pml_hyperbolic.evaluation import gromov_delta
torch.set_num_threads({threads})
def field(name):
    return int(re.search(name + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1)) / 1024
x = torch.randn({n}, {dim}, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
except OSError:
    pass
before = field("VmRSS")
gromov_delta(x, dtype=torch.{dtype})
print(field("VmHWM") - before)
"""


def peak_rss_growth_mb(n, dim, dtype, threads):
    """Peak RSS growth of one gromov_delta call on n x dim points, measured in a fresh process
    (VmHWM reset through /proc/self/clear_refs just before the call), so earlier steps do not hide it."""
    import subprocess

    code = _PEAK_SNIPPET.format(threads=threads, n=n, dim=dim,
                                dtype=dtype)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--naive-n", type=int, nargs="+", default=[400, 600])
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"# bench/delta.py  threads={args.threads}  dim={args.dim}  {load_text()}")
    print("| n | method | dtype | wall (s) | 1-thread CPU (s) | largest temporary (MB) | peak RSS (MB) | delta |")
    print("|---|---|---|---|---|---|---|---|")
    for n in args.naive_n:
        x = torch.randn(n, args.dim, generator=g, dtype=torch.float64)
        D = torch.cdist(x, x)
        t = time.perf_counter()
        ref = naive(D)
        t_naive = time.perf_counter() - t
        c_naive, _ = cpu_1thread(lambda: naive(D))
        print(f"| {n} | naive broadcast | float64 | {t_naive:.2f} | {c_naive:.2f} | {n ** 3 * 8 / 2**20:.0f} | "
              f"{rss_mb():.0f} | {ref:.6f} |")
        for dt in (torch.float64, torch.float32):
            t = time.perf_counter()
            ours = gromov_delta(distances=D, dtype=dt)
            t_ours = time.perf_counter() - t
            c_ours, _ = cpu_1thread(lambda: gromov_delta(distances=D, dtype=dt))
            tmp = (n * n + BLOCK_ROWS * BLOCK_COLS * n) * (8 if dt == torch.float64 else 4) / 2**20
            print(f"| {n} | gromov_delta (blocked) | {str(dt)[6:]} | {t_ours:.2f} | {c_ours:.2f} | {tmp:.1f} | "
                  f"{rss_mb():.0f} | {ours:.6f} (|diff| {abs(ours - ref):.1e}; speed-up {t_naive / t_ours:.1f}x "
                  f"wall, {c_naive / c_ours:.1f}x 1-thread CPU) |")
    n = args.n
    x = torch.randn(n, args.dim, generator=g, dtype=torch.float64)
    for dt in (torch.float32, torch.float64):
        t = time.perf_counter()
        val = gromov_delta(x, dtype=dt)
        tm = time.perf_counter() - t
        cm, _ = cpu_1thread(lambda: gromov_delta(x, dtype=dt))
        tmp = (n * n + BLOCK_ROWS * BLOCK_COLS * n) * (8 if dt == torch.float64 else 4) / 2**20
        print(f"| {n} | gromov_delta (blocked) | {str(dt)[6:]} | {tm:.2f} | {cm:.2f} | {tmp:.1f} | {rss_mb():.0f} | "
              f"{val:.6f} |")
    print(load_text())
    print(f"(naive at n={n} would need an n^3 float64 temporary of {n ** 3 * 8 / 2**30:.0f} GB)")
    for dt in ("float32", "float64"):
        print(f"peak RSS growth of gromov_delta, n={n} x {args.dim}, {dt} (fresh process, VmHWM): "
              f"{peak_rss_growth_mb(n, args.dim, dt, args.threads):.0f} MB")
    t, cpu = time.perf_counter(), time.process_time()
    m, s = relative_delta(x, n_samples=500, n_draws=5, return_std=True)
    c = suggest_curvature(x, n_samples=500, n_draws=5)
    print(f"\nsampled relative_delta (5 draws x 500 points): {m:.4f} +- {s:.4f}; "
          f"suggest_curvature(x, n_samples=500, n_draws=5) = {c:.4f}; both in {time.perf_counter() - t:.2f} s wall, "
          f"{time.process_time() - cpu:.2f} s CPU at --threads ({load_text()})")


if __name__ == "__main__":
    main()
