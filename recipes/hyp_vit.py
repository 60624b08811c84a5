#!/usr/bin/env python
"""Hyp-ViT (Ermolov et al., CVPR'22) and its Sph- baseline.

    python recipes/hyp_vit.py --dataset cub --data-root /data/CUB_200_2011
    python recipes/hyp_vit.py --dataset sop --model sph          # the spherical baseline
    python recipes/hyp_vit.py --dataset cars --init dino --backbone-checkpoint dino_deitsmall16.pth
    torchrun --nproc_per_node=4 recipes/hyp_vit.py --dataset sop  # DistributedDataParallel
    python recipes/hyp_vit.py                                     # bundled glyphs, CPU-sized

A ViT-S/16 → 128-d Poincaré-ball head (c = 0.1, clip 2.3) → pairwise cross-entropy on the
Poincaré distance (τ = 0.2; the sphere: cosine, τ = 0.1). The benchmark presets are the paper's
(batch 900 of whole classes, AdamW lr 3e-5, frozen patch embedding, its step counts).
"""

from pml_hyperbolic.training.cli import RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.config import nonnegative_float, optional_positive_float, positive_int, str2bool
from pml_hyperbolic.training.presets import HYP_VIT_PRESETS

PAPER_PRESETS = HYP_VIT_PRESETS
_VIT = HYP_VIT_PRESETS["cub200"]


class HypViT(RecipeCommandLine):
    name = "hyp_vit"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = PAPER_PRESETS
    docs_page = "hyp-vit.md"

    def __init__(self, args):
        super().__init__(args)
        self.hyperbolic = args.model == "hyp"

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("Hyp-ViT")
        g.add_argument("--model", default="hyp", choices=["hyp", "sph"],
                       help="'hyp': Poincaré-ball head and distance; 'sph': the L2-normalised baseline (cosine).")
        g.add_argument("--init", default="vit", choices=["vit", "dino"],
                       help="Backbone initialisation: supervised ImageNet ViT-S/16 or DINO (on the benchmarks: "
                            "the timm DINO weights and lr 1e-5 unless --backbone/--lr are given).")
        g.add_argument("--hier-weight", type=nonnegative_float, default=0.0,
                       help="Weight of HIER's hierarchical-proxy regulariser (Kim et al., CVPR'23) beside the "
                            "loss (0 = off).")
        g.add_argument("--hier-proxies", type=positive_int, default=512, help="HIER: number of learnable proxies.")
        g.add_argument("--view-pairs", type=str2bool, default=False, metavar="BOOL",
                       help="The authors' multi-view loss over the m(m-1) ordered view pairs; every class must "
                            "appear exactly m times in the (gathered) batch.")
        g.add_argument("--temperature", type=optional_positive_float, default=None,
                       help="Cross-entropy temperature τ > 0 ('none': 0.2 hyperbolic, 0.1 spherical).")

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
            loss = PairwiseCrossEntropyLoss(temperature=tau, distance=PoincareDistance(c=self.geometry),
                                            view_pairs=self.args.view_pairs)
            if not self.args.hier_weight:
                return loss
            # HIER (Kim et al., CVPR'23): the hierarchical-proxy regulariser beside the main loss
            from pytorch_metric_learning.losses import MultipleLosses

            from pml_hyperbolic.losses import HIERLoss

            hier = HIERLoss(embedding_size=self.args.embedding_dim, num_proxies=self.args.hier_proxies,
                            c=self.geometry)
            return MultipleLosses([loss, hier], weights=[1.0, self.args.hier_weight])
        from pytorch_metric_learning.distances import CosineSimilarity

        return PairwiseCrossEntropyLoss(temperature=self.args.temperature or 0.1, distance=CosineSimilarity(),
                                        view_pairs=self.args.view_pairs)


if __name__ == "__main__":
    HypViT.main()
