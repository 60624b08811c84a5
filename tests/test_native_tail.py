"""The pairwise kernel's fused native tail (pml_hyperbolic/_native.py, _native_tail.c): agreement
with the torch path (forward, backward, float32 and float64), its log1p against reference values,
and the fallback to the torch path whenever it cannot run (disabled, no compiler, unwritable cache,
odd dtype, device or layout), and a damaged or altered cached library never being trusted."""
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from pml_hyperbolic import _native
from pml_hyperbolic import _pairwise_dist as kernel
from pml_hyperbolic import poincare_ball as pb

C = 0.1
TOL = {torch.float32: 1e-6, torch.float64: 1e-14}


@pytest.fixture
def fresh_native(monkeypatch):
    """Forget the loaded library before and after the test (the test changes the environment)."""
    _native.reset()
    yield monkeypatch
    monkeypatch.undo()
    _native.reset()


def native_available() -> bool:
    return _native.status() == "native"


needs_native = pytest.mark.skipif(not native_available(), reason="no C compiler here: " + _native.status())


def radial_points(n, dim, d0_low, d0_high, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = d0_low + (d0_high - d0_low) * torch.rand(n, 1, generator=g, dtype=torch.float64)
    return (v * torch.tanh(math.sqrt(C) * d0 / 2) / math.sqrt(C)).to(dtype)


def reference(x, y):
    x, y = x.double(), y.double()
    s = ((x[:, None] - y[None]) ** 2).sum(-1)
    a, b = 1 - C * (x * x).sum(1), 1 - C * (y * y).sum(1)
    return 2 / math.sqrt(C) * torch.asinh(torch.sqrt(C * s / (a[:, None] * b[None])))


def tail_inputs(dtype):
    """P over the tail's whole range (0, tiny, near-duplicates to far pairs, +inf of extreme rows)
    and a column scale >= 1."""
    g = torch.Generator().manual_seed(0)
    P = torch.exp((torch.rand(64, 257, generator=g, dtype=torch.float64) * 24 - 18) * math.log(10.0))
    P[0, :5] = torch.tensor([0.0, 1e-30, 2.0 ** -24, 0.3, 1e6], dtype=torch.float64)
    P[3] = float("inf")
    q = 1 + 10 * torch.rand(257, generator=g, dtype=torch.float64)
    return P.to(dtype), q.to(dtype)


def torch_tail(P, q, keep_S, monkeypatch):
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")
    out = P.clone()
    S = kernel._distance_tail(out, C, q, out.amin(1), keep_S)
    S = S.clone() if S is not None else None
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "1")
    return out, S


# ------------------------------------------------------------------ the tail itself
@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("keep_S", [True, False])
def test_tail_matches_torch_path_and_float64(dtype, keep_S, monkeypatch):
    P, q = tail_inputs(dtype)
    D_torch, S_torch = torch_tail(P, q, keep_S, monkeypatch)
    D = P.clone()
    S = torch.empty_like(P) if keep_S else None
    assert _native.distance_tail(D, S, q, 1 / math.sqrt(C))
    W = P.double() * q.double()
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2) * S_ref) / math.sqrt(C)
    finite = torch.isfinite(D_ref)
    # P = +inf (rows of extreme points, overwritten by their explicit pairs): inf, the limit
    # (the torch path's log1p rebuild gives NaN there; neither value is ever read)
    assert torch.isinf(D[~finite]).all()
    for got in (D, D_torch):
        rel = ((got[finite].double() - D_ref[finite]).abs() / D_ref[finite].clamp_min(1e-300)).max()
        assert rel <= TOL[dtype], rel
    assert (D[P == 0] == 0).all()
    if keep_S:
        torch.testing.assert_close(S[finite], S_torch[finite], rtol=TOL[dtype], atol=0)
        torch.testing.assert_close(S[finite].double(), S_ref[finite], rtol=TOL[dtype], atol=0)


