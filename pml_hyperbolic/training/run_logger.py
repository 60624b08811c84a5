"""Per-epoch CSV log (and TensorBoard when installed) written by rank 0 only.

Design note: docs/design/training.md
"""
from __future__ import annotations

import csv
import json
import os
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

from .config import run_write_error

TENSORBOARD_MISSING_NOTE = ("note: TensorBoard is not installed; install pml-hyperbolic[tensorboard] to log "
                            "curves (use --no-tensorboard to silence this)")


class RunLogger:
    """Appends one row per epoch to ``<run_dir>/log.csv`` (loss, lr, curvature, Recall@K, ...).

    Columns are fixed by the first row written; a resumed run appends to the same file after
    dropping rows of epochs it is about to redo, so the CSV never holds duplicate epochs. With
    ``tensorboard`` the same scalars also go to ``<run_dir>/tensorboard/`` when the ``tensorboard``
    package can be imported; when it cannot, the run goes on with the CSV alone and
    :attr:`tensorboard_note` says why (the recipes print it once).

    Every write that fails (disk full, a read-only folder) raises
    :class:`~pml_hyperbolic.training.config.RunWriteError` naming the file, which the recipes print
    as one ``error:`` line.

    Args:
        run_dir: the run folder (created when ``enabled``).
        enabled: False on every process but rank 0: nothing is written.
        tensorboard: also log to TensorBoard when it is installed.

    Attributes:
        writer: the ``SummaryWriter``, or None when TensorBoard logging is off.
        tensorboard_note: one line saying why TensorBoard logging is off although it was requested
            (:data:`TENSORBOARD_MISSING_NOTE` when the package is missing), else None.
    """

    def __init__(self, run_dir: str, enabled: bool = True, tensorboard: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self.csv_path = os.path.join(run_dir, "log.csv")
        self.writer = None
        self.tensorboard_note: Optional[str] = None
        if enabled:
            with _writing(run_dir):
                os.makedirs(run_dir, exist_ok=True)
            if tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

                    self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
                except ImportError:  # not installed: CSV only
                    self.tensorboard_note = TENSORBOARD_MISSING_NOTE
                except Exception as err:  # installed but unusable: CSV only
                    self.tensorboard_note = f"note: TensorBoard logging is off ({type(err).__name__}: {err})"

    @property
    def tensorboard_active(self) -> bool:
        """Whether TensorBoard logs are being written."""
        return self.writer is not None

    def truncate_after(self, epoch: int) -> None:
        """Keep only rows with ``epoch <= epoch`` (called when resuming after ``epoch``)."""
        if not self.enabled or not os.path.isfile(self.csv_path):
            return
        with open(self.csv_path, newline="") as handle:
            rows = list(csv.DictReader(handle))
        if not rows:
            return
        fields = list(rows[0].keys())
        kept = [r for r in rows if int(r["epoch"]) <= epoch]
        with _writing(self.csv_path), open(self.csv_path, "w", newline="") as handle:
            w = csv.DictWriter(handle, fieldnames=fields)
            w.writeheader()
            w.writerows(kept)

    def log_epoch(self, row: Dict[str, Any]) -> None:
        """Append ``row`` to the CSV (columns fixed by the first row) and its numbers to TensorBoard."""
        if not self.enabled:
            return
        exists = os.path.isfile(self.csv_path) and os.path.getsize(self.csv_path) > 0
        if exists:
            with open(self.csv_path, newline="") as handle:
                fields = next(csv.reader(handle), None) or list(row.keys())
        else:
            fields = list(row.keys())
        with _writing(self.csv_path), open(self.csv_path, "a", newline="") as handle:
            w = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
            if not exists:
                w.writeheader()
            w.writerow({k: row.get(k, "") for k in fields})
        if self.writer is not None:
            step = int(row.get("step", row.get("epoch", 0)))
            for key, value in row.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                    self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def write_json(self, name: str, payload: Dict[str, Any]) -> Optional[str]:
        """Write ``payload`` to ``<run_dir>/<name>`` atomically; returns the path (None when disabled)."""
        if not self.enabled:
            return None
        path = os.path.join(self.run_dir, name)
        tmp = path + ".tmp"
        with _writing(path):
            try:
                with open(tmp, "w") as handle:
                    json.dump(payload, handle, indent=2, default=_json_default)
                os.replace(tmp, path)
            except OSError:
                try:  # a half-written file would be mistaken for a result
                    os.remove(tmp)
                except OSError:
                    pass
                raise
        return path

    def close(self) -> None:
        """Close the TensorBoard writer, if any."""
        if self.writer is not None:
            self.writer.close()


@contextmanager
def _writing(path: str) -> Iterator[None]:
    """An ``OSError`` inside the block as one :class:`RunWriteError` naming ``path``."""
    try:
        yield
    except OSError as err:
        raise run_write_error(path, err) from None


def _json_default(value):
    try:
        import numpy as np
        import torch

        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, np.generic):
            return value.item()
        if isinstance(value, np.ndarray):
            return value.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
