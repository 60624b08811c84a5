"""Warm start of an embedding head's linear layer from the training features (PCA whitening).

Design note: docs/design/heads.md
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch


def principal_axes(features: Any):
    """A thin SVD of the centred float64 ``features`` (N × F): ``(mean, u, s, vt, rank)``, the rank
    counting singular values above 1e-10 of the largest (memory ~2 × N × F × 8 bytes)."""
    x = torch.as_tensor(features).detach().cpu().double()
    mean = x.mean(0)
    u, s, vt = torch.linalg.svd(x - mean, full_matrices=False)
    rank = int((s > s[0] * 1e-10).sum()) if s.numel() else 0
    return mean, u, s, vt, rank


DEFAULT_WHITENING_HEAD_INIT_SCALE = 1.0


def whitening_head_init(linear: torch.nn.Linear, features: Any,
                        scale: float = DEFAULT_WHITENING_HEAD_INIT_SCALE) -> int:
    r"""Warm-start an embedding head's linear layer (F → D) as the PCA whitening of ``features``.

    .. math:: W_{i\cdot} = \frac{v_i^\top}{\sigma_i}, \qquad b = -W\mu, \qquad
              W \leftarrow \text{scale}\cdot\sqrt{\min(D, F)}\,\frac{W}{\|W\|_F}

    with :math:`v_i, \sigma_i` the i-th principal direction and standard deviation of the features
    and :math:`\mu` their mean, so ``linear(f)`` is the centred ``f`` on its top D principal
    directions at equal variance (``training.pseudo_labels.pca_whiten`` up to the overall scale). Rows beyond the
    features' rank are zero. No label is used. Why the rescaling: the head's output direction does
    not depend on the weight's scale, so ``scale`` sets how far one optimiser step moves it (a larger
    scale, a smaller step: a trust region around the warm start for AdamW). The default 1
    (``DEFAULT_WHITENING_HEAD_INIT_SCALE``, the random init's own norm) keeps the start and lets a
    loss on real labels move it, as the recipes' ``--head-init whiten`` does; on noisy pseudo-labels
    a larger scale keeps the head near the start, which otherwise drifts below the features it
    starts from (the unsupervised recipe uses 10; the component bench of docs/design/pseudo-labels.md,
    100).

    Args:
        linear: the head's ``torch.nn.Linear`` (with a bias); modified in place (same Parameter
            objects, so optimisers built before still hold them).
        features: (N ≥ 2, F) trunk outputs on the training images, finite.
        scale: multiple of the default (semi-)orthogonal init's Frobenius norm, √min(D, F); > 0;
            default 1.

    Returns:
        The number of whitened rows, min(D, rank).

    Raises:
        ValueError: ``linear`` is not a Linear with a bias, bad ``scale``, features of the wrong
            shape, NaN/Inf, or rank 0.

    Design note: docs/design/heads.md
    """
    if not isinstance(linear, torch.nn.Linear) or linear.bias is None:
        raise ValueError(f"linear must be a torch.nn.Linear with a bias (it centres the features), "
                         f"got {linear!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
    f = torch.as_tensor(features).detach().cpu().double()
    if f.ndim != 2 or f.shape[1] != linear.in_features or f.shape[0] < 2:
        raise ValueError(f"features must have shape (N >= 2, {linear.in_features}), got {tuple(f.shape)}")
    if not torch.isfinite(f).all():
        raise ValueError("features contain NaN/Inf")
    # the thin SVD of pca_whiten, not an eigendecomposition of the covariance (which flips signs and
    # rounds differently): the defaults were chosen with this one (docs/design/pseudo-labels.md)
    mean, _, s, vt, rank = principal_axes(f)
    if rank < 1:
        raise ValueError("features have rank 0: nothing to whiten")
    out = linear.out_features
    k = min(out, rank)
    weight = torch.zeros(out, f.shape[1], dtype=torch.float64)
    weight[:k] = vt[:k] / s[:k, None] * np.sqrt(f.shape[0] - 1)
    weight *= float(scale) * np.sqrt(min(out, f.shape[1])) / weight.norm()
    with torch.no_grad():
        linear.weight.copy_(weight.to(linear.weight.dtype))
        linear.bias.copy_((-(weight @ mean)).to(linear.bias.dtype))
    return k
