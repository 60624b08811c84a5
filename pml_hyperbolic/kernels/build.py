"""The build of the native kernels: ``csrc/ops.cpp`` (which includes ``csrc/kernels.c``) compiled by
``torch.utils.cpp_extension`` at first use, loaded as torch operators (``TORCH_LIBRARY``), then
self-checked.

Build. ``torch.utils.cpp_extension.load(..., is_python_module=False)`` with ninja, into
``$PML_HYPERBOLIC_CACHE`` or ``$XDG_CACHE_HOME/pml_hyperbolic`` or ``~/.cache/pml_hyperbolic``, in
a folder named for torch's version, the Python ABI and a hash of the two sources and the flags: a
changed source, torch or flag set builds anew, never reuses a stale object. cpp_extension locks the
folder while it builds, so processes that start together (pytest-xdist, DDP ranks) build once.
The compiler is cpp_extension's (``CXX``, else ``c++``); ``PML_HYPERBOLIC_CC`` names another one.

Flags. ``-fopenmp`` (compile and link): ATen's ``at::parallel_for``, which splits every kernel's
rows over torch's intra-op threads, is a header template that runs its whole range on the calling
thread unless the including file is compiled with OpenMP; the extension links the ``libgomp.so.1``
torch has already loaded, so there is one thread pool. A compiler that cannot build with OpenMP
gets one more build without it (its kernels then run on one thread; :func:`parallel` says which).
``-O3 -fno-math-errno -fno-trapping-math``: both only drop C's side channels (``errno``, FP
exception flags) so that ``sqrt`` becomes one instruction and the selects vectorise; and
``-ffp-contract=fast``, GCC's default for GNU C that the ISO ``-std=c++20`` of cpp_extension turns
off: multiply-adds become FMA instructions in the AVX2/AVX-512 clones, as in the C build. The results
stay IEEE (no ``-ffast-math``, no ``-march=native``: the build may run on another CPU than the one
that built it; GCC on x86-64 adds AVX2/AVX-512 clones picked at load time). On x86-64 a build
without the clones (another compiler) is slower than torch's own ops: the torch path is kept.

Trust. A build's SHA-256 digest is written beside it; a later process loads a cached build only
when its bytes match that digest, and loads them from a private copy (a file changed after the check
is never mapped); a cached build without a matching digest is deleted and built anew. After loading, every operator in float32 and float64 is checked against a float64 torch
reference (:func:`pml_hyperbolic.kernels.self_check.self_check`). A build that fails to load or
fails the check is deleted; a failed load is built again once, a failed check (its operators are
registered in this process) falls back to torch here, with a warning, and the next process builds
anew.

Environment: ``PML_HYPERBOLIC_NATIVE=0`` disables the native path. :func:`status` says which path
runs and why; the first load logs it once (logger ``pml_hyperbolic.kernels``, INFO).

Design note: docs/design/native-code.md
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from .self_check import self_check

__all__ = ["cache_dir", "enabled", "library", "parallel", "reset", "status", "switched_on"]

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "ops.cpp", CSRC / "kernels.c")
FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast")
OPENMP_FLAGS = ("-fopenmp",)  # compile and link
_NAME = "pml_hyperbolic_kernels"

_log = logging.getLogger("pml_hyperbolic.kernels")
_lock = threading.Lock()
_fakes_registered = False
_loaded_in_process = False  # the operators are registered in this process (by either load path)
_state: dict = {}  # "ops": the operator namespace or None, "reason": status text, "path": build folder


def switched_on(variable: str) -> bool:
    """An on/off environment switch, on unless set to 0, false, no or off (read at every call, so
    tests can flip it)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def values_checked(x: torch.Tensor) -> bool:
    """Whether the checks that read values back (NaN/Inf, index ranges) read ``x``: always for CPU
    tensors; for tensors on an accelerator only with ``PML_HYPERBOLIC_CHECK_VALUES=1`` (read at every
    call), because reading a value back makes the host wait for the device in the middle of a training
    step. Unchecked, a NaN/Inf reaches the loss, where the trainer (and AMP's GradScaler) skip the step
    and count it.

    Design note: docs/design/gpu-kernel.md
    """
    if x.device.type == "cpu":
        return True
    return os.environ.get("PML_HYPERBOLIC_CHECK_VALUES", "0").strip().lower() in ("1", "true", "yes", "on")


