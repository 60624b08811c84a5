"""The torch-free half of a recipe: command line, ``--config`` file, presets, and every check that
needs no model and no data (paths, batch size, run folder), so that ``--help`` and a user's
mistakes are answered in well under a second instead of after torch, PML and timm are imported.

A recipe script subclasses :class:`RecipeCommandLine` (its flags, presets and builders; the
builders import what they need inside their bodies). Creating an instance builds the runnable
class, ``(the recipe, its runtime_mixins(), runner.Recipe)``, and that is the moment the heavy
packages are imported::

    class HypViT(RecipeCommandLine):     # importing the script is light
        ...
    HypViT.main()                        # parse + check (light), then HypViT(args).run() (heavy)

This module imports only the standard library, :mod:`.config` and :mod:`..data.registry` (both
light as well); the packages' ``__init__`` files import their components lazily, so importing this
module loads no torch.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import shlex
import shutil
import sys
from typing import Dict, List, Optional, Sequence

from ..data.registry import ROOT_ENVIRONMENT_VARIABLES, SHARED_DATA_VARIABLE
from .config import DATASET_ALIASES, ConfigError, RecipeArgumentParser, add_common_arguments, check_batch_settings, \
    parse_config

#: Files of a previous run in a run folder; any of them makes the folder "used" (see check_run_folder).
PREVIOUS_RUN_FILES = ("last.pt", "best.pt", "results.json", "log.csv", "before.json")
#: Also deleted by --overwrite (a new run writes them again).
OVERWRITTEN_FILES = PREVIOUS_RUN_FILES + ("config.json", "poincare_disk.png", "uncertainty_vs_recall.png",
                                          "retrieval_grid.png")
#: Exit status of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention).
INTERRUPTED_EXIT_STATUS = 130


class ImportedOnUse:
    """A class attribute naming a class by module and name, imported when first read: lets a light
    recipe class say ``trainer_class = ImportedOnUse("pml_hyperbolic.training.hcl_trainer", "HCLTrainer")``."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __get__(self, instance, owner):
        return getattr(importlib.import_module(self.module), self.name)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the recipe docstring's layout (its example commands) and shows every default."""


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def warn(message: str) -> None:
    """One ``warning: ...`` line on stderr (rank 0 only under torchrun)."""
    if _is_main_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# checks that need no torch
# ----------------------------------------------------------------------------------------------
def light_dataset_name(requested: str, data_root: Optional[str], real_default: str) -> Optional[str]:
    """The dataset ``--dataset``/``--data-root`` select, decided from names and paths alone.

    Returns ``None`` only where the answer depends on a folder's layout: ``--dataset auto`` without
    ``--data-root`` while a data environment variable is set (the runner then looks inside it).
    Raises :class:`ConfigError` for a ``--data-root`` that does not exist and for a named benchmark
    with no way to find it.
    """
    name = DATASET_ALIASES[requested]
    if data_root is not None and not os.path.exists(os.path.expanduser(data_root)):
        target = real_default if name == "auto" else name
        raise ConfigError(f"--data-root {data_root} does not exist. Pass the folder holding the {target} data "
                          "(see --help for the layouts), or run on the bundled data with --dataset glyphs.")
    if name == "glyphs":
        return "glyphs"
    target = real_default if name == "auto" else name
    if data_root is not None:
        return target  # the runner checks the folder's layout and says what it expected
    env = ROOT_ENVIRONMENT_VARIABLES.get(target)
    if os.environ.get(env or "") or os.environ.get(SHARED_DATA_VARIABLE):
        return target if name != "auto" else None
    if name == "auto":
        return "glyphs"
    raise ConfigError(f"{target}: no --data-root given and ${env} / ${SHARED_DATA_VARIABLE} are unset, so the data "
                      f"cannot be found. Pass --data-root DIR (the extracted {target} folder) or set {env}=DIR; "
                      "or run on the bundled data with --dataset glyphs.")


def previous_run_files(run_dir: str) -> List[str]:
    """Names of the files of an earlier run found in ``run_dir``."""
    return [name for name in PREVIOUS_RUN_FILES if os.path.isfile(os.path.join(run_dir, name))]


def resume_checkpoint_path(run_dir: str, resume: Optional[str]) -> Optional[str]:
    """The checkpoint ``--resume`` names (``auto``: ``<run_dir>/last.pt``), checked to exist."""
    if resume is None:
        return None
    path = os.path.join(run_dir, "last.pt") if resume == "auto" else resume
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: no checkpoint at {path}. Give the path of a last.pt/best.pt, or drop "
                          "--resume to start from scratch.")
    return path


