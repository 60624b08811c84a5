"""The pairwise kernel's elementwise tail as native code: ``_native_tail.c`` compiled at first use.

:func:`distance_tail` runs the fused one-pass tail of :func:`pml_hyperbolic._pairwise_dist._distance_tail`
(W = P·q_j, S = √(W + W²/2), D = log1p(W + √2·S)/√c) on contiguous CPU float32/float64 tensors
and returns True, or returns False when it cannot, and the caller takes the torch path (same
results within the kernel's tolerances). It never raises for an environment reason: no compiler,
an unwritable cache, a failed build or load, a wrong dtype, device or layout all mean False.

Build. The C file is compiled once per (source, compiler, flags, Python, platform) into the user
cache, ``$PML_HYPERBOLIC_CACHE`` or ``$XDG_CACHE_HOME/pml_hyperbolic`` or
``~/.cache/pml_hyperbolic``, under a name that hashes all of these: a changed source or compiler
builds a new file, never reuses a stale one. Each build writes a private temporary file and
renames it into place (atomic on POSIX), so processes that start together (pytest-xdist, DDP
ranks) at worst build twice, never load a half-written file. The loaded library is checked
against a float64 reference on a few values before first use.

Flags. ``-O3 -fno-math-errno -fno-trapping-math``: both only drop C's side channels (``errno``, FP
exception flags) so that ``sqrt`` becomes one instruction and the selects vectorise; the results
stay IEEE (no ``-ffast-math``, no ``-march=native``: the file may run on another CPU than the one
that built it; GCC on x86-64 adds AVX2/AVX-512 clones picked at load time). If the cloned build
fails (another compiler, no ifunc), a plain one is tried; on x86-64 a plain (SSE2) build measured
slower than torch's own ops (2.7 against 2.1 ms at 900²), so there the torch path is kept.

Environment: ``PML_HYPERBOLIC_NATIVE=0`` disables the native path; ``PML_HYPERBOLIC_CC`` (else
``CC``, else ``gcc`` then ``cc``) names the compiler. :func:`status` says which path runs and why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["distance_tail", "enabled", "row_terms", "status", "symmetric_distance_tail", "symmetric_gradient_weights"]

SOURCE = Path(__file__).with_name("_native_tail.c")
_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
_BUILD_TIMEOUT_S = 120
# Below this many elements a call runs on one thread (a thread hand-off costs ~20-50 µs).
_MIN_ELEMENTS_PER_THREAD = 1 << 18

_lock = threading.Lock()
_pool_lock = threading.Lock()
_state: dict = {}  # "lib": the loaded CDLL or None, "reason": why not, "key": the cache key
_pool: tuple | None = None  # (ThreadPoolExecutor, its size, the pid that made it)


def switched_on(variable: str) -> bool:
    """An on/off environment switch, on unless set to 0, false, no or off (read at every call, so
    tests can flip it)."""
    return os.environ.get(variable, "1").strip() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """False when ``PML_HYPERBOLIC_NATIVE=0``."""
    return switched_on("PML_HYPERBOLIC_NATIVE")


def cache_dir() -> Path:
    """Where built libraries are kept (see the module docstring)."""
    explicit = os.environ.get("PML_HYPERBOLIC_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pml_hyperbolic"


def _compiler() -> list[str] | None:
    """The compiler command (argv prefix), or None when none is on PATH."""
    for spec in (os.environ.get("PML_HYPERBOLIC_CC"), os.environ.get("CC"), "gcc", "cc"):
        if not spec:
            continue
        argv = shlex.split(spec)
        path = shutil.which(argv[0]) if argv else None
        if path:
            return [path, *argv[1:]]
        if spec == os.environ.get("PML_HYPERBOLIC_CC"):
            return None  # an explicit choice that is missing: no silent substitute
    return None


def _cache_key(source: bytes, compiler: list[str]) -> str:
    """Hash of everything the shared object depends on (the compiler by path, size and mtime:
    an upgraded compiler builds anew)."""
    st = os.stat(compiler[0])
    parts = [source, repr(compiler).encode(), repr(_FLAGS).encode(), str(st.st_size).encode(),
             str(st.st_mtime_ns).encode(), sys.implementation.cache_tag.encode(),
             sysconfig.get_platform().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:20]


def _build(source: bytes, compiler: list[str], target: Path) -> None:
    """Compile into a temporary file next to ``target``, then rename it into place (atomic)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    try:
        errors = []
        for extra in ((), ("-DPML_NO_CLONES",)):  # the cloned build first, then a plain one
            cmd = [*compiler, *_FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            if done.returncode == 0:
                os.replace(tmp, target)
                return
            errors.append(done.stderr.strip()[-500:])
        raise RuntimeError("compiler failed: " + " | ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _declare(lib: ctypes.CDLL) -> None:
    ptr, long_ = ctypes.c_void_p, ctypes.c_long
    for name, scalar in (("f32", ctypes.c_float), ("f64", ctypes.c_double)):
        tail = getattr(lib, f"pml_tail_{name}")
        tail.argtypes = [ptr, ptr, ptr, long_, long_, long_, scalar]
        tail.restype = None
        log1p = getattr(lib, f"pml_log1p_{name}")
        log1p.argtypes = [ptr, ptr, long_]
        log1p.restype = None
        sym_tail = getattr(lib, f"pml_sym_tail_{name}")
        sym_tail.argtypes = [ptr, ptr, ptr, ptr, ptr, long_, scalar, scalar, long_, long_, ptr]
        sym_tail.restype = None
        row_terms = getattr(lib, f"pml_row_terms_{name}")
        row_terms.argtypes = [ptr, long_, long_, ctypes.c_double, ctypes.c_double, ptr, ptr, ctypes.c_double,
                              ctypes.c_double, ptr, ptr, ptr, ptr]
        row_terms.restype = None
        sym_grad = getattr(lib, f"pml_sym_grad_{name}")
        sym_grad.argtypes = [ptr, long_, long_, ptr, long_, long_, long_]
        sym_grad.restype = None
        lca = getattr(lib, f"pml_lca_rows_{name}")
        lca.argtypes = [ptr, long_, ptr, ptr, ptr, long_, long_, long_, scalar, scalar, ctypes.c_int,
                        ctypes.c_uint64, ptr, ptr, ptr, ptr, ptr, ptr]
        lca.restype = None
        uniform_rows = getattr(lib, f"pml_uniform_rows_{name}")
        uniform_rows.argtypes = [ctypes.c_uint64, ctypes.c_uint64, long_, long_, ptr]
        uniform_rows.restype = None
        lca_backward = getattr(lib, f"pml_lca_backward_{name}")
        lca_backward.argtypes = [ptr, ptr, long_, ptr, ptr, ptr, ptr, ptr, long_, long_, long_]
        lca_backward.restype = None
    lib.pml_vector_clones.argtypes = []
    lib.pml_vector_clones.restype = ctypes.c_int


def _self_check(lib: ctypes.CDLL) -> None:
    """The tail on a row of known values against float64 torch (a miscompiled or foreign library
    must not produce distances)."""
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-14)):
        P = torch.tensor([[0.0, 1e-30, 1e-7, 0.01, 0.3, 1.0, 7.0, 1e4, 1e12, float("inf")]], dtype=torch.float64)
        q = torch.linspace(1.0, 3.0, P.shape[1], dtype=torch.float64)
        W = P * q
        S_ref = torch.sqrt(W + W * W / 2)
        D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(0.1)
        Pn, Sn, qn = P.to(dtype), torch.empty_like(P, dtype=dtype), q.to(dtype)
        _call(lib, Pn, Sn, qn, 1.0 / math.sqrt(0.1), 0, 1)
        finite = torch.isfinite(D_ref)
        ok = (torch.isinf(Pn[~finite]).all() and torch.allclose(Pn[finite].double(), D_ref[finite], rtol=tol, atol=0)
              and torch.allclose(Sn[finite].double(), S_ref[finite], rtol=tol, atol=0))
        if not ok:
            raise RuntimeError(f"self-check failed ({dtype}): {Pn.tolist()} vs {D_ref.tolist()}")


