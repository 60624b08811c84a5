"""DistributedLossWrapper with 2 gloo processes on CPU vs the single-process loss on the whole batch."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.spawned_workers import leave_spawned_worker


def _make_losses():
    from pml_hyperbolic.losses import (HierarchicalLogRatioLoss, HierarchicalMarginLoss, HypMixLoss,
                                       PairwiseCrossEntropyLoss, UncertaintyAdaptiveContrastiveLoss,
                                       UncertaintyAdaptiveTripletLoss)
    return [PairwiseCrossEntropyLoss(), HypMixLoss(), UncertaintyAdaptiveContrastiveLoss(),
            UncertaintyAdaptiveTripletLoss(), HierarchicalLogRatioLoss(), HierarchicalMarginLoss(num_classes=8)]


def _data():
    g = torch.Generator().manual_seed(0)
    from pml_hyperbolic.heads import ToPoincare
    z = ToPoincare(c=0.1)(torch.randn(16, 6, generator=g, dtype=torch.float64))
    y = torch.arange(8).repeat_interleave(2)[torch.randperm(16, generator=g)]
    return z, y


def _worker(rank, world, port, out_dir):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from pytorch_metric_learning.utils.distributed import DistributedLossWrapper
    z, y = _data()
    per = len(z) // world
    results = []
    for loss in _make_losses():
        local = z[rank * per:(rank + 1) * per].clone().requires_grad_()
        value = DistributedLossWrapper(loss)(local, y[rank * per:(rank + 1) * per])
        value.backward()
        results.append((value.detach(), local.grad.clone()))
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears gloo down while the other still uses it (that aborts the other)
    dist.destroy_process_group()
    leave_spawned_worker()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_distributed_loss_wrapper_matches_single_process(tmp_path):
    world = 2
    mp.spawn(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    z, y = _data()
    per = len(z) // world
    for k, loss in enumerate(_make_losses()):
        full = z.clone().requires_grad_()
        value = loss(full, y)
        value.backward()
        for rank in range(world):
            got_value, got_grad = torch.load(os.path.join(tmp_path, f"rank{rank}.pt"))[k]
            # PML's wrapper returns world_size x the loss on the gathered batch (DDP then averages)
            assert torch.allclose(got_value / world, value.detach(), atol=1e-10), (k, rank)
            assert torch.allclose(got_grad / world, full.grad[rank * per:(rank + 1) * per], atol=1e-10), (k, rank)
