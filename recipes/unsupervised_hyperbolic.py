#!/usr/bin/env python
"""Unsupervised hyperbolic metric learning (Yan et al., CVPR'21).

    python recipes/unsupervised_hyperbolic.py                       # bundled glyphs, no labels used
    python recipes/unsupervised_hyperbolic.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/unsupervised_hyperbolic.py --paper-pseudo-labels --omega 10 --head-init random  # the paper's
    python recipes/unsupervised_hyperbolic.py --supervised          # hierarchical-margin variant

No label is used for training: the training set is clustered hierarchically into pseudo-labels
(pml_hyperbolic.training.pseudo_labels.UnsupervisedPseudoLabels), refreshed at the start of every
epoch, and the hierarchical log-ratio loss is trained on them. The head's linear layer starts as
the PCA whitening of the training images' trunk outputs (--head-init). The default pseudo-labels
were chosen on the bundled glyphs: on another dataset pass --levels for its size. With --supervised
the real class labels train the hierarchical-margin loss instead. Test labels are used only to
report Recall@K.
"""

from pml_hyperbolic.training.cli import RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.config import (BUNDLED_DATASETS, greater_than_one, nonnegative_float,
                                            nonnegative_int, positive_int, set_flag_defaults, str2bool)
from pml_hyperbolic.training.presets import DEFAULT_PSEUDO_LEVELS, PAPER_PSEUDO_LEVELS
from pml_hyperbolic.training.presets import PSEUDO_LABEL_LINKAGES as LINKAGES
from pml_hyperbolic.training.presets import PSEUDO_LABEL_SOURCES as SOURCES
from pml_hyperbolic.training.presets import DEFAULT_UNSUPERVISED_HEAD_INIT, DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE
from pml_hyperbolic.training.presets import HIER_MARGIN_GLYPH_HEAD_LR, UNSUPERVISED_BUNDLED_HEAD_LR

PAPER = {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "batch_size": 120,
         "samples_per_class": 4, "lr": 3e-5, "epochs": 50, "steps_per_epoch": None, "curvature": 0.1}


class UnsupervisedHyperbolic(RecipeCommandLine):
    name = "unsupervised_hyperbolic"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = {"cub200": PAPER, "cars196": PAPER, "sop": PAPER}
    docs_page = "unsupervised.md"
    # the pseudo-label training's head rate, chosen on validation carves of the three bundled domains
    # (docs/design/recipe-defaults.md)
    glyph_preset = {**RecipeCommandLine.glyph_preset, "head_lr": UNSUPERVISED_BUNDLED_HEAD_LR}

    @classmethod
    def presets(cls, args):
        preset = super().presets(args)
        if args.supervised and cls.resolved_dataset(args) in BUNDLED_DATASETS:
            # the margin loss's head rate, chosen on glyph validation carves (docs/design/recipe-defaults.md);
            # the icons reuse it, as they reuse the rest of the glyph preset
            preset["head_lr"] = HIER_MARGIN_GLYPH_HEAD_LR
        if args.supervised:
            preset["head_init"] = "random"  # the warm start belongs to the pseudo-label training
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
                       help="Train HierarchicalMarginLoss on the real labels instead of pseudo-labels (bundled "
                            f"glyphs and icons: --head-lr {HIER_MARGIN_GLYPH_HEAD_LR:g} by default).")
        g.add_argument("--levels", type=positive_int, nargs="+", default=None, metavar="K",
                       help=f"Clusters per pseudo-label level, finest first (unset: {' '.join(map(str, DEFAULT_PSEUDO_LEVELS))}; "
                            f"the paper: {' '.join(map(str, PAPER_PSEUDO_LEVELS))}).")
        g.add_argument("--linkage", choices=LINKAGES, default=None,
                       help="Agglomerative linkage of the pseudo-labels (unset: ward; the paper: average).")
        g.add_argument("--pseudo-source", choices=SOURCES, default=None,
                       help="What is clustered (unset: the pre-trained features, once; the paper: features "
                            "then the learned embeddings).")
        g.add_argument("--whiten", type=nonnegative_int, default=None, metavar="D",
                       help="PCA-whiten the features to D dimensions before clustering (0: off; unset: 256).")
        g.add_argument("--min-cluster-size", type=positive_int, default=None, metavar="N",
                       help="Merge finest pseudo-classes smaller than N into the nearest one (unset: 4).")
        g.add_argument("--paper-pseudo-labels", action="store_true",
                       help="Yan et al.'s pseudo-labels (average linkage, levels "
                            f"{' '.join(map(str, PAPER_PSEUDO_LEVELS))}, features then embeddings).")
        g.add_argument("--omega", type=greater_than_one, default=1.2,
                       help="Ω > 1 of the log-ratio loss (the paper: 10).")
        g.add_argument("--train-radius", type=str2bool, default=True, metavar="BOOL",
                       help="Let the log-ratio loss's gradient move the radius (true: the paper's full gradient; "
                            "false: directions only, HierarchicalLogRatioLoss(train_radius=False)).")
        g.add_argument("--gamma", type=nonnegative_float, default=0.05,
                       help="--supervised: margin offset γ of HierarchicalMarginLoss.")
        # the head's warm start (shared flags): on by default here, off by default with --supervised
        set_flag_defaults(parser, head_init=DEFAULT_UNSUPERVISED_HEAD_INIT,
                          head_init_scale=DEFAULT_UNSUPERVISED_HEAD_INIT_SCALE)

    # ---- data: hide the labels ----
    def train_dataset(self, dataset):
        from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset

        return dataset if self.args.supervised else PseudoLabelledDataset(dataset)

    def pseudo_labels(self):
        """The recipe's pseudo-label policy (built once: it caches feature-based labels)."""
        if getattr(self, "_pseudo_policy", None) is None:
            from pml_hyperbolic.training.pseudo_labels import UnsupervisedPseudoLabels
            from pml_hyperbolic.training.recipe_data import pseudo_label_options

            a = self.args
            paper = UnsupervisedPseudoLabels.paper(c=self.geometry).config() if a.paper_pseudo_labels else None
            kw = pseudo_label_options(a, paper)
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

        return HierarchicalLogRatioLoss(omega=self.args.omega, train_radius=self.args.train_radius,
                                        distance=PoincareDistance(c=self.geometry))


if __name__ == "__main__":
    UnsupervisedHyperbolic.main()
