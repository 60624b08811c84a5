"""The native symmetric path of the pairwise kernel (x is y on CPU): triangular Gram product, one
evaluation per unordered pair, mirrored; backward weights (U + Uᵀ)/S in one pass.

Every result is compared with the general path of the same kernel (``PML_HYPERBOLIC_NATIVE=0``:
full Gram product and torch tail), itself checked against float64 references in
``test_pairwise.py``."""
from __future__ import annotations

import math

import pytest
import torch

from pml_hyperbolic.kernels import native as _native
from pml_hyperbolic.kernels import pairwise as kernel
from pml_hyperbolic.kernels import gram, tail
from pml_hyperbolic import poincare_ball as pb
from tests.kernels import torch_threads

pytestmark = pytest.mark.skipif(_native.status() != "native", reason="native library unavailable here")


def radial_points(n: int, dim: int, c: float, d0_max: float, seed: int, dtype=torch.float32) -> torch.Tensor:
    """n points with hyperbolic distance to the origin uniform in [0, d0_max], random directions."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, dim, generator=g, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = d0_max * torch.rand(n, generator=g, dtype=torch.float64)
    return (v * (torch.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c))[:, None]).to(dtype)


def both_paths(monkeypatch, x: torch.Tensor, c: float, upstream=None):
    """(D, x.grad, c.grad) from the native symmetric path and from the general path."""
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", flag)
        xi = x.detach().clone().requires_grad_()
        ci = torch.tensor(c, dtype=x.dtype, requires_grad=True)
        d = pb.pairwise_dist(xi, xi, ci)
        (d.sum() if upstream is None else (d * upstream).sum()).backward()
        out.append((d.detach(), xi.grad, ci.grad))
    return out


def test_symmetric_path_runs(monkeypatch):
    calls = []
    real = kernel._symmetric_forward
    monkeypatch.setattr(kernel, "_symmetric_forward", lambda *a: calls.append(real(*a)) or calls[-1])
    x = radial_points(50, 8, 0.1, 2.5, 0)
    d = pb.pairwise_dist(x, x, 0.1)
    assert calls and calls[0] is not None
    assert torch.equal(d, d.T) and torch.all(d.diagonal() == 0)


@pytest.mark.parametrize("n", [2, 15, 16, 17, 100, 257, 600])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_general_path(monkeypatch, n, dtype):
    """Sizes around the band (16 rows) and chunk (256 columns) edges; dense random upstream."""
    c = 0.1
    x = radial_points(n, 24, c, 4.0, n, dtype)
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(n, n, generator=g, dtype=dtype)
    (d_sym, gx_sym, gc_sym), (d_gen, gx_gen, gc_gen) = both_paths(monkeypatch, x, c, upstream)
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    assert torch.equal(d_sym, d_sym.T)
    torch.testing.assert_close(d_sym, d_gen, rtol=rel, atol=rel)
    scale = gx_gen.abs().max()
    torch.testing.assert_close(gx_sym / scale, gx_gen / scale, rtol=0, atol=10 * rel)
    torch.testing.assert_close(gc_sym, gc_gen, rtol=10 * rel, atol=0)


@pytest.mark.parametrize("case", ["origin", "boundary", "duplicates"])
def test_matches_general_path_on_hard_points(monkeypatch, case):
    """Points at the origin (W = 0, S = 0), near project's edge, and a few exact and near duplicates
    (close pairs: recomputed explicitly, below the 1/16 fraction that sends float32 to the general
    path's float64 redo)."""
    c = 0.5
    x = radial_points(120, 16, c, 3.0, 7).double()
    if case == "origin":
        x[:7] = 0
    elif case == "boundary":
        x = pb.project(x / x.norm(dim=1, keepdim=True), c)
    else:
        x[10:14] = x[0]
        x[20] = x[1] * (1 + 1e-6)
    x = x.float()
    (d_sym, gx_sym, gc_sym), (d_gen, gx_gen, gc_gen) = both_paths(monkeypatch, x, c)
    torch.testing.assert_close(d_sym, d_gen, rtol=2e-5, atol=2e-5)
    assert torch.isfinite(gx_sym).all() and torch.isfinite(gc_sym)
    scale = gx_gen.abs().max()
    torch.testing.assert_close(gx_sym / scale, gx_gen / scale, rtol=0, atol=1e-4)
    torch.testing.assert_close(gc_sym, gc_gen, rtol=1e-4, atol=0)


def test_collapsed_batch_falls_back(monkeypatch):
    """More than 1/16 of the pairs close (float32): the symmetric path declines, the general path
    redoes the product in float64."""
    dtypes = []
    real = kernel._gram_W
    monkeypatch.setattr(kernel, "_gram_W", lambda *a: dtypes.append(a[-1]) or real(*a))
    x = radial_points(1, 16, 1.0, 2.0, 0).double()
    g = torch.Generator().manual_seed(1)
    x = (x + 3e-3 * torch.randn(64, 16, generator=g, dtype=torch.float64)).float()
    assert kernel._symmetric_forward(x, *gram._row_terms(x, 1.0), 1.0, True) is None
    pb.pairwise_dist(x, x, 1.0)
    assert dtypes == [torch.float32, torch.float64]


def test_thread_count_does_not_change_results(monkeypatch):
    """Each pair is evaluated by the same code whatever the band split: bit-identical."""
    x = radial_points(700, 32, 0.1, 2.5, 3)
    c = torch.tensor(0.1)
    x2, inv_a = gram._row_terms(x, 0.1)
    outs = []
    for threads in (1, 2, 3):
        G = torch.empty(700, 700)
        block = tail._symmetric_block_rows(700, 1)
        for start in range(0, 700, block):
            torch.mm(x[start:start + block], x[start:].T, out=G[start:start + block, start:])
        S = torch.empty_like(G)
        n_close = _native.symmetric_distance_tail(G, S, x2.float(), (0.2 * inv_a).float(), inv_a.float(),
                                                  1 / math.sqrt(0.1), 0.07, threads)
        assert n_close == 0
        U = torch.randn(700, 700, generator=torch.Generator().manual_seed(0))
        E = S.clone()
        assert _native.symmetric_gradient_weights(U, E, threads)
        outs.append((G, S, E))
    for G, S, E in outs[1:]:
        # (S is written on and above the diagonal only)
        assert torch.equal(G, outs[0][0]) and torch.equal(S.triu(), outs[0][1].triu()) and torch.equal(E, outs[0][2])
    del c


def test_gradient_weights_reference():
    """E = U/S + (U/S)ᵀ off the diagonal, 0 on it; a broadcast U (``D.sum().backward()``) too."""
    n = 37
    g = torch.Generator().manual_seed(2)
    A = torch.rand(n, n, generator=g, dtype=torch.float64) + 0.5
    S = A + A.T
    U = torch.randn(n, n, generator=g, dtype=torch.float64)
    expected = (U + U.T) / S  # = U/S + (U/S)ᵀ as S is symmetric, in the kernel's rounding order
    expected.fill_diagonal_(0)
    E = S.clone()
    assert _native.symmetric_gradient_weights(U, E)
    assert torch.equal(E, expected)
    E = S.clone()
    assert _native.symmetric_gradient_weights(torch.ones(()).double().expand(n, n), E)
    assert torch.equal(E, (2 / S).fill_diagonal_(0))


def test_declines_what_it_cannot_do():
    G = torch.zeros(4, 4)
    v = torch.zeros(4)
    assert _native.symmetric_distance_tail(G.double(), None, v, v, v, 1.0, 0.1) is None  # mixed dtypes
    assert _native.symmetric_distance_tail(torch.zeros(4, 5), None, v, v, v, 1.0, 0.1) is None  # not square
    assert _native.symmetric_distance_tail(G.T.contiguous()[:, :3], None, v[:3], v[:3], v[:3], 1.0, 0.1) is None
    assert not _native.symmetric_gradient_weights(torch.zeros(4, 4).half(), torch.zeros(4, 4).half())
    assert not _native.symmetric_gradient_weights(torch.zeros(3, 3), G)


def test_nan_point_gives_nan_row():
    x = radial_points(20, 8, 0.1, 2.0, 0)
    x[3] = float("nan")
    d = pb.pairwise_dist(x, x, 0.1)
    assert torch.isnan(d[3]).all() and torch.isnan(d[:, 3]).all()
    mask = torch.ones(20, dtype=torch.bool)
    mask[3] = False
    assert torch.isfinite(d[mask][:, mask]).all()


def test_float64_gradcheck_through_symmetric_path():
    x = radial_points(12, 5, 0.3, 2.0, 4, torch.float64).requires_grad_()
    c = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, cc: pb.pairwise_dist(a, a, cc), (x, c))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_row_terms_match_torch(dtype):
    """The native float64 row terms against x.double() and vecdot: NaN rows stay NaN, points on or
    outside the boundary get the floor."""
    c = 0.7
    x = radial_points(50, 37, c, 5.0, 0, dtype)  # 37: the 8-wide partial sums plus a remainder
    x[3] = float("nan")
    x[4] = 2.0 / math.sqrt(c * 37)  # outside the ball
    x[5] = 0
    x2, inv_a = _native.row_terms(x, c, gram.DENOM_FLOOR)
    xd = x.double()
    x2_ref = torch.linalg.vecdot(xd, xd)
    # (from the native x2: near the boundary 1/a amplifies x2's last-bit differences of summation order)
    inv_ref = (1.0 - c * x2).clamp_min(gram.DENOM_FLOOR).reciprocal()
    torch.testing.assert_close(x2, x2_ref, rtol=1e-15, atol=0, equal_nan=True)
    torch.testing.assert_close(inv_a, inv_ref, rtol=1e-15, atol=0, equal_nan=True)
    assert torch.isnan(inv_a[3]) and inv_a[4] == 2.0 ** 60 and x2[5] == 0 and inv_a[5] == 1
    assert _native.row_terms(x.T, c, gram.DENOM_FLOOR) is None  # not contiguous: the torch path


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_native_row_terms_extras_match_the_torch_ops(dtype):
    """With ``extreme=``: the tail's row vectors equal the torch expressions they replace, bit for
    bit, and the two flags equal ``(x2 != 0).any()`` and ``_extreme_points(...) is not None``."""
    c = 0.7
    bound = (1.0 / gram._EXTREME_A[dtype], gram._TINY_SQ_NORM[dtype])
    x = radial_points(40, 19, c, 5.0, 1, dtype)
    x2, inv_a, vectors, any_nonzero, any_extreme = _native.row_terms(x, c, gram.DENOM_FLOOR, extreme=bound)
    assert torch.equal(torch.stack([x2, inv_a]), torch.stack(_native.row_terms(x, c, gram.DENOM_FLOOR)))
    expected = (x2.to(dtype), ((2.0 * c) * inv_a).to(dtype), inv_a.to(dtype))
    assert all(v.dtype == dtype and torch.equal(v, e) for v, e in zip(vectors, expected))
    assert any_nonzero and not any_extreme
    cases = {"all at the origin": (lambda z: z.zero_(), False, False),
             "one NaN row, rest at the origin": (lambda z: z.zero_().index_fill_(0, torch.tensor([3]), float("nan")),
                                                 True, False),
             "a point outside the ball": (lambda z: z[4].fill_(2.0 / math.sqrt(c * 19)), True, True),
             "a tiny nonzero point": (lambda z: z[5].zero_().index_fill_(0, torch.tensor([0]), 1e-20 if dtype ==
                                                                                 torch.float32 else 1e-150), True, True)}
    for name, (edit, nonzero, extreme) in cases.items():
        y = x.clone()
        edit(y)
        y2, inv_b, _, any_nonzero, any_extreme = _native.row_terms(y, c, gram.DENOM_FLOOR, extreme=bound)
        assert any_nonzero == bool((y2 != 0).any()) == nonzero, name
        assert any_extreme == (gram._extreme_points(y2, inv_b, dtype) is not None) == extreme, name


