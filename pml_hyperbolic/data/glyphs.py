"""The bundled CJK glyph dataset: a small real image set with a radical -> character hierarchy.

Design note: docs/design/data.md
"""
from __future__ import annotations

import json
import os
from typing import Callable, Dict, Optional, Union

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ._archive import read_npz_archive

BUNDLED_GLYPHS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cjk_glyphs.npz")
QUERY_FAMILY = "display"


_ARCHIVE_FIELDS = ("images", "characters", "char_radicals", "radical_characters", "char_is_test", "font_names",
                   "font_families", "metadata")
_archive_cache = {}


def read_glyph_archive(path: str) -> Dict[str, np.ndarray]:
    """The arrays of a glyph ``.npz`` file, decompressed once per process and file version.

    Why: a run builds four splits (and two views of the training split) from the same file. Keyed by
    the resolved path, size and modification time, so a rebuilt file is read again; the arrays are
    read-only (shared by every dataset built from the file).

    Args:
        path: the ``.npz`` file.

    Returns:
        Field name → read-only array.

    Raises:
        ValueError: the file lacks one of the expected fields.
    """
    return read_npz_archive(path, _ARCHIVE_FIELDS, _archive_cache, "glyph",
                            "regenerate it with `python -m pml_hyperbolic.data.build_glyphs --install-fonts`")


class GlyphDataset(Dataset):
    """Joyo kanji rendered in 29 real typefaces; classes are characters, super-classes radicals.

    Built by ``python -m pml_hyperbolic.data.build_glyphs`` from Debian's CJK font
    packages and Unihan (see ``GLYPHS_LICENSES.md``) and shipped with the package,
    so the recipes run on a machine that holds no benchmark and cannot download.

    Content: 320 characters from 32 Kangxi radicals (10 each), one rendering per
    typeface, 40x40 px, black ink on white paper, returned as RGB. Every
    rendering carries a random scale / aspect / rotation / stroke-weight /
    position change baked in at build time, so that identical characters do not
    line up pixel for pixel.

    Splits (character classes are disjoint between train and the rest; every
    radical contributes 5 characters to each side, so the radical level exists
    in both):

    * ``"train"``: all typefaces of the 160 training characters.
    * ``"test"``: all typefaces of the 160 held-out characters
      (the easy "query = reference" protocol; reported for completeness).
    * ``"query"`` / ``"gallery"``: **the evaluation protocol.** Queries are the
      held-out characters rendered in the held-out *display* style family
      (brush Kai, rounded, pixel and hand-lettered faces, 6 fonts); the gallery
      holds the same characters in the *serif* (Mincho/Song) and *sans*
      (Gothic/Hei) families (23 fonts). A query must be matched across a style
      change, which raw pixels do badly (how the baselines score: the design note).
      Query and gallery share one label space, so labels compare directly.

    Attributes:
        labels: character label per sample, int64, remapped to 0..C-1 over the
            split (over query+gallery jointly for those two).
        super_labels: radical label per sample, remapped likewise.
        hierarchical_labels: ``(N, 2)`` int64, column 0 character, column 1 radical.
        num_classes: size of the character label space.
        num_super_classes: size of the radical label space.
        characters: the Unicode character of each class.
        radicals: the Unicode character of each super-class.
        font_names: typeface of each sample.
        font_families: style family of each sample.

    Args:
        split: "train", "test", "query" or "gallery".
        transform: applied to the PIL RGB image (e.g. ``build_transforms("glyph")``).
        root: a ``.npz`` file or a folder containing ``cjk_glyphs.npz``; default the bundled file.
        query_family: style family used as queries in the hard protocol.

    Raises:
        ValueError: an unknown ``split`` or ``query_family``, or an archive lacking fields.
        FileNotFoundError: no glyph archive at ``root``.

    Design note: docs/design/data.md
    """

    SPLITS = ("train", "test", "query", "gallery")

    def __init__(self, split: str = "train", transform: Optional[Callable] = None,
                 root: Optional[Union[str, os.PathLike]] = None, query_family: str = QUERY_FAMILY):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        path = BUNDLED_GLYPHS_PATH if root is None else str(root)
        if os.path.isdir(path):
            path = os.path.join(path, "cjk_glyphs.npz")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"glyph array file {path} not found; regenerate it with "
                "`python -m pml_hyperbolic.data.build_glyphs --install-fonts`"
            )
        archive = read_glyph_archive(path)
        images = archive["images"]  # (characters, fonts, H, W) ink intensity
        characters = archive["characters"]
        char_radicals = archive["char_radicals"].astype(np.int64)
        radical_characters = archive["radical_characters"]
        char_is_test = archive["char_is_test"].astype(bool)
        font_names = archive["font_names"]
        font_families = archive["font_families"]
        self.metadata = json.loads(str(archive["metadata"]))
        if query_family not in set(font_families.tolist()):
            raise ValueError(f"query_family {query_family!r} not in {sorted(set(font_families.tolist()))}")

        self.split = split
        self.transform = transform
        chars = np.flatnonzero(char_is_test if split != "train" else ~char_is_test)
        if split == "query":
            fonts = np.flatnonzero(font_families == query_family)
        elif split == "gallery":
            fonts = np.flatnonzero(font_families != query_family)
        else:
            fonts = np.arange(len(font_names))

        char_grid, font_grid = np.meshgrid(chars, fonts, indexing="ij")
        char_ids, font_ids = char_grid.ravel(), font_grid.ravel()
        # Paper white, ink black: closer to natural-image statistics than white-on-black.
        self._pixels = 255 - images[char_ids, font_ids]
        self.font_ids = font_ids
        self.font_names = font_names[font_ids]
        self.font_families = font_families[font_ids]

        # Remap over all characters of the split side (query and gallery share it).
        class_ids, self.labels = np.unique(char_ids, return_inverse=True)
        self.labels = self.labels.astype(np.int64)
        radical_ids, class_to_radical = np.unique(char_radicals[class_ids], return_inverse=True)
        self.super_labels = class_to_radical[self.labels].astype(np.int64)
        self.hierarchical_labels = np.stack([self.labels, self.super_labels], axis=1)
        self.characters = characters[class_ids]
        self.radical_numbers = radical_ids
        first_char_of_radical = [np.flatnonzero(char_radicals == r)[0] for r in radical_ids]
        self.radicals = radical_characters[first_char_of_radical]
        self.num_classes = len(class_ids)
        self.num_super_classes = len(radical_ids)

    @property
    def image_size(self):
        return self._pixels.shape[-1]

    def pixel_array(self):
        """``(N, H, W)`` uint8 greyscale array (255 = paper): for raw-pixel baselines."""
        return self._pixels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = Image.fromarray(self._pixels[index])  # greyscale ("L")
        # the package's glyph pipelines give the same output for the grey image as for its RGB
        # conversion, at a third of the work: only other transforms (and none) get RGB
        if not getattr(self.transform, "accepts_greyscale", False):
            image = image.convert("RGB")
        if self.transform is not None:
            image = self.transform(image)
        return image, int(self.labels[index])

    def __repr__(self):
        return (
            f"GlyphDataset(split={self.split!r}, samples={len(self)}, classes={self.num_classes}, "
            f"radicals={self.num_super_classes}, image_size={self.image_size})"
        )
