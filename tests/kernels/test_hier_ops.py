"""pml_hyperbolic.kernels.lca: HIER's LCA rows as the custom ops ``pml_hyperbolic::hier_lca_rows`` and
``::hier_lca_rows_backward`` (schema, fake implementation, autograd registration and AOT dispatch
checked by torch.library.opcheck in float32 and float64; gradcheck of the hard path in float64; the
straight-through gradient against autograd over the textbook per-op form; native against torch;
bad inputs)."""
import numpy as np
import pytest
import torch

from pml_hyperbolic import kernels
from pml_hyperbolic.kernels import lca
from tests.kernels import torch_threads

OPS = torch.ops.pml_hyperbolic
needs_native = pytest.mark.skipif(kernels.status()["pairwise"] != "native", reason="native kernels unavailable here")
PATHS = ["native", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run the test through the native loops and through the torch ops."""
    if request.param == "native":
        if kernels.status()["pairwise"] != "native":
            pytest.skip("native kernels unavailable here")
        monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "1")
    else:
        monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")
    return request.param


def problem(dtype, n=9, p=7, t=12, seed=0, spread=3.0):
    """Distances with well separated values (no ties, no hinge at 0) and random triplets."""
    g = torch.Generator().manual_seed(seed)
    dist = (spread * torch.rand(n, p, generator=g, dtype=torch.float64)).to(dtype)
    i, j, k = (torch.randint(n, (t,), generator=g) for _ in range(3))
    return dist, i, j, k


def key(value=123456789):
    return torch.tensor(value, dtype=torch.long)


def _op_args(dtype, noise, keep):
    dist, i, j, k = problem(dtype)
    return (dist.requires_grad_(keep), i, j, k, 0.5, 0.1, key() if noise else None, 5, keep)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", [False, True])
def test_opcheck_forward(path, dtype, noise):
    for keep in (True, False):
        torch.library.opcheck(OPS.hier_lca_rows.default, _op_args(dtype, noise, keep))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("noise", [False, True])
def test_opcheck_backward(path, dtype, noise):
    dist, i, j, k = problem(dtype)
    k_ = key() if noise else None
    _, a, b, grads, on = lca.triplet_rows(dist, i, j, k, 0.5, 0.1, lca._noise(k_, dist.device), 5, True)
    grad_loss = torch.linspace(-1.0, 2.0, i.numel(), dtype=dtype)
    for rows in ((grads.clone(), on.clone()), (None, None)):  # the forward's rows, or recomputed
        args = (grad_loss, dist, i, j, k, a, b, *rows, 0.5, 0.1, k_, 5)
        torch.library.opcheck(OPS.hier_lca_rows_backward.default, args)


def test_fake_shapes_without_running():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dist = torch.empty(11, 6, dtype=torch.float64)
        i = torch.empty(4, dtype=torch.long)
        loss, a, b = OPS.hier_lca_rows(dist, i, i, i, 0.5, 0.1, None, 3, False)
        grad = OPS.hier_lca_rows_backward(loss, dist, i, i, i, a, b, None, None, 0.5, 0.1, None, 3)
    assert loss.shape == (4,) and loss.dtype == torch.float64
    assert a.shape == b.shape == (4,) and a.dtype == b.dtype == torch.long
    assert grad.shape == (11, 6) and grad.dtype == torch.float64


@pytest.mark.parametrize("noise", [False, True])
def test_gradcheck_hard_path_float64(path, noise):
    """At a small τ the softmaxes are one-hot in float64 (gaps/τ in the thousands), the straight-through
    term vanishes, and the registered backward must be the exact derivative of the forward."""
    dist, i, j, k = problem(torch.float64)
    dist.requires_grad_(True)
    k_ = key(77) if noise else None

    def f(d):
        return lca.lca_triplet_loss(d, i, j, k, tau=1e-4, margin=0.1, key=k_, block=5)[0]

    assert f(dist).detach().abs().sum() > 0  # active hinges: a real gradient
    assert torch.autograd.gradcheck(f, (dist,), eps=1e-7, atol=1e-8)


def _textbook(dist, i, j, k, tau, margin, u1, u2):
    """HIER's per-op form: hard Gumbel-softmax one_hot + s − s.detach() over g = −log(−log U)."""
    di, dj, dk = dist[i], dist[j], dist[k]
    m1 = torch.maximum(di, dj)
    m2 = torch.maximum(m1, dk)

    def st(m, u):
        z = -m / tau if u is None else -m / tau - torch.log(-torch.log(u))
        s = torch.softmax(z, dim=1)
        return torch.nn.functional.one_hot(z.argmax(1), m.shape[1]).to(s.dtype) + s - s.detach()

    w1, w2 = st(m1, u1), st(m2, u2)
    dot = lambda d, w: (d * w).sum(1)  # noqa: E731
    return (torch.relu(dot(di, w1) - dot(di, w2) + margin) + torch.relu(dot(dj, w1) - dot(dj, w2) + margin)
            + torch.relu(dot(dk, w2) - dot(dk, w1) + margin))


@pytest.mark.parametrize("noise", [False, True])
def test_straight_through_gradient_equals_the_textbook_form(path, noise):
    """At a moderate τ (the softmaxes spread): the same losses and, to rounding, the same gradient as
    autograd over the textbook per-op estimator fed the same draws (the counter's, from the key)."""
    dist, i, j, k = problem(torch.float64, t=30, spread=0.4)
    tau, margin = 0.3, 0.05
    k_ = key(2024) if noise else None
    u1 = u2 = None
    if noise:
        streams = 2 * np.arange(i.numel(), dtype=np.uint64)
        u1 = lca.counter_uniform(2024, streams, dist.shape[1], torch.float64)
        u2 = lca.counter_uniform(2024, streams + np.uint64(1), dist.shape[1], torch.float64)
    c = torch.linspace(0.5, 1.5, i.numel(), dtype=torch.float64)
    mine = dist.clone().requires_grad_(True)
    loss = lca.lca_triplet_loss(mine, i, j, k, tau=tau, margin=margin, key=k_, block=7)[0]
    (got,) = torch.autograd.grad((loss * c).sum(), mine)
    ref = dist.clone().requires_grad_(True)
    want_loss = _textbook(ref, i, j, k, tau, margin, u1, u2)
    (want,) = torch.autograd.grad((want_loss * c).sum(), ref)
    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert got.abs().sum() > 0


@needs_native
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-13)])
@pytest.mark.parametrize("noise", [False, True])
def test_native_equals_the_torch_path(monkeypatch, dtype, tol, noise):
    """The native loops and the torch ops: the same choices, losses and gradients to rounding."""
    dist, i, j, k = problem(dtype, n=40, p=33, t=300, seed=5)
    dist[::6, 3:7] = dist[::6, 3:4]  # exact ties: the first-of-equal rule on both paths
    c = torch.rand(300, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    results = {}
    for native in ("1", "0"):
        monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", native)
        d = dist.clone().requires_grad_(True)
        loss, a, b = lca.lca_triplet_loss(d, i, j, k, tau=0.2, margin=0.1, key=key(99) if noise else None, block=64)
        (grad,) = torch.autograd.grad((loss * c).sum(), d)
        results[native] = (loss.detach(), a, b, grad)
    (l1, a1, b1, g1), (l0, a0, b0, g0) = results["1"], results["0"]
    assert torch.equal(a1, a0) and torch.equal(b1, b0)
    torch.testing.assert_close(l1, l0, rtol=0, atol=tol)
    assert (g1 - g0).abs().max() <= tol * g0.abs().max()
    assert g0.abs().sum() > 0


def test_the_chosen_path_runs(path):
    """The forward keeps u¹, u² (2, T, P) for the native scatter, the routed three rows on the torch path."""
    dist, i, j, k = problem(torch.float32)
    with torch.no_grad():  # (no autograd node takes them from the slot)
        OPS.hier_lca_rows(dist, i, j, k, 0.5, 0.1, key(), 5, True)
    rows = lca._slot.last[1]
    lca._slot.last = None
    assert rows.shape == ((2 if path == "native" else 3), 12, 7)


def test_deterministic_in_the_key_and_independent_of_the_block(path):
    dist, i, j, k = problem(torch.float32, n=20, p=15, t=200, seed=2, spread=0.3)
    run = lambda value, block: lca.lca_triplet_loss(dist, i, j, k, tau=0.5, margin=0.1, key=key(value),  # noqa: E731
                                                     block=block)
    first, again, blocked, other = run(5, 64), run(5, 64), run(5, 7), run(6, 64)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    for x, y in zip(first, blocked):  # CPU draws are keyed by row: the block size changes nothing
        assert torch.equal(x, y)
    assert not torch.equal(first[1], other[1])  # another key, other draws: other choices somewhere
    plain = lca.lca_triplet_loss(dist, i, j, k, tau=0.5, margin=0.1, key=None, block=64)
    m1 = torch.maximum(dist[i], dist[j])
    assert torch.equal(plain[1], m1.argmin(dim=1))  # no noise: the plain LCA, argmin of the maxima


@needs_native
def test_native_rows_give_the_same_bits_on_one_and_two_threads():
    # the forward's triplet rows and the backward's scatter split their rows over torch's threads:
    # the loss and the gradient may not change by a bit
    dist, i, j, k = problem(torch.float32, n=400, p=128, t=3000, seed=4, spread=0.5)
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            d = dist.clone().requires_grad_()
            loss, a, b = lca.lca_triplet_loss(d, i, j, k, tau=0.5, margin=0.1, key=key(), block=512)
            (loss * torch.linspace(0.5, 1.5, loss.numel())).sum().backward()
            results.append((loss.detach(), a, b, d.grad))
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_device_generator_source_is_keyed(monkeypatch):
    """Off the CPU the draws come from a generator of the device seeded with the key (exercised here
    with a CPU generator through the torch ops): the same key gives the same draws, losses and rows."""
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")
    dist, i, j, k = problem(torch.float64, n=20, p=15, t=200, seed=2, spread=0.3)

    def run(value):
        return lca.triplet_rows(dist, i, j, k, 0.5, 0.1, lca._DeviceUniform(value, dist.device), 64, True)

    first, again, other = run(5), run(5), run(6)
    for x, y in zip(first, again):
        assert torch.equal(x, y)
    assert not torch.equal(first[1], other[1])
    assert torch.equal(lca._DeviceUniform(5, dist.device).draws(0, 0, 3, 4, torch.float64, dist.device),
                       torch.rand(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5)))


