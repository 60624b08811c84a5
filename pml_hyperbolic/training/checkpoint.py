"""Atomic checkpoints with everything ``--resume`` needs to reproduce an uninterrupted run."""
from __future__ import annotations

import hashlib
import io
import os
import random
import signal
import tempfile
import threading
from contextlib import contextmanager
from typing import Dict, Iterator, Optional

import numpy as np
import torch

from .config import ConfigError, config_fingerprint


CHECKPOINT_FORMAT = "pml-hyperbolic-checkpoint/2"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_with_digest(obj) -> Dict:
    """``{"format", "sha256", "payload"}``: ``obj`` serialised by ``torch.save`` and its SHA-256.

    torch's zip reader checks no CRC, so bytes flipped inside tensor data would load silently; the
    digest over the whole payload makes any change a clear error at load time."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    return {"format": CHECKPOINT_FORMAT, "sha256": _sha256(payload), "payload": payload}


def unpack_with_digest(packed, path: str, map_location="cpu"):
    """Inverse of :func:`pack_with_digest`; a digest mismatch raises ``ConfigError`` naming ``path``.
    A file written before digests existed (no ``format`` key) is returned as it is."""
    if not (isinstance(packed, dict) and packed.get("format") == CHECKPOINT_FORMAT):
        return packed
    payload = packed.get("payload")
    if not isinstance(payload, (bytes, bytearray)) or _sha256(bytes(payload)) != packed.get("sha256"):
        raise ConfigError(f"--resume: checkpoint {path} is corrupted (its SHA-256 digest does not match its "
                          "contents). Resume from another checkpoint (best.pt / last.pt) or start from scratch.")
    return torch.load(io.BytesIO(payload), map_location=map_location, weights_only=False)


def read_checkpoint(path: str, map_location="cpu"):
    """Load a checkpoint written by :func:`atomic_torch_save`, verifying its digest."""
    return unpack_with_digest(torch.load(path, map_location=map_location, weights_only=False), path, map_location)


_deferring = False


@contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold a Ctrl-C (SIGINT) that arrives inside the block and raise ``KeyboardInterrupt`` when it ends.

    Why: a ``KeyboardInterrupt`` raised inside ``torch.save`` leaves its zip writer half-written, and
    the writer's cleanup then raises ``RuntimeError: unexpected pos ...``, which replaces the
    interrupt (a traceback and exit status 1 instead of the resume line and 130). Deferring it until
    the checkpoint is complete also means the resume line points at the checkpoint just written.
    Only the main thread can install signal handlers; elsewhere, or nested, the block runs as is.
    """
    global _deferring
    if _deferring or threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    _deferring = True
    try:
        yield
    finally:
        _deferring = False
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):  # the handler that was active (Python's default raises KeyboardInterrupt)
            previous(signal.SIGINT, None)
        elif previous == signal.SIG_DFL:
            raise KeyboardInterrupt
        # SIG_IGN: the process ignores Ctrl-C; so do we


def atomic_torch_save(obj, path: str, packed: bool = False) -> None:
    """Write ``obj`` (with a SHA-256 digest, see :func:`pack_with_digest`) to a temporary file in the
    same folder, fsync it, then ``os.replace`` it. ``packed=True``: ``obj`` is already the output of
    :func:`pack_with_digest` (one serialisation written to several files).

    A crash mid-write leaves the previous checkpoint intact (``os.replace`` is atomic on POSIX and
    Windows when source and target are on the same file system, hence the same folder). A Ctrl-C
    during the write takes effect once the file is in place (:func:`ctrl_c_deferred`).
    """
    if packed and not (isinstance(obj, dict) and obj.get("format") == CHECKPOINT_FORMAT and "payload" in obj):
        raise ValueError("atomic_torch_save(packed=True) needs the dict returned by pack_with_digest")
    with ctrl_c_deferred():
        _write_then_replace(obj if packed else pack_with_digest(obj), path)


