#!/usr/bin/env python
"""Method comparison on real data: every method against PML's strong baselines.

    python -m bench quality                 # the held-out protocol on every development domain (below)
    python -m bench quality --datasets icons --rows supcon,ms,hms --seeds 0,1
    python -m bench quality --protocol tail # the MobileNetV2 tail table: 3 seeds, 120 steps, all rows, glyphs
    python -m bench quality --quick         # 1 seed, 100 steps, head only, all rows but HCL (187 CPU-s measured)
    python -m bench quality --protocol tail --rows raw,supcon,hypvit --seeds 0 --steps 50 --out results.json

**Default protocol (``--protocol heldout``)**: the one an outside benchmark measures the package with.
Frozen ImageNet EfficientNet-Lite0 (``tf_efficientnet_lite0``, offline weights, 64 px, pooled 1280-d
features of 1 clean + 3 augmented views per training image), a 128-d head, batch 256 = 64 classes × 4,
AdamW 1e-3 (weight decay 0.01, grad clip 3), 600 steps, seeds 0-4, on every development domain
(``DEVELOPMENT_DOMAINS``: every bank dataset with a parent level, e.g. the bundled glyphs and icons).
Rows (``HELDOUT_ROWS``): PML ``SupConLoss`` and ``MultiSimilarityLoss`` on the sphere, Hyp-ViT's pairwise
CE, MultiSimilarity on ``PoincareSimilarity`` without and with the radial calibration (from the
recipe's whitened warm start; ``hms_random`` from a random head, ``ms_whiten`` the sphere from the
same start), + HIER, and
``SupConLoss`` on ``PoincareSimilarity``. The table adds, per domain, each row's paired R@1 difference
(seed by seed) to the better PML baseline (mean ± sd, seeds won), parent-level R@1 and Spearman(distance,
tree distance) against SupCon's, the share of test queries at the clip radius of every ball row
(``pml_hyperbolic.evaluation.radius_health``), and the targets read off it. The function returns those
rows (``python -m bench quality`` records them as JSON); ``--out`` writes every per-seed metric.

The rest of this text describes ``--protocol tail``, the earlier table.

**Every method trains through its recipe** (``bench/_recipe_rows.py``): the recipe script's class
with its parser, presets, geometry, head, loss, miner, optimisers, PML trainer (``trainer_class``:
HCL's momentum trainer, the unsupervised re-clustering hook) and PML tester — ``recipe.run()``, what
``python recipes/<name>.py`` runs. The PML baselines run on the same runner as a bench-only recipe
(``PMLBaseline``). Two things differ from a recipe run, to fit the table on 2 CPU cores:

* Backbone: ``mobilenetv2_100`` with the offline ImageNet weights of
  :func:`pml_hyperbolic.backbones.build_backbone` (``--backbone tf_efficientnet_lite0`` also works).
  Its frozen prefix is not run during training: its activations are cached once per image view
  (1 clean + 3 augmented views per training image, drawn once with a fixed seed; ``--cache-dir``),
  and a training item is one of its image's views. Every method and seed trains on the same bank.
* Trainable part (the recipe's trunk): the last inverted-residual block + ``conv_head`` (320→1280),
  every BatchNorm at its ImageNet statistics, + the recipe's embedding head (128-d). Cost measured:
  ~1 s CPU per training step (batch 128) + ~6 s CPU per evaluation.
* Images 64 px; 120 steps × batch 128 (32 classes × 4, ``ClassBalancedBatchSampler``); AdamW
  (lr 3e-4 tail / 3e-3 head, weight decay 0.01), gradient-norm clip 3; seeds 0, 1, 2.
  ``--quick``: 100 steps, seed 0, a 2-view bank, and only the embedding head trains (the trunk is the
  identity over the frozen backbone's pooled 1280-d features): a plumbing/smoke run, not the table.
* No hyperparameter was tuned on the test classes: every method uses its paper's (or PML's)
  defaults listed in the row label. ``bench/tau_sweep.py`` does its τ/c selection on a validation
  split carved from the training classes.

**Data.** The bundled glyph dataset under its hard protocol (160 held-out characters; queries in
display fonts, gallery in serif/sans fonts) and, when Debian's ``dataset-fashion-mnist`` is
installed (``/usr/share/datasets/fashion-mnist``), Fashion-MNIST with held-out classes 5-9; when it
is not installed the script says so and skips it (it never installs anything).

**Evaluation.** Held-out classes only. Spherical / Euclidean outputs: cosine kNN. Hyperbolic heads:
the exact Poincaré kNN at the head's c (``RecallAtKAccuracyCalculator(c=...)``). Metrics:
Recall@1/2/4/8 and PML's MAP@R, mean ± std over seeds, in %.

**Rows.** ``raw`` pretrained pooled features (no training) · ``supcon`` PML ``SupConLoss`` (cosine,
τ = 0.1: the Sph- baseline) · ``ms`` PML ``MultiSimilarityLoss`` + ``MultiSimilarityMiner`` ·
``hypvit`` Hyp-ViT pairwise CE (c = 0.1, τ = 0.2) · ``hms`` MultiSimilarity + miner on the ball
(``PoincareSimilarity``, 1 − d/T with T = 2·clip_r; ``recipes/hier.py --hier-weight 0``) · ``hms_whiten`` /
``ms_whiten`` ``hms`` (the HIER recipe's bundled-data default since 2026-11-28) and ``ms`` from the head's
PCA-whitening warm start (``--head-init whiten``), ``hms_random`` ``hms`` from a random head · ``hier_ms`` HIER's
recipe (its glyph default: the same plus 0.3·HIER; ``hier_ms_cosine`` on the cosine, the default
until 2026-11-26) · ``hypmix`` / ``hypmix_learn`` HypMix (λ = 3,
τe = 0.05, τh = 0.2; fixed / learnable λ) · ``uml_tau`` / ``uml_tau_lit`` Hyp-UML adaptive τ (sound
default U / the paper's literal U) · ``uml_margin`` / ``uml_margin_lit`` Hyp-UML adaptive margin (the
``uml`` rows follow the recipe's bundled-data head start: the PCA whitening since 2026-11-28;
``uml_tau_random`` ``uml_tau`` from a random head) ·
``hier_margin`` hierarchical-margin contrastive loss (supervised) · ``unsup_logratio`` unsupervised
hierarchical log-ratio loss (labels never used: pseudo-labels from the package's
``UnsupervisedPseudoLabels`` defaults — one level of 512 Ward clusters of the pre-trained (step-0)
features, PCA-whitened to 256-d, computed once; the head warm-started as the PCA whitening of the
training images' trunk outputs at 10× the random init's norm; chosen on a validation split by
``bench/unsupervised_pseudo_labels.py --protocol recipe``; Ω = 1.2, the loss's default; the
paper's average linkage on the embeddings with levels (100, 70, 40, 10) and Ω = 10 is
``UnsupervisedPseudoLabels.paper()`` + ``omega=10.0``) · ``unsup_kmeans`` its baseline with the same
budget (k-means k = 100 pseudo-labels + PML ``TripletMarginLoss``) · ``hcl`` HCL on scenes composed
from the training glyphs (``ComposedGlyphScenes`` of the training package; MoCo + 0.1 × hyperbolic
scene→object loss, c = 0.05, T = 0.2), evaluated like the recipe: cosine kNN on the glyph protocol.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import warnings

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402
from bench import _recipe_rows as rr  # noqa: E402

HYP_C = 0.1


# --------------------------------------------------------------------------------------- rows


class Row:
    """One method: the recipe that trains it (script, class, flags) — ``raw`` trains nothing."""

    def __init__(self, key, label, recipe=None, argv=(), kind="recipe"):
        self.key, self.label, self.recipe, self.argv, self.kind = key, label, recipe, list(argv), kind


def build_rows():
    from pml_hyperbolic.geometry import DEFAULT_CLIP_R
    from pml_hyperbolic.training.presets import (DEFAULT_HEAD_INIT_SCALE, HCL_GLYPH_HYPERBOLIC_WEIGHT,
                                                 HCL_GLYPH_TRUNK_LR, HCL_GLYPH_VIEW_AUGMENTATION,
                                                 HIER_MARGIN_GLYPH_HEAD_LR)
    hcl_argv = ["--samples-per-class", "1", "--ball-curvature", "0.05", "--temperature", "0.2",
                "--hyperbolic-weight", f"{HCL_GLYPH_HYPERBOLIC_WEIGHT:g}", "--momentum", "0.99",
                "--lr", f"{HCL_GLYPH_TRUNK_LR:g}"]
    uml = ("hyp_uml_cars", "HypUML")
    calibration = rr.load_recipe_class("hier", "HIER").glyph_preset["radial_calibration"]
    NO_COPIES = ["--degraded-copies", "0"]
    HMS = ["--hier-weight", "0", "--ms-similarity", "poincare"]  # recipes/hier.py without HIER, MS on the ball
    WHITEN = ["--head-init", "whiten", "--head-init-scale", f"{DEFAULT_HEAD_INIT_SCALE:g}"]
    rows = [
        Row("raw", "Pretrained features, no training (1280-d, cosine)", kind="raw"),
        Row("supcon", "PML SupConLoss (cosine, τ=0.1) [Sph- baseline]", "baseline", ["--pml-loss", "supcon"]),
        Row("ms", "PML MultiSimilarityLoss + MultiSimilarityMiner (2, 50, 0.5; ε=0.1)", "baseline",
            ["--pml-loss", "ms"]),
        Row("pa", "PML ProxyAnchorLoss (cosine, margin 0.1, α 32)", "baseline", ["--pml-loss", "pa"]),
        Row("hypvit", "Hyp-ViT pairwise CE (c=0.1, τ=0.2)", ("hyp_vit", "HypViT")),
        Row("hier", "Hyp-ViT pairwise CE + 3·HIER (128 proxies, c=0.1)", ("hyp_vit", "HypViT"),
            ["--hier-weight", "3", "--hier-proxies", "128"]),
        Row("hier_ms", f"HIER: MultiSimilarity on the Poincaré similarity + 0.3·HIER + {calibration:g}·radial "
            "calibration (128 proxies, c=0.1; recipes/hier.py)", ("hier", "HIER")),
        Row("hier_ms_cosine", "HIER: MultiSimilarity on the cosine + 0.3·HIER + 0.03·radial calibration (the glyph "
            "default until 2026-11-26, 00070d1)", ("hier", "HIER"), ["--ms-similarity", "cosine"]),
        Row("hier_ms_nocal", "HIER: MultiSimilarity (cosine) + 0.3·HIER, no calibration (before 2026-11-26, 56f95f3)",
            ("hier", "HIER"), ["--radial-calibration", "0", "--ms-similarity", "cosine"]),
        Row("hier_ms_cal", "HIER: MultiSimilarity (cosine) + 0.3·HIER + radial calibration 1", ("hier", "HIER"),
            ["--radial-calibration", "1", "--ms-similarity", "cosine"]),
        # the Poincaré distance as MultiSimilarity's similarity (distances.PoincareSimilarity, T = 2·clip_r)
        Row("hms", f"MultiSimilarity + miner on the Poincaré similarity 1 − d/{2 * DEFAULT_CLIP_R:g} + "
            f"{calibration:g}·radial calibration, head warm-started from the features' PCA whitening (c=0.1; "
            "recipes/hier.py, no HIER)",
            ("hier", "HIER"), HMS),
        Row("hms_whiten", f"hms with the head warm-started from the PCA whitening of the training features "
            f"(--head-init whiten, scale {DEFAULT_HEAD_INIT_SCALE:g}; the recipe's default since 2026-11-28, so hms "
            "itself from then on)", ("hier", "HIER"), HMS + WHITEN),
        Row("hms_random", "hms from the head's random init (--head-init random: the hms row up to 2026-11-28, "
            "commit 81c28d8)", ("hier", "HIER"), HMS + ["--head-init", "random"]),
        Row("hms_t_clip", f"MultiSimilarity + miner on the Poincaré similarity 1 − d/{DEFAULT_CLIP_R:g} (T = clip_r, "
            f"half the default) + {calibration:g}·radial calibration (c=0.1; recipes/hier.py)", ("hier", "HIER"),
            HMS + ["--ms-scale", f"{DEFAULT_CLIP_R:g}"]),
        Row("hms_nocal", f"MultiSimilarity + miner on the Poincaré similarity 1 − d/{2 * DEFAULT_CLIP_R:g}, no radial "
            "calibration (c=0.1; recipes/hier.py)", ("hier", "HIER"),
            HMS + ["--radial-calibration", "0"]),
        Row("hms_parent", f"MultiSimilarity + miner on the Poincaré similarity 1 − d/{2 * DEFAULT_CLIP_R:g} + "
            f"{calibration:g}·radial calibration + {PARENT_WEIGHT:g}·MultiSimilarity on the parent labels "
            f"(ParentLabelLoss; recipes/hier.py --parent-weight {PARENT_WEIGHT:g})", ("hier", "HIER"),
            HMS + ["--parent-weight", f"{PARENT_WEIGHT:g}"]),
        Row("hms_parent_0.3", "hms_parent with weight 0.3 on the parent term (validation: more tree-faithful "
            "distances, lower R@1)", ("hier", "HIER"),
            HMS + ["--parent-weight", "0.3"]),
        Row("ms_parent", f"PML MultiSimilarityLoss + miner (cosine) + {PARENT_WEIGHT:g}·the same on the parent labels "
            "(ParentLabelLoss on the sphere: the control of hms_parent)", "baseline",
            ["--pml-loss", "ms", "--parent-weight", f"{PARENT_WEIGHT:g}"]),
        Row("ms_whiten", "PML MultiSimilarityLoss + miner (cosine) from the same warm-started head as hms "
            "(the control of its warm start)", "baseline", ["--pml-loss", "ms"] + WHITEN),
        Row("supcon_ball", f"PML SupConLoss (τ=0.1) on the Poincaré similarity 1 − d/{2 * DEFAULT_CLIP_R:g} (polar head, "
            "c=0.1, no calibration)", "baseline_ball", ["--pml-loss", "supcon", "--radial-calibration", "0"]),
        # = hier_ms since 8a53977 (the flag explicit: the row that chose it, docs/design/records.md)
        Row("hier_hms", "HIER: MultiSimilarity on the Poincaré similarity + 0.3·HIER + 0.03·radial calibration "
            "(recipes/hier.py --ms-similarity poincare)", ("hier", "HIER"), ["--ms-similarity", "poincare"]),
        Row("hier_pa", "HIER: ProxyAnchor + 0.3·HIER + 0.03·radial calibration (128 proxies, c=0.1; HIER's "
            "public scripts' main loss)", ("hier", "HIER"), ["--main-loss", "pa"]),
        Row("hypmix", "HypMix (λ=3, τe=0.05, τh=0.2, c=0.1)", ("hyp_mix", "HypMix"),
            ["--lam", "3", "--tau-e", "0.05", "--tau-h", "0.2"]),
        Row("hypmix_learn", "HypMix, learnable λ (init 3)", ("hyp_mix", "HypMix"),
            ["--lam", "3", "--tau-e", "0.05", "--tau-h", "0.2", "--learnable-lambda"]),
        # The bank holds backbone activations, not images: the recipe's --degraded-copies (image
        # degradations inside the training step) cannot run on it; bench/radius.py measures them.
        Row("uml_tau", "Hyp-UML adaptive τ (sound U, default; + calibration, no degraded copies; head warm-started "
            "from the features' PCA whitening, the recipe's bundled-data default)", uml, NO_COPIES),
        Row("uml_tau_random", "uml_tau from the head's random init (--head-init random: the uml_tau row up to "
            "2026-11-28, commit 3819751)", uml, NO_COPIES + ["--head-init", "random"]),
        Row("uml_tau_lit", "Hyp-UML adaptive τ (literal U)", uml, ["--uncertainty-mode", "literal"] + NO_COPIES),
        Row("uml_margin", "Hyp-UML adaptive margin triplet (sound U)", uml, ["--loss", "triplet"] + NO_COPIES),
        Row("uml_margin_lit", "Hyp-UML adaptive margin triplet (literal U)", uml,
            ["--loss", "triplet", "--uncertainty-mode", "literal"] + NO_COPIES),
        # --head-lr: the recipe's glyph value for this loss (chosen on validation carves), which the bench
        # budget's own --head-lr would otherwise replace
        Row("hier_margin", f"Hierarchical margin (supervised, triplet form, γ=0.05, c=0.1, head lr "
            f"{HIER_MARGIN_GLYPH_HEAD_LR:g})", ("unsupervised_hyperbolic", "UnsupervisedHyperbolic"),
            ["--supervised", "--head-lr", f"{HIER_MARGIN_GLYPH_HEAD_LR:g}"]),
        Row("hier_margin_low_lr", "Hierarchical margin (supervised, triplet form, γ=0.05, c=0.1), head lr 3e-5 (chosen "
            "on validation carves at the held-out protocol's 600 steps)", ("unsupervised_hyperbolic",
                                                                           "UnsupervisedHyperbolic"),
            ["--supervised", "--head-lr", "3e-5"]),
        Row("unsup_logratio", "Unsupervised: pseudo-labels (512 ward clusters, whitened features) + log-ratio (Ω=1.2), "
            "whitening-initialised head",
            ("unsupervised_hyperbolic", "UnsupervisedHyperbolic")),
        Row("unsup_kmeans", "Unsupervised baseline: k-means pseudo-labels + PML TripletMarginLoss", "baseline",
            ["--pml-loss", "triplet", "--kmeans-pseudo-labels", str(UNSUP_KMEANS_K)], kind="recluster"),
        # --lr / --hyperbolic-weight / --view-augmentation: the recipe's glyph values (chosen on validation by
        # bench/hcl_validation.py); the bench budget's own --lr would otherwise replace the rate
        Row("hcl", f"HCL on composed glyph scenes (MoCo + {HCL_GLYPH_HYPERBOLIC_WEIGHT:g}·hyperbolic, c=0.05, trunk lr "
            f"{HCL_GLYPH_TRUNK_LR:g}, {HCL_GLYPH_VIEW_AUGMENTATION} views)", ("hcl", "HCL"),
            hcl_argv + ["--view-augmentation", HCL_GLYPH_VIEW_AUGMENTATION], kind="hcl"),
    ]
    for views in ("crop", "font"):
        if views != HCL_GLYPH_VIEW_AUGMENTATION:
            rows.append(Row(f"hcl_{views}", f"HCL, {views} views (otherwise the hcl row)", ("hcl", "HCL"),
                            hcl_argv + ["--view-augmentation", views], kind="hcl"))
    return {r.key: r for r in rows}


UNSUP_KMEANS_K = 100
PARENT_WEIGHT = 0.05  # chosen on validation carves of the three development domains (docs/design/losses.md)
ROWS = build_rows()
QUICK_ROWS = [k for k, r in ROWS.items() if r.kind != "hcl"]

# The held-out benchmark's protocol (the default of ``python -m bench quality``): frozen ImageNet
# EfficientNet-Lite0 features, a 128-d head, batch 256 = 64 classes x 4, AdamW 1e-3, 600 steps, seeds 0-4,
# on every development domain (every bank dataset with a parent level; Fashion-MNIST has none).
HELDOUT_PROTOCOL = {"backbone": "tf_efficientnet_lite0", "trainable": "head", "embedding_dim": 128,
                    "batch_size": 256, "samples_per_class": 4, "lr_tail": 1e-3, "lr_head": 1e-3, "steps": 600,
                    "seeds": (0, 1, 2, 3, 4)}
HELDOUT_ROWS = ("supcon", "ms", "hypvit", "hms_nocal", "hms", "hms_random", "ms_whiten", "hms_t_clip", "hier_ms",
                "hms_parent", "ms_parent", "supcon_ball")
BASELINES = ("supcon", "ms")  # PML's losses on the sphere: a row is compared with the better of them
NOT_RECOMMENDED = ("supcon_ball",)  # ball rows measured to show a failure (the docs advise against them)
DEVELOPMENT_DOMAINS = tuple(d for d in qc.BANK_DATASETS if d != "fashion-mnist")
PROTOCOLS = ("heldout", "tail")


def row_option(row, flag, default=None):
    """The value a row's argv gives ``flag`` (the last one, as argparse reads it), else ``default``."""
    values = [row.argv[i + 1] for i, a in enumerate(row.argv[:-1]) if a == flag]
    return values[-1] if values else default


