"""bench/distance.py --steady-allocator: glibc's thresholds pinned, so that a freed N×N buffer is reused
without fresh pages (run in a child process: the pytest process keeps its allocator as it is)."""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_steady_allocator_reuses_a_freed_buffer_without_fresh_pages():
    code = """
import resource
from bench.distance import steady_allocator
import torch
steady_allocator()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(8):  # (the heap settles within a few) 64 MiB: above glibc's largest dynamic mmap threshold, mmapped afresh by default
    torch.ones(4096, 4096).sum()
before = faults()
for _ in range(5):
    torch.ones(4096, 4096).sum()
print(faults() - before)
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 1000  # a fresh 64 MiB buffer would fault in ~16,000 pages each time


def test_the_option_is_documented_and_offered():
    from bench import distance

    assert "--steady-allocator" in distance.__doc__
    parser_help = subprocess.run([sys.executable, "-m", "bench", "distance", "--help"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=300)
    assert "--steady-allocator" in parser_help.stdout