@needs_native
def test_tail_gives_nan_for_nan_like_the_torch_path(monkeypatch):
    P = torch.tensor([[float("nan"), 1.0, -5.0, 0.5]])
    q = torch.ones(4)
    D_torch, _ = torch_tail(P, q, False, monkeypatch)
    D = P.clone()
    assert _native.distance_tail(D, None, q, 1 / math.sqrt(C))
    assert torch.isnan(D[0, 0]) and torch.isnan(D_torch[0, 0])
    assert torch.isnan(D[0, 2]) and torch.isnan(D_torch[0, 2])  # W < 0: NaN on both paths
    torch.testing.assert_close(D[0, [1, 3]], D_torch[0, [1, 3]], rtol=1e-6, atol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_log1p_reference_values(dtype):
    lib = _native._library()
    fn = lib.pml_log1p_f32 if dtype == torch.float32 else lib.pml_log1p_f64
    tiny = torch.finfo(dtype).tiny
    u = torch.cat([torch.tensor([0.0, tiny, 1e-30, 2.0 ** -24, 2.0 ** -53, 1e-7, 0.41421356, 0.5, 1.0, 3.0, 1e6],
                                dtype=torch.float64),
                   torch.logspace(-37, 38, 20001, dtype=torch.float64),
                   torch.linspace(0, 3, 20001, dtype=torch.float64)]).to(dtype)
    out = torch.empty_like(u)
    fn(u.data_ptr(), out.data_ptr(), u.numel())
    assert out[0] == 0 and out[1] == tiny  # log1p(u) = u below eps, exactly
    # math.log1p (correctly rounded libm) as the reference; 1 eps = 2 ulp of the result at worst
    ref = torch.tensor([math.log1p(v) for v in u.double().tolist()], dtype=torch.float64)
    rel = ((out.double() - ref).abs() / ref.clamp_min(1e-300))[1:].max()
    assert rel <= torch.finfo(dtype).eps, rel


@needs_native
def test_threads_split_rows_and_give_the_same_bits():
    P, q = tail_inputs(torch.float32)
    P = P.repeat(64, 4)[:, :1024]  # 4096 × 1024: large enough to split
    q = q.repeat(4)[:1024]
    one, two = P.clone(), P.clone()
    S1, S2 = torch.empty_like(P), torch.empty_like(P)
    assert _native.distance_tail(one, S1, q, 3.0, threads=1)
    assert _native.distance_tail(two, S2, q, 3.0, threads=3)
    assert torch.equal(one, two) and torch.equal(S1, S2)


@needs_native
def test_unsupported_inputs_are_declined_untouched():
    P, q = tail_inputs(torch.float32)
    cases = [
        (P.double(), None, q),                         # dtypes differ
        (P.half(), None, q.half()),                    # float16
        (P.t(), None, q[:64]),                         # not contiguous
        (P, torch.empty(64, 257, dtype=torch.float64), q),  # S of another dtype
        (P, None, q[:10]),                             # wrong column scale
        (P.to("meta"), None, q.to("meta")),            # not CPU
        (P[0], None, q),                               # not 2-D
    ]
    for p, s, scale in cases:
        before = p.clone() if p.device.type == "cpu" else None
        assert _native.distance_tail(p, s, scale, 3.0) is False
        if before is not None:
            assert torch.equal(p, before) or torch.isnan(p).any()


# ------------------------------------------------------------------ through the public function
def distances_and_gradients(x, y, same, dtype, flag, monkeypatch):
    """D, ∇x, ∇y (None when same), ∂/∂c of Σ G∘D in ``dtype`` on the given tail path."""
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", flag)
    xs = x.to(dtype).clone().requires_grad_(True)
    ys = xs if same else y.to(dtype).clone().requires_grad_(True)
    c = torch.tensor(C, dtype=dtype, requires_grad=True)
    d = pb.pairwise_dist(xs, ys, c)
    g = torch.randn(d.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(dtype)
    (d * g).sum().backward()
    return d.detach(), xs.grad, None if same else ys.grad, c.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("same", [True, False])
def test_pairwise_dist_native_and_torch_paths_agree(dtype, same, monkeypatch):
    # each path against float64 (torch path): measured float32 1e-7..5e-7 on D and the gradients
    # of x, y, ~1.2e-6 on ∂/∂c (a sum over all pairs) for both paths alike
    x = radial_points(120, 32, 0.0, 2.5, 0, torch.float64)
    y = x if same else radial_points(90, 32, 0.0, 2.5, 1, torch.float64)
    exact = distances_and_gradients(x, y, same, torch.float64, "0", monkeypatch)
    tol = {torch.float32: 5e-6, torch.float64: 1e-12}[dtype]
    for flag in ("1", "0"):
        got = distances_and_gradients(x, y, same, dtype, flag, monkeypatch)
        for value, ref in zip(got, exact):
            if ref is not None:
                assert float((value.double() - ref).abs().max() / ref.abs().max()) <= tol, (flag, value, ref)
    native, fallback = (distances_and_gradients(x, y, same, dtype, f, monkeypatch)[0] for f in ("1", "0"))
    torch.testing.assert_close(native, fallback, rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0)
    rel = ((native.double() - reference(x, y)).abs() / reference(x, y).clamp_min(1e-2)).max()
    assert rel <= (2e-6 if dtype == torch.float32 else 1e-12)


@needs_native
def test_the_kernel_takes_the_native_path_and_gradcheck_passes(monkeypatch):
    calls = []
    real = _native.distance_tail
    monkeypatch.setattr(_native, "distance_tail", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    x = radial_points(7, 4, 0.0, 2.0, 0, torch.float64).requires_grad_(True)
    y = radial_points(5, 4, 0.0, 2.0, 1, torch.float64).requires_grad_(True)
    c = torch.tensor(C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(pb.pairwise_dist, (x, y, c))
    assert torch.autograd.gradcheck(lambda a, cc: pb.pairwise_dist(a, a, cc), (x, c))
    assert calls and all(calls)


# ------------------------------------------------------------------ fallbacks
def test_disabled_by_environment_variable(monkeypatch):
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")
    assert not _native.enabled()
    assert _native.status() == "torch (disabled by PML_HYPERBOLIC_NATIVE=0)"
    P, q = tail_inputs(torch.float32)
    assert _native.distance_tail(P.clone(), None, q, 3.0) is False
    x = radial_points(50, 16, 0.0, 1.0, 0)
    d = pb.pairwise_dist(x, x, C)
    assert float(((d.double() - reference(x, x)).abs() / reference(x, x).clamp_min(1e-2)).max()) <= 2e-6


def test_missing_compiler_falls_back_to_torch(fresh_native, tmp_path):
    fresh_native.setenv("PML_HYPERBOLIC_CC", str(tmp_path / "no-such-compiler"))
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(tmp_path / "cache"))
    status = _native.status()
    assert status.startswith("torch (native unavailable") and "compiler" in status
    P, q = tail_inputs(torch.float32)
    assert _native.distance_tail(P.clone(), None, q, 3.0) is False
    x = radial_points(60, 16, 0.0, 2.5, 0).requires_grad_(True)
    d = pb.pairwise_dist(x, x, C)
    d.sum().backward()
    assert torch.isfinite(x.grad).all()
    ref = reference(x.detach(), x.detach())
    assert float(((d.detach().double() - ref).abs() / ref.clamp_min(1e-2)).max()) <= 2e-6
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_unwritable_cache_falls_back_to_torch(fresh_native, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")  # (root ignores permissions: a file in the path blocks for everyone)
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(blocker / "cache"))
    assert _native.status().startswith("torch (native unavailable")
    x = radial_points(40, 8, 0.0, 2.5, 0)
    assert torch.isfinite(pb.pairwise_dist(x, x, C)).all()


def test_failed_compilation_falls_back_to_torch(fresh_native, tmp_path):
    fake = tmp_path / "fakecc"
    fake.write_text("#!/bin/sh\necho 'fake compiler: error' >&2\nexit 1\n")
    fake.chmod(0o755)
    fresh_native.setenv("PML_HYPERBOLIC_CC", str(fake))
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(tmp_path / "cache"))
    status = _native.status()
    assert status.startswith("torch (native unavailable") and "fake compiler: error" in status
    assert not any((tmp_path / "cache").glob("*.so"))  # no half-written library left behind


@needs_native
def test_build_into_a_fresh_cache_is_atomic_and_reused(fresh_native, tmp_path):
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(tmp_path))
    assert _native.status() == "native"
    built = sorted(p.name for p in tmp_path.iterdir())
    assert len(built) == 2 and built[1].startswith("native_tail-") and built[1].endswith(".so")
    assert built[0] == built[1][:-3] + ".sha256"  # the library and its digest, nothing else
    mtime = (tmp_path / built[1]).stat().st_mtime_ns
    _native.reset()
    assert _native.status() == "native"
    assert (tmp_path / built[1]).stat().st_mtime_ns == mtime  # loaded from the cache, not rebuilt


@needs_native
def test_damaged_cached_library_is_rebuilt(fresh_native, tmp_path):
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(tmp_path))
    key = _native._cache_key(_native.SOURCE.read_bytes(), _native._compiler())
    damaged = tmp_path / f"native_tail-{key}.so"
    damaged.write_bytes(b"not a shared object")
    assert _native.status() == "native"
    assert damaged.stat().st_size > 1000  # replaced by a real build


