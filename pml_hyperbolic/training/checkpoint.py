"""Atomic checkpoints with everything ``--resume`` needs to reproduce an uninterrupted run.

Files hold tensors and plain data only and are read with torch's restricted loader
(``weights_only=True``): a crafted file is refused before any of its code runs. A SHA-256 digest
over the serialised state makes damage a clear error.

Design note: docs/design/checkpoints.md
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
import random
import re
import signal
import tempfile
import threading
import zipfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import numpy as np
import torch

from .config import ConfigError, config_fingerprint


CHECKPOINT_FORMAT = "pml-hyperbolic-checkpoint/2"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_with_digest(obj: Any) -> Dict:
    """``{"format", "sha256", "payload"}``: ``obj`` serialised by ``torch.save`` and its SHA-256.

    torch's zip reader checks no CRC, so bytes flipped inside tensor data would load silently; the
    digest over the whole payload makes any change a clear error at load time."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    payload = buffer.getvalue()
    return {"format": CHECKPOINT_FORMAT, "sha256": _sha256(payload), "payload": payload}


def _numpy_reconstruct():
    try:
        from numpy._core.multiarray import _reconstruct  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core.multiarray import _reconstruct
    return _reconstruct


# The only globals a checkpoint may name besides torch's own: numpy's array reconstruction, for the
# NumPy RNG state of checkpoints written before it was stored as plain integers (both module names:
# numpy 1 and numpy 2 pickle it under different ones).
_SAFE_GLOBALS = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                 (_numpy_reconstruct(), "numpy.core.multiarray._reconstruct"),
                 (_numpy_reconstruct(), "numpy._core.multiarray._reconstruct")]


class _PlainUnpickler(pickle.Unpickler):
    """Reads pickles of plain data only (dicts, strings, bytes, numbers): any global or tensor is
    refused before anything is built, so no code from the file can run."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("tensor data")


def _refused(path: str, err: Exception) -> ConfigError:
    """One line for a file that the restricted loader refuses (no pickle internals)."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    what = f" ({found.group(1)})" if found else ""
    return ConfigError(f"cannot read checkpoint {path}: it holds objects other than tensors and plain data{what}; "
                       "refused, since loading them could run code from the file. Use a checkpoint written by "
                       "pml-hyperbolic's training, or start from scratch.")


def _torch_load(source, path: str, map_location):
    """``torch.load(weights_only=True)`` with the few numpy globals old checkpoints need; every
    failure as one ConfigError naming ``path``."""
    try:
        with torch.serialization.safe_globals(_SAFE_GLOBALS):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        raise _refused(path, err) from None
    except Exception as err:  # truncated, not a torch file, unreadable
        raise ConfigError(f"cannot read checkpoint {path}: not a readable torch checkpoint "
                          f"({type(err).__name__}). Resume from another checkpoint or start from scratch.") from None


def unpack_with_digest(packed: Any, path: str, map_location: Any = "cpu") -> Any:
    """Inverse of :func:`pack_with_digest`; a digest mismatch raises ``ConfigError`` naming ``path``.
    A file written before digests existed (no ``format`` key) is returned as it is. The payload is
    read with ``torch.load(weights_only=True)``: tensors and plain data only, never code.

    Raises:
        ConfigError: a digest mismatch, or a payload that holds anything else than tensors and
            plain data (refused before any of it is executed).
    """
    if not (isinstance(packed, dict) and packed.get("format") == CHECKPOINT_FORMAT):
        return packed
    payload = packed.get("payload")
    if not isinstance(payload, (bytes, bytearray)) or _sha256(bytes(payload)) != packed.get("sha256"):
        raise ConfigError(f"--resume: checkpoint {path} is corrupted (its SHA-256 digest does not match its "
                          "contents). Resume from another checkpoint (best.pt / last.pt) or start from scratch.")
    return _torch_load(io.BytesIO(bytes(payload)), path, map_location)


