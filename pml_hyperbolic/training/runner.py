"""The shared recipe driver: data → backbone → head → loss → PML trainer → Recall@K → results.

A recipe script subclasses :class:`Recipe`, adds its flags and per-dataset presets, and overrides
``build_head`` / ``build_loss`` (and, when the training step differs, ``trainer_class``). Running
``Recipe.main()`` then gives every recipe the same command line, checkpoints, resume, DDP, logs
and plots.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Dict, Optional

import numpy as np
import torch

from ..backbones import PretrainedWeightsUnavailableError
from ..data.image_list import collate_skipping_unreadable
from . import config as cfg
from .checkpoint import CheckpointManager, restore_trainer, unwrap
from .config import ConfigError
from .distributed import barrier, cleanup, init_distributed, wrap_loss, wrap_miner, wrap_model
from .evaluation import EpochEndEvaluator, Evaluator, build_tester, eval_protocol, format_recall
from .run_logger import RunLogger
from .trainer import HyperbolicTrainer, resolve_amp



# ----------------------------------------------------------------------------------------------
# small building blocks (public: tests and other scripts use them)
# ----------------------------------------------------------------------------------------------
def select_device(name: str = "auto") -> torch.device:
    """'auto' → CUDA when available else CPU; an explicit CUDA request without CUDA is an error."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name} was requested but CUDA is not available on this machine "
                              "(torch.cuda.is_available() is False). Use --device cpu (or --device auto), or "
                              "install a CUDA build of PyTorch that matches your driver.")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible.")
        return device
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"--device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")


def seed_everything(seed: int, deterministic: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def check_batch_settings(batch_size: int, samples_per_class: int, world_size: int = 1) -> int:
    """Per-process batch size; a batch must hold whole classes of ``samples_per_class`` images each."""
    if samples_per_class < 1:
        raise ConfigError(f"--samples-per-class must be >= 1, got {samples_per_class}")
    if batch_size % world_size:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by the number of processes {world_size}; "
                          f"use a multiple of {world_size * samples_per_class}.")
    per_rank = batch_size // world_size
    if per_rank % samples_per_class:
        lower = per_rank - per_rank % samples_per_class
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by --samples-per-class {samples_per_class}"
            + (f" (per process: {per_rank})" if world_size > 1 else "")
            + f": a batch holds whole classes. Use e.g. --batch-size {lower * world_size} or "
              f"{(lower + samples_per_class) * world_size}.")
    if per_rank // samples_per_class < 2:
        raise ConfigError(f"--batch-size {batch_size} with --samples-per-class {samples_per_class} gives fewer than "
                          "2 classes per batch: metric losses need negatives. Increase --batch-size.")
    return per_rank


def resolve_dataset(requested: str, data_root: Optional[str], real_default: str):
    """Map ``--dataset`` to (canonical name, root, banner-or-None).

    'auto' looks for ``real_default`` (``--data-root``, else the dataset's environment variable or
    ``$PML_HYPERBOLIC_DATA``, via :func:`pml_hyperbolic.data.find_dataset_root`); when absent it falls
    back to the bundled glyphs and returns a one-line banner saying so. An explicit ``--data-root``
    that holds no recognisable layout is an error (never a silent fallback).
    """
    from ..data import find_dataset_root
    from ..data.registry import ROOT_ENVIRONMENT_VARIABLES, SHARED_DATA_VARIABLE

    name = cfg.DATASET_ALIASES[requested]
    if name == "glyphs":
        return "glyphs", None, None
    target = real_default if name == "auto" else name
    root = find_dataset_root(target, data_root)
    if root is not None and (data_root is None or os.path.abspath(os.path.expanduser(root))
                             == os.path.abspath(os.path.expanduser(data_root))):
        return target, root, None
    env = ROOT_ENVIRONMENT_VARIABLES.get(target, "")
    if name == "auto" and data_root is None:
        banner = (f"[pml-hyperbolic] {target} not found (no --data-root; ${env} / ${SHARED_DATA_VARIABLE} unset or "
                  f"not holding it): using the bundled glyph dataset. For the real data pass --data-root DIR or "
                  f"set {env}=DIR.")
        return "glyphs", None, banner
    raise ConfigError(missing_data_message(target, data_root))


