"""PML ``MetricLossOnly`` with mixed precision, correct clipping under a GradScaler, a fresh
per-epoch data order (so an interrupted run resumes exactly), a step budget and start-of-epoch
hooks (used by the unsupervised recipe to re-cluster).

Design note: docs/design/training.md
"""
from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Callable, Optional, Tuple

import torch
import tqdm
from pytorch_metric_learning.trainers import MetricLossOnly
from pytorch_metric_learning.utils import common_functions as c_f


def resolve_amp(amp: str, device: torch.device) -> Tuple[Optional[torch.dtype], bool]:
    """Map ``--amp`` to an autocast dtype and whether a GradScaler is needed.

    'auto' is fp16 + scaler on CUDA and off on CPU (CPU autocast of convolutions is slower than
    float32 on most machines). bf16 has fp32's exponent range, so it needs no scaler.

    Args:
        amp: ``"auto"``, ``"off"``, ``"fp16"`` or ``"bf16"``.
        device: the device the models run on.

    Returns:
        ``(dtype or None, use_grad_scaler)``.

    Raises:
        ConfigError: fp16 requested on a non-CUDA device.
        ValueError: an unknown ``amp``.
    """
    if amp == "off" or (amp == "auto" and device.type != "cuda"):
        return None, False
    if amp == "bf16":
        return torch.bfloat16, False
    if amp in ("fp16", "auto"):
        if device.type != "cuda":
            # fp16 autocast on CPU is poorly supported; running bf16 instead would silently ignore the flag
            from .config import ConfigError

            raise ConfigError(f"--amp fp16 needs a CUDA device (this run is on {device.type}); use --amp bf16 "
                              "(what CPUs accelerate) or --amp off")
        return torch.float16, True
    raise ValueError(f"amp must be one of auto/off/fp16/bf16, got {amp!r}")


# Images per call of a frozen trunk on CPU: a small CNN's activations for a few hundred images
# overflow the CPU caches; smaller chunks give the same outputs bit for bit (docs/design/training.md).
CPU_TRUNK_CHUNK_SIZE = 64


def forward_in_chunks(model: torch.nn.Module, images: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``model(images)`` computed as ``cat(model(x_1), ..., model(x_n))`` over ``n = ceil(B / chunk_size)``
    near-equal chunks along the batch, so that no chunk is much smaller than ``chunk_size`` (very
    small batches take other, slower kernels).

    Only exact for a model whose output rows depend on their own input row alone (eval mode: no
    batch statistics); callers check that (:func:`chunked_forward_applies`).

    Args:
        model: the module to apply.
        images: (B, ...) batch.
        chunk_size: target rows per chunk (≥ 1).

    Returns:
        The concatenated outputs, as ``model(images)``.

    Raises:
        ValueError: ``chunk_size < 1``.

    Design note: docs/design/training.md
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    n_chunks = math.ceil(images.shape[0] / chunk_size)
    if n_chunks <= 1:
        return model(images)
    return torch.cat([model(chunk) for chunk in torch.tensor_split(images, n_chunks)])


def checked_chunk_size(chunk_size: Optional[int]) -> Optional[int]:
    """``trunk_chunk_size`` as an int (or None = whole batches).

    Raises:
        ValueError: anything but None or a positive int.
    """
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"trunk_chunk_size must be a positive number of images or None (whole batches), "
                         f"got {chunk_size!r}")
    return int(chunk_size)


def is_frozen(model: torch.nn.Module) -> bool:
    """No parameter of ``model`` requires a gradient (nothing trains it)."""
    return not any(p.requires_grad for p in model.parameters())


def chunked_forward_applies(model: Any, images: Any, chunk_size: Optional[int],
                            require_frozen: bool = True) -> bool:
    """Chunking pays and is exact: a model in eval mode (and frozen, unless ``require_frozen`` is
    False: under ``torch.no_grad`` it does not matter) on a CPU tensor larger than a chunk. GPUs want
    large batches, and their kernels may change with the batch size."""
    return (bool(chunk_size) and torch.is_tensor(images) and images.device.type == "cpu"
            and images.shape[0] > chunk_size and isinstance(model, torch.nn.Module)
            and not model.training and (is_frozen(model) or not require_frozen))


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_freed_memory_retained = False


def retain_freed_memory(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
    """Keep memory that a CPU forward frees inside the process (glibc ``mallopt``), instead of
    handing it back to the OS after every batch and page-faulting it in again on the next.

    Why: a CNN forward on CPU allocates and frees tens of MB of activations per batch. glibc serves
    blocks above its mmap threshold with fresh ``mmap`` pages and trims the heap top once more than
    ``2 x`` that threshold is free, so each batch faults its activations in anew (page faults and
    kernel time, not user time). Blocks up to ``mmap_threshold`` (glibc's ceiling, 32 MiB) then come
    from the heap, and up to ``trim_threshold`` bytes of free heap stay mapped. Process-wide and
    applied once.

    Args:
        mmap_threshold: glibc's ``M_MMAP_THRESHOLD`` in bytes.
        trim_threshold: glibc's ``M_TRIM_THRESHOLD`` in bytes.

    Returns:
        True when the setting is in effect; False where the C library has no ``mallopt`` (macOS,
        musl) or refused it.

    Design note: docs/design/training.md
    """
    global _freed_memory_retained
    if _freed_memory_retained:
        return True
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _freed_memory_retained = (mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold)) == 1
                              and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold)) == 1)
    return _freed_memory_retained


