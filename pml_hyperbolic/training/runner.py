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
import time
from typing import Dict

import torch

from ..backbones import PretrainedWeightsUnavailableError
from ..data.image_list import DatasetNotFoundError, collate_skipping_unreadable  # noqa: F401
from . import config as cfg
from .checkpoint import CheckpointManager, ctrl_c_deferred, restore_trainer, unwrap  # noqa: F401
from .command_line import (RecipeCommandLineBase, backup_previous_run, discard_previous_run,  # noqa: F401
                           missing_data_message, previous_run_files, resolve_dataset, restore_previous_run)
# check_batch_settings and RunWriteError: public here too
from .config import ConfigError, RunWriteError, check_batch_settings, run_write_error  # noqa: F401
from .distributed import barrier, cleanup, init_distributed
from .evaluation import EpochEndEvaluator, Evaluator, build_tester, format_recall
# the parts Recipe composes; their public helpers stay importable from here
from .recipe_data import (LabelledSubset, RecipeDataMixin, dataset_labels, seeded_subset,  # noqa: F401
                          train_subset_indices, training_class_count)
from .recipe_model import (RecipeModelMixin, backbone_features, backbone_size_kwargs,  # noqa: F401
                           compute_embeddings, freeze_patch_embedding)
from .recipe_optimisation import (RecipeOptimisationMixin, _silence_pml_missing_key,  # noqa: F401
                                  seed_everything, select_device)
from .recipe_reporting import PHASE_ORDER, RecipeReportingMixin, format_summary  # noqa: F401
from .run_logger import RunLogger
from .trainer import HyperbolicTrainer, resolve_amp


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


class Recipe(RecipeDataMixin, RecipeModelMixin, RecipeOptimisationMixin, RecipeReportingMixin,
             RecipeCommandLineBase):
    """The runnable recipe: data, model, training, evaluation and results (torch, PML).

    Recipe scripts subclass :class:`~.cli.RecipeCommandLine` (light); instantiating one makes it a
    subclass of this class. Both derive from :class:`~.command_line.RecipeCommandLineBase`, so this
    module never imports ``cli``. Subclassing ``Recipe`` directly works as well (then importing the script
    imports torch). Subclasses override the builders of its parts: data (:mod:`.recipe_data`), model and
    geometry (:mod:`.recipe_model`), optimisation (:mod:`.recipe_optimisation`) and reporting
    (:mod:`.recipe_reporting`); this class keeps the run itself, phase by phase.

    Design note: docs/design/training.md
    """

    trainer_class = HyperbolicTrainer

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
        # a checkpoint written before a flag existed resumes at that flag's default (built only to resume)
        defaults = cfg.flag_defaults(self.make_parser()) if a.resume else None
        checkpoints = CheckpointManager(self.run_dir, config, enabled=self.ctx.is_main, flag_defaults=defaults)
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
        try:
            # also when resuming (the checkpoint then replaces the head): the first labels see the same head;
            # the features the warm start computes are shared with the first labels, then released
            self.warm_start_head()
            sampler = self.build_sampler(labels, per_rank_batch)
        finally:
            self._step0_features = None

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
        trainer = self.build_trainer(loss_funcs, miner, optimizers, trainer_class, trainer_kwargs, sampler,
                                     per_rank_batch, hook, amp_dtype, use_scaler)
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
                method = self.method_check()
                if method is not None:  # kept with Recall@K: before.json also serves a resumed run
                    before["method_check"] = method
                    self.say(f"before training  {method['line']}")
                run_logger.write_json("before.json", before)
            barrier(self.ctx)
            self._timed("eval before", started)

        started = time.time()
        self.pick_threads()
        trainer.train(start_epoch=start_epoch, num_epochs=a.epochs)
        self._timed("training", started)

        results = self.finish_run(t0, before, start_epoch, hook, evaluator, trainer, checkpoints, run_logger)
        run_logger.close()
        barrier(self.ctx)
        return results