def missing_data_message(name: str, data_root: Optional[str]) -> str:
    """helper-1's layout description of ``name`` plus what to do."""
    from ..data.registry import DATASET_CLASSES, ROOT_ENVIRONMENT_VARIABLES
    from ..data.image_list import missing_dataset_error

    cls = DATASET_CLASSES[name]
    env = ROOT_ENVIRONMENT_VARIABLES.get(name, "")
    where = data_root if data_root else f"${env} (unset or not holding the data)"
    detail = str(missing_dataset_error(name, where, cls.LAYOUTS, cls.SOURCE))
    return (f"{detail}\nFix: pass --data-root DIR (the folder in one of the layouts above) or set {env}=DIR; "
            "or run on the bundled data with --dataset glyphs.")


def backbone_size_kwargs(name: str, image_size: int) -> Dict:
    """Vision transformers need the input size at construction (position embeddings); CNNs do not."""
    base = name.split(".")[0].lower()
    if any(tag in base for tag in ("vit", "deit", "beit", "eva")):
        return {"img_size": int(image_size)}
    return {}


def freeze_patch_embedding(model: torch.nn.Module) -> int:
    """Freeze ``patch_embed`` (Hyp-ViT trains everything else); returns the number of frozen tensors."""
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith("patch_embed") or ".patch_embed." in name:
            p.requires_grad_(False)
            frozen += 1
    return frozen


@torch.no_grad()
def backbone_features(model, dataset, device, max_samples=1000, batch_size=128, seed=0):
    """Backbone outputs for a seeded subset (δ-hyperbolicity / curvature estimate)."""
    n = len(dataset)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_samples].tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=batch_size,
                                         collate_fn=collate_skipping_unreadable)
    was_training = model.training
    model.eval()
    feats = [model(batch[0].to(device)).float().cpu() for batch in loader if batch is not None]
    model.train(was_training)
    return torch.cat(feats)


def seeded_subset(dataset, max_samples: Optional[int], seed: int = 0):
    if not max_samples or len(dataset) <= max_samples:
        return dataset
    idx = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:max_samples]
    return torch.utils.data.Subset(dataset, sorted(idx.tolist()))


class LabelledSubset(torch.utils.data.Subset):
    """``Subset`` that keeps the ``labels`` (and ``num_classes``) the samplers and losses need."""

    @property
    def labels(self):
        return np.asarray(self.dataset.labels)[np.asarray(self.indices)]

    @property
    def num_classes(self):
        return getattr(self.dataset, "num_classes", None)


def train_subset_indices(n: int, max_samples: Optional[int], seed: int = 0):
    if not max_samples or n <= max_samples:
        return None
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))[:max_samples].tolist())


def dataset_labels(dataset) -> np.ndarray:
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ConfigError(f"{type(dataset).__name__} has no .labels attribute; the class-balanced sampler needs it")
    labels = np.asarray(labels)
    return labels[:, 0] if labels.ndim == 2 else labels


# ----------------------------------------------------------------------------------------------
# the recipe driver
# ----------------------------------------------------------------------------------------------
def _silence_pml_missing_key(key: str) -> None:
    """Drop PML's 'optimizers is missing "<key>"' warning, which is expected for a frozen model."""
    import logging

    from pytorch_metric_learning.utils import common_functions as c_f

    class _DropMissingKey(logging.Filter):
        def filter(self, record):
            return f'missing "{key}"' not in record.getMessage()

    if not any(isinstance(f, _DropMissingKey) for f in c_f.LOGGER.filters):
        c_f.LOGGER.addFilter(_DropMissingKey())


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the recipe docstring's layout (its example commands) and shows every default."""


