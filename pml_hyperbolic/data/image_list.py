"""Shared machinery of the benchmark loaders: label remapping, RGB conversion, unreadable-image handling."""

import os
import warnings

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

_UNREADABLE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


class DatasetNotFoundError(FileNotFoundError):
    """A dataset folder is missing or does not match any supported layout."""


def missing_dataset_error(dataset_name, root, layouts, source):
    """Build the one error message every loader raises: what was expected, where, and where to get it."""
    expected = "\n".join(f"  - {layout}" for layout in layouts)
    return DatasetNotFoundError(
        f"{dataset_name}: no supported layout found under {str(root)!r}.\n"
        f"Expected one of:\n{expected}\n"
        f"Nothing is downloaded automatically. Get the data from {source}, extract it, and pass "
        f"its folder as root (or set the environment variable named in find_dataset_root)."
    )


def remap_labels(raw_labels, label_space=None):
    """Map raw labels to 0..C-1 in sorted order of ``label_space`` (default: the labels' own unique values).

    Returns ``(labels, label_space)``.
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
    * An unreadable image does not crash an epoch: it is reported once with a
      warning, counted in ``.num_unreadable`` (per process; DataLoader workers
      keep their own count) and replaced by another image of the same class.
      :meth:`check_images` finds and drops such files up front.
    """

    def __init__(self, paths, raw_labels, raw_super_labels=None, transform=None, split=None,
                 label_space=None, super_label_space=None):
        if len(paths) != len(raw_labels):
            raise ValueError("paths and labels differ in length")
        self.paths = [str(p) for p in paths]
        self.split = split
        self.transform = transform
        self._set_labels(
            np.asarray(raw_labels),
            None if raw_super_labels is None else np.asarray(raw_super_labels),
            label_space=label_space,
            super_label_space=super_label_space,
        )
        self.num_unreadable = 0
        self.unreadable_paths = set()

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

    def _note_unreadable(self, path, error):
        if path in self.unreadable_paths:
            return
        self.unreadable_paths.add(path)
        self.num_unreadable += 1
        warnings.warn(
            f"skipping unreadable image {path} ({type(error).__name__}: {error}); "
            f"{self.num_unreadable} unreadable so far, using another image of the same class",
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

    def load_image(self, index):
        """The RGB PIL image at ``index``, or a readable same-class substitute."""
        path = self.paths[index]
        if path not in self.unreadable_paths:
            try:
                return self._open_rgb(path)
            except _UNREADABLE_ERRORS as error:
                self._note_unreadable(path, error)
        for other in self._same_class_substitutes(index):
            other_path = self.paths[other]
            if other_path in self.unreadable_paths:
                continue
            try:
                return self._open_rgb(other_path)
            except _UNREADABLE_ERRORS as error:
                self._note_unreadable(other_path, error)
        raise RuntimeError(f"no readable image left in class {self.labels[index]} (e.g. {path})")

    def __getitem__(self, index):
        image = self.load_image(index)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def check_images(self, drop=True):
        """Decode every image once; warn about, count and (if ``drop``) remove unreadable ones.

        Labels keep their label space, so a class that loses all images just
        becomes empty. Returns the number of unreadable files found.
        """
        bad = []
        for index, path in enumerate(self.paths):
            try:
                self._open_rgb(path)
            except _UNREADABLE_ERRORS as error:
                self._note_unreadable(path, error)
                bad.append(index)
        if drop and bad:
            keep = np.setdiff1d(np.arange(len(self.paths)), bad)
            self.paths = [self.paths[i] for i in keep]
            raw_super = None if self.raw_super_labels is None else self.raw_super_labels[keep]
            super_space = None if raw_super is None else self.super_class_ids
            self._set_labels(self.raw_labels[keep], raw_super, label_space=self.class_ids, super_label_space=super_space)
        return len(bad)

    def __repr__(self):
        return (
            f"{self.__class__.__name__}(split={self.split!r}, images={len(self)}, classes={self.num_classes}"
            f"{', super_classes=%d' % self.num_super_classes if self.super_labels is not None else ''})"
        )


def first_existing(candidates, predicate=os.path.exists):
    for candidate in candidates:
        if predicate(candidate):
            return candidate
    return None
