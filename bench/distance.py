"""Benchmark: all-pairs distance matrices, forward and forward+backward, on CPU.

Prints one table per size with the median time of each implementation as a ratio to PML's
``CosineSimilarity`` measured in the same run (the repeats of the fast methods are interleaved so
that load from other processes hits all of them alike), plus the peak extra memory of one
forward+backward, and the headline ratio (target <= 1.5). Exit code 0 either way: it
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

Radial cases (``--radial``): the kernel's cost and error depend on where the points lie
(near the origin its closeness test and log1p work hardest), so the same ratios are taken on
head-like points, hyperbolic radii d₀ uniform in [1, 2.5], [0, 2.5] and [0, 0.5] (four seeds), all
points at the origin, d₀ in [15, 30] and points at ``project``'s edge: fwd+bwd as a ratio to
``CosineSimilarity`` fwd+bwd, fwd as a ratio to a GEMM ``x @ x.T`` of the same shape (1-thread CPU
time, interleaved), the max error against a float64 reference, and the load average. The "tail"
column says which elementwise tail ran: the fused native loop (``pml_hyperbolic/kernels/native.py``) or
the torch ops.

Usage:  python -m bench distance            (N=M=900 and N=M=4096, D=128, ~2-3 min)
        python -m bench distance --quick    (N=M=900 only)
        python -m bench distance --radial [--quick] [--log1p]   (~2 min; --quick: N = 900 only)
        python -m bench distance --radial --native-vs-torch   (the kernel's fused native tail and its
                                    torch fallback side by side; --no-native: the torch tail only)
        python -m bench distance --radial --symmetric-vs-general   (x is y: the symmetric path
                                    (triangular product, native symmetric tail) against the general
                                    path with the native tail, side by side in one run)
        python -m bench distance --symmetric-parts [--quick]   (the symmetric forward's parts: the
                                    triangular product, its tail per block or after, the row terms)
        python -m bench distance --log1p    (adds aten log1p_ vs the kernel's log-based form)
        python -m bench distance --steady-allocator   (no N×N buffer comes with fresh pages, see below)

Allocator state. A fresh N×N buffer costs page faults when glibc's malloc serves it from new pages:
always above its largest dynamic mmap threshold (32 MiB, e.g. 4096² float32), and at 900² (3.2 MB)
depending on the process's history (the threshold rises after a large buffer is freed, and the heap
top is trimmed back to the OS past the trim threshold). The baseline's own backward allocates three
such buffers, the kernel one, so at N = 900 the ratio moves between runs with that history.
``--steady-allocator`` pins both thresholds high (``mallopt`` at start; glibc only, refused elsewhere)
so that freed buffers are reused without page faults: the steady state of a training loop at that
batch size. Each row then records ``"allocator": "steady"`` (else ``"default"``).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
            [sys.executable, "-m", "bench.distance", "--memory-case", name, str(n), str(dim)], cwd=ROOT,
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


# ------------------------------------------------------------------ radial distributions
def radial_points(n: int, dim: int, d0_low: float, d0_high: float, seed: int) -> torch.Tensor:
    """float32 points of the c = 0.1 ball in random directions whose HYPERBOLIC distance to the
    origin d₀ = (2/√c)·artanh(√c‖x‖) is uniform in [d0_low, d0_high] (made in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    direction = torch.randn(n, dim, generator=g, dtype=torch.float64)
    direction = direction / direction.norm(dim=1, keepdim=True)
    d0 = d0_low + (d0_high - d0_low) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return (direction * torch.tanh(math.sqrt(C) * d0 / 2) / math.sqrt(C)).float()


def radial_cases(n: int, dim: int) -> dict:
    """name -> N×D float32 points. Near the boundary, d₀ ∈ [15, 30] is 1 − c‖x‖² ∈ [3e-4, 0.035]
    (regular points: the kernel keeps a point out of its Gram product, as "extreme", only below
    1e-5, i.e. d₀ ≳ 40); "project edge" puts every point where ``project`` clips, 1 − √c‖x‖ = 1e-5."""
    cases = {"head-like": ball_points(n, dim, 0),
             "d0 in [1, 2.5]": radial_points(n, dim, 1.0, 2.5, 0),
             "d0 in [0, 2.5]": radial_points(n, dim, 0.0, 2.5, 0)}
    for seed in range(4):
        cases[f"d0 in [0, 0.5] seed {seed}"] = radial_points(n, dim, 0.0, 0.5, seed)
    cases["all at the origin"] = torch.zeros(n, dim)
    cases["near boundary d0 in [15, 30]"] = radial_points(n, dim, 15.0, 30.0, 0)
    cases["project edge"] = pb.project(radial_points(n, dim, 60.0, 60.0, 0), C)
    return cases


def reference_dist(x: torch.Tensor) -> torch.Tensor:
    """float64 distances of the float32 points x to themselves. The Gram form's float64 error,
    ~1e-16·(‖x‖² + ‖y‖²), is far below float32's for these cases (no near-duplicate pairs; the
    diagonal is set to 0), and at N = 4096 explicit differences would take minutes."""
    xd = x.double()
    x2 = (xd * xd).sum(1)
    s = (x2[:, None] + x2[None] - 2 * (xd @ xd.T)).clamp_min_(0).fill_diagonal_(0)
    a = 1 - C * x2
    return 2 / math.sqrt(C) * torch.asinh(torch.sqrt(C * s / (a[:, None] * a[None])))


def cpu_time(fn, x0: torch.Tensor, backward: bool) -> float:
    """1-thread CPU seconds (time.process_time) of fn(x, x), with the backward of its sum."""
    x = x0.detach().clone().requires_grad_(backward)
    start = time.process_time()
    out = fn(x)
    if backward:
        out.sum().backward()
    return time.process_time() - start


def _set_tail_path(path: str) -> None:
    """Select the kernel's path for the following calls: "native" (the fused C loops, if they build
    here, with the symmetric path for x is y), "general" (the native tail without the symmetric
    path, as with PML_HYPERBOLIC_SYMMETRIC=0) or "torch" (the torch ops, as with
    PML_HYPERBOLIC_NATIVE=0)."""
    os.environ["PML_HYPERBOLIC_NATIVE"] = "0" if path == "torch" else "1"
    os.environ["PML_HYPERBOLIC_SYMMETRIC"] = "0" if path == "general" else "1"


def bench_radial(sizes, dim: int, repeats: int, paths=("native",)) -> list:
    """Per radial case: pairwise_dist fwd+bwd / CosineSimilarity fwd+bwd, pairwise_dist fwd / GEMM
    (x @ x.T), 1-thread CPU time, medians of interleaved repeats; max error against float64.
    With several ``paths`` (native, torch) each repeat measures the kernel once per path, so the
    paths' ratios come from the same run and the same background load."""
    from pml_hyperbolic.kernels import build as _build
    from pml_hyperbolic.kernels import native as _native

    previous = torch.get_num_threads()
    previous_env = {k: os.environ.get(k) for k in ("PML_HYPERBOLIC_NATIVE", "PML_HYPERBOLIC_SYMMETRIC")}
    torch.set_num_threads(1)
    cosine = CosineSimilarity()
    kernel = lambda t: pb.pairwise_dist(t, t, C)
    cos = lambda t: cosine(t, t)
    gemm = lambda t: t @ t.T
    rows = []
    try:
        # which path "native" really is here (it falls back to torch when it cannot build)
        _set_tail_path("native")
        native_status = _native.status()
        labels = {"native": "native" if native_status == "native" else "torch (fallback)", "torch": "torch",
                  "general": "native, general path" if native_status == "native" else "torch (fallback)"}
        where = f" [{_build._state.get('path')}]" if native_status == "native" else ""
        print(f"kernel tail measured: {', '.join(labels[p] for p in paths)}; native tail here: {native_status}{where}")
        warm = ball_points(256, dim, 0)
        for _ in range(5):  # lazy initialisations and allocator warm-up, before the first case
            for path in paths:
                _set_tail_path(path)
                for fn in (kernel, cos, gemm):
                    cpu_time(fn, warm, fn is not gemm)
        for n in sizes:
            reps = repeats if n <= 1024 else max(3, repeats // 4)
            print(f"\nRadial distributions, N = M = {n}, D = {dim}, c = {C}, float32, 1 thread, CPU time "
                  f"(time.process_time), medians of {reps} interleaved repeats; radius = hyperbolic d₀")
            print("| case | tail | fwd+bwd / Cosine fwd+bwd | fwd / GEMM | fwd / GEMM, each right after Cosine "
                  "\\| each second | fwd+bwd ms | Cosine ms | max rel err (D ≥ 0.01) | max abs err (D < 0.01) | load avg |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for name, x in radial_cases(n, dim).items():
                for path in paths:  # warm-up
                    _set_tail_path(path)
                    for fn in (kernel, cos):
                        cpu_time(fn, x, True)
                t = {k: [] for k in ("cos", "gemm")}
                t.update({(path, k): [] for path in paths for k in ("fb", "fwd")})
                for repeat in range(reps):
                    for path in paths:
                        _set_tail_path(path)
                        t[path, "fb"].append(cpu_time(kernel, x, True))
                    t["cos"].append(cpu_time(cos, x, True))
                    # the forwards and the GEMM in alternating order: whichever runs right after the
                    # Cosine fwd+bwd starts from colder caches than the one after it (before, that
                    # was always the kernel); the position columns show the difference
                    fwd_order = [*paths, "gemm"] if repeat % 2 == 0 else ["gemm", *paths]
                    for path in fwd_order:
                        if path == "gemm":
                            t["gemm"].append(cpu_time(gemm, x, False))
                        else:
                            _set_tail_path(path)
                            t[path, "fwd"].append(cpu_time(kernel, x, False))
                m = {k: statistics.median(v) for k, v in t.items()}
                ref = reference_dist(x)
                big = ref >= 1e-2
                load = os.getloadavg()[0]
                for path in paths:
                    _set_tail_path(path)
                    with torch.no_grad():
                        d = kernel(x).double()
                    rel = float(((d - ref).abs()[big] / ref[big]).max()) if big.any() else 0.0
                    small = float((d - ref).abs()[~big].max()) if (~big).any() else 0.0
                    fb, fwd = m[path, "fb"] / m["cos"], m[path, "fwd"] / m["gemm"]
                    # the same position for both: the kernel on even repeats and the GEMM on odd
                    # ones ran right after the Cosine fwd+bwd; the reverse, second
                    kf, gm = t[path, "fwd"], t["gemm"]
                    if reps > 1 and len(paths) == 1:
                        by_position = (f"{statistics.median(kf[0::2]) / statistics.median(gm[1::2]):.2f} \\| "
                                       f"{statistics.median(kf[1::2]) / statistics.median(gm[0::2]):.2f}")
                    else:  # (with several paths only the first one alternates with the GEMM)
                        by_position = "-"
                    rows.append((n, name, labels[path], fb, fwd, rel, small, load))
                    print(f"| {name} | {labels[path]} | {fb:.2f} | {fwd:.2f} | {by_position} | "
                          f"{m[path, 'fb'] * 1e3:.1f} | {m['cos'] * 1e3:.1f} | {rel:.1e} | {small:.1e} | {load:.2f} |",
                          flush=True)
    finally:
        torch.set_num_threads(previous)
        for key, value in previous_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    for label in dict.fromkeys(r[2] for r in rows):
        mine = [r for r in rows if r[2] == label]
        worst = max(mine, key=lambda r: r[3])
        print(f"\n[{label}] worst fwd+bwd / Cosine: {worst[3]:.2f} (N = {worst[0]}, {worst[1]}; target ≤ 1.1); "
              f"worst fwd / GEMM: {max(r[4] for r in mine):.2f} (target ≤ 1.6)")
    return rows


def kernel_log1p_(u: torch.Tensor) -> torch.Tensor:
    """In-place log1p(u), u >= 0, the way the kernel's tail does it (``_log1p_from_log`` in row blocks
    of ``_TAIL_BLOCK_ELEMENTS``)."""
    from pml_hyperbolic.kernels import gram, tail

    rows = max(1, gram._TAIL_BLOCK_ELEMENTS // max(1, u.shape[-1]))
    for start in range(0, u.shape[0], rows):
        blk = u[start:start + rows]
        v, t = torch.empty_like(blk), torch.empty_like(blk)
        blk.copy_(tail._log1p_from_log(blk, v, t))
    return u


def compare_log1p(repeats: int, after_pow: bool = False) -> None:
    """Which in-place log1p is fastest (and most accurate) on the installed torch: aten's ``log1p_`` or
    the kernel's log-based rebuild (``_log1p_from_log``: log v + (u − (v − 1))/v, v = 1 + u).

    Measured on torch 2.14.1 (MKL build, AMD EPYC): aten's ``log1p_`` runs ~7 ms at 900² in a fresh
    process but ~0.7 ms once any large float ``pow`` has run in the process (``torch.rand(10**5).pow(2.5)``),
    so its speed depends on process state; it is therefore measured in fresh subprocesses, without and
    with that ``pow`` first (``--log1p-state``). The kernel's form does not depend on it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    if after_pow:
        torch.rand(100_000).pow(2.5)
    g = torch.Generator().manual_seed(0)
    methods = (("aten", lambda t: t.log1p_()), ("kernel", kernel_log1p_))
    try:
        for n in (900, 4096):
            # the tail's range, without pow: u = 10^U(-9, 3) (tiny near-duplicates up to far pairs)
            u = torch.exp((torch.rand(n, n, generator=g) * 12 - 9) * math.log(10.0))
            ref = u.double().log1p()
            times = {name: [] for name, _ in methods}
            for _ in range(repeats):
                for name, fn in methods:
                    t = u.clone()
                    start = time.process_time()
                    fn(t)
                    times[name].append(time.process_time() - start)
            err = {name: float(((fn(u.clone()).double() - ref) / ref).abs().max()) for name, fn in methods}
            a, b = statistics.median(times["aten"]), statistics.median(times["kernel"])
            state = "after a float pow" if after_pow else "fresh process"
            print(f"| {n} × {n} | {state} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} | {err['aten']:.1e} | "
                  f"{err['kernel']:.1e} | {os.getloadavg()[0]:.2f} |", flush=True)
    finally:
        torch.set_num_threads(previous)


def compare_log1p_states(repeats: int) -> None:
    print(f"\nlog1p on the kernel's elementwise tail (u = W + √2·S >= 0), torch {torch.__version__}, 1 thread, "
          f"CPU time medians of {repeats}, each state in a fresh subprocess:")
    print("| n × n | process state | aten log1p_ ms | kernel log-based ms | aten / kernel | max rel err aten "
          "| max rel err kernel | load avg |")
    print("|---|---|---|---|---|---|---|---|")
    for state in ("fresh", "after-pow"):
        try:
            out = subprocess.run([sys.executable, "-m", "bench.distance", "--log1p-state", state, "--repeats", str(repeats)],
                                 cwd=ROOT, capture_output=True, text=True, timeout=600, check=True).stdout
            print(out.strip())
        except Exception as exc:  # a report, not a test: say what failed
            print(f"| - | {state} | n/a ({type(exc).__name__}) |")
    print("(the kernel uses the log-based form: its speed does not depend on the process state)")


def symmetric_parts(sizes, dim: int, repeats: int) -> None:
    """The parts of the symmetric forward, 1 thread, medians of interleaved CPU times: the full GEMM
    x xᵀ; the triangular product alone at the 1-thread block rule and at 160 rows; product + native
    tail per block (the kernel's order) and all products then one tail; the row terms natively and
    through ``x.double()`` + ``vecdot``."""
    from pml_hyperbolic.kernels import gram
    from pml_hyperbolic.kernels import native as _native
    from pml_hyperbolic.kernels import tail as kernel_tail

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if _native.status() != "native":
            print(f"native library unavailable ({_native.status()}): nothing to measure")
            return
        for n in sizes:
            x = radial_cases(n, dim)["head-like"].contiguous()
            x2, inv_a = gram._row_terms(x, C)
            vectors = (x2.float(), ((2 * C) * inv_a).float(), inv_a.float())
            factor = gram._gram_error(x.dtype, dim + 2) / gram._TARGET_REL_ERROR[x.dtype]
            default_block = kernel_tail._symmetric_block_rows(n, 1)

            def product(block, tail=None):
                G = torch.empty(n, n)
                run = _native.symmetric_tail_runner(G, None, *vectors, 1 / math.sqrt(C), factor)  # as the kernel
                for start in range(0, n, block):
                    torch.mm(x[start:start + block], x[start:].T, out=G[start:start + block, start:])
                    if tail == "per block":
                        run(start, min(n, start + block))
                if tail == "after":
                    run(0, n)

            def torch_row_terms():
                xd = x.double()
                x2 = torch.linalg.vecdot(xd, xd)
                return x2, (1.0 - C * x2).clamp_min_(gram.DENOM_FLOOR).reciprocal_()

            cases = {
                "full GEMM x @ x.T": lambda: x @ x.T,
                f"triangular product, {default_block}-row blocks": lambda: product(default_block),
                "triangular product, 160-row blocks": lambda: product(160),
                f"product + tail per block ({default_block} rows)": lambda: product(default_block, "per block"),
                "product + tail per block (160 rows)": lambda: product(160, "per block"),
                f"all products ({default_block} rows), then one tail": lambda: product(default_block, "after"),
                "row terms, native": lambda: _native.row_terms(x, C, gram.DENOM_FLOOR),
                "row terms, x.double() + vecdot": torch_row_terms,
            }
            times = {k: [] for k in cases}
            for _ in range(repeats):
                for k, fn in cases.items():
                    start = time.process_time()
                    fn()
                    times[k].append(time.process_time() - start)
            print(f"\nSymmetric forward's parts, N = {n}, D = {dim}, head-like points, 1 thread, medians of "
                  f"{repeats} interleaved CPU times, load average {os.getloadavg()[0]:.2f}")
            print("| part | ms | / full GEMM |\n|---|---:|---:|")
            gemm = statistics.median(times["full GEMM x @ x.T"])
            for k, v in times.items():
                m = statistics.median(v)
                print(f"| {k} | {m * 1e3:.3f} | {m / gemm:.2f} |")
    finally:
        torch.set_num_threads(previous)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def steady_allocator() -> None:
    """Pin glibc malloc's mmap threshold at 1 GiB and its trim threshold at 2 GiB - 1 for this process:
    buffers up to 1 GiB come from the heap and stay there when freed, so a later buffer of the same size
    reuses those pages instead of faulting in fresh ones.

    Raises:
        SystemExit: not glibc (``mallopt`` missing) or ``mallopt`` refused a value.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        raise SystemExit("--steady-allocator needs glibc's mallopt (Linux with glibc)")
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, 1 << 30) != 1 or mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) != 1:
        raise SystemExit("--steady-allocator: glibc's mallopt refused the thresholds")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only N = M = 900")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--log1p", action="store_true", help="also compare aten's log1p_ with the kernel's log-based form")
    parser.add_argument("--radial", action="store_true",
                        help="instead of the method tables: pairwise_dist vs CosineSimilarity and a GEMM on radial "
                             "distributions (head-like, d0 ranges, all at the origin, near the boundary), 1 thread")
    parser.add_argument("--no-native", action="store_true",
                        help="--radial: the kernel's torch tail only (as PML_HYPERBOLIC_NATIVE=0)")
    parser.add_argument("--native-vs-torch", action="store_true",
                        help="--radial: measure the native and the torch tail side by side in one run")
    parser.add_argument("--symmetric-vs-general", action="store_true",
                        help="--radial: the symmetric path (x is y) and the general path side by side in one run")
    parser.add_argument("--symmetric-parts", action="store_true",
                        help="instead: the symmetric forward's parts (triangular product, its tail, row terms), 1 thread")
    parser.add_argument("--steady-allocator", action="store_true",
                        help="pin glibc's mmap and trim thresholds high first (no N×N buffer with fresh pages)")
    parser.add_argument("--log1p-state", choices=("fresh", "after-pow"), help=argparse.SUPPRESS)
    parser.add_argument("--memory-case", nargs=3, metavar=("NAME", "N", "D"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steady_allocator:
        steady_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.log1p_state:
        compare_log1p(args.repeats, after_pow=args.log1p_state == "after-pow")
        return 0
    if args.memory_case:
        name, n, dim = args.memory_case
        memory_case(name, int(n), int(dim))
        return 0
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, c = {C}, load average {os.getloadavg()[0]:.2f}"
          + (", allocator pinned (--steady-allocator)" if args.steady_allocator else ""))
    if args.symmetric_parts:
        symmetric_parts((900,) if args.quick else (900, 4096), 128, args.repeats if args.quick else max(5, args.repeats // 4))
        return 0
    if args.radial:
        paths = (("native", "torch") if args.native_vs_torch else ("native", "general") if args.symmetric_vs_general
                 else ("torch",) if args.no_native else ("native",))
        bench_radial((900,) if args.quick else (900, 4096), 128,
                     args.repeats // 2 if args.repeats > 20 else args.repeats, paths)
        if args.log1p:
            compare_log1p_states(max(5, args.repeats // 4))
        return 0
    rows = []
    sizes = ((900, args.repeats, 3),) + (() if args.quick else ((4096, max(5, args.repeats // 6), 2),))
    for n, repeats, slow_repeats in sizes:
        med_n = bench_size(n, 128, repeats, slow_repeats, not args.no_memory)
        med = med_n if n == 900 else med
        base = med_n["CosineSimilarity"]
        rows += [{"n": n, "d": 128, "method": k, "baseline": "CosineSimilarity", "fwd ms": round(m["fwd"] * 1e3, 3),
                  "fwd ratio": round(m["fwd"] / base["fwd"], 2), "fwd+bwd ms": round(m["fb"] * 1e3, 3),
                  "fwd+bwd ratio": round(m["fb"] / base["fb"], 2),
                  "allocator": "steady" if args.steady_allocator else "default"} for k, m in med_n.items()]
    ratio = med["pairwise_dist(x, x)"]["fb"] / med["CosineSimilarity"]["fb"]
    print(f"\npairwise_dist fwd+bwd / CosineSimilarity = {ratio:.2f} (target ≤ 1.5)")
    if args.log1p:
        compare_log1p_states(max(5, args.repeats // 4))
    return rows


if __name__ == "__main__":
    main()
