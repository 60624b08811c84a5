#!/usr/bin/env python
"""HCL: hyperbolic contrastive learning for visual representations beyond objects (Ge et al., CVPR'23).

    python recipes/hcl.py                                        # scenes composed from the bundled glyphs
    python recipes/hcl.py --annotations instances_train2017.json --images-dir train2017/   # COCO-style

Self-supervised: a MoCo loss (query encoder, momentum key encoder, key queue) on two views of an
object crop, plus a weighted hyperbolic contrastive loss whose query is a scene and whose positive
key is an object crop inside it (logits −d_Poincaré/T, c = 0.05, T = 0.2). On the bundled data,
scenes are made by pasting glyph "objects" onto one canvas. Recall@K of the trunk's features on the
glyph query/gallery split is a quick check (the paper evaluates by linear probing).
"""
import math
import os

from pml_hyperbolic.training.cli import ConfigError, ImportedOnUse, RecipeCommandLine  # torch-free
from pml_hyperbolic.training.config import (DATASET_ALIASES, nonnegative_float, positive_float, positive_int,
                                            unit_fraction)
from pml_hyperbolic.training.presets import (GLYPH_VIEW_AUGMENTATIONS, HCL_GLYPH_HYPERBOLIC_WEIGHT,  # torch-free
                                             HCL_GLYPH_QUEUE_SIZE, HCL_GLYPH_TRUNK_LR,
                                             HCL_GLYPH_VIEW_AUGMENTATION, HCL_PAPER_HYPERBOLIC_WEIGHT)
BUNDLED_GLYPH_SIDE = 40  # pixels of a bundled glyph image (pml_hyperbolic/data/cjk_glyphs.npz); scenes tile them
#: The paper's settings, applied with --annotations (COCO-style data).
COCO_PRESET = {"backbone": "resnet50", "image_size": 224, "batch_size": 256, "lr": 0.03, "epochs": 200,
               "trunk_train": "all"}


