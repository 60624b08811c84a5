"""pml_hyperbolic.kernels.threads: scoped thread counts, the load-aware count for loops, the default."""
import collections

import faiss
import pytest
import torch

from pml_hyperbolic.kernels import threads as T
from pml_hyperbolic.kernels.threads import default_threads, limited_threads, runnable_elsewhere, uncontended_threads


@pytest.fixture
def two_threads():
    before = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(2)
    faiss.omp_set_num_threads(2)
    yield
    torch.set_num_threads(before[0])
    faiss.omp_set_num_threads(before[1])


def test_limited_threads_sets_and_restores(two_threads):
    with limited_threads(1):
        assert torch.get_num_threads() == 1
        assert faiss.omp_get_max_threads() == 1  # the shared OpenMP runtime is capped too
    assert torch.get_num_threads() == 2
    assert faiss.omp_get_max_threads() == 2


def test_limited_threads_restores_on_exception(two_threads):
    with pytest.raises(RuntimeError, match="boom"):
        with limited_threads(1):
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == 2
    assert faiss.omp_get_max_threads() == 2


def test_limited_threads_never_raises_the_count_and_nests(two_threads):
    with limited_threads(8):
        assert torch.get_num_threads() == 2
        with limited_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 2


def test_limited_threads_restores_a_count_changed_inside(two_threads):
    with limited_threads(1):
        torch.set_num_threads(2)
    assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", None, True])
def test_limited_threads_bad_arguments(bad, two_threads):
    with pytest.raises(ValueError, match="limited_threads"):
        with limited_threads(bad):
            pass
    assert torch.get_num_threads() == 2


def test_runnable_elsewhere_reads_the_run_queue():
    others = runnable_elsewhere(samples=2, interval=0.0)
    assert others is None or (isinstance(others, int) and others >= 0)
    with pytest.raises(ValueError, match="samples"):
        runnable_elsewhere(samples=0)
    with pytest.raises(ValueError, match="interval"):
        runnable_elsewhere(interval=-1.0)


@pytest.mark.parametrize("others, cores, requested, want", [
    (0, 2, 2, 2),   # idle machine: the caller's count
    (1, 2, 2, 1),   # one core taken
    (2, 2, 2, 1),   # both taken (the synthetic load of bench/under_load.py)
    (9, 2, 2, 1),   # never below 1
    (1, 16, 4, 4),  # plenty of free cores: the request
    (13, 16, 8, 3),
])
def test_uncontended_threads_reference_values(monkeypatch, others, cores, requested, want):
    monkeypatch.setattr(T, "runnable_elsewhere", lambda samples=3, interval=0.002: others)
    monkeypatch.setattr(T, "_readings", collections.deque())
    assert uncontended_threads(requested, cores=cores) == want


def test_uncontended_threads_caches_and_defaults(monkeypatch, two_threads):
    calls = []
    monkeypatch.setattr(T, "runnable_elsewhere", lambda samples=3, interval=0.002: calls.append(samples) or 0)
    monkeypatch.setattr(T, "_readings", collections.deque())
    assert uncontended_threads(cores=2) == 2  # requested = torch's count
    assert uncontended_threads(cores=2) == 2
    assert calls == [1]  # one reading, no sleep; then none for 0.05 s
    assert uncontended_threads(1) == 1
    for bad in (0, 1.5, "2", True):
        with pytest.raises(ValueError, match="requested"):
            uncontended_threads(bad)
    with pytest.raises(ValueError, match="cores"):
        uncontended_threads(2, cores=0)