def check_run_folder(run_dir: str, resume: Optional[str], overwrite: bool) -> None:
    """Refuse to mix two runs in one folder: a folder holding an earlier run needs ``--resume``
    (continue it) or ``--overwrite`` (delete it first)."""
    if resume is not None and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{run_dir}, --overwrite deletes it. Give one of them.")
    if resume is not None:
        resume_checkpoint_path(run_dir, resume)
        return
    found = previous_run_files(run_dir)
    if found and not overwrite:
        raise ConfigError(f"--output-dir {run_dir} holds a previous run ({', '.join(found)}). Continue it with "
                          "--resume, start afresh with --overwrite (deletes its checkpoints, logs, results and "
                          "plots), or choose another --output-dir.")


def clear_previous_run(run_dir: str) -> List[str]:
    """Delete an earlier run's files from ``run_dir`` (only the files a run writes: the folder may
    hold other things); returns what was deleted."""
    import json

    names = set(OVERWRITTEN_FILES)
    try:  # plots the previous run listed in its results (e.g. ones a newer version names differently)
        with open(os.path.join(run_dir, "results.json")) as handle:
            names.update(os.path.basename(p) for p in (json.load(handle).get("plots") or {}).values())
    except (OSError, ValueError, AttributeError):
        pass
    deleted = []
    for name in sorted(names):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path):
            os.remove(path)
            deleted.append(name)
    for path in glob.glob(os.path.join(run_dir, ".tmp-*")):  # half-written checkpoints of a killed run
        os.remove(path)
    tensorboard = os.path.join(run_dir, "tensorboard")
    if os.path.isdir(tensorboard):
        shutil.rmtree(tensorboard)
        deleted.append("tensorboard/")
    return deleted


def resume_command(argv: Sequence[str], program: Optional[str] = None) -> str:
    """The command line that continues an interrupted run: the same flags, ``--overwrite`` dropped,
    ``--resume`` added."""
    program = program or (sys.argv[0] if sys.argv and sys.argv[0] else "recipe.py")
    kept = [a for a in argv if a != "--overwrite"]
    if not any(a == "--resume" or a.startswith("--resume=") for a in kept):
        kept.append("--resume")
    return shlex.join([os.path.basename(sys.executable) if sys.executable else "python", program, *kept])


def ineffective_flag_warnings(args: argparse.Namespace) -> List[str]:
    """Flags the user set that the run will not use (each a one-line warning)."""
    explicit = getattr(args, "_explicit", set())
    out = []
    if "lr" in explicit and args.freeze_trunk and args.head_lr is not None:
        out.append(f"--lr {args.lr:g} has no effect: the trunk is frozen (--freeze-trunk true), so only the head "
                   f"trains, with --head-lr {args.head_lr:g} (log.csv's lr_embedder column). Set "
                   "--head-lr instead, or --freeze-trunk false to fine-tune the backbone.")
    if "backbone_checkpoint" in explicit and args.backbone_checkpoint and "pretrained" in explicit and args.pretrained:
        out.append("--pretrained true has no effect with --backbone-checkpoint: the weights come from the file.")
    if "eval_every" in explicit and args.eval_every > args.epochs:
        out.append(f"--eval-every {args.eval_every} exceeds --epochs {args.epochs}: only the last epoch is evaluated.")
    return out


