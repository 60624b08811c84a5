#!/usr/bin/env python
"""HypMix (Yue et al., "Understanding Hyperbolic Metric Learning through Hard Negative Sampling").

    python recipes/hyp_mix.py --dataset cars --data-root /data/cars196      # λ = 8
    python recipes/hyp_mix.py --dataset cub --lam 3 --tau-e 0.05 --tau-h 0.2
    python recipes/hyp_mix.py                                                # bundled glyphs, CPU-sized

One Linear head; the loss mixes the spherical and the hyperbolic geometry of the same output in one
cross-entropy: logits ⟨z_e, z_e'⟩/τ_e − λ·d_c(z_h, z_h')/τ_h (pml_hyperbolic.losses.HypMixLoss).
Training otherwise follows Hyp-ViT (the authors' code is a fork of it). The mixed distance is a
monotone function of the cosine, so Recall@K is evaluated with the cosine.
"""

from pml_hyperbolic.training.cli import RecipeCommandLine  # torch-free: --help answers at once
from pml_hyperbolic.training.config import nonnegative_float, positive_float
from pml_hyperbolic.training.presets import HYP_MIX_PRESETS as PAPER_PRESETS


class HypMix(RecipeCommandLine):
    name = "hyp_mix"
    description = __doc__
    real_dataset = "cub200"
    paper_presets = PAPER_PRESETS
    glyph_preset = {**RecipeCommandLine.glyph_preset, "lam": 3.0, "tau_e": 0.05, "tau_h": 0.2}
    docs_page = "hyp-mix.md"

    def __init__(self, args):
        super().__init__(args)
        self.hyperbolic = False  # evaluated with the cosine (see the module docstring)

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("HypMix")
        g.add_argument("--lam", type=nonnegative_float, default=3.0, help="λ >= 0, weight of the hyperbolic term.")
        g.add_argument("--tau-e", type=positive_float, default=0.05, help="τ_e > 0, spherical temperature.")
        g.add_argument("--tau-h", type=positive_float, default=0.2, help="τ_h > 0, hyperbolic temperature.")
        g.add_argument("--learnable-lambda", action="store_true", help="Learn λ (beyond the paper).")

    def build_head(self, in_features):
        from pml_hyperbolic.heads import SphericalEmbeddingHead

        return SphericalEmbeddingHead(in_features, self.args.embedding_dim)

    def build_loss(self):
        from pml_hyperbolic.losses import HypMixLoss

        a = self.args
        return HypMixLoss(c=self.geometry, lam=a.lam, tau_e=a.tau_e, tau_h=a.tau_h,
                          learnable_lambda=a.learnable_lambda)  # the clip radius is the geometry's


if __name__ == "__main__":
    HypMix.main()
