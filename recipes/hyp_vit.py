#!/usr/bin/env python
"""Hyp-ViT (Ermolov et al., CVPR'22) and its Sph- baseline.

    python recipes/hyp_vit.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/hyp_vit.py --dataset sop --model sph          # the spherical baseline
    python recipes/hyp_vit.py --dataset cars --init dino --backbone-checkpoint dino_deitsmall16.pth
    torchrun --nproc_per_node=4 recipes/hyp_vit.py --dataset sop  # DistributedDataParallel
    python recipes/hyp_vit.py                                     # bundled glyphs, CPU-sized

Paper settings: ViT-S/16, 128-d head, c = 0.1, clip 2.3, pairwise cross-entropy with τ = 0.2
(0.1 for the sphere), batch 900 (whole classes), AdamW lr 3e-5 (1e-5 when starting from DINO),
weight decay 0.01, gradient-norm clip 3, frozen patch embedding, AMP; 200 / 600 / 25000 / 2200
steps on CUB / Cars / SOP / In-Shop.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

from pml_hyperbolic.training import Recipe  # noqa: E402

_VIT = {"backbone": "vit_small_patch16_224", "image_size": 224, "resize_size": 256, "lr": 3e-5,
        "weight_decay": 0.01, "grad_clip": 3.0, "freeze_patch_embed": True, "amp": "auto", "curvature": 0.1,
        "clip_r": 2.3}
# epochs × steps_per_epoch = the paper's step counts (an evaluation + checkpoint after each epoch).
PAPER_PRESETS = {
    "cub200": {**_VIT, "batch_size": 900, "samples_per_class": 9, "epochs": 10, "steps_per_epoch": 20,
               "k_values": [1, 2, 4, 8, 16, 32]},
    "cars196": {**_VIT, "batch_size": 882, "samples_per_class": 9, "epochs": 10, "steps_per_epoch": 60,
                "k_values": [1, 2, 4, 8, 16, 32]},
    "sop": {**_VIT, "batch_size": 900, "samples_per_class": 2, "epochs": 50, "steps_per_epoch": 500,
            "k_values": [1, 10, 100, 1000]},
    "inshop": {**_VIT, "batch_size": 900, "samples_per_class": 2, "epochs": 22, "steps_per_epoch": 100,
               "k_values": [1, 10, 20, 30, 40, 50]},
}


class HypViT(Recipe):
    name = "hyp_vit"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = PAPER_PRESETS

    def __init__(self, args):
        super().__init__(args)
        self.hyperbolic = args.model == "hyp"

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("Hyp-ViT")
        g.add_argument("--model", default="hyp", choices=["hyp", "sph"],
                       help="'hyp': Poincaré-ball head and distance; 'sph': the L2-normalised baseline (cosine).")
        g.add_argument("--init", default="vit", choices=["vit", "dino"],
                       help="Backbone initialisation: supervised ImageNet ViT-S/16 or DINO (sets lr 1e-5 and the "
                            "timm DINO weights unless --backbone/--lr are given).")
        g.add_argument("--view-pairs", type=lambda v: str(v).lower() in ("1", "true", "yes", "on"), default=False,
                       help="The authors' multi-view loss (sum over the m(m-1) ordered view pairs); needs every class "
                            "exactly m times in the (gathered) batch, so not with DDP when ranks share classes.")
        g.add_argument("--temperature", type=float, default=None,
                       help="Cross-entropy temperature τ (default 0.2 hyperbolic, 0.1 spherical).")

    @classmethod
    def presets(cls, args):
        preset = super().presets(args)
        if args.init == "dino" and preset.get("backbone") == _VIT["backbone"]:
            preset.update(backbone="vit_small_patch16_224.dino", lr=1e-5)
        return preset

    def build_head(self, in_features):
        if self.hyperbolic:
            return super().build_head(in_features)
        from pml_hyperbolic.heads import SphericalEmbeddingHead

        return SphericalEmbeddingHead(in_features, self.args.embedding_dim)

    def build_loss(self):
        from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

        if self.hyperbolic:
            from pml_hyperbolic.distances import PoincareDistance

            tau = self.args.temperature or 0.2
            return PairwiseCrossEntropyLoss(temperature=tau, distance=PoincareDistance(c=self.geometry),
                                            view_pairs=self.args.view_pairs)
        from pytorch_metric_learning.distances import CosineSimilarity

        return PairwiseCrossEntropyLoss(temperature=self.args.temperature or 0.1, distance=CosineSimilarity(),
                                        view_pairs=self.args.view_pairs)


if __name__ == "__main__":
    HypViT.main()
