#!/usr/bin/env python
"""HIER (Kim, Jeong, Kwak, CVPR'23, "HIER: Metric Learning Beyond Class Labels via Hierarchical Regularization").

    python recipes/hier.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/hier.py --dataset cars --data-root /data/cars196 --hier-weight 1
    python recipes/hier.py --main-loss pce          # Hyp-ViT's pairwise cross-entropy as the main loss
    python recipes/hier.py                          # bundled glyphs, CPU-sized

An ordinary metric loss plus λ·HIER: learnable hierarchical proxies in the Poincaré ball
(pml_hyperbolic.losses.HIERLoss) that pull a same-class pair nearer their lowest common ancestor
than the one they share with a third sample; no hierarchy labels are needed. The head maps into the
ball (c = 0.1, clip 2.3) and Recall@K uses the exact Poincaré kNN. The main loss (--main-loss) is
MultiSimilarity with its miner (on the cosine of the ball points, or on the ball with
--ms-similarity poincare), Proxy-Anchor, or Hyp-ViT's pairwise cross-entropy. Training otherwise
follows Hyp-ViT's presets.
"""

from pml_hyperbolic.training.cli import ConfigError, RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.config import (nonnegative_float, optional_positive_float, positive_float, positive_int,
                                            similarity_threshold)
from pml_hyperbolic.training.presets import HYP_VIT_PRESETS

MAIN_LOSSES = ("ms", "pa", "pce")
MS_SIMILARITIES = ("cosine", "poincare")
PAPER_HIER = {"hier_weight": 1.0, "hier_proxies": 512}  # the paper's proxy count; λ 1 as a starting point
# chosen on validation characters (docs/design/recipe-defaults.md); the small radial calibration keeps
# the radius off the clip; the head starts from the PCA whitening of the training features, chosen on
# validation carves of three domains (docs/design/heads.md)
GLYPH_HIER = {"hier_weight": 0.3, "hier_proxies": 128, "radial_calibration": 0.03, "ms_similarity": "poincare",
              "head_init": "whiten"}


