"""ClassBalancedBatchSampler: whole classes per batch, determinism, distributed ranks, resume."""

import os
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pml_hyperbolic.data import ClassBalancedBatchSampler
from tests.spawned_workers import leave_spawned_worker


def make_labels(num_classes=20, low=4, high=12, seed=0):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(low, high, num_classes)
    return np.repeat(np.arange(num_classes) * 7 + 3, sizes)  # non-contiguous raw ids


def check_batch(batch, labels, batch_size, samples_per_class):
    assert len(batch) == batch_size
    counts = Counter(labels[batch].tolist())
    assert len(counts) == batch_size // samples_per_class
    assert set(counts.values()) == {samples_per_class}


def test_every_batch_is_whole_classes_with_distinct_samples():
    labels = make_labels()
    sampler = ClassBalancedBatchSampler(labels, batch_size=24, samples_per_class=4, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == len(labels) // 24
    for batch in batches:
        check_batch(batch, labels, 24, 4)
        assert len(set(batch)) == 24  # every class here has >= 4 samples
    # classes cycle through their samples: over many batches every index shows up
    sampler = ClassBalancedBatchSampler(labels, batch_size=24, samples_per_class=4, num_batches=200)
    seen = set(i for batch in sampler for i in batch)
    assert seen == set(range(len(labels)))


def test_small_classes_are_drawn_with_replacement():
    labels = np.array([0, 0, 1, 1, 1, 1, 2, 3, 3, 3])
    for batch in ClassBalancedBatchSampler(labels, batch_size=6, samples_per_class=3, num_batches=20):
        check_batch(batch, labels, 6, 3)


def test_deterministic_under_seed_and_epoch():
    labels = torch.as_tensor(make_labels())
    first = list(ClassBalancedBatchSampler(labels, 24, 4, seed=5))
    again = list(ClassBalancedBatchSampler(labels, 24, 4, seed=5))
    other_seed = list(ClassBalancedBatchSampler(labels, 24, 4, seed=6))
    assert first == again and first != other_seed
    sampler = ClassBalancedBatchSampler(labels, 24, 4, seed=5)
    sampler.set_epoch(1)
    assert list(sampler) != first
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_two_ranks_get_distinct_whole_class_batches():
    labels = make_labels(num_classes=20)
    ranks = [ClassBalancedBatchSampler(labels, 12, 3, seed=3, rank=r, world_size=2) for r in range(2)]
    single = ClassBalancedBatchSampler(labels, 12, 3, seed=3)
    assert len(ranks[0]) == len(ranks[1]) == len(single) // 2
    for batch_0, batch_1 in zip(*ranks):
        check_batch(batch_0, labels, 12, 3)
        check_batch(batch_1, labels, 12, 3)
        # 20 classes >= 2 ranks x 4 classes: the ranks of one step hold disjoint classes
        assert not set(labels[batch_0].tolist()) & set(labels[batch_1].tolist())
        assert not set(batch_0) & set(batch_1)
    all_batches = [tuple(b) for r in ranks for b in r]
    assert len(set(all_batches)) == len(all_batches)  # no batch duplicated across ranks


def test_two_ranks_with_few_classes_still_differ():
    labels = np.repeat(np.arange(4), 10)  # every batch needs all 4 classes
    ranks = [list(ClassBalancedBatchSampler(labels, 8, 2, seed=0, rank=r, world_size=2, num_batches=6))
             for r in range(2)]
    for batch_0, batch_1 in zip(*ranks):
        check_batch(batch_0, labels, 8, 2)
        assert sorted(Counter(labels[batch_1].tolist())) == [0, 1, 2, 3]
        assert not set(batch_0) & set(batch_1)  # enough samples per class: no shared indices


def test_drop_last_controls_rank_rounding():
    labels = make_labels(num_classes=20)  # 3 * 12 = 36 would not split evenly
    global_batches = len(labels) // 12
    kept = ClassBalancedBatchSampler(labels, 12, 3, rank=0, world_size=5, drop_last=True)
    padded = ClassBalancedBatchSampler(labels, 12, 3, rank=0, world_size=5, drop_last=False)
    assert len(kept) == global_batches // 5
    assert len(padded) == -(-global_batches // 5)


def test_state_dict_resumes_mid_epoch():
    labels = make_labels()
    sampler = ClassBalancedBatchSampler(labels, 24, 4, seed=2)
    sampler.set_epoch(3)
    full = list(sampler)
    iterator = iter(sampler)
    consumed = [next(iterator), next(iterator)]
    state = sampler.state_dict()
    assert state == {"seed": 2, "epoch": 3, "next_batch": 2}
    resumed = ClassBalancedBatchSampler(labels, 24, 4, seed=0)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert consumed + rest == full
    assert list(resumed) == full  # the following pass is the whole epoch again


def test_works_as_dataloader_batch_sampler():
    labels = make_labels()
    dataset = torch.utils.data.TensorDataset(torch.arange(len(labels)), torch.as_tensor(labels))
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=ClassBalancedBatchSampler(labels, 16, 4))
    for indices, batch_labels in loader:
        assert indices.shape == (16,)
        assert sorted(Counter(batch_labels.tolist()).values()) == [4, 4, 4, 4]


def test_helpful_errors():
    labels = make_labels(num_classes=5)
    with pytest.raises(ValueError, match="divisible"):
        ClassBalancedBatchSampler(labels, batch_size=10, samples_per_class=4)
    with pytest.raises(ValueError, match="distinct classes"):
        ClassBalancedBatchSampler(labels, batch_size=24, samples_per_class=4)
    with pytest.raises(ValueError, match="rank"):
        ClassBalancedBatchSampler(labels, 8, 4, rank=2, world_size=2)


def _distributed_sampler_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        labels = make_labels(num_classes=20)
        # rank and world size come from the process group, not from arguments
        sampler = ClassBalancedBatchSampler(labels, 12, 3, seed=3)
        sampler.set_epoch(1)
        batches = [list(b) for b in sampler]
        gathered = [None] * world
        dist.all_gather_object(gathered, batches)
        if rank == 0:
            torch.save(gathered, os.path.join(out_dir, "batches.pt"))
        dist.barrier()  # no rank tears gloo down while the other still uses it (that aborts the other)
    finally:
        dist.destroy_process_group()
    leave_spawned_worker()


def test_real_process_group_ranks_get_distinct_whole_class_batches(tmp_path):
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_distributed_sampler_worker, args=(world, str(tmp_path / "init"), str(tmp_path)),
             nprocs=world, join=True)
    per_rank = torch.load(tmp_path / "batches.pt", weights_only=False)
    labels = make_labels(num_classes=20)
    # the same batches as the explicit rank/world_size arguments give
    for rank, batches in enumerate(per_rank):
        explicit = ClassBalancedBatchSampler(labels, 12, 3, seed=3, rank=rank, world_size=world)
        explicit.set_epoch(1)
        assert batches == [list(b) for b in explicit]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for batch_0, batch_1 in zip(*per_rank):
        check_batch(batch_0, labels, 12, 3)
        check_batch(batch_1, labels, 12, 3)
        assert not set(labels[batch_0].tolist()) & set(labels[batch_1].tolist())
    all_batches = [tuple(b) for batches in per_rank for b in batches]
    assert len(set(all_batches)) == len(all_batches)


