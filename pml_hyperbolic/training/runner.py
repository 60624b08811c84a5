"""The shared recipe driver: data → backbone → head → loss → PML trainer → Recall@K → results.

A recipe script subclasses :class:`Recipe`, adds its flags and per-dataset presets, and overrides
``build_head`` / ``build_loss`` (and, when the training step differs, ``trainer_class``). Running
``Recipe.main()`` then gives every recipe the same command line, checkpoints, resume, DDP, logs
and plots.

Design note: docs/design/training.md
"""
from __future__ import annotations

import gc
import os
import random
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..backbones import PretrainedWeightsUnavailableError
from ..data.image_list import DatasetNotFoundError, collate_skipping_unreadable
from . import config as cfg
from .checkpoint import CheckpointManager, ctrl_c_deferred, restore_trainer, unwrap
from .command_line import (RecipeCommandLineBase, backup_previous_run, discard_previous_run,  # noqa: F401
                           missing_data_message, previous_run_files, resolve_dataset, restore_previous_run)
# check_batch_settings and RunWriteError: public here too
from .config import ConfigError, RunWriteError, check_batch_settings, run_write_error  # noqa: F401
from .distributed import barrier, cleanup, init_distributed, wrap_loss, wrap_miner, wrap_model
from .evaluation import EpochEndEvaluator, Evaluator, build_tester, eval_protocol, format_recall
from .radius_terms import add_radius_terms
from .run_logger import RunLogger
from .trainer import HyperbolicTrainer, resolve_amp



# ----------------------------------------------------------------------------------------------
# small building blocks (public: tests and other scripts use them)
# ----------------------------------------------------------------------------------------------
def select_device(name: str = "auto") -> torch.device:
    """The device ``--device`` names: 'auto' → CUDA when available else CPU.

    Args:
        name: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (case and spaces ignored).

    Returns:
        The ``torch.device``.

    Raises:
        ConfigError: CUDA requested but unavailable, an index beyond the visible devices, or an
            unknown name.
    """
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
    """Seed Python's, NumPy's and torch's generators; ``deterministic`` also asks torch for
    deterministic algorithms (warn-only) and turns cuDNN benchmarking off."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


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
def backbone_features(model: torch.nn.Module, dataset: torch.utils.data.Dataset, device: torch.device,
                      max_samples: int = 1000, batch_size: int = 128, seed: int = 0) -> torch.Tensor:
    """Backbone outputs (float32, CPU, eval mode) for a seeded subset of at most ``max_samples``
    images: the input of the δ-hyperbolicity curvature estimate. The model's mode is restored."""
    n = len(dataset)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:max_samples].tolist()
    loader = torch.utils.data.DataLoader(torch.utils.data.Subset(dataset, idx), batch_size=batch_size,
                                         collate_fn=collate_skipping_unreadable)
    was_training = model.training
    model.eval()
    feats = [model(batch[0].to(device)).float().cpu() for batch in loader if batch is not None]
    model.train(was_training)
    return torch.cat(feats)


def seeded_subset(dataset: torch.utils.data.Dataset, max_samples: Optional[int],
                  seed: int = 0) -> torch.utils.data.Dataset:
    """``dataset`` itself, or a seeded subset of ``max_samples`` items (in index order)."""
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


def train_subset_indices(n: int, max_samples: Optional[int], seed: int = 0) -> Optional[List[int]]:
    """Sorted seeded indices of ``max_samples`` of ``n`` training items, or None to keep them all."""
    if not max_samples or n <= max_samples:
        return None
    return sorted(torch.randperm(n, generator=torch.Generator().manual_seed(seed + 1))[:max_samples].tolist())


def dataset_labels(dataset: Any) -> np.ndarray:
    """The first-level ``labels`` of ``dataset`` as a 1-D array.

    Raises:
        ConfigError: the dataset has no ``labels`` attribute.
    """
    labels = getattr(dataset, "labels", None)
    if labels is None:
        raise ConfigError(f"{type(dataset).__name__} has no .labels attribute; the class-balanced sampler needs it")
    labels = np.asarray(labels)
    return labels[:, 0] if labels.ndim == 2 else labels


