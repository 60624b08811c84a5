"""torchrun / DistributedDataParallel support: one process per device, rank 0 writes everything.

Design note: docs/design/training.md
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .config import ConfigError


@dataclass
class DistributedContext:
    """Where this process stands in a torchrun job (a single process: rank 0 of 1).

    Args:
        rank: global rank.
        world_size: number of processes.
        local_rank: rank on this machine (the CUDA device index).
        initialized_here: whether :func:`init_distributed` created the process group (and
            :func:`cleanup` should destroy it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False

    @property
    def enabled(self) -> bool:
        """More than one process."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes files and prints."""
        return self.rank == 0


def launched_by_torchrun() -> bool:
    """``RANK`` and ``WORLD_SIZE`` (> 1) are set in the environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1


def init_distributed(device: torch.device, backend: str = "auto") -> DistributedContext:
    """Join the process group torchrun describes in the environment; no-op for a single process.

    Args:
        device: this process's device (chooses the backend for ``"auto"``).
        backend: ``"auto"`` (nccl on CUDA, else gloo), ``"nccl"`` or ``"gloo"``.

    Returns:
        The :class:`DistributedContext`.

    Raises:
        ConfigError: nccl requested without CUDA.
    """
    if not launched_by_torchrun():
        return DistributedContext()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("--dist-backend nccl needs CUDA devices; use --dist-backend gloo on CPU.")
    initialized_here = False
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
        initialized_here = True
    return DistributedContext(rank, world_size, local_rank, initialized_here)


def barrier(ctx: DistributedContext) -> None:
    """``dist.barrier()`` when distributed."""
    if ctx.enabled:
        dist.barrier()


def cleanup(ctx: DistributedContext) -> None:
    """Destroy the process group if :func:`init_distributed` created it."""
    if ctx.enabled and ctx.initialized_here and dist.is_initialized():
        dist.destroy_process_group()


def wrap_model(model: torch.nn.Module, ctx: DistributedContext, device: torch.device) -> torch.nn.Module:
    """DDP-wrap a module that has trainable parameters (others are returned unchanged)."""
    if not ctx.enabled or not any(p.requires_grad for p in model.parameters()):
        return model
    device_ids = [device.index if device.index is not None else ctx.local_rank] if device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)


def wrap_loss(loss: Any, ctx: DistributedContext, efficient: bool = False) -> Any:
    """PML's ``DistributedLossWrapper`` (gathers embeddings from all ranks) when distributed."""
    if not ctx.enabled:
        return loss
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper

    return DistributedLossWrapper(loss, efficient=efficient)


def wrap_miner(miner: Any, ctx: DistributedContext, efficient: bool = False) -> Any:
    """PML's ``DistributedMinerWrapper`` when distributed (None and single processes: unchanged)."""
    if miner is None or not ctx.enabled:
        return miner
    from pytorch_metric_learning.utils.distributed import DistributedMinerWrapper

    return DistributedMinerWrapper(miner, efficient=efficient)


def broadcast_object(obj: Any, ctx: DistributedContext, src: int = 0) -> Any:
    """``obj`` as rank ``src`` holds it, on every rank (picklable objects)."""
    if not ctx.enabled:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
