"""Shared machinery of ``bench/quality.py`` and ``bench/tau_sweep.py``.

Design (CPU budget: the whole method table in about an hour on 2 cores):

* **One backbone for everything**: a timm CNN with the offline ImageNet weights of
  :func:`pml_hyperbolic.backbones.build_backbone` (default ``mobilenetv2_100``, the fastest of the
  two offline weight sets on CPU; ``--backbone tf_efficientnet_lite0`` works too).
* **Frozen prefix, trainable tail.** Everything up to the last inverted-residual block is frozen;
  the last block, the 1×1 ``conv_head`` (→1280) and the embedding head are trained. All BatchNorm
  layers stay in eval mode (ImageNet statistics; the affine parameters of the tail still train).
* **Feature bank.** Because the prefix is frozen, its output is a fixed function of the input
  image, so it is computed once per image *view* and stored: view 0 is the clean (eval-transform)
  image, views 1..A-1 are random augmentations (``build_transforms("glyph", train=True)``: affine
  jitter), drawn once with a fixed seed. Training samples one of the A views of each image at every
  step, so the augmentation diversity is A views per image instead of a fresh draw per step — that
  is the only approximation; the trained part (last block + head, ~0.8 M parameters for
  MobileNetV2) sees real gradients through real convolutions at every step. The bank is shared by
  every method and seed (same inputs for all), and cached on disk (``--cache-dir``).
* **Evaluation** on held-out classes only: spherical / Euclidean heads by cosine kNN (embeddings
  L2-normalised, faiss L2 = cosine ranking), hyperbolic heads by the exact Poincaré kNN at the
  head's curvature (:class:`pml_hyperbolic.evaluation.RecallAtKAccuracyCalculator` with ``c``).
  Metrics: Recall@1/2/4/8 and PML's MAP@R.
"""
from __future__ import annotations

import copy
import functools
import gzip
import hashlib
import os
import struct
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch


BANK_VERSION = 2
BANK_DATASETS = ("glyphs", "icons", "iconify", "fashion-mnist")
# Per dataset, the value of ``Split.font_families`` that marks a validation query (the rest is the
# validation gallery): display fonts for the glyphs, the query group of themes for the icons, the query
# group of icon sets for the Iconify sets.
QUERY_SIDE = {"glyphs": "display", "icons": "query", "iconify": "query"}
# The bundled development domains (drawings of a class in several styles, every class under one parent):
# their images are read by :func:`image_dataset` and go through the ``"glyph"`` transforms.
DEVELOPMENT_DOMAINS = ("glyphs", "icons", "iconify")
FASHION_MNIST_DIRS = ("/usr/share/datasets/fashion-mnist", "/usr/share/dataset-fashion-mnist",
                      "/usr/share/fashion-mnist")
METRIC_KEYS = ("recall_at_1", "recall_at_2", "recall_at_4", "recall_at_8", "mean_average_precision_at_r")
METRIC_NAMES = {"recall_at_1": "R@1", "recall_at_2": "R@2", "recall_at_4": "R@4", "recall_at_8": "R@8",
                "mean_average_precision_at_r": "MAP@R"}