def recipe_class(row):
    if row.recipe == "baseline":
        return rr.PMLBaseline
    if row.recipe == "baseline_ball":
        return rr.PMLBallBaseline
    return rr.load_recipe_class(*row.recipe)


# ------------------------------------------------------------------------------------------ HCL


def build_hcl_bank(cfg, n_scenes, log=print, glyphs=None, tag="", view_augmentation="crop"):
    """Prefix activations of (scene, object view 1, object view 2) for ``n_scenes`` composed scenes,
    cached. ``glyphs``: the images the scenes are composed from (default: every training glyph);
    ``tag`` names another choice in the cache key (``bench/hcl_validation.py``'s training characters);
    ``view_augmentation``: how the object views are augmented (``ComposedGlyphScenes``'s
    ``glyph_augmentation``; each view is drawn once and kept, like the bank's other views)."""
    from pml_hyperbolic.data import GlyphDataset
    from pml_hyperbolic.training.scene_objects import ComposedGlyphScenes

    # "crop" banks keep the key they had before the augmentation was a choice
    views = "" if view_augmentation == "crop" else f"|views={view_augmentation}"
    path = qc._cache_path(cfg, "hcl", f"scenes{n_scenes}" + (f"|{tag}" if tag else "") + views)
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    prefix, _, _ = qc.split_backbone(cfg.backbone)
    glyphs = GlyphDataset("train") if glyphs is None else glyphs
    scenes = ComposedGlyphScenes(glyphs, num_scenes=n_scenes, image_size=cfg.image_size, seed=0,
                                 glyph_augmentation=view_augmentation)
    log(f"[bank] HCL: {n_scenes} composed scenes x (scene + 2 {view_augmentation} object views) through the "
        "frozen prefix ...")
    torch.manual_seed(2024)
    out = {"scene": [], "view_q": [], "view_k": []}
    with torch.no_grad():
        for start in range(0, n_scenes, 128):
            items = [scenes[i] for i in range(start, min(n_scenes, start + 128))]
            for j, key in enumerate(("scene", "view_q", "view_k")):
                out[key].append(prefix(torch.stack([it[j] for it in items])))
    out = {k: torch.cat(v) for k, v in out.items()}
    os.makedirs(cfg.cache_dir, exist_ok=True)
    torch.save(out, path)
    return out