def progress_enabled(requested: bool = True) -> bool:
    """``requested`` unless ``TQDM_DISABLE`` is set (the recipes' ``--quiet`` sets it)."""
    return requested and os.environ.get("TQDM_DISABLE", "").strip().lower() in ("", "0", "false")


def _scalar(value) -> float:
    return float(value.detach()) if torch.is_tensor(value) else float(value)


def is_batch_sampler(sampler: Any) -> bool:
    """True for samplers that yield whole batches (``ClassBalancedBatchSampler`` is not a
    ``torch.utils.data.BatchSampler`` subclass, so PML's own check would misuse it)."""
    return isinstance(sampler, torch.utils.data.BatchSampler) or hasattr(sampler, "samples_per_class")


class HyperbolicTrainer(MetricLossOnly):
    """``MetricLossOnly`` plus AMP, unscale-then-clip, per-epoch ``sampler.set_epoch`` and ``max_steps``.

    The arguments below come on top of PML's ``BaseTrainer`` ones.

    Args:
        amp_dtype: autocast dtype for the models' forward (None = off). The embeddings are cast to
            float32 *before* the loss, so every distance/loss runs in float32 outside autocast.
        use_grad_scaler: use ``torch.amp.GradScaler`` (fp16 only).
        grad_clip_norm: total gradient-norm threshold; gradients are unscaled first, otherwise the
            threshold would apply to ``scale × grad`` and clip almost nothing (or everything).
        max_steps: stop after this many optimiser steps in total (across epochs and resumes).
        start_of_epoch_hook: ``hook(trainer)`` called before each epoch's data is drawn.
        show_progress: tqdm bars (off on non-zero ranks, and when ``TQDM_DISABLE`` is set).
        trunk_chunk_size: a frozen trunk in eval mode runs on CPU in chunks of about this many
            images (same outputs, fewer cache misses: :data:`CPU_TRUNK_CHUNK_SIZE`); None = whole batches.
        keep_freed_memory: on a CPU device, keep freed activation memory in the process
            (:func:`retain_freed_memory`, process-wide) rather than page-faulting it in every batch.
        *args: PML ``BaseTrainer`` positional arguments.
        **kwargs: PML ``BaseTrainer`` keyword arguments (models, optimizers, loss_funcs, ...).

    Raises:
        ValueError: a bad ``trunk_chunk_size``.

    Design note: docs/design/training.md
    """

    def __init__(self, *args: Any, amp_dtype: Optional[torch.dtype] = None, use_grad_scaler: bool = False,
                 grad_clip_norm: Optional[float] = None,
                 max_steps: Optional[int] = None, start_of_epoch_hook: Optional[Callable] = None,
                 show_progress: bool = True, trunk_chunk_size: Optional[int] = CPU_TRUNK_CHUNK_SIZE,
                 keep_freed_memory: bool = True, **kwargs: Any):
        self.trunk_chunk_size = checked_chunk_size(trunk_chunk_size)
        self.amp_dtype = amp_dtype
        self.grad_clip_norm = grad_clip_norm
        self.max_steps = max_steps
        self.start_of_epoch_hook = start_of_epoch_hook
        self.show_progress = progress_enabled(show_progress)
        self.global_step = 0
        self.nonfinite_steps = 0
        device = kwargs.get("data_device") or torch.device("cpu")
        if keep_freed_memory and torch.device(device).type == "cpu":
            retain_freed_memory()
        self.scaler = torch.amp.GradScaler(torch.device(device).type) if use_grad_scaler else None
        super().__init__(*args, **kwargs)

    # ---- extension points for recipes with extra state (e.g. a momentum encoder's queue) ----
    def extra_state_dict(self) -> dict:
        return {}

    def load_extra_state_dict(self, state: dict) -> None:
        pass

    # ---- data ----
    def initialize_dataloader(self):
        from pytorch_metric_learning.utils import common_functions as c_f

        if is_batch_sampler(self.sampler):
            self.dataloader = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=self.sampler, num_workers=self.dataloader_num_workers,
                collate_fn=self.collate_fn, persistent_workers=False)
        else:
            self.dataloader = c_f.get_train_dataloader(
                self.dataset, self.batch_size, self.sampler, self.dataloader_num_workers, self.collate_fn)
        if not self.iterations_per_epoch:
            self.iterations_per_epoch = len(self.dataloader)

    def steps_exhausted(self) -> bool:
        return self.max_steps is not None and self.global_step >= self.max_steps

    def train(self, start_epoch: int = 1, num_epochs: int = 1) -> None:
        """Train epochs ``start_epoch..num_epochs`` (fewer when ``max_steps`` is reached or the
        end-of-epoch hook returns False)."""
        self.initialize_dataloader()
        for self.epoch in range(start_epoch, num_epochs + 1):
            if self.steps_exhausted():
                break
            if hasattr(self.sampler, "set_epoch"):
                self.sampler.set_epoch(self.epoch)
            if self.start_of_epoch_hook is not None:
                self.start_of_epoch_hook(self)
            # A new iterator per epoch: the order then depends only on (seed, epoch) and the RNG
            # state at the epoch start, which checkpoints store, so a resumed run is identical.
            self.dataloader_iter = iter(self.dataloader)
            self.set_to_train()
            pbar = tqdm.tqdm(range(self.iterations_per_epoch), disable=not self.show_progress,
                             desc=f"epoch {self.epoch}", leave=False, dynamic_ncols=True)
            epoch_loss, epoch_steps = 0.0, 0
            for self.iteration in pbar:
                if self.steps_exhausted():
                    break
                self.forward_and_backward()
                self.global_step += 1
                epoch_loss += _scalar(self.losses["total_loss"])
                epoch_steps += 1
                self.end_of_iteration_hook(self)
                pbar.set_postfix(loss=f"{_scalar(self.losses['total_loss']):.4f}")
                self.step_lr_schedulers(end_of_epoch=False)
            pbar.close()
            self.step_lr_schedulers(end_of_epoch=True)
            self.last_epoch_loss = epoch_loss / epoch_steps if epoch_steps else float("nan")
            self.zero_losses()
            if self.end_of_epoch_hook(self) is False:
                break

    def get_batch(self):
        # a batch of unreadable images only is None (collate_skipping_unreadable): take the next
        # one, for at most one pass over the loader (then the data itself is unusable)
        for _ in range(len(self.dataloader) + 1):
            self.dataloader_iter, batch = c_f.try_next_on_generator(self.dataloader_iter, self.dataloader)
            if batch is not None:
                break
        else:
            raise RuntimeError("every image of a whole pass over the training data was unreadable")
        data, labels = self.data_and_label_getter(batch)
        labels = c_f.process_label(labels, self.label_hierarchy_level, self.label_mapper)
        data, labels = self.maybe_do_batch_mining(data, labels)
        if torch.is_tensor(labels) and labels.device != torch.device(self.data_device):
            # now, while the device has nothing of this step queued: a loss that moved them itself
            # would make the host wait for the trunk's forward pass first (a copy from pageable memory
            # waits for the stream)
            labels = labels.to(self.data_device, non_blocking=True)
        return data, labels

    # ---- forward: models under autocast, losses in float32 ----
    def autocast(self):
        device_type = torch.device(self.data_device).type
        return torch.autocast(device_type=device_type, dtype=self.amp_dtype or torch.float32,
                              enabled=self.amp_dtype is not None)

    def get_trunk_output(self, data: Any) -> torch.Tensor:
        data = c_f.to_device(data, device=self.data_device, dtype=self.dtype)
        trunk = self.models["trunk"]
        if chunked_forward_applies(trunk, data, self.trunk_chunk_size):
            return forward_in_chunks(trunk, data, self.trunk_chunk_size)
        return trunk(data)

    def compute_embeddings(self, data: Any) -> torch.Tensor:
        with self.autocast():
            embeddings = super().compute_embeddings(data)
        return embeddings.float()

    # ---- backward / clip / step ----
    def backward(self):
        loss = self.losses["total_loss"]
        if not torch.is_tensor(loss) or not loss.requires_grad:
            return
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def trainable_parameters(self):
        for group in (self.models, self.loss_funcs):
            for module in group.values():
                for p in module.parameters():
                    if p.requires_grad and p.grad is not None:
                        yield p

    def clip_gradients(self):
        if self.scaler is not None:
            for opt in self.optimizers.values():
                self.scaler.unscale_(opt)
        if self.grad_clip_norm is not None:
            params = list(self.trainable_parameters())
            if params:
                torch.nn.utils.clip_grad_norm_(params, self.grad_clip_norm)
        super().clip_gradients()

    def step_optimizers(self):
        loss = self.losses["total_loss"]
        finite = bool(torch.isfinite(loss).all()) if torch.is_tensor(loss) else math.isfinite(float(loss))
        if self.scaler is not None:
            for k, v in self.optimizers.items():
                self.scaler.step(v)
            self.scaler.update()
            return
        if not finite:
            # Without a scaler nothing else would stop a NaN from entering the weights.
            self.nonfinite_steps += 1
            warnings.warn(f"non-finite loss at step {self.global_step}; skipping the optimiser step")
            return
        super().step_optimizers()