@needs_native
def test_concurrent_processes_build_the_same_cache(tmp_path):
    env = dict(os.environ, PML_HYPERBOLIC_CACHE=str(tmp_path))
    code = "from pml_hyperbolic import _native; print(_native.status())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outputs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outputs == ["native"] * 3
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[1].endswith(".so") and names[0] == names[1][:-3] + ".sha256", names


# ---- the cached library is verified before it is trusted -------------------------------------------

_CHECK_IN_SUBPROCESS = r"""
import math, sys, warnings
import torch
warnings.simplefilter("always")
from pml_hyperbolic import _native, poincare_ball as pb
g = torch.Generator().manual_seed(0)
x = torch.randn(70, 9, generator=g, dtype=torch.float64)
x = x / x.norm(dim=1, keepdim=True) * torch.rand(70, 1, generator=g, dtype=torch.float64) * 2.5
for dtype in (torch.float32, torch.float64):
    xs = x.to(dtype)
    for y in (xs, xs[:33].clone()):  # the symmetric path and the general one
        d = pb.pairwise_dist(xs, y, 0.1).double()
        a, b = 1 - 0.1 * (xs.double() ** 2).sum(1), 1 - 0.1 * (y.double() ** 2).sum(1)
        s = ((xs.double()[:, None] - y.double()[None]) ** 2).sum(-1)
        ref = 2 / math.sqrt(0.1) * torch.asinh(torch.sqrt(0.1 * s / (a[:, None] * b[None])))
        err = float(((d - ref).abs() / ref.clamp_min(1e-2)).max())
        assert err < 1e-5, (dtype, err)
print(_native.status())
"""


