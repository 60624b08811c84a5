"""SpareBuffers: the CPU buffer pool shared by the distance kernel's scratch and HIER's gradients."""
import threading

import pytest
import torch

from pml_hyperbolic.kernels.spare_buffers import SpareBuffers


def test_a_given_buffer_is_taken_again_for_the_same_shape_and_dtype():
    pool = SpareBuffers(capacity=2)
    like = torch.empty(0)
    a = pool.take((3, 4), like)
    assert a.shape == (3, 4) and a.dtype == torch.float32 and len(pool) == 0
    pool.give(a)
    pool.give(a)  # the same buffer twice is kept once
    assert len(pool) == 1
    assert pool.take((4, 3), like) is not a  # another shape: a new buffer, the kept one stays
    assert len(pool) == 1
    assert pool.take((3, 4), like.double()) is not a  # another dtype
    assert pool.take((3, 4), like) is a and len(pool) == 0


def test_capacity_keeps_the_most_recent_and_a_miss_on_a_full_pool_frees_the_oldest():
    pool = SpareBuffers(capacity=2)
    like = torch.empty(0)
    a, b, c = (torch.empty(n) for n in (1, 2, 3))
    for t in (a, b, c):
        pool.give(t)
    assert [t.shape[0] for t in pool] == [2, 3]  # a evicted
    d = pool.take((9,), like)  # a miss on a full pool: the oldest (b) is freed now
    assert [t.shape[0] for t in pool] == [3] and d.shape == (9,)
    one = SpareBuffers(capacity=1)  # the kernel's scratch: one buffer, replaced on a shape change
    one.give(a)
    one.take((5,), like)
    assert len(one) == 0


def test_non_contiguous_and_the_clear():
    pool = SpareBuffers(capacity=1)
    pool.give(torch.empty(4, 4).T)
    assert len(pool) == 0
    pool.give(torch.empty(2))
    pool.clear()
    assert len(pool) == 0


def test_two_threads_never_get_the_same_buffer():
    pool = SpareBuffers(capacity=1)
    like = torch.empty(0)
    got, start = [], threading.Barrier(8)
    for _ in range(50):
        pool.give(torch.empty(16))
        got.clear()

        def grab():
            start.wait()
            got.append(pool.take((16,), like))

        threads = [threading.Thread(target=grab) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len({id(t) for t in got}) == 8


@pytest.mark.parametrize("capacity", [0, -1])
def test_bad_capacity(capacity):
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        SpareBuffers(capacity)
