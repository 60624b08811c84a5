"""The bundled icon-theme dataset: freedesktop icons drawn by many themes, with a context -> icon hierarchy.

Design note: docs/design/icons-domain.md
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Union

import numpy as np

from ._archive import archive_path, read_npz_archive
from ._styled_archive import StyledArchiveDataset, existing_archive

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
    return archive_path(root, BUNDLED_ICONS_PATH, ICONS_FILE_NAME)


class IconDataset(StyledArchiveDataset):
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

    def __init__(self, split: str = "train", transform: Optional[Callable] = None,
                 root: Optional[Union[str, os.PathLike]] = None):
        self.check_arguments(split, transform)
        archive = read_icon_archive(existing_archive(resolve_icons_path(root), "icon", _REBUILD_HINT))
        super().__init__(split, transform, archive, "item_themes", "theme_groups")
        self.theme_ids = self.style_ids
        self.theme_names = archive["theme_names"][self.style_ids]
        self.theme_groups = self.style_groups

    def __repr__(self) -> str:
        return (
            f"IconDataset(split={self.split!r}, samples={len(self)}, classes={self.num_classes}, "
            f"contexts={self.num_super_classes}, image_size={self.image_size})"
        )
