#!/usr/bin/env python
"""Unsupervised hyperbolic metric learning (Yan et al., CVPR'21).

    python recipes/unsupervised_hyperbolic.py                       # bundled glyphs, no labels used
    python recipes/unsupervised_hyperbolic.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/unsupervised_hyperbolic.py --supervised          # hierarchical-margin variant

No label is used for training: the training set is clustered hierarchically into pseudo-labels
(``pml_hyperbolic.training.pseudo_labels.UnsupervisedPseudoLabels``: what is clustered, how, when)
and the hierarchical log-ratio loss (HierarchicalLogRatioLoss, Ω) is trained on them; the labels are
refreshed at the start of every epoch (a no-op by default: 512 Ward clusters of the PCA-whitened
pre-trained backbone features, computed once; ``--pseudo-source features_then_embeddings`` re-clusters
the learned embeddings). Before the first clustering the head's linear layer is warm-started as the
PCA whitening of the training images' trunk outputs, at 10× the random init's norm so that the
optimiser moves it in small steps (``--head-init whiten --head-init-scale 10``; the paper's random
head: ``--head-init random``). Defaults were chosen on a validation split of the bundled glyphs
(``bench/unsupervised_pseudo_labels.py --protocol recipe``; table in
``pml_hyperbolic/training/pseudo_labels.py``): val R@1 35.7 (seeds 0-9) vs 31.0 for the previous
defaults (random head, 128 clusters) and 30.2 for the pre-trained features; on the 160 test
characters ``python bench/quality.py --datasets glyphs --threads 1 --rows raw,unsup_logratio`` gives
18.4 ± 0.9 (19.5, 18.1, 17.7) vs 15.5 for the features, of which the warm start alone is 18.1. These
are glyph choices: on another dataset pass ``--levels`` for its size. The paper's setting is
``--paper-pseudo-labels --omega 10 --head-init random`` (average linkage, levels 100 70 40 10,
pre-trained features first, then the learned embeddings). With ``--supervised`` the real class
labels train the hierarchical-margin loss instead (no pseudo-labels, no warm start); on the bundled
glyphs its head then trains at ``--head-lr 3e-4`` (``presets.HIER_MARGIN_GLYPH_HEAD_LR``): at the glyph
default 3e-3, trained on all 160 characters, the head put every test query at the clip radius and
test R@1 ended level with the untrained features (chosen on 16- and 32-character validation
carves, ``bench/results/hier_margin_head_lr_stop25.txt``). Test labels are used only to report Recall@K.
"""

from pml_hyperbolic.training.cli import RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.config import finite_positive_float
from pml_hyperbolic.training.presets import DEFAULT_PSEUDO_LEVELS, PAPER_PSEUDO_LEVELS
from pml_hyperbolic.training.presets import PSEUDO_LABEL_LINKAGES as LINKAGES
from pml_hyperbolic.training.presets import PSEUDO_LABEL_SOURCES as SOURCES
from pml_hyperbolic.training.presets import DEFAULT_UNSUPERVISED_HEAD_INIT, DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE
from pml_hyperbolic.training.presets import HIER_MARGIN_GLYPH_HEAD_LR
from pml_hyperbolic.training.presets import UNSUPERVISED_HEAD_INITS as HEAD_INITS

PAPER = {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "batch_size": 120,
         "samples_per_class": 4, "lr": 3e-5, "epochs": 50, "steps_per_epoch": None, "curvature": 0.1}


