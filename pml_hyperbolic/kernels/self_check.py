"""The self-check of the compiled kernels: every native operator, in float32 and float64, on small
inputs against float64 torch references, before the native path is used.

Why: a miscompiled, damaged or foreign build must never produce numbers; a build that fails this
check is discarded and the torch path runs (:mod:`pml_hyperbolic.kernels.build`). Outputs start as
NaN, so a kernel that writes nothing fails too.

Design note: docs/design/native-code.md
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

# Rows per band of the symmetric loops (PML_SYM_ROWS in csrc/kernels.c).
_SYM_TILE = 16


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


def self_check(lib) -> None:
    """Every exported kernel, in both dtypes, on a few small inputs against float64 torch
    references (a miscompiled, altered or foreign library must not produce numbers): RuntimeError
    naming the first kernel that disagrees. Outputs start as NaN, so a kernel that writes nothing
    fails too."""
    for dtype, tol in ((torch.float32, 2e-5), (torch.float64, 1e-12)):
        name = "f32" if dtype == torch.float32 else "f64"
        for kernel, check in (("tail", _check_tail), ("log1p", _check_log1p), ("row_terms", _check_row_terms),
                              ("sym_tail", _check_sym_tail), ("gen_tail", _check_gen_tail),
                              ("sym_grad", _check_sym_grad),
                              ("uniform_rows", _check_uniform_rows), ("lca_rows", _check_lca_rows),
                              ("lca_backward", _check_lca_backward)):
            if not check(lib, dtype, tol):
                raise RuntimeError(f"self-check failed: the native {kernel} kernel ({name}) disagrees with the "
                                   "torch reference")


def _sample(shape, seed: int, scale: float = 1.0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=generator, dtype=torch.float64) * scale


def _check_tail(lib, dtype, tol) -> bool:
    P = torch.tensor([[0.0, 1e-30, 1e-7, 0.01, 0.3, 1.0, 7.0, 1e4, 1e12, float("inf")]], dtype=torch.float64)
    q = torch.linspace(1.0, 3.0, P.shape[1], dtype=torch.float64)
    W = P * q
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(0.1)
    Pn, Sn, qn = P.to(dtype), torch.full(P.shape, math.nan, dtype=dtype), q.to(dtype)
    lib._native_tail_(Pn, Sn, qn, 1.0 / math.sqrt(0.1), [0, 1])
    finite = torch.isfinite(D_ref)
    return _close(Pn, D_ref, tol) and _close(Sn[finite], S_ref[finite], tol)


def _check_log1p(lib, dtype, tol) -> bool:
    u = torch.tensor([0.0, 1e-30, 1e-7, 0.01, 0.3, 1.0, 7.0, 1e4, 1e12], dtype=dtype)
    out = torch.full_like(u, math.nan)
    lib._native_log1p(u, out)
    return _close(out, torch.log1p(u.double()), tol)


def _check_row_terms(lib, dtype, tol) -> bool:
    x = (_sample((3, 11), 1) - 0.5).to(dtype)
    c, floor = 0.7, 1e-3
    x2_ref = (x.double() ** 2).sum(1)
    inv_ref = 1.0 / (1.0 - c * x2_ref).clamp_min(floor)
    x2, inv_a, vectors, *counts = lib._native_row_terms(x, c, floor, float(inv_ref.max()) - 1e-9, 0.0, True)
    vectors_ref = torch.stack([x2_ref, 2 * c * inv_ref, inv_ref])
    return (_close(x2, x2_ref, 1e-12) and _close(inv_a, inv_ref, 1e-12) and _close(vectors, vectors_ref, tol)
            and tuple(counts) == (3, 1))


def _check_sym_tail(lib, dtype, tol) -> bool:
    n, c = 2 * _SYM_TILE + 3, 0.5  # three bands, the last one partial
    x = ((_sample((n, 3), 2) - 0.5) * 1.5).to(dtype)
    x[5] = x[3]  # one coincident pair: marked -1 (both orientations), counted twice
    x2 = (x.double() ** 2).sum(1)
    G = x.double() @ x.double().T
    p2, q = 2 * c / (1 - c * x2), 1 / (1 - c * x2)
    x2n, p2n, qn = x2.to(dtype), p2.to(dtype), q.to(dtype)
    Gn = G.to(dtype).triu()
    Sn = torch.full((n, n), math.nan, dtype=dtype)
    count = lib._native_sym_tail_(Gn, Sn, x2n, p2n, qn, 1.0 / math.sqrt(c), 1e-3, [0, -(-n // _SYM_TILE)])
    sq = x2n.double().view(-1, 1) + x2n.double().view(1, -1) - 2 * G.to(dtype).double()
    W = sq * p2n.double().view(-1, 1) * qn.double().view(1, -1)
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(c)
    D_ref = D_ref.triu(1) + D_ref.triu(1).T
    D_ref[3, 5] = D_ref[5, 3] = -1.0
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    upper[3, 5] = False
    return (count == 2 and _close(Gn, D_ref, tol) and _close(Sn[upper], S_ref[upper], tol)
            and bool((Sn.diagonal() == 0).all()))


def _check_gen_tail(lib, dtype, tol) -> bool:
    n, m, c = 7, 5, 0.5
    x = ((_sample((n, 3), 4) - 0.5) * 1.5).to(dtype)
    y = ((_sample((m, 3), 5) - 0.5) * 1.5).to(dtype)
    y[2] = x[4]  # one coincident pair: marked -1, counted once
    x2, y2 = (x.double() ** 2).sum(1), (y.double() ** 2).sum(1)
    G = x.double() @ y.double().T
    p2, q = 2 * c / (1 - c * x2), 1 / (1 - c * y2)
    x2n, p2n, y2n, qn = x2.to(dtype), p2.to(dtype), y2.to(dtype), q.to(dtype)
    Gn = G.to(dtype, copy=True)  # (float64: not G itself, which the reference reads below)
    Sn = torch.full((n, m), math.nan, dtype=dtype)
    count = lib._native_gen_tail_(Gn, Sn, x2n, p2n, y2n, qn, 1.0 / math.sqrt(c), 1e-3, [0, 3, n])
    sq = x2n.double().view(-1, 1) + y2n.double().view(1, -1) - 2 * G.to(dtype).double()
    W = sq * p2n.double().view(-1, 1) * qn.double().view(1, -1)
    S_ref = torch.sqrt(W + W * W / 2)
    D_ref = torch.log1p(W + math.sqrt(2.0) * S_ref) / math.sqrt(c)
    D_ref[4, 2] = -1.0
    regular = torch.ones(n, m, dtype=torch.bool)
    regular[4, 2] = False
    return count == 1 and _close(Gn, D_ref, tol) and _close(Sn[regular], S_ref[regular], tol)


def _check_sym_grad(lib, dtype, tol) -> bool:
    n = _SYM_TILE + 5
    U = (_sample((n, n), 3) - 0.5).to(dtype)
    S = (_sample((n, n), 4) + 0.5).to(dtype).triu()
    E_ref = ((U.double() + U.double().T) / S.double()).triu(1)
    E_ref = E_ref + E_ref.T
    lib._native_sym_grad_(U, S, [0, -(-n // _SYM_TILE)])
    return _close(S, E_ref, tol)


# Draws 0-3 of streams 4-6 under key 987654321 (kernels.lca.counter_uniform's formula; kept as
# literals so that checking the library needs no import of the losses)
_UNIFORM_REFERENCE = {
    "f32": [["0x1.f95938p-1", "0x1.efa3dcp-1", "0x1.5d8cc2p-1", "0x1.149d8ap-1"],
            ["0x1.884388p-2", "0x1.59d942p-1", "0x1.b92f56p-1", "0x1.ebe41ap-1"],
            ["0x1.3f3752p-1", "0x1.9654a8p-3", "0x1.76d7eap-1", "0x1.3be6eap-1"]],
    "f64": [["0x1.f959396cb52c1p-1", "0x1.efa3dd8f6ec25p-1", "0x1.5d8cc2ca5005fp-1", "0x1.149d8b0c62c42p-1"],
            ["0x1.88438892d4614p-2", "0x1.59d942df81310p-1", "0x1.b92f57bc8c020p-1", "0x1.ebe41bb04d27cp-1"],
            ["0x1.3f375384d70b6p-1", "0x1.9654aec30a618p-3", "0x1.76d7eaadfc0c5p-1", "0x1.3be6eb9cbab8ap-1"]],
}


def _check_uniform_rows(lib, dtype, tol) -> bool:
    out = torch.full((3, 4), math.nan, dtype=dtype)
    lib._native_uniform_rows_(987654321, 4, out)
    name = "f32" if dtype == torch.float32 else "f64"
    expected = torch.tensor([[float.fromhex(v) for v in row] for row in _UNIFORM_REFERENCE[name]], dtype=dtype)
    return torch.equal(out, expected)


def _lca_case(dtype):
    """A small HIER LCA problem: (dist (N, P), i, j, k)."""
    dist = (_sample((5, 7), 5, 3.0) + 0.1).to(dtype)
    i, j, k = (torch.tensor(v, dtype=torch.long) for v in ([0, 1, 2, 4], [1, 3, 2, 0], [2, 4, 0, 3]))
    return dist, i, j, k


def _check_lca_rows(lib, dtype, tol) -> bool:
    """Without noise, and with the counter draws (``pml_uniform_rows``, checked before this)."""
    dist, i, j, k = _lca_case(dtype)
    rows, p = i.numel(), dist.shape[1]
    tau, margin, key = 0.5, 0.1, 12345
    D = dist.double()
    m1 = torch.maximum(D[i], D[j])
    m2 = torch.maximum(m1, D[k])
    draws = torch.empty(2 * rows, p, dtype=dtype)  # stream 2t + r: LCA choice r of row t
    lib._native_uniform_rows_(key, 0, draws)
    for noise in (0, 1):
        loss = torch.full((rows,), math.nan, dtype=dtype)
        a, b = torch.full((rows,), -1, dtype=torch.long), torch.full((rows,), -1, dtype=torch.long)
        grads = torch.full((2, rows, p), math.nan, dtype=dtype)
        on = torch.full((3, rows), math.nan, dtype=dtype)
        work = torch.empty(1, 2 * p, dtype=dtype)
        code = lib._native_lca_rows_(dist, i, j, k, 1.0 / tau, margin, bool(noise), key, loss, a, b, grads, on, work,
                                     [0, rows])
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


def _check_lca_backward(lib, dtype, tol) -> bool:
    dist, i, j, k = _lca_case(dtype)
    rows, (n, p) = i.numel(), dist.shape
    u = (_sample((2, rows, p), 6) - 0.5).to(dtype)
    scale = (_sample((rows,), 7) + 0.5).to(dtype)
    grad = torch.zeros(n, p, dtype=dtype)
    code = lib._native_lca_backward_(grad, dist, i, j, k, u, scale, [0, n])
    D, U, s = dist.double(), u.double(), scale.double().view(-1, 1)
    g_k = torch.where(D[k] > torch.maximum(D[i], D[j]), U[1], torch.zeros_like(U[1]))
    g_m = (U[1] - g_k) - U[0]
    g_i = torch.where(D[i] >= D[j], g_m, torch.zeros_like(g_m))
    ref = torch.zeros(n, p, dtype=torch.float64)
    for index, g in ((i, g_i), (j, g_m - g_i), (k, g_k)):
        ref.index_add_(0, index, g * s)
    return code == 0 and _close(grad, ref, tol)
