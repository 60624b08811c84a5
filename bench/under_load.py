"""Hot paths at 1 vs 2 torch threads, on the machine as it is ("idle") and under a synthetic load
that this bench starts itself (one busy process per usable core, stopped in a ``finally``).

    python -m bench under_load                      # all cases, 2 interleaved repeats
    python -m bench under_load --cases delta,knn --repeats 3 --pseudo-n 20000

Cases: ``gromov_delta`` n = 2,000 (D = 384, float64); the hierarchical pseudo-labeller (approximate
path) on --pseudo-n points (default 60,000 × 128); exact kNN (HyperbolicKNN, self-retrieval,
exact_ranks 1/2/4/8) at the Cars size 8,131 × 128, k = 8; ``poincare_ball.pairwise_dist``
forward at N = 4,096, D = 128 (float32; no grad).

For every case and phase the 1-thread and 2-thread runs alternate (1, 2, 1, 2, ...) in one
process; the table gives medians of the wall times, their ratio (target: 2-thread wall
≤ 1.5× 1-thread wall under load), the process CPU time of each (all threads: spin-waiting at a
barrier shows up as CPU time well above the 1-thread figure), and the 1-minute load average at the
end of the case. The machine is shared: "idle" means without *our* synthetic load, whatever else
runs; compare figures within one run only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
from bench._load import synthetic_load, usable_cores  # noqa: E402

from pml_hyperbolic import poincare_ball as pb  # noqa: E402


def _case_delta():
    from pml_hyperbolic.evaluation import gromov_delta

    x = torch.randn(2000, 384, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return lambda: gromov_delta(x)


def _case_pseudo(n):
    from pml_hyperbolic.miners import HierarchicalPseudoLabeler

    g = torch.Generator().manual_seed(0)
    centers = torch.randn(300, 128, generator=g)
    x = centers[torch.randint(0, 300, (n,), generator=g)] + 0.7 * torch.randn(n, 128, generator=g)
    x = pb.project(pb.expmap0(0.25 * x, 0.1), 0.1)
    labeler = HierarchicalPseudoLabeler(levels=(100, 70, 40, 10))
    return lambda: labeler.fit_predict(x)


def _case_knn():
    from bench.knn import make_embeddings

    from pml_hyperbolic.evaluation import HyperbolicKNN

    x = make_embeddings(8131, 128, 0.1, seed=0)
    knn = HyperbolicKNN(c=0.1, exact_ranks=(1, 2, 4, 8))
    return lambda: knn(x, 8, x, True)


def _case_pairwise():
    g = torch.Generator().manual_seed(0)
    x = pb.project(pb.expmap0(0.2 * torch.randn(4096, 128, generator=g), 0.1), 0.1)

    def run():
        with torch.no_grad():
            return pb.pairwise_dist(x, x, 0.1)

    return run


CASES = {
    "delta": ("gromov_delta n=2000 D=384", lambda a: _case_delta()),
    "pseudo": (None, lambda a: _case_pseudo(a.pseudo_n)),
    "knn": ("HyperbolicKNN Cars 8131 k=8", lambda a: _case_knn()),
    "pairwise": ("pairwise_dist fwd N=4096 D=128", lambda a: _case_pairwise()),
}


def _timed(run, threads):
    torch.set_num_threads(threads)
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(run, repeats):
    """Median (wall, cpu) at 1 and at 2 threads, runs interleaved; one warm-up of each first."""
    _timed(run, 1)
    _timed(run, 2)
    one, two = [], []
    for _ in range(repeats):
        one.append(_timed(run, 1))
        two.append(_timed(run, 2))
    med = lambda rows, i: statistics.median(r[i] for r in rows)  # noqa: E731
    return med(one, 0), med(one, 1), med(two, 0), med(two, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="delta,pseudo,knn,pairwise",
                    help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--pseudo-n", type=int, default=60000)
    ap.add_argument("--skip-idle", action="store_true", help="only the loaded phase")
    ap.add_argument("--load-workers", type=int, default=None, help="busy processes (default: one per core)")
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    torch.set_num_threads(2)
    print(f"# bench/under_load.py  torch {torch.__version__}  usable cores {usable_cores()}  "
          f"repeats {args.repeats} (medians, 1t/2t interleaved)")
    runs = {}
    for key in names:
        label, make = CASES[key]
        runs[key] = (label or f"HierarchicalPseudoLabeler N={args.pseudo_n} D=128", make(args))
    print("| phase | case | 1t wall (s) | 2t wall (s) | 2t/1t wall | 1t CPU (s) | 2t CPU (s) | load avg 1m |")
    print("|---|---|---|---|---|---|---|---|")

    def phase(tag):
        for key in names:
            label, run = runs[key]
            w1, c1, w2, c2 = measure(run, args.repeats)
            print(f"| {tag} | {label} | {w1:.3f} | {w2:.3f} | {w2 / w1:.2f} | {c1:.3f} | {c2:.3f} | "
                  f"{os.getloadavg()[0]:.2f} |", flush=True)

    if not args.skip_idle:
        phase("idle")
    with synthetic_load(args.load_workers):
        phase("load")
    return 0


if __name__ == "__main__":
    sys.exit(main())