class Recipe:
    """Base class of the recipe scripts. Subclasses set the class attributes and override builders."""

    name = "recipe"
    description = ""
    real_dataset = "cars196"        # what --dataset auto looks for
    hyperbolic = True               # evaluate with the hyperbolic kNN and plot the Poincaré disk
    default_backbone = "vit_small_patch16_224"
    trainer_class = HyperbolicTrainer
    label_hierarchy_level = 0
    # Settings for the bundled-glyph path on CPU (a small pretrained CNN at small size; the
    # paper's ViT-S/16 at 224 px would take hours on 2 cores).
    glyph_preset: Dict = {
        "backbone": "efficientnet_lite0", "pretrained": True, "image_size": 48, "resize_size": 48,
        "batch_size": 120, "samples_per_class": 4, "lr": 3e-4, "head_lr": 3e-3, "epochs": 3,
        "steps_per_epoch": 15, "amp": "auto", "freeze_patch_embed": False, "freeze_trunk": True,
        "eval_batch_size": 256, "eval_every": 0,
    }
    paper_presets: Dict[str, Dict] = {}

    def __init__(self, args: argparse.Namespace):
        self.args = args

    # ---- command line ----
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Recipe-specific flags."""

    @classmethod
    def make_parser(cls) -> argparse.ArgumentParser:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else f"{cls.name}.py"
        parser = argparse.ArgumentParser(
            prog=prog, description=cls.description,
            epilog="Defaults shown are the generic ones; the dataset's preset (the paper's settings for a "
                   "real benchmark, the CPU demo for the bundled glyphs) replaces them unless the flag "
                   "is given (or set in --config).",
            formatter_class=_HelpFormatter)
        cfg.add_common_arguments(parser, default_backbone=cls.default_backbone, hyperbolic=cls.hyperbolic)
        cls.add_arguments(parser)
        return parser

    @classmethod
    def presets(cls, args) -> Dict:
        name = cfg.DATASET_ALIASES.get(args.dataset, args.dataset)
        if name == "auto":
            name, _, _ = resolve_dataset("auto", args.data_root, cls.real_dataset)
        if name == "glyphs":
            return dict(cls.glyph_preset)
        return dict(cls.paper_presets.get(name, {}))

    @classmethod
    def parse(cls, argv=None) -> argparse.Namespace:
        return cfg.parse_config(cls.make_parser, argv, presets=cls.presets)

    @classmethod
    def main(cls, argv=None) -> Dict:
        """Entry point of a recipe script: user errors print one message and exit with status 2."""
        try:
            args = cls.parse(argv)
            return cls(args).run()
        except (ConfigError, PretrainedWeightsUnavailableError) as err:
            print(f"error: {err}", file=sys.stderr)
            raise SystemExit(2)

    # ---- overridable builders ----
    def curvature(self) -> Optional[float]:
        return getattr(self, "c", None)

    def build_head(self, in_features: int) -> torch.nn.Module:
        from ..heads import HyperbolicEmbeddingHead

        return HyperbolicEmbeddingHead(in_features, self.args.embedding_dim, c=self.geometry,
                                       radius=getattr(self.args, "head_radius", "learned"))

    def build_loss(self):
        raise NotImplementedError

    def build_miner(self):
        return None

    def eval_curvature(self) -> Optional[float]:  # noqa: D401
        """c for the tester's kNN (None = cosine/Euclidean)."""
        return self.c if self.hyperbolic else None

    def train_dataset(self, dataset):
        return dataset

    def build_sampler(self, labels, per_rank_batch):
        from ..data import ClassBalancedBatchSampler

        a = self.args
        return ClassBalancedBatchSampler(labels, per_rank_batch, a.samples_per_class, num_batches=a.steps_per_epoch,
                                         seed=a.seed, rank=self.ctx.rank if self.ctx.enabled else None,
                                         world_size=self.ctx.world_size if self.ctx.enabled else None)

    def trainer_kwargs(self) -> Dict:
        return {}

    def plots(self, embeddings, labels, reference_embeddings=None, reference_labels=None) -> Dict[str, str]:
        """Poincaré disk + uncertainty-vs-recall of the final test embeddings (helper-D's plots)."""
        if not self.hyperbolic or embeddings is None:
            return {}
        from ..evaluation import plot_poincare_disk, plot_uncertainty_vs_recall

        out = {}
        disk = os.path.join(self.run_dir, "poincare_disk.png")
        plot_poincare_disk(embeddings, labels, disk, c=self.geometry, radius_histogram=True)
        out["poincare_disk"] = disk
        unc = os.path.join(self.run_dir, "uncertainty_vs_recall.png")
        clip = getattr(self.args, "clip_r", None)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said once, plainly, below
            protocol = ("queries vs gallery, as the run's Recall@1" if reference_embeddings is not None
                        else "self-retrieval among the test embeddings")
            table = plot_uncertainty_vs_recall(embeddings, labels, unc, c=self.geometry,
                                               reference_embeddings=reference_embeddings,
                                               reference_labels=reference_labels,
                                               title=f"Recall@1 per uncertainty bin\n({protocol})",
                                               n_bins=5,  # quintiles: ~±3 points of noise per bin at 1,000 queries
                                               **({"clip_r": clip} if clip is not None else {}))
        if len(table) == 1:
            self.say("[pml-hyperbolic] every test embedding sits at the clip radius, so the Hyp-UML uncertainty "
                     "is the same for all of them: the uncertainty-vs-recall plot has one bin (and an "
                     "uncertainty-adaptive loss acts as its fixed-temperature/margin form).")
        else:
            self.say("uncertainty bins (most certain → least; " + protocol + "): Recall@1 "
                     + " ".join(f"{row['recall_at_1']:.2f}" for row in table)
                     + f"  (n = {table[0]['count']} per bin)")
        out["uncertainty_vs_recall"] = unc
        self.uncertainty_table = table
        return out

    # ---- setup ----
    def say(self, *parts) -> None:
        if self.ctx.is_main:
            print(*parts, flush=True)

    def setup_data(self):
        from ..data import build_dataset, build_transforms

        a = self.args
        self.dataset_name, self.data_root, banner = resolve_dataset(a.dataset, a.data_root, self.real_dataset)
        if banner:
            self.say(banner)
            self.say(f"[pml-hyperbolic] bundled-data settings: backbone {a.backbone} "
                     f"({'ImageNet-pretrained' if a.pretrained else 'random init'}"
                     f"{', frozen: head-only training' if a.freeze_trunk else ''}) at {a.image_size}px, batch "
                     f"{a.batch_size} ({a.samples_per_class}/class), {a.epochs} epochs x {a.steps_per_epoch} steps; "
                     "the paper's ViT-S/16 setup runs with the real data (see --help).")
        kind = "glyph" if self.dataset_name == "glyphs" else "imagenet"
        train_tf = build_transforms(kind, train=True, image_size=a.image_size, resize_size=a.resize_size)
        eval_tf = build_transforms(kind, train=False, image_size=a.image_size, resize_size=a.resize_size)
        train_set = build_dataset(self.dataset_name, "train", root=self.data_root, transform=train_tf)
        train_eval_set = build_dataset(self.dataset_name, "train", root=self.data_root, transform=eval_tf)
        idx = train_subset_indices(len(train_set), a.max_train_samples, a.seed)
        if idx is not None:  # the same images in both views of the training set
            train_set, train_eval_set = LabelledSubset(train_set, idx), LabelledSubset(train_eval_set, idx)
        self.train_set = self.train_dataset(train_set)
        self.train_eval_set = train_eval_set
        self.splits_to_eval = eval_protocol(self.dataset_name)
        names = {q for q, _ in self.splits_to_eval} | {r for _, refs in self.splits_to_eval for r in refs}
        self.eval_sets = {s: seeded_subset(build_dataset(self.dataset_name, s, root=self.data_root, transform=eval_tf),
                                           a.max_eval_samples, a.seed) for s in names}

    def count_unreadable(self) -> int:
        """Distinct unreadable images met so far in the training and evaluation sets (the counts are
        shared with DataLoader workers; the two training views share their files)."""
        def base(ds):
            while isinstance(ds, torch.utils.data.Subset) or hasattr(ds, "base"):
                ds = ds.dataset if isinstance(ds, torch.utils.data.Subset) else ds.base
            return ds

        bases = {id(b): b for b in map(base, [self.train_set, self.train_eval_set, *self.eval_sets.values()])}
        paths = set()
        for b in bases.values():
            paths.update(getattr(b, "unreadable_paths", ()))
        return len(paths) + sum(getattr(b, "_dropped_unreadable", 0) for b in bases.values())

    def setup_model(self):
        from ..backbones import build_backbone

        a = self.args
        trunk, dim = build_backbone(a.backbone, pretrained=a.pretrained, checkpoint=a.backbone_checkpoint,
                                    **backbone_size_kwargs(a.backbone, a.image_size))
        if a.freeze_patch_embed:
            freeze_patch_embedding(trunk)
        if a.freeze_trunk:
            trunk.requires_grad_(False)
        self.trunk = trunk.to(self.device)
        self.feature_dim = dim
        self.c = None
        if getattr(a, "curvature", None) is not None:
            self.c = a.curvature
            if a.curvature == "auto":
                from ..evaluation import suggest_curvature

                feats = backbone_features(self.trunk, self.train_eval_set, self.device, seed=a.seed)
                self.c = float(suggest_curvature(feats))
                self.say(f"[pml-hyperbolic] --curvature auto: δ-hyperbolicity of {len(feats)} backbone features "
                         f"suggests c = {self.c:.4g}")
        self.geometry = None
        if self.c is not None:
            from ..geometry import PoincareGeometry

            clip_r = getattr(a, "clip_r", None)
            self.geometry = PoincareGeometry(c=self.c, clip="hard" if clip_r is not None else None, clip_r=clip_r)
        self.head = self.build_head(dim).to(self.device)

    def build_optimizers(self, trunk, head, loss_funcs: Dict) -> Dict:
        a = self.args
        # PML convention: one optimiser per model ("trunk_optimizer", "embedder_optimizer").
        opts = {}
        for key, module, lr in (("trunk", trunk, a.lr), ("embedder", head, a.head_lr if a.head_lr is not None else a.lr)):
            params = [p for p in module.parameters() if p.requires_grad]
            if params:
                opts[f"{key}_optimizer"] = torch.optim.AdamW(params, lr=lr, weight_decay=a.weight_decay)
        for name, loss in loss_funcs.items():
            # Learnable loss parameters (e.g. HypMix's λ) get their own optimiser, PML-style.
            params = [p for p in loss.parameters() if p.requires_grad] if isinstance(loss, torch.nn.Module) else []
            if params:
                opts[f"{name}_optimizer"] = torch.optim.AdamW(params, lr=a.head_lr or a.lr, weight_decay=0.0)
        return opts

    def default_run_dir(self) -> str:
        return os.path.join("runs", f"{self.name}-{self.dataset_name}")

    # ---- main flow ----
    def run(self) -> Dict:
        a = self.args
        t0 = time.time()
        if a.quiet:
            os.environ["TQDM_DISABLE"] = "1"  # also silences PML's tester bars
        self.device = select_device(a.device)
        self.ctx = init_distributed(self.device, a.dist_backend)
        try:
            return self._run(t0)
        finally:
            cleanup(self.ctx)

    def _run(self, t0) -> Dict:
        a = self.args
        if self.ctx.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.ctx.local_rank)
            torch.cuda.set_device(self.device)
        per_rank_batch = check_batch_settings(a.batch_size, a.samples_per_class, self.ctx.world_size)
        amp_dtype, use_scaler = resolve_amp(a.amp, self.device)  # a bad --amp fails before any data is read
        seed_everything(a.seed, a.deterministic)
        self.setup_data()
        self.run_dir = a.output_dir or self.default_run_dir()
        config = cfg.config_to_dict(a)
        config["dataset_resolved"] = self.dataset_name
        self.config = config
        run_logger = RunLogger(self.run_dir, enabled=self.ctx.is_main, tensorboard=not a.no_tensorboard)
        checkpoints = CheckpointManager(self.run_dir, config, enabled=self.ctx.is_main)
        resume_path = checkpoints.resolve(a.resume)
        checkpoint = checkpoints.load(resume_path) if resume_path else None
        if self.ctx.is_main:
            run_logger.write_json("config.json", {k: v for k, v in config.items() if k != "resume"})

        self.setup_model()
        loss = self.build_loss()
        miner = self.build_miner()
        loss_funcs = loss if isinstance(loss, dict) else {"metric_loss": loss}
        optimizers = self.build_optimizers(self.trunk, self.head, loss_funcs)
        loss_funcs = {k: (v.to(self.device) if isinstance(v, torch.nn.Module) else v) for k, v in loss_funcs.items()}
        labels = dataset_labels(self.train_set)
        sampler = self.build_sampler(labels, per_rank_batch)

        tester = build_tester(self.eval_curvature(), a.k_values, a.eval_batch_size, self.device, a.num_workers)
        evaluator = Evaluator(tester, self.eval_sets, self.splits_to_eval, a.k_values).install()
        hook = EpochEndEvaluator(
            evaluator, checkpoints, run_logger, self.ctx, a.k_values,
            curvature_fn=(lambda: unwrap(self.head).c) if self.hyperbolic and hasattr(self.head, "c") else None,
            stop_after_epoch=a.stop_after_epoch, verbose=True, eval_every=a.eval_every, num_epochs=a.epochs,
            history=checkpoint["history"] if checkpoint else None, best=checkpoint["best"] if checkpoint else None)
        mining_funcs = {"tuple_miner": wrap_miner(miner, self.ctx)} if miner is not None else {}
        if "trunk_optimizer" not in optimizers:
            _silence_pml_missing_key("trunk_optimizer")  # a frozen trunk has nothing to optimise
        trainer = self.trainer_class(
            models={"trunk": wrap_model(self.trunk, self.ctx, self.device),
                    "embedder": wrap_model(self.head, self.ctx, self.device)},
            optimizers=optimizers, batch_size=per_rank_batch,
            loss_funcs={k: wrap_loss(v, self.ctx) for k, v in loss_funcs.items()}, mining_funcs=mining_funcs,
            dataset=self.train_set, sampler=sampler, iterations_per_epoch=a.steps_per_epoch,
            collate_fn=collate_skipping_unreadable,
            data_device=self.device, dataloader_num_workers=a.num_workers,
            label_hierarchy_level=self.label_hierarchy_level, end_of_epoch_hook=hook,
            freeze_these=("trunk",) if a.freeze_trunk else (),  # PML keeps a frozen model in eval mode
            amp_dtype=amp_dtype, use_grad_scaler=use_scaler, grad_clip_norm=a.grad_clip, max_steps=a.max_steps,
            show_progress=self.ctx.is_main and not a.quiet, **self.trainer_kwargs())
        self.trainer = trainer

        before = None
        start_epoch = 1
        if checkpoint is not None:
            restore_trainer(trainer, checkpoint)
            start_epoch = int(checkpoint["epoch"]) + 1
            before = self._load_before()
            run_logger.truncate_after(int(checkpoint["epoch"]))
            self.say(f"[pml-hyperbolic] resumed from {resume_path} (epoch {checkpoint['epoch']}, "
                     f"step {checkpoint['global_step']})")
        elif a.eval_before:
            if self.ctx.is_main:
                before = evaluator(self.trunk, self.head, 0)
                self.say(f"before training  {format_recall(before, a.k_values)}")
                run_logger.write_json("before.json", before)
            barrier(self.ctx)

        trainer.train(start_epoch=start_epoch, num_epochs=a.epochs)

        results = {}
        if self.ctx.is_main:
            ran_epochs = hook.history and hook.history[-1]["epoch"] >= start_epoch
            if ran_epochs and "recall_at_1" in hook.history[-1]:
                after = {k: v for k, v in hook.history[-1].items() if k.startswith("recall_at_")}
            else:
                after = evaluator(self.trunk, self.head, trainer.global_step)
            self.say(f"after training   {format_recall(after, a.k_values)}")
            emb = evaluator.last_embeddings
            plots = {}
            if not a.no_plots and emb is not None:
                try:
                    plots = self.plots(*emb)
                except (ImportError, ValueError) as err:  # e.g. too few points for the bins
                    self.say(f"[pml-hyperbolic] plots skipped: {err}")
            results = {
                "recipe": self.name, "dataset": self.dataset_name, "curvature": self.c,
                "before": before, "after": after, "best": hook.best,
                "epochs_completed": hook.history[-1]["epoch"] if hook.history else 0,
                "global_step": trainer.global_step, "history": hook.history, "plots": plots,
                "wall_seconds": round(time.time() - t0, 1), "device": str(self.device),
                "world_size": self.ctx.world_size, "run_dir": self.run_dir,
                "uncertainty_vs_recall": getattr(self, "uncertainty_table", None),
            }
            unreadable = self.count_unreadable()
            if unreadable:
                self.say(f"[pml-hyperbolic] {unreadable} unreadable image(s) were skipped (see the warnings above; "
                         "dataset.check_images() lists them)")
            results["unreadable_images_skipped"] = unreadable
            run_logger.write_json("results.json", results)
            self.say(f"[pml-hyperbolic] results, checkpoints and plots in {self.run_dir}/ "
                     f"({results['wall_seconds']:.0f} s)")
        run_logger.close()
        barrier(self.ctx)
        return results

    def _load_before(self):
        import json

        path = os.path.join(self.run_dir, "before.json")
        if os.path.isfile(path):
            with open(path) as handle:
                return json.load(handle)
        return None