class UnsupervisedHyperbolic(RecipeCommandLine):
    name = "unsupervised_hyperbolic"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = {"cub200": PAPER, "cars196": PAPER, "sop": PAPER}

    @classmethod
    def presets(cls, args):
        preset = super().presets(args)
        if args.supervised and cls.resolved_dataset(args) == "glyphs":
            # the margin loss's head rate, chosen on glyph validation carves (presets.HIER_MARGIN_GLYPH_HEAD_LR)
            preset["head_lr"] = HIER_MARGIN_GLYPH_HEAD_LR
        return preset

    @classmethod
    def runtime_mixins(cls):
        from pml_hyperbolic.training.pseudo_labels import PseudoLabelTraining  # the re-clustering loop

        return (PseudoLabelTraining,)

    def __init__(self, args):
        super().__init__(args)
        if not args.supervised:
            self.label_hierarchy_level = "all"   # the loss gets all K pseudo-label columns
        self._labels_step = None

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("unsupervised hyperbolic metric learning")
        g.add_argument("--supervised", action="store_true",
                       help="Train HierarchicalMarginLoss on the real labels instead of pseudo-labels.")
        g.add_argument("--levels", type=int, nargs="+", default=None,
                       help=f"Clusters per pseudo-label level, finest first (default {list(DEFAULT_PSEUDO_LEVELS)}; "
                            f"the paper's K = 4 setting: {' '.join(map(str, PAPER_PSEUDO_LEVELS))}).")
        g.add_argument("--linkage", choices=LINKAGES, default=None,
                       help="Agglomerative linkage of the pseudo-labels (default ward; the paper: average).")
        g.add_argument("--pseudo-source", choices=SOURCES, default=None,
                       help="What is clustered: the pre-trained backbone features once (default 'features'), "
                            "features first then the learned embeddings (the paper), or always the embeddings.")
        g.add_argument("--whiten", type=int, default=None,
                       help="PCA-whiten the backbone features to this many dimensions before clustering "
                            "(default 256; 0: no whitening). Independent of --head-init.")
        g.add_argument("--min-cluster-size", type=int, default=None,
                       help="Merge finest pseudo-classes smaller than this into the nearest one (default 4).")
        g.add_argument("--paper-pseudo-labels", action="store_true",
                       help="Yan et al.'s pseudo-labels (average linkage, levels 100 70 40 10, features then "
                            "embeddings); --levels/--linkage/... still override.")
        g.add_argument("--head-init", choices=HEAD_INITS, default=DEFAULT_UNSUPERVISED_HEAD_INIT,
                       help="Start of the embedding head's linear layer: 'random' (its (semi-)orthogonal init, "
                            "the paper) or 'whiten' (PCA whitening of the training images' trunk outputs, no "
                            "label used; chosen on glyph validation). Unused with --supervised.")
        g.add_argument("--head-init-scale", type=finite_positive_float, default=DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE,
                       help="--head-init whiten: the warm-started weight's norm, in units of the random init's; "
                            "larger = smaller optimiser steps around the warm start (chosen on glyph validation).")
        g.add_argument("--omega", type=float, default=1.2,
                       help="Ω > 1 of the log-ratio loss (default 1.2, the loss's default; the paper: 10).")
        g.add_argument("--gamma", type=float, default=0.05,
                       help="--supervised: margin offset γ (0.05: HierarchicalMarginLoss's default, chosen on validation; "
                            "the paper's contrastive form is HierarchicalMarginLoss(margin_form='contrastive', gamma=0.1)).")

    # ---- data: hide the labels ----
    def train_dataset(self, dataset):
        from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset

        return dataset if self.args.supervised else PseudoLabelledDataset(dataset)

    def pseudo_labels(self):
        """The recipe's pseudo-label policy (built once: it caches feature-based labels)."""
        if getattr(self, "_pseudo_policy", None) is None:
            from pml_hyperbolic.training.pseudo_labels import UnsupervisedPseudoLabels

            a = self.args
            kw = dict(UnsupervisedPseudoLabels.paper(c=self.geometry).config()) if a.paper_pseudo_labels else {}
            for key, value in (("levels", a.levels), ("linkage", a.linkage), ("source", a.pseudo_source),
                               ("whiten", a.whiten), ("min_cluster_size", a.min_cluster_size)):
                if value is not None:
                    kw[key] = tuple(value) if key == "levels" else (None if key == "whiten" and value == 0 else value)
            kw.update(c=self.geometry, seed=a.seed)
            self._pseudo_policy = UnsupervisedPseudoLabels(**kw)
        return self._pseudo_policy

    # ---- model / loss ----
    def build_loss(self):
        from pml_hyperbolic.distances import PoincareDistance

        if self.args.supervised:
            from pml_hyperbolic.losses import HierarchicalMarginLoss

            from pml_hyperbolic.training.runner import training_class_count

            return HierarchicalMarginLoss(num_classes=training_class_count(self.train_set), gamma=self.args.gamma,
                                          distance=PoincareDistance(c=self.geometry))
        from pml_hyperbolic.losses import HierarchicalLogRatioLoss

        return HierarchicalLogRatioLoss(omega=self.args.omega, distance=PoincareDistance(c=self.geometry))


if __name__ == "__main__":
    UnsupervisedHyperbolic.main()