def _write_then_replace(packed: Dict, path: str) -> None:
    """Temporary file in ``path``'s folder, fsync, ``os.replace``; the temporary file removed on failure."""
    folder = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-" + os.path.basename(path) + "-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(packed, handle, pickle_protocol=4)  # protocol 4 stores the payload bytes raw
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def rng_state() -> Dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel (checkpoints never hold the ``module.`` prefix)."""
    return module.module if hasattr(module, "module") and isinstance(
        module, torch.nn.parallel.DistributedDataParallel) else module


def describe_config_difference(saved: Dict, current: Dict) -> str:
    keys = sorted(set(saved) | set(current))
    rows = [f"  {k}: checkpoint={saved.get(k, '<unset>')!r}  now={current.get(k, '<unset>')!r}"
            for k in keys if saved.get(k, "<unset>") != current.get(k, "<unset>")]
    return "\n".join(rows)


def check_compatible(checkpoint: Dict, config: Dict, path: str) -> None:
    """Refuse to resume a checkpoint written under different settings (say which, and what to do)."""
    saved = checkpoint.get("config_fingerprint")
    if saved is None:
        raise ConfigError(f"{path} is not a pml-hyperbolic training checkpoint (no config fingerprint).")
    current = config_fingerprint(config)
    # JSON-like normalisation: tuples vs lists must not count as a difference.
    norm = lambda d: {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}  # noqa: E731
    if norm(saved) != norm(current):
        raise ConfigError(
            f"checkpoint {path} was written with a different configuration:\n"
            f"{describe_config_difference(norm(saved), norm(current))}\n"
            "Resume with the same settings (e.g. --config <run folder>/config.json), or start a new run "
            "with a different --output-dir (or without --resume).")


class CheckpointManager:
    """``last.pt`` after every epoch and ``best.pt`` whenever Recall@1 improves, both atomic."""

    def __init__(self, run_dir: str, config: Dict, enabled: bool = True):
        self.run_dir = run_dir
        self.config = config
        self.enabled = enabled
        self.last_path = os.path.join(run_dir, "last.pt")
        self.best_path = os.path.join(run_dir, "best.pt")

    def state(self, trainer, epoch: int, best: Dict, history) -> Dict:
        sampler = getattr(trainer, "sampler", None)
        return {
            "format": "pml-hyperbolic-checkpoint-v1",
            "epoch": epoch,
            "global_step": trainer.global_step,
            "models": {k: unwrap(v).state_dict() for k, v in trainer.models.items()},
            "loss_funcs": {k: unwrap(v).state_dict() for k, v in trainer.loss_funcs.items()},
            "optimizers": {k: v.state_dict() for k, v in trainer.optimizers.items()},
            "lr_schedulers": {k: v.state_dict() for k, v in (trainer.lr_schedulers or {}).items()},
            "scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
            # Checkpoints are taken at epoch boundaries: the next epoch starts at its first batch.
            "sampler": ({**sampler.state_dict(), "next_batch": 0} if hasattr(sampler, "state_dict") else None),
            "extra": trainer.extra_state_dict(),
            "rng": rng_state(),
            "best": dict(best),
            "history": list(history),
            "config": self.config,
            "config_fingerprint": config_fingerprint(self.config),
        }

    def save(self, trainer, epoch: int, best: Dict, history, is_best: bool) -> None:
        if not self.enabled:
            return
        state = self.state(trainer, epoch, best, history)
        packed = None
        with ctrl_c_deferred():  # last.pt and best.pt both written before a Ctrl-C takes effect
            for path in [self.last_path] + ([self.best_path] if is_best else []):
                try:
                    if packed is None:  # serialised and digested once, written to last.pt (and best.pt)
                        packed = pack_with_digest(state)
                    atomic_torch_save(packed, path, packed=True)
                except OSError as err:  # disk full, quota, permissions: one clear line, the old file survives
                    raise ConfigError(f"cannot write checkpoint {path}: {err.strerror or err}. The previous "
                                      f"checkpoint there is intact (--resume continues from epoch {epoch - 1}); "
                                      "free space or choose another --output-dir.") from err

    def resolve(self, resume: Optional[str]) -> Optional[str]:
        if resume is None:
            return None
        path = self.last_path if resume == "auto" else resume
        if not os.path.isfile(path):
            raise ConfigError(f"--resume: no checkpoint at {path}. Give the path of a last.pt/best.pt, or drop "
                              "--resume to start from scratch.")
        return path

    def load(self, path: str, map_location="cpu") -> Dict:
        try:
            checkpoint = torch.load(path, map_location=map_location, weights_only=False)
        except Exception as err:  # corrupted or foreign file: tell the user which
            raise ConfigError(f"--resume: cannot read checkpoint {path}: {err}")
        checkpoint = unpack_with_digest(checkpoint, path, map_location)
        check_compatible(checkpoint, self.config, path)
        return checkpoint


def restore_trainer(trainer, checkpoint: Dict) -> None:
    """Load model/optimiser/scaler/sampler/RNG state into a freshly built trainer."""
    for k, v in checkpoint["models"].items():
        unwrap(trainer.models[k]).load_state_dict(v)
    for k, v in checkpoint.get("loss_funcs", {}).items():
        if k in trainer.loss_funcs:
            unwrap(trainer.loss_funcs[k]).load_state_dict(v)
    for k, v in checkpoint["optimizers"].items():
        trainer.optimizers[k].load_state_dict(v)
    for k, v in checkpoint.get("lr_schedulers", {}).items():
        trainer.lr_schedulers[k].load_state_dict(v)
    if trainer.scaler is not None and checkpoint.get("scaler") is not None:
        trainer.scaler.load_state_dict(checkpoint["scaler"])
    sampler = getattr(trainer, "sampler", None)
    if checkpoint.get("sampler") is not None and hasattr(sampler, "load_state_dict"):
        sampler.load_state_dict(checkpoint["sampler"])
    trainer.load_extra_state_dict(checkpoint.get("extra") or {})
    trainer.global_step = int(checkpoint["global_step"])
    set_rng_state(checkpoint["rng"])