def hcl_bank_for(cfg, bank, log=print, view_augmentation="crop"):
    """The HCL scene bank at the depth the run trains from (pooled when only the head trains)."""
    out = build_hcl_bank(cfg, cfg.hcl_scenes, log=log, view_augmentation=view_augmentation)
    if cfg.trainable == "head":
        _, tail, _ = qc.split_backbone(cfg.backbone)
        out = {k: qc._through(tail, v) for k, v in out.items()}
    return out


# ------------------------------------------------------------------------------------- running


HIERARCHY_KEYS = ("parent_r1", "spearman", "auroc_fail", "d0_med", "at_clip")
HIERARCHY_NAMES = {"parent_r1": "parent R@1", "spearman": "Spearman", "auroc_fail": "AUROC fail",
                   "d0_med": "d₀ median", "at_clip": "% at clip"}


def dataset_parents(bank):
    """(query, gallery) parent labels of the bank's test splits (the hierarchy's parent level: a glyph's
    radical, an icon's context), as ``build_bank`` stores them from the dataset's ``super_labels``; None
    when the dataset has no parents or no separate gallery (the hierarchy columns are then left out).
    Banks cached before the parents were stored fall back to the bundled glyph splits."""
    if bank.gallery is None:
        return None
    if bank.query.super_labels is not None and bank.gallery.super_labels is not None:
        return bank.query.super_labels, bank.gallery.super_labels
    return _glyph_parents_from_dataset(bank) if bank.dataset == "glyphs" else None


