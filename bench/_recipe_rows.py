"""Train a recipe on the bench's activation bank: the recipes' own code path, images replaced by
cached frozen-backbone activations.

``recipe_on_bank(HypViT, bank, cfg, seed, ["--hier-weight", "3"])`` returns an instance of the
recipe whose ``run()`` is the runner's: the recipe's parser and presets, its geometry, head, loss and
miner builders, its optimisers, PML trainer (``trainer_class``, AMP, gradient clipping, start-of-epoch
hooks such as the unsupervised re-clustering), the PML tester with the recipe's kNN, checkpoints and
logs. Only two things differ from ``python recipes/<name>.py``, both because a 2-core CPU must train
a dozen methods × 3 seeds in an hour:

* **data**: the training set yields, per image, one of the bank's views (1 clean + augmented
  views drawn once with a fixed seed, see ``_quality_common.build_bank``) instead of a freshly
  augmented image; evaluation uses the clean views;
* **trunk**: the frozen backbone prefix is not run (its activations are the bank); the trunk is the
  bank's tail (``cfg.trainable == "tail"``: last block + conv_head, BatchNorm frozen at its ImageNet
  statistics) or the identity over pooled features (``"head"``).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import torch

from bench import _quality_common as qc
from pml_hyperbolic.training.cli import RecipeCommandLine


class BankViews(torch.utils.data.Dataset):
    """``(activations of one view, label)`` per training image; the view is drawn from a generator
    seeded once, so a run (one process, no DataLoader workers) is reproducible."""

    def __init__(self, split: qc.Split, seed: int):
        if split.acts.dim() < 3:
            raise ValueError("BankViews needs per-view activations (N, V, ...)")
        self.acts = split.acts
        self.labels = split.labels.numpy()
        self.super_labels = None if split.super_labels is None else split.super_labels.numpy()
        self.num_classes = int(self.labels.max()) + 1
        self._generator = torch.Generator().manual_seed(10_000 + seed)

    def __len__(self):
        return len(self.acts)

    def __getitem__(self, index):
        view = int(torch.randint(self.acts.shape[1], (1,), generator=self._generator))
        return self.acts[index, view], int(self.labels[index])


class BankSplit(torch.utils.data.Dataset):
    """``(activations, label)`` of an evaluation split (or the clean view of the training split)."""

    def __init__(self, acts: torch.Tensor, labels):
        self.acts = acts
        self.labels = np.asarray(labels)

    def __len__(self):
        return len(self.acts)

    def __getitem__(self, index):
        return self.acts[index], int(self.labels[index])


class _FrozenBatchNorm(torch.nn.Module):
    """The bank's tail with every BatchNorm kept in eval mode (ImageNet statistics), whatever mode
    the trainer sets: the bench's fixed protocol (a batch of 32 classes × 4 would otherwise re-estimate them)."""

    def __init__(self, tail: torch.nn.Module):
        super().__init__()
        self.tail = tail

    def train(self, mode: bool = True):
        super().train(mode)
        for module in self.tail.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.eval()
        return self

    def forward(self, x):
        return self.tail(x)


def bench_arguments(cfg: qc.BenchConfig, seed: int, output_dir: str):
    """The recipe flags that fix the bench's budget (printed in the header of every run). ``--threads``
    is the bench's own count: the recipe's default (``auto``) reads the machine's load before each
    phase, and 1 or 2 threads round the reductions differently, so a row read 44.3 or 49.0 validation
    R@1 for the same seed depending on the load when it started (``bench/row_validation.py --variants
    ms --seeds 0``, 2026-11-26)."""
    return ["--threads", str(torch.get_num_threads()), "--dataset", "glyphs", "--backbone", cfg.backbone, "--image-size", str(cfg.image_size),
            "--batch-size", str(cfg.batch_size), "--samples-per-class", str(cfg.samples_per_class),
            "--epochs", "1", "--steps-per-epoch", str(cfg.steps), "--lr", f"{cfg.lr_tail:g}",
            "--head-lr", f"{cfg.lr_head:g}", "--weight-decay", f"{cfg.weight_decay:g}",
            "--grad-clip", f"{cfg.grad_clip:g}" if cfg.grad_clip else "none", "--embedding-dim", str(cfg.embedding_dim),
            "--freeze-trunk", "true" if cfg.trainable == "head" else "false", "--freeze-patch-embed", "false",
            "--amp", "off", "--seed", str(seed), "--eval-before", "false", "--eval-every", "1",
            "--eval-batch-size", "512", "--no-plots", "--no-tensorboard", "--quiet", "--overwrite",
            "--output-dir", output_dir]


