"""The papers' settings of every recipe, in one place (recipes are configuration and import these).

Each dict maps a dataset name to the argument values the paper used; the recipes apply them when
the real dataset is found (``Recipe.paper_presets``). Sources: the papers and their public code;
docs/recipes/ compares each paper's presets with the bundled-data ones.

Design note: docs/design/recipe-defaults.md
"""
from __future__ import annotations

__all__ = ["HYP_VIT_PRESETS", "HYP_MIX_PRESETS", "HYP_UML_PRESETS", "PAPER_PSEUDO_LEVELS", "DEFAULT_PSEUDO_LEVELS",
           "PSEUDO_LABEL_LINKAGES", "PSEUDO_LABEL_SOURCES", "UNSUPERVISED_HEAD_INITS",
           "DEFAULT_UNSUPERVISED_HEAD_INIT", "DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE", "HEAD_INITS",
           "DEFAULT_HEAD_INIT_SCALE", "HCL_PAPER_HYPERBOLIC_WEIGHT",
           "HCL_GLYPH_TRUNK_LR", "HCL_GLYPH_HYPERBOLIC_WEIGHT", "HCL_GLYPH_QUEUE_SIZE", "HCL_GLYPH_CHOICE_COMMAND",
           "GLYPH_VIEW_AUGMENTATIONS", "HCL_GLYPH_VIEW_AUGMENTATION", "HIER_MARGIN_GLYPH_HEAD_LR",
           "UNSUPERVISED_BUNDLED_HEAD_LR"]

# Pseudo-label settings of the unsupervised method (used by ``training.pseudo_labels``, which explains
# how the defaults were chosen, and by the recipe's --help, which must not import torch).
PAPER_PSEUDO_LEVELS = (100, 70, 40, 10)   # Yan et al. Table 2, K = 4
DEFAULT_PSEUDO_LEVELS = (512,)            # chosen on the glyph validation split (training.pseudo_labels)
PSEUDO_LABEL_LINKAGES = ("ward", "average")
PSEUDO_LABEL_SOURCES = ("features", "features_then_embeddings", "embeddings")
# Warm start of a recipe's head (--head-init, ``training.pseudo_labels.whitening_head_init``):
# "random" = the head's own (semi-)orthogonal init (the papers'), "whiten" = PCA whitening of the
# training images' trunk outputs; the scale (in units of the random init's norm) sets the AdamW step's
# reach around it. Every recipe takes the flags; the unsupervised recipe's defaults were chosen with the
# levels above on the glyph validation split (training.pseudo_labels has the table), the HIER recipe's
# on validation carves of three domains (docs/design/heads.md).
HEAD_INITS = ("random", "whiten")
DEFAULT_HEAD_INIT_SCALE = 1.0  # = heads.whitening.DEFAULT_WHITENING_HEAD_INIT_SCALE (torch-free here)
UNSUPERVISED_HEAD_INITS = HEAD_INITS
DEFAULT_UNSUPERVISED_HEAD_INIT = "whiten"
DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE = 10.0

# HCL (Ge et al., CVPR'23). The paper weighs its hyperbolic scene->object loss 0.1 (the recipe's
# default with --annotations). On the bundled glyphs the trunk learning rate, that weight and the object
# views' augmentation were chosen on validation splits carved from the training characters (never the
# test characters); HCL_GLYPH_CHOICE_COMMAND reruns the comparison of the chosen setting with the other
# views. The figures are in docs/design/recipe-defaults.md.
HCL_PAPER_HYPERBOLIC_WEIGHT = 0.1
HCL_GLYPH_TRUNK_LR = 3e-5
HCL_GLYPH_HYPERBOLIC_WEIGHT = 0.1
# The bundled run is short (45 steps of 64 scenes): a queue of the paper's 65,536 keys never fills, so
# InfoNCE's loss grows with the queue and hides the learning; 512 keys fill in 8 steps. The trunk trains
# (the shared glyph preset freezes it, which would leave HCL's representation untouched).
HCL_GLYPH_QUEUE_SIZE = 512
# How HCL's two object views of a glyph are augmented (pml_hyperbolic.data.transforms.glyph_view_transform;
# the one list of choices is the data floor's, torch-free: the recipes' command line reads it here).
from ..data.registry import GLYPH_VIEW_AUGMENTATIONS  # noqa: E402 (defined by the data floor, re-exported here)
HCL_GLYPH_VIEW_AUGMENTATION = "crop"
HCL_GLYPH_CHOICE_COMMAND = ("python -m bench hcl_validation --threads 1 --lrs 3e-5 --weights 0.1 --views crop,font "
                            "--carve-seeds 0,1,2,3 --seeds 0,1,2 --top 2")

