"""A synthetic CPU load for the benches: one busy process per usable core.

    with synthetic_load():          # started here, always stopped on exit (also on errors)
        measure()

Each worker spins in pure Python (no OpenMP, no memory traffic to speak of), so it competes only
for CPU time, as another user's job would. Workers are started with ``multiprocessing`` (spawn)
and terminated by their own handles, never by name.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time


def _spin(stop_at: float) -> None:
    # bounded: a worker orphaned by a hard kill of the bench stops by itself
    x = 0
    while time.monotonic() < stop_at:
        for _ in range(100_000):
            x += 1


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def synthetic_load(workers: int | None = None, max_seconds: float = 1800.0, settle: float = 1.0):
    """Start ``workers`` busy processes (default: one per usable core) for the duration of the
    block; they are terminated (then killed if need be) in a ``finally``. ``max_seconds`` bounds
    their life should the bench itself be killed; ``settle`` seconds let them get going."""
    n = usable_cores() if workers is None else int(workers)
    if n < 0:
        raise ValueError(f"workers must be >= 0, got {workers!r}")
    ctx = mp.get_context("spawn")
    procs = []
    try:
        stop_at = time.monotonic() + float(max_seconds)  # CLOCK_MONOTONIC is system-wide on Linux
        for _ in range(n):
            p = ctx.Process(target=_spin, args=(stop_at,), daemon=True)
            p.start()
            procs.append(p)
        time.sleep(settle)
        yield procs
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():  # pragma: no cover
                p.kill()
                p.join(timeout=5)


def load_text() -> str:
    """The 1/5/15-minute load averages and the usable core count, for a bench's output."""
    try:
        a, b, c = os.getloadavg()
    except (AttributeError, OSError):  # pragma: no cover
        return "load avg n/a"
    return f"load avg {a:.2f}/{b:.2f}/{c:.2f} (1/5/15 min) on {usable_cores()} cores"


def cpu_1thread(fn, repeats: int = 1):
    """(least CPU seconds of ``repeats`` calls of ``fn`` run with 1 torch/faiss thread, last
    result). CPU time at 1 thread is the figure that a busy machine distorts least."""
    from pml_hyperbolic.kernels.threads import limited_threads

    best, out = float("inf"), None
    with limited_threads(1):
        for _ in range(max(1, repeats)):
            t = time.process_time()
            out = fn()
            best = min(best, time.process_time() - t)
    return best, out
