"""The pairwise kernel's fused native tail (pml_hyperbolic/kernels/native.py, kernels/csrc/kernels.c): agreement
with the torch path (forward, backward, float32 and float64), its log1p against reference values,
and the fallback to the torch path whenever it cannot run (disabled, no compiler, a failed build,
odd dtype, device or layout), and a build that fails its self-check never being used."""
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

from pml_hyperbolic import kernels
from pml_hyperbolic.kernels import build
from pml_hyperbolic.kernels import native as _native
from tests.kernels import torch_threads
from pml_hyperbolic.kernels.self_check import self_check
from pml_hyperbolic.kernels import tail
from pml_hyperbolic import poincare_ball as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout these tests belong to
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
    S = tail._distance_tail(out, C, q, out.amin(1), keep_S)
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
    lib = build.library()
    tiny = torch.finfo(dtype).tiny
    u = torch.cat([torch.tensor([0.0, tiny, 1e-30, 2.0 ** -24, 2.0 ** -53, 1e-7, 0.41421356, 0.5, 1.0, 3.0, 1e6],
                                dtype=torch.float64),
                   torch.logspace(-37, 38, 20001, dtype=torch.float64),
                   torch.linspace(0, 3, 20001, dtype=torch.float64)]).to(dtype)
    out = torch.empty_like(u)
    lib._native_log1p(u, out)
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_gram_tails_and_weights_give_the_same_bits_on_one_and_two_threads(dtype):
    # each part of a native loop owns whole rows (or bands): splitting them over torch's threads
    # may not change a bit of D, S, the close-pair count or the symmetric gradient weights
    g = torch.Generator().manual_seed(5)
    n, m, dim, cf = 600, 520, 16, 0.1
    x = pb.expmap0(0.4 * torch.randn(n, dim, generator=g, dtype=torch.float64), cf).to(dtype)
    y = pb.expmap0(0.4 * torch.randn(m, dim, generator=g, dtype=torch.float64), cf).to(dtype)
    x[7] = y[3]  # one coincident pair: marked close
    x2, y2 = (x * x).sum(1), (y * y).sum(1)
    inv_a, inv_b = 1 / (1 - cf * x2), 1 / (1 - cf * y2)
    U = torch.rand(n, n, generator=g, dtype=torch.float64).to(dtype)
    results = []
    for threads in (1, 2):
        def run():
            G, S = x @ y.T, torch.empty(n, m, dtype=dtype)
            closes = _native.general_distance_tail(G, S, x2, 2 * cf * inv_a, y2, inv_b, cf ** -0.5, 0.5, threads)
            H, T = x @ x.T, torch.empty(n, n, dtype=dtype)
            sym_closes = _native.symmetric_distance_tail(H, T, x2, 2 * cf * inv_a, inv_a, cf ** -0.5, 0.5, threads)
            assert _native.symmetric_gradient_weights(U, T, threads)
            return G, S, closes, H, T, sym_closes

        with torch_threads(threads):
            results.append(run())
    assert results[0][2] >= 1 and results[0][5] >= 2  # the coincident pair was marked
    for one, two in zip(*results):
        assert torch.equal(one, two) if isinstance(one, torch.Tensor) else one == two


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
@pytest.mark.parametrize("general", ["1", "0"])
def test_the_kernel_takes_the_native_path_and_gradcheck_passes(monkeypatch, general):
    # x is not y: the general native tail (closeness test inside it), or with PML_HYPERBOLIC_GENERAL=0 the
    # torch prefilter and the plain native tail
    monkeypatch.setenv("PML_HYPERBOLIC_GENERAL", general)
    name = "general_distance_tail" if general == "1" else "distance_tail"
    calls = []
    real = getattr(_native, name)
    monkeypatch.setattr(_native, name, lambda *a, **k: calls.append(real(*a, **k)) or calls[-1])
    x = radial_points(7, 4, 0.0, 2.0, 0, torch.float64).requires_grad_(True)
    y = radial_points(5, 4, 0.0, 2.0, 1, torch.float64).requires_grad_(True)
    c = torch.tensor(C, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(pb.pairwise_dist, (x, y, c))
    assert torch.autograd.gradcheck(lambda a, cc: pb.pairwise_dist(a, a, cc), (x, c))
    assert calls and all(v is not None and v is not False for v in calls)


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


def test_failed_build_falls_back_to_torch(fresh_native, caplog):
    def no_compiler(folder):
        raise RuntimeError("no C++ compiler found")

    fresh_native.setattr(build, "_compile_and_load", no_compiler)
    with caplog.at_level(logging.INFO, logger="pml_hyperbolic.kernels"):
        status = _native.status()
    assert status.startswith("torch (native unavailable") and "compiler" in status
    assert kernels.status()["pairwise"] == "torch" and "compiler" in kernels.status()["reason"]
    assert [r for r in caplog.records if "native unavailable" in r.getMessage()]  # one INFO line says so
    P, q = tail_inputs(torch.float32)
    assert _native.distance_tail(P.clone(), None, q, 3.0) is False
    x = radial_points(60, 16, 0.0, 2.5, 0).requires_grad_(True)
    d = pb.pairwise_dist(x, x, C)
    d.sum().backward()
    assert torch.isfinite(x.grad).all()
    ref = reference(x.detach(), x.detach())
    assert float(((d.detach().double() - ref).abs() / ref.clamp_min(1e-2)).max()) <= 2e-6


@needs_native
def test_a_compiler_without_openmp_gets_a_build_without_it(fresh_native, caplog):
    calls = []

    def compile_and_load(folder, openmp=True):
        calls.append((folder, openmp))
        if openmp:  # what cpp_extension raises when the compile or link fails
            raise RuntimeError("Error building extension 'pml_hyperbolic_kernels': unrecognized option -fopenmp")
        # (the operators are registered in this process already)

    fresh_native.setattr(build, "_compile_and_load", compile_and_load)
    with caplog.at_level(logging.INFO, logger="pml_hyperbolic.kernels"):
        assert _native.status() == "native"
    assert calls == [(build.build_dir(), True), (build.build_dir(openmp=False), False)]
    assert build.build_dir() != build.build_dir(openmp=False)  # the two builds never share a folder
    assert [r for r in caplog.records if "without it" in r.getMessage()]


def test_a_failure_other_than_the_build_is_not_retried(fresh_native):
    calls = []

    def compile_and_load(folder, openmp=True):
        calls.append(openmp)
        raise RuntimeError("no C++ compiler found")

    fresh_native.setattr(build, "_compile_and_load", compile_and_load)
    assert _native.status().startswith("torch (native unavailable")
    assert calls == [True]


@needs_native
def test_the_build_shares_its_loops_over_torch_threads():
    # at::parallel_for runs serially in a file compiled without OpenMP: the build must carry it
    # wherever the compiler has it (GCC with libgomp here), and the status says so
    assert build.parallel() is True
    assert kernels.status()["cpu_threads"] == "torch's intra-op threads"


@needs_native
def test_torch_path_equals_native_path(fresh_native):
    x = radial_points(70, 16, 0.0, 2.5, 1, torch.float64)
    native = pb.pairwise_dist(x, x, C)
    fresh_native.setattr(build, "_compile_and_load", lambda folder: (_ for _ in ()).throw(RuntimeError("no compiler")))
    _native.reset()
    assert kernels.status()["pairwise"] == "torch"
    torch.testing.assert_close(pb.pairwise_dist(x, x, C), native, rtol=1e-12, atol=0)


@needs_native
def test_a_build_failing_its_self_check_is_discarded(fresh_native, tmp_path):
    fresh_native.setenv("PML_HYPERBOLIC_CACHE", str(tmp_path))
    folder = build.build_dir()
    folder.mkdir(parents=True)
    (folder / "pml_hyperbolic_kernels.so").write_bytes(b"a build that computes wrong numbers")
    fresh_native.setattr(build, "_compile_and_load", lambda folder: None)  # (the operators are registered already)
    tampered = _Tampered(torch.ops.pml_hyperbolic, "_native_tail_", lambda *args: None)
    fresh_native.setattr(build, "_operators", lambda: tampered)
    with pytest.warns(RuntimeWarning, match="failed their self-check"):
        status = _native.status()
    assert status.startswith("torch (native unavailable") and "self-check failed" in status
    assert not folder.exists()  # never reused: the next process builds anew


@needs_native
def test_missing_compiler_in_a_fresh_process_falls_back_to_torch(tmp_path):
    env = dict(os.environ, PML_HYPERBOLIC_CACHE=str(tmp_path), PML_HYPERBOLIC_CC=str(tmp_path / "no-such-compiler"),
               PYTHONPATH=ROOT)
    code = ("from pml_hyperbolic import kernels, poincare_ball as pb; import torch; "
            "x = torch.rand(30, 4) * 0.2; assert torch.isfinite(pb.pairwise_dist(x, x, 0.1)).all(); "
            "print(kernels.status()['pairwise'])")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "torch"


@pytest.mark.slow
@needs_native
def test_concurrent_processes_build_one_cache_and_reuse_it(tmp_path):
    env = dict(os.environ, PML_HYPERBOLIC_CACHE=str(tmp_path), PYTHONPATH=ROOT)
    code = "from pml_hyperbolic.kernels import native; print(native.status())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    assert [p.communicate(timeout=900)[0].strip() for p in procs] == ["native"] * 2
    (so,) = tmp_path.glob("torch-*/*/pml_hyperbolic_kernels.so")
    mtime = so.stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert again.stdout.strip() == "native" and so.stat().st_mtime_ns == mtime  # reused, not rebuilt


class _Tampered:
    """The loaded operators with one replaced."""

    def __init__(self, lib, name, fn):
        self._lib, self._name, self._fn = lib, name, fn

    def __getattr__(self, attr):
        return self._fn if attr == self._name else getattr(self._lib, attr)


_KERNELS = ["_native_tail_", "_native_log1p", "_native_row_terms", "_native_sym_tail_", "_native_sym_grad_",
            "_native_uniform_rows_", "_native_lca_rows_", "_native_lca_backward_"]


@needs_native
@pytest.mark.parametrize("kernel", _KERNELS)
def test_self_check_covers_every_kernel(kernel):
    lib = build.library()
    self_check(lib)  # the real operators pass
    real = getattr(lib, kernel)
    if kernel == "_native_row_terms":
        def wrong(*args):  # right shapes, wrong numbers
            x2, inv_a, vectors, nonzero, extreme = real(*args)
            return x2 * 1.5, inv_a, vectors, nonzero, extreme
    else:
        def wrong(*args):  # a kernel that writes nothing
            return 0
    with pytest.raises(RuntimeError, match="self-check failed"):
        self_check(_Tampered(lib, kernel, wrong))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_self_check_catches_a_symmetric_tail_a_thousandth_off(dtype):
    lib = build.library()
    real = lib._native_sym_tail_

    def off_by_a_thousandth(G, *args):
        count = real(G, *args)
        if G.dtype == dtype:
            G.mul_(1.001)
        return count

    with pytest.raises(RuntimeError, match="sym_tail"):
        self_check(_Tampered(lib, "_native_sym_tail_", off_by_a_thousandth))


def _fake_build(folder, payload=b"\x7fELF not a library", digest=None):
    folder.mkdir(parents=True)
    (folder / "pml_hyperbolic_kernels.so").write_bytes(payload)
    if digest is not None:
        (folder / "pml_hyperbolic_kernels.so.sha256").write_text(digest)
    return folder


def test_a_cached_build_without_its_digest_is_deleted_unloaded(tmp_path):
    folder = _fake_build(tmp_path / "build")
    assert build._load_verified_copy(folder) is False
    assert not folder.exists()


def test_a_cached_build_whose_bytes_changed_is_deleted_unloaded(tmp_path):
    payload = b"\x7fELF the bytes that were built"
    folder = _fake_build(tmp_path / "build", payload[:-5], digest=build._digest_line(payload))  # truncated
    assert build._load_verified_copy(folder) is False
    assert not folder.exists()


def test_no_cached_build_means_nothing_loaded(tmp_path):
    assert build._load_verified_copy(tmp_path / "missing") is False


@needs_native
def test_the_loaded_build_has_a_matching_digest():
    _native.status()
    folder = build.build_dir()
    data = build._library_file(folder).read_bytes()
    assert build._digest_file(folder).read_text() == build._digest_line(data)


def test_status_names_the_path_of_cuda_tensors(monkeypatch):
    from pml_hyperbolic import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernels.status()["cuda_pairwise"] == "none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("PML_HYPERBOLIC_TRITON", "off")
    assert kernels.status()["cuda_pairwise"] == "torch" and "PML_HYPERBOLIC_TRITON=0" in kernels.status()["cuda_reason"]
    monkeypatch.delenv("PML_HYPERBOLIC_TRITON")
    import importlib.util

    expected = "triton" if importlib.util.find_spec("triton") is not None else "torch"
    assert kernels.status()["cuda_pairwise"] == expected