# Supervised hierarchical-margin loss (recipes/unsupervised_hyperbolic.py --supervised) on the bundled
# glyphs: the embedding head's learning rate, chosen on validation carves of the training characters
# (at the generic glyph head rate the head pushed every test query to the clip radius);
# docs/design/recipe-defaults.md has the figures.
HIER_MARGIN_GLYPH_HEAD_LR = 3e-4

# Unsupervised recipe (pseudo-labels) on the bundled data: the embedding head's learning rate, chosen on
# validation carves of the training classes of the glyphs, icons and Iconify sets at the bundled run's
# budget (at the generic glyph head rate the pseudo-label training lowered Recall@K below its warm start);
# docs/design/recipe-defaults.md has the figures.
UNSUPERVISED_BUNDLED_HEAD_LR = 1e-3

_VIT = {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "lr": 3e-5,
        "weight_decay": 0.01, "grad_clip": 3.0, "freeze_patch_embed": True, "amp": "auto", "curvature": 0.1,
        "clip_r": 2.3}

#: Hyp-ViT (Ermolov et al., CVPR'22): epochs × steps_per_epoch = the paper's step counts (an
#: evaluation + checkpoint after each epoch).
HYP_VIT_PRESETS = {
    "cub200": {**_VIT, "batch_size": 900, "samples_per_class": 9, "epochs": 10, "steps_per_epoch": 20,
               "k_values": [1, 2, 4, 8, 16, 32]},
    "cars196": {**_VIT, "batch_size": 882, "samples_per_class": 9, "epochs": 10, "steps_per_epoch": 60,
                "k_values": [1, 2, 4, 8, 16, 32]},
    "sop": {**_VIT, "batch_size": 900, "samples_per_class": 2, "epochs": 50, "steps_per_epoch": 500,
            "k_values": [1, 10, 100, 1000]},
    "inshop": {**_VIT, "batch_size": 900, "samples_per_class": 2, "epochs": 22, "steps_per_epoch": 100,
               "k_values": [1, 10, 20, 30, 40, 50]},
}

#: HypMix (Yue et al.): Hyp-ViT's training with τ_e = 0.05, τ_h = 0.2, λ = 3 on CUB and 8 on Cars and SOP.
HYP_MIX_PRESETS = {
    "cub200": {**HYP_VIT_PRESETS["cub200"], "lam": 3.0, "tau_e": 0.05, "tau_h": 0.2},
    "cars196": {**HYP_VIT_PRESETS["cars196"], "lam": 8.0, "tau_e": 0.05, "tau_h": 0.2},
    "sop": {**HYP_VIT_PRESETS["sop"], "lam": 8.0, "tau_e": 0.05, "tau_h": 0.2},
    "inshop": {**HYP_VIT_PRESETS["inshop"], "lam": 8.0, "tau_e": 0.05, "tau_h": 0.2},
}

#: Hyp-UML (Yan, Liu, Xu) on Cars196: ViT-S/16, contrastive batch 294 = 98 × 3 (the triplet variant
#: 194 = 97 × 2, applied by the recipe), AdamW lr 3e-5, wd 0.01, AMP.
HYP_UML_PRESETS = {
    "cars196": {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "batch_size": 294,
                "samples_per_class": 3, "lr": 3e-5, "weight_decay": 0.01, "amp": "auto", "curvature": 0.1,
                "clip_r": 2.3, "epochs": 300, "steps_per_epoch": None, "k_values": [1, 2, 4, 8, 16, 32]},
}