@dataclass
class BenchConfig:
    """The budget shared by every method of a run (printed in the header)."""

    backbone: str = "mobilenetv2_100"
    image_size: int = 64
    views: int = 4                 # bank views per training image (view 0 clean, the rest augmented)
    steps: int = 120               # full run: ~1 s CPU per step (batch 128, tail trainable)
    batch_size: int = 128
    samples_per_class: int = 4
    lr_tail: float = 3e-4          # last backbone block + conv_head
    lr_head: float = 3e-3          # embedding head (and loss parameters such as HypMix's λ)
    weight_decay: float = 0.01     # AdamW, as Hyp-ViT
    grad_clip: float = 3.0         # Hyp-ViT's gradient-norm clip
    embedding_dim: int = 128
    seeds: tuple = (0, 1, 2)
    recluster_every: int = 60      # unsupervised rows: pseudo-labels refreshed every N steps
    hcl_scenes: int = 1500         # HCL: composed scenes in its bank
    hcl_queue: int = 4096
    threads: int = 2
    trainable: str = "tail"        # "tail": last block + conv_head + head; "head": head only (frozen pooled features)
    cache_dir: str = field(default_factory=lambda: os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pml-hyperbolic", "bench"))

    def describe(self):
        part = ("last block + conv_head + head (rest frozen, BN frozen)" if self.trainable == "tail"
                else "embedding head only (whole backbone frozen: pooled 1280-d features)")
        return (f"backbone {self.backbone} (offline ImageNet weights), {self.image_size}px, trainable: {part}, "
                f"bank of {self.views} views/image "
                f"(1 clean + {self.views - 1} augmented), {self.steps} steps x batch {self.batch_size} "
                f"({self.samples_per_class}/class), AdamW lr {self.lr_tail:g} (tail) / {self.lr_head:g} (head), "
                f"wd {self.weight_decay:g}, grad clip {self.grad_clip:g}, {self.embedding_dim}-d, "
                f"seeds {list(self.seeds)}")


def set_threads(n):
    torch.set_num_threads(max(1, int(n)))


# ------------------------------------------------------------------------------------------ data


class FashionMNISTRetrieval:
    """Debian ``dataset-fashion-mnist`` as a held-out-class retrieval set (PIL images, ``.labels``).

    Train: classes 0-4 (T-shirt, trouser, pullover, dress, coat) of the train file; evaluation:
    classes 5-9 (sandal, shirt, sneaker, bag, ankle boot) of the t10k file, query = reference
    (leave-one-out). ``per_class`` images per class (first ones in file order).
    """

    TRAIN_CLASSES = (0, 1, 2, 3, 4)
    TEST_CLASSES = (5, 6, 7, 8, 9)

    def __init__(self, root, split="train", per_class=600):
        images, labels = self._read(root, "train" if split == "train" else "t10k")
        classes = self.TRAIN_CLASSES if split == "train" else self.TEST_CLASSES
        keep = np.concatenate([np.flatnonzero(labels == c)[:per_class] for c in classes])
        self._pixels = images[keep]
        self.labels = np.searchsorted(np.asarray(classes), labels[keep]).astype(np.int64)
        self.num_classes = len(classes)

    @staticmethod
    def _read(root, prefix):
        def idx(path):
            opener = gzip.open if path.endswith(".gz") else open
            with opener(path, "rb") as fh:
                data = fh.read()
            magic = struct.unpack(">I", data[:4])[0]
            ndim = magic & 0xFF
            shape = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
            return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)

        def find(stem):
            for name in (stem + ".gz", stem):
                if os.path.isfile(os.path.join(root, name)):
                    return os.path.join(root, name)
            raise FileNotFoundError(f"{stem}[.gz] not in {root}")

        return idx(find(f"{prefix}-images-idx3-ubyte")), idx(find(f"{prefix}-labels-idx1-ubyte")).astype(np.int64)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        from PIL import Image

        return Image.fromarray(self._pixels[i]).convert("RGB"), int(self.labels[i])


def image_dataset(dataset, split):
    """The PIL images of one split of a development domain (``DEVELOPMENT_DOMAINS``): the glyphs, the
    freedesktop icons or the Iconify sets (greyscale, stored as ``"L"``; the ``"glyph"`` transforms
    turn every one into a 3-channel tensor). Each has ``labels`` and ``super_labels`` (the parent)."""
    from pml_hyperbolic.data import GlyphDataset, IconDataset, IconifyDataset

    readers = {"glyphs": GlyphDataset, "icons": IconDataset, "iconify": IconifyDataset}
    if dataset not in readers:
        raise ValueError(f"dataset must be one of {DEVELOPMENT_DOMAINS} (images readable here), got {dataset!r}")
    return readers[dataset](split)


def find_fashion_mnist(root=None):
    """Folder holding the Fashion-MNIST idx files (Debian ``dataset-fashion-mnist``), or None."""
    for d in ([root] if root else []) + list(FASHION_MNIST_DIRS):
        if d and os.path.isfile(os.path.join(d, "t10k-labels-idx1-ubyte.gz")) or (
                d and os.path.isfile(os.path.join(d, "t10k-labels-idx1-ubyte"))):
            return d
    return None


def fashion_transforms(image_size, train):
    from torchvision import transforms as T

    from pml_hyperbolic.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    steps = []
    if train:  # black background: fill 0; garments may be mirrored
        steps += [T.RandomAffine(degrees=8, translate=(0.08, 0.08), scale=(0.85, 1.1), fill=0),
                  T.RandomHorizontalFlip()]
    steps += [T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BICUBIC), T.ToTensor(),
              T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return T.Compose(steps)


# ------------------------------------------------------------------------------------- backbone