def training_class_count(dataset: Any) -> int:
    """Number of classes a per-class component (proxies, margins) needs: the dataset's ``num_classes``
    when it declares one, else 1 + its largest first-level label (labels index the classes).

    Raises:
        ConfigError: no labels, or negative labels.
    """
    declared = getattr(dataset, "num_classes", None)
    if declared is not None:
        return int(declared)
    labels = dataset_labels(dataset)
    if labels.size == 0 or labels.min() < 0:
        raise ConfigError(f"{type(dataset).__name__}'s labels must be non-negative class indices to size "
                          f"per-class parameters (got {'none' if labels.size == 0 else int(labels.min())})")
    return int(labels.max()) + 1


# ----------------------------------------------------------------------------------------------
# the recipe driver
# ----------------------------------------------------------------------------------------------
def freeze_long_lived_objects() -> None:
    """Take every object alive now out of the cyclic garbage collector's scans (``gc.freeze``).

    Why: a run imports torch, PML, scipy, torchvision (with torch._dynamo) and timm, ~500k objects
    that live as long as the process. Each full collection scans all of them and finds nothing, and
    the imports themselves trigger one each time the heap grows by a quarter. Frozen, they are
    skipped; objects created later are collected as usual.
    :meth:`Recipe.run` calls ``gc.unfreeze()`` when it ends (garbage frozen meanwhile is then
    collectable again).

    Design note: docs/design/training.md
    """
    gc.freeze()


def _silence_pml_missing_key(key: str) -> None:
    """Drop PML's 'optimizers is missing "<key>"' warning, which is expected for a frozen model."""
    import logging

    from pytorch_metric_learning.utils import common_functions as c_f

    class _DropMissingKey(logging.Filter):
        def filter(self, record):
            return f'missing "{key}"' not in record.getMessage()

    if not any(isinstance(f, _DropMissingKey) for f in c_f.LOGGER.filters):
        c_f.LOGGER.addFilter(_DropMissingKey())


