#!/usr/bin/env python
"""Does the ball's radius carry information? Head × loss ablation on every bundled development domain.

    python -m bench radius                      # 3 seeds, every head and loss, glyphs + icons + iconify
    python -m bench radius --datasets glyphs    # the glyphs alone (about 6 min on 2 cores)
    python -m bench radius --seeds 0 --steps 300 --heads paper,polar --losses pce   # quick look

Domains (``--datasets``, default every one of ``qc.DEVELOPMENT_DOMAINS``), one table each, the same
protocol for each: the bundled CJK glyphs (class = character, parent = radical; query = display
fonts, gallery = serif/sans), the freedesktop icon themes (class = icon name, parent = its context;
query themes vs the other themes) and the Iconify sets (class = icon concept, parent = topic; query
sets vs the other sets). The record (``python -m bench radius``) holds one row per domain, head and
loss. A glyph cell gives the same numbers whatever other domains run beside it (every cell seeds its
own generators).

Protocol (nothing is selected on test classes): the frozen MobileNetV2 (offline ImageNet weights,
64 px) of ``bench/quality.py`` (``--backbone tf_efficientnet_lite0``: the frozen EfficientNet-Lite0 of
the held-out benchmark, to check that choices made on MobileNetV2 carry over); only the 128-d
head trains, on pooled features (``BenchConfig``, head-only, batch 128 = 32 classes × 4, AdamW lr
3e-3, wd 0.01, grad clip 3). 32 of the training classes (glyphs: of the 160 training characters) are
carved out as a **validation** split (queried as the test split is: display-font / query-group
queries vs the rest); the head design is chosen on the validation columns; the held-out test classes
give the test columns.

Per head and loss, mean ± std over seeds:

* d₀ (geodesic distance to the origin) of the test queries: min / median / max, and the fraction
  within 0.1% of the largest d₀ the head can produce (2r: "at the clip radius");
* AUROC of the Hyp-UML uncertainty (−d₀) for "top-1 neighbour is of another class" (val and test),
  and beside it (test) the same AUROC of the top-1 distance (to the gallery): the gallery-based
  baseline, the only score a sphere cell has;
* AUROC clean vs degraded: every test query is also embedded blurred (Gaussian σ = 1.5 px), with
  noise (σ = 0.5 of the normalised intensity) and occluded (a 24 px square set to the mean); the
  AUROC of −d₀ for "degraded" over the clean + degraded queries (glyphs: 960 + 2,880), and (test)
  of the top-1 distance to the clean gallery;
* R@1 and MAP@R (query → gallery, exact Poincaré kNN / cosine for the sphere), val and test;
* parent R@1: the top-1 neighbour shares the query's radical;
* Spearman between embedding distance and tree distance (0 same character, 1 same radical,
  2 otherwise) over all query × gallery pairs;
* sibling AUROC: the AUROC of −distance for "same radical" over the pairs of different characters
  (tree distance 1 against 2). The 160 test characters sit under 32 radicals, five each: a query
  shares its character with 1/160 of the gallery and only its radical with 4/160, so beyond R@1
  the Spearman is this separation: how much of the radical the embedding carries to unseen
  characters.

Heads: ``paper`` = Hyp-ViT's ``Linear`` + hard clip at 2.3 (``radius="norm"``); ``tanh`` = the same
with the smooth clip r·tanh(‖v‖/r); ``polar`` = the package default (``radius="learned"``: the
direction from the ``Linear``, the tangent norm from a learned radial confidence); ``sphere`` =
PML-style L2-normalised head (for the losses that have a spherical form). Losses: ``pce`` =
Hyp-ViT's pairwise cross-entropy (τ = 0.2), ``uml`` = Hyp-UML's uncertainty-adaptive contrastive
loss (adaptive τ, its spread per anchor is printed), ``supcon`` = PML's SupConLoss (τ = 0.1, sphere
only), ``ms`` = PML's MultiSimilarityLoss + miner (sphere; on the polar head it runs on the cosine of the
ball points, i.e. of the head's directions), ``hier`` = Hyp-ViT's loss + the HIER regulariser, ``mshier``
= HIER's own pairing (polar head): MultiSimilarity on the directions + the HIER regulariser on the ball.
HIER's settings (``HIER_SETTINGS``, ``--hier weight=3,ms_weight=0.3,num_proxies=128,positives=labels+mutual_nn``) are
chosen on the validation columns. ``supcon+parent`` / ``pce+parent`` (a probe, not in the default
list): the loss also on the training characters' radicals, ``--parent weight=0.3,temperature=0.5``; neither
moved the test Spearman or parent R@1 (``docs/design/records.md``, "Spearman probe"). ``--parent class_weight=0``
trains on the radicals alone: the most of the hierarchy the frozen features give a head
(``docs/design/records.md``, "Spearman ceiling").
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402

HEADS = ("paper", "tanh", "polar", "sphere")
LOSSES = ("pce", "uml", "hier", "supcon", "ms", "mshier", "pce+cal", "pce+copies", "pce+cal+copies", "uml+cal+copies",
          "hier+cal+copies")


# ------------------------------------------------------------------------------- degraded queries

def degrade(images: torch.Tensor, kind: str, seed: int = 0) -> torch.Tensor:
    """Degraded copies of normalised image tensors (N, 3, H, W): 'blur', 'noise' or 'occlude'."""
    from torchvision.transforms.functional import gaussian_blur

    gen = torch.Generator().manual_seed(seed)
    if kind == "blur":
        return gaussian_blur(images, kernel_size=9, sigma=1.5)
    if kind == "noise":
        return images + 0.5 * torch.randn(images.shape, generator=gen)
    if kind == "occlude":
        out = images.clone()
        n, _, h, w = images.shape
        side = min(24, h, w)
        ys = torch.randint(0, h - side + 1, (n,), generator=gen)
        xs = torch.randint(0, w - side + 1, (n,), generator=gen)
        for i in range(n):
            out[i, :, ys[i]:ys[i] + side, xs[i]:xs[i] + side] = 0.0
        return out
    raise ValueError(f"unknown degradation {kind!r}")


def degraded_features(cfg, split="query", indices=None, kinds=("blur", "noise", "occlude"), use_cache=True,
                      dataset="glyphs"):
    """Pooled backbone features of the images of ``dataset`` (a development domain) ``split``
    (optionally only ``indices``) under each degradation: {kind: (N, 1280)}."""
    from pml_hyperbolic.data import build_transforms

    idx = None if indices is None else np.asarray(indices, np.int64)
    tag = "all" if idx is None else f"{len(idx)}-{int(idx.sum())}-{int((idx * np.arange(len(idx))).sum())}"
    path = qc._cache_path(cfg, dataset, f"degraded|{split}|{tag}|" + ",".join(kinds))
    if use_cache and os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    data = qc.image_dataset(dataset, split)
    clean = build_transforms("glyph", train=False, image_size=cfg.image_size)
    order = range(len(data)) if idx is None else idx
    images = torch.stack([clean(data[int(i)][0]) for i in order])
    return backbone_features_degraded(cfg, images, kinds, path if use_cache else None)


def backbone_features_degraded(cfg, images, kinds, cache_path=None):
    """{kind: pooled frozen-backbone features of ``images`` degraded by ``kind``} (the j-th kind drawn
    with seed j), saved to ``cache_path`` when given."""
    prefix, tail, _ = qc.split_backbone(cfg.backbone)
    out = {}
    with torch.no_grad():
        for j, kind in enumerate(kinds):
            x = degrade(images, kind, seed=j)
            out[kind] = torch.cat([tail(prefix(x[s:s + 256])) for s in range(0, len(x), 256)])
    if cache_path is not None:
        os.makedirs(cfg.cache_dir, exist_ok=True)
        torch.save(out, cache_path)
    return out


def validation_indices(bank, num_val_classes=32, seed=0):
    """Indices (into the training split) of the validation queries and gallery of
    ``qc.carve_validation`` (same classes, same display-font rule)."""
    labels = bank.train.labels.numpy()
    classes = np.unique(labels)
    val_classes = np.sort(np.random.default_rng(seed).choice(classes, size=num_val_classes, replace=False))
    va_idx = np.flatnonzero(np.isin(labels, val_classes))
    display = np.asarray(bank.train.font_families)[va_idx] == qc.QUERY_SIDE[bank.dataset]
    return va_idx[display], va_idx[~display]


# ----------------------------------------------------------------------------------------- metrics

def auroc(positive: np.ndarray, score: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    positive = np.asarray(positive, bool)
    if positive.all() or not positive.any():
        return float("nan")
    return float(roc_auc_score(positive, score))


def pair_distances(q, g, c):
    from pml_hyperbolic import poincare_ball as pb

    if c is None:
        qn, gn = torch.nn.functional.normalize(q.double(), dim=1), torch.nn.functional.normalize(g.double(), dim=1)
        return 1 - qn @ gn.T
    return pb.pairwise_dist(q.double(), g.double(), float(c))


def radius_metrics(q, ql, g, gl, c, max_d0, q_parent=None, g_parent=None):
    """d₀ statistics, failure AUROC, parent R@1 and Spearman to the tree distance (one split)."""
    from scipy.stats import spearmanr

    from pml_hyperbolic import poincare_ball as pb

    d = pair_distances(q, g, c)
    top = d.argmin(1)
    wrong = (gl[top] != ql).numpy()
    d1 = d.min(1).values.numpy()
    out = {"top1_wrong": wrong, "top1_dist": d1, "auroc_fail_top1": auroc(wrong, d1)}
    if c is not None:
        d0 = pb.dist0(q.double(), float(c)).numpy()
        out.update(d0_min=d0.min(), d0_med=np.median(d0), d0_max=d0.max(),
                   at_clip=float((d0 >= 0.999 * max_d0).mean()) if np.isfinite(max_d0) else 0.0,
                   auroc_fail=auroc(wrong, -d0), d0=d0)
    if q_parent is not None:
        out["parent_r1"] = float((g_parent[top] == q_parent).float().mean())
        tree = np.where((ql[:, None] == gl[None, :]).numpy(), 0, np.where((q_parent[:, None] == g_parent[None, :]).numpy(), 1, 2))
        rng = np.random.default_rng(0)
        idx = rng.choice(tree.size, size=min(tree.size, 400_000), replace=False)
        d_sampled, tree_sampled = d.numpy().ravel()[idx], tree.ravel()[idx]
        out["spearman"] = float(spearmanr(d_sampled, tree_sampled).statistic)
        other_character = tree_sampled > 0
        out["sibling_auroc"] = auroc(tree_sampled[other_character] == 1, -d_sampled[other_character])
    return out


# ----------------------------------------------------------------------------------------- models

# weight: beside pairwise CE (``hier``); ms_weight: beside MultiSimilarity (``mshier``, recipes/hier.py's glyph
# default). Both chosen on the validation columns (weights 0.3 / 1 / 3 / 10 tried, 2 seeds).
HIER_SETTINGS = {"weight": 3.0, "ms_weight": 0.3, "num_proxies": 128, "max_triplets": 2048, "max_proxy_triplets": 1024,
                 "margin": 0.1, "positives": "labels"}


# The ball's curvature and the pairwise CE's temperature of every hyperbolic cell (--c, --pce-temperature:
# the Spearman probe varies them; the defaults are Hyp-ViT's glyph settings).
CELL_SETTINGS = {"c": 0.1, "pce_temperature": 0.2}

RADIUS_TERMS = ("cal", "copies", "parent")

# ``+parent``: the cell's loss also on the parent labels (the radical of each training character),
# with this weight and, for the pairwise CE, this temperature (--parent).
# class_weight 0 drops the class-level loss (the radicals alone: the ceiling of the hierarchy columns).
PARENT_SETTINGS = {"weight": 0.3, "temperature": 0.5, "class_weight": 1.0}


def split_terms(loss_name):
    """'pce+cal+copies' -> ('pce', {'cal', 'copies'}): the base loss and the radius terms."""
    base, *terms = loss_name.split("+")
    unknown = set(terms) - set(RADIUS_TERMS)
    if unknown:
        raise ValueError(f"unknown radius term(s) {sorted(unknown)} in {loss_name!r} (known: {RADIUS_TERMS})")
    return base, set(terms)


def build(head_name, loss_name, feature_dim, embedding_dim=128):
    """(head, loss, c or None, max d₀) for one cell. ``loss_name`` may carry radius terms:
    ``+cal`` adds ``RadialCalibrationLoss`` (weight 1, as ``--radial-calibration 1``), ``+copies`` is
    handled by :func:`run_cell` (degraded copies, as ``--degraded-copies 0.25``); both need the
    polar head, as in the recipes."""
    base, terms = split_terms(loss_name)
    if terms == {"parent"}:
        head, loss, geometry, max_d0 = build(head_name, base, feature_dim, embedding_dim)
        return head, ParentLevelTerm(loss, _parent_loss(base, geometry)), geometry, max_d0
    if terms:
        if head_name != "polar" or "parent" in terms:
            raise ValueError("radius terms need the polar head (and go without +parent)")
        head, loss, geometry, max_d0 = build(head_name, base, feature_dim, embedding_dim)
        if "cal" in terms:
            from pytorch_metric_learning.losses import MultipleLosses

            from pml_hyperbolic.losses import RadialCalibrationLoss

            loss = MultipleLosses([loss, RadialCalibrationLoss(c=geometry)], weights=[1.0, 1.0])
        return head, loss, geometry, max_d0
    from pytorch_metric_learning.losses import SupConLoss

    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.geometry import PoincareGeometry
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss, UncertaintyAdaptiveContrastiveLoss

    if head_name == "sphere":
        head = SphericalEmbeddingHead(feature_dim, embedding_dim)
        if loss_name == "supcon":
            return head, SupConLoss(temperature=0.1), None, np.inf
        if loss_name == "ms":
            return head, _multi_similarity(), None, np.inf
        raise ValueError(f"no spherical form of {loss_name!r}")
    if loss_name == "supcon" or (loss_name in ("ms", "mshier") and head_name != "polar"):
        raise ValueError(f"{loss_name} runs on the sphere head (ms, mshier: also the polar head)")
    geometry = PoincareGeometry(c=CELL_SETTINGS["c"], clip="tanh" if head_name == "tanh" else "hard", clip_r=2.3)
    head = HyperbolicEmbeddingHead(feature_dim, embedding_dim, c=geometry,
                                   radius="learned" if head_name == "polar" else "norm")
    distance = PoincareDistance(c=geometry)
    if loss_name in ("ms", "mshier"):
        # HIER's own setup: MultiSimilarity on the cosine of the ball points (for the polar head the
        # cosine of its directions: the radius is left to the regulariser), HIER on the ball
        loss = _multi_similarity()
    elif loss_name == "uml":
        loss = UncertaintyAdaptiveContrastiveLoss(c=geometry, distance=distance)  # U's radius: the geometry's
    else:
        loss = PairwiseCrossEntropyLoss(temperature=CELL_SETTINGS["pce_temperature"], distance=distance)
    if loss_name in ("hier", "mshier"):
        from pml_hyperbolic.losses import HIERLoss

        if head_name == "tanh":
            raise ValueError("HIER rows: paper and polar heads only (CPU budget)")
        # HIER's regulariser at a CPU budget (HIER_SETTINGS, --hier): fewer proxies and triplets than the paper
        h = dict(HIER_SETTINGS)
        weight, ms_weight = h.pop("weight"), h.pop("ms_weight")
        weight = ms_weight if loss_name == "mshier" else weight
        from pytorch_metric_learning.losses import MultipleLosses

        loss = MultipleLosses([loss, HIERLoss(embedding_size=embedding_dim, c=geometry, **h)], weights=[1.0, weight])
    return head, loss, geometry, geometry.max_dist0()


def _parent_loss(base, geometry):
    """The parent-level loss of a ``+parent`` cell: SupCon on the sphere (same τ as the class
    level), the pairwise CE on the ball at ``PARENT_SETTINGS['temperature']``."""
    from pytorch_metric_learning.losses import SupConLoss

    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

    if base == "supcon":
        return SupConLoss(temperature=0.1)
    if base == "pce":
        return PairwiseCrossEntropyLoss(temperature=PARENT_SETTINGS["temperature"], distance=PoincareDistance(c=geometry))
    raise ValueError(f"+parent: only supcon and pce cells, not {base!r}")


class ParentLevelTerm(torch.nn.Module):
    """w_class · loss(emb, labels[:, 0]) + w · parent_loss(emb, labels[:, 1]) for (N, 2) labels."""

    def __init__(self, loss, parent_loss):
        super().__init__()
        self.loss, self.parent_loss = loss, parent_loss

    def forward(self, emb, labels, indices_tuple=None):
        parent_term = PARENT_SETTINGS["weight"] * self.parent_loss(emb, labels[:, 1])
        if PARENT_SETTINGS["class_weight"] == 0:
            return parent_term
        return PARENT_SETTINGS["class_weight"] * self.loss(emb, labels[:, 0]) + parent_term


def _multi_similarity():
    """PML's MultiSimilarityLoss (α 2, β 50, base 0.5) with its miner (ε 0.1), as ``bench/quality.py``'s row."""
    from pytorch_metric_learning.losses import MultiSimilarityLoss
    from pytorch_metric_learning.miners import MultiSimilarityMiner

    return _Mined(MultiSimilarityLoss(alpha=2, beta=50, base=0.5), MultiSimilarityMiner(epsilon=0.1))


class _Mined(torch.nn.Module):
    """A PML loss with its miner (as ``bench/quality.py``'s MultiSimilarity row)."""

    def __init__(self, loss, miner):
        super().__init__()
        self.loss, self.miner = loss, miner

    def forward(self, emb, labels, indices_tuple=None):
        return self.loss(emb, labels, self.miner(emb, labels))


COPY_FRACTION = 0.25  # the recipes' --degraded-copies default (Hyp-UML)


def degraded_view_features(cfg, degrade, cache_tag, views=2, use_cache=True, dataset="glyphs"):
    """Pooled features of every training image of ``dataset``, augmented then degraded by
    ``degrade(images (B, C, H, W), generator)``: (N, views, 1280), cached under ``cache_tag``."""
    from pml_hyperbolic.data import build_transforms

    path = qc._cache_path(cfg, dataset, cache_tag)
    if use_cache and os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    prefix, tail, _ = qc.split_backbone(cfg.backbone)
    data = qc.image_dataset(dataset, "train")
    augment = build_transforms("glyph", train=True, image_size=cfg.image_size)
    generator = torch.Generator().manual_seed(77)
    torch.manual_seed(77)  # torchvision's random transforms draw from the global RNG
    out = []
    with torch.no_grad():
        for _ in range(views):
            feats = []
            for start in range(0, len(data), 256):
                images = torch.stack([augment(data[i][0]) for i in range(start, min(len(data), start + 256))])
                feats.append(tail(prefix(degrade(images, generator))))
            out.append(torch.cat(feats))
    out = torch.stack(out, 1)
    if use_cache:
        os.makedirs(cfg.cache_dir, exist_ok=True)
        torch.save(out, path)
    return out


def package_degraded_views(cfg, kinds=("blur", "noise", "occlusion"), views=2, use_cache=True, dataset="glyphs"):
    """Training views degraded by the package's ``RandomDegradation`` (the recipes' ``--degraded-copies``)."""
    from pml_hyperbolic.data.degradations import RandomDegradation

    return degraded_view_features(cfg, RandomDegradation(kinds=kinds),
                                  f"package-degraded-train-views-batched|{views}|" + ",".join(kinds), views, use_cache,
                                  dataset=dataset)


def aligned_views(data, views):
    """``views`` (of the whole training set) restricted to the rows of the training split, in its order
    (carve_validation keeps a subset of the training rows: found by their clean view)."""
    train, full = data["train"], data["bank"].train
    index = {tuple(full.acts[i, 0, :8].tolist()): i for i in range(len(full.acts))}
    rows = torch.tensor([index[tuple(train.acts[j, 0, :8].tolist())] for j in range(len(train.acts))])
    return views[rows]


def train_with_copies(cfg, train, degraded, head, loss_fn, copy_loss, seed=0, steps=None,
                      copy_fraction=COPY_FRACTION):
    """``qc.train_with_labels`` (head only) with ``DegradedCopyTrainer``'s step: ⌈f·B⌉ rows of each batch
    also embed one of their degraded views; the metric loss sees the clean rows, ``copy_loss`` the pairs."""
    import math

    from pml_hyperbolic.data import ClassBalancedBatchSampler

    steps = cfg.steps if steps is None else steps
    opt = qc.make_optimizer(cfg, torch.nn.Identity(), head, loss_fn)
    params = [p for g in opt.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(10_000 + seed)
    sampler = ClassBalancedBatchSampler(train.labels, cfg.batch_size, cfg.samples_per_class, num_batches=steps,
                                        seed=seed * 7919)
    head.train()
    for idx in sampler:
        idx = torch.as_tensor(idx)
        batch = len(idx)
        view = torch.randint(train.acts.shape[1], (batch,), generator=gen)
        rows = torch.randperm(batch, generator=gen)[:max(1, math.ceil(copy_fraction * batch))]
        dview = torch.randint(degraded.shape[1], (len(rows),), generator=gen)
        emb = head(torch.cat([train.acts[idx, view], degraded[idx[rows], dview]]))
        clean, copies = emb[:batch], emb[batch:]
        loss = loss_fn(clean, train.labels[idx]) + copy_loss(clean[rows], ref_emb=copies)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if not torch.isfinite(loss):
            raise FloatingPointError("non-finite loss")
    return head


def embed(head, feats, batch=1024):
    head.eval()
    with torch.no_grad():
        return torch.cat([head(feats[s:s + batch]) for s in range(0, len(feats), batch)]).float()


def run_cell(cfg, data, head_name, loss_name, seed, steps, builder=None, train=None):
    """Train one (head, loss) cell and measure it. ``builder(feature_dim)`` replaces :func:`build`
    and ``train`` the training split (``bench/radius_probes.py``'s variants)."""
    torch.manual_seed(seed)
    built = builder(data["bank"].feature_dim) if builder else build(head_name, loss_name, data["bank"].feature_dim)
    head, loss, geometry, max_d0 = built
    c = None if geometry is None else float(geometry.curvature())
    if "copies" in split_terms(loss_name)[1]:
        from pml_hyperbolic.losses import DegradedCopyRadiusLoss

        train_with_copies(cfg, data["train"] if train is None else train, data["train_degraded"], head, loss,
                          DegradedCopyRadiusLoss(c=geometry, margin=0.2), seed=seed, steps=steps)
    else:
        split = data["train"] if train is None else train
        relabel = None
        if "parent" in split_terms(loss_name)[1]:
            levels = torch.stack([torch.as_tensor(split.labels), torch.as_tensor(split.super_labels)], 1)
            relabel = lambda tail, head: (split.labels, levels)  # noqa: E731 (batches balanced by class)
        qc.train_with_labels(cfg, split, torch.nn.Identity(), head, loss, seed=seed, steps=steps, relabel=relabel)
    res = {}
    vq, vg = data["val_q"], data["val_g"]
    val = radius_metrics(embed(head, vq.acts), vq.labels, embed(head, vg.acts), vg.labels, c, max_d0,
                         data["val_q_parent"], data["val_g_parent"])
    res["val_parent_r1"], res["val_spearman"] = val["parent_r1"], val["spearman"]
    res["val_sibling_auroc"] = val["sibling_auroc"]
    res["val_r1"] = 1 - val["top1_wrong"].mean()
    res["val_auroc_fail"] = val.get("auroc_fail", np.nan)
    if c is not None:
        res["val_auroc_degraded"] = _degraded_auroc(head, val["d0"], data["val_degraded"], c)
    bank = data["bank"]
    q, g = embed(head, bank.query.acts), embed(head, bank.gallery.acts)
    test = radius_metrics(q, bank.query.labels, g, bank.gallery.labels, c, max_d0, data["q_parent"], data["g_parent"])
    res.update({k: v for k, v in test.items() if k not in ("top1_wrong", "d0", "top1_dist")})
    res["r1"] = 1 - test["top1_wrong"].mean()
    res["map_r"] = qc.retrieval_metrics(q, bank.query.labels, g, bank.gallery.labels, c=c,
                                        keys=("mean_average_precision_at_r",))["mean_average_precision_at_r"]
    if c is not None:
        res["auroc_degraded"] = _degraded_auroc(head, test["d0"], data["degraded"], c)
    res["auroc_degraded_top1"] = _degraded_top1_auroc(head, test["top1_dist"], data["degraded"], g, c)
    if split_terms(loss_name)[0] == "uml":
        from pml_hyperbolic.uncertainty import hyperbolic_uncertainty, uncertainty_ratio_log

        with torch.no_grad():
            u = hyperbolic_uncertainty(q, c=geometry)  # the geometry's clip radius, as the loss
            uml = loss.losses[0] if hasattr(loss, "losses") else loss
            tau = (uml.scale * uncertainty_ratio_log(u)).clamp_min(uml.min_temperature)
        res["tau_spread"] = f"{float(tau.min()):.3f}-{float(tau.max()):.3f}"
    return res


def _degraded_auroc(head, d0_clean, degraded, c):
    """AUROC of −d₀ for 'degraded' over the clean queries and their degraded copies."""
    from pml_hyperbolic import poincare_ball as pb

    d0_deg = np.concatenate([pb.dist0(embed(head, f).double(), c).numpy() for f in degraded.values()])
    is_deg = np.r_[np.zeros(len(d0_clean), bool), np.ones(len(d0_deg), bool)]
    return auroc(is_deg, -np.r_[d0_clean, d0_deg])


def _degraded_top1_auroc(head, d1_clean, degraded, gallery_emb, c):
    """AUROC of the top-1 distance (to the clean gallery) for 'degraded' over the clean queries and
    their degraded copies: the gallery-based baseline of :func:`_degraded_auroc` (the sphere's only one)."""
    d1_deg = np.concatenate([pair_distances(embed(head, f), gallery_emb, c).min(1).values.numpy()
                             for f in degraded.values()])
    is_deg = np.r_[np.zeros(len(d1_clean), bool), np.ones(len(d1_deg), bool)]
    return auroc(is_deg, np.r_[d1_clean, d1_deg])


VAL_CLASSES = 32  # training classes carved out as the validation split, in every domain


def _parents(split, dataset, name):
    """The parent label of every item of an evaluation split: the bank's, or (banks cached before
    they stored them) the image dataset's."""
    if split.super_labels is not None:
        return torch.as_tensor(split.super_labels)
    parents = torch.as_tensor(qc.image_dataset(dataset, name).super_labels)
    if len(parents) != len(split.labels):
        raise RuntimeError(f"cached bank does not match the bundled {dataset} splits; rerun with --no-cache")
    return parents


def load_data(cfg, use_cache=True, dataset="glyphs"):
    """Everything one domain's cells need: the pooled bank, the validation carve (``VAL_CLASSES``
    training classes, queried as the test split is), the parents of every split and the degraded
    features of the test and validation queries."""
    if dataset not in qc.DEVELOPMENT_DOMAINS:
        raise ValueError(f"dataset must be one of {qc.DEVELOPMENT_DOMAINS}, got {dataset!r}")
    bank = qc.pooled_bank(qc.build_bank(cfg, dataset, use_cache=use_cache), cfg, use_cache=use_cache)
    if bank.train.font_families is None or bank.gallery is None:
        raise RuntimeError(f"the {dataset} bank has no query/gallery styles; rerun with --no-cache")
    train, val_q, val_g = qc.carve_validation(bank, num_val_classes=VAL_CLASSES, seed=0)
    val_q_idx, val_g_idx = validation_indices(bank, num_val_classes=VAL_CLASSES)
    parents = bank.train.super_labels
    return {"bank": bank, "train": train, "val_q": val_q, "val_g": val_g,
            "q_parent": _parents(bank.query, dataset, "query"),
            "val_q_parent": parents[val_q_idx], "val_g_parent": parents[val_g_idx],
            "g_parent": _parents(bank.gallery, dataset, "gallery"),
            "degraded": degraded_features(cfg, "query", use_cache=use_cache, dataset=dataset),
            "val_degraded": degraded_features(cfg, "train", val_q_idx, use_cache=use_cache, dataset=dataset)}


def fmt(values, pct=False, digits=3):
    v = np.asarray([x for x in values if x is not None], float)
    if len(v) == 0 or np.all(np.isnan(v)):
        return "—"
    scale = 100 if pct else 1
    if len(v) == 1:
        return f"{scale * v[0]:.{1 if pct else digits}f}"
    return f"{scale * np.nanmean(v):.{1 if pct else digits}f} ± {scale * np.nanstd(v):.{1 if pct else digits}f}"


COLUMNS = [("val R@1", "val_r1", True), ("val parent R@1", "val_parent_r1", True), ("val Spearman", "val_spearman", False),
           ("val sibling AUROC", "val_sibling_auroc", False),
           ("val AUROC fail", "val_auroc_fail", False), ("val AUROC degraded", "val_auroc_degraded", False),
           ("R@1", "r1", True),
           ("MAP@R", "map_r", True), ("parent R@1", "parent_r1", True), ("Spearman", "spearman", False),
           ("sibling AUROC", "sibling_auroc", False), ("AUROC fail", "auroc_fail", False),
           ("AUROC fail top-1 dist", "auroc_fail_top1", False), ("AUROC degraded", "auroc_degraded", False),
           ("AUROC degraded top-1 dist", "auroc_degraded_top1", False),
           ("d₀ min / med / max", None, False), ("at clip", "at_clip", True)]


TEST_KINDS = {"blur": "blur", "noise": "noise", "occlusion": "occlude"}  # RandomDegradation kind -> test copy


def leave_one_out(cfg, data, seeds, steps, use_cache=True):
    """Does the radius learn "degraded" or only the corruptions it saw? Polar head, pce + cal + copies,
    the copies drawn from two of the three kinds; AUROC degraded (test) per test degradation."""
    from pml_hyperbolic import poincare_ball as pb

    kinds = tuple(TEST_KINDS)
    trainings = [("none (pce + cal, no copies)", None)] + [("all three", kinds)] + [
        (f"{', '.join(k for k in kinds if k != held)} (held out: {held})", tuple(k for k in kinds if k != held))
        for held in kinds]
    print("| degraded copies in training | " + " | ".join(f"AUROC degraded: {k}" for k in kinds) + " | R@1 |")
    print("|---|" + "---|" * (len(kinds) + 1))
    for name, train_kinds in trainings:
        per_kind, r1 = {k: [] for k in kinds}, []
        loss_name = "pce+cal" if train_kinds is None else "pce+cal+copies"
        if train_kinds is not None:
            data["train_degraded"] = aligned_views(data, package_degraded_views(cfg, train_kinds, use_cache=use_cache,
                                                                                dataset=data["bank"].dataset))
        for seed in seeds:
            torch.manual_seed(seed)
            head, loss, geometry, max_d0 = build("polar", loss_name, data["bank"].feature_dim)
            if train_kinds is None:
                qc.train_with_labels(cfg, data["train"], torch.nn.Identity(), head, loss, seed=seed, steps=steps)
            else:
                from pml_hyperbolic.losses import DegradedCopyRadiusLoss

                train_with_copies(cfg, data["train"], data["train_degraded"], head, loss,
                                  DegradedCopyRadiusLoss(c=geometry, margin=0.2), seed=seed, steps=steps)
            c = float(geometry.curvature())
            q = embed(head, data["bank"].query.acts)
            clean = pb.dist0(q.double(), c).numpy()
            for kind in kinds:
                d = pb.dist0(embed(head, data["degraded"][TEST_KINDS[kind]]).double(), c).numpy()
                per_kind[kind].append(auroc(np.r_[np.zeros(len(clean), bool), np.ones(len(d), bool)], -np.r_[clean, d]))
            g = embed(head, data["bank"].gallery.acts)
            top = pair_distances(q, g, c).argmin(1)
            r1.append(float((data["bank"].gallery.labels[top] == data["bank"].query.labels).float().mean()))
        print(f"| {name} | " + " | ".join(fmt(per_kind[k]) for k in kinds) + f" | {fmt(r1, pct=True)} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default=",".join(qc.DEVELOPMENT_DOMAINS),
                   help="comma-separated development domains, each with the same protocol and its own table "
                        f"(default: every one, {','.join(qc.DEVELOPMENT_DOMAINS)})")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=600, help="training steps per cell (head only)")
    p.add_argument("--heads", default=",".join(HEADS))
    p.add_argument("--losses", default=",".join(LOSSES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hier", default="", help="HIER settings, e.g. 'weight=3,num_proxies=512' (default: "
                   + ", ".join(f"{k}={v}" for k, v in HIER_SETTINGS.items()) + ")")
    p.add_argument("--c", type=float, default=CELL_SETTINGS["c"], help="curvature of the hyperbolic cells")
    p.add_argument("--pce-temperature", type=float, default=CELL_SETTINGS["pce_temperature"],
                   help="temperature of the pairwise cross-entropy cells (pce, hier)")
    p.add_argument("--parent", default="", help="+parent settings, e.g. 'weight=0.3,temperature=0.5' (default: "
                   + ", ".join(f"{k}={v}" for k, v in PARENT_SETTINGS.items()) + ")")
    p.add_argument("--backbone", default=qc.BenchConfig.backbone,
                   help="frozen feature extractor: mobilenetv2_100 (default) or tf_efficientnet_lite0 (the "
                        "backbone of the held-out benchmark; a transfer check of the settings chosen on "
                        "the default, not a place to choose them)")
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--leave-one-out", action="store_true",
                   help="Only the generalisation check of --degraded-copies: train polar pce+cal+copies with the "
                        "degraded copies of two kinds, report the AUROC degraded of each test kind")
    a = p.parse_args(argv)
    qc.set_threads(a.threads)
    if not (a.c > 0 and a.pce_temperature > 0):
        p.error(f"--c and --pce-temperature must be > 0, got {a.c} and {a.pce_temperature}")
    CELL_SETTINGS.update(c=a.c, pce_temperature=a.pce_temperature)
    seeds = [int(s) for s in a.seeds.split(",")]
    for item in filter(None, a.hier.split(",")):
        key, value = item.split("=")
        if key not in HIER_SETTINGS:
            p.error(f"--hier: unknown setting {key!r} (known: {', '.join(HIER_SETTINGS)})")
        kind = type(HIER_SETTINGS[key])
        HIER_SETTINGS[key] = value if kind is str else kind(float(value))
    for item in filter(None, a.parent.split(",")):
        key, value = item.split("=")
        if key not in PARENT_SETTINGS:
            p.error(f"--parent: unknown setting {key!r} (known: {', '.join(PARENT_SETTINGS)})")
        PARENT_SETTINGS[key] = float(value)
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    unknown = [d for d in datasets if d not in qc.DEVELOPMENT_DOMAINS]
    if unknown or not datasets:
        p.error(f"--datasets: unknown domain(s) {unknown} (known: {', '.join(qc.DEVELOPMENT_DOMAINS)})")
    cfg = qc.BenchConfig(steps=a.steps, seeds=tuple(seeds), trainable="head", backbone=a.backbone)
    t0 = time.perf_counter()
    print(f"# {qc.machine_line()}\n# {cfg.describe()}")
    rows = []
    for dataset in datasets:
        data = load_data(cfg, use_cache=not a.no_cache, dataset=dataset)
        print(f"\n## {dataset}\n# {data['bank'].note}; validation: {VAL_CLASSES} training classes", flush=True)
        if a.leave_one_out:
            leave_one_out(cfg, data, seeds, a.steps, use_cache=not a.no_cache)
            continue
        rows += domain_table(cfg, data, a.heads.split(","), a.losses.split(","), seeds, a.steps,
                             use_cache=not a.no_cache)
    print(f"# {time.perf_counter() - t0:.0f} s wall")
    return rows or None


ROW_KEYS = ("val_r1", "val_auroc_fail", "r1", "map_r", "parent_r1", "spearman", "sibling_auroc", "auroc_fail",
            "auroc_fail_top1", "auroc_degraded", "auroc_degraded_top1", "d0_med", "at_clip")


def domain_table(cfg, data, heads, losses, seeds, steps, use_cache=True):
    """Train and measure every (head, loss) cell on one domain, print its table; the record's rows
    (one per cell: the means over seeds of ``ROW_KEYS``)."""
    dataset = data["bank"].dataset
    if any("copies" in split_terms(name)[1] for name in losses):
        data["train_degraded"] = aligned_views(data, package_degraded_views(cfg, use_cache=use_cache, dataset=dataset))
    header = "| head | loss | " + " | ".join(name for name, _, _ in COLUMNS) + " | adaptive τ (test) |"
    print(header + "\n|" + "---|" * (header.count("|") - 1))
    rows = []
    for head_name in heads:
        for loss_name in losses:
            try:
                build(head_name, loss_name, 8)
            except (ValueError, ImportError):
                continue  # no such combination (e.g. SupCon on the ball, HIER not installed)
            runs = [run_cell(cfg, data, head_name, loss_name, s, steps) for s in seeds]
            cells = []
            for _, key, pct in COLUMNS:
                if key is None:
                    cells.append(" / ".join(fmt([r.get(k) for r in runs], digits=2) for k in ("d0_min", "d0_med", "d0_max"))
                                 if "d0_min" in runs[0] else "—")
                else:
                    cells.append(fmt([r.get(key) for r in runs], pct=pct))
            tau = ", ".join(r["tau_spread"] for r in runs) if "tau_spread" in runs[0] else "—"
            print(f"| {head_name} | {loss_name} | " + " | ".join(cells) + f" | {tau} |", flush=True)
            row = {"dataset": dataset, "head": head_name, "loss": loss_name, "seeds": len(runs)}
            for key in ROW_KEYS:
                values = np.asarray([r[key] for r in runs if key in r], float)
                if len(values) and not np.all(np.isnan(values)):
                    row[key] = round(float(np.nanmean(values)), 4)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
