"""pml_hyperbolic.kernels.ops: the kernels as registered custom ops (schema, fake implementation,
autograd registration checked by torch.library.opcheck; gradcheck in float64), the torch fallback,
and torch.compile tracing through the distance op."""
import pytest
import torch

from pml_hyperbolic import kernels
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.kernels import gram, ops


def _points(n, dim, dtype, seed, scale=0.6):
    g = torch.Generator().manual_seed(seed)
    return ((torch.rand(n, dim, generator=g, dtype=torch.float64) - 0.5) * scale).to(dtype)


def _cases(dtype):
    x = _points(7, 4, dtype, 1).requires_grad_(True)
    y = _points(5, 4, dtype, 2).requires_grad_(True)
    c = torch.tensor(0.7, dtype=dtype, requires_grad=True)
    near = x.detach().clone()
    near[3] = near[2] + 1e-4  # one close pair: recomputed explicitly
    near.requires_grad_(True)
    return [(x, y, c, True), (x, x, c, True), (near, near, c, True), (x.detach(), y.detach(), c.detach(), False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_pairwise_distance(dtype):
    for args in _cases(dtype):
        torch.library.opcheck(torch.ops.pml_hyperbolic.pairwise_poincare_dist.default, args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_row_terms(dtype):
    x = _points(6, 3, dtype, 3).requires_grad_(True)
    torch.library.opcheck(torch.ops.pml_hyperbolic.poincare_row_terms.default, (x, 0.5, gram.DENOM_FLOOR))


def test_gradcheck_pairwise_distance_float64():
    for x, y, c, _ in _cases(torch.float64)[:3]:
        fn = (lambda a, cc: ops.poincare_pairwise_dist(a, a, cc)) if x is y else ops.poincare_pairwise_dist
        args = (x, c) if x is y else (x, y, c)
        assert torch.autograd.gradcheck(fn, args)


def test_gradgradcheck_pairwise_distance_float64():
    x, y, c, _ = _cases(torch.float64)[0]
    assert torch.autograd.gradgradcheck(ops.poincare_pairwise_dist, (x[:4], y[:3], c))


def test_gradcheck_row_terms_float64():
    x = _points(6, 3, torch.float64, 4, scale=2.0).requires_grad_(True)  # some rows outside the c = 2 ball
    assert torch.autograd.gradcheck(lambda t: ops.poincare_row_terms(t, 2.0, 1e-3), (x,))


def test_row_terms_reference_values():
    x = torch.tensor([[0.0, 0.0], [0.3, 0.4], [3.0, 4.0]], dtype=torch.float64)
    x2, inv_a = ops.poincare_row_terms(x, 0.5, 1e-3)
    assert torch.equal(x2, torch.tensor([0.0, 0.25, 25.0], dtype=torch.float64))
    assert torch.allclose(inv_a, torch.tensor([1.0, 1 / 0.875, 1e3], dtype=torch.float64))


def test_op_equals_the_public_function():
    x, y = _points(9, 4, torch.float32, 5), _points(6, 4, torch.float32, 6)
    c = torch.tensor(0.1)
    assert torch.equal(torch.ops.pml_hyperbolic.pairwise_poincare_dist(x, y, c, False)[0], pb.pairwise_dist(x, y, c))


def test_second_backward_recomputes_the_buffer():
    x = _points(8, 3, torch.float64, 7).requires_grad_(True)
    c = torch.tensor(0.4, dtype=torch.float64)
    d = ops.poincare_pairwise_dist(x, x, c)
    (g1,) = torch.autograd.grad(d.sum(), x, retain_graph=True)
    (g2,) = torch.autograd.grad(d.sum(), x)
    assert torch.equal(g1, g2)


def test_status_names_the_path():
    st = kernels.status()
    assert st["pairwise"] in ("native", "torch") and isinstance(st["reason"], str) and st["reason"]


def test_torch_compile_traces_the_distance_op_without_graph_breaks():
    x = _points(6, 3, torch.float32, 8)
    c = torch.tensor(0.3)
    compiled = torch.compile(lambda a, cc: ops.poincare_pairwise_dist(a, a, cc), fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x, c), ops.poincare_pairwise_dist(x, x, c))
