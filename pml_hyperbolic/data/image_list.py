"""Shared machinery of the benchmark loaders: label remapping, RGB conversion, unreadable-image handling.

Design note: docs/design/data.md
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import warnings
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, default_collate

_UNREADABLE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class DatasetNotFoundError(FileNotFoundError):
    """A dataset folder is missing or does not match any supported layout."""


def missing_dataset_error(dataset_name: str, root: Any, layouts: Sequence[str], source: str) -> DatasetNotFoundError:
    """Build the one error every loader raises: what was expected, where, and where to get it.

    Args:
        dataset_name: name shown in the message.
        root: where the data was looked for.
        layouts: the accepted folder layouts, one line each.
        source: where to get the data.

    Returns:
        The :class:`DatasetNotFoundError` (to raise), with a one-line message.
    """
    # One line (the recipes print it as their only error line); layouts are numbered when several.
    if len(layouts) == 1:
        expected = layouts[0]
    else:
        expected = "; ".join(f"({i}) {layout}" for i, layout in enumerate(layouts, 1))
    return DatasetNotFoundError(
        f"{dataset_name}: no supported layout found under {str(root)!r}. Expected one of: {expected}. "
        f"Nothing is downloaded automatically. Get the data from {source}, extract it, and pass its folder "
        f"(root=..., --data-root in the recipes, or the dataset's PML_HYPERBOLIC_* environment variable)."
    )


def remap_labels(raw_labels: Any, label_space: Any = None) -> Tuple[np.ndarray, np.ndarray]:
    """Map raw labels to 0..C-1 in sorted order of ``label_space`` (default: the labels' own unique values).

    Args:
        raw_labels: the labels as read (any sortable ids).
        label_space: sorted ids that define the numbering; None: the unique values of ``raw_labels``.

    Returns:
        ``(labels, label_space)``, labels int64.

    Raises:
        ValueError: a label outside ``label_space``.
    """
    raw = np.asarray(raw_labels).reshape(-1)
    if label_space is None:
        label_space = np.unique(raw)
    label_space = np.asarray(label_space)
    labels = np.searchsorted(label_space, raw)
    if raw.size and (labels.max() >= len(label_space) or np.any(label_space[labels] != raw)):
        raise ValueError("labels contain ids outside the given label space")
    return labels.astype(np.int64), label_space


class ImageListDataset(Dataset):
    """A list of image paths with labels, optionally a super-label per image.

    * Labels are remapped to ``0..C-1`` (``.labels``, int64); the original
      ids are kept in ``.raw_labels``. Super labels likewise, and when present
      ``.hierarchical_labels`` is the ``(N, 2)`` array [class, super-class].
    * Every image is converted to RGB (the benchmarks contain greyscale and
      CMYK JPEGs, which would otherwise break batching or normalisation).
    * An unreadable image does not crash an epoch. It is reported once with a
      warning and counted in ``.num_unreadable``; the flags live in shared
      memory, so DataLoader workers (any number, any epoch) add to the same
      count and a file is reported and decoded-and-failed only once. With
      ``on_unreadable="skip"`` (default) ``__getitem__`` returns ``None`` and
      :func:`collate_skipping_unreadable` drops it from the batch (the batch is
      one smaller; pass it as the DataLoader's / PML trainer's and tester's
      ``collate_fn``). With ``"substitute"`` another image of the same class is
      returned instead (batches keep their size and class balance, but never
      use it for evaluation: a duplicate is a perfect same-class neighbour).
      :meth:`check_images` finds and drops such files up front.

    Args:
        paths: image files.
        raw_labels: one class id per image.
        raw_super_labels: one super-class id per image, or None.
        transform: applied to each RGB PIL image.
        split: the split's name (shown in ``repr``).
        label_space: sorted class ids defining the numbering (see :func:`remap_labels`).
        super_label_space: likewise for the super-classes.
        on_unreadable: ``"skip"`` or ``"substitute"``.

    Raises:
        ValueError: ``paths`` and ``raw_labels`` differ in length, or a bad ``on_unreadable``.
    """

    def __init__(self, paths: Sequence[Any], raw_labels: Any, raw_super_labels: Any = None,
                 transform: Optional[Callable] = None, split: Optional[str] = None, label_space: Any = None,
                 super_label_space: Any = None, on_unreadable: str = "skip"):
        if len(paths) != len(raw_labels):
            raise ValueError("paths and labels differ in length")
        if on_unreadable not in ("skip", "substitute"):
            raise ValueError(f"on_unreadable must be 'skip' or 'substitute', got {on_unreadable!r}")
        self.on_unreadable = on_unreadable
        self.paths = [str(p) for p in paths]
        self.split = split
        self.transform = transform
        self._set_labels(
            np.asarray(raw_labels),
            None if raw_super_labels is None else np.asarray(raw_super_labels),
            label_space=label_space,
            super_label_space=super_label_space,
        )
        self._dropped_unreadable = 0
        self._new_unreadable_flags()

    def _new_unreadable_flags(self):
        # one shared byte per image: DataLoader workers are other processes, and a per-process
        # count would be lost with them (and restart at 0 in every epoch's fresh workers)
        self._unreadable_flags = multiprocessing.RawArray("b", max(1, len(self.paths)))

    def _flags(self):
        return np.frombuffer(self._unreadable_flags, dtype=np.int8)[: len(self.paths)]

    @property
    def num_unreadable(self) -> int:
        """How many distinct images failed to decode so far (in this process and its workers)."""
        return int(np.count_nonzero(self._flags())) + self._dropped_unreadable

    @property
    def unreadable_paths(self):
        """The paths that failed to decode so far."""
        return [self.paths[i] for i in np.flatnonzero(self._flags())]

    def __getstate__(self):
        state = self.__dict__.copy()
        if multiprocessing.context.get_spawning_popen() is None:
            # plain pickling / deepcopy (not a worker being started): shared memory cannot travel,
            # the copy gets its own flags with the same content
            state["_unreadable_flags"] = bytes(self._flags().tobytes())
        return state

    def __setstate__(self, state):
        flags = state["_unreadable_flags"]
        self.__dict__.update(state)
        if isinstance(flags, bytes):
            self._new_unreadable_flags()
            self._flags()[:] = np.frombuffer(flags, dtype=np.int8)[: len(self.paths)]

    def _set_labels(self, raw_labels, raw_super_labels, label_space=None, super_label_space=None):
        self.raw_labels = raw_labels
        # label_space: sorted raw ids shared with another split (In-Shop query / gallery)
        self.labels, self.class_ids = remap_labels(raw_labels, label_space)
        self.num_classes = len(self.class_ids)
        self.raw_super_labels = raw_super_labels
        if raw_super_labels is None:
            self.super_labels = None
            self.hierarchical_labels = None
            self.num_super_classes = 0
        else:
            self.super_labels, self.super_class_ids = remap_labels(raw_super_labels, super_label_space)
            self.num_super_classes = len(self.super_class_ids)
            self.hierarchical_labels = np.stack([self.labels, self.super_labels], axis=1)
        self._members_by_label = None

    def __len__(self):
        return len(self.paths)

    @staticmethod
    def _open_rgb(path):
        with Image.open(path) as image:
            return image.convert("RGB")  # convert() forces a full decode inside the try

    def _note_unreadable(self, index, error):
        if self._unreadable_flags[index]:
            return
        self._unreadable_flags[index] = 1
        what = ("skipped (its batch is one image smaller)" if self.on_unreadable == "skip"
                else "replaced by another image of the same class")
        warnings.warn(
            f"unreadable image {self.paths[index]} ({type(error).__name__}: {error}) {what}; "
            f"{self.num_unreadable} unreadable so far",
            RuntimeWarning,
            stacklevel=3,
        )

    def _same_class_substitutes(self, index):
        if self._members_by_label is None:
            order = np.argsort(self.labels, kind="stable")
            bounds = np.searchsorted(self.labels[order], np.arange(self.num_classes + 1))
            self._members_by_label = [order[bounds[c]:bounds[c + 1]] for c in range(self.num_classes)]
        members = self._members_by_label[self.labels[index]]
        start = int(np.searchsorted(members, index))
        return [int(i) for i in np.roll(members, -start) if i != index]

    def _try_open(self, index):
        """The RGB image at ``index``, or None (flagged, warned once) when it cannot be decoded."""
        if self._unreadable_flags[index]:
            return None
        try:
            return self._open_rgb(self.paths[index])
        except _UNREADABLE_ERRORS as error:
            self._note_unreadable(index, error)
            return None

    def load_image(self, index: int) -> Optional[Image.Image]:
        """The RGB PIL image at ``index``; if it is unreadable, None (``on_unreadable="skip"``) or
        a readable same-class substitute (``"substitute"``)."""
        image = self._try_open(index)
        if image is not None or self.on_unreadable == "skip":
            return image
        for other in self._same_class_substitutes(index):
            image = self._try_open(other)
            if image is not None:
                return image
        raise RuntimeError(f"no readable image left in class {self.labels[index]} "
                           f"(e.g. {self.paths[index]})")

    def __getitem__(self, index):
        image = self.load_image(index)
        if image is None:
            return None  # dropped by collate_skipping_unreadable
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def check_images(self, drop: bool = True) -> int:
        """Decode every image once; warn about, count and (if ``drop``) remove unreadable ones.

        Labels keep their label space, so a class that loses all images just
        becomes empty. Returns the number of unreadable files found.
        """
        bad = [index for index in range(len(self.paths)) if self._try_open(index) is None]
        if drop and bad:
            keep = np.setdiff1d(np.arange(len(self.paths)), bad)
            self.paths = [self.paths[i] for i in keep]
            self._dropped_unreadable += len(bad)
            self._new_unreadable_flags()
            raw_super = None if self.raw_super_labels is None else self.raw_super_labels[keep]
            super_space = None if raw_super is None else self.super_class_ids
            self._set_labels(self.raw_labels[keep], raw_super, label_space=self.class_ids, super_label_space=super_space)
        return len(bad)

    def __repr__(self):
        return (
            f"{self.__class__.__name__}(split={self.split!r}, images={len(self)}, classes={self.num_classes}"
            f"{', super_classes=%d' % self.num_super_classes if self.super_labels is not None else ''})"
        )


def first_existing(candidates: Iterable[Any], predicate: Callable[[Any], bool] = os.path.exists) -> Any:
    """The first of ``candidates`` for which ``predicate`` holds, or None."""
    for candidate in candidates:
        if predicate(candidate):
            return candidate
    return None


def collate_skipping_unreadable(batch: List[Any]) -> Any:
    """``collate_fn`` for :class:`ImageListDataset` with ``on_unreadable="skip"``: drops the
    ``None`` items of unreadable images, then collates as PyTorch's default does. A batch with no
    readable image at all becomes ``None`` (with a warning), which this package's trainer and
    tester skip."""
    kept = [item for item in batch if item is not None]
    if not kept:
        # nothing to collate: the package's trainer and tester skip a None batch
        warnings.warn(f"all {len(batch)} images of a batch were unreadable; the batch is skipped "
                      "(dataset.check_images() finds and drops the bad files)", RuntimeWarning, stacklevel=2)
        return None
    return default_collate(kept)