@functools.lru_cache(maxsize=2)
def split_backbone(name):
    """(frozen prefix, tail, feature_dim) of a timm EfficientNet/MobileNet backbone.

    Cached: callers never modify these modules (training works on ``fresh_tail`` copies)."""
    from pml_hyperbolic.backbones import build_backbone

    model, dim = build_backbone(name, pretrained="offline")
    model.eval()
    prefix = torch.nn.Sequential(model.conv_stem, model.bn1, *list(model.blocks)[:-1]).eval()
    tail = torch.nn.Sequential(model.blocks[-1], model.conv_head, model.bn2, model.global_pool).eval()
    for p in prefix.parameters():
        p.requires_grad_(False)
    return prefix, tail, dim


@torch.no_grad()
def run_prefix(prefix, dataset, transform, batch=256, seed=None, limit=None):
    """Prefix activations of every item of ``dataset`` (PIL images) under ``transform``."""
    n = len(dataset) if limit is None else min(limit, len(dataset))
    if seed is not None:
        torch.manual_seed(seed)  # torchvision random transforms draw from the global torch RNG
    out = []
    for start in range(0, n, batch):
        imgs = torch.stack([transform(dataset[i][0]) for i in range(start, min(n, start + batch))])
        out.append(prefix(imgs))
    return torch.cat(out)


@dataclass
class Split:
    acts: torch.Tensor            # (N, [V,] C, h, w) prefix activations
    labels: torch.Tensor          # (N,) int64
    super_labels: torch.Tensor | None = None
    font_families: np.ndarray | None = None


@dataclass
class Bank:
    """Prefix activations of one dataset: train (N, V, C, h, w), eval query / gallery."""

    dataset: str
    train: Split
    query: Split
    gallery: Split | None          # None: query = reference (leave-one-out)
    tail: torch.nn.Module
    feature_dim: int
    note: str = ""
    build_seconds: float = 0.0
    from_cache: bool = False

    @property
    def num_train_classes(self):
        return int(self.train.labels.max()) + 1


def _cache_path(cfg, dataset, extra):
    key = f"v{BANK_VERSION}|{dataset}|{cfg.backbone}|{cfg.image_size}|{cfg.views}|{extra}"
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(cfg.cache_dir, f"bank_{dataset}_{cfg.backbone}_{cfg.image_size}px_{cfg.views}v_{digest}.pt")


class _ClassSubset:
    """The samples of the first ``k`` classes of a dataset (tests / tiny budgets)."""

    def __init__(self, base, k):
        self.base = base
        labels = np.asarray(base.labels)
        self.index = np.flatnonzero(labels < k)
        self.labels = labels[self.index]
        for name in ("super_labels", "font_families"):
            if hasattr(base, name):
                setattr(self, name, np.asarray(getattr(base, name))[self.index])
        self.num_classes = int(min(k, labels.max() + 1))

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        return self.base[int(self.index[i])]


