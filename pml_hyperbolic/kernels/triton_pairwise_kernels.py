r"""The Triton kernels of the pairwise Poincaré distance: row terms, forward, backward (split walk)
and the backward's finishing pass. Launched, registered and documented by
:mod:`pml_hyperbolic.kernels.triton_pairwise` (formulas there); this module only defines them, and
imports only where Triton is installed.

Every kernel takes arbitrary strides and uses 64-bit row offsets; the accumulation dtype is the
element type of the row-terms buffer (float32, or float64 for float64 inputs).

Design note: docs/design/gpu-kernel.md
"""
import triton
import triton.language as tl


@triton.jit
def _asinh_nonneg(t):
    """arsinh(t) for t ≥ 0: odd series below 0.1 (the log of a number near 1 would lose digits
    on approximate log units), log(t + √(1 + t²)) up to 1e8, log(2t) above (t² overflows)."""
    small = tl.where(t < 0.1, t, 0.0)  # keeps the unused branches finite
    z = small * small
    series = small * (1.0 + z * (-1.0 / 6.0 + z * (3.0 / 40.0 + z * (-5.0 / 112.0 + z * (
        35.0 / 1152.0 + z * (-63.0 / 2816.0 + z * (231.0 / 13312.0)))))))
    big = tl.where(t > 1e8, 1.0, t)
    middle = tl.log(big + tl.sqrt(1.0 + big * big))
    large = tl.log(tl.where(t > 1e8, t, 1.0)) + 0.6931471805599453
    return tl.where(t < 0.1, series, tl.where(t > 1e8, large, middle))


