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
    # forward and backward traced by AOTAutograd (the backward op recomputes the N×M buffer there)
    loss = torch.compile(lambda a, cc: ops.poincare_pairwise_dist(a, a, cc).sum(), fullgraph=True,
                         backend="aot_eager")
    traced, eager = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    loss(traced, c).backward()
    ops.poincare_pairwise_dist(eager, eager, c).sum().backward()
    assert torch.allclose(traced.grad, eager.grad, rtol=1e-5, atol=1e-6)


needs_native = pytest.mark.skipif(kernels.status()["pairwise"] != "native", reason="native kernels unavailable here")


def _native_cases(dtype):
    """(operator, args, test_utils) for every native operator on a small input."""
    g = torch.Generator().manual_seed(9)
    n, p = 20, 6
    P = torch.rand(n, n, generator=g, dtype=torch.float64).to(dtype)
    q = torch.rand(n, generator=g, dtype=torch.float64).to(dtype) + 1
    x = ((torch.rand(n, 5, generator=g, dtype=torch.float64) - 0.5) * 0.5).to(dtype)
    x2 = (x.double() ** 2).sum(1)
    G = (x @ x.T).triu()
    p2, qq = (0.2 / (1 - 0.1 * x2)).to(dtype), (1 / (1 - 0.1 * x2)).to(dtype)
    dist = (torch.rand(n, p, generator=g, dtype=torch.float64) + 0.1).to(dtype)
    i, j, k = (torch.randint(0, n, (8,), generator=g) for _ in range(3))
    rows = i.numel()
    lca = (dist, i, j, k, 2.0, 0.1, True, 12345, dist.new_empty(rows), torch.empty(rows, dtype=torch.long),
           torch.empty(rows, dtype=torch.long), dist.new_empty(2, rows, p), dist.new_empty(3, rows),
           dist.new_empty(2, 2 * p), [0, 4, rows])
    u = torch.rand(2, rows, p, generator=g, dtype=torch.float64).to(dtype)
    ops_ = torch.ops.pml_hyperbolic
    static = ("test_schema", "test_faketensor")
    counted = ("test_schema",)  # (an int result is data-dependent: a fake size cannot be compared with it)
    return [
        (ops_._native_tail_.default, (P.clone(), torch.empty_like(P), q, 3.0, [0, 7, n]), static),
        (ops_._native_log1p.default, (P.flatten().clone(), torch.empty(n * n, dtype=dtype)), static),
        (ops_._native_sym_tail_.default, (G.clone(), torch.empty_like(G), x2.to(dtype), p2, qq, 3.0, 1e-3, [0, 2]),
         counted),
        (ops_._native_sym_grad_.default, (P, (P + 0.5).triu(), [0, 2]), static),
        (ops_._native_row_terms.default, (x, 0.1, 2.0 ** -60, 1e5, 1e-30, True), counted),
        (ops_._native_uniform_rows_.default, (7, 3, torch.empty(4, p, dtype=dtype)), static),
        (ops_._native_lca_rows_.default, lca, counted),
        (ops_._native_lca_backward_.default, (torch.zeros_like(dist), dist, i, j, k, u, q[:rows], [0, 10, n]), counted),
    ]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck_native_operators(dtype):
    for op, args, utils in _native_cases(dtype):
        torch.library.opcheck(op, args, test_utils=utils)
