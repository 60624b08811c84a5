"""Large CPU buffers kept between calls and handed out again.

torch's CPU allocator returns large blocks to the OS when they are freed, so a fresh buffer of a few
MB or more comes with fresh pages, and faulting them in is a noticeable part of a hot loop (the
distance kernel's N×M scratch, HIER's gradient buffers). A :class:`SpareBuffers` keeps up to
``capacity`` such buffers for the next call of the same shape and dtype. CUDA's caching allocator
already reuses memory: only CPU tensors are kept.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor


class SpareBuffers:
    """Up to ``capacity`` contiguous CPU tensors, no longer referenced by their last user."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._spares: list = []
        self._lock = threading.Lock()  # (two threads never get the same buffer)

    def take(self, shape: tuple[int, ...] | torch.Size, like: Tensor) -> Tensor:
        """An uninitialised tensor of ``shape`` with ``like``'s dtype and device: a kept one when
        one fits, else new. A miss while the pool is full frees its oldest buffer now (the new one
        will replace it when given back), so memory does not grow by one buffer per shape change."""
        shape = tuple(shape)
        if like.device.type == "cpu":
            with self._lock:
                for index, spare in enumerate(self._spares):
                    if tuple(spare.shape) == shape and spare.dtype == like.dtype:
                        return self._spares.pop(index)
                if len(self._spares) >= self.capacity:
                    del self._spares[0]
        return like.new_empty(shape)

    def give(self, buffer: Tensor) -> None:
        """Keep ``buffer`` (its caller no longer reads it) for a later :meth:`take`; the most recent
        ``capacity`` buffers are kept."""
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            return
        with self._lock:
            if all(spare is not buffer for spare in self._spares):
                self._spares.append(buffer)
                del self._spares[:-self.capacity]

    def clear(self) -> None:
        with self._lock:
            self._spares.clear()

    def __len__(self) -> int:
        return len(self._spares)

    def __iter__(self):
        return iter(list(self._spares))
