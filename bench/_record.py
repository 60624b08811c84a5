"""What every benchmark records: the JSON result file of one run.

``record(...)`` builds the dictionary that ``bench/results/schema.json`` describes (the command, the
commit and whether the tree was dirty, the date, the machine, the threads, the load average before and
after, the versions of the libraries that set the speed) around the benchmark's own ``results`` rows;
``write(...)`` stores it as ``bench/results/<benchmark>-<date>-<commit>.json``.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from importlib import metadata

SCHEMA_VERSION = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")

# distribution names, in the order tried; the first one installed gives the version
_PACKAGES = {
    "torch": ("torch",),
    "numpy": ("numpy",),
    "faiss": ("faiss-cpu", "faiss-gpu", "faiss"),
    "pml": ("pytorch-metric-learning",),
    "hypll": ("hypll",),
    "timm": ("timm",),
    "pml_hyperbolic": ("pml-hyperbolic",),
}


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def commit() -> tuple[str, bool | None]:
    """The short hash of HEAD ("unknown" outside a git checkout) and whether tracked files differ from it."""
    head = _git("rev-parse", "--short=7", "HEAD")
    if head is None:
        return "unknown", None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head, None if status is None else bool(status)


def load_average() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict:
    """Platform, CPU model, cores (all and usable by this process), memory, and the GPU if torch sees one."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    info = {"platform": platform.platform(), "cpu": _cpu_model(), "cores": os.cpu_count(),
            "usable_cores": usable, "memory_gib": _memory_gib(), "gpu": None}
    torch = sys.modules.get("torch")  # never import torch just to ask
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def versions() -> dict:
    """Python and the installed versions of the libraries a benchmark's figures depend on (None: absent)."""
    found = {"python": platform.python_version()}
    for key, names in _PACKAGES.items():
        found[key] = None
        for name in names:
            try:
                found[key] = metadata.version(name)
                break
            except metadata.PackageNotFoundError:
                continue
    return found


def threads() -> int | None:
    """torch's intra-op thread count at the end of the run (None if the benchmark never imported torch)."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def jsonable(value):
    """``value`` with tuples as lists, non-string keys as strings, tensors and numpy scalars as numbers,
    non-finite floats as None and anything else unknown as its ``str``."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, str) else k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return jsonable(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return jsonable(tolist())
    return str(value)


def record(benchmark: str, results: list, *, command: list[str], description: str = "",
           load_before: list[float] | None = None, load_after: list[float] | None = None,
           wall_s: float | None = None, exit_status: int = 0, text: str | None = None,
           settings: dict | None = None, summary: str | None = None) -> dict:
    """The result dictionary of one run of ``benchmark`` (see ``bench/results/schema.json``).

    ``results`` are the benchmark's rows (dictionaries). ``text`` keeps the printed report of a
    benchmark that has no rows yet; ``settings`` and ``summary`` (optional) describe the run."""
    head, dirty = commit()
    now = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)
    out = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": benchmark,
        "description": description,
        "command": ["python", "-m", "bench", benchmark, *command],
        "commit": head,
        "dirty": dirty,
        "date": now.isoformat().replace("+00:00", "Z"),
        "machine": machine(),
        "threads": threads(),
        "load_before": load_before,
        "load_after": load_after,
        "wall_s": None if wall_s is None else round(wall_s, 2),
        "exit_status": exit_status,
        "versions": versions(),
        "results": jsonable(list(results)),
    }
    if settings is not None:
        out["settings"] = jsonable(settings)
    if summary is not None:
        out["summary"] = str(summary)
    if text is not None:
        out["text"] = text
    return out


def default_path(rec: dict) -> str:
    """``bench/results/<benchmark>-<YYYY-MM-DD>-<commit>.json``."""
    return os.path.join(RESULTS_DIR, f"{rec['benchmark']}-{rec['date'][:10]}-{rec['commit']}.json")


def write(rec: dict, path: str | None = None) -> str:
    """Write ``rec`` as indented JSON to ``path`` (default: ``default_path(rec)``); returns the path."""
    path = path or default_path(rec)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(rec, fh, indent=1, ensure_ascii=False)
        fh.write("\n")
    return path
