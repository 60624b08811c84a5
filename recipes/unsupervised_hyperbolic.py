#!/usr/bin/env python
"""Unsupervised hyperbolic metric learning (Yan et al., CVPR'21).

    python recipes/unsupervised_hyperbolic.py                       # bundled glyphs, no labels used
    python recipes/unsupervised_hyperbolic.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/unsupervised_hyperbolic.py --supervised          # hierarchical-margin variant

No label is used for training: at the start of every epoch the current embeddings of the training
set are clustered hierarchically in the Poincaré ball (HierarchicalPseudoLabeler, K levels) and the
hierarchical log-ratio loss (HierarchicalLogRatioLoss, Ω) is trained on those pseudo-labels. With
``--supervised`` the real class labels train the hierarchical-margin loss instead. Test labels are
used only to report Recall@K.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))


from pml_hyperbolic.training import Recipe  # noqa: E402
from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset  # noqa: E402
from pml_hyperbolic.training.runner import compute_embeddings  # noqa: E402

PAPER = {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "batch_size": 120,
         "samples_per_class": 4, "lr": 3e-5, "epochs": 50, "steps_per_epoch": None, "curvature": 0.1}


class UnsupervisedHyperbolic(Recipe):
    name = "unsupervised_hyperbolic"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = {"cub200": PAPER, "cars196": PAPER, "sop": PAPER}

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
        g.add_argument("--levels", type=int, nargs="+", default=[100, 70, 40, 10],
                       help="Clusters per pseudo-label level, finest first (paper's K = 4 setting).")
        g.add_argument("--omega", type=float, default=10.0, help="Ω > 1 of the log-ratio loss.")
        g.add_argument("--gamma", type=float, default=0.1, help="--supervised: margin offset γ.")

    # ---- data: hide the labels ----
    def train_dataset(self, dataset):
        return dataset if self.args.supervised else PseudoLabelledDataset(dataset)

    def relabel(self, step):
        """Cluster the current training-set embeddings into the K-level pseudo-labels."""
        from pml_hyperbolic.miners import HierarchicalPseudoLabeler

        if self._labels_step == step:
            return
        emb = compute_embeddings(self.trunk, self.head, self.train_eval_set, self.device,
                                 self.args.eval_batch_size)
        labeler = HierarchicalPseudoLabeler(levels=tuple(self.args.levels), c=self.c, seed=self.args.seed)
        labels = labeler.fit_predict(emb)
        self.train_set.set_labels(labels)
        self._labels_step = step
        self.say(f"[pseudo-labels] step {step}: clusters per level {list(labeler.level_sizes_)}")

    def build_sampler(self, labels, per_rank_batch):
        if self.args.supervised:
            return super().build_sampler(labels, per_rank_batch)
        self.relabel(0)
        self._per_rank_batch = per_rank_batch
        return super().build_sampler(self.train_set.labels[:, 0], per_rank_batch)

    def trainer_kwargs(self):
        if self.args.supervised:
            return {}

        def start_of_epoch(trainer):
            self.relabel(trainer.global_step)
            sampler = super(UnsupervisedHyperbolic, self).build_sampler(self.train_set.labels[:, 0],
                                                                         self._per_rank_batch)
            sampler.set_epoch(trainer.epoch)
            trainer.sampler = sampler
            trainer.initialize_dataloader()

        return {"start_of_epoch_hook": start_of_epoch}

    # ---- model / loss ----
    def build_loss(self):
        from pml_hyperbolic.distances import PoincareDistance

        if self.args.supervised:
            from pml_hyperbolic.losses import HierarchicalMarginLoss

            num_classes = int(getattr(self.train_set, "num_classes", int(max(self.train_set.labels)) + 1))
            return HierarchicalMarginLoss(num_classes=num_classes, gamma=self.args.gamma,
                                          distance=PoincareDistance(c=self.c))
        from pml_hyperbolic.losses import HierarchicalLogRatioLoss

        return HierarchicalLogRatioLoss(omega=self.args.omega, distance=PoincareDistance(c=self.c))


if __name__ == "__main__":
    UnsupervisedHyperbolic.main()
