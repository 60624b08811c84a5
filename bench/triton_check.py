#!/usr/bin/env python
"""The Triton pairwise-distance kernels on a GPU: accuracy against float64, opcheck, speed and memory.

    python -m bench triton_check                      # CUDA: every check, N = 900 and 4096, D = 128
    python -m bench triton_check --sizes 900 --repeats 10
    python -m bench triton_check --device cpu         # smoke run in Triton's interpreter (small sizes, no timing)
    python -m bench triton_check --compile-only       # no GPU needed: compile every kernel for sm_90 (ptxas -v)

1. Accuracy (``pml_hyperbolic.kernels.triton_pairwise.pairwise_poincare_dist_triton``): n = 300 and
   900 points (``--accuracy-sizes``), D = 128, c = 0.1 and 1.0, distances to the origin uniform in
   [0, 3], with a pair 1e-4 apart, one 1e-6 apart and an exact copy. x is y and (x, y[: n/2]) in
   float32, and x is y in float16 under ``torch.autocast`` (returns float32), against the formula in
   float64 on the same float32/float16 points; the gradient of a dense random upstream (x is y)
   against float64 autograd, and the curvature's gradient. Fails above 1e-4 (distance, relative,
   floored at 1e-2 as ``kernel_check``) or 1e-3 (gradients, relative to the largest entry).
2. ``torch.library.opcheck`` of the forward and backward ops in float32 and float64 (with
   ``test_aot_dispatch_dynamic``, which the interpreter cannot run).
3. Speed and memory (CUDA only): forward and forward+backward of x is y at each ``--sizes`` N,
   D = 128, float32 and float16 inputs under autocast, for the Triton kernels, the package's torch
   path (``poincare_ball.pairwise_dist``) and PML's ``CosineSimilarity`` (the baseline, same run).
   CUDA-event medians over ``--repeats`` interleaved repeats (the three methods alternate) after
   warm-up; peak memory is ``torch.cuda.max_memory_allocated`` over one forward+backward, reset
   before it, minus the memory held before (inputs included in neither).

``--compile-only`` needs no GPU: it compiles each kernel (row terms, forward and backward, x is y
and not) for every input dtype through Triton's full pipeline to a cubin for ``--arch`` (default 90,
H100/H200) and runs the bundled ``ptxas -v`` on the PTX for registers and spills. It catches what the
interpreter cannot (typing and lowering errors) but runs nothing.

``poincare_ball.pairwise_dist`` itself sends CUDA tensors to these kernels (``PML_HYPERBOLIC_TRITON=0``:
the torch path); ``python -m bench gpu_step --pairwise triton|torch`` sets that switch for the
training-step targets.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

C_VALUES = (0.1, 1.0)
DIM = 128


def reference(x, y, c):
    """Float64 all-pairs distance from the formula (x_i = y_j: zero subgradient), in row chunks."""
    import torch

    xd, yd = x.double(), y.double()
    c = torch.as_tensor(c, dtype=torch.float64, device=xd.device)
    a = (1 - c * (xd * xd).sum(1)).clamp_min(2.0 ** -60)
    b = (1 - c * (yd * yd).sum(1)).clamp_min(2.0 ** -60)
    rows = []
    for start in range(0, xd.shape[0], 64):
        s = ((xd[start:start + 64, None, :] - yd[None, :, :]) ** 2).sum(-1)
        w = c * s / (a[start:start + 64, None] * b[None, :])
        rows.append((2 / c.sqrt()) * torch.asinh(w.clamp_min(1e-300).sqrt()))
    return torch.cat(rows)


def ball_points(n, d, c, generator):
    import torch

    v = torch.randn(n, d, generator=generator, dtype=torch.float64)
    v = v / v.norm(dim=1, keepdim=True)
    d0 = 3.0 * torch.rand(n, generator=generator, dtype=torch.float64)
    x = v * (torch.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c))[:, None]
    x[1] = x[0] + 1e-4 * torch.randn(d, generator=generator, dtype=torch.float64)
    x[2] = x[0] + 1e-6 * torch.randn(d, generator=generator, dtype=torch.float64)
    x[3] = x[0]
    return x


def accuracy_rows(tp, device, sizes, dim):
    import torch

    rows, g = [], torch.Generator().manual_seed(0)
    for c in C_VALUES:
        for n in sizes:
            x32 = ball_points(n, dim, c, g).float()
            upstream = torch.randn(n, n, generator=g, dtype=torch.float64)
            x64 = x32.double().to(device)
            xr = x64.clone().requires_grad_()
            cr = torch.tensor(c, dtype=torch.float64, device=device, requires_grad=True)
            ref = reference(xr, xr, cr)
            gx_ref, gc_ref = torch.autograd.grad((ref * upstream.to(device)).sum(), (xr, cr))
            ref = ref.detach()

            xg = x32.to(device).requires_grad_()
            cg = torch.tensor(c, dtype=torch.float64, device=device, requires_grad=True)
            d = tp.pairwise_poincare_dist_triton(xg, xg, cg)
            gx, gc = torch.autograd.grad((d * upstream.float().to(device)).sum(), (xg, cg))
            err = ((d.double() - ref).abs() / ref.clamp_min(1e-2)).max().item()
            gerr = ((gx.double() - gx_ref).abs().max() / gx_ref.abs().max()).item()
            cerr = abs(gc.item() / gc_ref.item() - 1)
            half = n // 2
            d_xy = tp.pairwise_poincare_dist_triton(xg.detach(), xg.detach()[:half].clone(), c)
            err_xy = ((d_xy.double() - ref[:, :half]).abs() / ref[:, :half].clamp_min(1e-2)).max().item()
            x16 = x32.half().to(device)
            with torch.autocast(device.type, dtype=torch.float16 if device.type == "cuda" else torch.bfloat16):
                x_amp = x16 if device.type == "cuda" else x16.bfloat16()
                d16 = tp.pairwise_poincare_dist_triton(x_amp, x_amp, c)
            ref16 = reference(x_amp.double(), x_amp.double(), c)
            err16 = ((d16.double() - ref16).abs() / ref16.clamp_min(1e-2)).max().item()
            passed = (max(err, err_xy, err16) < 1e-4 and gerr < 1e-3 and cerr < 1e-3 and d16.dtype == torch.float32
                      and bool(torch.isfinite(gx).all()) and float(d.detach().diagonal().abs().max()) == 0.0)
            print(f"{device.type} c={c} n={n}: max rel err D {err:.1e} (x, y: {err_xy:.1e}; autocast "
                  f"{x_amp.dtype} -> {d16.dtype}: {err16:.1e}), grad x {gerr:.1e}, grad c {cerr:.1e}"
                  f"{'' if passed else '  FAILED'}", flush=True)
            rows.append({"check": "triton pairwise vs float64", "device": device.type, "c": c, "n": n, "dim": dim,
                         "rel err D (x is y)": err, "rel err D (x, y)": err_xy, "rel err D (autocast)": err16,
                         "rel err grad x": gerr, "rel err grad c": cerr, "passed": passed})
    return rows


def opcheck_rows(device):
    import torch

    rows = []
    tests = ["test_schema", "test_autograd_registration", "test_faketensor"]
    if device.type == "cuda":
        tests.append("test_aot_dispatch_dynamic")
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.float64):
        x = (0.2 * torch.randn(7, 5, generator=g, dtype=dtype)).to(device).requires_grad_()
        y = (0.2 * torch.randn(6, 5, generator=g, dtype=dtype)).to(device).requires_grad_()
        c = torch.tensor(0.5, dtype=torch.float64, device=device).requires_grad_()
        for label, args in (("x, y", (x, y, c)), ("x is y", (x, None, c))):
            try:
                result = torch.library.opcheck(torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton, args,
                                               test_utils=tests)
                passed = all(v == "SUCCESS" for v in result.values())
                detail = ", ".join(f"{k}: {v}" for k, v in result.items())
            except Exception as err:  # report and go on: one row per case
                passed, detail = False, f"{type(err).__name__}: {str(err)[:3000]}"
                causes, cause = [], err.__cause__ or err.__context__
                while cause is not None and len(causes) < 4:  # the comparison that failed, with its tolerance
                    causes.append(f"{type(cause).__name__}: {str(cause)[:1500]}")
                    cause = cause.__cause__ or cause.__context__
                if causes:
                    detail += " | caused by: " + " | ".join(causes)
            print(f"opcheck {dtype} {label}: {'ok' if passed else 'FAILED'} ({detail})", flush=True)
            row = {"check": "opcheck", "device": device.type, "dtype": str(dtype), "case": label,
                   "tests": tests, "passed": passed, "detail": detail}
            if not passed and device.type == "cuda":
                row["diagnosis"] = compiled_gradient_diagnosis(args)
                print(f"  diagnosis: {row['diagnosis']}", flush=True)
            rows.append(row)
    return rows


def compiled_gradient_diagnosis(args) -> dict:
    """Where eager and compiled (``aot_eager``) gradients of the op part: the largest difference per
    input, whether two eager runs agree bit for bit, and which backward ran under compilation (the
    kernels or the float64 composite graph kept for ``create_graph=True``)."""
    import torch

    from pml_hyperbolic.kernels import triton_pairwise as tp

    op = torch.ops.pml_hyperbolic.pairwise_poincare_dist_triton
    inputs = [a for a in args if a is not None]

    def grads(fn):
        out = fn(*args)
        upstream = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).reshape(out.shape)
        return torch.autograd.grad(out, inputs, upstream)

    composite_calls = []
    original = tp._composite

    def spy(*a, **k):
        composite_calls.append(1)
        return original(*a, **k)

    result = {}
    try:
        eager, again = grads(op), grads(op)
        result["eager deterministic"] = all(bool(torch.equal(a, b)) for a, b in zip(eager, again))
        tp._composite = spy
        torch._dynamo.reset()
        compiled = grads(torch.compile(lambda *a: op(*a), backend="aot_eager", dynamic=True))
        result["composite backward calls under compile"] = len(composite_calls)
        for name, a, b in zip(("x", "y", "c"), eager, compiled):
            diff = (a.double() - b.double()).abs().max().item()
            result[f"max |eager - compiled| {name}"] = diff
            result[f"relative {name}"] = diff / max(a.double().abs().max().item(), 1e-300)
    except Exception as err:  # a diagnosis never fails the run
        result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
    finally:
        tp._composite = original
    return result


_DTYPE_CODES = {"float32": ("fp32", "fp32"), "float16": ("fp16", "fp32"), "bfloat16": ("bf16", "fp32"),
                "float64": ("fp64", "fp64")}


def compile_rows(tp, arch, dtypes):
    """Compile every kernel for a CUDA target without a GPU; one row per kernel and dtype."""
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    rows = []
    for name in dtypes:
        inp, acc = _DTYPE_CODES[name]
        strides = lambda *names: {n: "i32" for n in names}  # noqa: E731
        cases = [("row terms", tp._row_terms_kernel,
                  {"X": f"*{inp}", "CPTR": "*fp64", "ROWS": f"*{acc}", **strides("N", "D", "sxn", "sxd")},
                  {"FLOOR": 2.0 ** -60, "BR": tp._ROWS_BLOCK, "BK": tp._ROWS_BK})]
        for sym in (False, True):
            cases.append((f"forward{' x is y' if sym else ''}", tp._forward_kernel,
                          {"X": f"*{inp}", "Y": f"*{inp}", "ROWX": f"*{acc}", "ROWY": f"*{acc}", "CPTR": "*fp64",
                           "OUT": f"*{acc}", **strides("N", "M", "D", "sxn", "sxd", "syn", "syd", "son", "som")},
                          {"SYM": sym, "BM": tp._BM, "BN": tp._BN, "BK": tp._BK}))
            cases.append((f"backward{' x is y' if sym else ''}", tp._backward_kernel,
                          {"A": f"*{inp}", "B": f"*{inp}", "U": "*fp32", "ROWA": f"*{acc}", "ROWB": f"*{acc}",
                           "CPTR": "*fp64", "GACC": f"*{acc}", "RSUM": f"*{acc}", "UDSUM": f"*{acc}",
                           **strides("NA", "NB", "D", "san", "sad", "sbn", "sbd", "su_a", "su_b", "sgs", "sgn", "sgd")},
                          {"SYM": sym, "BM": tp._BWD_BM, "BN": tp._BWD_BN, "BK": tp._BWD_BK}))
        cases.append(("backward finish", tp._finish_kernel,
                      {"A": f"*{inp}", "ROWA": f"*{acc}", "CPTR": "*fp64", "GACC": f"*{acc}", "RSUM": f"*{acc}",
                       "UDSUM": f"*{acc}", "GOUT": f"*{inp}", "RSUM_OUT": f"*{acc}", "UDSUM_OUT": f"*{acc}",
                       **strides("NA", "D", "NSPLIT", "san", "sad", "sgs", "sgn", "sgd", "son", "sod")},
                      {"BM": tp._FIN_BM, "BK": tp._FIN_BK}))
        for label, fn, signature, constants in cases:
            row = {"check": "compile", "arch": f"sm_{arch}", "dtype": name, "kernel": label}
            try:
                kernel = triton.compile(ASTSource(fn, {**signature, **{k: "constexpr" for k in constants}}, constants),
                                        target=target, options={"num_warps": tp._NUM_WARPS})
                row["passed"] = "cubin" in kernel.asm
                if os.path.exists(ptxas):
                    with tempfile.TemporaryDirectory() as folder:
                        ptx = os.path.join(folder, "k.ptx")
                        with open(ptx, "w", encoding="utf-8") as fh:
                            fh.write(kernel.asm["ptx"])
                        info = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a" if arch >= 90 else
                                               f"--gpu-name=sm_{arch}", ptx, "-o", os.path.join(folder, "k.cubin")],
                                              capture_output=True, text=True).stderr
                    regs = re.search(r"Used (\d+) registers", info)
                    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
                    row["registers"] = int(regs.group(1)) if regs else None
                    row["spill bytes"] = sum(map(int, spills.groups())) if spills else None
            except Exception as err:  # report every kernel, then fail
                row["passed"], row["error"] = False, f"{type(err).__name__}: {str(err)[:500]}"
            print(f"compile sm_{arch} {name:<8} {label:<18} {'ok' if row['passed'] else 'FAILED'}"
                  + (f", {row['registers']} registers, {row['spill bytes']} bytes spilled" if row.get("registers")
                     else "") + (f" ({row['error']})" if "error" in row else ""), flush=True)
            rows.append(row)
    return rows


def _time_ms(fn, torch):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def speed_rows(tp, device, sizes, dim, repeats):
    import torch
    from pytorch_metric_learning.distances import CosineSimilarity

    from pml_hyperbolic import poincare_ball as pb

    cosine = CosineSimilarity()
    methods = {"CosineSimilarity": lambda x: cosine(x),
               "torch path (pairwise_dist)": lambda x: pb.pairwise_dist(x, x, 0.1),
               "triton": lambda x: tp.pairwise_poincare_dist_triton(x, x, 0.1)}
    rows, g = [], torch.Generator().manual_seed(2)
    for n in sizes:
        base = ball_points(n, dim, 0.1, g).float().to(device)
        upstream = torch.randn(n, n, generator=g).to(device)
        for amp in (False, True):
            def call(method, backward):
                x = base.half().requires_grad_() if amp else base.clone().requires_grad_()
                with torch.autocast("cuda", dtype=torch.float16, enabled=amp):
                    out = methods[method](x)
                if backward:
                    (out.float() * upstream).sum().backward()
                return out

            times = {(m, b): [] for m in methods for b in (False, True)}
            for _ in range(3):  # warm-up: compilation, allocator
                for m in methods:
                    call(m, True)
            torch.cuda.synchronize()
            for _ in range(repeats):
                for m in methods:
                    for b in (False, True):
                        times[(m, b)].append(_time_ms(lambda: call(m, b), torch))
            peaks = {}
            for m in methods:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                held = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                call(m, True)
                torch.cuda.synchronize()
                peaks[m] = torch.cuda.max_memory_allocated(device) - held
            base_fwd = statistics.median(times[("CosineSimilarity", False)])
            base_both = statistics.median(times[("CosineSimilarity", True)])
            for m in methods:
                fwd, both = statistics.median(times[(m, False)]), statistics.median(times[(m, True)])
                row = {"check": "speed", "device": torch.cuda.get_device_name(device), "n": n, "dim": dim,
                       "inputs": "float16 under autocast" if amp else "float32", "method": m,
                       "fwd ms": fwd, "fwd+bwd ms": both, "fwd ratio": fwd / base_fwd,
                       "fwd+bwd ratio": both / base_both, "peak MiB": peaks[m] / 2 ** 20,
                       "memory ratio": peaks[m] / peaks["CosineSimilarity"], "repeats": repeats, "passed": True}
                rows.append(row)
                print(f"n={n} {row['inputs']:<24} {m:<28} fwd {fwd:8.3f} ms ({row['fwd ratio']:5.2f}x)  "
                      f"fwd+bwd {both:8.3f} ms ({row['fwd+bwd ratio']:5.2f}x)  peak {row['peak MiB']:8.1f} MiB "
                      f"({row['memory ratio']:5.2f}x)", flush=True)
    return rows


def main(argv=None) -> list:
    """Print the checks; return one row per check (its figures and whether it passed)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="'cuda' (default), 'cuda:N', or 'cpu' (interpreter smoke)")
    parser.add_argument("--sizes", default="900,4096", help="N of the speed rows (comma-separated)")
    parser.add_argument("--accuracy-sizes", default=None,
                        help="n of the accuracy rows (default 300,900 on CUDA, 40 on the CPU)")
    parser.add_argument("--repeats", type=int, default=20, help="timed repeats per method (medians)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the kernels for --arch without a GPU (and run ptxas -v); nothing runs")
    parser.add_argument("--arch", type=int, default=90, help="compute capability of --compile-only (90: H100/H200)")
    parser.add_argument("--dtypes", default=",".join(_DTYPE_CODES), help="input dtypes of --compile-only")
    a = parser.parse_args(argv)
    if a.compile_only:
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise SystemExit("--compile-only compiles real kernels: run it without TRITON_INTERPRET=1")
        dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
        unknown = [d for d in dtypes if d not in _DTYPE_CODES]
        if unknown or not dtypes:
            parser.error(f"--dtypes: unknown {unknown} (choose among {', '.join(_DTYPE_CODES)})")
        from pml_hyperbolic.kernels import triton_pairwise as tp

        rows = compile_rows(tp, a.arch, dtypes)
        print("triton compile ok" if all(r["passed"] for r in rows) else "triton compile FAILED")
        return rows
    if a.device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--device cpu needs TRITON_INTERPRET=1 before triton is imported: "
                             "run `TRITON_INTERPRET=1 python -m bench triton_check --device cpu`")
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from pml_hyperbolic.kernels import triton_pairwise as tp

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available: run on a GPU, or `--device cpu` for an interpreter smoke run")
    if not tp.triton_available(device):
        raise SystemExit(f"the Triton kernels cannot run on {device} (is triton installed?)")
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu (Triton interpreter)'}; "
          f"torch {torch.__version__}; triton {sys.modules['triton'].__version__}", flush=True)
    default_acc = "300,900" if device.type == "cuda" else "40"
    acc_sizes = [int(s) for s in (a.accuracy_sizes or default_acc).split(",") if s.strip()]
    dim = DIM if device.type == "cuda" else 16
    rows = accuracy_rows(tp, device, acc_sizes, dim)
    rows += opcheck_rows(device)
    if device.type == "cuda":
        rows += speed_rows(tp, device, [int(s) for s in a.sizes.split(",") if s.strip()], DIM, a.repeats)
    ok = all(row["passed"] for row in rows)
    print("triton check ok" if ok else "triton check FAILED")
    return rows


if __name__ == "__main__":
    sys.exit(0 if all(row["passed"] for row in main()) else 1)