def _load() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set PML_HYPERBOLIC_CC or CC)")
    source = SOURCE.read_bytes()
    key = _cache_key(source, compiler)
    target = cache_dir() / f"native_tail-{key}.so"
    built = not target.exists()
    if built:
        _build(source, compiler, target)
    try:
        lib = _open_checked(target)
    except (OSError, AttributeError, RuntimeError):
        if built:
            raise
        # a cached file that does not load or check (damaged, foreign): build it again, once
        # (the name is unchanged; a process holding the old file keeps its own mapping)
        _build(source, compiler, target)
        lib = _open_checked(target)
    _state["path"] = str(target)
    return lib


def _open_checked(target: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    if platform.machine().lower() in ("x86_64", "amd64") and not lib.pml_vector_clones():
        raise RuntimeError("built without AVX2/AVX-512 clones (the SSE2 loop is slower than torch's)")
    _self_check(lib)
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None (with ``status()`` saying why) on any failure.
    A failure is remembered for the process: no rebuild attempt per call."""
    if "lib" in _state:
        return _state["lib"]
    with _lock:
        if "lib" not in _state:
            try:
                _state["lib"] = _load()
                _state["reason"] = "native"
            except Exception as exc:  # any environment failure means: the torch path
                _state["lib"] = None
                _state["reason"] = f"torch (native unavailable: {type(exc).__name__}: {exc})"
    return _state["lib"]


def reset() -> None:
    """Forget the loaded library and any failure (tests; a changed environment)."""
    with _lock:
        _state.clear()


def status() -> str:
    """Which path the kernel's tail takes, and why: "native", "torch (disabled by
    PML_HYPERBOLIC_NATIVE=0)" or "torch (native unavailable: ...)". Builds on first call."""
    if not enabled():
        return "torch (disabled by PML_HYPERBOLIC_NATIVE=0)"
    _library()
    return _state["reason"]


