#!/usr/bin/env python
"""Hyp-UML (Yan, Liu, Xu): hyperbolic image retrieval with uncertainty-aware metric learning.

    python recipes/hyp_uml_cars.py                          # Cars196 if found, else the bundled glyphs
    python recipes/hyp_uml_cars.py --data-root /data/cars196
    python recipes/hyp_uml_cars.py --loss triplet           # the adaptive-margin variant
    python recipes/hyp_uml_cars.py --help                   # every setting

Cars196 (paper settings): ViT-S/16 → hyperbolic head (128-d, c = 0.1, clip 2.3) → uncertainty-
adaptive contrastive loss; 3 samples per class, batch 294 (contrastive) or 2 per class and 194
(triplet), AdamW lr 3e-5, weight decay 0.01, AMP. Without Cars196 the recipe trains a small
ImageNet-pretrained CNN on the bundled glyph dataset so that it finishes in minutes on a CPU.

Beyond the paper (so that the uncertainty it reads off the radius means something; bench/radius.py):
the polar head, ``--radial-calibration 1`` (the radii ordered by in-batch retrieval success) and
``--degraded-copies 0.25`` (a blurred / noisy / occluded copy of a quarter of each batch must sit
nearer the origin). ``--head-radius norm --radial-calibration 0 --degraded-copies 0`` is the paper's setup.
"""

from pml_hyperbolic.training.cli import RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.presets import HYP_UML_PRESETS

PAPER_CARS = HYP_UML_PRESETS["cars196"]


class HypUML(RecipeCommandLine):
    name = "hyp_uml"
    description = __doc__
    real_dataset = "cars196"
    reports_uncertainty = True  # print the Recall@1 of each uncertainty bin (the paper's claim)

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("Hyp-UML")
        g.add_argument("--loss", default="contrastive", choices=["contrastive", "triplet"],
                       help="Uncertainty-adaptive contrastive (temperature) or triplet (margin) loss.")
        g.add_argument("--uncertainty-mode", default=None, choices=[None, "clip", "ball", "batch", "literal"],
                       type=lambda s: None if s in (None, "none", "None") else s,
                       help="How U is normalised (see pml_hyperbolic.uncertainty); 'literal' = the paper's formula.")
        g.add_argument("--uncertainty-scale", type=float, default=0.3,
                       help="Contrastive: τ_i = max(τ_min, scale·log(U_i/max U + 1)).")
        g.add_argument("--min-temperature", type=float, default=0.05, help="Contrastive: lower bound τ_min.")
        g.add_argument("--margin-scale", type=float, default=None,
                       help="Triplet: margin = log(U/max U + 1)·margin_scale (default exp(c), the paper's).")
        # The radius terms that make the uncertainty predict failures and degraded inputs (bench/radius.py,
        # chosen on validation characters): on by default here, off in the other recipes.
        parser.set_defaults(radial_calibration=1.0, degraded_copies=0.25)

    @classmethod
    def presets(cls, args):
        preset = super().presets(args)
        if preset.get("batch_size") == PAPER_CARS["batch_size"] and getattr(args, "loss", "") == "triplet":
            # Table I of the paper: the triplet variant uses 2 samples per class, batch 194.
            preset.update(samples_per_class=2, batch_size=194)
        return preset

    paper_presets = {"cars196": PAPER_CARS}

    def build_loss(self):
        from pml_hyperbolic.distances import PoincareDistance

        a = self.args
        distance = PoincareDistance(c=self.geometry)
        if a.loss == "triplet":
            from pml_hyperbolic.losses import UncertaintyAdaptiveTripletLoss

            return UncertaintyAdaptiveTripletLoss(margin_scale=a.margin_scale, mode=a.uncertainty_mode, c=self.geometry,
                                                  clip_r=a.clip_r, distance=distance)
        from pml_hyperbolic.losses import UncertaintyAdaptiveContrastiveLoss

        return UncertaintyAdaptiveContrastiveLoss(scale=a.uncertainty_scale, min_temperature=a.min_temperature,
                                                  mode=a.uncertainty_mode, c=self.geometry, clip_r=a.clip_r,
                                                  distance=distance)


if __name__ == "__main__":
    HypUML.main()
