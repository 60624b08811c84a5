"""The package's speed code: the pairwise Poincaré distance kernel, its native (C) parts, the
thread-count policy and CPU buffer reuse, kept apart from the maths they accelerate.

Modules: :mod:`~pml_hyperbolic.kernels.pairwise` (the all-pairs distance and its closed-form
backward), :mod:`~pml_hyperbolic.kernels.gram` (the Gram product and its accuracy guards),
:mod:`~pml_hyperbolic.kernels.tail` (the elementwise tail and the symmetric forward),
:mod:`~pml_hyperbolic.kernels.ops` (the kernels as ``torch.library`` custom ops),
:mod:`~pml_hyperbolic.kernels.lca` (HIER's LCA rows as custom ops),
:mod:`~pml_hyperbolic.kernels.native` (the native code's entry points),
:mod:`~pml_hyperbolic.kernels.build` (its build with ``torch.utils.cpp_extension``),
:mod:`~pml_hyperbolic.kernels.self_check`,
:mod:`~pml_hyperbolic.kernels.threads` (thread counts), :mod:`~pml_hyperbolic.kernels.spare_buffers`.
Everything here is private to the package except :func:`status`; the public entry point of the
distance is :func:`pml_hyperbolic.poincare_ball.pairwise_dist`.

Design note: docs/design/kernels.md
"""
from __future__ import annotations

from . import build

__all__ = ["status"]


def status() -> dict:
    """Which implementation the kernels run in this process, and why.

    Returns:
        ``{"pairwise": path, "hier_lca": path, "reason": str, "cpu_threads": str, "cuda_pairwise": str,
        "cuda_reason": str}`` with path ``"native"`` when the
        compiled kernels loaded and passed their self-check, else ``"torch"`` (the reference torch
        path) with the reason (disabled by ``PML_HYPERBOLIC_NATIVE=0``, no compiler, a failed build or
        self-check). ``"pairwise"``: the distance ops (``pml_hyperbolic::pairwise_poincare_dist``,
        ``::poincare_row_terms``); ``"hier_lca"``: HIER's LCA rows on CPU
        (``pml_hyperbolic::hier_lca_rows`` and its backward; off the CPU they always run the torch ops);
        ``"cpu_threads"``: ``"torch's intra-op threads"`` (the native kernels built with OpenMP, or the
        torch path) or ``"one"`` (a native build without OpenMP, see :func:`build.parallel`);
        ``"cuda_pairwise"``: the distance on CUDA tensors, ``"triton"``, ``"torch"`` or ``"none"`` (no
        CUDA device), with ``"cuda_reason"``.
    """
    text = build.status()
    path = "native" if text == "native" else "torch"
    reason = "compiled kernels loaded and self-checked" if path == "native" else text
    threads = "one" if path == "native" and not build.parallel() else "torch's intra-op threads"
    cuda, cuda_reason = _cuda_path()
    return {"pairwise": path, "hier_lca": path, "reason": reason, "cpu_threads": threads, "cuda_pairwise": cuda,
            "cuda_reason": cuda_reason}


def _cuda_path() -> tuple[str, str]:
    """Which path ``pairwise_dist`` takes on CUDA tensors, without importing Triton."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "none", "no CUDA device"
    if not build.switched_on("PML_HYPERBOLIC_TRITON"):
        return "torch", "PML_HYPERBOLIC_TRITON=0"
    if importlib.util.find_spec("triton") is None:
        return "torch", "Triton is not installed"
    return "triton", "fused Triton kernels (PML_HYPERBOLIC_TRITON=0 turns them off)"