def test_uncontended_threads_ignores_a_passing_blip_and_follows_a_lasting_competitor(monkeypatch):
    """The lower median of the last second's readings: one reading of a short-lived runnable thread
    leaves the caller's count; a competitor runnable in most readings takes its core; readings
    older than 1 s leave the window."""
    clock = [100.0]
    readings = iter([1, 0, 0, 2, 2, 2, 0, 0, 0, 0, 1])
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(T, "runnable_elsewhere", lambda samples=3, interval=0.002: next(readings))
    monkeypatch.setattr(T, "_readings", collections.deque())
    chosen = []
    for _ in range(10):
        chosen.append(uncontended_threads(2, cores=2))
        clock[0] += 0.1
    # lower medians: [1] -> 1; [0, 1] -> 0; [0, 0, 1] -> 0; [0, 0, 1, 2] -> 0; [0, 0, 1, 2, 2] -> 1;
    # [0, 0, 1, 2, 2, 2] -> 1; [0, 0, 0, 1, 2, 2, 2] -> 1; then the zeros are the majority again
    assert chosen == [1, 2, 2, 2, 1, 1, 1, 2, 2, 2]
    clock[0] += 2.0
    assert uncontended_threads(2, cores=2) == 1  # a lone reading is the whole window
    assert [others for _, others in T._readings] == [1]  # every reading older than 1 s dropped


def test_uncontended_threads_under_a_lasting_two_core_load(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(T.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(T, "runnable_elsewhere", lambda samples=3, interval=0.002: 2)
    monkeypatch.setattr(T, "_readings", collections.deque())
    for _ in range(20):
        assert uncontended_threads(2, cores=2) == 1
        clock[0] += 0.06


@pytest.mark.parametrize("load, cores, want", [
    (0.0, 2, 2), (0.4, 2, 2), (0.6, 2, 1), (2.0, 2, 1), (24.0, 2, 1),
    (0.0, 16, 16), (3.2, 16, 13), (15.7, 16, 1),
])
def test_default_threads_reference_values(monkeypatch, load, cores, want):
    monkeypatch.delenv("PML_HYPERBOLIC_THREADS", raising=False)
    assert default_threads(load=load, cores=cores) == want


def test_default_threads_environment_and_bad_arguments(monkeypatch):
    monkeypatch.setenv("PML_HYPERBOLIC_THREADS", "3")
    assert default_threads(load=50.0, cores=2) == 3
    for bad in ("0", "x", "-2", "1.5"):
        monkeypatch.setenv("PML_HYPERBOLIC_THREADS", bad)
        with pytest.raises(ValueError, match="PML_HYPERBOLIC_THREADS"):
            default_threads()
    monkeypatch.delenv("PML_HYPERBOLIC_THREADS")
    assert 1 <= default_threads() <= T.usable_cores()
    for bad in (-1.0, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="load"):
            default_threads(load=bad, cores=2)
    with pytest.raises(ValueError, match="cores"):
        default_threads(load=0.0, cores=0)


def test_run_threads_takes_the_fewer_of_load_average_and_run_queue(monkeypatch):
    monkeypatch.delenv("PML_HYPERBOLIC_THREADS", raising=False)
    monkeypatch.setattr(T.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: 0)
    assert T.run_threads(cores=4) == 4  # idle machine: every core
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: 1)
    assert T.run_threads(cores=2) == 1  # one busy process now: the other core only
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: 9)
    assert T.run_threads(cores=2) == 1  # never below 1
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: 0)
    monkeypatch.setattr(T.os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    assert T.run_threads(cores=4) == 1  # a competitor that just paused still counts
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: None)  # no run queue figure: the load average
    monkeypatch.setattr(T.os, "getloadavg", lambda: (1.0, 0.0, 0.0))
    assert T.run_threads(cores=4) == 3
    monkeypatch.setenv("PML_HYPERBOLIC_THREADS", "5")
    assert T.run_threads(cores=2) == 5
    monkeypatch.delenv("PML_HYPERBOLIC_THREADS")
    with pytest.raises(ValueError, match="cores"):
        T.run_threads(cores=0)


def test_recipe_auto_threads_follow_run_threads(monkeypatch):
    import argparse

    from pml_hyperbolic.training import runner

    monkeypatch.setattr(T, "run_threads", lambda cores=None: 1)
    before = torch.get_num_threads()
    recipe = object.__new__(runner.Recipe)
    try:
        recipe.args = argparse.Namespace(threads="auto")
        recipe.pick_threads()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        recipe.args = argparse.Namespace(threads=2)  # an explicit count is left alone
        recipe.pick_threads()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