@pytest.fixture(scope="module")
def copying_compiler(tmp_path_factory):
    """One real build of the library, and a stand-in compiler that "builds" by copying it (so that a
    rebuild takes milliseconds) and logs each call: ``(compiler, its log)``."""
    compiler = _native._compiler()
    if compiler is None:
        pytest.skip("no C compiler here")
    folder = tmp_path_factory.mktemp("copying_compiler")
    good = folder / "good.so"
    subprocess.run([*compiler, *_native._FLAGS, "-o", str(good), str(_native.SOURCE), "-lm"], check=True,
                   capture_output=True, timeout=300)
    log = folder / "calls.log"
    script = folder / "copycc"
    script.write_text('#!/bin/sh\necho call >> "%s"\nout=""\nwhile [ $# -gt 0 ]; do\n'
                      '  if [ "$1" = "-o" ]; then out="$2"; fi; shift\ndone\n'
                      'if [ -n "$COPYCC_GARBAGE" ]; then echo garbage > "$out"; else cp "%s" "$out"; fi\n'
                      % (log, good))
    script.chmod(0o755)
    return script, log


def _run_check(cache, compiler, **extra_env):
    env = dict(os.environ, PML_HYPERBOLIC_CACHE=str(cache), PML_HYPERBOLIC_CC=str(compiler),
               PML_HYPERBOLIC_NATIVE="1", **extra_env)
    return subprocess.run([sys.executable, "-c", _CHECK_IN_SUBPROCESS], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def built_cache(copying_compiler, tmp_path_factory):
    """A cache folder holding one verified build (made by a first process)."""
    compiler, _ = copying_compiler
    folder = tmp_path_factory.mktemp("built_cache")
    done = _run_check(folder, compiler)
    assert done.returncode == 0 and done.stdout.strip() == "native", done.stderr
    return folder


def _calls(log) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _damage_truncate(so, digest):
    so.write_bytes(so.read_bytes()[:4096])


def _damage_flip_bytes(so, digest):
    data = bytearray(so.read_bytes())
    for offset in (len(data) // 3, len(data) // 2, len(data) - 100):
        data[offset] ^= 0x10
    so.write_bytes(bytes(data))


def _damage_empty(so, digest):
    so.write_bytes(b"")


def _damage_digest(so, digest):
    line = digest.read_text()
    digest.write_text(("0" if line[0] != "0" else "1") + line[1:])


def _damage_digest_missing(so, digest):
    digest.unlink()


def _damage_digest_of_another_build(so, digest):
    sha, key = digest.read_text().split()
    digest.write_text(f"{sha} {'0' * len(key)}\n")  # a true digest, bound to another key


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip_bytes, _damage_empty, _damage_digest,
                                    _damage_digest_missing, _damage_digest_of_another_build],
                         ids=lambda f: f.__name__[len("_damage_"):])
