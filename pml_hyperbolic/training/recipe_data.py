"""The data part of :class:`~.runner.Recipe`: datasets, transforms, the training subset, the
class-balanced sampler and the evaluation sets, plus the small label helpers recipes share.

Why a module of its own: the recipe driver composes one mixin per responsibility (data, model and
geometry, optimisation, reporting), each readable alone.

Design note: docs/design/training.md
"""
from __future__ import annotations

import time
from typing import Any, List, Optional

import numpy as np
import torch

from .command_line import resolve_dataset
from .config import ConfigError
from .evaluation import eval_protocol


def seeded_subset(dataset: torch.utils.data.Dataset, max_samples: Optional[int],
                  seed: int = 0) -> torch.utils.data.Dataset:
    """``dataset`` itself, or a seeded subset of ``max_samples`` items (in index order)."""
    if not max_samples or len(dataset) <= max_samples:
        return dataset
    idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_samples]
    return torch.utils.data.Subset(dataset, sorted(idx.tolist()))


class LabelledSubset(torch.utils.data.Subset):
    """``Subset`` that keeps the ``labels`` (and ``num_classes``, ``super_labels``) the samplers and
    losses need."""

    @property
    def labels(self):
        return np.asarray(self.dataset.labels)[np.asarray(self.indices)]

    @property
    def super_labels(self):
        parents = getattr(self.dataset, "super_labels", None)
        return None if parents is None else np.asarray(parents)[np.asarray(self.indices)]

    @property
    def num_classes(self):
        return getattr(self.dataset, "num_classes", None)


def train_subset_indices(n: int, max_samples: Optional[int], seed: int = 0) -> Optional[List[int]]:
    """Sorted seeded indices of ``max_samples`` of ``n`` training items, or None to keep them all."""
    if not max_samples or n <= max_samples:
        return None
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))[:max_samples].tolist())


def dataset_labels(dataset: Any) -> np.ndarray:
    """The first-level ``labels`` of ``dataset`` as a 1-D array.

    Raises:
        ConfigError: the dataset has no ``labels`` attribute.
    """
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ConfigError(f"{type(dataset).__name__} has no .labels attribute; the class-balanced sampler needs it")
    labels = np.asarray(labels)
    return labels[:, 0] if labels.ndim == 2 else labels


def training_class_count(dataset: Any) -> int:
    """Number of classes a per-class component (proxies, margins) needs: the dataset's ``num_classes``
    when it declares one, else 1 + its largest first-level label (labels index the classes).

    Raises:
        ConfigError: no labels, or negative labels.
    """
    declared = getattr(dataset, "num_classes", None)
    if declared is not None:
        return int(declared)
    labels = dataset_labels(dataset)
    if labels.size == 0 or labels.min() < 0:
        raise ConfigError(f"{type(dataset).__name__}'s labels must be non-negative class indices to size "
                          f"per-class parameters (got {'none' if labels.size == 0 else int(labels.min())})")
    return int(labels.max()) + 1


def training_class_parents(dataset: Any) -> torch.Tensor:
    """The parent of every training class, (C,) int64, from the dataset's ``labels`` and its
    ``super_labels`` (the bundled domains' parent level: a radical, an icon's context, a topic).

    Raises:
        ConfigError: the dataset has no ``super_labels``, or its labels do not form a tree.
    """
    from ..losses.parent_label_loss import class_parents

    parents = getattr(dataset, "super_labels", None)
    if parents is None:
        raise ConfigError(f"{type(dataset).__name__} has no parent labels (.super_labels): --parent-weight "
                          "needs a dataset with a parent level (the bundled glyphs, icons, iconify)")
    parents = np.asarray(parents)
    try:
        return class_parents(dataset_labels(dataset), parents[:, 0] if parents.ndim == 2 else parents)
    except ValueError as err:
        raise ConfigError(f"{type(dataset).__name__}'s parent labels: {err}") from None


def pseudo_label_options(args: Any, paper_config: Optional[dict] = None) -> dict:
    """Keyword arguments of ``UnsupervisedPseudoLabels`` from the unsupervised recipe's flags:
    ``paper_config`` (the paper's policy, ``--paper-pseudo-labels``) or nothing, then every flag
    given on top: ``--levels`` (a tuple), ``--linkage``, ``--pseudo-source``, ``--whiten`` (0 means
    no whitening: None) and ``--min-cluster-size``. Flags left at None keep the base value.

    Why here: the recipe file stays configuration, and this mapping is reachable by a test.

    Args:
        args: the parsed arguments (``levels``, ``linkage``, ``pseudo_source``, ``whiten``,
            ``min_cluster_size``; a missing one counts as None).
        paper_config: the base options, or None for the policy's own defaults.

    Returns:
        The options, without ``c`` and ``seed`` (the recipe adds its geometry and seed).

    Design note: docs/design/training.md
    """
    options = dict(paper_config) if paper_config else {}
    for key, flag in (("levels", "levels"), ("linkage", "linkage"), ("source", "pseudo_source"),
                      ("whiten", "whiten"), ("min_cluster_size", "min_cluster_size")):
        value = getattr(args, flag, None)
        if value is not None:
            options[key] = tuple(value) if key == "levels" else (None if key == "whiten" and value == 0 else value)
    return options


