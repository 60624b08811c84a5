"""The optimisation part of :class:`~.runner.Recipe`: device and seeds, the loss and miner hooks,
the optimisers, the trainer, and the thread count of each phase.

Why a module of its own: the recipe driver composes one mixin per responsibility (data, model and
geometry, optimisation, reporting), each readable alone.

Design note: docs/design/training.md
"""
from __future__ import annotations

import random
from typing import Dict

import numpy as np
import torch

from ..data.image_list import collate_skipping_unreadable
from .config import ConfigError
from .distributed import wrap_loss, wrap_miner, wrap_model
from .radius_terms import add_radius_terms


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


def _silence_pml_missing_key(key: str) -> None:
    """Drop PML's 'optimizers is missing "<key>"' warning, which is expected for a frozen model."""
    import logging

    from pytorch_metric_learning.utils import common_functions as c_f

    class _DropMissingKey(logging.Filter):
        def filter(self, record):
            return f'missing "{key}"' not in record.getMessage()

    if not any(isinstance(f, _DropMissingKey) for f in c_f.LOGGER.filters):
        c_f.LOGGER.addFilter(_DropMissingKey())



class RecipeOptimisationMixin:
    """Training step of a recipe run: the loss and miner a recipe overrides, the optimisers (one per
    model, PML-style), the trainer built from them, and ``--threads``.

    Design note: docs/design/training.md
    """

    def build_loss(self):
        raise NotImplementedError

    def build_miner(self):
        return None

    def trainer_kwargs(self) -> Dict:
        return {}

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

    def build_trainer(self, loss_funcs: Dict, miner, optimizers: Dict, trainer_class: type, trainer_kwargs: Dict,
                      sampler, per_rank_batch: int, hook, amp_dtype, use_scaler: bool):
        """The trainer of this run (``trainer_class``, after :meth:`setup_model` and :meth:`setup_data`):
        trunk and head wrapped for DDP, the losses and miner, the sampler, ``hook`` at each epoch's end.

        Args:
            loss_funcs: ``{name: loss}`` from :meth:`build_training_parts`.
            miner: the tuple miner, or None.
            optimizers: ``{"<model>_optimizer": optimiser}``.
            trainer_class: the trainer class to build.
            trainer_kwargs: its extra keyword arguments.
            sampler: the batch sampler of this rank.
            per_rank_batch: this rank's batch size.
            hook: the end-of-epoch hook (evaluation, checkpoints).
            amp_dtype: the autocast dtype, or None.
            use_scaler: whether a gradient scaler runs.

        Returns:
            The trainer instance.
        """
        a = self.args
        mining_funcs = {"tuple_miner": wrap_miner(miner, self.ctx)} if miner is not None else {}
        if "trunk_optimizer" not in optimizers:
            _silence_pml_missing_key("trunk_optimizer")  # a frozen trunk has nothing to optimise
        return trainer_class(
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