def recipe_on_bank(recipe_cls, bank: qc.Bank, cfg: qc.BenchConfig, seed: int, extra_argv=(), output_dir=None,
                   train_set=None):
    """An instance of ``recipe_cls`` (a recipe script's class) that trains on ``bank``; see the module
    docstring. ``extra_argv``: the row's own recipe flags (e.g. ``["--loss", "triplet"]``);
    ``train_set``: a training dataset of activations to use instead of the bank's views (HCL's scenes)."""
    output_dir = output_dir or tempfile.mkdtemp(prefix=f"bench-{recipe_cls.name}-")

    class OnBank(recipe_cls):
        def setup_data(self):
            self.dataset_name, self.data_root = bank.dataset, None
            self.train_set = self.train_dataset(BankViews(bank.train, seed) if train_set is None else train_set)
            self.train_eval_set = BankSplit(bank.train.acts[:, 0], bank.train.labels)
            self.eval_sets = {"query": BankSplit(bank.query.acts, bank.query.labels)}
            if bank.gallery is None:  # query = reference, leave-one-out (Fashion-MNIST)
                self.splits_to_eval = [("query", ["query"])]
            else:  # the glyph protocol: display-font queries against the serif/sans gallery
                self.eval_sets["gallery"] = BankSplit(bank.gallery.acts, bank.gallery.labels)
                self.splits_to_eval = [("query", ["gallery"])]
        def setup_model(self):
            trunk = qc.fresh_tail(bank)
            if self.args.freeze_trunk:
                trunk.requires_grad_(False)
            self.trunk = _FrozenBatchNorm(trunk).to(self.device)
            self.feature_dim = bank.feature_dim
            self.setup_geometry(lambda: qc.embed(self.trunk, None, bank.train.acts[:2000, 0]))
            self.head = self.build_head(self.feature_dim).to(self.device)

    OnBank.__name__ = OnBank.__qualname__ = recipe_cls.__name__
    args = OnBank.parse(bench_arguments(cfg, seed, output_dir) + list(extra_argv))
    if getattr(args, "degraded_copies", 0):
        # DegradedCopyTrainer blurs / noises / occludes its input: here that would be activations
        raise ValueError(f"{recipe_cls.__name__} on the bank: pass --degraded-copies 0 (the bank holds backbone "
                         "activations, not images; bench/radius.py measures the degraded copies)")
    return OnBank(args)


