"""Torch intra-op thread control: a scoped thread count, a load-aware count for loops of small ops,
and a default for the recipes and benches.

Why: torch's CPU ops split their work over OpenMP threads and end in a barrier. When the machine
is busier than it has cores, the barrier waits for a thread the OS has not scheduled, so a loop of
many small parallel ops can be several times *slower* with 2 threads than with 1 (and burns CPU
in spin-waits that slow everyone else); once the cores are taken, no work-per-op threshold makes
more threads pay. So hot paths made of loops run under ``limited_threads(uncontended_threads())``:
the caller's count on an idle machine, 1 thread when the cores are busy. ``default_threads()`` is
a sane starting count for a whole process.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import collections
import contextlib
import math
import numbers
import os
import sys
import time

import torch

__all__ = ["limited_threads", "uncontended_threads", "runnable_elsewhere", "default_threads", "run_threads",
           "usable_cores"]


def _check_count(n, name: str) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or int(n) < 1:
        raise ValueError(f"{name} must be an integer >= 1 (a number of threads), got {n!r}")
    return int(n)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask where the OS has one, else
    ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def limited_threads(n: int):
    """Run a block with at most ``n`` torch intra-op threads, then restore the previous count
    (also when the block raises). ``n`` above the current count leaves it unchanged: the caller's
    choice is an upper bound that library code never raises.

        >>> with limited_threads(1):
        ...     many_small_ops()
    """
    n = _check_count(n, "limited_threads(n)")
    before = torch.get_num_threads()
    # faiss (if loaded) shares the OpenMP runtime, whose count torch.set_num_threads overwrites
    # but faiss may have set differently: restore it as well
    faiss = sys.modules.get("faiss")
    omp_before = faiss.omp_get_max_threads() if faiss is not None else None
    if n < before:
        torch.set_num_threads(n)
    if omp_before is not None and omp_before > n:
        faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
        if omp_before is not None and faiss.omp_get_max_threads() != omp_before:
            faiss.omp_set_num_threads(omp_before)


def _own_running_threads() -> int:
    """Threads of this process in state R (running or runnable) right now, itself included."""
    count = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 1
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                # the state follows the command name in parentheses, which may hold spaces
                if f.read().rsplit(")", 1)[1].split()[0] == "R":
                    count += 1
        except (OSError, IndexError):
            continue
    return max(1, count)


def runnable_elsewhere(samples: int = 3, interval: float = 0.002) -> int | None:
    """Runnable threads of *other* processes right now: the kernel's count of runnable entities
    (4th field of ``/proc/loadavg``, an instant figure unlike the load averages) minus this
    process's own running threads; the largest of ``samples`` readings ``interval`` seconds
    apart. ``None`` where the OS has no ``/proc/loadavg``."""
    samples = _check_count(samples, "samples")
    if not (isinstance(interval, numbers.Real) and math.isfinite(interval) and interval >= 0):
        raise ValueError(f"interval must be a finite number of seconds >= 0, got {interval!r}")
    worst = None
    for i in range(samples):
        if i:
            time.sleep(interval)
        try:
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return None
        others = max(0, running - _own_running_threads())
        worst = others if worst is None else max(worst, others)
    return worst


# uncontended_threads looks at the run queue once per call at most every _LOOK_SECONDS (one
# reading, no sleep) and counts as busy elsewhere the lower median of the readings of the last
# _WINDOW_SECONDS.
_LOOK_SECONDS = 0.05
_WINDOW_SECONDS = 1.0
_readings: collections.deque = collections.deque()  # (monotonic time, runnable_elsewhere(samples=1))


def uncontended_threads(requested: int | None = None, cores: int | None = None) -> int:
    r"""Threads for a loop of small parallel ops, chosen now:

    .. math:: \max\big(1,\ \min(\text{requested},\ \text{cores} - \tilde r)\big)

    where :math:`\tilde r` is the lower median of the readings of :func:`runnable_elsewhere` taken
    in the last second (one reading per call at most every 0.05 s). ``requested`` defaults to torch's current
    count. That count on an idle machine; fewer, down to 1, when other processes keep the cores
    busy (there a barrier would wait for a descheduled thread). Why a median and not the busiest
    reading: a kernel thread or a short-lived process is runnable in a few readings only, and
    must not halve the threads of the calls that follow; a process that computes is runnable in
    nearly every reading. Why no fresh look of several readings per call: their sleeps cost more
    than the thread choice saves, since under load a process that sleeps waits for a core to wake
    up. Where the OS gives no run-queue figure, ``requested`` is returned.

    Args:
        requested: the upper bound (>= 1); ``None``: torch's current count.
        cores: the usable cores (>= 1); ``None``: :func:`usable_cores`.

    Returns:
        The thread count, between 1 and ``requested``.

    Raises:
        ValueError: ``requested`` or ``cores`` is not an integer >= 1.
    """
    requested = torch.get_num_threads() if requested is None else _check_count(requested, "requested")
    cores = usable_cores() if cores is None else _check_count(cores, "cores")
    if requested <= 1:
        return 1
    now = time.monotonic()
    if not _readings or now - _readings[-1][0] > _LOOK_SECONDS:
        _readings.append((now, runnable_elsewhere(samples=1)))
    while now - _readings[0][0] > _WINDOW_SECONDS and len(_readings) > 1:
        _readings.popleft()
    seen = [others for _, others in _readings if others is not None]
    if not seen:  # pragma: no cover - non-Linux
        return requested
    busy_elsewhere = sorted(seen)[(len(seen) - 1) // 2]
    return max(1, min(requested, cores - busy_elsewhere))


def default_threads(load: float | None = None, cores: int | None = None) -> int:
    r"""A thread count for a process that is about to start heavy work:

    .. math:: \max\big(1,\ \min(\text{cores},\ \operatorname{round}(\text{cores} - \text{load}))\big)

    i.e. the cores that the 1-minute load average leaves idle, at least 1. On an idle machine
    that is every usable core; once the load reaches the core count it is 1, where more threads
    only add barrier waits. ``load`` defaults to ``os.getloadavg()[0]`` (0 where the OS has none),
    ``cores`` to :func:`usable_cores`. The environment variable ``PML_HYPERBOLIC_THREADS``
    (an integer >= 1) overrides the policy.
    """
    env = os.environ.get("PML_HYPERBOLIC_THREADS")
    if env is not None and env.strip():
        try:
            value = int(env)
        except ValueError:
            value = 0
        if value < 1:
            raise ValueError(f"PML_HYPERBOLIC_THREADS must be an integer >= 1, got {env!r}; "
                             "unset it to use the load-based default")
        return value
    cores = usable_cores() if cores is None else _check_count(cores, "cores")
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):  # pragma: no cover - non-Unix
            load = 0.0
    if isinstance(load, bool) or not isinstance(load, numbers.Real) or not math.isfinite(load) or load < 0:
        raise ValueError(f"load must be a finite number >= 0 (a load average), got {load!r}")
    return max(1, min(cores, int(math.floor(cores - float(load) + 0.5))))


def run_threads(cores: int | None = None) -> int:
    r"""The thread count of a recipe's ``--threads auto``, read before each phase of a run:

    .. math:: \min\big(\text{default\_threads}(),\ \max(1,\ \text{cores} - \text{runnable elsewhere now})\big)

    The 1-minute load average (:func:`default_threads`) remembers a competitor that just paused; the
    run queue (:func:`runnable_elsewhere`) sees one that started a second ago. Why both: beside a
    busy process, a thread per core makes every small op's barrier wait for a descheduled thread,
    which costs far more than the at most half the speed that one thread loses on an idle machine.
    ``PML_HYPERBOLIC_THREADS`` overrides the policy, as in :func:`default_threads`.

    Args:
        cores: the usable cores (>= 1); ``None``: :func:`usable_cores`.

    Returns:
        A thread count >= 1.

    Raises:
        ValueError: ``cores`` is not an integer >= 1, or ``PML_HYPERBOLIC_THREADS`` is not an
            integer >= 1.
    """
    env = os.environ.get("PML_HYPERBOLIC_THREADS")
    if env is not None and env.strip():
        return default_threads()
    cores = usable_cores() if cores is None else _check_count(cores, "cores")
    others = runnable_elsewhere()
    now = cores if others is None else max(1, cores - others)
    return max(1, min(default_threads(cores=cores), now))
