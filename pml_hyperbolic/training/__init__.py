"""Shared training machinery of the recipes: configuration, PML trainer with AMP, evaluation hook,
checkpoints/resume, torchrun/DDP helpers and run logging."""
from .checkpoint import CheckpointManager, atomic_torch_save, restore_trainer
from .config import ConfigError, add_common_arguments, load_config_file, parse_config
from .distributed import DistributedContext, init_distributed, wrap_loss, wrap_miner, wrap_model
from .evaluation import EpochEndEvaluator, Evaluator, build_tester, eval_protocol, format_recall
from .run_logger import RunLogger
from .runner import Recipe, check_batch_settings, freeze_patch_embedding, resolve_dataset, select_device
from .trainer import HyperbolicTrainer, resolve_amp

__all__ = [
    "CheckpointManager", "atomic_torch_save", "restore_trainer",
    "ConfigError", "add_common_arguments", "load_config_file", "parse_config",
    "DistributedContext", "init_distributed", "wrap_loss", "wrap_miner", "wrap_model",
    "EpochEndEvaluator", "Evaluator", "build_tester", "eval_protocol", "format_recall",
    "RunLogger", "Recipe", "check_batch_settings", "freeze_patch_embedding", "resolve_dataset", "select_device",
    "HyperbolicTrainer", "resolve_amp",
]