def test_damaged_cache_is_discarded_and_rebuilt_in_a_new_process(copying_compiler, built_cache, tmp_path, damage):
    compiler, log = copying_compiler
    shutil.copytree(built_cache, tmp_path, dirs_exist_ok=True)
    (so,) = tmp_path.glob("native_tail-*.so")
    digest = so.with_suffix(".sha256")
    good = so.read_bytes()
    before = _calls(log)
    damage(so, digest)
    second = _run_check(tmp_path, compiler)  # a crash would show as a signal exit status here
    assert second.returncode == 0, (second.returncode, second.stderr[-2000:])
    assert second.stdout.strip() == "native"  # rebuilt, verified and self-checked
    assert _calls(log) > before
    assert _calls(log) == before + 1  # one rebuild
    assert so.read_bytes() == good and digest.read_text() == (built_cache / digest.name).read_text()


def test_damaged_cache_whose_rebuild_fails_falls_back_with_a_warning(copying_compiler, built_cache, tmp_path):
    compiler, _ = copying_compiler
    shutil.copytree(built_cache, tmp_path, dirs_exist_ok=True)
    (so,) = tmp_path.glob("native_tail-*.so")
    so.write_bytes(so.read_bytes()[:4096])
    done = _run_check(tmp_path, compiler, COPYCC_GARBAGE="1")  # the rebuild "succeeds" with garbage
    assert done.returncode == 0, done.stderr[-2000:]  # right numbers on the torch path, no crash
    assert done.stdout.strip().startswith("torch (native unavailable")
    warning_lines = [line for line in done.stderr.splitlines() if "discarded a damaged native library" in line]
    assert len(warning_lines) == 1
    assert not list(tmp_path.glob("native_tail-*"))  # nothing untrusted left in the cache


class _Tampered:
    """A loaded library with one kernel replaced."""

    def __init__(self, lib, name, fn):
        self._lib, self._name, self._fn = lib, name, fn

    def __getattr__(self, attr):
        return self._fn if attr == self._name else getattr(self._lib, attr)


_KERNELS = [f"pml_{kernel}_{dtype}" for kernel in ("tail", "log1p", "row_terms", "sym_tail", "sym_grad",
                                                    "uniform_rows", "lca_rows", "lca_backward")
            for dtype in ("f32", "f64")]


@needs_native
@pytest.mark.parametrize("kernel", _KERNELS)
def test_self_check_covers_every_kernel(kernel):
    lib = _native._library()
    _native._self_check(lib)  # the real library passes
    with pytest.raises(RuntimeError, match=kernel):
        _native._self_check(_Tampered(lib, kernel, lambda *args: 0))  # a kernel that writes nothing


@needs_native
@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_self_check_catches_a_symmetric_tail_a_thousandth_off(dtype):
    import ctypes

    import numpy as np

    lib = _native._library()
    real = getattr(lib, f"pml_sym_tail_{dtype}")
    scalar = ctypes.c_float if dtype == "f32" else ctypes.c_double

    def off_by_a_thousandth(*args):
        real(*args)
        n = args[5]
        np.ctypeslib.as_array((scalar * (n * n)).from_address(args[0]))[:] *= 1.001

    with pytest.raises(RuntimeError, match=f"pml_sym_tail_{dtype}"):
        _native._self_check(_Tampered(lib, f"pml_sym_tail_{dtype}", off_by_a_thousandth))