class HCL(RecipeCommandLine):
    name = "hcl"
    description = __doc__
    hyperbolic = False           # features evaluated in Euclidean space; the ball is a loss geometry
    evaluate_head = False        # MoCo / HCL score the backbone's representation; the MLP serves the losses
    real_dataset = "glyphs"
    trainer_class = ImportedOnUse("pml_hyperbolic.training.hcl_trainer", "HCLTrainer")
    min_samples_per_class = 1    # self-supervised: the positives are views of one image
    docs_page = "hcl.md"
    # lr (the trunk's), hyperbolic_weight and the view augmentation: chosen on validation characters
    # (docs/design/recipe-defaults.md)
    glyph_preset = {**RecipeCommandLine.glyph_preset, "batch_size": 64, "samples_per_class": 1,
                    "lr": HCL_GLYPH_TRUNK_LR, "hyperbolic_weight": HCL_GLYPH_HYPERBOLIC_WEIGHT,
                    "view_augmentation": HCL_GLYPH_VIEW_AUGMENTATION,
                    "head_lr": 3e-3, "grad_clip": None, "k_values": [1, 2, 4, 8],
                    "freeze_trunk": False, "trunk_train": "tail", "queue_size": HCL_GLYPH_QUEUE_SIZE}
    paper_presets = {}

    @classmethod
    def add_arguments(cls, parser):
        g = parser.add_argument_group("HCL")
        g.add_argument("--annotations", default=None, metavar="JSON",
                       help="COCO-style annotation file (images, annotations with bbox); unset: the composed "
                            "glyph scenes.")
        g.add_argument("--images-dir", default=None, metavar="DIR", help="Image folder of --annotations.")
        g.add_argument("--ball-curvature", type=positive_float, default=0.05, help="c > 0 of the hyperbolic branch.")
        g.add_argument("--temperature", type=positive_float, default=0.2, help="T > 0 of both contrastive losses.")
        g.add_argument("--hyperbolic-weight", type=nonnegative_float, default=HCL_PAPER_HYPERBOLIC_WEIGHT,
                       help="Weight of the hyperbolic loss beside MoCo's.")
        g.add_argument("--momentum", type=unit_fraction, default=0.999, help="Momentum of the key encoder, in [0, 1].")
        g.add_argument("--queue-size", type=positive_int, default=65536, help="Length of both key queues.")
        g.add_argument("--view-augmentation", choices=GLYPH_VIEW_AUGMENTATIONS, default=None,
                       help="Bundled glyph scenes: 'crop' (random resized crop) or 'font' (typeface-like changes) "
                            "for the two object views; --annotations uses MoCo v2's photo augmentation.")
        g.add_argument("--trunk-train", choices=("all", "tail"), default=None,
                       help="What of the trunk trains: 'all', or 'tail' (an EfficientNet/MobileNet's last block "
                            "and conv_head, every BatchNorm frozen).")
        g.add_argument("--canvas-size", type=positive_int, default=112, help="Bundled scenes: canvas side in pixels.")
        g.add_argument("--max-objects", type=positive_int, default=4, help="Objects per scene: 2..max-objects.")

    @classmethod
    def preset_columns(cls):
        return [("on", "the bundled glyph scenes", dict(cls.glyph_preset)), ("with", "--annotations", COCO_PRESET)]

    @classmethod
    def presets(cls, args):
        if args.annotations:
            return dict(COCO_PRESET)
        return dict(cls.glyph_preset)

    @classmethod
    def resolved_dataset(cls, args):
        return "coco" if args.annotations else "glyphs"

    @classmethod
    def preflight(cls, args):
        if DATASET_ALIASES[args.dataset] in ("icons", "iconify"):
            raise ConfigError(f"--dataset {args.dataset} is not supported by hcl: its scenes are composed from the "
                              "bundled glyphs (the default), or read from COCO-style data with --annotations FILE "
                              f"--images-dir DIR. Drop --dataset {args.dataset}.")
        super().preflight(args)
        if args.max_objects < 2:
            raise ConfigError(f"--max-objects must be >= 2 (a scene holds 2..max-objects objects), got {args.max_objects}")
        side = args.canvas_size // BUNDLED_GLYPH_SIDE
        if not args.annotations and side * side < args.max_objects:
            needed = BUNDLED_GLYPH_SIDE * math.ceil(math.sqrt(args.max_objects))
            raise ConfigError(f"--canvas-size {args.canvas_size} holds {side * side} glyph(s) of {BUNDLED_GLYPH_SIDE} px "
                              f"side by side, fewer than --max-objects {args.max_objects}: use --canvas-size {needed} "
                              "or more (or fewer --max-objects).")
        if args.annotations and args.view_augmentation is not None:
            raise ConfigError(f"--view-augmentation {args.view_augmentation} applies to the bundled glyph scenes; "
                              "with --annotations the object views use MoCo v2's photo augmentation. Drop one of "
                              "the two.")
        if args.annotations:
            if not args.images_dir:
                raise ConfigError("--annotations needs --images-dir (the folder its file_name entries are in)")
            for flag, path, test in (("--annotations", args.annotations, os.path.isfile),
                                     ("--images-dir", args.images_dir, os.path.isdir)):
                if not test(path):
                    raise ConfigError(f"{flag} {path} does not exist. Give a COCO-style annotation file and the "
                                      "folder of its images, or drop --annotations to use the bundled glyph scenes.")
        if args.freeze_trunk:  # after the errors: a run that fails says only why
            from pml_hyperbolic.training.cli import warn

            warn("HCL is scored on the trunk's representation and --freeze-trunk true keeps it fixed: Recall@K "
                 "after training equals Recall@K before (only the loss's projection head trains). "
                 "Use --freeze-trunk false to train the representation.")

    def setup_data(self):
        from pml_hyperbolic.training.scene_objects import hcl_scene_data

        for name, value in hcl_scene_data(self.args, self.say).items():
            setattr(self, name, value)

    def method_check(self):
        from pml_hyperbolic.training.checkpoint import unwrap
        from pml_hyperbolic.training.scene_objects import scene_object_report

        scenes = getattr(self, "scene_check_set", None)
        if scenes is None:  # --annotations, or data set up elsewhere (the benches): no held-out scenes
            return None
        trainer = getattr(self, "trainer", None)  # objects as the loss sees them: through the momentum encoder
        keys = (trainer.key_trunk, trainer.key_embedder) if trainer is not None else None
        return scene_object_report(unwrap(self.trunk), unwrap(self.head), scenes, self.args.ball_curvature,
                                   self.device, self.args.eval_batch_size, object_encoder=keys)

    def setup_model(self):
        super().setup_model()
        if self.args.trunk_train == "tail" and not self.args.freeze_trunk:
            from pml_hyperbolic.training.hcl_trainer import train_only_the_tail

            if not hasattr(self.trunk, "conv_head") and "trunk_train" not in getattr(self.args, "_explicit", ()):
                # the preset's "tail" names the preset backbone's parts; another backbone trains whole
                self.say(f"[hcl] --trunk-train tail needs an EfficientNet/MobileNet trunk; the "
                         f"{type(self.trunk).__name__} trunk trains whole (--trunk-train all)")
                return

            try:
                n = train_only_the_tail(self.trunk)
            except ValueError as err:
                raise ConfigError(str(err))
            self.say(f"[hcl] trunk: only the last block and conv_head train ({n} parameters), BatchNorm frozen")

    def build_sampler(self, labels, per_rank_batch):
        import torch

        if self.ctx.enabled:
            return torch.utils.data.distributed.DistributedSampler(self.train_set, seed=self.args.seed)
        return None  # plain shuffling; its order is drawn from the (checkpointed) torch RNG

    def build_head(self, in_features):
        import torch

        # MoCo v2 projection MLP; its output feeds both the Euclidean and the hyperbolic branch.
        d = self.args.embedding_dim
        return torch.nn.Sequential(torch.nn.Linear(in_features, in_features), torch.nn.ReLU(inplace=True),
                                   torch.nn.Linear(in_features, d))

    def build_loss(self):
        from pytorch_metric_learning.distances import CosineSimilarity

        from pml_hyperbolic.distances import PoincareDistance
        from pml_hyperbolic.losses import PairwiseCrossEntropyLoss
        from pml_hyperbolic.training.hcl_trainer import KeyQueue

        a = self.args
        d = a.embedding_dim
        # MoCo's InfoNCE. Every query has exactly one positive in the queue (its own key), so the pairwise
        # cross-entropy on the cosine equals PML's NTXentLoss term for term (tests/training/test_hcl_trainer_key_queue.py),
        # with one (B, queue) logit matrix where NTXentLoss builds (B, B x queue): at the paper's batch 256
        # and queue 65,536 that is 4.3e9 elements (17 GB of float32) per step.
        moco = KeyQueue(PairwiseCrossEntropyLoss(temperature=a.temperature, distance=CosineSimilarity()), d,
                        memory_size=a.queue_size)
        hyp = KeyQueue(PairwiseCrossEntropyLoss(temperature=a.temperature,
                                                distance=PoincareDistance(c=a.ball_curvature)),
                       d, memory_size=a.queue_size)
        return {"metric_loss": moco, "hyperbolic_loss": hyp}

    def trainer_kwargs(self):
        a = self.args
        return {"momentum": a.momentum, "curvature": a.ball_curvature, "hyperbolic_weight": a.hyperbolic_weight}


if __name__ == "__main__":
    HCL.main()