class Recipe(RecipeCommandLineBase):
    """The runnable recipe: data, model, training, evaluation and results (torch, PML).

    Recipe scripts subclass :class:`~.cli.RecipeCommandLine` (light); instantiating one makes it a
    subclass of this class. Both derive from :class:`~.command_line.RecipeCommandLineBase`, so this
    module never imports ``cli``. Subclassing ``Recipe`` directly works as well (then importing the script
    imports torch). Subclasses override the builders below.

    Design note: docs/design/training.md
    """

    trainer_class = HyperbolicTrainer

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

    def train_dataset(self, dataset: torch.utils.data.Dataset) -> torch.utils.data.Dataset:
        """The training set as the trainer sees it (e.g. wrapped for pseudo-labels)."""
        return dataset

    def build_sampler(self, labels: np.ndarray, per_rank_batch: int):
        """The class-balanced batch sampler of this rank."""
        from ..data import ClassBalancedBatchSampler

        a = self.args
        return ClassBalancedBatchSampler(labels, per_rank_batch, a.samples_per_class, num_batches=a.steps_per_epoch,
                                         seed=a.seed, rank=self.ctx.rank if self.ctx.enabled else None,
                                         world_size=self.ctx.world_size if self.ctx.enabled else None)

    def trainer_kwargs(self) -> Dict:
        return {}

    def plots(self, embeddings: torch.Tensor, labels: torch.Tensor, reference_embeddings: Optional[torch.Tensor] = None,
              reference_labels: Optional[torch.Tensor] = None) -> Dict[str, str]:
        """Poincaré disk + uncertainty-vs-recall of the final test embeddings; ``{name: png path}``."""
        if not self.hyperbolic or embeddings is None:
            return {}
        from ..evaluation import plot_poincare_disk, plot_uncertainty_vs_recall

        out = {}
        disk = os.path.join(self.run_dir, "poincare_disk.png")
        plot_poincare_disk(embeddings, labels, disk, c=self.geometry, radius_histogram=True)
        out["poincare_disk"] = disk
        unc = os.path.join(self.run_dir, "uncertainty_vs_recall.png")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said once, plainly, below
            protocol = ("queries vs gallery, as the run's Recall@1" if reference_embeddings is not None
                        else "self-retrieval among the test embeddings")
            table = plot_uncertainty_vs_recall(embeddings, labels, unc, c=self.geometry,
                                               reference_embeddings=reference_embeddings,
                                               reference_labels=reference_labels,
                                               title=f"Recall@1 per uncertainty bin\n({protocol})",
                                               n_bins=5)  # quintiles: enough queries per bin to read its recall
        # The plot is drawn for every hyperbolic recipe; only Hyp-UML (whose loss uses the uncertainty)
        # explains a degenerate one. Its bins are printed in the end-of-run summary.
        radius_said = getattr(getattr(self, "evaluator", None), "radius_report", None) is not None  # in the summary
        if self.reports_uncertainty and len(table) == 1 and not radius_said:
            self.say("[pml-hyperbolic] every test embedding sits at the clip radius, so the Hyp-UML uncertainty "
                     "is the same for all of them: the uncertainty-vs-recall plot has one bin (and an "
                     "uncertainty-adaptive loss acts as its fixed-temperature/margin form).")
        out["uncertainty_vs_recall"] = unc
        self.uncertainty_table = table
        from ..evaluation import uncertainty_failure_auroc

        self.uncertainty_auroc = uncertainty_failure_auroc(
            embeddings, labels, c=self.geometry, reference_embeddings=reference_embeddings,
            reference_labels=reference_labels)  # U's clip radius: the geometry's
        return out

    def retrieval_grid(self, embeddings: torch.Tensor, labels: torch.Tensor,
                       reference_embeddings: Optional[torch.Tensor] = None,
                       reference_labels: Optional[torch.Tensor] = None) -> Dict[str, str]:
        """Top-5 neighbours of six seeded queries on the run's own protocol (every recipe): correct
        neighbours framed green, wrong ones red."""
        from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
        from ..evaluation import plot_retrieval_grid_from_embeddings

        query_split, reference_splits = self.splits_to_eval[0]
        gallery_set = None
        if reference_embeddings is not None:  # the splits and order of Evaluator.capture_hook
            others = [self.eval_sets[s] for s in reference_splits if s != query_split]
            gallery_set = others[0] if len(others) == 1 else torch.utils.data.ConcatDataset(others)
        path = os.path.join(self.run_dir, "retrieval_grid.png")
        plot_retrieval_grid_from_embeddings(
            embeddings, reference_embeddings, labels, reference_labels, self.eval_sets[query_split], gallery_set,
            path, c=self.geometry if self.eval_curvature() is not None else None,
            metric="euclidean",  # the tester's kNN on unnormalised outputs when there is no curvature
            n_queries=6, k=5, seed=self.args.seed, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        return {"retrieval_grid": path}

    # ---- setup ----
    def say(self, *parts: Any) -> None:
        """Print on the main process only."""
        if self.ctx.is_main:
            print(*parts, flush=True)

    def status(self, message: str) -> None:
        """A progress line for a phase that can take seconds (silenced by --quiet)."""
        if not self.args.quiet:
            self.say(f"[pml-hyperbolic] {message}")

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
        self.status(f"indexing the {self.dataset_name} data" + (f" in {self.data_root}" if self.data_root else "")
                    + " ...")
        started = time.time()
        # the glyph pipeline keeps drawings unmirrored and uncropped (a mirrored character or arrow is
        # another class): the glyphs and the monochrome icon sets; everything else, the RGB theme icons
        # included, takes the ImageNet one
        kind = "glyph" if self.dataset_name in ("glyphs", "iconify") else "imagenet"
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
        sizes = ", ".join(f"{split} {len(ds)}" for split, ds in sorted(self.eval_sets.items()))
        self.status(f"data ready: train {len(self.train_eval_set)}, {sizes} images ({time.time() - started:.1f} s)")

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
        weights = (f"weights from {a.backbone_checkpoint}" if a.backbone_checkpoint
                   else "pretrained weights" if a.pretrained else "random init")
        self.status(f"loading backbone {a.backbone} ({weights}) ...")
        started = time.time()
        trunk, dim = build_backbone(a.backbone, pretrained=a.pretrained, checkpoint=a.backbone_checkpoint,
                                    **backbone_size_kwargs(a.backbone, a.image_size))
        self.status(f"backbone ready: {dim}-d features ({time.time() - started:.1f} s)")
        if a.freeze_patch_embed:
            freeze_patch_embedding(trunk)
        if a.freeze_trunk:
            trunk.requires_grad_(False)
        self.trunk = trunk.to(self.device)
        if self.channels_last():
            # conv weights in channels-last: oneDNN then runs every conv (and what follows it) in its
            # native NHWC layout instead of converting NCHW tensors around each call
            self.trunk = self.trunk.to(memory_format=torch.channels_last)
        self.feature_dim = dim
        self.setup_geometry(lambda: backbone_features(self.trunk, self.train_eval_set, self.device, seed=a.seed))
        self.head = self.build_head(dim).to(self.device)

    def channels_last(self) -> bool:
        """``--memory-format``: whether the backbone runs channels-last ('auto': on CPU only, where
        oneDNN's convolutions are native NHWC; the printed Recall@K does not change)."""
        choice = getattr(self.args, "memory_format", "auto")
        if choice == "auto":
            return self.device.type == "cpu"
        return choice == "channels_last"

    def setup_geometry(self, features_fn: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """``self.c`` and ``self.geometry`` (the one :class:`PoincareGeometry` every component shares)
        from ``--curvature`` and ``--clip-r``; ``--curvature auto`` estimates c from the δ-hyperbolicity
        of ``features_fn()`` (backbone features of training images). Non-hyperbolic recipes: None."""
        a = self.args
        self.c = None
        if getattr(a, "curvature", None) is not None:
            self.c = a.curvature
            if a.curvature == "auto":
                from ..evaluation import suggest_curvature

                if features_fn is None:
                    raise ConfigError("--curvature auto needs backbone features to estimate c from")
                self.status("--curvature auto: computing backbone features of up to 1000 training images ...")
                feats = features_fn()
                self.c = float(suggest_curvature(feats))
                self.say(f"[pml-hyperbolic] --curvature auto: δ-hyperbolicity of {len(feats)} backbone features "
                         f"suggests c = {self.c:.4g}")
        self.geometry = None
        if self.c is not None:
            from ..geometry import PoincareGeometry

            clip_r = getattr(a, "clip_r", None)
            self.geometry = PoincareGeometry(c=self.c, clip="hard" if clip_r is not None else None, clip_r=clip_r)

    def build_optimizers(self, trunk: torch.nn.Module, head: torch.nn.Module, loss_funcs: Dict) -> Dict:
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
                lr = getattr(a, "loss_lr", None) or a.head_lr or a.lr
                opts[f"{name}_optimizer"] = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        return opts

    def default_run_dir(self) -> str:
        return os.path.join("runs", f"{self.name}-{self.dataset_name}")

    # ---- main flow ----
    def run(self) -> Dict:
        a = self.args
        t0 = time.time()
        if a.quiet:
            os.environ["TQDM_DISABLE"] = "1"  # also silences PML's tester bars
        self.pick_threads()
        self.phase_seconds: Dict[str, float] = {}
        try:
            self.device = select_device(a.device)
            self.ctx = init_distributed(self.device, a.dist_backend)
        except PretrainedWeightsUnavailableError as err:
            raise ConfigError(str(err)) from None
        freeze_long_lived_objects()
        self.previous_run_backup = None
        try:
            try:
                return self._run(t0)
            except BaseException:
                self._put_back_previous_run()
                raise
        except PretrainedWeightsUnavailableError as err:
            raise ConfigError(str(err)) from None
        except DatasetNotFoundError as err:  # a folder with the wrong layout, a garbage annotation file
            raise ConfigError(str(err)) from None
        finally:
            gc.unfreeze()  # collectable again: several runs in one process (tests) leak nothing
            cleanup(self.ctx)

    def _put_back_previous_run(self) -> None:
        """After a failed or interrupted ``--overwrite`` run: when it wrote no checkpoint, delete its
        files and move the previous run back from its backup folder (``cli.backup_previous_run``)."""
        backup = getattr(self, "previous_run_backup", None)
        if not backup or os.path.isfile(os.path.join(self.run_dir, "last.pt")):
            return  # nothing kept aside, or this run has a checkpoint to resume: the backup waits
        try:
            with ctrl_c_deferred():  # never half moved
                restored = restore_previous_run(self.run_dir, backup)
        except OSError as err:
            self.say(f"[pml-hyperbolic] the previous run could not be put back ({err.strerror or err}); its files "
                     f"are in {backup}/")
            return
        self.previous_run_backup = None
        if restored:
            self.say(f"[pml-hyperbolic] stopped before the first checkpoint: the previous run is back in "
                     f"{self.run_dir}/")

    def build_training_parts(self):
        """``(loss_funcs, miner, optimizers, trainer_class, trainer_kwargs)`` of this recipe's training step,
        after :meth:`setup_model`: its loss and miner, the ``--radial-calibration`` / ``--degraded-copies``
        terms beside them (``training/radius_terms.py``), the optimisers, the loss modules on ``self.device``
        and the trainer class those terms need. :meth:`_run` trains with them.

        Raises:
            ConfigError: ``--degraded-copies`` with a trainer class that is not a ``DegradedCopyTrainer``.
        """
        loss = self.build_loss()
        miner = self.build_miner()
        loss_funcs = loss if isinstance(loss, dict) else {"metric_loss": loss}
        loss_funcs, radius_trainer, radius_trainer_kwargs = add_radius_terms(
            self.args, self.geometry if self.hyperbolic else None, loss_funcs)
        optimizers = self.build_optimizers(self.trunk, self.head, loss_funcs)
        loss_funcs = {k: (v.to(self.device) if isinstance(v, torch.nn.Module) else v) for k, v in loss_funcs.items()}
        trainer_class = self.trainer_class
        if radius_trainer is not None:
            if not issubclass(radius_trainer, trainer_class):
                raise ConfigError(f"--degraded-copies needs {radius_trainer.__name__}, but this recipe trains with "
                                  f"{trainer_class.__name__}")
            trainer_class = radius_trainer
        return loss_funcs, miner, optimizers, trainer_class, {**self.trainer_kwargs(), **radius_trainer_kwargs}

    def pick_threads(self) -> None:
        """torch's thread count for the next phase: ``--threads N`` as given; ``auto`` the cores other
        processes leave idle now (``threads.run_threads``), read again before each phase (evaluation,
        training), so that a run sharing the machine does not spin on barriers waiting for a thread
        the OS has descheduled."""
        requested = getattr(self.args, "threads", "auto")
        if requested == "auto":
            from ..kernels.threads import run_threads

            wanted = run_threads()
        else:
            wanted = int(requested)
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def _timed(self, phase: str, started: float) -> None:
        self.phase_seconds[phase] = self.phase_seconds.get(phase, 0.0) + time.time() - started

    def _run(self, t0) -> Dict:
        a = self.args
        if self.ctx.enabled and self.device.type == "cuda":
            self.device = torch.device("cuda", self.ctx.local_rank)
            torch.cuda.set_device(self.device)
        per_rank_batch = check_batch_settings(a.batch_size, a.samples_per_class, self.ctx.world_size)
        amp_dtype, use_scaler = resolve_amp(a.amp, self.device)  # a bad --amp fails before any data is read
        seed_everything(a.seed, a.deterministic)
        started = time.time()
        self.setup_data()
        freeze_long_lived_objects()  # torchvision's (and torch._dynamo's) modules, the datasets
        self._timed("data", started)
        self.run_dir = a.output_dir or self.default_run_dir()
        if self.ctx.is_main:
            # Recipe.main checked this before loading anything; checked again for direct callers of run()
            from .command_line import check_run_folder

            check_run_folder(self.run_dir, a.resume, a.overwrite)
            if a.overwrite and previous_run_files(self.run_dir):
                # kept aside, not deleted: put back if this run stops before its first checkpoint
                with ctrl_c_deferred():  # never half moved
                    self.previous_run_backup = backup_previous_run(self.run_dir)
                if self.previous_run_backup:
                    self.status(f"--overwrite: the previous run's files are in {self.previous_run_backup}/ "
                                "until this run completes")
        barrier(self.ctx)
        config = cfg.config_to_dict(a)
        config["dataset_resolved"] = self.dataset_name
        self.config = config
        checkpoints = CheckpointManager(self.run_dir, config, enabled=self.ctx.is_main)
        resume_path = checkpoints.resolve(a.resume)
        # read before anything is written: a checkpoint that cannot be used leaves no run folder behind
        checkpoint = checkpoints.load(resume_path) if resume_path else None
        run_logger = RunLogger(self.run_dir, enabled=self.ctx.is_main, tensorboard=not a.no_tensorboard)
        if run_logger.tensorboard_note:  # requested but unavailable: said once, recorded as off
            self.say(run_logger.tensorboard_note)
            config["no_tensorboard"] = True
        if self.ctx.is_main:
            run_logger.write_json("config.json", {k: v for k, v in config.items() if k not in ("resume", "overwrite")})

        started = time.time()
        self.setup_model()
        freeze_long_lived_objects()  # timm's modules, the backbone
        loss_funcs, miner, optimizers, trainer_class, trainer_kwargs = self.build_training_parts()
        labels = dataset_labels(self.train_set)
        sampler = self.build_sampler(labels, per_rank_batch)

        tester = build_tester(self.eval_curvature(), a.k_values, a.eval_batch_size, self.device, a.num_workers,
                              use_trunk_output=not self.evaluate_head)
        evaluator = Evaluator(tester, self.eval_sets, self.splits_to_eval, a.k_values,
                              geometry=self.geometry if self.hyperbolic and self.evaluate_head else None).install()
        self.evaluator = evaluator  # its last_embeddings: the plots, and benches that score them further
        hook = EpochEndEvaluator(
            evaluator, checkpoints, run_logger, self.ctx, a.k_values,
            curvature_fn=(lambda: unwrap(self.head).c) if self.hyperbolic and hasattr(self.head, "c") else None,
            stop_after_epoch=a.stop_after_epoch, verbose=True, eval_every=a.eval_every, num_epochs=a.epochs,
            history=checkpoint["history"] if checkpoint else None, best=checkpoint["best"] if checkpoint else None)
        mining_funcs = {"tuple_miner": wrap_miner(miner, self.ctx)} if miner is not None else {}
        if "trunk_optimizer" not in optimizers:
            _silence_pml_missing_key("trunk_optimizer")  # a frozen trunk has nothing to optimise
        trainer = trainer_class(
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
            show_progress=self.ctx.is_main and not a.quiet, **trainer_kwargs)
        self.trainer = trainer
        self._timed("model", started)

        before = None
        start_epoch = 1
        if checkpoint is not None:
            try:
                restore_trainer(trainer, checkpoint)
            except (KeyError, RuntimeError, ValueError, TypeError) as err:  # e.g. another recipe's or backbone's model
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise ConfigError(f"--resume: checkpoint {resume_path} does not fit this run's model and optimisers "
                                  f"({type(err).__name__}: {first[:200]}); it was written by another recipe or "
                                  "backbone. Resume with the recipe and settings that wrote it, or start from "
                                  "scratch.") from None
            start_epoch = int(checkpoint["epoch"]) + 1
            before = self._load_before()
            run_logger.truncate_after(int(checkpoint["epoch"]))
            self.say(f"[pml-hyperbolic] resumed from {resume_path} (epoch {checkpoint['epoch']}, "
                     f"step {checkpoint['global_step']})")
        elif a.eval_before:
            started = time.time()
            if self.ctx.is_main:
                self.status("evaluating before training ...")
                self.pick_threads()
                before = evaluator(self.trunk, self.head, 0)
                self.say(f"before training  {format_recall(before, a.k_values)}")
                run_logger.write_json("before.json", before)
            barrier(self.ctx)
            self._timed("eval before", started)

        started = time.time()
        self.pick_threads()
        trainer.train(start_epoch=start_epoch, num_epochs=a.epochs)
        self._timed("training", started)

        results = {}
        if self.ctx.is_main:
            ran_epochs = hook.history and hook.history[-1]["epoch"] >= start_epoch
            started = time.time()
            if ran_epochs and "recall_at_1" in hook.history[-1]:
                after = {k: v for k, v in hook.history[-1].items() if k.startswith("recall_at_")}
            else:
                self.status("evaluating after training ...")
                self.pick_threads()
                after = evaluator(self.trunk, self.head, trainer.global_step)
                self._timed("eval after", started)
            self.say(f"after training   {format_recall(after, a.k_values)}")
            emb = evaluator.last_embeddings
            plots = {}
            if not a.no_plots and emb is not None:
                started = time.time()
                self.status("drawing plots ...")
                try:
                    plots = self.plots(*emb)
                except (ImportError, ValueError) as err:  # e.g. too few points for the bins
                    self.say(f"[pml-hyperbolic] plots skipped: {err}")
                except OSError as err:
                    raise run_write_error(err.filename or self.run_dir, err, "plot") from None
                try:
                    plots.update(self.retrieval_grid(*emb))
                except (ImportError, ValueError) as err:
                    self.say(f"[pml-hyperbolic] retrieval grid skipped: {err}")
                except OSError as err:
                    raise run_write_error(err.filename or self.run_dir, err, "plot") from None
                if plots:
                    self._timed("plots", started)
            results = {
                "recipe": self.name, "dataset": self.dataset_name, "curvature": self.c,
                "before": before, "after": after, "best": hook.best,
                "epochs_completed": hook.history[-1]["epoch"] if hook.history else 0,
                "global_step": trainer.global_step, "history": hook.history, "plots": plots,
                "wall_seconds": round(time.time() - t0, 1), "device": str(self.device),
                "world_size": self.ctx.world_size, "run_dir": self.run_dir,
                "uncertainty_vs_recall": getattr(self, "uncertainty_table", None),
                "uncertainty_failure_auroc": getattr(self, "uncertainty_auroc", None),
                "radius_collapse": evaluator.radius_report.as_dict() if evaluator.radius_report else None,
                "phase_seconds": {k: round(v, 2) for k, v in self.phase_seconds.items()},
                "tensorboard_logging": run_logger.tensorboard_active,
            }
            unreadable = self.count_unreadable()
            if unreadable:
                self.say(f"[pml-hyperbolic] {unreadable} unreadable image(s) were skipped (see the warnings above; "
                         "dataset.check_images() lists them)")
            results["unreadable_images_skipped"] = unreadable
            results_path = run_logger.write_json("results.json", results)
            checkpoint_paths = [p for p in (checkpoints.last_path, checkpoints.best_path) if os.path.isfile(p)]
            self.say(format_summary(results, a.k_values, results_path, checkpoint_paths,
                                    uncertainty_bins=self.reports_uncertainty))
            stopped_early = (a.stop_after_epoch is not None and results["epochs_completed"] < a.epochs
                             and not trainer.steps_exhausted())
            if not stopped_early:  # complete: the run --overwrite replaced is no longer needed
                try:
                    discard_previous_run(self.run_dir)
                except OSError as err:
                    self.say(f"[pml-hyperbolic] could not delete the previous run's backup ({err.strerror or err}); "
                             "delete it yourself")
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


PHASE_ORDER = ("data", "model", "eval before", "training", "eval after", "plots")


def format_summary(results: Dict, k_values: Sequence[int], results_path: Optional[str],
                   checkpoint_paths: Sequence[str], uncertainty_bins: bool = False) -> str:
    """The end-of-run summary (~8 lines): Recall@K before/after for each K, the time of each phase,
    and where the results, checkpoints and plots are; one more line when the test embeddings' radius
    collapsed (``results["radius_collapse"]``).

    Args:
        results: the run's ``results.json`` payload.
        k_values: the K of Recall@K (columns).
        results_path: where ``results.json`` was written, or None.
        checkpoint_paths: the checkpoint files written.
        uncertainty_bins: add the uncertainty bins and AUROC lines (Hyp-UML).

    Returns:
        The summary, lines joined by newlines.
    """
    ks = list(k_values)
    epochs = results.get("epochs_completed", 0)
    head = (f"[pml-hyperbolic] summary: {results.get('recipe')} on {results.get('dataset')}, {epochs} epoch"
            f"{'s' if epochs != 1 else ''}, {results.get('global_step', 0)} steps, {results.get('wall_seconds', 0):.0f} s")
    width = max(7, *(len(f"R@{k}") + 2 for k in ks))
    lines = [head, "          " + "".join(f"{'R@' + str(k):>{width}}" for k in ks)]
    for label in ("before", "after"):
        recall = results.get(label)
        if recall:
            lines.append(f"  {label:<8}" + "".join(f"{recall.get(f'recall_at_{k}', float('nan')):>{width}.3f}"
                                                 for k in ks))
    table = results.get("uncertainty_vs_recall")
    if uncertainty_bins and table and len(table) > 1:
        lines.append("  uncertainty bins, most certain first: R@1 "
                     + " ".join(f"{row['recall_at_1']:.2f}" for row in table) + f" (n = {table[0]['count']} per bin)")
    auroc = results.get("uncertainty_failure_auroc")
    if uncertainty_bins and auroc is not None and auroc == auroc:
        lines.append(f"  uncertainty AUROC for a wrong top-1: {auroc:.3f} (0.5 = no information)")
    collapse = results.get("radius_collapse")
    if collapse:  # see pml_hyperbolic.evaluation.radius_health
        lines.append(f"  {collapse['summary']}")
    phases = results.get("phase_seconds") or {}
    if phases:
        lines.append("  time    " + " | ".join(f"{name} {phases[name]:.1f} s" for name in PHASE_ORDER
                                               if name in phases))
    if results_path:
        lines.append(f"  results     {results_path}")
    if checkpoint_paths:
        lines.append(f"  checkpoints {', '.join(checkpoint_paths)}")
    plots = results.get("plots") or {}
    if plots:  # recipes that draw none (or --no-plots) get no line, rather than a claim
        lines.append(f"  plots       {', '.join(plots.values())}")
    return "\n".join(lines)


@torch.no_grad()
def compute_embeddings(trunk: torch.nn.Module, head: torch.nn.Module, dataset: torch.utils.data.Dataset,
                       device: torch.device, batch_size: int = 128, num_workers: int = 0) -> torch.Tensor:
    """Head outputs (float32, CPU) of a whole dataset in eval mode; modules' modes are restored.

    Rows of unreadable images stay at the origin.

    Raises:
        RuntimeError: no image of the dataset was readable.
    """
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