@pytest.mark.parametrize("name, value, error", [
    ("batch_size", 1.5, TypeError), ("batch_size", True, TypeError), ("batch_size", "8", TypeError),
    ("batch_size", 0, ValueError), ("batch_size", -8, ValueError), ("batch_size", float("nan"), TypeError),
    ("samples_per_class", 2.5, TypeError), ("samples_per_class", False, TypeError),
    ("samples_per_class", 0, ValueError), ("samples_per_class", None, TypeError),
    ("num_batches", 0, ValueError), ("num_batches", 2.5, TypeError), ("num_batches", True, TypeError),
    ("seed", -1, ValueError), ("seed", 0.5, TypeError), ("seed", "0", TypeError), ("seed", True, TypeError),
    ("rank", -1, ValueError), ("rank", 0.5, TypeError), ("rank", True, TypeError),
    ("world_size", 0, ValueError), ("world_size", 1.5, TypeError), ("world_size", False, TypeError),
    ("drop_last", 1, TypeError), ("drop_last", "yes", TypeError),
])
def test_every_argument_is_checked_and_named(name, value, error):
    kwargs = {"labels": make_labels(num_classes=5), "batch_size": 8, "samples_per_class": 4, name: value}
    with pytest.raises(error, match=name):
        ClassBalancedBatchSampler(**kwargs)


def test_empty_labels_and_bad_epoch_are_clear_errors():
    with pytest.raises(ValueError, match="labels"):
        ClassBalancedBatchSampler([], 8, 4)
    sampler = ClassBalancedBatchSampler(make_labels(num_classes=5), 8, 4)
    for bad, error in [(1.5, TypeError), (-1, ValueError), ("1", TypeError)]:
        with pytest.raises(error, match="epoch"):
            sampler.set_epoch(bad)


def test_integral_numbers_of_other_types_are_accepted():
    labels = make_labels(num_classes=5)
    a = ClassBalancedBatchSampler(labels, np.int64(8), 4, num_batches=3, seed=np.int32(2))
    b = ClassBalancedBatchSampler(labels, 8.0, 4, num_batches=3, seed=2)
    assert [list(x) for x in a] == [list(x) for x in b]


def test_multi_column_labels_are_rejected_and_a_column_is_accepted():
    labels = make_labels(num_classes=5)
    with pytest.raises(ValueError, match="labels"):
        ClassBalancedBatchSampler(np.stack([labels, labels], 1), 8, 4)
    a = ClassBalancedBatchSampler(labels[:, None], 8, 4, num_batches=3)
    b = ClassBalancedBatchSampler(labels, 8, 4, num_batches=3)
    assert [list(x) for x in a] == [list(x) for x in b]


_BAD_INTS = [0, -3, 1.5, 2.5, float("nan"), float("inf"), True, False, "8", None, 1e300, [8]]


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(["batch_size", "samples_per_class", "num_batches", "seed", "rank", "world_size"]),
       value=st.sampled_from(_BAD_INTS))
def test_sweep_every_integer_argument(name, value):
    if (value is None and name in ("num_batches", "rank", "world_size")) or (value == 0 and name in ("seed", "rank")
                                                                           and not isinstance(value, bool)):
        return  # documented defaults / valid values
    kwargs = {"labels": make_labels(num_classes=5), "batch_size": 8, "samples_per_class": 4, name: value}
    with pytest.raises((TypeError, ValueError), match=name):
        ClassBalancedBatchSampler(**kwargs)
