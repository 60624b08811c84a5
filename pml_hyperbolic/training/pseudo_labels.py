"""Training-set wrapper whose labels are replaced every epoch by clustering (unsupervised recipe)."""
from __future__ import annotations

import numpy as np
import torch


class PseudoLabelledDataset(torch.utils.data.Dataset):
    """Returns ``(image, pseudo_labels_row)``; the true labels of ``base`` are never returned.

    ``labels`` is (N, K) int64 (finest level first) once :meth:`set_labels` has been called; before
    that every sample is its own class (so nothing can leak from the ground truth).
    """

    def __init__(self, base):
        self.base = base
        self.pseudo = np.arange(len(base), dtype=np.int64)[:, None]

    @property
    def labels(self) -> np.ndarray:
        return self.pseudo

    def set_labels(self, labels) -> None:
        labels = np.asarray(labels.cpu() if torch.is_tensor(labels) else labels, dtype=np.int64)
        if labels.ndim == 1:
            labels = labels[:, None]
        if labels.shape[0] != len(self.base):
            raise ValueError(f"labels has {labels.shape[0]} rows for a dataset of {len(self.base)}")
        self.pseudo = labels

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        item = self.base[index]
        if item is None:  # an unreadable image: dropped by collate_skipping_unreadable
            return None
        return item[0], torch.as_tensor(self.pseudo[index])
