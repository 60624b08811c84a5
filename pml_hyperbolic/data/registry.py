"""``build_dataset`` / ``find_dataset_root``: one entry point for every dataset, local folders only.

Importing this module imports only the standard library: the recipes read its names (environment variables,
folder names) while parsing the command line, before torch is loaded. The dataset classes are
imported on first use (``DATASET_CLASSES``, :func:`build_dataset`, :func:`find_dataset_root`).

Design note: docs/design/data.md
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ._archive import archive_path


def _dataset_classes():
    from .benchmarks import Cars196Dataset, CUB200Dataset, InShopDataset, OnlineProductsDataset
    from .glyphs import GlyphDataset
    from .iconify import IconifyDataset
    from .icons import IconDataset

    return {
        "cars196": Cars196Dataset,
        "cub200": CUB200Dataset,
        "sop": OnlineProductsDataset,
        "inshop": InShopDataset,
        "glyphs": GlyphDataset,
        "icons": IconDataset,
        "iconify": IconifyDataset,
    }


def _classes():
    if "DATASET_CLASSES" not in globals():
        globals()["DATASET_CLASSES"] = _dataset_classes()
    return globals()["DATASET_CLASSES"]


def __getattr__(name):
    # ``DATASET_CLASSES`` is built on first access (PEP 562) so that importing the module stays light.
    if name == "DATASET_CLASSES":
        return _classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Environment variables: a dataset-specific one wins over the shared data folder.
ROOT_ENVIRONMENT_VARIABLES = {
    "cars196": "PML_HYPERBOLIC_CARS196",
    "cub200": "PML_HYPERBOLIC_CUB200",
    "sop": "PML_HYPERBOLIC_SOP",
    "inshop": "PML_HYPERBOLIC_INSHOP",
    "glyphs": "PML_HYPERBOLIC_GLYPHS",
    "icons": "PML_HYPERBOLIC_ICONS",
    "iconify": "PML_HYPERBOLIC_ICONIFY",
}
SHARED_DATA_VARIABLE = "PML_HYPERBOLIC_DATA"

#: How the two object views of a glyph may be augmented (``transforms.glyph_view_transform``): the one
#: list of choices, here because the recipes' command line reads it without importing torch.
GLYPH_VIEW_AUGMENTATIONS = ("crop", "font")

# Folder names looked for inside $PML_HYPERBOLIC_DATA.
CONVENTIONAL_FOLDER_NAMES = {
    "cars196": ("cars196", "Cars196", "CARS196", "stanford_cars", "cars"),
    "cub200": ("cub200", "CUB_200_2011", "cub", "CUB", "cub_200_2011"),
    "sop": ("sop", "SOP", "Stanford_Online_Products", "online_products"),
    "inshop": ("inshop", "InShop", "in_shop", "In-shop Clothes Retrieval Benchmark", "deepfashion_inshop"),
    "glyphs": ("glyphs",),
    "icons": ("icons", "icon_themes"),
    "iconify": ("iconify", "iconify_sets"),
}


def _check_name(name):
    key = str(name).lower().replace("-", "").replace("_", "")
    aliases = {"cars": "cars196", "cub": "cub200", "cub2002011": "cub200", "onlineproducts": "sop",
               "stanfordonlineproducts": "sop", "cjkglyphs": "glyphs",
               "iconthemes": "icons", "freedesktopicons": "icons",
               "iconifysets": "iconify", "iconsets": "iconify"}
    key = aliases.get(key, key)
    if key not in ROOT_ENVIRONMENT_VARIABLES:
        raise ValueError(f"unknown dataset {name!r}; choose from {sorted(ROOT_ENVIRONMENT_VARIABLES)}")
    return key


# the archive file a folder of a bundled dataset holds
_BUNDLED_ARCHIVE_NAMES = {"glyphs": "cjk_glyphs.npz", "icons": "icon_themes.npz", "iconify": "iconify_sets.npz"}


def _is_valid_root(name, root):
    if root is None:
        return False
    root = os.path.expanduser(str(root))
    if name in _BUNDLED_ARCHIVE_NAMES:
        return os.path.isfile(archive_path(root, "", _BUNDLED_ARCHIVE_NAMES[name]))
    return _classes()[name].detect_layout(root) is not None


def find_dataset_root(name: str, root: Optional[str] = None) -> Optional[str]:
    """Return a folder holding dataset ``name`` in a supported layout, or ``None``.

    Looks, in order, at: the explicit ``root``; the dataset's own environment
    variable (``PML_HYPERBOLIC_CARS196``, ``..._CUB200``, ``..._SOP``,
    ``..._INSHOP``); ``$PML_HYPERBOLIC_DATA`` itself and its conventionally named
    sub-folders (e.g. ``$PML_HYPERBOLIC_DATA/cars196``). For ``"glyphs"``,
    ``"icons"`` and ``"iconify"`` the bundled array file's folder is the final
    fallback, so they are always found.
    Used by the recipes' ``--dataset auto``.

    Args:
        name: dataset name or alias (``"cars196"``, ``"cub200"``, ``"sop"``, ``"inshop"``,
            ``"glyphs"``, ``"icons"``, ``"iconify"``, ``"cub"``, ...).
        root: a folder (or, for the bundled datasets, a ``.npz`` file) to try first.

    Returns:
        The first candidate holding a supported layout, or None.

    Raises:
        ValueError: an unknown dataset name.
    """
    name = _check_name(name)
    candidates = [root, os.environ.get(ROOT_ENVIRONMENT_VARIABLES[name])]
    shared = os.environ.get(SHARED_DATA_VARIABLE)
    if shared:
        candidates.append(shared)
        candidates.extend(os.path.join(shared, folder) for folder in CONVENTIONAL_FOLDER_NAMES[name])
    if name == "glyphs":
        from .glyphs import BUNDLED_GLYPHS_PATH

        candidates.append(os.path.dirname(BUNDLED_GLYPHS_PATH))
    if name == "icons":
        from .icons import BUNDLED_ICONS_PATH

        candidates.append(os.path.dirname(BUNDLED_ICONS_PATH))
    if name == "iconify":
        from .iconify import BUNDLED_ICONIFY_PATH

        candidates.append(os.path.dirname(BUNDLED_ICONIFY_PATH))
    for candidate in candidates:
        if candidate and _is_valid_root(name, candidate):
            return os.path.expanduser(str(candidate))
    return None


def build_dataset(name: str, split: str, root: Optional[str] = None, transform: Optional[Callable] = None,
                  **dataset_kwargs: Any) -> Any:
    """Instantiate dataset ``name`` ("cars196", "cub200", "sop", "inshop", "glyphs", "icons", "iconify") for ``split``.

    Splits: "train" / "test" for all; "query" / "gallery" also for "inshop",
    "glyphs", "icons" and "iconify". ``root`` is resolved with :func:`find_dataset_root`; when nothing
    is found a :class:`DatasetNotFoundError` (a ``FileNotFoundError``) names the
    expected layouts and where to get the data. Nothing is ever downloaded.

    Args:
        name: dataset name or alias.
        split: one of the dataset class's ``SPLITS``.
        root: where to look first (see :func:`find_dataset_root`).
        transform: applied to each PIL image.
        **dataset_kwargs: passed to the dataset class.

    Returns:
        The dataset.

    Raises:
        ValueError: an unknown name or split.
        DatasetNotFoundError: no supported layout found.
    """
    from .glyphs import GlyphDataset
    from .image_list import missing_dataset_error

    name = _check_name(name)
    cls = _classes()[name]
    if split not in cls.SPLITS:
        raise ValueError(f"{name} has splits {cls.SPLITS}, got {split!r}")
    resolved = find_dataset_root(name, root)
    if name == "glyphs":
        return GlyphDataset(split=split, transform=transform, root=resolved, **dataset_kwargs)
    if name == "icons":
        from .icons import IconDataset

        return IconDataset(split=split, transform=transform, root=resolved, **dataset_kwargs)
    if name == "iconify":
        from .iconify import IconifyDataset

        return IconifyDataset(split=split, transform=transform, root=resolved, **dataset_kwargs)
    if resolved is None:
        where = root if root is not None else (
            f"${ROOT_ENVIRONMENT_VARIABLES[name]} / ${SHARED_DATA_VARIABLE} (neither points at the data)"
        )
        raise missing_dataset_error(name, where, cls.LAYOUTS, cls.SOURCE)
    return cls(resolved, split=split, transform=transform, **dataset_kwargs)
