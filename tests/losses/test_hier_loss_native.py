"""HIER's LCA rows in the native library against the torch ops they replace (same formulas, same
Gumbel draws), at float32 and float64, with and without noise and gradients, on 1 and 2 threads."""
import os

import numpy as np
import pytest
import torch

from pml_hyperbolic.kernels import build, self_check
from pml_hyperbolic.kernels import native as _native
from pml_hyperbolic.losses import HIERLoss
from pml_hyperbolic.losses import hier_loss as H

pytestmark = pytest.mark.skipif(_native.status() != "native", reason="native library unavailable here")


def problem(dtype, n=120, p=70, t=400, seed=0):
    """Distances with exact ties in some rows (so that the first-of-equal rule is exercised)."""
    g = torch.Generator().manual_seed(seed)
    dist = (3 * torch.rand(n, p, generator=g, dtype=torch.float64)).to(dtype)
    dist[::7, 5:9] = dist[::7, 5:6]  # ties
    i, j, k = (torch.randint(n, (t,), generator=g) for _ in range(3))
    return dist, i, j, k


def run(path, dist, i, j, k, stochastic, need_grad, block=64, seed=11):
    previous = os.environ.get("PML_HYPERBOLIC_NATIVE")
    os.environ["PML_HYPERBOLIC_NATIVE"] = path
    try:
        noise = H._noise_source(dist.device, seed)[0] if stochastic else None
        loss, a, b, grads, on = H._lca.triplet_rows(dist, i, j, k, 0.2, 0.1, noise, block, need_grad)
        routed = None
        if grads is not None:  # the native path keeps u¹, u² (2, T, P), the torch path g_i, g_j, g_k
            assert grads.shape[0] == (2 if path == "1" else 3)
            routed = torch.stack(H._route_through_maxima(dist, i, j, k, grads)) if path == "1" else grads.clone()
        out = (loss.clone(), a.clone(), b.clone(), routed, None if on is None else on.clone())
        if grads is not None:
            H._SPARE_GRADS.give(grads)
        return out
    finally:
        if previous is None:
            os.environ.pop("PML_HYPERBOLIC_NATIVE", None)
        else:
            os.environ["PML_HYPERBOLIC_NATIVE"] = previous


@pytest.mark.parametrize("dtype,grad_tol", [(torch.float32, 2e-6), (torch.float64, 1e-14)])
@pytest.mark.parametrize("stochastic", [False, True])
def test_native_rows_match_the_torch_ops(dtype, grad_tol, stochastic):
    dist, i, j, k = problem(dtype)
    native = run("1", dist, i, j, k, stochastic, need_grad=True)
    torch_ops = run("0", dist, i, j, k, stochastic, need_grad=True)
    assert torch.equal(native[1], torch_ops[1]) and torch.equal(native[2], torch_ops[2])  # the same LCAs
    torch.testing.assert_close(native[0], torch_ops[0], rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-14)
    assert torch.equal(native[4], torch_ops[4])  # active hinges
    scale = torch_ops[3].abs().max()
    assert (native[3] - torch_ops[3]).abs().max() <= grad_tol * scale


def test_no_gradient_rows_and_thread_counts_agree():
    dist, i, j, k = problem(torch.float32, p=300, t=1000)
    full = run("1", dist, i, j, k, True, need_grad=True, block=512)
    loss_only = run("1", dist, i, j, k, True, need_grad=False, block=512)
    assert torch.equal(full[0], loss_only[0]) and torch.equal(full[1], loss_only[1])
    assert loss_only[3] is None and loss_only[4] is None
    noise = H._noise_source(dist.device, 11)[0]
    grads, on = torch.empty(2, 1000, 300), torch.empty(3, 1000)
    two = _native.lca_rows(dist, i, j, k, 0.2, 0.1, noise, 512, grads, on, threads=2)
    assert torch.equal(two[0], full[0]) and torch.equal(two[1], full[1])
    assert torch.equal(torch.stack(H._route_through_maxima(dist, i, j, k, grads)), full[3])
    assert _native.lca_rows(dist, i, j, k, 0.2, 0.1, noise, 512, torch.empty(3, 1000, 300), on) is None  # layout


