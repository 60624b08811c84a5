"""Tests of kernels."""
import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """Run a block with exactly ``n`` torch intra-op threads, then restore the previous count (unlike the
    package's ``limited_threads``, which never raises the count: a test of the two-thread split needs two)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