def build_bank(cfg, dataset="glyphs", fashion_root=None, fashion_per_class=(600, 300), use_cache=True, log=print,
               max_classes=None):
    """Prefix-activation bank of ``dataset`` (one of ``BANK_DATASETS``), cached on disk.

    ``max_classes`` keeps only the first classes of every split (tests and smoke runs)."""
    from pml_hyperbolic.data import GlyphDataset, IconDataset, IconifyDataset, build_transforms

    if dataset not in BANK_DATASETS:
        raise ValueError(f"dataset must be one of {BANK_DATASETS}, got {dataset!r}")
    prefix, tail, dim = split_backbone(cfg.backbone)
    extra = f"{fashion_per_class}" if dataset == "fashion-mnist" else "hard-protocol"
    if max_classes is not None:
        extra += f"|first{max_classes}"
    path = _cache_path(cfg, dataset, extra)
    if use_cache and os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=False)
        return Bank(dataset=dataset, train=state["train"], query=state["query"], gallery=state["gallery"],
                    tail=tail, feature_dim=dim, note=state["note"], build_seconds=state["build_seconds"],
                    from_cache=True)
    t0 = time.perf_counter()
    if dataset == "glyphs":
        train_set, query_set, gallery_set = GlyphDataset("train"), GlyphDataset("query"), GlyphDataset("gallery")
        clean = build_transforms("glyph", train=False, image_size=cfg.image_size)
        augment = build_transforms("glyph", train=True, image_size=cfg.image_size)
        note = (f"bundled CJK glyphs, hard protocol: train {len(train_set)} images / {train_set.num_classes} "
                f"characters; test = {query_set.num_classes} held-out characters, query {len(query_set)} "
                f"(display fonts) vs gallery {len(gallery_set)} (serif+sans fonts)")
    elif dataset == "icons":
        train_set, query_set, gallery_set = IconDataset("train"), IconDataset("query"), IconDataset("gallery")
        train_set.font_families = train_set.theme_groups  # the theme group plays the font family's part
        clean = build_transforms("glyph", train=False, image_size=cfg.image_size)
        augment = build_transforms("glyph", train=True, image_size=cfg.image_size)
        note = (f"bundled icon themes: train {len(train_set)} drawings / {train_set.num_classes} icon names; "
                f"test = {query_set.num_classes} held-out icon names, query {len(query_set)} (query themes) vs "
                f"gallery {len(gallery_set)} (the other themes)")
    elif dataset == "iconify":
        train_set, query_set, gallery_set = (IconifyDataset("train"), IconifyDataset("query"),
                                             IconifyDataset("gallery"))
        train_set.font_families = train_set.set_groups  # the set group plays the font family's part
        clean = build_transforms("glyph", train=False, image_size=cfg.image_size)
        augment = build_transforms("glyph", train=True, image_size=cfg.image_size)
        note = (f"bundled Iconify icon sets: train {len(train_set)} drawings / {train_set.num_classes} icon names; "
                f"test = {query_set.num_classes} held-out icon names, query {len(query_set)} (query sets) vs "
                f"gallery {len(gallery_set)} (the other sets)")
    elif dataset == "fashion-mnist":
        root = find_fashion_mnist(fashion_root)
        if root is None:
            raise FileNotFoundError("Fashion-MNIST not found (Debian package dataset-fashion-mnist)")
        train_set = FashionMNISTRetrieval(root, "train", fashion_per_class[0])
        query_set, gallery_set = FashionMNISTRetrieval(root, "test", fashion_per_class[1]), None
        clean, augment = fashion_transforms(cfg.image_size, False), fashion_transforms(cfg.image_size, True)
        note = (f"Fashion-MNIST ({root}): train classes 0-4 x {fashion_per_class[0]} (train file); test = "
                f"held-out classes 5-9 x {fashion_per_class[1]} (t10k file), query = reference (leave-one-out)")
    if max_classes is not None:
        train_set, query_set = _ClassSubset(train_set, max_classes), _ClassSubset(query_set, max_classes)
        gallery_set = None if gallery_set is None else _ClassSubset(gallery_set, max_classes)
        note += f" [first {max_classes} classes of each split only]"
    log(f"[bank] {dataset}: computing frozen-prefix activations ({len(train_set)} x {cfg.views} train views + "
        f"{len(query_set) + (len(gallery_set) if gallery_set is not None else 0)} eval images) ...")
    views = [run_prefix(prefix, train_set, clean)]
    for v in range(1, cfg.views):
        views.append(run_prefix(prefix, train_set, augment, seed=1000 + v))
    train = Split(torch.stack(views, dim=1), torch.as_tensor(np.asarray(train_set.labels), dtype=torch.long),
                  torch.as_tensor(getattr(train_set, "super_labels", np.zeros(len(train_set), np.int64))),
                  getattr(train_set, "font_families", None))
    query = Split(run_prefix(prefix, query_set, clean), torch.as_tensor(np.asarray(query_set.labels)),
                  _parent_labels(query_set))
    gallery = None
    if gallery_set is not None:
        gallery = Split(run_prefix(prefix, gallery_set, clean), torch.as_tensor(np.asarray(gallery_set.labels)),
                        _parent_labels(gallery_set))
    seconds = time.perf_counter() - t0
    if use_cache:
        os.makedirs(cfg.cache_dir, exist_ok=True)
        tmp = path + f".tmp{os.getpid()}"
        torch.save({"train": train, "query": query, "gallery": gallery, "note": note, "build_seconds": seconds}, tmp)
        os.replace(tmp, path)
    return Bank(dataset=dataset, train=train, query=query, gallery=gallery, tail=tail, feature_dim=dim,
                note=note, build_seconds=seconds)


def _parent_labels(dataset):
    """The dataset's parent label per item (``super_labels``: the hierarchy columns), or None."""
    parents = getattr(dataset, "super_labels", None)
    return None if parents is None else torch.as_tensor(np.asarray(parents), dtype=torch.long)


