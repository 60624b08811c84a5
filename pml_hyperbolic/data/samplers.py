"""Class-balanced batch sampling: every batch holds m samples of each of B/m classes.

Design note: docs/design/data.md
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import numpy as np
import torch
from torch.utils.data import Sampler

from .._checks import check_int


def _distributed_rank_and_world_size():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class ClassBalancedBatchSampler(Sampler):
    """Batch sampler yielding index lists made of whole classes: ``batch_size / m`` classes x ``m`` samples.

    Why: the papers' losses (Hyp-ViT's pairwise cross-entropy, Hyp-UML's
    proxy/pair losses) need every class in a batch to appear with several
    positives. PML's ``MPerClassSampler`` yields a flat index stream and only
    keeps classes whole when it is given ``batch_size`` *and* the DataLoader's
    batch size matches; this sampler builds the batches itself and is meant for
    ``DataLoader(dataset, batch_sampler=sampler)``.

    Guarantees:

    * every batch has exactly ``batch_size`` indices: ``samples_per_class``
      indices of each of ``batch_size // samples_per_class`` distinct classes,
      grouped class by class;
    * within a batch a class's indices are distinct when the class has at
      least ``samples_per_class`` samples (smaller classes are drawn with
      replacement); across batches each class cycles through reshuffled
      passes over its samples, so all samples get used;
    * deterministic for a given ``(seed, epoch)``; call :meth:`set_epoch` each epoch;
    * distributed: ``batch_size`` is per rank. All ranks build the same global
      sequence of steps from the shared seed; at each step rank ``r`` takes the
      ``r``-th batch. Ranks therefore never receive the same batch, and when
      there are at least ``world_size * batch_size / m`` classes the ranks of one
      step even hold disjoint classes (otherwise classes may repeat across
      ranks but draw different samples while a class has enough of them).
      Every rank yields the same number of batches.

    Args:
        labels: class label per dataset index (sequence, array or tensor).
        batch_size: indices per batch (per rank).
        samples_per_class: ``m``; must divide ``batch_size``.
        num_batches: batches per epoch per rank; default: dataset size // batch_size
            global batches split over the ranks.
        seed: base seed shared by all ranks.
        rank: this process's rank; default from ``torch.distributed`` when initialised, else 0.
        world_size: number of ranks; default from ``torch.distributed`` when initialised, else 1.
        drop_last: with the default ``num_batches``, round the per-rank count down
            (True) or up (False) when the global batches do not split evenly.

    Raises:
        TypeError: ``batch_size``, ``samples_per_class``, ``num_batches``, ``seed``, ``rank`` or
            ``world_size`` not an integer (a bool or a fractional number included), or
            ``drop_last`` not a bool.
        ValueError: empty ``labels`` or labels not (N,) / (N, 1), sizes < 1, a negative ``seed`` or ``rank``,
            ``samples_per_class`` not dividing ``batch_size``, fewer classes than a batch needs,
            or ``rank`` outside ``world_size``.
    """

    def __init__(self, labels: Any, batch_size: int, samples_per_class: int, num_batches: Optional[int] = None,
                 seed: int = 0, rank: Optional[int] = None, world_size: Optional[int] = None,
                 drop_last: bool = True):
        if isinstance(labels, torch.Tensor):
            labels = labels.detach().cpu().numpy()
        labels = np.asarray(labels)
        if labels.ndim > 2 or (labels.ndim == 2 and labels.shape[1] != 1):
            raise ValueError(f"labels must hold one class label per dataset index, (N,) or (N, 1), got shape "
                             f"{labels.shape}")
        labels = labels.reshape(-1)
        if len(labels) == 0:
            raise ValueError("labels is empty: there is nothing to sample")
        batch_size = check_int(batch_size, "batch_size", 1)
        samples_per_class = check_int(samples_per_class, "samples_per_class", 1)
        if num_batches is not None:
            num_batches = check_int(num_batches, "num_batches", 1)
        seed = check_int(seed, "seed", 0)
        if rank is not None:
            rank = check_int(rank, "rank", 0)
        if world_size is not None:
            world_size = check_int(world_size, "world_size", 1)
        if not isinstance(drop_last, (bool, np.bool_)):
            raise TypeError(f"drop_last must be a bool, got {drop_last!r}")
        if batch_size % samples_per_class != 0:
            raise ValueError(
                f"batch_size ({batch_size}) must be divisible by samples_per_class ({samples_per_class}) "
                f"so that every class in a batch is whole; e.g. use batch_size="
                f"{max(1, batch_size // samples_per_class) * samples_per_class}"
            )
        self.classes, inverse = np.unique(labels, return_inverse=True)
        self.class_members = [np.flatnonzero(inverse == c) for c in range(len(self.classes))]
        self.classes_per_batch = batch_size // samples_per_class
        if len(self.classes) < self.classes_per_batch:
            raise ValueError(
                f"a batch of {batch_size} with {samples_per_class} samples per class needs "
                f"{self.classes_per_batch} distinct classes but the labels have only {len(self.classes)}; "
                f"lower batch_size or raise samples_per_class"
            )
        default_rank, default_world = _distributed_rank_and_world_size()
        self.rank = default_rank if rank is None else int(rank)
        self.world_size = default_world if world_size is None else int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        self.batch_size = batch_size
        self.samples_per_class = samples_per_class
        self.seed = int(seed)
        self.drop_last = drop_last
        if num_batches is None:
            global_batches = max(1, len(labels) // batch_size)
            rounding = math.floor if drop_last else math.ceil
            num_batches = max(1, rounding(global_batches / self.world_size))
        self.num_batches = int(num_batches)
        self.epoch = 0
        self._start_batch = 0  # for resuming mid-epoch
        self._next_batch = 0

    def set_epoch(self, epoch: int) -> None:
        """Reseed for a new epoch (same on every rank).

        Raises:
            TypeError: ``epoch`` is not an integer.
            ValueError: ``epoch`` < 0.
        """
        self.epoch = check_int(epoch, "epoch", 0)

    def __len__(self):
        return self.num_batches

    def _global_step_batches(self, epoch):
        """Yield, per step, the list of ``world_size`` batches (identical on all ranks)."""
        rng = np.random.default_rng([self.seed, epoch])
        num_classes, m = len(self.classes), self.samples_per_class
        queues = [rng.permutation(members) for members in self.class_members]
        positions = [0] * num_classes
        class_stream = {"order": rng.permutation(num_classes), "pos": 0}

        def take_classes(count, exclude):
            taken = []
            while len(taken) < count:
                if class_stream["pos"] >= num_classes:
                    class_stream["order"] = rng.permutation(num_classes)
                    class_stream["pos"] = 0
                candidate = int(class_stream["order"][class_stream["pos"]])
                class_stream["pos"] += 1
                if candidate not in exclude and candidate not in taken:
                    taken.append(candidate)
            return taken

        def take_samples(class_id, used_this_step):
            members = self.class_members[class_id]
            if len(members) < m:
                return rng.choice(members, size=m, replace=True)
            if positions[class_id] + m > len(members):
                # new pass over the class; indices another rank holds in this step go last
                fresh = rng.permutation(members)
                held = np.isin(fresh, used_this_step.get(class_id, ()))
                queues[class_id] = np.concatenate([fresh[~held], fresh[held]])
                positions[class_id] = 0
            start = positions[class_id]
            positions[class_id] += m
            return queues[class_id][start:start + m]

        disjoint_ranks = num_classes >= self.world_size * self.classes_per_batch
        while True:
            step, used, used_samples = [], set(), {}
            for _ in range(self.world_size):
                exclude = used if disjoint_ranks else set()
                chosen = take_classes(self.classes_per_batch, exclude)
                used.update(chosen)
                batch = []
                for class_id in chosen:
                    samples = [int(i) for i in take_samples(class_id, used_samples)]
                    used_samples.setdefault(class_id, []).extend(samples)
                    batch.extend(samples)
                step.append(batch)
            yield step

    def __iter__(self):
        start = self._start_batch
        self._start_batch = 0
        steps = self._global_step_batches(self.epoch)
        for batch_index in range(self.num_batches):
            step = next(steps)
            if batch_index < start:
                continue
            self._next_batch = batch_index + 1
            yield step[self.rank]
        self._next_batch = 0

    def state_dict(self):
        """Seed, epoch and the next batch position (batches handed out so far this epoch).

        With a multi-worker DataLoader the sampler runs ahead of training by the
        prefetch depth; trainers that resume mid-epoch should store their own
        step count as ``next_batch``.
        """
        return {"seed": self.seed, "epoch": self.epoch, "next_batch": self._next_batch}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Restore :meth:`state_dict`'s seed, epoch and next batch (the next epoch starts there)."""
        self.seed = int(state.get("seed", self.seed))
        self.epoch = int(state.get("epoch", self.epoch))
        self._start_batch = int(state.get("next_batch", 0))
        self._next_batch = self._start_batch
