"""The common core of the bundled datasets whose instances are one class drawn in several styles (private).

A class (an icon name, an icon concept) is drawn by several styles (icon themes, icon sets); every
style belongs to the ``"query"`` or the ``"gallery"`` group; classes are split into training and
held-out classes, and every class has one parent. :class:`StyledArchiveDataset` turns such an
archive into the four splits and their label arrays; the subclasses name the style (theme, set).

Design note: docs/design/data.md
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional

import numpy as np
from PIL import Image
from torch.utils.data import Dataset


class StyledArchiveDataset(Dataset):
    """Splits of a styled archive: ``"train"``, ``"test"``, ``"query"``, ``"gallery"``.

    ``"train"`` holds every drawing of the training classes, ``"test"`` every drawing of the held-out
    classes, ``"query"`` / ``"gallery"`` the held-out classes drawn by the query / gallery group of
    styles (one label space for both). Labels are remapped to 0..C-1 over the split's side of the
    class split, parents likewise.

    Args:
        split: "train", "test", "query" or "gallery".
        transform: applied to the PIL image, or None.
        archive: field name -> array, as the subclass's reader returns it; must hold ``images``,
            ``item_classes``, ``class_parents``, ``class_is_test``, ``class_names``, ``parent_names``,
            ``metadata`` and the style fields named by ``style_field`` and ``group_field``.
        style_field: the per-item style index field (e.g. ``"item_themes"``).
        group_field: the per-style group field (``"query"`` / ``"gallery"`` values).

    Attributes ``style_ids`` and ``style_groups`` hold each sample's style and its group; the
    subclasses expose them under their own names (``theme_ids``, ``set_groups``, ...).

    Raises:
        ValueError: an unknown ``split`` or a non-callable ``transform``.
    """

    SPLITS = ("train", "test", "query", "gallery")

    @classmethod
    def check_arguments(cls, split: str, transform: Optional[Callable]) -> None:
        """One clear error for an unknown split or a non-callable transform (before any file is read)."""
        if split not in cls.SPLITS:
            raise ValueError(f"split must be one of {cls.SPLITS}, got {split!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable or None, got {type(transform).__name__}")

    def __init__(self, split: str, transform: Optional[Callable], archive: Dict[str, np.ndarray],
                 style_field: str, group_field: str):
        self.check_arguments(split, transform)
        item_classes = archive["item_classes"].astype(np.int64)
        item_styles = archive[style_field].astype(np.int64)
        class_parents = archive["class_parents"].astype(np.int64)
        class_is_test = archive["class_is_test"].astype(bool)
        groups = archive[group_field]
        self.metadata = json.loads(str(archive["metadata"]))
        self.split = split
        self.transform = transform

        keep = class_is_test[item_classes] if split != "train" else ~class_is_test[item_classes]
        if split in ("query", "gallery"):
            keep &= groups[item_styles] == split
        self.indices = np.flatnonzero(keep)
        self._images = archive["images"]
        self.style_ids = item_styles[self.indices]
        self.style_groups = groups[self.style_ids]

        # Remap over all classes of the split side (query and gallery share it).
        side_classes = np.flatnonzero(class_is_test if split != "train" else ~class_is_test)
        self.labels = np.searchsorted(side_classes, item_classes[self.indices]).astype(np.int64)
        parent_ids, class_to_parent = np.unique(class_parents[side_classes], return_inverse=True)
        self.super_labels = class_to_parent.reshape(-1)[self.labels].astype(np.int64)
        self.parent_labels = self.super_labels
        self.hierarchical_labels = np.stack([self.labels, self.super_labels], axis=1)
        self.class_names = archive["class_names"][side_classes]
        self.parent_names = archive["parent_names"][parent_ids]
        self.num_classes = len(side_classes)
        self.num_super_classes = len(parent_ids)

    @property
    def image_size(self) -> int:
        """Side of the square images in pixels."""
        return int(self._images.shape[1])

    def pixel_array(self) -> np.ndarray:
        """The split's uint8 images, ``(N, H, W)`` greyscale or ``(N, H, W, 3)`` RGB (255 = white
        background): for raw-pixel baselines."""
        return self._images[self.indices]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self._images[self.indices[index]])  # "L" or "RGB", as stored
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])


def existing_archive(path: str, kind: str, rebuild_hint: str) -> str:
    """``path`` if it is a file, else one FileNotFoundError naming it and how to rebuild it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} array file {path} not found; {rebuild_hint}")
    return path