def test_hier_loss_training_step_equals_the_torch_path():
    """The whole loss (batch and proxy terms, checkpointed chunks) through both paths: the same
    value and, to rounding, the same gradients for the embeddings and the proxies."""
    results = {}
    for path in ("1", "0"):
        os.environ["PML_HYPERBOLIC_NATIVE"] = path
        try:
            torch.manual_seed(0)
            loss = HIERLoss(embedding_size=16, num_proxies=40, max_triplets=3000, max_proxy_triplets=500,
                            chunk_size=1024)
            x = (0.3 * torch.randn(64, 16)).requires_grad_()
            value = loss(x, torch.arange(64) // 4)
            value.backward()
            results[path] = (value.detach(), x.grad.clone(), loss.proxies.grad.clone())
        finally:
            os.environ.pop("PML_HYPERBOLIC_NATIVE", None)
    (v1, gx1, gp1), (v0, gx0, gp0) = results["1"], results["0"]
    torch.testing.assert_close(v1, v0, rtol=1e-6, atol=0)
    torch.testing.assert_close(gx1, gx0, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(gp1, gp0, rtol=1e-4, atol=1e-6)


def test_not_applicable_returns_none_and_draws_nothing():
    dist, i, j, k = problem(torch.float32)
    drawn = []

    class RecordingSource:  # not counter-based: the native loop cannot generate its draws
        def draws(self, *args):
            drawn.append(1)
            return torch.rand(args[1] - args[0], args[2])

    noise = H._noise_source(dist.device, 3)[0]
    assert _native.lca_rows(dist[:, ::2], i, j, k, 0.2, 0.1, noise, 64, None, None) is None  # not contiguous
    assert _native.lca_rows(dist, i.int(), j.int(), k.int(), 0.2, 0.1, noise, 64, None, None) is None
    assert _native.lca_rows(dist, i, j, k, 0.2, 0.1, RecordingSource(), 64, None, None) is None
    assert not drawn


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_counter_draws_equal_the_native_loop_bit_for_bit(dtype):
    """The numpy form of the counter-based draws (torch path) equals the C one, for keys and
    streams of the full 64-bit range and a row length past the vector width."""
    for key, first in ((0, 0), (12345678901234, 7), (2 ** 62 - 1, 2 ** 40), (2 ** 64 - 1, 2 ** 63)):
        native = _native.uniform_rows(key, first, 37, 301, dtype)
        numpy_form = H.counter_uniform(key, np.arange(37, dtype=np.uint64) + np.uint64(first), 301, dtype)
        assert native.dtype == numpy_form.dtype == dtype
        assert torch.equal(native, numpy_form)


def test_counter_draws_reference_values():
    """Three draws against literal values, U = m / 2**24, from the formula in ``counter_uniform``'s
    docstring; the generating snippet (plain Python integers, no library code) runs beside them."""
    def mix32(x):
        x ^= x >> 16
        x = x * 0x7FEB352D % 2 ** 32
        x ^= x >> 15
        x = x * 0x846CA68B % 2 ** 32
        return x ^ (x >> 16)

    def by_hand(key, stream, q):
        m = 2 ** 64
        z = (key + (stream + 1) * 0x9E3779B97F4A7C15) % m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % m
        z ^= z >> 31
        return mix32(mix32((q + z) % 2 ** 32) ^ (z >> 32)) >> 8

    for key, stream, q, mantissa in ((5, 0, 0, 1776955), (2 ** 61 + 3, 9, 300, 6500246), (123, 2 ** 33, 17, 8820676)):
        assert by_hand(key, stream, q) == mantissa
        got = H.counter_uniform(key, np.array([stream], dtype=np.uint64), q + 1, torch.float32)[0, q]
        assert float(got) == mantissa / 2 ** 24


def test_counter_draws_are_uniform_and_uncorrelated():
    """Kolmogorov–Smirnov against U[0, 1) over 200,000 draws of 400 streams; lag-1 correlation along
    a row and between neighbouring streams (rows) near 0."""
    from scipy import stats

    u = H.counter_uniform(987654321, np.arange(400, dtype=np.uint64), 500, torch.float64).numpy()
    assert stats.kstest(u.ravel(), "uniform").pvalue > 1e-3
    assert 0 <= u.min() and u.max() < 1
    for a, b in ((u[:, :-1], u[:, 1:]), (u[:-1], u[1:]), (u[::2], u[1::2])):
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 0.01  # s.e. ≈ 0.0022
    assert len(np.unique(u[0])) == 500  # a row's draws are distinct (bijective hash of the position)


def test_gumbel_choice_frequencies_follow_the_softmax():
    """Gumbel-max through the native loop: over 40,000 rows of one (D_i, D_j, D_k) triple, LCA(i, j)
    is proxy p with probability softmax(−max(D_i, D_j)/τ)_p (chi-square test)."""
    from scipy import stats

    g = torch.Generator().manual_seed(4)
    p, rows = 9, 40000
    dist = (0.3 * torch.rand(3, p, generator=g, dtype=torch.float64)).float()
    i, j, k = torch.zeros(rows, dtype=torch.long), torch.ones(rows, dtype=torch.long), torch.full((rows,), 2)
    noise = H._noise_source(dist.device, 77)[0]
    _, a, b = _native.lca_rows(dist, i, j, k, 0.2, 0.1, noise, 4096, None, None)
    for choice, m in ((a, torch.maximum(dist[0], dist[1])), (b, dist.max(dim=0).values)):
        expected = torch.softmax(-m.double() / 0.2, dim=0).numpy() * rows
        observed = np.bincount(choice.numpy(), minlength=p)
        assert stats.chisquare(observed, expected).pvalue > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lca_backward_equals_routing_then_index_add(dtype):
    """The native backward against the torch ops it replaces: route u¹, u² through the maxima, then
    ``grad.index_add_(0, idx, g * scale[:, None])`` for i, j, k. Bit for bit when every target row is
    hit once (rows 3t, 3t+1, 3t+2); to rounding with repeated rows (the order of the additions differs)."""
    g = torch.Generator().manual_seed(3)
    n, p = 300, 53  # 53: a remainder after the vector width
    dist = (3 * torch.rand(n, p, generator=g, dtype=torch.float64)).to(dtype)
    dist[::5, 7:11] = dist[::5, 7:8]  # ties of D_i and D_j within a row
    for rows, distinct in ((100, True), (2000, False)):
        if distinct:
            i, j, k = torch.arange(0, 300, 3), torch.arange(1, 300, 3), torch.arange(2, 300, 3)
            dist[i[::4]] = dist[j[::4]]  # D_i = D_j exactly in a quarter of the rows: the tie goes to i
        else:
            i, j, k = (torch.randint(0, n, (rows,), generator=g) for _ in range(3))
        u = torch.randn(2, rows, p, generator=g, dtype=dtype)
        scale = torch.randn(rows, generator=g, dtype=dtype)
        base = torch.randn(n, p, generator=g, dtype=dtype)
        expected = base.clone()
        for part, index in zip(H._route_through_maxima(dist, i, j, k, u), (i, j, k)):
            expected.index_add_(0, index, part * scale[:, None])
        got = base.clone()
        assert _native.lca_backward(got, dist, i, j, k, u, scale, threads=1)
        for threads in (2, 3):  # disjoint ranges of grad's rows: the same additions in the same order
            split = base.clone()
            assert _native.lca_backward(split, dist, i, j, k, u, scale, threads=threads)
            assert torch.equal(split, got)
        if distinct:
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-13)


def test_lca_backward_bad_input():
    dist, u, scale = torch.rand(4, 3), torch.ones(2, 5, 3), torch.ones(5)
    ok = torch.zeros(5, dtype=torch.long)
    grad = torch.zeros(4, 3)
    with pytest.raises(IndexError, match="out of range"):
        _native.lca_backward(grad, dist, ok, torch.tensor([0, 1, 2, 3, 4]), ok, u, scale)
    with pytest.raises(IndexError, match="out of range"):
        _native.lca_backward(grad, dist, ok, ok, torch.tensor([0, 1, -1, 3, 0]), u, scale)
    assert not _native.lca_backward(grad.double(), dist, ok, ok, ok, u, scale)  # dtypes
    assert not _native.lca_backward(grad, dist, ok, ok, ok, torch.ones(3, 5, 3), scale)  # layout
    assert not _native.lca_backward(grad, dist, ok, ok, ok.int(), u, scale)
    assert not _native.lca_backward(grad, dist, ok, ok, ok[:4], u, scale)
    assert torch.equal(grad, torch.zeros(4, 3))  # nothing written by the refusals


def test_hier_backward_native_equals_the_torch_routing(monkeypatch):
    """HIERLoss's gradients with the native backward equal, to rounding, those of the torch routing and
    scatter it replaces (the order of the additions into repeated rows differs)."""
    torch.manual_seed(0)
    emb = torch.randn(60, 16) * 0.1
    labels = torch.arange(60) // 4
    grads = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(_native, "lca_backward", lambda *args: False)
        loss = HIERLoss(embedding_size=16, num_proxies=24)
        torch.manual_seed(1)
        loss.proxies.data = torch.randn(24, 16) * 0.1
        x = emb.clone().requires_grad_()
        torch.manual_seed(2)
        (0.7 * loss(x, labels)).backward()
        grads.append((x.grad.clone(), loss.proxies.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)
    assert grads[0][0].abs().sum() > 0  # (a real gradient)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [-1, 120, 10 ** 8])
def test_out_of_range_rows_are_refused_before_any_read(dtype, bad):
    dist, i, j, k = problem(dtype, t=40)
    k = k.clone()
    k[17] = bad
    u = torch.full((2, 40, dist.shape[1]), float("nan"), dtype=dtype)
    on = torch.full((3, 40), float("nan"), dtype=dtype)
    with pytest.raises(IndexError):
        _native.lca_rows(dist, i, j, k, 0.2, 0.1, None, 64, u, on)
    with pytest.raises(IndexError):
        _native.lca_backward(torch.zeros_like(dist), dist, i, j, k, u, torch.ones(40, dtype=dtype))
    # the C loops check too (defence in depth): -1 and nothing written
    lib = build.library()
    loss = torch.full((40,), float("nan"), dtype=dtype)
    a, b = torch.full((40,), -7, dtype=torch.long), torch.full((40,), -7, dtype=torch.long)
    work = torch.empty(1, 2 * dist.shape[1], dtype=dtype)
    code = lib._native_lca_rows_(dist, i, j, k, 5.0, 0.1, False, 0, loss, a, b, u, on, work, [0, 40])
    assert code == -1 and loss.isnan().all() and (a == -7).all() and u.isnan().all() and on.isnan().all()
    grad = torch.zeros_like(dist)
    code = lib._native_lca_backward_(grad, dist, i, j, k, u, torch.ones(40, dtype=dtype), [0, dist.shape[0]])
    assert code == -1 and (grad == 0).all()


def test_self_check_draws_are_counter_uniform_values():
    # the library's load-time check compares pml_uniform_rows_* with literals: they must be the
    # values of the formula the torch path evaluates
    for name, dtype in (("f32", torch.float32), ("f64", torch.float64)):
        literal = [[float.fromhex(v) for v in row] for row in self_check._UNIFORM_REFERENCE[name]]
        assert torch.equal(H.counter_uniform(987654321, np.arange(4, 7), 4, dtype), torch.tensor(literal, dtype=dtype))