def load_recipe_class(script: str, class_name: str):
    """The recipe class of ``recipes/<script>.py`` (recipe scripts are not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "recipes", f"{script}.py")
    spec = importlib.util.spec_from_file_location(f"_bench_recipe_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name)


def run_recipe_row(recipe_cls, bank, cfg, seed, extra_argv=(), train_set=None):
    """Train one recipe row on the bank; returns the held-out metrics (``qc.retrieval_metrics`` of the
    final evaluation's embeddings, with the recipe's own kNN curvature) and the recipe instance."""
    import contextlib
    import io
    import shutil

    recipe = recipe_on_bank(recipe_cls, bank, cfg, seed, extra_argv, train_set=train_set)
    log = io.StringIO()  # the run's own lines (epoch losses, summary): the bench prints one line per row
    try:
        with contextlib.redirect_stdout(log):
            recipe.run()
    except BaseException:
        print(log.getvalue())
        raise
    finally:
        shutil.rmtree(recipe.args.output_dir, ignore_errors=True)
    captured = recipe.evaluator.last_embeddings
    q, ql = captured[0], captured[1]
    g, gl = (captured[2], captured[3]) if len(captured) > 2 and captured[2] is not None else (None, None)
    return qc.retrieval_metrics(q, ql, g, gl, c=recipe.eval_curvature()), recipe


class HCLBankScenes(torch.utils.data.Dataset):
    """HCL's training items ``(scene, object view 1, object view 2, scene id)`` from the activation
    bank of composed glyph scenes (``quality.build_hcl_bank``), as ``ComposedGlyphScenes`` yields them."""

    def __init__(self, hcl_bank):
        self.scene, self.view_q, self.view_k = hcl_bank["scene"], hcl_bank["view_q"], hcl_bank["view_k"]
        self.labels = np.arange(len(self.scene))

    def __len__(self):
        return len(self.scene)

    def __getitem__(self, index):
        return self.scene[index], self.view_q[index], self.view_k[index], index


# ------------------------------------------------------------------------------ PML's baselines


class KMeansPseudoLabels:
    """Spherical k-means (faiss) of the current embeddings: the unsupervised baseline's pseudo-labels
    (one level), in the interface of ``pml_hyperbolic.training.pseudo_labels.UnsupervisedPseudoLabels``."""

    def __init__(self, k: int = 100, seed: int = 0):
        self.k, self.seed = int(k), int(seed)

    def uses_embeddings(self):
        return True

    def uses_features(self):
        return False

    def __call__(self, features=None, embeddings=None):
        import faiss

        z = torch.nn.functional.normalize(embeddings.float(), dim=1).numpy().astype(np.float32)
        km = faiss.Kmeans(z.shape[1], self.k, niter=20, seed=self.seed, spherical=True, verbose=False)
        km.cp.min_points_per_centroid = 1
        km.train(z)
        return torch.as_tensor(km.index.search(z, 1)[1][:, :1], dtype=torch.long)


class PMLBaseline(RecipeCommandLine):
    """PML's own losses on the recipes' spherical head, trained by the same runner: the table's
    baselines. ``--pml-loss supcon`` (SupConLoss, τ = 0.1), ``ms`` (MultiSimilarityLoss (2, 50, 0.5) +
    MultiSimilarityMiner ε = 0.1), ``pa`` (ProxyAnchorLoss, margin 0.1, α 32; its proxies train at the
    head's rate), ``triplet`` (TripletMarginLoss, margin 0.1; with
    ``--kmeans-pseudo-labels K`` the unsupervised baseline: k-means pseudo-labels of the embeddings,
    re-clustered at the start of every epoch)."""

    name = "pml_baseline"
    description = __doc__
    hyperbolic = False
    real_dataset = "glyphs"

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--pml-loss", choices=("supcon", "ms", "pa", "triplet"), default="supcon")
        parser.add_argument("--kmeans-pseudo-labels", type=int, default=0, metavar="K")
        parser.add_argument("--parent-weight", type=float, default=0.0,
                            help="--pml-loss ms: weight of MultiSimilarity (and its miner) on the parent labels "
                                 "(ParentLabelLoss), the sphere's counterpart of recipes/hier.py's flag")

    @classmethod
    def runtime_mixins(cls):
        from pml_hyperbolic.training.pseudo_labels import PseudoLabelTraining

        return (PseudoLabelTraining,)

    def __init__(self, args):
        super().__init__(args)
        args.supervised = not args.kmeans_pseudo_labels  # PseudoLabelTraining stays out of the way when supervised

    def train_dataset(self, dataset):
        from pml_hyperbolic.training.pseudo_labels import PseudoLabelledDataset

        return dataset if self.args.supervised else PseudoLabelledDataset(dataset)

    def pseudo_labels(self):
        return KMeansPseudoLabels(self.args.kmeans_pseudo_labels, self.args.seed)

    def build_head(self, in_features):
        from pml_hyperbolic.heads import SphericalEmbeddingHead

        return SphericalEmbeddingHead(in_features, self.args.embedding_dim)

    def build_loss(self):
        from pytorch_metric_learning import losses

        choice = self.args.pml_loss
        if choice == "supcon":
            return losses.SupConLoss(temperature=0.1)
        if choice == "ms":
            main = losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5)
            if not self.args.parent_weight:
                return main  # its miner comes from build_miner
            from pml_hyperbolic.losses import OrderedMultipleLosses, ParentLabelLoss
            from pml_hyperbolic.training.recipe_data import training_class_parents

            parent = ParentLabelLoss(losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5),
                                     training_class_parents(self.train_set), miner=self._ms_miner())
            return OrderedMultipleLosses([main, parent], miners=[self._ms_miner(), None],
                                         weights=[1.0, self.args.parent_weight])
        if choice == "pa":
            from pml_hyperbolic.training.runner import training_class_count

            return losses.ProxyAnchorLoss(num_classes=training_class_count(self.train_set),
                                          embedding_size=self.args.embedding_dim, margin=0.1, alpha=32)
        return losses.TripletMarginLoss(margin=0.1)

    def build_miner(self):
        if self.args.pml_loss != "ms" or self.args.parent_weight:
            return None  # with the parent term, each MultiSimilarity term has its own miner in the loss
        return self._ms_miner()

    @staticmethod
    def _ms_miner():
        from pytorch_metric_learning.miners import MultiSimilarityMiner

        return MultiSimilarityMiner(epsilon=0.1)


class PMLBallBaseline(PMLBaseline):
    """``--pml-loss supcon`` / ``ms`` of :class:`PMLBaseline` on the ball: the recipes' hyperbolic head
    (polar by default; ``--head-radius``, ``--curvature``, ``--clip-r``, ``--radial-calibration`` as in
    every hyperbolic recipe) and PML's loss (and miner) on
    :class:`pml_hyperbolic.distances.PoincareSimilarity` (1 − d/T, T = 2·clip_r), evaluated by the exact
    Poincaré kNN. The combination the docs warn about (SupCon pushes every point to the clip radius)
    measured the way every other row is."""

    name = "pml_ball_baseline"
    hyperbolic = True

    @classmethod
    def add_arguments(cls, parser):
        parser.add_argument("--pml-loss", choices=("supcon", "ms"), default="supcon")
        parser.add_argument("--kmeans-pseudo-labels", type=int, default=0, metavar="K")

    def build_head(self, in_features):
        from pml_hyperbolic.heads import HyperbolicEmbeddingHead

        return HyperbolicEmbeddingHead(in_features, self.args.embedding_dim, c=self.geometry,
                                       radius=self.args.head_radius)

    def _similarity(self):
        if getattr(self, "_poincare_similarity", None) is None:
            from pml_hyperbolic.distances import PoincareSimilarity

            self._poincare_similarity = PoincareSimilarity(c=self.geometry)
        return self._poincare_similarity

    def build_loss(self):
        from pytorch_metric_learning import losses

        if self.args.pml_loss == "supcon":
            return losses.SupConLoss(temperature=0.1, distance=self._similarity())
        return losses.MultiSimilarityLoss(alpha=2, beta=50, base=0.5, distance=self._similarity())

    def build_miner(self):
        if self.args.pml_loss != "ms":
            return None
        from pytorch_metric_learning.miners import MultiSimilarityMiner

        return MultiSimilarityMiner(epsilon=0.1, distance=self._similarity())
