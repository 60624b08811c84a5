"""The bundled Iconify icon-set dataset: one icon concept drawn by many monochrome icon sets, topic -> concept.

Design note: docs/design/iconify-domain.md
"""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Union

import numpy as np

from ._archive import archive_path, read_npz_archive
from ._styled_archive import StyledArchiveDataset, existing_archive

BUNDLED_ICONIFY_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "iconify_sets.npz")
ICONIFY_FILE_NAME = "iconify_sets.npz"

_ARCHIVE_FIELDS = ("images", "item_classes", "item_sets", "item_icons", "class_names", "class_parents",
                   "class_is_test", "parent_names", "set_names", "set_groups", "metadata")
_REBUILD_HINT = "regenerate it with `python -m pml_hyperbolic.data.build_iconify --fetch`"
_archive_cache = {}


def read_iconify_archive(path: str) -> Dict[str, np.ndarray]:
    """The arrays of an Iconify ``.npz`` file, decompressed once per process and file version.

    Why: a run builds several splits from the same file. Keyed by the resolved path, size and
    modification time, so a rebuilt file is read again; the arrays are read-only (shared by every
    dataset built from the file).

    Args:
        path: the ``.npz`` file.

    Returns:
        Field name -> read-only array.

    Raises:
        ValueError: the file lacks one of the expected fields (e.g. it is another dataset's file).
    """
    return read_npz_archive(path, _ARCHIVE_FIELDS, _archive_cache, "Iconify icon-set", _REBUILD_HINT)


def resolve_iconify_path(root: Optional[Union[str, os.PathLike]] = None) -> str:
    """The Iconify ``.npz`` file named by ``root`` (a file, or a folder holding ``iconify_sets.npz``).

    Args:
        root: a file or folder; ``None`` for the bundled file.

    Returns:
        The file's path (not checked for existence).
    """
    return archive_path(root, BUNDLED_ICONIFY_PATH, ICONIFY_FILE_NAME)


class IconifyDataset(StyledArchiveDataset):
    """Monochrome icons of many open icon sets (npm ``@iconify-json/*``); classes are icon concepts, parents topics.

    Built by ``python -m pml_hyperbolic.data.build_iconify`` from pinned versions of
    the sets' npm packages (see ``ICONIFY_LICENSES.md``) and shipped with the package,
    so a third real development domain is available offline. A class is a
    normalised icon name several sets draw (``bell``, ``arrow-left``, ``file-text``,
    ...); its instances are the drawings of that name by different sets (Tabler,
    Lucide, Material Design, Phosphor, Remix, Carbon, Fluent, ...), rendered black
    on white as greyscale; its parent is a topic (arrows, files, media, people,
    weather and nature, ...) read from the name's tokens.

    Unlike the freedesktop icons (colour artwork, a few broad contexts), every image
    is a single-colour line or solid drawing on a common grid, so a class differs
    from its neighbours (``bell`` / ``bell-off``, ``arrow-left`` / ``arrow-right``)
    by a few strokes, and the style of a set (stroke weight, corner radius, padding)
    changes all of them at once.

    Splits (icon classes are disjoint between train and the rest; every topic
    contributes about half of its classes to each side):

    * ``"train"``: all drawings of the training classes.
    * ``"test"``: all drawings of the held-out classes (query = reference protocol).
    * ``"query"`` / ``"gallery"``: **the evaluation protocol.** Queries are the
      held-out classes drawn by the query group of sets; the gallery holds the same
      classes drawn by the other sets, so a query is matched across a change of
      drawing style. Query and gallery share one label space.

    Attributes:
        labels: class label per sample, int64, remapped to 0..C-1 over the split
            (over query+gallery jointly for those two).
        super_labels: parent (topic) label per sample, remapped likewise.
        parent_labels: the same array as ``super_labels``.
        hierarchical_labels: ``(N, 2)`` int64, column 0 class, column 1 parent.
        num_classes: size of the class label space.
        num_super_classes: size of the parent label space.
        class_names: the normalised icon name of each class.
        parent_names: the topic name of each super-class.
        set_names: the icon set (Iconify prefix) of each sample.
        set_groups: ``"query"`` or ``"gallery"``, the group of each sample's set.
        icon_names: each sample's icon name within its set.
        metadata: the build settings and pinned set versions stored in the file.

    Args:
        split: "train", "test", "query" or "gallery".
        transform: applied to the PIL greyscale (``"L"``) image, e.g. a
            :func:`~pml_hyperbolic.data.build_transforms` pipeline (both kinds
            accept greyscale).
        root: a ``.npz`` file or a folder containing ``iconify_sets.npz``; default the bundled file.

    Raises:
        ValueError: an unknown ``split``, a non-callable ``transform``, or an archive lacking fields.
        FileNotFoundError: no Iconify archive at ``root``.

    Design note: docs/design/iconify-domain.md
    """

    def __init__(self, split: str = "train", transform: Optional[Callable] = None,
                 root: Optional[Union[str, os.PathLike]] = None):
        self.check_arguments(split, transform)
        archive = read_iconify_archive(existing_archive(resolve_iconify_path(root), "Iconify icon-set", _REBUILD_HINT))
        super().__init__(split, transform, archive, "item_sets", "set_groups")
        self.set_ids = self.style_ids
        self.set_names = archive["set_names"][self.style_ids]
        self.set_groups = self.style_groups
        self.icon_names = archive["item_icons"][self.indices]

    def __repr__(self) -> str:
        return (
            f"IconifyDataset(split={self.split!r}, samples={len(self)}, classes={self.num_classes}, "
            f"topics={self.num_super_classes}, image_size={self.image_size})"
        )
