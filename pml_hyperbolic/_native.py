"""The pairwise kernel's elementwise tail as native code: ``_native_tail.c`` compiled at first use.

:func:`distance_tail` runs the fused one-pass tail of :func:`pml_hyperbolic._pairwise_dist._distance_tail`
(W = P·q_j, S = √(W + W²/2), D = log1p(W + √2·S)/√c) on contiguous CPU float32/float64 tensors
and returns True, or returns False when it cannot, and the caller takes the torch path (same
results within the kernel's tolerances). It never raises for an environment reason: no compiler,
an unwritable cache, a failed build or load, a wrong dtype, device or layout all mean False.

Build. The C file is compiled once per (source, compiler, flags, Python, platform) into the user
cache, ``$PML_HYPERBOLIC_CACHE`` or ``$XDG_CACHE_HOME/pml_hyperbolic`` or
``~/.cache/pml_hyperbolic``, under a name that hashes all of these (the cache key): a changed
source or compiler builds a new file, never reuses a stale one. Each build writes a private
temporary file and renames it into place (atomic on POSIX), so processes that start together
(pytest-xdist, DDP ranks) at worst build twice, never load a half-written file.

Trust. Beside each library a digest file holds its SHA-256 and the cache key. A cached library is
loaded only when both match (a truncated, bit-flipped or foreign file is never handed to the
dynamic loader, where it could crash the process or compute wrong numbers), from a private copy
that no other process can change while it is mapped. After loading, every exported kernel, in
float32 and float64, is checked against a float64 torch reference on small inputs
(:func:`_self_check`). A cached library that fails either check is deleted and built again once;
if the rebuild fails too, the torch path runs (with one warning when a damaged file was found).

Flags. ``-O3 -fno-math-errno -fno-trapping-math``: both only drop C's side channels (``errno``, FP
exception flags) so that ``sqrt`` becomes one instruction and the selects vectorise; the results
stay IEEE (no ``-ffast-math``, no ``-march=native``: the file may run on another CPU than the one
that built it; GCC on x86-64 adds AVX2/AVX-512 clones picked at load time). If the cloned build
fails (another compiler, no ifunc), a plain one is tried; on x86-64 a plain (SSE2) build is
slower than torch's own ops, so there the torch path is kept.

Environment: ``PML_HYPERBOLIC_NATIVE=0`` disables the native path; ``PML_HYPERBOLIC_CC`` (else
``CC``, else ``gcc`` then ``cc``) names the compiler. :func:`status` says which path runs and why.

Design note: docs/design/native-code.md
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
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["distance_tail", "enabled", "row_terms", "status", "symmetric_distance_tail", "symmetric_gradient_weights"]

SOURCE = Path(__file__).with_name("_native_tail.c")
_FLAGS = ("-O3", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared")
_BUILD_TIMEOUT_S = 120
# Below this many elements a call runs on one thread (a thread hand-off costs more than it saves).
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


def _digest_path(target: Path) -> Path:
    return target.with_suffix(".sha256")


def _digest_line(data: bytes, key: str) -> str:
    """The digest file's one line: the library's SHA-256 and the cache key it was built under (the
    hash of source, compiler and flags), so that a digest cannot vouch for another build."""
    return f"{hashlib.sha256(data).hexdigest()} {key}\n"


def _build(source: bytes, compiler: list[str], target: Path, key: str) -> None:
    """Compile into a temporary file next to ``target``, write its digest file
    (:func:`_digest_line`), then rename both into place (each rename atomic; the library first, so
    that a digest never names a file that is not there yet)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp.so", dir=target.parent)
    os.close(fd)
    digest_tmp = tmp + ".sha256"
    try:
        errors = []
        for extra in ((), ("-DPML_NO_CLONES",)):  # the cloned build first, then a plain one
            cmd = [*compiler, *_FLAGS, *extra, "-o", tmp, str(SOURCE), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
            if done.returncode == 0:
                Path(digest_tmp).write_text(_digest_line(Path(tmp).read_bytes(), key))
                os.replace(tmp, target)
                os.replace(digest_tmp, _digest_path(target))
                return
            errors.append(done.stderr.strip()[-500:])
        raise RuntimeError("compiler failed: " + " | ".join(errors))
    finally:
        for leftover in (tmp, digest_tmp):
            if os.path.exists(leftover):
                os.unlink(leftover)


def _verified_bytes(target: Path, key: str) -> bytes:
    """The cached library's bytes, if its digest file vouches for them under ``key``; else
    RuntimeError (missing, truncated, altered, or built under another key)."""
    try:
        data = target.read_bytes()
        recorded = _digest_path(target).read_text()
    except OSError as exc:
        raise RuntimeError(f"cannot read the cached library or its digest: {exc}") from None
    if recorded != _digest_line(data, key):
        raise RuntimeError(f"{target.name} does not match its SHA-256 digest (damaged or altered)")
    return data


def _discard(target: Path) -> None:
    for path in (target, _digest_path(target)):
        try:
            path.unlink()
        except FileNotFoundError:
            pass


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
        lca.argtypes = [ptr, long_, long_, ptr, ptr, ptr, long_, long_, long_, scalar, scalar, ctypes.c_int,
                        ctypes.c_uint64, ptr, ptr, ptr, ptr, ptr, ptr]
        lca.restype = ctypes.c_int
        uniform_rows = getattr(lib, f"pml_uniform_rows_{name}")
        uniform_rows.argtypes = [ctypes.c_uint64, ctypes.c_uint64, long_, long_, ptr]
        uniform_rows.restype = None
        lca_backward = getattr(lib, f"pml_lca_backward_{name}")
        lca_backward.argtypes = [ptr, ptr, long_, long_, ptr, ptr, ptr, ptr, ptr, long_, long_, long_]
        lca_backward.restype = ctypes.c_int
    lib.pml_vector_clones.argtypes = []
    lib.pml_vector_clones.restype = ctypes.c_int


def _close(got: Tensor, ref: Tensor, tol: float) -> bool:
    """``got`` equals the float64 ``ref`` within ``tol`` relative (to each value, or to the largest
    one for values near 0), with the same non-finite entries."""
    got = got.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(got[~finite].isnan(), ref[~finite].isnan()):
        return False
    if not torch.equal(got[~finite & ~ref.isnan()], ref[~finite & ~ref.isnan()]):
        return False
    scale = float(ref[finite].abs().max()) if bool(finite.any()) else 0.0
    return torch.allclose(got[finite], ref[finite], rtol=tol, atol=tol * scale)


def _self_check(lib: ctypes.CDLL) -> None:
    """Every exported kernel, in both dtypes, on a few small inputs against float64 torch
    references (a miscompiled, altered or foreign library must not produce numbers): RuntimeError
    naming the first kernel that disagrees. Outputs start as NaN, so a kernel that writes nothing
    fails too."""
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        name = "f32" if dtype == torch.float32 else "f64"
        for kernel, check in (("tail", _check_tail), ("log1p", _check_log1p), ("row_terms", _check_row_terms),
                              ("sym_tail", _check_sym_tail), ("sym_grad", _check_sym_grad),
                              ("uniform_rows", _check_uniform_rows), ("lca_rows", _check_lca_rows),
                              ("lca_backward", _check_lca_backward)):
            if not check(lib, name, dtype, tol):
                raise RuntimeError(f"self-check failed: pml_{kernel}_{name} disagrees with the torch reference")


def _sample(shape, seed: int, scale: float = 1.0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator, dtype=torch.float64) * scale


def _check_tail(lib, name, dtype, tol) -> bool:
    P = torch.tensor([[0.0, 1e-30, 1e-7, 0.01, 0.3, 1.0, 7.0, 1e4, 1e12, float("inf")]], dtype=torch.float64)
    q = torch.linspace(1.0, 3.0, P.shape[1], dtype=torch.float64)
    W = P * q
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(0.1)
    Pn, Sn, qn = P.to(dtype), torch.full(P.shape, math.nan, dtype=dtype), q.to(dtype)
    getattr(lib, f"pml_tail_{name}")(Pn.data_ptr(), Sn.data_ptr(), qn.data_ptr(), 0, 1, P.shape[1],
                                     1.0 / math.sqrt(0.1))
    finite = torch.isfinite(D_ref)
    return _close(Pn, D_ref, tol) and _close(Sn[finite], S_ref[finite], tol)


def _check_log1p(lib, name, dtype, tol) -> bool:
    u = torch.tensor([0.0, 1e-30, 1e-7, 0.01, 0.3, 1.0, 7.0, 1e4, 1e12], dtype=dtype)
    out = torch.full_like(u, math.nan)
    getattr(lib, f"pml_log1p_{name}")(u.data_ptr(), out.data_ptr(), u.numel())
    return _close(out, torch.log1p(u.double()), tol)


def _check_row_terms(lib, name, dtype, tol) -> bool:
    x = (_sample((3, 11), 1) - 0.5).to(dtype)
    c, floor = 0.7, 1e-3
    x2_ref = (x.double() ** 2).sum(1)
    inv_ref = 1.0 / (1.0 - c * x2_ref).clamp_min(floor)
    x2, inv_a = torch.full((3,), math.nan, dtype=torch.float64), torch.full((3,), math.nan, dtype=torch.float64)
    vectors = torch.full((3, 3), math.nan, dtype=dtype)
    counts = (ctypes.c_long * 2)(-1, -1)
    base, step = vectors.data_ptr(), 3 * vectors.element_size()
    getattr(lib, f"pml_row_terms_{name}")(x.data_ptr(), 3, 11, c, floor, x2.data_ptr(), inv_a.data_ptr(),
                                          float(inv_ref.max()) - 1e-9, 0.0, base, base + step, base + 2 * step,
                                          counts)
    vectors_ref = torch.stack([x2_ref, 2 * c * inv_ref, inv_ref])
    return (_close(x2, x2_ref, 1e-12) and _close(inv_a, inv_ref, 1e-12) and _close(vectors, vectors_ref, tol)
            and tuple(counts) == (3, 1))


def _check_sym_tail(lib, name, dtype, tol) -> bool:
    n, c = 2 * _SYM_TILE + 3, 0.5  # three bands, the last one partial
    x = ((_sample((n, 3), 2) - 0.5) * 1.5).to(dtype)
    x[5] = x[3]  # one coincident pair: marked -1 (both orientations), counted twice
    x2 = (x.double() ** 2).sum(1)
    G = x.double() @ x.double().T
    p2, q = 2 * c / (1 - c * x2), 1 / (1 - c * x2)
    x2n, p2n, qn = x2.to(dtype), p2.to(dtype), q.to(dtype)
    Gn = G.to(dtype).triu()
    Sn = torch.full((n, n), math.nan, dtype=dtype)
    count = ctypes.c_long(-1)
    getattr(lib, f"pml_sym_tail_{name}")(Gn.data_ptr(), Sn.data_ptr(), x2n.data_ptr(), p2n.data_ptr(), qn.data_ptr(),
                                         n, 1.0 / math.sqrt(c), 1e-3, 0, -(-n // _SYM_TILE), ctypes.byref(count))
    sq = x2n.double().view(-1, 1) + x2n.double().view(1, -1) - 2 * G.to(dtype).double()
    W = sq * p2n.double().view(-1, 1) * qn.double().view(1, -1)
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(c)
    D_ref = D_ref.triu(1) + D_ref.triu(1).T
    D_ref[3, 5] = D_ref[5, 3] = -1.0
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    upper[3, 5] = False
    return (count.value == 2 and _close(Gn, D_ref, tol) and _close(Sn[upper], S_ref[upper], tol)
            and bool((Sn.diagonal() == 0).all()))


def _check_sym_grad(lib, name, dtype, tol) -> bool:
    n = _SYM_TILE + 5
    U = (_sample((n, n), 3) - 0.5).to(dtype)
    S = (_sample((n, n), 4) + 0.5).to(dtype).triu()
    E_ref = ((U.double() + U.double().T) / S.double()).triu(1)
    E_ref = E_ref + E_ref.T
    getattr(lib, f"pml_sym_grad_{name}")(U.data_ptr(), n, 1, S.data_ptr(), n, 0, -(-n // _SYM_TILE))
    return _close(S, E_ref, tol)


# Draws 0-3 of streams 4-6 under key 987654321 (hier_loss.counter_uniform's formula; kept as
# literals so that checking the library needs no import of the losses)
_UNIFORM_REFERENCE = {
    "f32": [["0x1.f95938p-1", "0x1.efa3dcp-1", "0x1.5d8cc2p-1", "0x1.149d8ap-1"],
            ["0x1.884388p-2", "0x1.59d942p-1", "0x1.b92f56p-1", "0x1.ebe41ap-1"],
            ["0x1.3f3752p-1", "0x1.9654a8p-3", "0x1.76d7eap-1", "0x1.3be6eap-1"]],
    "f64": [["0x1.f959396cb52c1p-1", "0x1.efa3dd8f6ec25p-1", "0x1.5d8cc2ca5005fp-1", "0x1.149d8b0c62c42p-1"],
            ["0x1.88438892d4614p-2", "0x1.59d942df81310p-1", "0x1.b92f57bc8c020p-1", "0x1.ebe41bb04d27cp-1"],
            ["0x1.3f375384d70b6p-1", "0x1.9654aec30a618p-3", "0x1.76d7eaadfc0c5p-1", "0x1.3be6eb9cbab8ap-1"]],
}


def _check_uniform_rows(lib, name, dtype, tol) -> bool:
    out = torch.full((3, 4), math.nan, dtype=dtype)
    getattr(lib, f"pml_uniform_rows_{name}")(987654321, 4, 3, 4, out.data_ptr())
    expected = torch.tensor([[float.fromhex(v) for v in row] for row in _UNIFORM_REFERENCE[name]], dtype=dtype)
    return torch.equal(out, expected)


def _lca_case(dtype):
    """A small HIER LCA problem: (dist (N, P), i, j, k)."""
    dist = (_sample((5, 7), 5, 3.0) + 0.1).to(dtype)
    i, j, k = (torch.tensor(v, dtype=torch.long) for v in ([0, 1, 2, 4], [1, 3, 2, 0], [2, 4, 0, 3]))
    return dist, i, j, k


def _check_lca_rows(lib, name, dtype, tol) -> bool:
    """Without noise, and with the counter draws (``pml_uniform_rows``, checked before this)."""
    dist, i, j, k = _lca_case(dtype)
    rows, p = i.numel(), dist.shape[1]
    tau, margin, key = 0.5, 0.1, 12345
    D = dist.double()
    m1 = torch.maximum(D[i], D[j])
    m2 = torch.maximum(m1, D[k])
    draws = torch.empty(2 * rows, p, dtype=dtype)  # stream 2t + r: LCA choice r of row t
    getattr(lib, f"pml_uniform_rows_{name}")(key, 0, 2 * rows, p, draws.data_ptr())
    for noise in (0, 1):
        loss = torch.full((rows,), math.nan, dtype=dtype)
        a, b = torch.full((rows,), -1, dtype=torch.long), torch.full((rows,), -1, dtype=torch.long)
        grads = torch.full((2, rows, p), math.nan, dtype=dtype)
        on = torch.full((3, rows), math.nan, dtype=dtype)
        work = torch.empty(2 * p, dtype=dtype)
        code = getattr(lib, f"pml_lca_rows_{name}")(
            dist.data_ptr(), dist.shape[0], p, i.data_ptr(), j.data_ptr(), k.data_ptr(), rows, 0, rows, 1.0 / tau,
            margin, noise, key, loss.data_ptr(), a.data_ptr(), b.data_ptr(), grads.data_ptr(), on.data_ptr(),
            work.data_ptr())
        if code != 0:
            return False
        pis, choices = [], []
        for r, m in enumerate((m1, m2)):
            z = -m / tau
            if noise:
                u = draws[r::2].double()
                weights = torch.exp(z - z.amax(1, keepdim=True)) / torch.log(u)
                choices.append(weights.argmin(1))
                pis.append(weights / weights.sum(1, keepdim=True))
            else:
                choices.append(z.argmax(1))
                pis.append(torch.softmax(z, 1))
        if not (torch.equal(a, choices[0]) and torch.equal(b, choices[1])):
            return False
        col_a, col_b = a.view(-1, 1), b.view(-1, 1)
        h = torch.cat([D[i].gather(1, col_a) - D[i].gather(1, col_b), D[j].gather(1, col_a) - D[j].gather(1, col_b),
                       D[k].gather(1, col_b) - D[k].gather(1, col_a)], 1) + margin
        on_ref = (h > 0).double()
        w = D[i] * on_ref[:, :1] + D[j] * on_ref[:, 1:2] - D[k] * on_ref[:, 2:]
        u_ref = torch.stack([pi * (w - (pi * w).sum(1, keepdim=True)) for pi in pis])
        if not (_close(loss, h.clamp_min(0).sum(1), tol) and torch.equal(on.double(), on_ref.T)
                and _close(grads, u_ref, 10 * tol)):
            return False
    return True


def _check_lca_backward(lib, name, dtype, tol) -> bool:
    dist, i, j, k = _lca_case(dtype)
    rows, (n, p) = i.numel(), dist.shape
    u = (_sample((2, rows, p), 6) - 0.5).to(dtype)
    scale = (_sample((rows,), 7) + 0.5).to(dtype)
    grad = torch.zeros(n, p, dtype=dtype)
    code = getattr(lib, f"pml_lca_backward_{name}")(grad.data_ptr(), dist.data_ptr(), n, p, i.data_ptr(),
                                                    j.data_ptr(), k.data_ptr(), u.data_ptr(), scale.data_ptr(),
                                                    rows, 0, n)
    D, U, s = dist.double(), u.double(), scale.double().view(-1, 1)
    g_k = torch.where(D[k] > torch.maximum(D[i], D[j]), U[1], torch.zeros_like(U[1]))
    g_m = (U[1] - g_k) - U[0]
    g_i = torch.where(D[i] >= D[j], g_m, torch.zeros_like(g_m))
    ref = torch.zeros(n, p, dtype=torch.float64)
    for index, g in ((i, g_i), (j, g_m - g_i), (k, g_k)):
        ref.index_add_(0, index, g * s)
    return code == 0 and _close(grad, ref, tol)


def _load() -> ctypes.CDLL:
    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set PML_HYPERBOLIC_CC or CC)")
    source = SOURCE.read_bytes()
    key = _cache_key(source, compiler)
    target = cache_dir() / f"native_tail-{key}.so"
    damaged = None
    if target.exists():
        try:
            lib = _open_checked(_verified_bytes(target, key), target)
        except (OSError, AttributeError, RuntimeError) as exc:
            # damaged, altered or failing its self-check: never trusted, built again once
            _discard(target)
            damaged = f"{type(exc).__name__}: {exc}"
        else:
            _state["path"] = str(target)
            return lib
    _build(source, compiler, target, key)
    try:
        lib = _open_checked(_verified_bytes(target, key), target)
    except (OSError, AttributeError, RuntimeError):
        _discard(target)
        if damaged is not None:
            warnings.warn(f"pml_hyperbolic: discarded a damaged native library ({damaged}) and its rebuild "
                          "failed too; using the torch path", RuntimeWarning, stacklevel=4)
        raise
    _state["path"] = str(target)
    return lib


def _open_checked(data: bytes, target: Path) -> ctypes.CDLL:
    """Load the verified ``data`` from a private copy beside ``target`` (removed once mapped: no
    other process can replace or truncate what is loaded), then self-check every kernel."""
    fd, private = tempfile.mkstemp(prefix=target.stem + ".", suffix=".load.so", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        lib = ctypes.CDLL(private)
    finally:
        os.unlink(private)
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


def _in_parallel(calls) -> list:
    """Run the zero-argument ``calls``, all but the first on the pool, the first here; their results."""
    if len(calls) == 1:
        return [calls[0]()]
    pool = _thread_pool(len(calls) - 1)
    futures = [pool.submit(call) for call in calls[1:]]
    first = calls[0]()
    return [first, *(future.result() for future in futures)]


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
    native path does not apply. The symmetric forward calls the tail once per Gram block: checking
    the arguments once instead of per block saves a visible share of the forward
    (docs/design/native-code.md); ``run`` itself is one foreign call per block."""
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
    is read in place: making it contiguous would cost a pass over n² elements).
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
    ``x`` (eight partial sums per row, so that the loop vectorises, unlike ``x.double()`` and
    ``vecdot``), or None when the native path does not apply.

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


# An LCA element (two exponentials and logarithms) costs several times a distance-tail element,
# so a part pays for a thread hand-off at fewer elements (32k against 256k).
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
    (also for a noise source that is not counter-based). Raises IndexError for an index of i, j, k
    outside [0, N), before anything is read (the C loop checks them too)."""
    if noise is not None and not isinstance(getattr(noise, "key", None), int):
        return None
    if not enabled() or dist.ndim != 2 or not _usable(dist) or (grads is not None and not _usable(dist, grads, on)):
        return None
    if any(t.dtype != torch.long or t.device.type != "cpu" or not t.is_contiguous() for t in (i, j, k)):
        return None
    if grads is not None and tuple(grads.shape) != (2, i.numel(), dist.shape[1]):
        return None
    if i.shape != j.shape or i.shape != k.shape or i.ndim != 1:
        raise ValueError(f"i, j, k must be 1-D of one length, got {tuple(i.shape)}, {tuple(j.shape)}, {tuple(k.shape)}")
    _check_rows(dist.shape[0], i, j, k)
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
    fixed = (dist.data_ptr(), dist.shape[0], p, i.data_ptr(), j.data_ptr(), k.data_ptr(), n)
    noise_args = (0, 0) if noise is None else (1, noise.key)
    tail = (loss.data_ptr(), a.data_ptr(), b.data_ptr(), grads.data_ptr() if grads is not None else None,
            on.data_ptr() if on is not None else None)
    for start in range(0, n, block):
        stop = min(n, start + block)
        parts = max(1, min(threads, (stop - start) * p // _LCA_MIN_ELEMENTS_PER_THREAD))
        bounds = [start + (stop - start) * q // parts for q in range(parts + 1)]
        codes = _in_parallel([functools.partial(fn, *fixed, bounds[q], bounds[q + 1], 1.0 / tau, margin, *noise_args,
                                                *tail, work[q].data_ptr())
                              for q in range(parts)])
        if any(codes):  # (the check above makes this unreachable: the C loop's own bounds check)
            raise IndexError(f"lca_rows: a row index outside [0, {dist.shape[0]})")
    return loss, a, b


def _check_rows(n: int, *indices: Tensor) -> None:
    """IndexError unless every entry of the int64 ``indices`` lies in [0, n)."""
    for index in indices:
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"index out of range [0, {n})")


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
    _check_rows(n, i, j, k)
    lib = _library()
    if lib is None:
        return False
    fn = lib.pml_lca_backward_f32 if grad.dtype == torch.float32 else lib.pml_lca_backward_f64
    threads = max(1, torch.get_num_threads() if threads is None else int(threads))
    parts = max(1, min(threads, n, 3 * rows * p // _LCA_MIN_ELEMENTS_PER_THREAD))
    bounds = [n * q // parts for q in range(parts + 1)]
    fixed = (grad.data_ptr(), dist.data_ptr(), n, p, i.data_ptr(), j.data_ptr(), k.data_ptr(), u.data_ptr(),
             scale.data_ptr(), rows)
    if any(_in_parallel([functools.partial(fn, *fixed, bounds[q], bounds[q + 1]) for q in range(parts)])):
        raise IndexError(f"lca_backward: a row index outside [0, {n})")  # (unreachable after _check_rows)
    return True
