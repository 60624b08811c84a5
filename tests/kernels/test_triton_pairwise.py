"""The Triton pairwise Poincaré distance (``pml_hyperbolic.kernels.triton_pairwise``): forward and
backward against a float64 torch reference, the ``torch.library`` registration (opcheck), gradcheck,
odd sizes and bad inputs.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``); on a
machine with CUDA they are compiled and run on the GPU. Sizes stay small (N ≤ 64, D ≤ 32, one
N = 130 case with D = 3): the interpreter runs each program in numpy.
"""
from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

# TRITON_INTERPRET is read when a function is decorated with triton.jit, and Triton decorates its
# own library functions (tl.zeros, ...) when it is imported: the variable must be set before triton
# is first imported, and interpreted library functions must not meet real GPU kernels later in the
# same process. Hence:
# * TRITON_INTERPRET=1 already set for the run: interpret, in this process;
# * no CUDA and triton not imported yet: set it now (for the rest of the process: nothing compiles
#   Triton kernels on a CPU-only machine) and interpret in this process;
# * CUDA: compile the kernels and test them on the GPU;
# * no CUDA but triton already imported (not interpreted): the tests run in a child pytest process
#   started with TRITON_INTERPRET=1 (test_interpreter_tests_in_a_child_process).
HAVE_TRITON = importlib.util.find_spec("triton") is not None
tp = None
if HAVE_TRITON:
    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        from pml_hyperbolic.kernels import triton_pairwise as tp
    elif "triton" not in sys.modules:
        # left set: parts of triton imported later (during a launch) check it too
        os.environ["TRITON_INTERPRET"] = "1"
        from pml_hyperbolic.kernels import triton_pairwise as tp
DEVICE = "cuda" if tp is not None and torch.cuda.is_available() and not tp.triton_available("cpu") else "cpu"
RUNNABLE = tp is not None and tp.triton_available(DEVICE)

in_interpreter = pytest.mark.skipif(
    not RUNNABLE, reason="triton is not installed" if not HAVE_TRITON else
    "triton was imported before TRITON_INTERPRET=1 could be set: these tests run in a child process "
    "(test_interpreter_tests_in_a_child_process)")


def test_interpreter_tests_in_a_child_process():
    if RUNNABLE or not HAVE_TRITON:
        pytest.skip("the kernel tests run in this process" if RUNNABLE else "triton is not installed")
    root = pathlib.Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(pathlib.Path(__file__).resolve())],
                            cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"interpreter tests failed:\n{result.stdout[-6000:]}\n{result.stderr[-3000:]}"
    summary = result.stdout.strip().splitlines()[-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) >= 20 and "failed" not in summary and "error" not in summary, summary


FLOOR = 2.0 ** -60


def _on(t):
    return t.to(DEVICE) if isinstance(t, torch.Tensor) else t


def dist(x, y, c):
    """The kernel on DEVICE for CPU inputs (``y is x`` kept), the result back on the CPU."""
    xd = _on(x)
    return tp.pairwise_poincare_dist_triton(xd, xd if y is x else _on(y), _on(c)).cpu()


def reference(x: torch.Tensor, y: torch.Tensor, c) -> torch.Tensor:
    """Float64 all-pairs distance from the formula by broadcasting (the clamp gives x_i = y_j a
    zero subgradient)."""
    xd, yd = x.double(), y.double()
    cd = c.double() if isinstance(c, torch.Tensor) else torch.tensor(float(c), dtype=torch.float64)
    a = (1 - cd * (xd * xd).sum(1)).clamp_min(FLOOR)
    b = (1 - cd * (yd * yd).sum(1)).clamp_min(FLOOR)
    s = ((xd[:, None, :] - yd[None, :, :]) ** 2).sum(-1)
    w = cd * s / (a[:, None] * b[None, :])
    return (2 / cd.sqrt()) * torch.asinh(w.clamp_min(1e-300).sqrt())


def ball_points(n: int, d: int, c: float, seed: int, max_d0: float = 3.0) -> torch.Tensor:
    """n float64 points with distances to the origin uniform in [0, max_d0], plus close pairs:
    row 1 is row 0 moved by 1e-4, row 2 by 1e-6, row 3 a copy of row 0 (when n allows)."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = max_d0 * torch.rand(n, generator=g, dtype=torch.float64)
    x = v * (torch.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c))[:, None]
    for row, scale in ((1, 1e-4), (2, 1e-6), (3, 0.0)):
        if n > row:
            x[row] = x[0] + scale * torch.randn(d, generator=g, dtype=torch.float64)
    return x


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest relative error, entries below 1e-12 compared absolutely."""
    return ((got.double() - want).abs() / want.abs().clamp_min(1e-12)).max().item()


TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