def _glyph_parents_from_dataset(bank):
    from pml_hyperbolic.data import GlyphDataset

    out = []
    for name, split in (("query", bank.query), ("gallery", bank.gallery)):
        data = GlyphDataset(name)
        labels, parents = np.asarray(data.labels), np.asarray(data.super_labels)
        mine = split.labels.numpy()
        keep = np.isin(labels, np.unique(mine))
        if keep.sum() != len(mine) or not np.array_equal(labels[keep], mine):
            return None
        out.append(torch.as_tensor(parents[keep]))
    return tuple(out)


def clip_share(embeddings, geometry) -> float:
    """Share of ``embeddings`` at the clip radius, as ``pml_hyperbolic.evaluation.radius_health`` counts
    it (d₀ within its relative tolerance of the geometry's largest radius); 0 when none are."""
    from pml_hyperbolic.evaluation.radius_health import radius_collapse

    report = radius_collapse(torch.as_tensor(embeddings).float(), geometry, clip_fraction=0.0, what="test queries")
    return 0.0 if report is None or report.fraction_at_clip is None else float(report.fraction_at_clip)


def hierarchy_metrics(q, ql, g, gl, c, max_d0, parents):
    """``bench/radius.py``'s columns for one evaluation: parent R@1, Spearman(distance, tree distance),
    and for a hyperbolic head the failure AUROC of −d₀, the median d₀ and the fraction at the clip."""
    from bench.radius import radius_metrics

    q_parent, g_parent = parents
    if len(q_parent) != len(ql) or len(g_parent) != len(gl):
        raise RuntimeError("the parent labels do not match the bank's test splits; rerun with --no-cache")
    out = radius_metrics(q.float(), torch.as_tensor(ql), g.float(), torch.as_tensor(gl), c, max_d0, q_parent, g_parent)
    keep = {"parent_r1": out["parent_r1"], "spearman": out["spearman"]}
    if c is not None:
        keep.update(auroc_fail=out["auroc_fail"], d0_med=float(out["d0_med"]), at_clip=out["at_clip"])
    return keep


