"""Shared training machinery of the recipes: configuration, PML trainer with AMP, evaluation hook,
checkpoints/resume, torchrun/DDP wrappers and run logging.

``cli``, ``command_line``, ``config`` and ``presets`` import no torch: the recipes parse and check
their command line with them before anything heavy is loaded (see ``cli``). Every other name is imported on first
access (see ``pml_hyperbolic._lazy``).

Design note: docs/design/training.md
"""
from __future__ import annotations

_EXPORTS = {
    "cli": ".cli", "command_line": ".command_line", "config": ".config", "presets": ".presets",
    "CheckpointManager": ".checkpoint", "atomic_torch_save": ".checkpoint", "restore_trainer": ".checkpoint",
    "RecipeCommandLine": ".cli", "RecipeCommandLineBase": ".command_line",
    "ConfigError": ".config", "add_common_arguments": ".config", "check_batch_settings": ".config",
    "load_config_file": ".config", "parse_config": ".config",
    "DistributedContext": ".distributed", "init_distributed": ".distributed", "wrap_loss": ".distributed",
    "wrap_miner": ".distributed", "wrap_model": ".distributed",
    "EpochEndEvaluator": ".evaluation", "Evaluator": ".evaluation", "build_tester": ".evaluation",
    "eval_protocol": ".evaluation", "format_recall": ".evaluation",
    "RunLogger": ".run_logger",
    "Recipe": ".runner", "format_summary": ".runner", "freeze_patch_embedding": ".runner",
    "resolve_dataset": ".command_line", "select_device": ".runner",
    "HyperbolicTrainer": ".trainer", "resolve_amp": ".trainer",
    "DegradedCopyTrainer": ".degraded_copy_trainer", "add_radius_terms": ".radius_terms",
}

__all__ = [
    "CheckpointManager", "atomic_torch_save", "restore_trainer",
    "ConfigError", "add_common_arguments", "load_config_file", "parse_config",
    "DistributedContext", "init_distributed", "wrap_loss", "wrap_miner", "wrap_model",
    "EpochEndEvaluator", "Evaluator", "build_tester", "eval_protocol", "format_recall",
    "RunLogger", "Recipe", "RecipeCommandLine", "RecipeCommandLineBase", "format_summary", "check_batch_settings", "freeze_patch_embedding",
    "resolve_dataset", "select_device",
    "HyperbolicTrainer", "resolve_amp", "DegradedCopyTrainer", "add_radius_terms",
]

from .._lazy import lazy_exports  # noqa: E402

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
