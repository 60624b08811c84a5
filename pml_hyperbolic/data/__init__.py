"""Datasets, transforms and samplers for hyperbolic deep metric learning (all offline).

Design note: docs/design/data.md
"""
from __future__ import annotations

# Imported on first access (see ``pml_hyperbolic._lazy``): ``data.registry`` stays torch-free for the
# recipes' command line.
_EXPORTS = {
    "Cars196Dataset": ".benchmarks",
    "CUB200Dataset": ".benchmarks",
    "InShopDataset": ".benchmarks",
    "OnlineProductsDataset": ".benchmarks",
    "BUNDLED_GLYPHS_PATH": ".glyphs",
    "GlyphDataset": ".glyphs",
    "BUNDLED_ICONS_PATH": ".icons",
    "IconDataset": ".icons",
    "BUNDLED_ICONIFY_PATH": ".iconify",
    "IconifyDataset": ".iconify",
    "DatasetNotFoundError": ".image_list",
    "ImageListDataset": ".image_list",
    "collate_skipping_unreadable": ".image_list",
    "build_dataset": ".registry",
    "find_dataset_root": ".registry",
    "ClassBalancedBatchSampler": ".samplers",
    "ConvertToRGB": ".transforms",
    "ToNormalizedTensor": ".transforms",
    "build_transforms": ".transforms",
}

__all__ = [
    "BUNDLED_GLYPHS_PATH",
    "BUNDLED_ICONIFY_PATH",
    "BUNDLED_ICONS_PATH",
    "CUB200Dataset",
    "Cars196Dataset",
    "ClassBalancedBatchSampler",
    "ConvertToRGB",
    "DatasetNotFoundError",
    "GlyphDataset",
    "IconDataset",
    "IconifyDataset",
    "ImageListDataset",
    "InShopDataset",
    "OnlineProductsDataset",
    "ToNormalizedTensor",
    "build_dataset",
    "collate_skipping_unreadable",
    "build_transforms",
    "find_dataset_root",
]

from .._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