def run_row(row, cfg, bank, seed, hcl_bank=None, log=print, parents=None):
    """Train one row with one seed through its recipe (``_recipe_rows``); return its metrics on the
    held-out classes (+ extras). ``parents``: (query, gallery) parent labels, for the hierarchy columns."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    extra = {}
    if row.kind == "raw":
        # qc.evaluate's two steps, so that the hierarchy columns reuse the embeddings
        q = qc.embed(bank.tail, None, bank.query.acts)
        g = None if bank.gallery is None else qc.embed(bank.tail, None, bank.gallery.acts)
        metrics = qc.retrieval_metrics(q, bank.query.labels, g, None if g is None else bank.gallery.labels, c=None)
        if parents is not None:
            metrics.update(hierarchy_metrics(q, bank.query.labels, g, bank.gallery.labels, None, np.inf, parents))
        return metrics, extra
    argv = list(row.argv)
    train_set = None
    if row.kind == "hcl":
        if hcl_bank is None:
            raise RuntimeError("HCL needs its scene bank")
        argv += ["--queue-size", str(cfg.hcl_queue)]
        train_set = rr.HCLBankScenes(hcl_bank)
    elif row.kind == "recluster":  # pseudo-labels refreshed at every epoch start: one epoch per refresh
        epochs = max(1, cfg.steps // cfg.recluster_every)
        argv += ["--epochs", str(epochs), "--steps-per-epoch", str(cfg.steps // epochs)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the literal Hyp-UML mode warns on every call, by design
        metrics, recipe = rr.run_recipe_row(recipe_class(row), bank, cfg, seed, argv, train_set=train_set)
    captured = recipe.evaluator.last_embeddings
    c = recipe.eval_curvature()
    geometry = getattr(recipe, "geometry", None)
    if parents is not None:
        max_d0 = float(geometry.max_dist0()) if c is not None and geometry is not None else np.inf
        metrics.update(hierarchy_metrics(captured[0], captured[1], captured[2], captured[3], c, max_d0, parents))
    if c is not None and geometry is not None:  # every ball row: the radius_health count of the test queries
        metrics["at_clip"] = clip_share(captured[0], geometry)
    loss = recipe.trainer.loss_funcs.get("metric_loss")
    lam = getattr(getattr(loss, "distance", None), "lam", None)
    if row.key == "hypmix_learn" and lam is not None:
        extra["final_lambda"] = float(torch.as_tensor(lam).detach().reshape(-1)[0])
    return metrics, extra


def with_fewer_training_classes(bank, keep, log=print):
    """``bank`` training on ``keep`` of its training classes (the rest dropped as
    ``qc.carve_validation`` carves them, carve seed 0); query and gallery untouched."""
    total = int(bank.train.labels.unique().numel())
    if not 2 <= keep <= total:
        raise SystemExit(f"--train-classes must be in [2, {total}] (the bank's training classes), got {keep}")
    if keep == total:
        return bank
    train, _, _ = qc.carve_validation(bank, total - keep, seed=0)
    log(f"[bank] training on {keep} of the {total} training classes (carve seed 0); test split unchanged")
    return dataclasses.replace(bank, train=train)


def run_table(cfg, rows, datasets, fashion_root=None, log=print, use_cache=True, max_classes=None,
              train_classes=None, progress=None):
    """Run every (dataset, row, seed); returns the results dict (also what ``--out`` writes).
    ``train_classes``: train on that many of the training classes (a seeded choice, carve seed 0;
    the test split unchanged), to see how a method depends on the number of training classes.
    ``progress``: called with the results so far after every row (``--out`` keeps a long run's finished rows)."""
    results = {"config": qc.config_dict(cfg), "datasets": {}, "notes": []}
    for name in datasets:
        if name == "fashion-mnist" and qc.find_fashion_mnist(fashion_root) is None:
            msg = ("Fashion-MNIST skipped: Debian's dataset-fashion-mnist is not installed "
                   "(apt-get install dataset-fashion-mnist, or --fashion-root DIR with the idx files)")
            log(msg)
            results["notes"].append(msg)
            continue
        t0 = time.perf_counter()
        bank = qc.build_bank(cfg, name, fashion_root=fashion_root, use_cache=use_cache, log=log,
                             max_classes=max_classes)
        if cfg.trainable == "head":
            bank = qc.pooled_bank(bank, cfg, use_cache=use_cache)
        if train_classes is not None:
            bank = with_fewer_training_classes(bank, train_classes, log=log)
        log(f"[bank] {name}: {'loaded from cache' if bank.from_cache else 'built'} "
            f"(build took {bank.build_seconds:.0f} s; this run {time.perf_counter() - t0:.0f} s). {bank.note}")
        hcl_banks = {}  # view augmentation -> scene bank
        parents = dataset_parents(bank)
        ds = {"note": bank.note, "bank_from_cache": bank.from_cache, "bank_build_s": bank.build_seconds, "rows": {}}
        for key in rows:
            row = ROWS[key]
            hcl_bank = None
            if row.kind == "hcl":
                if name != "glyphs":
                    ds["rows"][key] = {"label": row.label, "skipped": "HCL scenes are composed from glyphs only"}
                    continue
                views = row_option(row, "--view-augmentation", "crop")
                if views not in hcl_banks:
                    hcl_banks[views] = hcl_bank_for(cfg, bank, log=log, view_augmentation=views)
                hcl_bank = hcl_banks[views]
            per_seed, extras, t_row = [], [], time.perf_counter()
            seeds = [cfg.seeds[0]] if row.kind == "raw" else list(cfg.seeds)
            for seed in seeds:
                ts = time.perf_counter()
                metrics, extra = run_row(row, cfg, bank, seed, hcl_bank=hcl_bank, log=log, parents=parents)
                per_seed.append(metrics)
                extras.append(extra)
                log(f"  {name:13s} {key:15s} seed {seed}: R@1 {100 * metrics['recall_at_1']:5.1f}  "
                    f"MAP@R {100 * metrics['mean_average_precision_at_r']:5.1f}  ({time.perf_counter() - ts:.0f} s)"
                    + (f"  {extra}" if extra else ""))
            ds["rows"][key] = {"label": row.label, "per_seed": per_seed, "seeds": seeds, "extras": extras,
                               "seconds": time.perf_counter() - t_row}
            results["datasets"][name] = ds
            if progress is not None:
                progress(results)
        results["datasets"][name] = ds
    return results


def paired_cell(values, reference) -> str:
    """Mean ± standard error of the per-run differences ``values − reference`` (the same carves
    and seeds in the same order), e.g. ``+1.2 ± 0.8``."""
    values, reference = np.asarray(values, float), np.asarray(reference, float)
    if values.shape != reference.shape or values.size < 2:
        raise ValueError(f"paired runs must match and be at least 2, got {values.shape} and {reference.shape}")
    diff = values - reference
    return f"{diff.mean():+.1f} ± {diff.std(ddof=1) / np.sqrt(diff.size):.1f}"


def paired_lines(results, reference):
    """For ``--paired-to``: each row's R@1 minus the ``reference`` row's, seed by seed (same seeds:
    the same bank and sampler draws), as mean ± standard error and the number of seeds it is higher on."""
    lines = []
    for name, ds in results["datasets"].items():
        ref = ds["rows"].get(reference)
        if ref is None or "per_seed" not in ref:
            continue
        base = 100 * np.array([m["recall_at_1"] for m in ref["per_seed"]])
        for key, r in ds["rows"].items():
            if key == reference or "per_seed" not in r or r["seeds"] != ref["seeds"] or len(base) < 2:
                continue
            r1 = 100 * np.array([m["recall_at_1"] for m in r["per_seed"]])
            lines.append(f"{name}: {key} − {reference} R@1 {paired_cell(r1, base)} (paired over seeds "
                         f"{','.join(map(str, r['seeds']))}; higher on {int((r1 > base).sum())} of {len(base)})")
    return lines


def _mean_sd(values):
    values = np.asarray(values, float)
    return float(values.mean()), float(values.std(ddof=1)) if values.size > 1 else 0.0


def _per_seed(row, key, scale=100.0):
    values = [m.get(key) for m in row.get("per_seed", [])]
    return None if not values or any(v is None for v in values) else scale * np.asarray(values, float)


def _paired(row, reference, key, scale=100.0):
    """(row − reference) over the seeds both ran (the same seed: the same bank views and batches), or None
    when fewer than two seeds are shared or a value is missing."""
    a, b = _per_seed(row, key, scale), _per_seed(reference, key, scale)
    if a is None or b is None:
        return None
    mine, theirs = dict(zip(row["seeds"], a)), dict(zip(reference["seeds"], b))
    common = [s for s in row["seeds"] if s in theirs]
    return np.array([mine[s] - theirs[s] for s in common]) if len(common) > 1 else None


def paired_summary(results, baselines=BASELINES):
    """One flat row per (domain, method): R@1 mean and sd over seeds; its per-seed difference to the best
    PML baseline of that domain (the one of ``baselines`` with the higher mean R@1), over the seeds both
    ran, as mean and sd, and the seeds it is higher on; parent R@1 and Spearman with
    their paired differences to SupCon's; the % of test queries at the clip radius for a ball row."""
    out = []
    for name, ds in results["datasets"].items():
        rows = {k: r for k, r in ds["rows"].items() if "per_seed" in r}
        have = [b for b in baselines if b in rows]
        best = max(have, key=lambda b: _per_seed(rows[b], "recall_at_1").mean()) if have else None
        supcon = rows.get("supcon")
        for key, r in rows.items():
            r1 = _per_seed(r, "recall_at_1")
            mean, sd = _mean_sd(r1)
            item = {"dataset": name, "row": key, "seeds": len(r1), "R@1": round(mean, 2), "R@1 sd": round(sd, 2),
                    "per_seed_r1": [round(v, 2) for v in r1]}
            diff = None if best is None or key == best else _paired(r, rows[best], "recall_at_1")
            if diff is not None:
                item.update({"best baseline": best, "ΔR@1": round(float(diff.mean()), 2),
                             "ΔR@1 sd": round(float(diff.std(ddof=1)), 2),
                             "seeds won": f"{int((diff > 0).sum())}/{diff.size}"})
            for key_, label, scale in (("parent_r1", "parent R@1", 100.0), ("spearman", "Spearman", 1.0)):
                values = _per_seed(r, key_, scale)
                if values is None:
                    continue
                item[label] = round(float(values.mean()), 3 if scale == 1.0 else 2)
                delta = None if supcon is None or key == "supcon" else _paired(r, supcon, key_, scale)
                if delta is not None:
                    item[f"Δ{label} vs supcon"] = round(float(delta.mean()), 3 if scale == 1.0 else 2)
            clip = _per_seed(r, "at_clip")
            if clip is not None:
                item["% at clip"] = round(float(clip.mean()), 1)
            out.append(item)
    return out


SUMMARY_COLUMNS = (("R@1", "{R@1:.1f} ± {R@1 sd:.1f}"), ("Δ R@1 vs best PML (paired)", "{ΔR@1:+.1f} ± {ΔR@1 sd:.1f}"),
                   ("seeds won", "{seeds won}"), ("parent R@1", "{parent R@1:.1f}"),
                   ("Δ parent R@1 vs SupCon", "{Δparent R@1 vs supcon:+.1f}"), ("Spearman", "{Spearman:.3f}"),
                   ("Δ Spearman vs SupCon", "{ΔSpearman vs supcon:+.3f}"), ("% at clip", "{% at clip:.1f}"))


def summary_markdown(summary):
    """The paired table of :func:`paired_summary`, one Markdown table per domain (— where a cell does
    not apply: the baseline itself, a sphere row's clip share, a domain without parents)."""
    lines = []
    for name in dict.fromkeys(item["dataset"] for item in summary):
        items = [i for i in summary if i["dataset"] == name]
        best = next((i["best baseline"] for i in items if "best baseline" in i), "—")
        lines += [f"\n**{name}** (paired over seeds, mean ± sd of the per-seed differences; best PML baseline: "
                  f"{best})\n", "| row | " + " | ".join(h for h, _ in SUMMARY_COLUMNS) + " |",
                  "|---|" + "---:|" * len(SUMMARY_COLUMNS)]
        for item in items:
            cells = []
            for _, fmt in SUMMARY_COLUMNS:
                try:
                    cells.append(fmt.format(**item))
                except KeyError:
                    cells.append("—")
            lines.append(f"| {item['row']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def target_lines(summary, baselines=BASELINES):
    """The targets, per domain, read off the paired summary: the best ball row's R@1 margin over the best
    PML baseline (target ≥ +1), its parent R@1 and Spearman against SupCon's (target ≥ 0), and the
    largest clip share of a ball row other than SupCon on the ball (target ≤ 50%)."""
    lines = []
    for name in dict.fromkeys(item["dataset"] for item in summary):
        items = {i["row"]: i for i in summary if i["dataset"] == name}
        ball = [i for k, i in items.items() if "% at clip" in i and k not in baselines + NOT_RECOMMENDED
                and "ΔR@1" in i]
        if not ball:
            continue
        top = max(ball, key=lambda i: i["ΔR@1"])
        parts = [f"{name}: best ball row {top['row']} {top['ΔR@1']:+.1f} R@1 over {top['best baseline']} "
                 f"(target ≥ +1: {'met' if top['ΔR@1'] >= 1 else 'NOT met'})"]
        for label in ("parent R@1", "Spearman"):
            key = f"Δ{label} vs supcon"
            if key in top:
                digits = 3 if label == "Spearman" else 1
                parts.append(f"{label} {top[key]:+.{digits}f} vs SupCon ({'met' if top[key] >= 0 else 'NOT met'})")
        recommended = [i for k, i in items.items() if "% at clip" in i and k not in NOT_RECOMMENDED]
        worst = max(recommended, key=lambda i: i["% at clip"])
        parts.append(f"largest clip share of a recommended ball row {worst['% at clip']:.1f}% ({worst['row']}; "
                     f"{'met' if worst['% at clip'] <= 50 else 'NOT met'})")
        lines.append("; ".join(parts))
    return lines


def markdown_table(results):
    lines = []
    for name, ds in results["datasets"].items():
        lines.append(f"\n**{name}** — {ds['note']}\n")
        hier = [k for k in HIERARCHY_KEYS if any(k in m for r in ds["rows"].values() for m in r.get("per_seed", []))]
        lines.append("| method | " + " | ".join([qc.METRIC_NAMES[k] for k in qc.METRIC_KEYS]
                                              + [HIERARCHY_NAMES[k] for k in hier]) + " | s/seed |")
        lines.append("|---|" + "---:|" * (len(qc.METRIC_KEYS) + len(hier) + 1))
        for key, r in ds["rows"].items():
            if "skipped" in r:
                lines.append(f"| {r['label']} | " + " | ".join("—" for _ in qc.METRIC_KEYS + tuple(hier))
                             + f" | {r['skipped']} |")
                continue
            cells = [qc.fmt_cell([m[k] for m in r["per_seed"]]) for k in qc.METRIC_KEYS]
            for k in hier:
                values = [m[k] for m in r["per_seed"] if k in m]
                if not values:
                    cells.append("—")
                elif k in ("parent_r1", "at_clip"):
                    cells.append(qc.fmt_cell(values))
                else:
                    digits = 2 if k == "d0_med" else 3
                    spread = f" ± {np.std(values):.{digits}f}" if len(values) > 1 else ""
                    cells.append(f"{np.mean(values):.{digits}f}{spread}")
            label = r["label"]
            lams = [e["final_lambda"] for e in r["extras"] if "final_lambda" in e]
            if lams:
                label += f" (final λ {np.mean(lams):.2f})"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {r['seconds'] / len(r['seeds']):.0f} |")
    for note in results["notes"]:
        lines.append(f"\nNote: {note}")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=PROTOCOLS, default="heldout",
                   help="heldout (default): the held-out benchmark's protocol -- frozen tf_efficientnet_lite0 "
                        "features, 128-d head only, batch 256 = 64 x 4, AdamW 1e-3, 600 steps, seeds 0-4, the "
                        f"rows {','.join(HELDOUT_ROWS)} on every development domain ({','.join(DEVELOPMENT_DOMAINS)}) "
                        "with the paired table; tail: the MobileNetV2 tail protocol (last block trains, 120 steps, "
                        "3 seeds, every row, glyphs + Fashion-MNIST). Flags below override either.")
    p.add_argument("--quick", action="store_true",
                   help="1 seed, 100 steps, 2-view bank, head-only training, all rows but HCL (~5 min).")
    p.add_argument("--rows", default=None, help=f"comma-separated subset of {list(ROWS)}")
    p.add_argument("--datasets", default=None,
                   help=f"comma-separated, of {', '.join(qc.BANK_DATASETS)} (fashion-mnist skipped with a note when not "
                        "installed); default: every development domain (heldout), glyphs,fashion-mnist (tail)")
    p.add_argument("--fashion-root", default=None, help="folder with the Fashion-MNIST idx files")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0-4 heldout, 0,1,2 tail; --quick 0)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--views", type=int, default=None, help="bank views per training image (1 clean + rest augmented)")
    p.add_argument("--recluster-every", type=int, default=None, help="unsupervised rows: steps between pseudo-labelings")
    p.add_argument("--backbone", default=None, help="mobilenetv2_100 (default) or tf_efficientnet_lite0")
    p.add_argument("--trainable", choices=("tail", "head"), default=None,
                   help="tail: last block + conv_head + head (default); head: embedding head only (--quick)")
    p.add_argument("--train-classes", type=int, default=None,
                   help="train on this many of the training classes (diagnostic: how a method depends on the "
                        "number of training classes; the test split is unchanged; HCL's scenes keep every class)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 2)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate of the head (and of the tail)")
    p.add_argument("--paired-to", default=None, metavar="ROW",
                   help="also print every row's R@1 minus this row's, paired seed by seed (mean ± s.e.)")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--no-cache", action="store_true", help="recompute the feature banks and do not store them")
    p.add_argument("--out", default=None, help="write all per-seed results as JSON")
    return p.parse_args(argv)


