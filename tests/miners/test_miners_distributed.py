"""All miners under PML's DistributedMinerWrapper: 2 processes, gloo backend, CPU, tiny tensors."""
import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pytorch_metric_learning.utils.distributed import DistributedMinerWrapper

from tests.spawned_workers import leave_spawned_worker

WORLD = 2
BATCH = 8


def rank_batch(rank):
    from pml_hyperbolic import poincare_ball as pb

    g = torch.Generator().manual_seed(100 + rank)
    x = pb.expmap0(0.6 * torch.randn(BATCH, 5, generator=g, dtype=torch.float64) / math.sqrt(0.1), 0.1)
    labels = (torch.arange(BATCH) // 2 + rank) % 5
    hier = torch.stack([labels, labels // 2, labels // 4], 1)
    return x, labels, hier


def as_set(t):
    return set(zip(*(v.tolist() for v in t)))


def worker(rank, init_file):
    from pml_hyperbolic.miners import HardNegativeProbabilityMiner, HierarchicalSimilarityMiner, MixedGeometryMiner

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        batches = [rank_batch(r) for r in range(WORLD)]
        x, y, h = batches[rank]
        # PML's gather order: own batch first, then the other ranks in rank order
        order = [rank] + [r for r in range(WORLD) if r != rank]
        all_x = torch.cat([batches[r][0] for r in order])
        all_y = torch.cat([batches[r][1] for r in order])
        all_h = torch.cat([batches[r][2] for r in order])
        cases = [
            (HardNegativeProbabilityMiner(threshold=0.05), y, all_y),
            (HardNegativeProbabilityMiner(top_k=2), y, all_y),
            (MixedGeometryMiner(top_k=1), y, all_y),
            (HierarchicalSimilarityMiner(), h, all_h),
        ]
        for miner, labels, all_labels in cases:
            got = DistributedMinerWrapper(miner, efficient=False)(x, labels)
            assert as_set(got) == as_set(miner(all_x, all_labels)), type(miner).__name__
            assert len(got[0]) > 0
            got = DistributedMinerWrapper(miner, efficient=True)(x, labels)
            want = miner(x, labels, all_x.clone(), all_labels)
            assert as_set(got) == as_set(want), type(miner).__name__ + " (efficient)"
            assert all(t.dtype == torch.int64 for t in got)
        # every rank is done with gloo before either tears it down: a rank that destroys the group while the
        # other still talks to it aborts the other process
        dist.barrier()
    finally:
        dist.destroy_process_group()
    leave_spawned_worker()


def test_distributed_miner_wrapper_two_processes(tmp_path, monkeypatch):
    init_file = str(tmp_path / "pg_init")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(init_file,), nprocs=WORLD, join=True)
