#!/usr/bin/env python
"""The pairwise kernel on every device at hand against a float64 reference: pairwise_dist(x, x)
(the symmetric path on CPU, the general one on CUDA) and pairwise_dist(x, y), forward and, for
x is y, the gradient of a dense random upstream, n = 300 and 900, D = 128, c = 0.1, radii uniform
in d₀ ∈ [0, 2.5]. Exits 1 if an error exceeds 1e-4 (distances) or 1e-3 (gradients, relative to
the largest).

Then ``HIERLoss`` on each device: with the deterministic LCA (eval mode) its loss and gradient
against the CPU's float64 ones, and in training mode (Gumbel noise) a second backward through the
same graph (``retain_graph``) against the first: the CPU replays the draws from their seed (equal
bit for bit), CUDA keeps the forward's buffer (equal up to the order of its atomic ``index_add_``).
Every triplet is used (no subsampling: the devices' random streams differ). Exits 1 on a relative
error above 1e-4 (loss) or 1e-3 (gradient), or two backwards differing at all on CPU or by more than
1e-5 on CUDA (3.2e-6 measured on an H200: float32 atomics in another order).

    python -m bench kernel_check            # cuda (if available) and cpu
"""
import math
import sys

import torch

from pml_hyperbolic.kernels import native as _native
from pml_hyperbolic import poincare_ball as pb

C = 0.1


def reference(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Float64 all-pairs distance by broadcasting (+tiny under the root: a finite zero
    subgradient at x_i = y_j)."""
    x2, y2 = (x * x).sum(1), (y * y).sum(1)
    s = ((x[:, None] - y[None]) ** 2).sum(-1)
    w = C * s / ((1 - C * x2)[:, None] * (1 - C * y2)[None])
    return 2 / math.sqrt(C) * torch.asinh(torch.sqrt(w + 1e-300))


def main(argv=None) -> list:
    """Print the checks; return one row per check (its errors and whether it passed)."""
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    print("native:", _native.status())
    rows = []
    devices = (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    g = torch.Generator().manual_seed(0)
    ok = True
    for n in (300, 900):
        v = torch.randn(n, 128, generator=g, dtype=torch.float64)
        v = v / v.norm(dim=1, keepdim=True)
        d0 = 2.5 * torch.rand(n, generator=g, dtype=torch.float64)
        x = v * (torch.tanh(math.sqrt(C) * d0 / 2) / math.sqrt(C))[:, None]
        upstream = torch.randn(n, n, generator=g, dtype=torch.float64)
        xr = x.clone().requires_grad_()
        (reference(xr, xr) * upstream).sum().backward()
        ref, ref_xy = reference(x, x), reference(x, x[: n // 2])
        for device in devices:
            xg = x.float().to(device).requires_grad_()
            d = pb.pairwise_dist(xg, xg, C)
            (d * upstream.float().to(device)).sum().backward()
            err = ((d.double().cpu() - ref).abs() / ref.clamp_min(1e-2)).max().item()
            gerr = ((xg.grad.double().cpu() - xr.grad).abs().max() / xr.grad.abs().max()).item()
            d_xy = pb.pairwise_dist(xg.detach(), x[: n // 2].float().to(device), C)
            err_xy = ((d_xy.double().cpu() - ref_xy).abs() / ref_xy.clamp_min(1e-2)).max().item()
            print(f"{device} n={n} x-is-y: max rel err D {err:.1e}, grad rel err {gerr:.1e}; x, y: {err_xy:.1e}")
            passed = err < 1e-4 and gerr < 1e-3 and err_xy < 1e-4
            rows.append({"check": "pairwise_dist vs float64", "device": device, "n": n, "rel err D (x is y)": err,
                         "rel err grad": gerr, "rel err D (x, y)": err_xy, "passed": passed})
            ok &= passed
    ok &= hier_check(devices, g, rows)
    print("kernel check ok" if ok else "kernel check FAILED")
    return rows


def hier_check(devices, g, rows) -> bool:
    from pml_hyperbolic.losses import HIERLoss

    n, d = 96, 32
    x = pb.expmap0(0.3 * torch.randn(n, d, generator=g, dtype=torch.float64), C)
    labels = torch.arange(n) // 4
    torch.manual_seed(0)
    every = dict(max_triplets=10 ** 6, max_proxy_triplets=10 ** 6)  # no subsampling
    proto = HIERLoss(embedding_size=d, num_proxies=24, c=C, **every)
    ok = True

    def run(device, dtype, training, twice=False):
        loss = HIERLoss(embedding_size=d, num_proxies=24, c=C, **every)
        loss.load_state_dict(proto.state_dict())
        loss = loss.to(device=device, dtype=dtype).train(training)
        xg = x.to(device=device, dtype=dtype).requires_grad_()
        torch.manual_seed(1)
        value = loss(xg, labels.to(device))
        first, = torch.autograd.grad(value, xg, retain_graph=twice)
        second = torch.autograd.grad(value, xg)[0] if twice else None
        return value.double().cpu(), first.double().cpu(), None if second is None else second.double().cpu()

    ref_value, ref_grad, _ = run("cpu", torch.float64, training=False)
    for device in devices:
        value, grad, _ = run(device, torch.float32, training=False)
        verr = (abs(value - ref_value) / abs(ref_value)).item()
        gerr = ((grad - ref_grad).abs().max() / ref_grad.abs().max()).item()
        _, first, second = run(device, torch.float32, training=True, twice=True)
        again = ((second - first).abs().max() / first.abs().max()).item()
        print(f"{device} HIERLoss (eval, vs cpu float64): loss rel err {verr:.1e}, grad rel err {gerr:.1e}; "
              f"training, second backward vs first: {again:.1e}")
        passed = verr < 1e-4 and gerr < 1e-3 and (again == 0 if device == "cpu" else again <= 1e-5)
        rows.append({"check": "HIERLoss vs cpu float64", "device": device, "rel err loss": verr, "rel err grad": gerr,
                     "second backward vs first": again, "passed": passed})
        ok &= passed
    return ok


if __name__ == "__main__":
    sys.exit(0 if all(row["passed"] for row in main()) else 1)
