"""The torch-free half of a recipe: command line, ``--config`` file, presets, dataset resolution and
every check that needs no model and no data (paths, batch size, run folder), so that ``--help`` and a
user's mistakes are answered before torch, PML and timm are imported.

:class:`RecipeCommandLineBase` holds a recipe's flags, presets and checks. It is the floor both
halves stand on: :class:`~pml_hyperbolic.training.runner.Recipe` (the heavy half) derives from it,
and :class:`~pml_hyperbolic.training.cli.RecipeCommandLine` (what recipe scripts subclass, one floor
up) adds the step that joins a recipe with the runner. This module imports neither of them.

This module imports only the standard library, :mod:`.config` and :mod:`..data.registry` (both
light as well); the packages' ``__init__`` files import their components lazily, so importing this
module loads no torch.

Design note: docs/design/recipe-defaults.md
"""
from __future__ import annotations

import argparse
import glob
import importlib
import os
import shlex
import shutil
import sys
import tempfile
import textwrap
import zipfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..data.registry import ROOT_ENVIRONMENT_VARIABLES, SHARED_DATA_VARIABLE
from .config import BUNDLED_DATASETS, DATASET_ALIASES, ConfigError, RecipeArgumentParser, RunWriteError, \
    add_common_arguments, check_batch_settings, parse_config, run_write_error

#: Files of a previous run in a run folder; any of them makes the folder "used" (see check_run_folder).
PREVIOUS_RUN_FILES = ("last.pt", "best.pt", "results.json", "log.csv", "before.json")
#: Also deleted by --overwrite (a new run writes them again).
OVERWRITTEN_FILES = PREVIOUS_RUN_FILES + ("config.json", "poincare_disk.png", "uncertainty_vs_recall.png",
                                          "retrieval_grid.png")
#: Exit status of a run stopped by Ctrl-C (128 + SIGINT, the shell's convention).
INTERRUPTED_EXIT_STATUS = 130
#: Exit status of a run whose folder could not be written once it had started (disk full, read-only).
WRITE_FAILED_EXIT_STATUS = 1
#: Suffix of the sibling folder that keeps the run --overwrite replaces until the new run completes.
BACKUP_SUFFIX = ".previous"
#: The file that marks a backup folder as made by --overwrite (only such a folder is ever deleted).
BACKUP_MARKER = ".pml-hyperbolic-previous-run"


class ImportedOnUse:
    """A class attribute naming a class by module and name, imported when first read: lets a light
    recipe class say ``trainer_class = ImportedOnUse("pml_hyperbolic.training.hcl_trainer", "HCLTrainer")``."""

    def __init__(self, module: str, name: str):
        """Name the class to import on first use.

        Args:
            module: the dotted module path.
            name: the attribute of that module to return.
        """
        self.module, self.name = module, name

    def __get__(self, instance, owner):
        return getattr(importlib.import_module(self.module), self.name)


#: The real benchmarks a recipe may carry the paper's preset for, in the order --help lists them.
BENCHMARKS = ("cub200", "cars196", "sop", "inshop")