@pytest.mark.parametrize("flag", ["1", "0"])
def test_same_data_distinct_tensors(monkeypatch, flag):
    """x and x.detach() share their data (the symmetric forward runs) but only x wants a gradient:
    the backward takes the general route and needs S below the diagonal too (mirrored first).
    Against the closed form of the one-sided gradient computed through two distinct tensors."""
    monkeypatch.setenv("PML_HYPERBOLIC_SYMMETRIC", flag)
    x = radial_points(70, 12, 0.2, 3.0, 5)
    U = torch.randn(70, 70, generator=torch.Generator().manual_seed(3))
    a = x.clone().requires_grad_()
    (pb.pairwise_dist(a, a.detach(), 0.2) * U).sum().backward()
    b = x.clone().requires_grad_()
    (pb.pairwise_dist(b, x.clone(), 0.2) * U).sum().backward()  # distinct data: general path
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


def test_mirror_upper():
    M = torch.arange(16.0).view(4, 4)
    out = tail._mirror_upper_(M.clone())
    assert torch.equal(out, torch.triu(M) + torch.triu(M, 1).T)


@pytest.mark.parametrize("threads", [1, 2])
def test_tail_by_row_blocks_equals_one_call(threads):
    """The tail run per Gram block (``rows=``) gives the matrix of one call, bit for bit."""
    n = 300
    x = radial_points(n, 16, 0.1, 2.5, 8)
    x2, inv_a = gram._row_terms(x, 0.1)
    vectors = (x2.float(), (0.2 * inv_a).float(), inv_a.float())
    G = x @ x.T
    whole, blocks = G.clone(), G.clone()
    assert _native.symmetric_distance_tail(whole, None, *vectors, 1 / math.sqrt(0.1), 0.07, threads) == 0
    for start in range(0, n, 64):
        assert _native.symmetric_distance_tail(blocks, None, *vectors, 1 / math.sqrt(0.1), 0.07, threads,
                                               rows=(start, min(n, start + 64))) == 0
    assert torch.equal(whole, blocks)
    for bad in ((8, 64), (0, 40), (64, 32), (0, 400)):
        with pytest.raises(ValueError, match="band-aligned"):
            _native.symmetric_distance_tail(G.clone(), None, *vectors, 1.0, 0.07, threads, rows=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, splits", [(1, ()), (17, (16,)), (129, (16, 48)), (300, (128, 256)), (301, (144,))])
def test_mirror_fills_every_lower_entry(n, splits, dtype):
    """The mirror (16 × 16 blocks by column tiles of groups of up to 128 rows, element by element
    at the edges) writes every entry below the diagonal exactly once from its transpose, for sizes
    and row ranges around the 16-row slices and 128-row groups; the lower triangle starts as NaN."""
    x = radial_points(n, 8, 0.1, 2.5, 4).to(dtype)
    x2, inv_a = gram._row_terms(x, 0.1)
    vectors = (x2.to(dtype), (0.2 * inv_a).to(dtype), inv_a.to(dtype))
    G = torch.triu(x @ x.T) + torch.full((n, n), float("nan"), dtype=dtype).tril(-1)
    bounds = (0, *splits, n)
    for begin, end in zip(bounds[:-1], bounds[1:]):
        # (a tiny closeness factor: no pair is handed back for explicit recomputation)
        assert _native.symmetric_distance_tail(G, None, *vectors, 1 / math.sqrt(0.1), 1e-9, 1, rows=(begin, end)) == 0
    assert not torch.isnan(G).any() and torch.equal(G, G.T)
    ref = pb.pairwise_dist(x.double(), x.double().clone(), 0.1)
    torch.testing.assert_close(G.double(), ref, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=1e-6)


def test_two_threads_match_one(monkeypatch):
    """With 2 torch threads the symmetric forward runs all products first, then one tail split
    over the threads (and the backward's weights too): the same matrix and gradient within the
    products' rounding (the GEMM's blocking may differ with the thread count)."""
    x = radial_points(600, 32, 0.1, 2.5, 11)
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            xi = x.clone().requires_grad_()
            d = pb.pairwise_dist(xi, xi, 0.1)
            (d * d).sum().backward()
            results.append((d.detach(), xi.grad))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-4, atol=1e-4)


def test_non_contiguous_and_float64_duplicates(monkeypatch):
    """A strided view (row terms then come from torch) and a float64 batch with many exact duplicates
    (float64 has no fallback fraction: every close pair is recomputed explicitly)."""
    x = radial_points(400, 24, 0.1, 2.5, 12)[::2]
    assert not x.is_contiguous()
    (d_sym, gx_sym, _), (d_gen, gx_gen, _) = both_paths(monkeypatch, x, 0.1)
    torch.testing.assert_close(d_sym, d_gen, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx_sym, gx_gen, rtol=1e-4, atol=1e-4)
    y = radial_points(60, 8, 0.5, 2.0, 13, torch.float64)
    y[20:40] = y[0]
    (d_sym, gx_sym, gc_sym), (d_gen, gx_gen, gc_gen) = both_paths(monkeypatch, y, 0.5)
    assert torch.all(d_sym[0, 20:40] == 0) and torch.all(d_sym[20:40, 20:40] == 0)
    torch.testing.assert_close(d_sym, d_gen, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gx_sym, gx_gen, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gc_sym, gc_gen, rtol=1e-10, atol=0)
