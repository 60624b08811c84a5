"""The model part of :class:`~.runner.Recipe`: the backbone (trunk), the embedding head, the
geometry they share, and the embedding of a whole dataset.

Why a module of its own: the recipe driver composes one mixin per responsibility (data, model and
geometry, optimisation, reporting), each readable alone.

Design note: docs/design/training.md
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Optional

import torch

from ..data.image_list import collate_skipping_unreadable
from .checkpoint import unwrap
from .config import ConfigError


def backbone_size_kwargs(name: str, image_size: int) -> Dict:
    """Vision transformers need the input size at construction (position embeddings); CNNs do not."""
    base = name.split(".")[0].lower()
    if any(tag in base for tag in ("vit", "deit", "beit", "eva")):
        return {"img_size": int(image_size)}
    return {}


def freeze_patch_embedding(model: torch.nn.Module) -> int:
    """Freeze ``patch_embed`` (Hyp-ViT trains everything else); returns the number of frozen tensors."""
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith("patch_embed") or ".patch_embed." in name:
            p.requires_grad_(False)
            frozen += 1
    return frozen


@torch.no_grad()
def backbone_features(model: torch.nn.Module, dataset: torch.utils.data.Dataset, device: torch.device,
                      max_samples: int = 1000, batch_size: int = 128, seed: int = 0) -> torch.Tensor:
    """Backbone outputs (float32, CPU, eval mode) for a seeded subset of at most ``max_samples``
    images: the input of the δ-hyperbolicity curvature estimate. The model's mode is restored."""
    n = len(dataset)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_samples].tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=batch_size,
                                         collate_fn=collate_skipping_unreadable)
    was_training = model.training
    model.eval()
    feats = [model(batch[0].to(device)).float().cpu() for batch in loader if batch is not None]
    model.train(was_training)
    return torch.cat(feats)


@torch.no_grad()
def compute_embeddings(trunk: torch.nn.Module, head: torch.nn.Module, dataset: torch.utils.data.Dataset,
                       device: torch.device, batch_size: int = 128, num_workers: int = 0) -> torch.Tensor:
    """Head outputs (float32, CPU) of a whole dataset in eval mode; modules' modes are restored.

    Rows of unreadable images stay at the origin.

    Raises:
        RuntimeError: no image of the dataset was readable.
    """
    trunk, head = unwrap(trunk), unwrap(head)
    modes = (trunk.training, head.training)
    trunk.eval()
    head.eval()
    loader = torch.utils.data.DataLoader(_WithIndex(dataset), batch_size=batch_size, num_workers=num_workers,
                                         collate_fn=collate_skipping_unreadable)
    out = None
    for batch in loader:
        if batch is None:  # every image of the batch was unreadable: its rows stay at the origin
            continue
        index, images = batch
        emb = head(trunk(images.to(device))).float().cpu()
        if out is None:
            # rows of unreadable images (skipped by the loader) stay at the origin
            out = torch.zeros(len(dataset), emb.shape[1])
        out[index] = emb
    trunk.train(modes[0])
    head.train(modes[1])
    if out is None:
        raise RuntimeError("no readable image in the dataset: nothing to embed")
    return out