@in_interpreter
@pytest.mark.parametrize("c", [0.1, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_forward_matches_float64_reference(c, dtype):
    x64 = ball_points(64, 32, c, seed=1)
    x = x64.to(dtype)
    y = ball_points(37, 32, c, seed=2).to(dtype)
    y[5] = x[7]  # an exact duplicate across x and y
    d = dist(x, x, c)
    assert d.dtype == dtype and d.shape == (64, 64)
    want = reference(x, x, c)
    assert rel_err(d, want) < TOL[dtype]
    assert torch.equal(d.diagonal(), torch.zeros(64, dtype=dtype))
    assert torch.equal(d, d.T)  # exactly symmetric
    assert d[0, 3] == 0  # the copy of row 0
    assert d[0, 2] > 0 and abs(d[0, 2].item() / want[0, 2].item() - 1) < TOL[dtype]  # 1e-6 apart
    dxy = dist(x, y, c)
    assert dxy.shape == (64, 37)
    assert rel_err(dxy, reference(x, y, c)) < TOL[dtype]
    assert dxy[7, 5] == 0


@pytest.fixture(params=[None, 2], ids=["splits-auto", "splits-2"])
def splits(request, monkeypatch):
    """The backward's walk over the other side in one part (the interpreter's default) or in two
    partial sums reduced by the finishing kernel (what a GPU with few row blocks does)."""
    if tp is not None:
        monkeypatch.setattr(tp, "_SPLITS_OVERRIDE", request.param)
    return request.param


@in_interpreter
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_backward_matches_float64_autograd(c, splits):
    # the reference starts from the float32-rounded points: close pairs' directions depend on the rounding
    x64 = ball_points(48, 16, c, seed=3).float().double()
    y64 = ball_points(29, 16, c, seed=4).float().double()
    g = torch.Generator().manual_seed(5)
    upstream = torch.randn(48, 29, generator=g, dtype=torch.float64)
    c64 = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    xr, yr = x64.clone().requires_grad_(), y64.clone().requires_grad_()
    (reference(xr, yr, c64) * upstream).sum().backward()

    x, y = x64.float().requires_grad_(), y64.float().requires_grad_()
    ct = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    (dist(x, y, ct) * upstream.float()).sum().backward()
    assert x.grad.dtype == torch.float32 and y.grad.dtype == torch.float32
    for got, want in ((x.grad, xr.grad), (y.grad, yr.grad)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    assert abs(ct.grad.item() / c64.grad.item() - 1) < 1e-5


@in_interpreter
def test_a_learnable_curvature_of_a_geometry_gets_its_gradient():
    from pml_hyperbolic.geometry import PoincareGeometry

    x64 = ball_points(24, 8, 0.5, seed=16).float().double()
    y64 = ball_points(19, 8, 0.5, seed=17).float().double()
    upstream = torch.randn(24, 19, generator=torch.Generator().manual_seed(18), dtype=torch.float64)
    geometry, twin = PoincareGeometry(c=0.5, learnable_c=True), PoincareGeometry(c=0.5, learnable_c=True)
    (dist(x64.float(), y64.float(), geometry.curvature(torch.float64)) * upstream.float()).sum().backward()
    (reference(x64, y64, twin.curvature(torch.float64)) * upstream).sum().backward()
    got = [p.grad for p in geometry.parameters() if p.requires_grad]
    want = [p.grad for p in twin.parameters() if p.requires_grad]
    assert len(got) == len(want) == 1 and got[0] is not None
    assert torch.allclose(got[0].double(), want[0].double(), rtol=1e-5, atol=0)


@in_interpreter
@pytest.mark.parametrize("c", [0.1, 1.0])
def test_x_is_y_gradient_adds_both_sides_and_is_zero_safe(c, splits):
    x64 = ball_points(40, 24, c, seed=6).float().double()  # rows 0 and 3 coincide: w = 0 off the diagonal
    g = torch.Generator().manual_seed(7)
    upstream = torch.randn(40, 40, generator=g, dtype=torch.float64)  # not symmetric
    c64 = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    xr = x64.clone().requires_grad_()
    (reference(xr, xr, c64) * upstream).sum().backward()
    x = x64.float().requires_grad_()
    ct = torch.tensor(c, dtype=torch.float64, requires_grad=True)
    (dist(x, x, ct) * upstream.float()).sum().backward()
    assert torch.isfinite(x.grad).all()
    assert ((x.grad.double() - xr.grad).abs().max() / xr.grad.abs().max()).item() < 1e-5
    assert abs(ct.grad.item() / c64.grad.item() - 1) < 1e-5
    # the same tensor passed as two different tensors gives the same gradient (two launches)
    x2 = x64.float().requires_grad_()
    (dist(x2, x2.clone(), c) * upstream.float()).sum().backward()
    assert torch.allclose(x2.grad, x.grad, rtol=0, atol=1e-5 * x.grad.abs().max().item())


@in_interpreter
def test_gradcheck_and_gradgradcheck_tiny_float64():
    g = torch.Generator().manual_seed(8)
    x = (0.3 * torch.randn(3, 2, generator=g, dtype=torch.float64)).requires_grad_()
    y = (0.3 * torch.randn(2, 2, generator=g, dtype=torch.float64)).requires_grad_()
    c = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    x, y, c = (t.detach().to(DEVICE).requires_grad_() for t in (x, y, c))
    f = tp.pairwise_poincare_dist_triton
    assert torch.autograd.gradcheck(f, (x, y, c), fast_mode=True)
    assert torch.autograd.gradcheck(lambda a, cc: f(a, a, cc), (x, c), fast_mode=True)
    # create_graph=True differentiates the float64 composite: a gradient penalty works
    assert torch.autograd.gradgradcheck(f, (x, y, c), fast_mode=True)


@in_interpreter
@pytest.mark.parametrize("n", [1, 37, 130])
def test_sizes_that_are_not_block_multiples(n):
    dim = 3 if n == 130 else 11
    x64 = ball_points(n, dim, 0.1, seed=9).float().double()
    y64 = ball_points(n + 2, dim, 0.1, seed=10).float().double()
    x = x64.float().requires_grad_()
    d = dist(x, y64.float(), 0.1)
    assert d.shape == (n, n + 2)
    assert rel_err(d, reference(x64, y64, 0.1)) < 1e-5
    if n <= 37:
        d.sum().backward()  # an expanded (stride 0) upstream gradient
        xr = x64.clone().requires_grad_()
        reference(xr, y64, 0.1).sum().backward()
        assert ((x.grad.double() - xr.grad).abs().max() / xr.grad.abs().max()).item() < 1e-5


@in_interpreter
def test_strided_inputs_and_empty_sets():
    x64 = ball_points(20, 9, 1.0, seed=11)
    x = x64.float().T.contiguous().T  # column-major
    y = ball_points(30, 18, 1.0, seed=12).float()[::2, ::2]  # every other row and feature
    assert not x.is_contiguous() and not y.is_contiguous()
    d = dist(x, y, 1.0)
    assert rel_err(d, reference(x, y, 1.0)) < 1e-5
    assert dist(x[:0], y, 1.0).shape == (0, 15)
    assert dist(x, y[:0], 1.0).shape == (20, 0)


@in_interpreter
def test_points_on_or_outside_the_boundary_use_the_denominator_floor():
    x64 = ball_points(10, 4, 1.0, seed=13)
    x64[4] = x64[4] / x64[4].norm() * 1.5  # outside the ball: 1 − c‖x‖² floored at 2⁻⁶⁰
    x64[5] = x64[5] / x64[5].norm()  # on the boundary
    x = x64.float().requires_grad_()
    d = dist(x, x, 1.0)
    assert torch.isfinite(d).all()
    assert rel_err(d, reference(x.detach(), x.detach(), 1.0)) < 1e-5
    d.sum().backward()
    assert torch.isfinite(x.grad).all()


@in_interpreter
def test_half_precision_inputs_accumulate_and_return_float32():
    x64 = ball_points(33, 16, 1.0, seed=14)
    x = x64.half().requires_grad_()
    d = dist(x, x, 1.0)
    assert d.dtype == torch.float32
    assert rel_err(d, reference(x.detach(), x.detach(), 1.0)) < 1e-5  # against the float16 values
    d.sum().backward()
    assert x.grad.dtype == torch.float16
    xr = x.detach().double().requires_grad_()
    reference(xr, xr, 1.0).sum().backward()
    assert ((x.grad.double() - xr.grad).abs().max() / xr.grad.abs().max()).item() < 2e-3  # float16 grad
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        xb = _on(x64.bfloat16())
        db = tp.pairwise_poincare_dist_triton(xb, xb, 1.0).cpu()
        xb = xb.cpu()
    assert db.dtype == torch.float32
    assert rel_err(db, reference(xb, xb, 1.0)) < 1e-5


@in_interpreter
@pytest.mark.parametrize("shape", [(5, 4, 3), (7, 6, 5)])
@pytest.mark.parametrize("y_is_x", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(dtype, y_is_x, shape):
    # In the interpreter test_aot_dispatch_dynamic is left out: under AOT dispatch a triton_op
    # decomposes into its kernel launches (wrap_triton), which must be traced as GPU kernels; the
    # interpreter's kernels are plain Python that reads data pointers, so they cannot run on the
    # functional fake tensors ("Attempted to access the data pointer on an invalid python
    # storage"). On CUDA it runs here.
    n, m, d = shape
    g = torch.Generator().manual_seed(15)
    x = _on(0.2 * torch.randn(n, d, generator=g, dtype=dtype)).requires_grad_()
    y = None if y_is_x else _on(0.2 * torch.randn(m, d, generator=g, dtype=dtype)).requires_grad_()
    c = _on(torch.tensor(0.5, dtype=torch.float64)).requires_grad_()
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    if DEVICE == "cuda":
        tests += ("test_aot_dispatch_dynamic",)
    result = torch.library.opcheck(torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton, (x, y, c),
                                   test_utils=tests)
    assert result == {name: "SUCCESS" for name in tests}
    upstream = _on(torch.randn(n, n if y_is_x else m, generator=g, dtype=dtype))
    result = torch.library.opcheck(torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton_backward,
                                   (upstream, x.detach(), None if y is None else y.detach(), c.detach()),
                                   test_utils=("test_schema", "test_faketensor"))
    assert set(result.values()) == {"SUCCESS"}


@in_interpreter
@pytest.mark.parametrize("y_is_x", [False, True])
def test_gradient_does_not_depend_on_the_upstream_layout(monkeypatch, y_is_x):
    # `.sum()` hands the backward an expanded (stride 0) gradient in eager mode, torch.compile a
    # contiguous one; the kernels see a contiguous gradient either way, so both give the same bits
    seen = []
    side_gradient = tp._side_gradient

    def spy(a, b, grad, *args, **kwargs):
        seen.append(grad.is_contiguous())
        return side_gradient(a, b, grad, *args, **kwargs)

    monkeypatch.setattr(tp, "_side_gradient", spy)
    g = torch.Generator().manual_seed(4)
    x = _on(0.2 * torch.randn(7, 5, generator=g)).requires_grad_()
    y = x if y_is_x else _on(0.2 * torch.randn(6, 5, generator=g)).requires_grad_()
    c = _on(torch.tensor(0.5, dtype=torch.float64)).requires_grad_()
    inputs = [x, c] if y_is_x else [x, y, c]
    expanded = torch.autograd.grad(tp.pairwise_poincare_dist_triton(x, y, c).sum(), inputs)
    out = tp.pairwise_poincare_dist_triton(x, y, c)
    dense = torch.autograd.grad(out, inputs, torch.ones_like(out))
    assert seen == [True] * (2 if y_is_x else 4)  # one kernel walk per side and backward
    for a, b in zip(expanded, dense):
        assert torch.equal(a, b)


@in_interpreter
def test_bad_inputs_raise_one_clear_error(monkeypatch):
    # a curvature tensor on an accelerator is read back on request only (else: a device assertion)
    monkeypatch.setenv("PML_HYPERBOLIC_CHECK_VALUES", "1")
    x = 0.1 * torch.randn(4, 3)
    with pytest.raises(ValueError, match="same number of features"):
        dist(x, 0.1 * torch.randn(4, 5), 0.1)
    with pytest.raises(ValueError, match="x must be 2-D"):
        dist(x[None], x, 0.1)
    with pytest.raises(ValueError, match="y must be 2-D"):
        dist(x, x[0], 0.1)
    for bad_c in (0.0, -1.0, float("nan"), torch.tensor(-0.5)):
        with pytest.raises(ValueError, match="c"):
            dist(x, x, bad_c)
    with pytest.raises(ValueError, match="scalar curvature"):
        dist(x, x, torch.tensor([0.1, 0.2]))
    with pytest.raises(TypeError, match="x must be float16"):
        dist(torch.ones(4, 3, dtype=torch.int64), x, 0.1)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        dist(x, x.tolist(), 0.1)
    with pytest.raises(RuntimeError, match="pairwise_dist instead"):
        tp.pairwise_poincare_dist_triton(x.to("meta"), x.to("meta"), 0.1)
    assert not tp.triton_available("meta")


@in_interpreter
def test_registered_names():
    assert tp.OP_NAME == "pml_hyperbolic::pairwise_poincare_dist_triton"
    assert hasattr(torch.ops.pml_hyperbolic, "pairwise_poincare_dist_triton")
    assert hasattr(torch.ops.pml_hyperbolic, "pairwise_poincare_dist_triton_backward")


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_kernels_compile_for_a_gpu_without_one(tmp_path):
    """Triton's full pipeline to a cubin for sm_90 (what the interpreter never does), float32 inputs."""
    root = pathlib.Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a real compile, not a cache hit
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "bench", "--no-json", "triton_check", "--compile-only",
                             "--dtypes", "float32"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("compile sm_90")]
    assert len(lines) == 6 and all(" ok" in line for line in lines), result.stdout[-3000:]
    assert "triton compile ok" in result.stdout