# ----------------------------------------------------------------------------------------------
# the light recipe base class
# ----------------------------------------------------------------------------------------------
class RecipeCommandLine:
    """A recipe's flags, presets and start-up checks (no torch); see the module docstring."""

    name = "recipe"
    description = ""
    real_dataset = "cars196"        # what --dataset auto looks for
    hyperbolic = True               # evaluate with the hyperbolic kNN and plot the Poincaré disk
    reports_uncertainty = False     # print the Hyp-UML uncertainty bins (the Hyp-UML recipe)
    default_backbone = "vit_small_patch16_224"
    trainer_class = ImportedOnUse("pml_hyperbolic.training.trainer", "HyperbolicTrainer")
    label_hierarchy_level = 0
    # Settings for the bundled-glyph path on CPU (a small pretrained CNN at small size; the
    # paper's ViT-S/16 at 224 px would take hours on 2 cores).
    # Score the head's output (True) or the trunk's features (False: the head is a projection that
    # only serves the loss, as MoCo's and HCL's MLP).
    evaluate_head = True
    glyph_preset: Dict = {
        "backbone": "efficientnet_lite0", "pretrained": True, "image_size": 48, "resize_size": 48,
        "batch_size": 120, "samples_per_class": 4, "lr": 3e-4, "head_lr": 3e-3, "epochs": 3,
        "steps_per_epoch": 15, "amp": "auto", "freeze_patch_embed": False, "freeze_trunk": True,
        "eval_batch_size": 256, "eval_every": 0,
    }
    paper_presets: Dict[str, Dict] = {}

    def __new__(cls, *args, **kwargs):
        # The runnable class joins this one with the runner (torch, PML): imported here, not earlier.
        return super().__new__(cls.runnable())

    def __init__(self, args: argparse.Namespace):
        self.args = args

    @classmethod
    def runtime_mixins(cls) -> tuple:
        """Heavy mixins placed between the recipe and ``runner.Recipe`` (imported inside, on use)."""
        return ()

    @classmethod
    def runnable(cls) -> type:
        """``cls`` itself when it already derives from ``runner.Recipe``, else (cached) the class
        ``(cls, *runtime_mixins(), runner.Recipe)``."""
        from .runner import Recipe

        if issubclass(cls, Recipe):
            return cls
        built = cls.__dict__.get("_runnable_class")
        if built is None:
            built = type(cls.__name__, (cls, *cls.runtime_mixins(), Recipe),
                         {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__})
            cls._runnable_class = built
        return built

    # ---- command line ----
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Recipe-specific flags."""

    @classmethod
    def make_parser(cls) -> argparse.ArgumentParser:
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else f"{cls.name}.py"
        parser = RecipeArgumentParser(
            prog=prog, description=cls.description,
            epilog="Defaults shown are the generic ones; the dataset's preset (the paper's settings for a "
                   "real benchmark, the CPU demo for the bundled glyphs) replaces them unless the flag "
                   "is given (or set in --config). A run folder that holds a previous run is refused: "
                   "continue it with --resume or start afresh with --overwrite.",
            formatter_class=_HelpFormatter)
        add_common_arguments(parser, default_backbone=cls.default_backbone, hyperbolic=cls.hyperbolic)
        cls.add_arguments(parser)
        return parser

    @classmethod
    def resolved_dataset(cls, args) -> str:
        """The canonical dataset this run uses (``glyphs`` for ``--dataset auto`` without the data)."""
        name = light_dataset_name(args.dataset, args.data_root, cls.real_dataset)
        if name is None:  # auto with a data environment variable: the folder's layout decides
            from .runner import resolve_dataset

            name = resolve_dataset(args.dataset, args.data_root, cls.real_dataset)[0]
        return name

    @classmethod
    def presets(cls, args) -> Dict:
        name = cls.resolved_dataset(args)
        if name == "glyphs":
            return dict(cls.glyph_preset)
        return dict(cls.paper_presets.get(name, {}))

    @classmethod
    def parse(cls, argv=None) -> argparse.Namespace:
        return parse_config(cls.make_parser, argv, presets=cls.presets)

    @classmethod
    def run_folder(cls, args) -> str:
        return args.output_dir or os.path.join("runs", f"{cls.name}-{cls.resolved_dataset(args)}")

    @classmethod
    def preflight(cls, args) -> None:
        """Every check that needs neither torch nor data, run before anything is loaded or written."""
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        check_batch_settings(args.batch_size, args.samples_per_class, world_size)
        check_run_folder(cls.run_folder(args), args.resume, args.overwrite)
        for message in ineffective_flag_warnings(args):
            warn(message)

    @classmethod
    def main(cls, argv=None) -> Dict:
        """Entry point of a recipe script: a user error prints one ``error:`` line and exits with
        status 2; Ctrl-C prints where the last checkpoint is and how to resume, and exits with 130."""
        argv = list(sys.argv[1:] if argv is None else argv)
        run_dir = None
        try:
            args = cls.parse(argv)
            cls.preflight(args)
            run_dir = cls.run_folder(args)
            return cls(args).run()
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        except KeyboardInterrupt:
            print(interrupted_message(run_dir, argv), file=sys.stderr, flush=True)
            raise SystemExit(INTERRUPTED_EXIT_STATUS)


def interrupted_message(run_dir: Optional[str], argv: Sequence[str]) -> str:
    """The one line printed on Ctrl-C."""
    checkpoint = os.path.join(run_dir, "last.pt") if run_dir else None
    if checkpoint and os.path.isfile(checkpoint):
        return (f"interrupted: the last checkpoint is {checkpoint}; continue with: {resume_command(argv)}")
    if run_dir:
        again = "the same command" + (" plus --overwrite" if previous_run_files(run_dir) and "--overwrite" not in argv
                                      else "")
        return (f"interrupted before the first checkpoint (nothing in {run_dir}/ to resume from); "
                f"start again with {again}.")
    return "interrupted before the run started."