class _WithIndex(torch.utils.data.Dataset):
    """``(index, image)`` items, ``None`` where the base dataset skipped an unreadable image, so
    that per-index outputs stay aligned."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        item = self.base[index]
        return None if item is None else (index, item[0])


class RecipeModelMixin:
    """Model of a recipe run: ``self.trunk``, ``self.head``, ``self.feature_dim``, ``self.c`` and
    ``self.geometry`` (the one :class:`PoincareGeometry` every component shares).

    Design note: docs/design/training.md
    """

    def curvature(self) -> Optional[float]:
        return getattr(self, "c", None)

    def build_head(self, in_features: int) -> torch.nn.Module:
        from ..heads import HyperbolicEmbeddingHead

        return HyperbolicEmbeddingHead(in_features, self.args.embedding_dim, c=self.geometry,
                                       radius=getattr(self.args, "head_radius", "learned"))

    def eval_curvature(self) -> Optional[float]:  # noqa: D401
        """c for the tester's kNN (None = cosine/Euclidean)."""
        return self.c if self.hyperbolic else None

    def setup_model(self):
        from ..backbones import build_backbone

        a = self.args
        weights = (f"weights from {a.backbone_checkpoint}" if a.backbone_checkpoint
                   else "pretrained weights" if a.pretrained else "random init")
        self.status(f"loading backbone {a.backbone} ({weights}) ...")
        started = time.time()
        trunk, dim = build_backbone(a.backbone, pretrained=a.pretrained, checkpoint=a.backbone_checkpoint,
                                    **backbone_size_kwargs(a.backbone, a.image_size))
        self.status(f"backbone ready: {dim}-d features ({time.time() - started:.1f} s)")
        if a.freeze_patch_embed:
            freeze_patch_embedding(trunk)
        if a.freeze_trunk:
            trunk.requires_grad_(False)
        self.trunk = trunk.to(self.device)
        if self.channels_last():
            # conv weights in channels-last: oneDNN then runs every conv (and what follows it) in its
            # native NHWC layout instead of converting NCHW tensors around each call
            self.trunk = self.trunk.to(memory_format=torch.channels_last)
        self.feature_dim = dim
        self.setup_geometry(lambda: backbone_features(self.trunk, self.train_eval_set, self.device, seed=a.seed))
        self.head = self.build_head(dim).to(self.device)

    _step0_features: Optional[torch.Tensor] = None

    def training_features(self) -> torch.Tensor:
        """Trunk outputs of the training images (clean transform). The head's warm start keeps them in
        ``self._step0_features`` until the runner's set-up ends, so the first pseudo-labelling reuses
        them instead of computing them again."""
        if self._step0_features is not None:
            return self._step0_features
        return compute_embeddings(self.trunk, torch.nn.Identity(), self.train_eval_set, self.device,
                                  self.args.eval_batch_size)

    def warm_start_head(self) -> None:
        """``--head-init whiten``: the head's linear layer starts as the PCA whitening of the training
        images' trunk outputs (:func:`~pml_hyperbolic.heads.whitening_head_init` at ``--head-init-scale``; no
        label is used); ``random`` leaves the head as built. Why: a random projection of the features
        starts below them on classes never trained on; the principal directions keep what the
        features share across classes (docs/design/heads.md).

        Raises:
            ConfigError: ``--head-init whiten`` with a head that has no ``.linear`` layer.
        """
        mode = getattr(self.args, "head_init", "random")
        if mode == "random":
            return
        if mode != "whiten":
            raise ConfigError(f"--head-init must be 'random' or 'whiten', got {mode!r}")
        from ..heads import whitening_head_init

        linear = getattr(unwrap(self.head), "linear", None)
        if not isinstance(linear, torch.nn.Linear) or linear.bias is None:
            raise ConfigError(f"--head-init whiten needs a head with a .linear layer with a bias, got "
                              f"{type(unwrap(self.head)).__name__}; use --head-init random")
        self.status("--head-init whiten: computing the training images' backbone features ...")
        self._step0_features = self.training_features()  # released by the runner after the set-up
        k = whitening_head_init(linear, self._step0_features, scale=self.args.head_init_scale)
        self.say(f"[pml-hyperbolic] head warm start: PCA whitening of the training features ({k} of "
                 f"{linear.out_features} rows, scale {self.args.head_init_scale:g})")

    def channels_last(self) -> bool:
        """``--memory-format``: whether the backbone runs channels-last ('auto': on CPU only, where
        oneDNN's convolutions are native NHWC; the printed Recall@K does not change)."""
        choice = getattr(self.args, "memory_format", "auto")
        if choice == "auto":
            return self.device.type == "cpu"
        return choice == "channels_last"

    def setup_geometry(self, features_fn: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """``self.c`` and ``self.geometry`` (the one :class:`PoincareGeometry` every component shares)
        from ``--curvature`` and ``--clip-r``; ``--curvature auto`` estimates c from the δ-hyperbolicity
        of ``features_fn()`` (backbone features of training images). Non-hyperbolic recipes: None."""
        a = self.args
        self.c = None
        if getattr(a, "curvature", None) is not None:
            self.c = a.curvature
            if a.curvature == "auto":
                from ..evaluation import suggest_curvature

                if features_fn is None:
                    raise ConfigError("--curvature auto needs backbone features to estimate c from")
                self.status("--curvature auto: computing backbone features of up to 1000 training images ...")
                feats = features_fn()
                self.c = float(suggest_curvature(feats))
                self.say(f"[pml-hyperbolic] --curvature auto: δ-hyperbolicity of {len(feats)} backbone features "
                         f"suggests c = {self.c:.4g}")
        self.geometry = None
        if self.c is not None:
            from ..geometry import PoincareGeometry

            clip_r = getattr(a, "clip_r", None)
            self.geometry = PoincareGeometry(c=self.c, clip="hard" if clip_r is not None else None, clip_r=clip_r)