def _read_container(path: str):
    """The outer dict of a file written by :func:`atomic_torch_save`, read by :class:`_PlainUnpickler`
    (the container holds no tensors; torch's restricted loader does not read the pickle protocol
    that stores the payload bytes raw), or None when ``path`` is a torch zip file of another kind
    (a checkpoint from before digests existed, or a foreign file). ConfigError when it is not a
    torch zip file at all."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if name.endswith("/data.pkl")]
            if len(names) != 1:
                raise zipfile.BadZipFile("no data.pkl")
            data = archive.read(names[0])
    except zipfile.BadZipFile as err:
        if "CRC" in str(err):  # bytes changed after the file was written (zip's own check, before the digest's)
            raise ConfigError(f"--resume: checkpoint {path} is corrupted (its CRC-32 and SHA-256 digests do not "
                              "match its contents). Resume from another checkpoint (best.pt / last.pt) or start "
                              "from scratch.") from None
        raise ConfigError(f"cannot read checkpoint {path}: not a torch checkpoint (zip) file. Resume from "
                          "another checkpoint or start from scratch.") from None
    except (EOFError, ValueError, OSError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else "not a torch checkpoint (zip) file"
        raise ConfigError(f"cannot read checkpoint {path}: {reason}. Resume from another checkpoint or "
                          "start from scratch.") from None
    try:
        packed = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception:
        return None
    return packed if isinstance(packed, dict) and packed.get("format") == CHECKPOINT_FORMAT else None


def read_checkpoint(path: str, map_location: Any = "cpu") -> Any:
    """Load a checkpoint written by :func:`atomic_torch_save`, verifying its digest.

    Tensors and plain data only (``weights_only=True``): a file holding other objects is refused
    before any of its code can run.

    Raises:
        ConfigError: naming ``path``, for a file that is not a readable checkpoint, whose digest does
            not match, or that holds objects other than tensors and plain data.
    """
    packed = _read_container(path)
    if packed is None:  # written before digests existed, or foreign: the restricted loader on the file
        return _torch_load(path, path, map_location)
    return unpack_with_digest(packed, path, map_location)


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


def atomic_torch_save(obj: Any, path: str, packed: bool = False) -> None:
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
    """Python's, NumPy's, torch's (and CUDA's) RNG states, as tensors and plain data (NumPy's key
    array as a list of ints), so that :func:`read_checkpoint`'s restricted loader reads them."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, keys.tolist(), int(pos), int(has_gauss), float(cached_gaussian)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict) -> None:
    """Restore :func:`rng_state`'s states (NumPy's key array as a list or, in older checkpoints, an array)."""
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
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


def check_compatible(checkpoint: Dict, config: Dict, path: str, flag_defaults: Optional[Dict] = None) -> None:
    """Refuse to resume a checkpoint written under different settings (say which, and what to do).

    Args:
        checkpoint: the loaded checkpoint (its ``config_fingerprint``).
        config: this run's settings.
        path: the checkpoint's path, for the message.
        flag_defaults: each flag's default. A setting the checkpoint does not record (a flag added
            after it was written) counts as unchanged when this run leaves it at that default, the
            behaviour the flag was added with; without ``flag_defaults`` every setting must match.

    Raises:
        ConfigError: no fingerprint, or settings that differ.
    """
    saved = checkpoint.get("config_fingerprint")
    if saved is None:
        raise ConfigError(f"{path} is not a pml-hyperbolic training checkpoint (no config fingerprint).")
    # JSON-like normalisation: tuples vs lists must not count as a difference.
    as_list = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    norm = lambda d: {k: as_list(v) for k, v in d.items()}  # noqa: E731
    defaults = flag_defaults or {}
    current = {k: v for k, v in config_fingerprint(config).items()
               if k in saved or k not in defaults or as_list(v) != as_list(defaults[k])}
    if norm(saved) != norm(current):
        raise ConfigError(
            f"checkpoint {path} was written with a different configuration:\n"
            f"{describe_config_difference(norm(saved), norm(current))}\n"
            "Resume with the same settings (e.g. --config <run folder>/config.json), or start a new run "
            "with a different --output-dir (or without --resume).")


class CheckpointManager:
    """``last.pt`` after every epoch and ``best.pt`` whenever Recall@1 improves, both atomic.

    Args:
        run_dir: the run's output folder (the checkpoints' folder).
        config: the run's configuration; its fingerprint is saved, and a checkpoint written under
            another one is refused at load.
        enabled: False writes nothing.
        flag_defaults: each flag's default, for :func:`check_compatible`.
    """

    def __init__(self, run_dir: str, config: Dict, enabled: bool = True, flag_defaults: Optional[Dict] = None):
        self.run_dir = run_dir
        self.config = config
        self.flag_defaults = flag_defaults
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
                except (OSError, RuntimeError) as err:  # one clear line; the old file survives
                    # torch's zip writer reports a full disk as a RuntimeError ("unexpected pos ...")
                    reason = (err.strerror or err) if isinstance(err, OSError) else f"{err} (disk full?)"
                    raise ConfigError(f"cannot write checkpoint {path}: {reason}. The previous "
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
        """The checkpoint at ``path`` (:func:`read_checkpoint`), checked against this run's config.

        Raises:
            ConfigError: an unreadable, corrupted, unsafe or incompatible checkpoint, naming ``path``.
        """
        try:
            checkpoint = read_checkpoint(path, map_location)
        except ConfigError as err:
            message = str(err)
            raise ConfigError(message if message.startswith("--resume") else "--resume: " + message) from None
        if not isinstance(checkpoint, dict):
            raise ConfigError(f"{path} is not a pml-hyperbolic training checkpoint (no config fingerprint).")
        check_compatible(checkpoint, self.config, path, self.flag_defaults)
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