class HIER(RecipeCommandLine):
    name = "hier"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = {name: {**preset, **PAPER_HIER} for name, preset in HYP_VIT_PRESETS.items()}
    glyph_preset = {**RecipeCommandLine.glyph_preset, **GLYPH_HIER}
    docs_page = "hier.md"

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("HIER")
        g.add_argument("--main-loss", default="ms", choices=MAIN_LOSSES,
                       help="'ms': MultiSimilarity + miner (see --ms-similarity); 'pa': Proxy-Anchor on the "
                            "cosine; 'pce': Hyp-ViT's pairwise cross-entropy on the Poincaré distance.")
        g.add_argument("--hier-weight", type=nonnegative_float, default=PAPER_HIER["hier_weight"],
                       help="λ, the regulariser's weight (0 = the main loss alone).")
        g.add_argument("--hier-proxies", type=positive_int, default=PAPER_HIER["hier_proxies"],
                       help="Number of learnable hierarchical proxies.")
        g.add_argument("--hier-margin", type=nonnegative_float, default=0.1, help="HIER's margin δ.")
        g.add_argument("--hier-positives", default="labels", choices=["labels", "labels+mutual_nn"],
                       help="Pairs (i, j) of the triplets: same label, or also mutual nearest neighbours.")
        g.add_argument("--temperature", type=positive_float, default=0.2, help="τ of --main-loss pce.")
        g.add_argument("--ms-similarity", default="cosine", choices=MS_SIMILARITIES,
                       help="What --main-loss ms and its miner compare: the 'cosine' of the ball points (the "
                            "paper's) or 'poincare', the similarity 1 − d/T (PoincareSimilarity).")
        g.add_argument("--parent-weight", type=nonnegative_float, default=0.0,
                       help="Weight of MultiSimilarity on the classes' parent labels (ParentLabelLoss; 0 = off); "
                            "needs --main-loss ms and parent labels.")
        g.add_argument("--ms-scale", type=optional_positive_float, default=None,
                       help="T > 0 of --ms-similarity poincare ('none': 2·clip_r, which keeps every similarity "
                            "in [-1, 1]).")
        g.add_argument("--ms-alpha", type=positive_float, default=2.0,
                       help="α of MultiSimilarity (--main-loss ms, and the parent term): weight of the positive pairs.")
        g.add_argument("--ms-beta", type=positive_float, default=50.0,
                       help="β of MultiSimilarity (--main-loss ms, and the parent term): weight of the negative pairs.")
        g.add_argument("--ms-base", type=similarity_threshold, default=0.5,
                       help="λ of MultiSimilarity (--main-loss ms, and the parent term): the similarity threshold.")
        g.add_argument("--ms-epsilon", type=nonnegative_float, default=0.1,
                       help="ε of MultiSimilarity's miner (--main-loss ms, and the parent term).")

    @classmethod
    def preflight(cls, args):
        super().preflight(args)
        if args.hier_proxies < 1:
            raise ConfigError(f"--hier-proxies must be >= 1, got {args.hier_proxies}")
        # the glyph preset's similarity applies to --main-loss ms only; a flag the user gives must apply
        if "ms_similarity" in getattr(args, "_explicit", ()) and args.ms_similarity != "cosine" and args.main_loss != "ms":
            raise ConfigError(f"--ms-similarity {args.ms_similarity} needs --main-loss ms, got {args.main_loss}")
        if args.parent_weight and args.main_loss != "ms":
            raise ConfigError(f"--parent-weight needs --main-loss ms, got {args.main_loss}")
        if args.ms_scale is not None and (args.ms_similarity != "poincare" or args.main_loss != "ms"):
            raise ConfigError("--ms-scale needs --main-loss ms with --ms-similarity poincare")
        given = sorted(f"--{k.replace('_', '-')}" for k in getattr(args, "_explicit", ())
                       if k in ("ms_alpha", "ms_beta", "ms_base", "ms_epsilon"))
        if given and args.main_loss != "ms":
            raise ConfigError(f"{' '.join(given)} {'need' if len(given) > 1 else 'needs'} --main-loss ms, "
                              f"got {args.main_loss}")

    def build_loss(self):
        from pml_hyperbolic.losses import HIERLoss, OrderedMultipleLosses

        a = self.args
        if a.main_loss == "ms":
            main, miner = self.multi_similarity_loss(), self.multi_similarity_miner()
        elif a.main_loss == "pa":
            from pml_hyperbolic.training.runner import training_class_count
            from pytorch_metric_learning.losses import ProxyAnchorLoss

            # one proxy per training class; they train with the loss optimiser (--loss-lr, else --head-lr)
            main = ProxyAnchorLoss(num_classes=training_class_count(self.train_set), embedding_size=a.embedding_dim,
                                   margin=0.1, alpha=32)
            miner = None
        else:
            from pml_hyperbolic.distances import PoincareDistance
            from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

            distance = PoincareDistance(c=self.geometry)
            main, miner = PairwiseCrossEntropyLoss(temperature=a.temperature, distance=distance), None
        if not (a.hier_weight or a.parent_weight):
            return main  # its miner, if any, comes from build_miner
        losses, miners, weights = [main], [miner], [1.0]
        if a.hier_weight:
            losses.append(HIERLoss(embedding_size=a.embedding_dim, num_proxies=a.hier_proxies,
                                   margin=a.hier_margin, positives=a.hier_positives, c=self.geometry))
            miners.append(None)  # HIER draws its own triplets
            weights.append(a.hier_weight)
        if a.parent_weight:
            losses.append(self.parent_level_loss())
            miners.append(None)  # the parent term mines on the parent labels itself
            weights.append(a.parent_weight)
        # HIER, which reads nothing back from the device, is computed first (the miners' reads would
        # leave it to an idle device)
        order = [1] + [i for i in range(len(losses)) if i != 1] if a.hier_weight else None
        return OrderedMultipleLosses(losses, miners=miners, weights=weights, compute_order=order)

    def parent_level_loss(self):
        """MultiSimilarity and its miner on the parent labels of the training classes."""
        from pml_hyperbolic.losses import ParentLabelLoss
        from pml_hyperbolic.training.recipe_data import training_class_parents

        return ParentLabelLoss(self.multi_similarity_loss(), training_class_parents(self.train_set),
                               miner=self.multi_similarity_miner())

    def build_miner(self):
        if self.args.main_loss != "ms" or self.args.hier_weight or self.args.parent_weight:
            return None
        return self.multi_similarity_miner()

    def multi_similarity_loss(self):
        """MultiSimilarity (``--ms-alpha``, ``--ms-beta``, ``--ms-base``) on the loss's similarity."""
        from pytorch_metric_learning.losses import MultiSimilarityLoss

        a = self.args
        return MultiSimilarityLoss(alpha=a.ms_alpha, beta=a.ms_beta, base=a.ms_base, **self.multi_similarity_distance())

    def multi_similarity_miner(self):
        """MultiSimilarity's miner (``--ms-epsilon``) on the loss's similarity: beside HIER inside
        ``MultipleLosses``, alone as the trainer's miner."""
        from pytorch_metric_learning.miners import MultiSimilarityMiner

        return MultiSimilarityMiner(epsilon=self.args.ms_epsilon, **self.multi_similarity_distance())

    def multi_similarity_distance(self):
        """``distance=`` for MultiSimilarity and its miner: PML's default cosine, or the Poincaré
        similarity on this recipe's geometry (one object, built once, shared by the loss and the miner;
        the geometry shared by reference with the head)."""
        if self.args.ms_similarity == "cosine" or self.args.main_loss != "ms":
            return {}
        if getattr(self, "_ms_similarity", None) is None:
            from pml_hyperbolic.distances import PoincareSimilarity

            self._ms_similarity = PoincareSimilarity(c=self.geometry, scale=self.args.ms_scale)
        return {"distance": self._ms_similarity}


if __name__ == "__main__":
    HIER.main()