def config_from_args(a):
    cfg = qc.BenchConfig()
    if a.protocol == "heldout" and not a.quick:
        for attr, value in HELDOUT_PROTOCOL.items():
            setattr(cfg, attr, value)
    if getattr(a, "lr", None) is not None:
        cfg.lr_tail = cfg.lr_head = a.lr
    if a.quick:
        cfg.steps, cfg.seeds, cfg.views, cfg.recluster_every, cfg.hcl_scenes = 100, (0,), 2, 50, 512
        cfg.trainable = "head"
    for name, attr in (("steps", "steps"), ("batch_size", "batch_size"), ("image_size", "image_size"),
                       ("views", "views"), ("backbone", "backbone"), ("trainable", "trainable"),
                       ("recluster_every", "recluster_every"), ("threads", "threads"),
                       ("cache_dir", "cache_dir")):
        if getattr(a, name) is not None:
            setattr(cfg, attr, getattr(a, name))
    if a.seeds is not None:
        cfg.seeds = tuple(int(s) for s in a.seeds.split(","))
    return cfg


def main(argv=None):
    a = parse_args(argv)
    cfg = config_from_args(a)
    qc.set_threads(cfg.threads)
    heldout = a.protocol == "heldout" and not a.quick
    rows = a.rows.split(",") if a.rows else (QUICK_ROWS if a.quick else list(HELDOUT_ROWS) if heldout else list(ROWS))
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise SystemExit(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if a.paired_to is not None and (a.paired_to not in rows or len(cfg.seeds) < 2):
        raise SystemExit(f"--paired-to needs one of the run's rows {rows} and at least 2 seeds, got "
                         f"{a.paired_to!r} with {len(cfg.seeds)} seed(s)")
    if a.datasets is None:
        a.datasets = ",".join(DEVELOPMENT_DOMAINS) if heldout else "glyphs,fashion-mnist"
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    unknown = [d for d in datasets if d not in qc.BANK_DATASETS]
    if unknown:
        raise SystemExit(f"unknown datasets {unknown}; choose from {list(qc.BANK_DATASETS)}")
    t0 = time.perf_counter()
    print(f"# bench/quality.py {'--quick ' if a.quick else f'--protocol {a.protocol} '}(pml-hyperbolic method comparison)")
    print(f"budget: {cfg.describe()}")
    print(f"machine: {qc.machine_line()}")
    print(f"rows: {rows}")
    def write_out(results):
        with open(a.out, "w") as fh:
            json.dump(results, fh, indent=1)

    results = run_table(cfg, rows, datasets, fashion_root=a.fashion_root, use_cache=not a.no_cache,
                        train_classes=a.train_classes, progress=write_out if a.out else None)
    wall = time.perf_counter() - t0
    results["wall_seconds"] = wall
    print(markdown_table(results))
    print(f"\nRecall@K / MAP@R in % on held-out classes (mean ± std over {len(cfg.seeds)} seed(s)); "
          f"hyperbolic heads: exact Poincaré kNN at c={HYP_C}; others: cosine. "
          f"Total wall time {wall:.0f} s; {qc.machine_line()}.")
    if a.paired_to is not None:
        print("\n" + "\n".join(paired_lines(results, a.paired_to)))
    summary = paired_summary(results)
    if len(cfg.seeds) > 1:
        print(summary_markdown(summary))
        print("\nTargets (test classes, checked here, chosen on validation carves):\n" + "\n".join(target_lines(summary)))
    if a.out:
        write_out(results)
        print(f"results written to {a.out}")
    return summary


if __name__ == "__main__":
    main()