class RecipeDataMixin:
    """Data of a recipe run: ``self.train_set`` / ``self.train_eval_set`` (two views of the same
    training images), ``self.eval_sets`` and ``self.splits_to_eval``, and the sampler.

    Design note: docs/design/training.md
    """

    def train_dataset(self, dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
        """The training set as the trainer sees it (e.g. wrapped for pseudo-labels)."""
        return dataset

    def build_sampler(self, labels: np.ndarray, per_rank_batch: int):
        """The class-balanced batch sampler of this rank."""
        from ..data import ClassBalancedBatchSampler

        a = self.args
        return ClassBalancedBatchSampler(labels, per_rank_batch, a.samples_per_class, num_batches=a.steps_per_epoch,
                                         seed=a.seed, rank=self.ctx.rank if self.ctx.enabled else None,
                                         world_size=self.ctx.world_size if self.ctx.enabled else None)

    def setup_data(self):
        from ..data import build_dataset, build_transforms

        a = self.args
        self.dataset_name, self.data_root, banner = resolve_dataset(a.dataset, a.data_root, self.real_dataset)
        if banner:
            self.say(banner)
            self.say(f"[pml-hyperbolic] bundled-data settings: backbone {a.backbone} "
                     f"({'ImageNet-pretrained' if a.pretrained else 'random init'}"
                     f"{', frozen: head-only training' if a.freeze_trunk else ''}) at {a.image_size}px, batch "
                     f"{a.batch_size} ({a.samples_per_class}/class), {a.epochs} epochs x {a.steps_per_epoch} steps; "
                     "the paper's ViT-S/16 setup runs with the real data (see --help).")
        self.status(f"indexing the {self.dataset_name} data" + (f" in {self.data_root}" if self.data_root else "")
                    + " ...")
        started = time.time()
        # the glyph pipeline keeps drawings unmirrored and uncropped (a mirrored character or arrow is
        # another class): the glyphs and the monochrome icon sets; everything else, the RGB theme icons
        # included, takes the ImageNet one
        kind = "glyph" if self.dataset_name in ("glyphs", "iconify") else "imagenet"
        train_tf = build_transforms(kind, train=True, image_size=a.image_size, resize_size=a.resize_size)
        eval_tf = build_transforms(kind, train=False, image_size=a.image_size, resize_size=a.resize_size)
        train_set = build_dataset(self.dataset_name, "train", root=self.data_root, transform=train_tf)
        train_eval_set = build_dataset(self.dataset_name, "train", root=self.data_root, transform=eval_tf)
        idx = train_subset_indices(len(train_set), a.max_train_samples, a.seed)
        if idx is not None:  # the same images in both views of the training set
            train_set, train_eval_set = LabelledSubset(train_set, idx), LabelledSubset(train_eval_set, idx)
        self.train_set = self.train_dataset(train_set)
        self.train_eval_set = train_eval_set
        self.splits_to_eval = eval_protocol(self.dataset_name)
        names = {q for q, _ in self.splits_to_eval} | {r for _, refs in self.splits_to_eval for r in refs}
        self.eval_sets = {s: seeded_subset(build_dataset(self.dataset_name, s, root=self.data_root, transform=eval_tf),
                                           a.max_eval_samples, a.seed) for s in names}
        sizes = ", ".join(f"{split} {len(ds)}" for split, ds in sorted(self.eval_sets.items()))
        self.status(f"data ready: train {len(self.train_eval_set)}, {sizes} images ({time.time() - started:.1f} s)")

    def count_unreadable(self) -> int:
        """Distinct unreadable images met so far in the training and evaluation sets (the counts are
        shared with DataLoader workers; the two training views share their files)."""
        def base(ds):
            while isinstance(ds, torch.utils.data.Subset) or hasattr(ds, "base"):
                ds = ds.dataset if isinstance(ds, torch.utils.data.Subset) else ds.base
            return ds

        bases = {id(b): b for b in map(base, [self.train_set, self.train_eval_set, *self.eval_sets.values()])}
        paths = set()
        for b in bases.values():
            paths.update(getattr(b, "unreadable_paths", ()))
        return len(paths) + sum(getattr(b, "_dropped_unreadable", 0) for b in bases.values())
