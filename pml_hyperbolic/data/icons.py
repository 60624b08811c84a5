"""The bundled icon-theme dataset: freedesktop icons drawn by many themes, with a context -> icon hierarchy.

Design note: docs/design/icons-domain.md
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional, Union

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ._archive import read_npz_archive

BUNDLED_ICONS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "icon_themes.npz")
ICONS_FILE_NAME = "icon_themes.npz"

_ARCHIVE_FIELDS = ("images", "item_classes", "item_themes", "class_names", "class_parents", "class_is_test",
                   "parent_names", "theme_names", "theme_groups", "metadata")
_REBUILD_HINT = "regenerate it with `python -m pml_hyperbolic.data.build_icons --install-themes`"
_archive_cache = {}


def read_icon_archive(path: str) -> Dict[str, np.ndarray]:
    """The arrays of an icon ``.npz`` file, decompressed once per process and file version.

    Why: a run builds several splits from the same file. Keyed by the resolved path, size and
    modification time, so a rebuilt file is read again; the arrays are read-only (shared by every
    dataset built from the file).

    Args:
        path: the ``.npz`` file.

    Returns:
        Field name -> read-only array.

    Raises:
        ValueError: the file lacks one of the expected fields.
    """
    return read_npz_archive(path, _ARCHIVE_FIELDS, _archive_cache, "icon", _REBUILD_HINT)


def resolve_icons_path(root: Optional[Union[str, os.PathLike]] = None) -> str:
    """The icon ``.npz`` file named by ``root`` (a file, or a folder holding ``icon_themes.npz``).

    Args:
        root: a file or folder; ``None`` for the bundled file.

    Returns:
        The file's path (not checked for existence).
    """
    path = BUNDLED_ICONS_PATH if root is None else os.path.expanduser(os.fspath(root))
    if os.path.isdir(path):
        path = os.path.join(path, ICONS_FILE_NAME)
    return path


class IconDataset(Dataset):
    """freedesktop.org icons drawn by many icon themes; classes are icon names, super-classes contexts.

    Built by ``python -m pml_hyperbolic.data.build_icons`` from Debian's icon-theme
    packages (see ``ICONS_LICENSES.md``) and shipped with the package, so a second
    real development domain is available offline. A class is an icon name of the
    freedesktop naming scheme (``edit-copy``, ``folder-music``, ...); its
    instances are the drawings of that name by different themes (Adwaita,
    Breeze, Papirus, Oxygen, Tango, ...), rasterised as RGB over white; its
    parent is the freedesktop context (actions, apps, categories, devices,
    emblems, mimetypes, places, status).

    Splits (icon classes are disjoint between train and the rest; every context
    contributes about half of its classes to each side, so the context level
    exists in both):

    * ``"train"``: all drawings of the training classes.
    * ``"test"``: all drawings of the held-out classes (query = reference protocol).
    * ``"query"`` / ``"gallery"``: **the evaluation protocol.** Queries are the
      held-out classes drawn by the query group of themes; the gallery holds the
      same classes drawn by the other themes. A query must be matched across a
      change of artwork style. Query and gallery share one label space.

    Attributes:
        labels: class label per sample, int64, remapped to 0..C-1 over the split
            (over query+gallery jointly for those two).
        super_labels: parent (context) label per sample, remapped likewise.
        parent_labels: the same array as ``super_labels``.
        hierarchical_labels: ``(N, 2)`` int64, column 0 class, column 1 parent.
        num_classes: size of the class label space.
        num_super_classes: size of the parent label space.
        class_names: the icon name of each class.
        parent_names: the context name of each super-class.
        theme_names: the theme of each sample.
        theme_groups: ``"query"`` or ``"gallery"``, the group of each sample's theme.
        metadata: the build settings and theme versions stored in the file.

    Args:
        split: "train", "test", "query" or "gallery".
        transform: applied to the PIL RGB image (e.g. a torchvision pipeline).
        root: a ``.npz`` file or a folder containing ``icon_themes.npz``; default the bundled file.

    Raises:
        ValueError: an unknown ``split``, or an archive lacking fields.
        FileNotFoundError: no icon archive at ``root``.

    Design note: docs/design/icons-domain.md
    """

    SPLITS = ("train", "test", "query", "gallery")

    def __init__(self, split: str = "train", transform: Optional[Callable] = None,
                 root: Optional[Union[str, os.PathLike]] = None):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"transform must be callable or None, got {type(transform).__name__}")
        path = resolve_icons_path(root)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"icon array file {path} not found; {_REBUILD_HINT}")
        archive = read_icon_archive(path)
        item_classes = archive["item_classes"].astype(np.int64)
        item_themes = archive["item_themes"].astype(np.int64)
        class_parents = archive["class_parents"].astype(np.int64)
        class_is_test = archive["class_is_test"].astype(bool)
        theme_groups = archive["theme_groups"]
        self.metadata = json.loads(str(archive["metadata"]))

        self.split = split
        self.transform = transform
        keep = class_is_test[item_classes] if split != "train" else ~class_is_test[item_classes]
        if split == "query":
            keep &= theme_groups[item_themes] == "query"
        elif split == "gallery":
            keep &= theme_groups[item_themes] == "gallery"
        indices = np.flatnonzero(keep)
        self._images = archive["images"]
        self.indices = indices
        class_ids = item_classes[indices]
        self.theme_ids = item_themes[indices]
        self.theme_names = archive["theme_names"][self.theme_ids]
        self.theme_groups = theme_groups[self.theme_ids]

        # Remap over all classes of the split side (query and gallery share it).
        side_classes = np.flatnonzero(class_is_test if split != "train" else ~class_is_test)
        self.labels = np.searchsorted(side_classes, class_ids).astype(np.int64)
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
        """``(N, H, W, 3)`` uint8 RGB array of the split (255 = white background): for raw-pixel baselines."""
        return self._images[self.indices]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        image = Image.fromarray(self._images[self.indices[index]])  # RGB
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def __repr__(self) -> str:
        return (
            f"IconDataset(split={self.split!r}, samples={len(self)}, classes={self.num_classes}, "
            f"contexts={self.num_super_classes}, image_size={self.image_size})"
        )
