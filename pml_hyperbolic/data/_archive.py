"""Reading the bundled ``.npz`` datasets (private): decompressed once per process and file version."""
from __future__ import annotations

import os
from typing import Dict, Optional, Sequence, Union

import numpy as np


def read_npz_archive(path: str, fields: Sequence[str], cache: dict, kind: str, rebuild_hint: str
                     ) -> Dict[str, np.ndarray]:
    """The ``fields`` of the ``.npz`` file ``path`` as read-only arrays, decompressed once.

    Why: a run builds several splits from the same file. ``cache`` (one per dataset module) is keyed
    by the resolved path, size and modification time, so a rebuilt file is read again, and holds one
    file version at a time (a rebuilt archive frees the old one).

    Args:
        path: the ``.npz`` file.
        fields: the arrays the file must hold.
        cache: the caller's cache dict.
        kind: what the file holds, for the message (e.g. ``"glyph"``).
        rebuild_hint: how to regenerate the file, for the message.

    Returns:
        Field name → read-only array.

    Raises:
        ValueError: the file lacks one of ``fields``.
    """
    real = os.path.realpath(path)
    info = os.stat(real)
    key = (real, info.st_size, info.st_mtime_ns)
    arrays = cache.get(key)
    if arrays is None:
        with np.load(real) as archive:
            missing = [name for name in fields if name not in archive.files]
            if missing:
                raise ValueError(f"{kind} array file {path} lacks {missing}; {rebuild_hint}")
            arrays = {name: archive[name] for name in fields}
        for array in arrays.values():
            array.setflags(write=False)
        cache.clear()
        cache[key] = arrays
    return arrays


def archive_path(root: Optional[Union[str, os.PathLike]], bundled_path: str, file_name: str) -> str:
    """The ``.npz`` file named by ``root``: the file itself, ``file_name`` inside a folder, or
    ``bundled_path`` when ``root`` is None (``~`` expanded; existence not checked).

    Args:
        root: a file or folder, or None.
        bundled_path: the file shipped with the package.
        file_name: the archive's name inside a folder.

    Returns:
        The file's path.
    """
    path = bundled_path if root is None else os.path.expanduser(os.fspath(root))
    if os.path.isdir(path):
        path = os.path.join(path, file_name)
    return path