@torch.no_grad()
def compute_embeddings(trunk, head, dataset, device, batch_size=128, num_workers=0) -> torch.Tensor:
    """Head outputs (float32, CPU) of a whole dataset in eval mode; modules' modes are restored."""
    trunk, head = unwrap(trunk), unwrap(head)
    modes = (trunk.training, head.training)
    trunk.eval()
    head.eval()
    loader = torch.utils.data.DataLoader(_WithIndex(dataset), batch_size=batch_size, num_workers=num_workers,
                                         collate_fn=collate_skipping_unreadable)
    out = None
    for batch in loader:
        if batch is None:  # every image of the batch was unreadable: its rows stay at the origin
            continue
        index, images = batch
        emb = head(trunk(images.to(device))).float().cpu()
        if out is None:
            # rows of unreadable images (skipped by the loader) stay at the origin
            out = torch.zeros(len(dataset), emb.shape[1])
        out[index] = emb
    trunk.train(modes[0])
    head.train(modes[1])
    if out is None:
        raise RuntimeError("no readable image in the dataset: nothing to embed")
    return out


class _WithIndex(torch.utils.data.Dataset):
    """``(index, image)`` items, ``None`` where the base dataset skipped an unreadable image, so
    that per-index outputs stay aligned."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        item = self.base[index]
        return None if item is None else (index, item[0])