def test_second_backward_recomputes_the_same_gradient(path):
    dist, i, j, k = problem(torch.float64, t=40, spread=0.4)
    dist.requires_grad_(True)
    loss = lca.lca_triplet_loss(dist, i, j, k, tau=0.3, margin=0.1, key=key(8), block=9)[0].sum()
    (first,) = torch.autograd.grad(loss, dist, retain_graph=True)  # the forward's rows
    (second,) = torch.autograd.grad(loss, dist)  # recomputed from the same key
    assert torch.equal(first, second)


def test_torch_compile_traces_the_op_without_graph_breaks(path):
    """AOTAutograd traces forward and backward (the backward op recomputes the rows there): the
    same values and gradients as eager."""
    dist, i, j, k = problem(torch.float64, t=40, spread=0.4)
    k_ = key(31)
    f = lambda d: lca.lca_triplet_loss(d, i, j, k, tau=0.3, margin=0.1, key=k_, block=9)[0].sum()  # noqa: E731
    traced, eager = dist.clone().requires_grad_(True), dist.clone().requires_grad_(True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    value = compiled(traced)
    value.backward()
    want = f(eager)
    want.backward()
    assert torch.equal(value.detach(), want.detach())
    torch.testing.assert_close(traced.grad, eager.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("bad", [-1, 9, 10 ** 8])
@pytest.mark.parametrize("name", ["i", "j", "k"])
def test_out_of_range_index_is_one_clear_error(path, bad, name):
    dist, i, j, k = problem(torch.float32)
    idx = {"i": i, "j": j, "k": k}
    idx[name] = idx[name].clone()
    idx[name][4] = bad
    with pytest.raises(ValueError, match=rf"^{name}: row indices must lie in \[0, 9\)"):
        lca.lca_triplet_loss(dist, idx["i"], idx["j"], idx["k"], tau=0.5, margin=0.1)
    with pytest.raises(ValueError, match=rf"^{name}: row indices"):
        OPS.hier_lca_rows_backward(torch.ones(12), dist, idx["i"], idx["j"], idx["k"], i, i, None, None, 0.5, 0.1,
                                   None, 5)


def test_wrong_shapes_and_dtypes_are_one_clear_error():
    dist, i, j, k = problem(torch.float32)
    call = lambda *a, **kw: lca.lca_triplet_loss(*a, **{"tau": 0.5, "margin": 0.1, **kw})  # noqa: E731
    with pytest.raises(TypeError, match="dist must be a floating-point tensor"):
        call(dist.long(), i, j, k)
    with pytest.raises(ValueError, match=r"dist must be \(N, P\)"):
        call(dist[0], i, j, k)
    with pytest.raises(TypeError, match=r"j must be an int64 index tensor.*\.long\(\)"):
        call(dist, i, j.int(), k)
    with pytest.raises(TypeError, match="k must be an int64"):
        call(dist, i, j, k.float())
    with pytest.raises(ValueError, match="i, j, k must be 1-D of one length"):
        call(dist, i, j[:5], k)
    with pytest.raises(ValueError, match="i, j, k must be 1-D of one length"):
        call(dist, i.view(3, 4), j.view(3, 4), k.view(3, 4))
    with pytest.raises(ValueError, match="tau must be a finite number > 0"):
        call(dist, i, j, k, tau=0.0)
    with pytest.raises(ValueError, match="margin must be finite"):
        call(dist, i, j, k, margin=float("nan"))
    with pytest.raises(TypeError, match="key must be None or a 0-d int64 tensor"):
        call(dist, i, j, k, key=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="block must be >= 1"):
        call(dist, i, j, k, block=0)
    _, a, b = call(dist, i, j, k)
    with pytest.raises(ValueError, match="grads and on must be given together"):
        OPS.hier_lca_rows_backward(torch.ones(12), dist, i, j, k, a, b, torch.zeros(2, 12, 7), None, 0.5, 0.1, None, 5)
    with pytest.raises(ValueError, match=r"grads must be \(2 or 3, T=12, P=7\)"):
        OPS.hier_lca_rows_backward(torch.ones(12), dist, i, j, k, a, b, torch.zeros(2, 12, 6), torch.zeros(3, 12),
                                   0.5, 0.1, None, 5)


def test_status_names_the_lca_path(monkeypatch):
    assert kernels.status()["hier_lca"] == kernels.status()["pairwise"]
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")
    st = kernels.status()
    assert st["hier_lca"] == "torch" and "PML_HYPERBOLIC_NATIVE=0" in st["reason"]


def test_no_triplets():
    dist = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    loss, a, b = lca.lca_triplet_loss(dist, none, none, none, tau=0.5, margin=0.1, key=key())
    assert loss.shape == a.shape == b.shape == (0,)
    (grad,) = torch.autograd.grad(loss.sum(), dist)
    assert torch.equal(grad, torch.zeros_like(dist))