def show_value(value: Any) -> str:
    """A setting as the command line spells it.

    Args:
        value: a setting's value.

    Returns:
        Its text: ``true``/``false``, ``none``, ``1 2 4 8`` for a list, ``3e-05`` for a float.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return " ".join(show_value(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def default_note(default: Any, dest: str, columns: Sequence[Tuple[str, str, Dict]]) -> str:
    """The ``default: ...`` note of one flag in ``--help``.

    Args:
        default: the flag's own default.
        dest: the flag's ``dest`` name.
        columns: ``(preposition, where, preset)`` per place a preset applies.

    Returns:
        Its value under each column, grouped by value, e.g.
        ``default: 3 on the bundled glyphs and icons; 10 on cub200, cars196``; a single value
        where every column agrees.
    """
    groups: Dict[str, Dict[str, List[str]]] = {}
    for preposition, where, preset in columns:
        text = show_value(preset.get(dest, default))
        groups.setdefault(text, {}).setdefault(preposition, []).append(where)
    if len(groups) <= 1:
        return f"default: {show_value(default)}"
    parts = []
    for text, places in groups.items():
        phrases = []
        for preposition, names in places.items():
            named = "the benchmarks" if preposition == "on" and sorted(names) == sorted(BENCHMARKS) else ", ".join(names)
            phrases.append(f"{preposition} {named}")
        parts.append(f"{text} {' and '.join(phrases)}")
    return "default: " + "; ".join(parts)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the recipe docstring's layout (its example commands) and ends each flag's help with
    its default, per dataset where the presets differ (``action.default_note``)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("%(default)" in text or action.default is argparse.SUPPRESS or not action.option_strings
                or action.nargs == 0):
            return text
        note = getattr(action, "default_note", None) or f"default: {show_value(action.default)}"
        return f"{text} ({note.replace('%', '%%')})"


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def warn(message: str) -> None:
    """Print one ``warning: <message>`` line on stderr (rank 0 only under torchrun).

    Args:
        message: the warning, one line.
    """
    if _is_main_process():
        print(f"warning: {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# checks that need no torch
# ----------------------------------------------------------------------------------------------
def light_dataset_name(requested: str, data_root: Optional[str], real_default: str) -> Optional[str]:
    """The dataset ``--dataset``/``--data-root`` select, decided from names and paths alone.

    Args:
        requested: the ``--dataset`` value (an alias of :data:`DATASET_ALIASES`).
        data_root: the ``--data-root`` value, or None.
        real_default: the benchmark ``--dataset auto`` looks for.

    Returns:
        The canonical dataset name, or None where the answer depends on a folder's layout
        (``--dataset auto`` without ``--data-root`` while a data environment variable is set).

    Raises:
        ConfigError: for a ``--data-root`` that does not exist, and for a named benchmark with no
            way to find it.
    """
    name = DATASET_ALIASES[requested]
    if data_root is not None and not os.path.exists(os.path.expanduser(data_root)):
        target = real_default if name == "auto" else name
        raise ConfigError(f"--data-root {data_root} does not exist. Pass the folder holding the {target} data "
                          "(see --help for the layouts), or run on the bundled data with --dataset glyphs.")
    if name in BUNDLED_DATASETS:
        return name
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
    """The files of an earlier run found in a run folder.

    Args:
        run_dir: the run folder.

    Returns:
        The names among :data:`PREVIOUS_RUN_FILES` that exist there.
    """
    return [name for name in PREVIOUS_RUN_FILES if os.path.isfile(os.path.join(run_dir, name))]


def resume_checkpoint_path(run_dir: str, resume: Optional[str]) -> Optional[str]:
    """The checkpoint ``--resume`` names, checked to exist.

    Args:
        run_dir: the run folder.
        resume: the ``--resume`` value: None, ``auto`` (``<run_dir>/last.pt``) or a path.

    Returns:
        The checkpoint path, or None without ``--resume``.

    Raises:
        ConfigError: when the checkpoint does not exist.
    """
    if resume is None:
        return None
    path = os.path.join(run_dir, "last.pt") if resume == "auto" else resume
    if not os.path.isfile(path):
        raise ConfigError(f"--resume: no checkpoint at {path}. Give the path of a last.pt/best.pt, or drop "
                          "--resume to start from scratch.")
    try:  # torch.save writes zip archives: anything else is refused before torch is imported
        is_zip = zipfile.is_zipfile(path)
    except OSError as err:
        raise ConfigError(f"--resume: cannot read {path}: {err.strerror or err}.") from None
    if not is_zip:
        raise ConfigError(f"--resume: {path} is not a checkpoint (checkpoints are the zip archives torch.save "
                          "writes: a last.pt/best.pt of a run). Give another checkpoint, or drop --resume to "
                          "start from scratch.")
    return path


def check_run_folder(run_dir: str, resume: Optional[str], overwrite: bool) -> None:
    """Refuse to mix two runs in one folder: a folder holding an earlier run needs ``--resume``
    (continue it) or ``--overwrite`` (replace it: the earlier run waits in
    :func:`backup_folder` until the new one completes).

    Args:
        run_dir: the run folder.
        resume: the ``--resume`` value, or None.
        overwrite: whether ``--overwrite`` was given.

    Raises:
        ConfigError: for ``--resume`` with ``--overwrite``, a missing checkpoint or a file that is
            no checkpoint, a used folder without either flag, or (``--overwrite``) a backup folder
            that cannot be made or that exists and was not made by ``--overwrite``.
    """
    if resume is not None and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{run_dir}, --overwrite replaces it. Give one of them.")
    if resume is not None:
        resume_checkpoint_path(run_dir, resume)
        return
    found = previous_run_files(run_dir)
    if found and not overwrite:
        raise ConfigError(f"--output-dir {run_dir} holds a previous run ({', '.join(found)}). Continue it with "
                          "--resume, start afresh with --overwrite (replaces its checkpoints, logs, results and "
                          "plots once the new run completes), or choose another --output-dir.")
    if not found:
        return
    backup = backup_folder(run_dir)
    if os.path.lexists(backup) and not is_backup_folder(backup):
        raise ConfigError(f"--overwrite keeps the previous run in {backup} until the new run completes, but "
                          f"{backup} already exists and was not made by --overwrite. Move it away, or choose "
                          "another --output-dir.")
    try:
        _try_creating_a_folder(os.path.dirname(backup))
    except OSError as err:
        raise ConfigError(f"--overwrite keeps the previous run in {backup} until the new run completes, but "
                          f"{os.path.dirname(backup)} refuses it ({err.strerror or err}). Move the previous run "
                          "away yourself, or choose another --output-dir.") from None


def _try_creating_a_folder(parent: str) -> None:
    """Create and remove an empty folder in ``parent``; the ``OSError`` when that fails."""
    os.rmdir(tempfile.mkdtemp(prefix=".pml-hyperbolic-write-test-", dir=parent))


def check_output_folder(run_dir: str, flag: str = "--output-dir") -> None:
    """Refuse a run folder that cannot be created or written.

    Args:
        run_dir: the run folder (it need not exist yet).
        flag: how the message names it.

    Raises:
        ConfigError: when ``run_dir`` is a file, lies under a file, or its nearest existing folder
            is not writable (by its permission bits, or because creating a folder there fails, as
            on a read-only mount or under ``/proc``), or when a resumed run's ``log.csv`` is not
            writable.
    """
    path = os.path.abspath(os.path.expanduser(run_dir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{flag} {run_dir} is a file, not a folder. Choose a folder for the run.")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {run_dir} lies under {parent}, which is a file, not a folder. Choose a folder "
                          "for the run.")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {run_dir}: {parent} is not writable. Choose a folder you can write to.")
    try:  # the permission bits do not tell everything (root, read-only mounts, /proc): try it
        _try_creating_a_folder(parent)
    except OSError as err:
        raise ConfigError(f"{flag} {run_dir}: cannot create a folder in {parent} ({err.strerror or err}). Choose "
                          "a folder you can write to.") from None
    if parent == path:  # an existing run folder: the files a resumed run appends to must be writable too
        for name in ("log.csv",):
            file = os.path.join(path, name)
            if os.path.isfile(file) and not os.access(file, os.W_OK):
                raise ConfigError(f"{flag} {run_dir}: {file} is not writable. Make it writable, or choose "
                                  "another --output-dir.")


def clear_previous_run(run_dir: str) -> List[str]:
    """Delete an earlier run's files from a run folder (only the files a run writes: the folder may
    hold other things).

    Args:
        run_dir: the run folder.

    Returns:
        The names deleted (``tensorboard/`` for that folder).
    """
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


def _run_file_names(run_dir: str) -> List[str]:
    """The names of the run files in ``run_dir`` (:data:`OVERWRITTEN_FILES`, the plots its results
    list, ``tensorboard``), those that exist."""
    import json

    names = set(OVERWRITTEN_FILES)
    try:
        with open(os.path.join(run_dir, "results.json")) as handle:
            names.update(os.path.basename(p) for p in (json.load(handle).get("plots") or {}).values())
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    names.add("tensorboard")
    return sorted(name for name in names if os.path.lexists(os.path.join(run_dir, name)))


def backup_folder(run_dir: str) -> str:
    """Where ``--overwrite`` keeps the previous run: the sibling folder ``<run_dir>.previous``.

    Args:
        run_dir: the run folder.

    Returns:
        The backup folder's path (it need not exist).
    """
    return os.path.normpath(os.path.abspath(os.path.expanduser(run_dir))) + BACKUP_SUFFIX


def is_backup_folder(path: str) -> bool:
    """Whether ``path`` is a folder made by :func:`backup_previous_run` (it holds :data:`BACKUP_MARKER`).

    Args:
        path: a folder.

    Returns:
        True for a backup folder, False for anything else.
    """
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, BACKUP_MARKER))


def backup_previous_run(run_dir: str) -> Optional[str]:
    """Move an earlier run's files out of the run folder into :func:`backup_folder` (``os.replace``
    within one parent folder: nothing is copied), so that ``--overwrite`` loses nothing until the
    new run has a checkpoint of its own. Half-written checkpoints of a killed run are deleted;
    other files of the folder stay.

    Args:
        run_dir: the run folder.

    Returns:
        The backup folder, or None when the folder held no run files.

    Raises:
        RunWriteError: a file could not be moved (those moved are put back first).
    """
    for path in glob.glob(os.path.join(run_dir, ".tmp-*")):
        os.remove(path)
    names = _run_file_names(run_dir)
    if not names:
        return None
    backup = backup_folder(run_dir)
    if is_backup_folder(backup):  # left by an --overwrite run that did not complete: this run replaces it
        shutil.rmtree(backup)
    moved = []
    try:
        os.makedirs(backup)
        with open(os.path.join(backup, BACKUP_MARKER), "w") as handle:
            handle.write(f"The previous run of {os.path.abspath(run_dir)}, kept by --overwrite until the new run "
                         "completes.\n")
        for name in names:
            os.replace(os.path.join(run_dir, name), os.path.join(backup, name))
            moved.append(name)
    except OSError as err:
        for name in moved:
            os.replace(os.path.join(backup, name), os.path.join(run_dir, name))
        shutil.rmtree(backup, ignore_errors=True)
        raise run_write_error(getattr(err, "filename", None) or backup, err) from None
    return backup


def restore_previous_run(run_dir: str, backup: str) -> List[str]:
    """Undo :func:`backup_previous_run`: delete the new run's files and move the previous run's back.

    Args:
        run_dir: the run folder.
        backup: the backup folder.

    Returns:
        The names restored.
    """
    if not is_backup_folder(backup):
        return []
    clear_previous_run(run_dir)
    names = [name for name in os.listdir(backup) if name != BACKUP_MARKER]
    for name in names:
        os.replace(os.path.join(backup, name), os.path.join(run_dir, name))
    shutil.rmtree(backup)
    return sorted(names)


def discard_previous_run(run_dir: str) -> Optional[str]:
    """Delete the backup :func:`backup_previous_run` made, once the new run has completed.

    Args:
        run_dir: the run folder.

    Returns:
        The backup folder deleted, or None when there was none.
    """
    backup = backup_folder(run_dir)
    if not is_backup_folder(backup):
        return None
    shutil.rmtree(backup)
    return backup


def one_line(message: str) -> str:
    """A message on one line: a multi-line one (e.g. a list of differing settings) joined with ``; ``.

    Args:
        message: the text.

    Returns:
        Its non-empty lines, stripped and joined.
    """
    out = ""
    for line in (part.strip() for part in message.splitlines()):
        if line:
            out += (line if not out else (" " if out.endswith(":") else "; ") + line)
    return out


def resume_command(argv: Sequence[str], program: Optional[str] = None) -> str:
    """The command line that continues an interrupted run.

    Args:
        argv: the run's arguments, without the program name.
        program: the script's path (default ``sys.argv[0]``).

    Returns:
        The shell-quoted command: the same flags, ``--overwrite`` dropped, ``--resume`` added.
    """
    program = program or (sys.argv[0] if sys.argv and sys.argv[0] else "recipe.py")
    kept = [a for a in argv if a != "--overwrite"]
    if not any(a == "--resume" or a.startswith("--resume=") for a in kept):
        kept.append("--resume")
    return shlex.join([os.path.basename(sys.executable) if sys.executable else "python", program, *kept])


def ineffective_flag_warnings(args: argparse.Namespace) -> List[str]:
    """Flags the user set that the run will not use.

    Args:
        args: the parsed settings (with ``_explicit``).

    Returns:
        One warning line per such flag.
    """
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
def resolve_dataset(requested: str, data_root: Optional[str],
                    real_default: str) -> Tuple[str, Optional[str], Optional[str]]:
    """Map ``--dataset`` to (canonical name, root, banner-or-None).

    The bundled datasets (``glyphs``, ``icons``) need no root. 'auto' looks for ``real_default``
    (``--data-root``, else the dataset's environment variable or ``$PML_HYPERBOLIC_DATA``, via
    :func:`pml_hyperbolic.data.find_dataset_root`); when absent it falls back to the bundled glyphs
    and returns a one-line banner saying so. An explicit ``--data-root``
    that holds no recognisable layout is an error (never a silent fallback).

    Args:
        requested: the ``--dataset`` value (a key of ``config.DATASET_ALIASES``).
        data_root: ``--data-root``, or None.
        real_default: the recipe's real dataset, looked for by ``auto``.

    Returns:
        ``(name, root or None, banner or None)``.

    Raises:
        ConfigError: the dataset (or ``--data-root``) does not hold a recognisable layout.
    """
    from ..data import find_dataset_root
    from ..data.registry import ROOT_ENVIRONMENT_VARIABLES, SHARED_DATA_VARIABLE

    name = DATASET_ALIASES[requested]
    if name in BUNDLED_DATASETS:
        return name, None, None
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
    """The error text for dataset ``name`` not found at ``data_root``: the layouts the loader
    accepts, where to get the data, and the flags that fix it."""
    from ..data.registry import DATASET_CLASSES, ROOT_ENVIRONMENT_VARIABLES
    from ..data.image_list import missing_dataset_error

    cls = DATASET_CLASSES[name]
    env = ROOT_ENVIRONMENT_VARIABLES.get(name, "")
    where = data_root if data_root else f"${env} (unset or not holding the data)"
    detail = str(missing_dataset_error(name, where, cls.LAYOUTS, cls.SOURCE))
    return (f"{detail} Fix: pass --data-root DIR (the folder in one of the layouts above) or set {env}=DIR; "
            "or run on the bundled data with --dataset glyphs.")


class RecipeCommandLineBase:
    """A recipe's flags, presets and start-up checks (no torch); see the module docstring.

    Recipe scripts subclass :class:`~pml_hyperbolic.training.cli.RecipeCommandLine`, which derives
    from this class.

    Design note: docs/design/recipe-defaults.md
    """

    name = "recipe"
    description = ""
    real_dataset = "cars196"        # what --dataset auto looks for
    hyperbolic = True               # evaluate with the hyperbolic kNN and plot the Poincaré disk
    reports_uncertainty = False     # print the Hyp-UML uncertainty bins (the Hyp-UML recipe)
    default_backbone = "vit_small_patch16_224"
    trainer_class = ImportedOnUse("pml_hyperbolic.training.trainer", "HyperbolicTrainer")
    label_hierarchy_level = 0
    # Score the head's output (True) or the trunk's features (False: the head is a projection that
    # only serves the loss, as MoCo's and HCL's MLP).
    evaluate_head = True
    # Fewest images per class in a batch: metric losses need a positive (HCL's self-supervised views: 1).
    min_samples_per_class = 2
    # The recipe's page under docs/recipes/ (named in --help).
    docs_page = "index.md"
    # Settings for the bundled glyphs on a CPU: a small pretrained CNN at a small image size (the
    # papers' ViT-S/16 at 224 px would take hours on a few cores). The bundled icons use the same
    # settings (not tuned on them).
    glyph_preset: Dict = {
        "backbone": "efficientnet_lite0", "pretrained": True, "image_size": 48, "resize_size": 48,
        "batch_size": 120, "samples_per_class": 4, "lr": 3e-4, "head_lr": 3e-3, "epochs": 3,
        "steps_per_epoch": 15, "amp": "auto", "freeze_patch_embed": False, "freeze_trunk": True,
        "eval_batch_size": 256, "eval_every": 0,
    }
    paper_presets: Dict[str, Dict] = {}

    def __init__(self, args: argparse.Namespace):
        """Hold the settings (the runner builds everything else).

        Args:
            args: the settings from :meth:`parse`.
        """
        self.args = args

    # ---- command line ----
    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        """Add the recipe's own flags (a subclass hook; the base adds none).

        Args:
            parser: the recipe's parser, the shared flags already added.
        """

    @classmethod
    def preset_columns(cls) -> List[Tuple[str, str, Dict]]:
        """Where each preset applies, as ``(preposition, where, preset)``: what ``--help`` lists
        beside each flag's default (the bundled data first, then the benchmarks)."""
        return [("on", "the bundled glyphs and icons", dict(cls.glyph_preset))] + [
            ("on", name, dict(cls.paper_presets.get(name, {}))) for name in BENCHMARKS]

    @classmethod
    def make_parser(cls) -> argparse.ArgumentParser:
        """The recipe's parser: the shared flags, the recipe's, and each flag's default per preset.

        Returns:
            A :class:`RecipeArgumentParser` (one-line errors).
        """
        prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else f"{cls.name}.py"
        parser = RecipeArgumentParser(
            prog=prog, description=cls.description,
            epilog=textwrap.fill(
                "Defaults: where the presets differ, each flag lists its default per dataset; the bundled "
                "glyphs are used with --dataset glyphs, or by --dataset auto when no benchmark is found; the "
                "bundled icons (--dataset icons) use the same settings, not tuned on icons yet. "
                "A flag or a --config key overrides the preset. A run folder holding a previous run is "
                "refused: continue it with --resume or start afresh with --overwrite. "
                f"Presets and notes: docs/recipes/{cls.docs_page}", width=78, break_on_hyphens=False),
            formatter_class=_HelpFormatter)
        add_common_arguments(parser, default_backbone=cls.default_backbone, hyperbolic=cls.hyperbolic)
        cls.add_arguments(parser)
        columns = cls.preset_columns()
        for action in parser._actions:
            if any(action.dest in preset for _, _, preset in columns):
                action.default_note = default_note(action.default, action.dest, columns)
        return parser

    @classmethod
    def resolved_dataset(cls, args: argparse.Namespace) -> str:
        """The canonical dataset this run uses.

        Args:
            args: the settings so far.

        Returns:
            The dataset name (``glyphs`` for ``--dataset auto`` without the benchmark's data;
            ``glyphs`` or ``icons`` when named).

        Raises:
            ConfigError: as :func:`light_dataset_name`.
        """
        name = light_dataset_name(args.dataset, args.data_root, cls.real_dataset)
        if name is None:  # auto with a data environment variable: the folder's layout decides
            name = resolve_dataset(args.dataset, args.data_root, cls.real_dataset)[0]
        return name

    @classmethod
    def presets(cls, args: argparse.Namespace) -> Dict:
        """The preset of the dataset in use (a copy).

        Args:
            args: the settings so far.

        Returns:
            The glyph preset on the bundled data (glyphs and icons alike), else the paper's preset
            for the dataset (empty where the recipe has none).
        """
        name = cls.resolved_dataset(args)
        if name in BUNDLED_DATASETS:
            return dict(cls.glyph_preset)
        return dict(cls.paper_presets.get(name, {}))

    @classmethod
    def parse(cls, argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
        """Parse a command line with the ``--config`` file and the presets (:func:`parse_config`).

        Args:
            argv: the arguments without the program name (default ``sys.argv[1:]``).

        Returns:
            The settings.
        """
        return parse_config(cls.make_parser, argv, presets=cls.presets)

    @classmethod
    def run_folder(cls, args: argparse.Namespace) -> str:
        """The run folder: ``--output-dir``, else ``runs/<recipe>-<dataset>``.

        Args:
            args: the settings.

        Returns:
            The folder's path.
        """
        return args.output_dir or os.path.join("runs", f"{cls.name}-{cls.resolved_dataset(args)}")

    @classmethod
    def preflight(cls, args: argparse.Namespace) -> None:
        """Every check that needs neither torch nor data, run before anything is loaded or written.

        Args:
            args: the settings.

        Raises:
            ConfigError: for samples per class below :attr:`min_samples_per_class`, a batch size
                that holds no whole classes, or a run folder that cannot be used.
        """
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if args.samples_per_class < cls.min_samples_per_class:
            raise ConfigError(f"--samples-per-class must be >= {cls.min_samples_per_class} for {cls.name} (a metric "
                              f"loss needs two images of a class in the batch), got {args.samples_per_class}")
        check_batch_settings(args.batch_size, args.samples_per_class, world_size)
        run_dir = cls.run_folder(args)
        check_output_folder(run_dir, "--output-dir" if args.output_dir else "run folder")
        check_run_folder(run_dir, args.resume, args.overwrite)
        for message in ineffective_flag_warnings(args):
            warn(message)

    @classmethod
    def main(cls, argv: Optional[Sequence[str]] = None) -> Dict:
        """Entry point of a recipe script.

        Args:
            argv: the arguments without the program name (default ``sys.argv[1:]``).

        Returns:
            The run's results.

        Raises:
            SystemExit: status 2 after one ``error:`` line for a user error; 1 after one ``error:``
                line naming the file when the run folder cannot be written once the run started;
                130 on Ctrl-C, after printing where the last checkpoint is and how to resume.
        """
        argv = list(sys.argv[1:] if argv is None else argv)
        run_dir = None
        try:
            args = cls.parse(argv)
            cls.preflight(args)
            run_dir = cls.run_folder(args)
            return cls(args).run()
        except ConfigError as err:
            print(f"error: {one_line(str(err))}", file=sys.stderr, flush=True)
            raise SystemExit(2)
        except RunWriteError as err:
            print(f"error: {one_line(str(err))}", file=sys.stderr, flush=True)
            raise SystemExit(WRITE_FAILED_EXIT_STATUS)
        except KeyboardInterrupt:
            print(interrupted_message(run_dir, argv), file=sys.stderr, flush=True)
            raise SystemExit(INTERRUPTED_EXIT_STATUS)


def interrupted_message(run_dir: Optional[str], argv: Sequence[str]) -> str:
    """The one line printed on Ctrl-C.

    Args:
        run_dir: the run folder, or None before it was decided.
        argv: the run's arguments, without the program name.

    Returns:
        Where the last checkpoint is and the command that resumes from it, or how to start again.
    """
    checkpoint = os.path.join(run_dir, "last.pt") if run_dir else None
    if checkpoint and os.path.isfile(checkpoint):
        kept = backup_folder(run_dir)
        kept = f" (the run it replaces stays in {kept} until this one completes)" if is_backup_folder(kept) else ""
        return f"interrupted: the last checkpoint is {checkpoint}{kept}; continue with: {resume_command(argv)}"
    if run_dir:
        again = "the same command" + (" plus --overwrite" if previous_run_files(run_dir) and "--overwrite" not in argv
                                      else "")
        return (f"interrupted before the first checkpoint (nothing in {run_dir}/ to resume from); "
                f"start again with {again}.")
    return "interrupted before the run started."