def _call(lib, P: Tensor, S: Tensor | None, q: Tensor, inv_sqrt_c: float, begin: int, end: int) -> None:
    fn = lib.pml_tail_f32 if P.dtype == torch.float32 else lib.pml_tail_f64
    fn(P.data_ptr(), S.data_ptr() if S is not None else None, q.data_ptr(), begin, end, P.shape[1], inv_sqrt_c)


def _in_parallel(calls) -> None:
    """Run the zero-argument ``calls``, all but the first on the pool, the first here."""
    if len(calls) == 1:
        calls[0]()
        return
    pool = _thread_pool(len(calls) - 1)
    futures = [pool.submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


def _thread_pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of at least ``workers`` threads (idle when unused). A new one after a
    fork: the parent's worker threads do not exist in the child, and work queued to its copy of
    the pool would wait for ever."""
    global _pool
    with _pool_lock:
        pool, size, pid = _pool or (None, 0, None)
        if pool is None or size < workers or pid != os.getpid():
            # (a smaller pool is left as it is, not shut down: another thread may be submitting to
            # it right now; its few threads just stay idle)
            pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pml_native_tail")
            _pool = (pool, workers, os.getpid())
        return pool


def distance_tail(P: Tensor, S: Tensor | None, col_scale: Tensor, inv_sqrt_c: float, threads: int = 1) -> bool:
    """In place: P → D = log1p(W + √2·S)/√c with W = P·col_scale[j], S = √(W + W²/2) written into
    ``S`` (or not, when None). Returns False (nothing written) when the native path does not apply:
    disabled, unavailable, not CPU, not float32/float64, dtypes differ, not contiguous, not 2-D.

    ``threads`` > 1 splits the rows over that many threads (ctypes releases the GIL during the
    call), for calls large enough to pay for the hand-off."""
    if not enabled() or P.device.type != "cpu" or P.dtype not in (torch.float32, torch.float64):
        return False
    if P.ndim != 2 or col_scale.shape != (P.shape[1],) or col_scale.dtype != P.dtype:
        return False
    if not (P.is_contiguous() and col_scale.is_contiguous() and col_scale.device.type == "cpu"):
        return False
    if S is not None and (S.shape != P.shape or S.dtype != P.dtype or not S.is_contiguous()
                          or S.device.type != "cpu"):
        return False
    if P.numel() == 0:
        return True
    lib = _library()
    if lib is None:
        return False
    n = P.shape[0]
    parts = max(1, min(int(threads), n, P.numel() // _MIN_ELEMENTS_PER_THREAD))
    bounds = [n * k // parts for k in range(parts + 1)]
    _in_parallel([functools.partial(_call, lib, P, S, col_scale, inv_sqrt_c, bounds[k], bounds[k + 1])
                  for k in range(parts)])
    return True


# Rows per band of the symmetric loops (PML_SYM_ROWS in _native_tail.c).
_SYM_TILE = 16


def _usable(*tensors: Tensor) -> bool:
    """Contiguous CPU tensors of one dtype, float32 or float64."""
    dtype = tensors[0].dtype
    return dtype in (torch.float32, torch.float64) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() for t in tensors)


def _tile_row_bounds(n: int, threads: int, first: int = 0, end: int | None = None) -> list[int]:
    """Band boundaries splitting bands [first, end) of the upper triangle of an n×n matrix (all
    bands by default) into ``threads`` parts of about equal area (band t of n_bands holds about
    n_bands - t blocks), fewer for small parts."""
    tiles = -(-n // _SYM_TILE)
    end = tiles if end is None else min(end, tiles)
    sizes = [tiles - t for t in range(first, end)]
    total = float(sum(sizes))
    parts = max(1, min(int(threads), len(sizes), int(total * _SYM_TILE * _SYM_TILE) // _MIN_ELEMENTS_PER_THREAD))
    bounds, done, t = [first], 0.0, first
    for k in range(1, parts):
        while t < end and done < total * k / parts:
            done += tiles - t
            t += 1
        bounds.append(t)
    bounds.append(end)
    return sorted(set(bounds))


def symmetric_distance_tail(G: Tensor, S: Tensor | None, x2: Tensor, p2: Tensor, q: Tensor,
                            inv_sqrt_c: float, close_factor: float, threads: int = 1,
                            rows: tuple[int, int] | None = None) -> int | None:
    """In place, for x is y: ``G`` holds x xᵀ on and above its diagonal; afterwards it holds the full
    symmetric distance matrix D, and ``S``, when given, S = √(W + W²/2) on and above its diagonal
    (its lower triangle is left as it was), with s = x2_i + x2_j − 2G_ij, W = s·p2_i·q_j. Pairs with
    s < close_factor·(x2_i + x2_j) get D = −1 (to be recomputed by the caller); returns their
    number (both orientations), or None (nothing written) when the native path does not apply.
    ``rows = (begin, end)`` (multiples of the band height, 16, except an end at n) does the pairs
    (i, j > i) of those rows only (with their mirror): the caller runs it on each block of the
    Gram product right after that block, while it is still in cache (:func:`symmetric_tail_runner`
    checks the arguments once for all the blocks)."""
    run = symmetric_tail_runner(G, S, x2, p2, q, inv_sqrt_c, close_factor)
    if run is None:
        return None
    n = G.shape[0]
    return run(*((0, n) if rows is None else rows), threads=threads)


def symmetric_tail_runner(G: Tensor, S: Tensor | None, x2: Tensor, p2: Tensor, q: Tensor,
                          inv_sqrt_c: float, close_factor: float):
    """:func:`symmetric_distance_tail` with its arguments checked once: returns
    ``run(begin, end, threads=1) -> count`` for row ranges of the same matrices, or None when the
    native path does not apply. The symmetric forward calls the tail once per Gram block (seven at
    900²): checking the arguments once instead of per block took the forward from 1.74–1.88× to
    1.67–1.79× a GEMM (``python bench/distance.py --radial --threads 1 --repeats 41
    --symmetric-vs-general``, before and after); ``run`` itself is one foreign call per block."""
    if not enabled() or G.ndim != 2 or G.shape[0] != G.shape[1] or not _usable(G, x2, p2, q):
        return None
    n = G.shape[0]
    if any(t.shape != (n,) for t in (x2, p2, q)) or (S is not None and (S.shape != G.shape or not _usable(G, S))):
        return None
    lib = _library()
    if lib is None:
        return None
    fn = lib.pml_sym_tail_f32 if G.dtype == torch.float32 else lib.pml_sym_tail_f64
    pointers = (G.data_ptr(), S.data_ptr() if S is not None else None, x2.data_ptr(), p2.data_ptr(), q.data_ptr(),
                n, inv_sqrt_c, close_factor)
    count = ctypes.c_long(0)

    def run(begin: int, stop: int, threads: int = 1) -> int:
        if begin % _SYM_TILE or (stop % _SYM_TILE and stop != n) or not 0 <= begin <= stop <= n:
            raise ValueError(f"rows must be band-aligned ({_SYM_TILE}) within [0, {n}], got {(begin, stop)}")
        if n == 0:
            return 0
        first, end = begin // _SYM_TILE, -(-stop // _SYM_TILE)
        if threads <= 1:  # (no split, no pool: one call per Gram block)
            fn(*pointers, first, end, ctypes.byref(count))
            return count.value
        bounds = _tile_row_bounds(n, threads, first, end)
        counts = [ctypes.c_long(0) for _ in bounds[:-1]]
        _in_parallel([functools.partial(fn, *pointers, bounds[k], bounds[k + 1], ctypes.byref(counts[k]))
                      for k in range(len(counts))])
        return sum(c.value for c in counts)

    run.tensors = (G, S, x2, p2, q)  # alive as long as their pointers are
    return run


def symmetric_gradient_weights(U: Tensor, S: Tensor, threads: int = 1) -> bool:
    """In place, for x is y: S (from :func:`symmetric_distance_tail`: only its part on and above the
    diagonal is read) becomes E = U/S + (U/S)ᵀ, i.e. (U_ij + U_ji)/S_ij off the diagonal and 0 on
    it. ``U`` may have any strides (a broadcast upstream gradient, as from ``D.sum().backward()``,
    is read in place: making it contiguous cost 0.5 ms at 900², a tenth of a forward+backward).
    Returns False (nothing written) when the native path does not apply."""
    if not enabled() or S.ndim != 2 or S.shape[0] != S.shape[1] or U.shape != S.shape:
        return False
    if not _usable(S) or U.dtype != S.dtype or U.device.type != "cpu":
        return False
    n = S.shape[0]
    if n == 0:
        return True
    lib = _library()
    if lib is None:
        return False
    fn = lib.pml_sym_grad_f32 if S.dtype == torch.float32 else lib.pml_sym_grad_f64
    bounds = _tile_row_bounds(n, threads)
    _in_parallel([functools.partial(fn, U.data_ptr(), U.stride(0), U.stride(1), S.data_ptr(), n,
                                    bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)])
    return True


def row_terms(x: Tensor, c: float, floor: float, extreme: tuple[float, float] | None = None):
    """(‖x_i‖², 1/max(1 − c‖x_i‖², floor)) in float64 for the rows of a contiguous CPU float32/float64
    ``x`` (eight partial sums per row, so that the loop vectorises: 0.08–0.09 against 0.27–0.30 ms
    for 900 × 128 through ``x.double()`` and ``vecdot``, ``python bench/distance.py --symmetric-parts
    --quick``), or None when the native path does not apply.

    With ``extreme = (inv_a_bound, tiny_sq_norm)`` (the symmetric forward), the same pass also
    returns the symmetric tail's row vectors in x's dtype, ``(x2, 2c·inv_a, inv_a)`` rounded as
    ``.to(dtype)`` rounds them, whether any row has x2 ≠ 0 (NaN counts) and whether any row is
    extreme (inv_a > inv_a_bound or 0 < x2 < tiny_sq_norm): ``(x2, inv_a, vectors, any_nonzero,
    any_extreme)``."""
    if not enabled() or x.ndim != 2 or not _usable(x) or x.numel() == 0:
        return None
    lib = _library()
    if lib is None:
        return None
    n, dim = x.shape
    x2 = torch.empty(n, dtype=torch.float64)
    inv_a = torch.empty(n, dtype=torch.float64)
    fn = lib.pml_row_terms_f32 if x.dtype == torch.float32 else lib.pml_row_terms_f64
    if extreme is None:
        fn(x.data_ptr(), n, dim, float(c), float(floor), x2.data_ptr(), inv_a.data_ptr(), 0.0, 0.0,
           None, None, None, None)
        return x2, inv_a
    vectors = torch.empty(3, n, dtype=x.dtype)
    counts = (ctypes.c_long * 2)()
    base, step = vectors.data_ptr(), n * vectors.element_size()
    fn(x.data_ptr(), n, dim, float(c), float(floor), x2.data_ptr(), inv_a.data_ptr(), float(extreme[0]),
       float(extreme[1]), base, base + step, base + 2 * step, counts)
    return x2, inv_a, tuple(vectors.unbind(0)), counts[0] > 0, counts[1] > 0


# ~2.5 ns of work per element (two exponentials and logarithms): a part of 32k elements (80 µs)
# pays for a thread hand-off (20-50 µs), where the distance tail's lighter elements need 256k.
_LCA_MIN_ELEMENTS_PER_THREAD = 1 << 15


def lca_rows(dist: Tensor, i: Tensor, j: Tensor, k: Tensor, tau: float, margin: float, noise, block: int,
             grads: Tensor | None, on: Tensor | None, threads: int | None = None):
    """HIER's LCA triplet rows natively (``pml_lca_rows_*`` in ``_native_tail.c``): fills ``loss``,
    ``a``, ``b`` and, when given, ``grads`` (2, T, P: the rows u¹, u² of the straight-through
    estimator, before their routing through the maxima, which :func:`lca_backward` does) and ``on``
    (3, T), with the formulas of ``hier_loss._LCATripletLoss._run``'s torch ops. ``noise``: None (no
    Gumbel noise) or a ``hier_loss._CounterUniform``, whose draws the C loop generates from its ``key``
    where it uses them (the same values as the source's ``draws``). ``block`` rows at a time, shared by ``threads``
    (default: torch's count). Returns (loss, a, b), or None when the native path does not apply
    (also for a noise source that is not counter-based)."""
    if noise is not None and not isinstance(getattr(noise, "key", None), int):
        return None
    if not enabled() or dist.ndim != 2 or not _usable(dist) or (grads is not None and not _usable(dist, grads, on)):
        return None
    if any(t.dtype != torch.long or t.device.type != "cpu" or not t.is_contiguous() for t in (i, j, k)):
        return None
    if grads is not None and tuple(grads.shape) != (2, i.numel(), dist.shape[1]):
        return None
    lib = _library()
    if lib is None:
        return None
    n, p = i.numel(), dist.shape[1]
    if p >= 2 ** 31:  # the loop's candidate indices and draw counters are 32-bit lanes
        return None
    fn = lib.pml_lca_rows_f32 if dist.dtype == torch.float32 else lib.pml_lca_rows_f64
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    loss = dist.new_empty(n)
    a = torch.empty(n, dtype=torch.long)
    b = torch.empty(n, dtype=torch.long)
    work = dist.new_empty(threads, 2 * p)  # each part's two rows of scratch
    fixed = (dist.data_ptr(), p, i.data_ptr(), j.data_ptr(), k.data_ptr(), n)
    noise_args = (0, 0) if noise is None else (1, noise.key)
    tail = (loss.data_ptr(), a.data_ptr(), b.data_ptr(), grads.data_ptr() if grads is not None else None,
            on.data_ptr() if on is not None else None)
    for start in range(0, n, block):
        stop = min(n, start + block)
        parts = max(1, min(threads, (stop - start) * p // _LCA_MIN_ELEMENTS_PER_THREAD))
        bounds = [start + (stop - start) * q // parts for q in range(parts + 1)]
        _in_parallel([functools.partial(fn, *fixed, bounds[q], bounds[q + 1], 1.0 / tau, margin, *noise_args, *tail,
                                        work[q].data_ptr())
                      for q in range(parts)])
    return loss, a, b


def uniform_rows(key: int, first_row: int, rows: int, p: int, dtype: torch.dtype = torch.float32) -> Tensor | None:
    """(rows, p) of the counter-based draws that ``lca_rows`` generates for streams ``first_row``..
    under ``key`` (``pml_uniform_rows_*``), or None without the native library. For checking the
    numpy form in ``hier_loss._CounterUniform`` against the C loop's."""
    lib = _library() if enabled() else None
    if lib is None:
        return None
    out = torch.empty(rows, p, dtype=dtype)
    fn = lib.pml_uniform_rows_f32 if dtype == torch.float32 else lib.pml_uniform_rows_f64
    fn(key, first_row, rows, p, out.data_ptr())
    return out


def lca_backward(grad: Tensor, dist: Tensor, i: Tensor, j: Tensor, k: Tensor, u: Tensor, scale: Tensor,
                 threads: int | None = None) -> bool:
    """HIER's backward scatter (``pml_lca_backward_*``): adds to ``grad`` (N, P), zero or not, the rows
    ``u`` (2, T, P) of :func:`lca_rows` routed through the maxima of ``dist`` (N, P) rows i, j, k and
    scaled by ``scale`` (T,): per row t, ``grad[i_t] += g_i s_t``, then j, then k (the formulas in
    ``_native_tail.c``). Contiguous CPU tensors of one dtype, int64 indices in [0, N) (checked before
    anything is written). ``threads`` (default torch's count) take disjoint ranges of grad's rows, each
    scanning every t in order: the same additions in the same order as one thread, bit for bit.
    Returns False (nothing written) when the native path does not apply."""
    if not enabled() or grad.ndim != 2 or u.ndim != 3 or not _usable(grad, dist, u, scale):
        return False
    n, p = dist.shape
    rows = i.numel()
    if grad.shape != (n, p) or u.shape != (2, rows, p) or scale.shape != (rows,):
        return False
    if any(index.shape != (rows,) or index.dtype != torch.long or index.device.type != "cpu"
           or not index.is_contiguous() for index in (i, j, k)):
        return False
    if rows and any(int(index.min()) < 0 or int(index.max()) >= n for index in (i, j, k)):
        raise IndexError(f"index out of range [0, {n})")
    lib = _library()
    if lib is None:
        return False
    fn = lib.pml_lca_backward_f32 if grad.dtype == torch.float32 else lib.pml_lca_backward_f64
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    parts = max(1, min(threads, n, 3 * rows * p // _LCA_MIN_ELEMENTS_PER_THREAD))
    bounds = [n * q // parts for q in range(parts + 1)]
    fixed = (grad.data_ptr(), dist.data_ptr(), p, i.data_ptr(), j.data_ptr(), k.data_ptr(), u.data_ptr(),
             scale.data_ptr(), rows)
    _in_parallel([functools.partial(fn, *fixed, bounds[q], bounds[q + 1]) for q in range(parts)])
    return True
