"""Datasets, transforms and samplers for hyperbolic deep metric learning (all offline)."""

from .benchmarks import Cars196Dataset, CUB200Dataset, InShopDataset, OnlineProductsDataset
from .glyphs import BUNDLED_GLYPHS_PATH, GlyphDataset
from .image_list import DatasetNotFoundError, ImageListDataset, collate_skipping_unreadable
from .registry import build_dataset, find_dataset_root
from .samplers import ClassBalancedBatchSampler
from .transforms import ConvertToRGB, build_transforms

__all__ = [
    "BUNDLED_GLYPHS_PATH",
    "CUB200Dataset",
    "Cars196Dataset",
    "ClassBalancedBatchSampler",
    "ConvertToRGB",
    "DatasetNotFoundError",
    "GlyphDataset",
    "ImageListDataset",
    "InShopDataset",
    "OnlineProductsDataset",
    "build_dataset",
    "collate_skipping_unreadable",
    "build_transforms",
    "find_dataset_root",
]