def assert_curvature_on_device(c: torch.Tensor) -> None:
    """Check a curvature tensor ``c`` (finite, > 0) on its own device, without reading it back: a bad
    ``c`` fails an asynchronous device assertion at the next synchronisation. For curvatures that
    :func:`values_checked` leaves unread."""
    torch._assert_async(torch.isfinite(c.detach()).all() & (c.detach() > 0).all(),
                        "c (the curvature magnitude) must be finite and > 0")


def enabled() -> bool:
    """False when ``PML_HYPERBOLIC_NATIVE=0``."""
    return switched_on("PML_HYPERBOLIC_NATIVE")


def cache_dir() -> Path:
    """Where builds are kept (see the module docstring)."""
    explicit = os.environ.get("PML_HYPERBOLIC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pml_hyperbolic"


def _flags(openmp: bool) -> tuple[str, ...]:
    return FLAGS + (OPENMP_FLAGS if openmp else ())


def build_key(openmp: bool = True) -> str:
    """Hash of the sources and flags (the build folder's name; torch's version and the Python ABI
    name the folder above it)."""
    parts = [path.read_bytes() for path in SOURCES]
    parts += [repr(_flags(openmp)).encode(), os.environ.get("PML_HYPERBOLIC_CC", "").encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def build_dir(openmp: bool = True) -> Path:
    return cache_dir() / f"torch-{torch.__version__}-{sys.implementation.cache_tag}" / build_key(openmp)


@contextlib.contextmanager
def _compiler_env():
    """``PML_HYPERBOLIC_CC`` as cpp_extension's ``CXX`` for the build."""
    chosen = os.environ.get("PML_HYPERBOLIC_CC")
    previous = os.environ.get("CXX")
    if chosen:
        os.environ["CXX"] = chosen
    try:
        yield
    finally:
        if chosen:
            if previous is None:
                os.environ.pop("CXX", None)
            else:
                os.environ["CXX"] = previous


def _compile_and_load(folder: Path, openmp: bool = True) -> None:
    """Load the verified cached build, else build (cpp_extension) and load, then record the digest.
    Once per process: the operators stay registered after :func:`reset`, and loading a second copy
    would register them twice, which aborts."""
    global _loaded_in_process
    if _loaded_in_process:
        return
    if not _load_verified_copy(folder):
        _build_and_load(folder, openmp)
        _record_digest(folder)
    _loaded_in_process = True


def _build_and_load(folder: Path, openmp: bool = True) -> None:
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    with _compiler_env(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (cpp_extension's notes about CUDA_HOME and the compiler ABI)
        load(name=_NAME, sources=[str(SOURCES[0])], extra_cflags=list(_flags(openmp)),
             extra_ldflags=list(OPENMP_FLAGS if openmp else ()), build_directory=str(folder),
             is_python_module=False, verbose=False)


def _build_failed(exc: Exception) -> bool:
    """Whether ``exc`` is cpp_extension's report of a failed compile or link (not a missing tool)."""
    return isinstance(exc, RuntimeError) and "Error building extension" in str(exc)


def _library_file(folder: Path) -> Path:
    return folder / f"{_NAME}.so"


def _digest_file(folder: Path) -> Path:
    return folder / f"{_NAME}.so.sha256"


def _digest_line(data: bytes) -> str:
    return f"{hashlib.sha256(data).hexdigest()} {build_key()}\n"


def _record_digest(folder: Path) -> None:
    """Write the digest of the library just built (atomically: a reader sees none or all of it)."""
    data = _library_file(folder).read_bytes()
    tmp = _digest_file(folder).with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(_digest_line(data))
    os.replace(tmp, _digest_file(folder))


def _load_verified_copy(folder: Path) -> bool:
    """Load a cached build only if its bytes match the digest written when it was built, from a
    private copy of those very bytes (so a file changed after the check is never mapped). A cached
    build without a matching digest (truncated, altered, or left by an interrupted build) is deleted.
    Returns True when the operators were loaded this way."""
    library_file, digest_file = _library_file(folder), _digest_file(folder)
    if not library_file.is_file():
        return False
    data = library_file.read_bytes()
    try:
        expected = digest_file.read_text()
    except OSError:
        expected = None
    if expected != _digest_line(data):
        shutil.rmtree(folder, ignore_errors=True)
        return False
    import tempfile

    private = Path(tempfile.mkdtemp(prefix="pml_hyperbolic_kernels_"))
    try:
        copy = private / library_file.name
        copy.write_bytes(data)
        torch.ops.load_library(str(copy))
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return True


def _operators():
    """The registered operators' namespace."""
    return torch.ops.pml_hyperbolic


def _load():
    """Build (or reuse) and load the operators, then self-check them; the ``torch.ops`` namespace."""
    folder = build_dir()
    try:
        _compile_and_load(folder)
    except OSError:  # a damaged shared object that did not load: built again once
        shutil.rmtree(folder, ignore_errors=True)
        _compile_and_load(folder)
    except RuntimeError as exc:  # a compiler without OpenMP: the same sources without it
        if not _build_failed(exc):
            raise
        _log.info("pml_hyperbolic kernels: the build with OpenMP failed, building without it (one thread)")
        folder = build_dir(openmp=False)
        _compile_and_load(folder, openmp=False)
    ops = _operators()
    if platform.machine().lower() in ("x86_64", "amd64") and not ops._native_vector_clones():
        raise RuntimeError("built without AVX2/AVX-512 clones (the SSE2 loop is slower than torch's)")
    try:
        self_check(ops)
    except RuntimeError as exc:
        shutil.rmtree(folder, ignore_errors=True)  # never reused: the next process builds anew
        warnings.warn(f"pml_hyperbolic: the compiled kernels failed their self-check ({exc}); discarded the build, "
                      "using the torch path", RuntimeWarning, stacklevel=5)
        raise
    _register_fakes()
    _state["path"] = str(folder)
    return ops


def library():
    """The loaded operators (``torch.ops.pml_hyperbolic``), built on first use; None (with
    :func:`status` saying why) when disabled or on any failure. A failure is remembered for the
    process: no rebuild attempt per call."""
    if not enabled():
        return None
    if "ops" in _state:
        return _state["ops"]
    with _lock:
        if "ops" not in _state:
            start = time.perf_counter()
            try:
                _state["ops"] = _load()
                _state["reason"] = "native"
                _log.info("pml_hyperbolic kernels: native (compiled operators loaded and self-checked in %.1f s, %s)",
                          time.perf_counter() - start, _state["path"])
            except Exception as exc:  # any environment failure means: the torch path
                _state["ops"] = None
                _state["reason"] = f"torch (native unavailable: {type(exc).__name__}: {str(exc)[-400:]})"
                _log.info("pml_hyperbolic kernels: %s", _state["reason"])
    return _state["ops"]


def parallel() -> bool:
    """Whether the loaded native kernels share their loops over torch's intra-op threads (built with
    OpenMP); False on the torch path (whose own ops are parallel) and for a build without OpenMP."""
    ops = library()
    return bool(ops is not None and ops._native_openmp())


def reset() -> None:
    """Forget the loaded operators and any failure (tests; a changed environment). Operators already
    registered in this process stay registered."""
    with _lock:
        _state.clear()


def status() -> str:
    """``"native"`` or ``"torch (<why>)"``: which implementation the kernels use (builds and loads on
    first call)."""
    if not enabled():
        return "torch (disabled by PML_HYPERBOLIC_NATIVE=0)"
    library()
    return _state["reason"]


def _register_fakes() -> None:
    """Fake (meta) implementations of the native operators (in-place loops: nothing to allocate;
    their int results are data-dependent), so that traced graphs and ``opcheck`` can reason about
    them. Registered once, after the operators themselves."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True

    def dynamic(*args, **kwargs):
        return torch.library.get_ctx().new_dynamic_size()

    def nothing(*args, **kwargs):
        return None

    def row_terms(x, c, floor, extreme_inv_a, tiny_sq, extras):
        n = x.shape[0]
        f64 = x.new_empty(n, dtype=torch.float64)
        ctx = torch.library.get_ctx()
        return (f64, torch.empty_like(f64), x.new_empty(3 if extras else 0, n), ctx.new_dynamic_size(),
                ctx.new_dynamic_size())

    for name, fake in (("_native_tail_", nothing), ("_native_log1p", nothing), ("_native_sym_tail_", dynamic),
                       ("_native_sym_grad_", nothing), ("_native_row_terms", row_terms),
                       ("_native_uniform_rows_", nothing), ("_native_lca_rows_", dynamic),
                       ("_native_lca_backward_", dynamic)):
        torch.library.register_fake(f"pml_hyperbolic::{name}", fake)