@torch.no_grad()
def _through(module, acts, batch=1024):
    flat = acts.reshape(-1, *acts.shape[-3:]) if acts.dim() == 5 else acts
    out = torch.cat([module(flat[s:s + batch]) for s in range(0, len(flat), batch)])
    return out.reshape(*acts.shape[:-3], -1) if acts.dim() == 5 else out


def pooled_bank(bank, cfg=None, use_cache=True):
    """The same bank passed through the frozen tail: pooled (N, V, 1280) features, identity tail.

    Used with ``trainable="head"`` (only the embedding head trains: fast enough for sweeps)."""
    path = None
    if cfg is not None and use_cache:
        path = _cache_path(cfg, bank.dataset, "pooled") if bank.dataset != "hcl" else None
    if path and os.path.isfile(path):
        state = torch.load(path, map_location="cpu", weights_only=False)
    else:
        state = {"train": _through(bank.tail, bank.train.acts), "query": _through(bank.tail, bank.query.acts),
                 "gallery": None if bank.gallery is None else _through(bank.tail, bank.gallery.acts)}
        if path:
            torch.save(state, path)

    def re(split, acts):
        return None if split is None else Split(acts, split.labels, split.super_labels, split.font_families)

    return Bank(dataset=bank.dataset, train=re(bank.train, state["train"]), query=re(bank.query, state["query"]),
                gallery=re(bank.gallery, state["gallery"]), tail=torch.nn.Identity(), feature_dim=bank.feature_dim,
                note=bank.note, build_seconds=bank.build_seconds, from_cache=bank.from_cache)


def carve_validation(bank, num_val_classes=32, seed=0):
    """Split the *training* classes into train' and validation (for tuning; test classes untouched).

    Glyphs: the validation characters get the hard protocol too (query = display-family fonts,
    gallery = the others). Returns (train_split, val_query, val_gallery or None).
    """
    labels = bank.train.labels.numpy()
    classes = np.unique(labels)
    rng = np.random.default_rng(seed)
    val_classes = np.sort(rng.choice(classes, size=num_val_classes, replace=False))
    is_val = np.isin(labels, val_classes)
    tr_idx, va_idx = np.flatnonzero(~is_val), np.flatnonzero(is_val)
    remap = -np.ones(classes.max() + 1, np.int64)
    remap[np.setdiff1d(classes, val_classes)] = np.arange(len(classes) - num_val_classes)
    train = Split(bank.train.acts[tr_idx], torch.as_tensor(remap[labels[tr_idx]]),
                  bank.train.super_labels[tr_idx] if bank.train.super_labels is not None else None)
    val_acts = bank.train.acts[va_idx, 0]  # clean view
    val_labels = torch.as_tensor(labels[va_idx])
    fam = bank.train.font_families
    if fam is not None:
        fam = np.asarray(fam)[va_idx]
        q = fam == QUERY_SIDE[bank.dataset]
        return train, Split(val_acts[q], val_labels[q]), Split(val_acts[~q], val_labels[~q])
    return train, Split(val_acts, val_labels), None


# ----------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def embed(tail, head, acts, batch=512):
    tail.eval()
    if head is not None:
        head.eval()
    outs = []
    for start in range(0, len(acts), batch):
        f = tail(acts[start:start + batch])
        outs.append(f if head is None else head(f))
    return torch.cat(outs).float()


def retrieval_metrics(query_emb, query_labels, gallery_emb=None, gallery_labels=None, c=None, keys=METRIC_KEYS):
    """Recall@1/2/4/8 and MAP@R; c=None: cosine (embeddings L2-normalised), c>0: exact Poincaré kNN."""
    from pml_hyperbolic.evaluation import RecallAtKAccuracyCalculator

    k_values = tuple(int(k.rsplit("_", 1)[1]) for k in keys if k.startswith("recall_at_")) or (1,)
    calc = RecallAtKAccuracyCalculator(k_values=k_values, c=c, include=tuple(keys))
    if c is None:
        query_emb = torch.nn.functional.normalize(query_emb, dim=1)
        gallery_emb = None if gallery_emb is None else torch.nn.functional.normalize(gallery_emb, dim=1)
    if gallery_emb is None:
        res = calc.get_accuracy(query_emb, query_labels)
    else:
        res = calc.get_accuracy(query_emb, query_labels, gallery_emb, gallery_labels, ref_includes_query=False)
    return {k: float(res[k]) for k in keys}


def evaluate(tail, head, query, gallery, c=None, keys=METRIC_KEYS):
    q = embed(tail, head, query.acts)
    g = None if gallery is None else embed(tail, head, gallery.acts)
    return retrieval_metrics(q, query.labels, g, None if gallery is None else gallery.labels, c=c, keys=keys)


