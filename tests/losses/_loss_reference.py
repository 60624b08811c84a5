"""Independent float64 plain-loop references for the loss tests (no pml_hyperbolic code)."""
import math

import torch


def poincare(x, y, c):
    """Scalar Poincaré distance via the arcosh form (x != y assumed)."""
    diff2 = ((x - y) ** 2).sum()
    den = (1 - c * (x ** 2).sum()) * (1 - c * (y ** 2).sum())
    return torch.acosh(1 + 2 * c * diff2 / den) / math.sqrt(c)


def cos_dist(x, y):
    return 1 - (x @ y) / (x.norm() * y.norm())


def dist_matrix(E, R, dfun):
    return [[dfun(E[i], R[j]) for j in range(len(R))] for i in range(len(E))]


def pairwise_ce(E, y, R, ry, dfun, tau, self_ref):
    D = dist_matrix(E, R, dfun)
    terms = []
    for i in range(len(E)):
        for j in range(len(R)):
            if (self_ref and i == j) or y[i] != ry[j]:
                continue
            den = sum(torch.exp(-D[i][k] / tau) for k in range(len(R)) if not (self_ref and k == i))
            terms.append(-torch.log(torch.exp(-D[i][j] / tau) / den))
    return sum(terms) / len(terms)


def uncertainty_clip(x, c, r):
    d0 = 2 / math.sqrt(c) * torch.atanh(math.sqrt(c) * x.norm())
    return torch.clamp(1 - d0 / (2 * r), 0, 1)


def adaptive_ce(E, y, R, ry, c, tau_fn, self_ref):
    U = [uncertainty_clip(E[i].detach(), c, 2.3) for i in range(len(E))]
    umax = max(U)
    D = dist_matrix(E, R, lambda a, b: poincare(a, b, c))
    terms = []
    for i in range(len(E)):
        tau = tau_fn(torch.log(U[i] / umax + 1))
        for j in range(len(R)):
            if (self_ref and i == j) or y[i] != ry[j]:
                continue
            dij = D[i][j]
            den = sum(torch.exp(-D[i][k] / tau) for k in range(len(R)) if not (self_ref and k == i))
            terms.append(-torch.log(torch.exp(-dij / tau) / den))
    return sum(terms) / len(terms)


def adaptive_triplet(E, y, R, ry, c, self_ref):
    U = [uncertainty_clip(E[i].detach(), c, 2.3) for i in range(len(E))]
    umax = max(U)
    D = dist_matrix(E, R, lambda a, b: poincare(a, b, c))
    terms = []
    for a in range(len(E)):
        alpha = torch.log(U[a] / umax + 1) * math.exp(c)
        for p in range(len(R)):
            if (self_ref and a == p) or y[a] != ry[p]:
                continue
            for n in range(len(R)):
                if ry[n] == y[a]:
                    continue
                terms.append(torch.relu(D[a][p] - D[a][n] + alpha))
    nonzero = [t for t in terms if t > 0]
    return sum(nonzero) / len(nonzero) if nonzero else sum(terms) * 0


def level(li, lj):
    for k in range(len(li)):
        if li[k] == lj[k]:
            return k + 1
    return len(li) + 1


def log_ratio_dense(E, L, R, RL, c, omega, eps, self_ref):
    """Mean over (i, j) of the mean over l with s_ij < s_il of the squared log-ratio residual."""
    pair_losses = []
    D = dist_matrix(E, R, lambda a, b: poincare(a, b, c))
    for i in range(len(E)):
        for j in range(len(R)):
            if self_ref and j == i:
                continue
            sij = level(L[i], RL[j])
            ls = [l for l in range(len(R)) if not (self_ref and l == i) and level(L[i], RL[l]) > sij]
            if not ls:
                continue
            dij = D[i][j]
            vals = [(torch.log(dij + eps) - torch.log(D[i][l] + eps)
                     - (sij - level(L[i], RL[l])) * math.log(omega)) ** 2 for l in ls]
            pair_losses.append(sum(vals) / len(vals))
    return sum(pair_losses) / len(pair_losses)


def hierarchical_margin(E, y, R, ry, c, gamma, self_ref):
    """First batch (fresh estimates): class means from this batch."""
    classes = sorted(set(y) | set(ry))
    D = {}
    for a in classes:
        for b in classes:
            vals = [poincare(E[i], R[j], c).detach() for i in range(len(E)) for j in range(len(R))
                    if not (self_ref and i == j) and y[i] == a and ry[j] == b]
            vals += [poincare(E[i], R[j], c).detach() for i in range(len(E)) for j in range(len(R))
                     if not (self_ref and i == j) and y[i] == b and ry[j] == a]
            D[a, b] = sum(vals) / len(vals) if vals else None
    pos, neg = [], []
    for i in range(len(E)):
        for j in range(len(R)):
            if self_ref and i == j:
                continue
            d = poincare(E[i], R[j], c)
            da = D[y[i], y[i]] if D[y[i], y[i]] is not None else 0.0
            if y[i] == ry[j]:
                pos.append(torch.relu(d - (da + gamma)))
            else:
                neg.append(torch.relu(D[y[i], ry[j]] - da + gamma - d))
    def avg_nonzero(ts):
        nz = [t for t in ts if t > 0]
        return sum(nz) / len(nz) if nz else sum(ts) * 0
    return avg_nonzero(pos) + avg_nonzero(neg)