@triton.jit
def _row_terms_kernel(X, CPTR, ROWS, N, D, sxn, sxd,
                      FLOOR: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """ROWS[i] = (α_i, r_i): α_i = 1/max(1 − c‖x_i‖², FLOOR), r_i = ‖x_i‖²α_i (0 where floored),
    with ‖x_i‖² summed in float64 from float64 squares."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    rmask = rows < N
    r64 = rows.to(tl.int64)
    sq = tl.zeros((BR,), dtype=tl.float64)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        v = tl.load(X + r64[:, None] * sxn + k[None, :] * sxd, mask=rmask[:, None] & (k < D)[None, :],
                    other=0.0).to(tl.float64)
        sq += tl.sum(v * v, axis=1)
    c = tl.load(CPTR).to(tl.float64)
    a = 1.0 - c * sq
    live = a > FLOOR
    alpha = 1.0 / tl.maximum(a, FLOOR)
    r = tl.where(live, sq * alpha, 0.0)
    out_ty = ROWS.dtype.element_ty
    tl.store(ROWS + r64 * 2, alpha.to(out_ty), mask=rmask)
    tl.store(ROWS + r64 * 2 + 1, r.to(out_ty), mask=rmask)


@triton.jit
def _sq_dist_tile(X, Y, ri, rj, mi, mj, D, sxn, sxd, syn, syd, s, BK: tl.constexpr):
    """s[i, j] += Σ_k (x_ik − y_jk)² over all features, in s's dtype."""
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        mk = k < D
        xv = tl.load(X + ri[:, None] * sxn + k[None, :] * sxd, mask=mi[:, None] & mk[None, :], other=0.0)
        yv = tl.load(Y + rj[:, None] * syn + k[None, :] * syd, mask=mj[:, None] & mk[None, :], other=0.0)
        diff = xv.to(s.dtype)[:, None, :] - yv.to(s.dtype)[None, :, :]
        s += tl.sum(diff * diff, axis=2)
    return s


@triton.jit
def _forward_kernel(X, Y, ROWX, ROWY, CPTR, OUT, N, M, D,
                    sxn, sxd, syn, syd, son, som,
                    SYM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """OUT[i, j] = 2/√c · arsinh(√(c s_ij) √(α_i β_j)) for one BM × BN tile. With SYM (Y is X,
    BM = BN) only tiles on and above the diagonal compute, and each also writes its mirror."""
    pid_i = tl.program_id(0)
    pid_j = tl.program_id(1)
    if (not SYM) or pid_j >= pid_i:
        acc_ty = ROWX.dtype.element_ty
        ri = (pid_i * BM + tl.arange(0, BM)).to(tl.int64)
        rj = (pid_j * BN + tl.arange(0, BN)).to(tl.int64)
        mi = ri < N
        mj = rj < M
        s = _sq_dist_tile(X, Y, ri, rj, mi, mj, D, sxn, sxd, syn, syd,
                          tl.zeros((BM, BN), dtype=acc_ty), BK)
        ax = tl.load(ROWX + ri * 2, mask=mi, other=1.0)
        ay = tl.load(ROWY + rj * 2, mask=mj, other=1.0)
        c = tl.load(CPTR).to(acc_ty)
        # √(α_i β_j) as one product: the same bits for (i, j) and (j, i), so (x, x) is exactly symmetric
        t = tl.sqrt(c * s) * tl.sqrt(ax[:, None] * ay[None, :])
        d = ((2.0 / tl.sqrt(c)) * _asinh_nonneg(t)).to(OUT.dtype.element_ty)
        mij = mi[:, None] & mj[None, :]
        tl.store(OUT + ri[:, None] * son + rj[None, :] * som, d, mask=mij)
        if SYM:
            tl.store(OUT + rj[None, :] * son + ri[:, None] * som, d, mask=mij)


@triton.jit
def _backward_kernel(A, B, U, ROWA, ROWB, CPTR, GACC, RSUM, UDSUM, NA, NB, D,
                     san, sad, sbn, sbd, su_a, su_b, sgs, sgn, sgd,
                     SYM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Partial gradient of Σ U·D with respect to the rows of A (the other side B held fixed): one
    block of BM rows (axis 0) and the tiles of B with index ≡ split (mod the number of splits,
    axis 1), walked in order. U[a, b] is read as U + a·su_a + b·su_b (and, with SYM,
    U[a, b] + U[b, a]). Writes, for its split s: GACC[s, i] = Σ_j L_ij (a_i − b_j),
    RSUM[s, i] = Σ_j U_ij ρ_ij/√c and UDSUM[s, i] = Σ_j U_ij D_ij (GACC starts at 0)."""
    acc_ty = ROWA.dtype.element_ty
    split = tl.program_id(1)
    nsplit = tl.num_programs(1)
    ri = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    mi = ri < NA
    alpha_a = tl.load(ROWA + ri * 2, mask=mi, other=1.0)
    c = tl.load(CPTR).to(acc_ty)
    sqc = tl.sqrt(c)
    rsum = tl.zeros((BM,), dtype=acc_ty)
    udsum = tl.zeros((BM,), dtype=acc_ty)
    gbase = GACC + split.to(tl.int64) * sgs
    for j0 in range(split * BN, NB, nsplit * BN):
        rj = (j0 + tl.arange(0, BN)).to(tl.int64)
        mj = rj < NB
        mij = mi[:, None] & mj[None, :]
        s = _sq_dist_tile(A, B, ri, rj, mi, mj, D, san, sad, sbn, sbd,
                          tl.zeros((BM, BN), dtype=acc_ty), BK)
        alpha_b = tl.load(ROWB + rj * 2, mask=mj, other=1.0)
        u = tl.load(U + ri[:, None] * su_a + rj[None, :] * su_b, mask=mij, other=0.0).to(acc_ty)
        if SYM:
            u += tl.load(U + rj[None, :] * su_a + ri[:, None] * su_b, mask=mij, other=0.0).to(acc_ty)
        t = tl.sqrt(c * s) * tl.sqrt(alpha_a[:, None] * alpha_b[None, :])
        sq1 = tl.sqrt(1.0 + t * t)  # inf once t² overflows: then L → 0 and ρ = 1 below
        rho = tl.where(t > 1e8, 1.0, t / sq1)
        positive = t > 0.0
        el = tl.where(positive, (alpha_b[None, :] * u) / (sqc * tl.where(positive, t, 1.0) * sq1), 0.0)
        rsum += tl.sum(u * rho, axis=1) / sqc
        udsum += tl.sum(u * ((2.0 / sqc) * _asinh_nonneg(t)), axis=1)
        for k0 in range(0, D, BK):
            k = k0 + tl.arange(0, BK)
            mk = k < D
            av = tl.load(A + ri[:, None] * san + k[None, :] * sad, mask=mi[:, None] & mk[None, :], other=0.0)
            bv = tl.load(B + rj[:, None] * sbn + k[None, :] * sbd, mask=mj[:, None] & mk[None, :], other=0.0)
            diff = av.to(acc_ty)[:, None, :] - bv.to(acc_ty)[None, :, :]
            part = tl.sum(el[:, :, None] * diff, axis=1)
            gptr = gbase + ri[:, None] * sgn + k[None, :] * sgd
            gmask = mi[:, None] & mk[None, :]
            tl.store(gptr, tl.load(gptr, mask=gmask, other=0.0) + part, mask=gmask)
    tl.store(RSUM + split * NA + ri, rsum, mask=mi)
    tl.store(UDSUM + split * NA + ri, udsum, mask=mi)


@triton.jit
def _finish_kernel(A, ROWA, CPTR, GACC, RSUM, UDSUM, GOUT, RSUM_OUT, UDSUM_OUT, NA, D, NSPLIT,
                   san, sad, sgs, sgn, sgd, son, sod, BM: tl.constexpr, BK: tl.constexpr):
    """Sums the splits' partials in split order (deterministic) and forms the gradient
    GOUT[i] = 2cα_i (Σ_s GACC[s, i] + [not floored] a_i Σ_s RSUM[s, i]); also the total sums."""
    acc_ty = ROWA.dtype.element_ty
    ri = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    mi = ri < NA
    alpha_a = tl.load(ROWA + ri * 2, mask=mi, other=1.0)
    live_a = tl.load(ROWA + ri * 2 + 1, mask=mi, other=0.0) > 0.0
    c = tl.load(CPTR).to(acc_ty)
    rsum = tl.zeros((BM,), dtype=acc_ty)
    udsum = tl.zeros((BM,), dtype=acc_ty)
    for sp in range(0, NSPLIT):
        rsum += tl.load(RSUM + sp * NA + ri, mask=mi, other=0.0)
        udsum += tl.load(UDSUM + sp * NA + ri, mask=mi, other=0.0)
    scale = 2.0 * c * alpha_a
    radial = tl.where(live_a, rsum, 0.0)
    for k0 in range(0, D, BK):
        k = k0 + tl.arange(0, BK)
        gmask = mi[:, None] & (k < D)[None, :]
        g = tl.zeros((BM, BK), dtype=acc_ty)
        for sp in range(0, NSPLIT):
            g += tl.load(GACC + sp * sgs + ri[:, None] * sgn + k[None, :] * sgd, mask=gmask, other=0.0)
        av = tl.load(A + ri[:, None] * san + k[None, :] * sad, mask=gmask, other=0.0).to(acc_ty)
        g = scale[:, None] * (g + radial[:, None] * av)
        tl.store(GOUT + ri[:, None] * son + k[None, :] * sod, g.to(GOUT.dtype.element_ty), mask=gmask)
    tl.store(RSUM_OUT + ri, rsum, mask=mi)
    tl.store(UDSUM_OUT + ri, udsum, mask=mi)