# ------------------------------------------------------------------------------------- training


def make_optimizer(cfg, tail, head, loss):
    head_params = list(head.parameters()) + [p for p in loss.parameters() if p.requires_grad]
    groups = [{"params": [p for p in tail.parameters() if p.requires_grad], "lr": cfg.lr_tail},
              {"params": head_params, "lr": cfg.lr_head}]
    return torch.optim.AdamW([g for g in groups if g["params"]], weight_decay=cfg.weight_decay)


def train_with_labels(cfg, train, tail, head, loss_fn, miner=None, seed=0, steps=None, relabel=None):
    """Generic class-balanced training on the bank, the loss on the 1-D class labels.

    ``relabel`` is a callable ``(tail, head) -> (sampler_labels (N,), loss_labels (N,...))`` called at step 0 and
    every ``cfg.recluster_every`` steps (unsupervised rows).
    """
    from pml_hyperbolic.data import ClassBalancedBatchSampler

    steps = cfg.steps if steps is None else steps
    opt = make_optimizer(cfg, tail, head, loss_fn)
    params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(10_000 + seed)
    n_views = train.acts.shape[1]
    sampler_labels, loss_labels = train.labels, train.labels
    done = 0
    while done < steps:
        chunk = steps - done
        if relabel is not None:
            sampler_labels, loss_labels = relabel(tail, head)
            chunk = min(chunk, cfg.recluster_every)
        batch, per_class = cfg.batch_size, cfg.samples_per_class
        n_classes = len(torch.unique(torch.as_tensor(sampler_labels)))
        if n_classes * per_class < batch:  # few classes (Fashion-MNIST: 5): every class, more samples each
            per_class = batch // n_classes
            batch = per_class * n_classes
        sampler = ClassBalancedBatchSampler(sampler_labels, batch, per_class, num_batches=chunk,
                                            seed=seed * 7919 + done)
        tail.eval()
        head.train()
        for idx in sampler:
            idx = torch.as_tensor(idx)
            view = torch.randint(n_views, (len(idx),), generator=gen)
            emb = head(tail(train.acts[idx, view]))
            y = loss_labels[idx]
            indices = miner(emb, y) if miner is not None else None
            loss = loss_fn(emb, y, indices) if indices is not None else loss_fn(emb, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            done += 1
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss at step {done}")
    return tail, head


def pseudo_label_relabel(train, policy):
    """``relabel`` callable for :func:`train_with_labels`: ``policy`` (an ``UnsupervisedPseudoLabels``)
    clusters the clean view's features of the initial tail and/or the current embeddings."""
    clean = train.acts[:, 0]

    def relabel(tail, head):
        z = embed(tail, head, clean) if policy.uses_embeddings() else None
        f = embed(tail, None, clean) if policy.uses_features() else None
        levels = policy(features=f, embeddings=z)
        return levels[:, 0], levels
    return relabel


def fresh_tail(bank):
    tail = copy.deepcopy(bank.tail)
    for p in tail.parameters():
        p.requires_grad_(True)
    return tail.eval()


# ------------------------------------------------------------------------------ δ-hyperbolicity


def suggest_curvature_from_features(features, seed=0, n_points=2000, draws=5):
    """c = (0.144 / δ_rel)² (Hyp-ViT / Khrulkov et al.) with the package's ``suggest_curvature``."""
    from pml_hyperbolic.evaluation import suggest_curvature

    n = min(int(n_points), len(features))
    return (float(suggest_curvature(torch.as_tensor(features), n_samples=n, n_draws=draws, seed=seed)),
            f"pml_hyperbolic.evaluation.suggest_curvature, {draws} draws of {n} points")


# ----------------------------------------------------------------------------------- reporting


def mean_std(values):
    a = np.asarray(values, dtype=np.float64)
    return float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0


def fmt_cell(values):
    m, s = mean_std([100 * v for v in values])
    return f"{m:.1f} ± {s:.1f}" if len(values) > 1 else f"{m:.1f}"


def machine_line():
    try:
        load = os.getloadavg()
        load_s = f"load avg {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f}"
    except OSError:
        load_s = "load n/a"
    return f"{os.cpu_count()} CPU cores visible, torch threads {torch.get_num_threads()}, {load_s}"


def config_dict(cfg):
    d = asdict(cfg)
    d["seeds"] = list(cfg.seeds)
    return d

