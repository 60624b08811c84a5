"""The four deep-metric-learning retrieval benchmarks, read from a local folder (never downloaded).

Zero-shot splits as in the papers (Hyp-ViT, Hyp-UML, following Song et al. 2016):

* Cars196: classes 1-98 train, 99-196 test (8,054 / 8,131 images);
* CUB-200-2011: classes 1-100 train, 101-200 test (5,864 / 5,924 images);
* Stanford Online Products: the official ``Ebay_train.txt`` / ``Ebay_test.txt``
  (11,318 / 11,316 classes), super-label = ``super_class_id`` (12 categories);
* In-Shop Clothes: the official ``list_eval_partition.txt`` (3,997 train items;
  3,985 test items as 14,218 queries / 12,612 gallery images), super-label =
  the category path (e.g. ``WOMEN/Dresses``).

PML's loaders are reused where they read the layout (Cars196 in PML's Kaggle
layout, CUB); the others are parsed here.

Design note: docs/design/data.md
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from .image_list import ImageListDataset, first_existing, missing_dataset_error


class Cars196Dataset(ImageListDataset):
    """Stanford Cars (Cars196), first 98 classes train, last 98 test.

    Reads two layouts (``detect_layout`` tells which one a folder holds):

    * ``"stanford"``: the original release, ``cars_annos.mat`` + ``car_ims/``
      (what most people have; PML cannot read it). Needs scipy.
    * ``"pml"``: the Kaggle "stanford-car-dataset-by-classes-folder" layout that
      ``pytorch_metric_learning.datasets.Cars196`` reads: ``names.csv``,
      ``anno_train.csv``, ``anno_test.csv``, ``car_data/car_data/{train,test}/<class>/``.

    Args:
        root: the dataset folder, in one of ``LAYOUTS``.
        split: one of ``SPLITS``.
        transform: applied to each RGB PIL image.
        **kwargs: :class:`~pml_hyperbolic.data.ImageListDataset` keyword arguments (``on_unreadable``).

    Raises:
        DatasetNotFoundError: ``root`` holds no supported layout, or no image of the split.
        ValueError: an unknown ``split``.

    Design note: docs/design/data.md
    """

    LAYOUTS = (
        "stanford: <root>/cars_annos.mat and <root>/car_ims/*.jpg (original Stanford release)",
        "pml: <root>/names.csv, anno_train.csv, anno_test.csv and car_data/car_data/{train,test}/<class name>/*.jpg "
        "(Kaggle 'stanford-car-dataset-by-classes-folder', as read by pytorch_metric_learning)",
    )
    SOURCE = "https://ai.stanford.edu/~jkrause/cars/car_dataset.html (or the Kaggle mirror)"
    SPLITS = ("train", "test")
    NUM_TRAIN_CLASSES = 98

    @staticmethod
    def detect_layout(root: Optional[str]) -> Optional[str]:
        if root is None or not os.path.isdir(root):
            return None
        if os.path.isfile(os.path.join(root, "cars_annos.mat")) and os.path.isdir(os.path.join(root, "car_ims")):
            return "stanford"
        pml_files = ("names.csv", "anno_train.csv", "anno_test.csv")
        if all(os.path.isfile(os.path.join(root, f)) for f in pml_files) and os.path.isdir(
            os.path.join(root, "car_data", "car_data")
        ):
            return "pml"
        return None

    def __init__(self, root: str, split: str = "train", transform: Optional[Callable] = None, **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        layout = self.detect_layout(root)
        if layout is None:
            raise missing_dataset_error("Cars196", root, self.LAYOUTS, self.SOURCE)
        self.layout = layout
        paths, labels = (self._read_stanford if layout == "stanford" else self._read_pml)(root, split)
        _require_images(paths, "Cars196", root, self.LAYOUTS[0 if layout == "stanford" else 1], split, self.SOURCE)
        super().__init__(paths, labels, transform=transform, split=split, **kwargs)

    def _read_stanford(self, root, split):
        from scipy.io import loadmat

        try:
            annotations = loadmat(os.path.join(root, "cars_annos.mat"), squeeze_me=True)["annotations"]
            relative_paths = [str(p) for p in np.atleast_1d(annotations["relative_im_path"])]
            classes = np.atleast_1d(annotations["class"]).astype(np.int64)
        except Exception as error:  # noqa: BLE001 - scipy raises many kinds for a corrupt file
            raise missing_dataset_error(
                "Cars196", root, (self.LAYOUTS[0] + f" [cars_annos.mat unreadable: {error}]",), self.SOURCE
            ) from error
        in_split = classes <= self.NUM_TRAIN_CLASSES if split == "train" else classes > self.NUM_TRAIN_CLASSES
        paths = [os.path.join(root, p) for p, keep in zip(relative_paths, in_split) if keep]
        return paths, classes[in_split]

    def _read_pml(self, root, split):
        from pytorch_metric_learning.datasets import Cars196

        try:
            pml = Cars196(root=root, split=split, download=False)
            return pml.paths, np.asarray(pml.labels, dtype=np.int64)
        except (ValueError, KeyError, IndexError, OSError) as error:  # a malformed names.csv / anno_*.csv
            raise missing_dataset_error(
                "Cars196", root, (self.LAYOUTS[1] + f" [malformed: {type(error).__name__}: {error}]",), self.SOURCE
            ) from error


def _require_images(paths, dataset_name, root, layout, split, source):
    if not len(paths):
        raise missing_dataset_error(dataset_name, root, (f"{layout} [no images listed for split {split!r}]",), source)


class CUB200Dataset(ImageListDataset):
    """CUB-200-2011: classes 1-100 train, 101-200 test (no super-label).

    Args:
        root: the dataset folder, in one of ``LAYOUTS``.
        split: one of ``SPLITS``.
        transform: applied to each RGB PIL image.
        **kwargs: :class:`~pml_hyperbolic.data.ImageListDataset` keyword arguments (``on_unreadable``).

    Raises:
        DatasetNotFoundError: ``root`` holds no supported layout, or no image of the split.
        ValueError: an unknown ``split``.

    Design note: docs/design/data.md
    """

    LAYOUTS = (
        "<root>/CUB_200_2011/{images.txt, image_class_labels.txt, images/} (the extracted CUB_200_2011.tgz)",
        "<root>/{images.txt, image_class_labels.txt, images/} (root is the CUB_200_2011 folder itself)",
    )
    SOURCE = "https://www.vision.caltech.edu/datasets/cub_200_2011/"
    SPLITS = ("train", "test")

    @staticmethod
    def _base(root):
        if root is None or not os.path.isdir(root):
            return None
        required = ("images.txt", "image_class_labels.txt", "images")
        return first_existing(
            [os.path.join(root, "CUB_200_2011"), root],
            lambda base: all(os.path.exists(os.path.join(base, f)) for f in required),
        )

    @classmethod
    def detect_layout(cls, root: Optional[str]) -> Optional[str]:
        base = cls._base(root)
        if base is None:
            return None
        return "nested" if base != root else "flat"

    def __init__(self, root: str, split: str = "train", transform: Optional[Callable] = None, **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        base = self._base(root)
        if base is None:
            raise missing_dataset_error("CUB-200-2011", root, self.LAYOUTS, self.SOURCE)
        layout = self.LAYOUTS[0 if os.path.basename(os.path.normpath(base)) == "CUB_200_2011" else 1]
        try:
            if os.path.basename(os.path.normpath(base)) == "CUB_200_2011":
                from pytorch_metric_learning.datasets import CUB

                pml = CUB(root=os.path.dirname(os.path.normpath(base)), split=split, download=False)
                paths, labels = pml.paths, np.asarray(pml.labels, dtype=np.int64)
            else:  # a renamed folder, which PML's CUB cannot address
                paths, labels = self._read_lists(base, split)
        except (ValueError, KeyError, IndexError, OSError) as error:  # malformed list files
            raise missing_dataset_error(
                "CUB-200-2011", root, (layout + f" [malformed: {type(error).__name__}: {error}]",), self.SOURCE
            ) from error
        _require_images(paths, "CUB-200-2011", root, layout, split, self.SOURCE)
        super().__init__(paths, labels, transform=transform, split=split, **kwargs)

    @staticmethod
    def _read_lists(base, split):
        with open(os.path.join(base, "images.txt")) as handle:
            image_paths = dict(line.split() for line in handle if line.strip())
        paths, labels = [], []
        with open(os.path.join(base, "image_class_labels.txt")) as handle:
            for line in handle:
                if not line.strip():
                    continue
                image_id, class_id = line.split()
                class_id = int(class_id)
                if (class_id <= 100) == (split == "train"):
                    paths.append(os.path.join(base, "images", image_paths[image_id]))
                    labels.append(class_id)
        return paths, np.asarray(labels, dtype=np.int64)


class OnlineProductsDataset(ImageListDataset):
    """Stanford Online Products with its official split files; super-label = ``super_class_id``.

    Parsed here rather than through PML's ``StanfordOnlineProducts`` because
    that loader drops the ``super_class_id`` column.

    Args:
        root: the dataset folder, in one of ``LAYOUTS``.
        split: one of ``SPLITS``.
        transform: applied to each RGB PIL image.
        **kwargs: :class:`~pml_hyperbolic.data.ImageListDataset` keyword arguments (``on_unreadable``).

    Raises:
        DatasetNotFoundError: ``root`` holds no supported layout, or no image of the split.
        ValueError: an unknown ``split``.

    Design note: docs/design/data.md
    """

    LAYOUTS = (
        "<root>/Stanford_Online_Products/{Ebay_train.txt, Ebay_test.txt, <category>_final/*.JPG}",
        "<root>/{Ebay_train.txt, Ebay_test.txt, <category>_final/*.JPG} (root is the Stanford_Online_Products folder)",
    )
    SOURCE = "https://cvgl.stanford.edu/projects/lifted_struct/ (Stanford_Online_Products.zip)"
    SPLITS = ("train", "test")

    @staticmethod
    def _base(root):
        if root is None or not os.path.isdir(root):
            return None
        return first_existing(
            [os.path.join(root, "Stanford_Online_Products"), root],
            lambda base: all(os.path.isfile(os.path.join(base, f"Ebay_{s}.txt")) for s in ("train", "test")),
        )

    @classmethod
    def detect_layout(cls, root: Optional[str]) -> Optional[str]:
        base = cls._base(root)
        return None if base is None else ("nested" if base != root else "flat")

    def __init__(self, root: str, split: str = "train", transform: Optional[Callable] = None, **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        base = self._base(root)
        if base is None:
            raise missing_dataset_error("Stanford Online Products", root, self.LAYOUTS, self.SOURCE)
        paths, labels, super_labels = [], [], []
        with open(os.path.join(base, f"Ebay_{split}.txt")) as handle:
            header = handle.readline().split()
            if header[:4] != ["image_id", "class_id", "super_class_id", "path"]:
                raise missing_dataset_error(
                    "Stanford Online Products", root,
                    (f"Ebay_{split}.txt starting with 'image_id class_id super_class_id path' (found {header})",),
                    self.SOURCE,
                )
            for number, line in enumerate(handle, start=2):
                fields = line.split()
                if len(fields) < 4:
                    continue
                try:
                    labels.append(int(fields[1]))
                    super_labels.append(int(fields[2]))
                except ValueError as error:
                    raise missing_dataset_error(
                        "Stanford Online Products", root,
                        (f"Ebay_{split}.txt with integer class ids [line {number}: {line.strip()!r}]",), self.SOURCE,
                    ) from error
                paths.append(os.path.join(base, fields[3]))
        _require_images(paths, "Stanford Online Products", root, f"Ebay_{split}.txt listing images", split,
                        self.SOURCE)
        super().__init__(paths, np.asarray(labels), np.asarray(super_labels), transform=transform, split=split,
                         **kwargs)


class InShopDataset(ImageListDataset):
    """In-Shop Clothes Retrieval (DeepFashion) with the official train / query / gallery partition.

    Split ``"test"`` is query + gallery together. ``"query"`` and ``"gallery"``
    share one label space (remapped over all test items), so a query's label
    equals its matches' labels. Super-label: the category path of the image
    (``img/<GENDER>/<Category>/id_x/...`` -> ``GENDER/Category``, 23 categories).

    Args:
        root: the dataset folder, in one of ``LAYOUTS``.
        split: one of ``SPLITS``.
        transform: applied to each RGB PIL image.
        **kwargs: :class:`~pml_hyperbolic.data.ImageListDataset` keyword arguments (``on_unreadable``).

    Raises:
        DatasetNotFoundError: ``root`` holds no supported layout, or no image of the split.
        ValueError: an unknown ``split``.

    Design note: docs/design/data.md
    """

    LAYOUTS = (
        "<root>/list_eval_partition.txt and <root>/img/<GENDER>/<Category>/id_*/*.jpg",
        "<root>/Eval/list_eval_partition.txt and <root>/Img/img/... (the official archive layout)",
    )
    SOURCE = "https://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html"
    SPLITS = ("train", "test", "query", "gallery")
    PARTITION_FILE = "list_eval_partition.txt"

    @classmethod
    def _locate(cls, root):
        if root is None or not os.path.isdir(root):
            return None, None
        partition = first_existing(
            [os.path.join(root, cls.PARTITION_FILE), os.path.join(root, "Eval", cls.PARTITION_FILE)],
            os.path.isfile,
        )
        image_base = first_existing(
            [root, os.path.join(root, "Img")], lambda base: os.path.isdir(os.path.join(base, "img"))
        )
        return partition, image_base

    @classmethod
    def detect_layout(cls, root: Optional[str]) -> Optional[str]:
        partition, image_base = cls._locate(root)
        if partition is None or image_base is None:
            return None
        return "flat" if os.path.dirname(partition) == os.path.normpath(root) else "official"

    def __init__(self, root: str, split: str = "train", transform: Optional[Callable] = None, **kwargs: Any):
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {self.SPLITS}, got {split!r}")
        partition, image_base = self._locate(root)
        if partition is None or image_base is None:
            raise missing_dataset_error("In-Shop Clothes", root, self.LAYOUTS, self.SOURCE)
        rows = self._read_partition(partition, root)
        wanted = ("query", "gallery") if split == "test" else (split,)
        chosen = [r for r in rows if r[2] in wanted]
        paths = [os.path.join(image_base, r[0]) for r in chosen]
        _require_images(paths, "In-Shop Clothes", root, f"{partition} listing images", split, self.SOURCE)
        items = np.asarray([r[1] for r in chosen])
        categories = np.asarray(["/".join(r[0].split("/")[1:3]) for r in chosen])
        label_space = super_label_space = None
        if split in ("query", "gallery"):
            test_rows = [r for r in rows if r[2] in ("query", "gallery")]
            label_space = np.unique([r[1] for r in test_rows])
            super_label_space = np.unique(["/".join(r[0].split("/")[1:3]) for r in test_rows])
        super().__init__(
            paths, items, categories, transform=transform, split=split,
            label_space=label_space, super_label_space=super_label_space, **kwargs,
        )

    def _read_partition(self, partition, root):
        rows = []
        with open(partition) as handle:
            lines = [line.split() for line in handle if line.strip()]
        # line 0: number of images, line 1: header "image_name item_id evaluation_status"
        if len(lines) < 2 or lines[1][:3] != ["image_name", "item_id", "evaluation_status"]:
            raise missing_dataset_error(
                "In-Shop Clothes", root,
                (f"{partition} with the header 'image_name item_id evaluation_status' on line 2",),
                self.SOURCE,
            )
        for fields in lines[2:]:
            if len(fields) >= 3 and fields[2] in ("train", "query", "gallery"):
                rows.append((fields[0], fields[1], fields[2]))
        return rows
