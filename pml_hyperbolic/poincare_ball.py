r"""Math of the Poincaré ball: small pure functions, one formula each.

The ball of curvature :math:`-c` (``c > 0``) is :math:`\{x \in \mathbb{R}^D : c\|x\|^2 < 1\}`,
of radius :math:`1/\sqrt{c}`. Every function takes the curvature ``c`` as a Python float, a 0-d
tensor (learnable: gradients flow to it), or a hypll ``Curvature`` / ``PoincareBall``.

hypll note: ``hypll.manifolds.poincare_ball.Curvature(value)`` is *not* c = value. hypll passes
``value`` through a constraining strategy (softplus by default), so ``Curvature(1.0)`` means
c = softplus(1) ≈ 1.313. These functions evaluate the hypll object, so they use the same c hypll
uses. To get exactly c = 1 from hypll write ``Curvature(1.0, constraining_strategy=lambda v: v)``,
or pass the float ``1.0`` here.

Numerics: half-precision inputs (and inputs under ``torch.autocast``) are computed in float32 and
returned in float32; float64 stays float64. The per-row scalar factors (‖x‖², the conformal
denominators 1 − c‖x‖², tanh/artanh factors) and the curvature are evaluated in float64 even for
float32 tensors: a Python ``c`` is never rounded to float32 (the default curvature rounded cost up to 1e-3
relative near the boundary), and 1 − c‖x‖² does not lose digits to a float32 ‖x‖².

Points on or outside the ball are projected by :func:`project` in the public classes. The kernels
themselves floor 1 − c‖x‖² at 2⁻⁶⁰ (``DENOM_FLOOR``; in float64 it acts exactly on points on or
outside the boundary): such a point gets large finite distances (as long as its squared norm is
finite in its dtype), never NaN or negative, and it does not change any other pair
(:func:`pairwise_dist` computes its pairs separately).

Inputs must be floating-point tensors (:func:`check_tensor`: integer, boolean and complex tensors
raise ``TypeError`` rather than being cast). These functions do not look for NaN/Inf values (a
reduction per call): NaN in gives NaN out. The public classes check (:func:`check_finite`).

Design note: docs/design/geometry.md
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Union

import torch
from torch import Tensor

from .kernels.build import assert_curvature_on_device, switched_on
from .kernels.build import values_checked  # noqa: F401 (part of this module's API)
from .kernels.gram import DENOM_FLOOR
from .kernels.ops import poincare_pairwise_dist

CurvatureLike = Union[float, Tensor, "torch.nn.Module"]

__all__ = [
    "C_RANGE",
    "as_curvature",
    "boundary_eps",
    "check_finite",
    "check_tensor",
    "compute_dtype",
    "project",
    "expmap0",
    "logmap0",
    "mobius_add",
    "dist",
    "pairwise_dist",
    "dist0",
    "conformal_factor",
    "to_lorentz",
    "from_lorentz",
    "lorentz_inner",
    "lorentz_dist",
]

# Relative margin kept between projected points and the boundary: the maximum norm is
# (1 - eps) / sqrt(c). float32 keeps 1e-5 so that points up to sqrt(c)|x| = 1 - 1e-3 (well inside
# what trained heads produce) are never moved; the conformal factor there is ~5e4, still finite.
_BOUNDARY_EPS = {torch.float32: 1e-5, torch.float64: 1e-10}

#: Accepted curvature magnitudes c (inclusive). Why bounded: √c and 1/√c (the ball's radius) must
#: stay normal float32 numbers, and outside this range every distance is 0 or inf in float32.
C_RANGE = (1e-12, 1e12)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels compute in: float64 stays, everything else is float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def boundary_eps(dtype: torch.dtype) -> float:
    """Relative margin to the boundary used by :func:`project` for ``dtype``."""
    return _BOUNDARY_EPS[compute_dtype(dtype)]


def check_tensor(x, name: str = "embeddings") -> Tensor:
    """Return ``x`` if it is a floating-point tensor on a real device.

    Why: integer, boolean and complex tensors would be cast silently (or fail deep inside torch),
    and the meta device has no values to compute with.

    Args:
        x: the input to check.
        name: what ``x`` is, for the message.

    Returns:
        ``x`` unchanged.

    Raises:
        TypeError: ``x`` is not a ``torch.Tensor``, or its dtype is not floating point.
        ValueError: ``x`` is on the meta device.
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__module__}.{type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (no values): move it to a real device first")
    return x


def _upcast(x: Tensor, name: str = "x") -> Tensor:
    check_tensor(x, name)
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def _check_range(value: float) -> None:
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"c (the curvature magnitude) must be finite and > 0, got {value}")
    if not C_RANGE[0] <= value <= C_RANGE[1]:
        raise ValueError(f"c (the curvature magnitude) must lie in [{C_RANGE[0]:g}, {C_RANGE[1]:g}] (the ball's "
                         f"radius 1/sqrt(c) and sqrt(c) stay normal float32 numbers), got {value!r}")


def as_curvature(c: CurvatureLike, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Tensor:
    """Return the positive curvature magnitude c as a 0-d tensor of ``dtype``.

    Accepts a Python number, a 0-d (or one-element) tensor, a hypll ``Curvature`` (evaluated
    through its constraining strategy), a hypll ``PoincareBall`` (its ``.c``) or a
    :class:`pml_hyperbolic.geometry.PoincareGeometry` (read without re-validation). A tensor keeps
    its autograd graph so that a learnable curvature receives gradients.

    A tensor on an accelerator is checked on the device (``torch._assert_async``), without a
    device-to-host copy: the error then surfaces at the next synchronisation.

    Raises:
        TypeError: c is of none of these types (a bool or a string included).
        ValueError: c is not finite, not strictly positive or outside :data:`C_RANGE` (the message
            names ``c``).
    """
    if getattr(c, "_is_pml_geometry", False):
        # a PoincareGeometry validated its curvature once at construction and its constraint keeps
        # it positive: read it without a device-to-host check on every call
        return c.curvature(dtype, device)
    if hasattr(c, "c") and isinstance(getattr(c, "c"), torch.nn.Module):  # hypll PoincareBall
        c = c.c
    if isinstance(c, torch.nn.Module):
        if not callable(c):
            raise TypeError(f"c: cannot read a curvature from {type(c).__name__}")
        c = c()
    if isinstance(c, Tensor):
        if c.numel() != 1:
            raise ValueError(f"c must be a scalar curvature, got a tensor of shape {tuple(c.shape)}")
        tensor = c.reshape(()).to(dtype=dtype, device=device if device is not None else c.device)
        if c.device.type != "cpu":
            # Validate on the device: reading the value back (float(c)) would synchronise the host
            # with the accelerator on every call. A bad c still raises, at the next synchronisation.
            assert_curvature_on_device(c)
            return tensor
        value = float(c.detach().reshape(()))
    elif isinstance(c, Real) and not isinstance(c, bool):
        value = float(c)
        tensor = None
    else:
        raise TypeError(
            f"c must be a float, a 0-d tensor, or a hypll Curvature/PoincareBall, got {type(c).__name__}"
        )
    _check_range(value)
    if tensor is None:
        tensor = torch.tensor(value, dtype=dtype, device=device)
    return tensor


def check_finite(x: Tensor, name: str = "embeddings") -> None:
    """Raise ``ValueError`` if ``x`` holds NaN or Inf (a silent NaN loss is worse than an error).
    Checked where :func:`values_checked` says so (CPU tensors; accelerator tensors on request).

    By the extremes: min and max propagate NaN and are infinite when any entry is, so one fused
    reduction answers, where ``isfinite(x).all()`` writes a boolean tensor of x's size first (every
    loss and the kNN search call this).

    Args:
        x: any tensor.
        name: what ``x`` is, for the message.

    Raises:
        ValueError: ``x`` holds a NaN or an infinity.
    """
    if x.numel() == 0 or not values_checked(x):
        return
    try:
        low, high = torch.aminmax(x.detach())
        finite = bool(torch.isfinite(low) & torch.isfinite(high))
    except RuntimeError:  # a dtype or device without aminmax
        finite = bool(torch.isfinite(x).all())
    if not finite:
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); cannot compute hyperbolic distances")


def _sq_norm(x: Tensor, keepdim: bool = True) -> Tensor:
    return x.pow(2).sum(dim=-1, keepdim=keepdim)


def _safe_norm(x: Tensor, keepdim: bool = True) -> Tensor:
    """‖x‖ whose gradient at x = 0 is 0, not NaN."""
    return torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim)


def _wide_dtype(x: Tensor) -> torch.dtype:
    """float64 for the scalar (per-row) factors, except where the device has none (MPS)."""
    return torch.float32 if x.device.type == "mps" else torch.float64


def _c_wide(c: CurvatureLike, x: Tensor) -> Tensor:
    """The curvature as a float64 0-d tensor: a Python c is not rounded to float32 (the default c in
    float32 is off by 1.5e-9, which 1 − c‖x‖² amplifies by up to 1/(1 − c‖x‖²) ~ 1e5)."""
    return as_curvature(c, _wide_dtype(x), x.device)


def _wide_norm(x: Tensor, keepdim: bool = True, huge: bool = False) -> Tensor:
    """‖x‖ in float64 (float32 inputs: exact squares, no cancellation downstream in 1 − c‖x‖²).

    ``huge``: float64 inputs are scaled by their largest entry first, so that norms above
    ~1e154 (whose squares overflow) stay finite."""
    wide = _wide_dtype(x)
    if x.dtype != wide:
        return torch.linalg.vector_norm(x.to(wide), dim=-1, keepdim=keepdim)
    if not huge:
        return torch.linalg.vector_norm(x, dim=-1, keepdim=keepdim)
    m = x.detach().abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    n = m * torch.linalg.vector_norm(x / m, dim=-1, keepdim=True)
    return n if keepdim else n.squeeze(-1)


def _denominator(c: Tensor, sq_norm: Tensor) -> Tensor:
    """1 − c‖x‖², floored at ``DENOM_FLOOR`` (2⁻⁶⁰): the same clamping as :func:`pairwise_dist`.
    In float64 it only acts on points on or outside the boundary."""
    return (1 - c * sq_norm).clamp_min(DENOM_FLOOR)


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a real number in [0, 1), got {type(eps).__name__} {eps!r}")
    if not 0.0 <= float(eps) < 1.0:
        raise ValueError(f"eps must lie in [0, 1) (the relative margin to the boundary), got {eps!r}")
    return float(eps)


def _eager_cpu(x: Tensor) -> bool:
    """A CPU tensor whose values may be read (:func:`values_checked`), outside ``torch.compile`` and
    tracing: a branch on its values costs no device sync and breaks no graph."""
    if x.device.type != "cpu" or not values_checked(x) or torch.jit.is_tracing():
        return False
    compiler = getattr(torch, "compiler", None)
    return not (compiler is not None and compiler.is_compiling())


def project(x: Tensor, c: CurvatureLike, eps: float | None = None) -> Tensor:
    r"""Project onto the open ball: :math:`x \cdot \min(1, r_{max}/\|x\|)`,
    :math:`r_{max} = (1-\epsilon)/\sqrt{c}`.

    Points already inside keep their value (and an identity gradient). The norm and the factor
    are computed in float64 (scaled by the largest entry for float64 input), so a huge point goes
    to the boundary margin in its own direction (a float32 norm overflows from ~1.8e19 on), and
    the gradient is finite for every finite point, tiny ones included.

    Args:
        x: floating-point points (…, D).
        c: the curvature (see :func:`as_curvature`).
        eps: relative margin in [0, 1); default :func:`boundary_eps` of the compute dtype (1e-5
            for float32, 1e-10 for float64).

    Returns:
        The projected points, of x's compute dtype.

    Raises:
        TypeError: ``x`` is not a floating-point tensor, or ``eps`` is not a number.
        ValueError: ``eps`` is outside [0, 1), or ``c`` is invalid.
    """
    x = _upcast(x)
    eps = boundary_eps(x.dtype) if eps is None else _check_eps(eps)
    c = _c_wide(c, x)
    max_norm = (1.0 - eps) / c.sqrt()
    norm = _wide_norm(x, huge=True)
    # A projected point's recomputed norm can round a few ulps above max_norm; the slack makes
    # project idempotent (project(project(x)) == project(x) bit for bit) and is far inside the ball.
    slack = 1.0 + 8.0 * torch.finfo(x.dtype).eps
    outside = norm > max_norm * slack
    if _eager_cpu(x) and not bool(outside.any()):
        # every point inside: the same values and the same (identity) gradient without the
        # product and its backward, a fixed cost of every distance call at PML's batch sizes
        return x.clone()
    # both branches finite for every point (no 0·inf in the gradient of a tiny point)
    safe_norm = torch.where(outside, norm, max_norm)
    scale = torch.where(outside, max_norm / safe_norm, torch.ones_like(norm))
    return x * scale.to(x.dtype)


def expmap0(v: Tensor, c: CurvatureLike) -> Tensor:
    r"""Exponential map at the origin: :math:`\exp_0(v) = \tanh(\sqrt{c}\|v\|)\,
    \frac{v}{\sqrt{c}\|v\|}`.

    Finite with an identity Jacobian at ``v = 0``. For large ``‖v‖`` the result rounds onto the
    boundary; follow with :func:`project` (as :class:`~pml_hyperbolic.heads.ToPoincare` does).
    """
    v = _upcast(v)
    sqrt_c = _c_wide(c, v).sqrt()
    # float64 norm: a float32 norm overflows from ~1.8e19 on and sent such v to the origin
    u = sqrt_c * _wide_norm(v, huge=True).clamp_min(torch.finfo(torch.float64).tiny)
    return v * (torch.tanh(u) / u).to(v.dtype)


def logmap0(y: Tensor, c: CurvatureLike) -> Tensor:
    r"""Logarithmic map at the origin: :math:`\log_0(y) = \operatorname{artanh}(\sqrt{c}\|y\|)\,
    \frac{y}{\sqrt{c}\|y\|}`; the inverse of :func:`expmap0` inside the ball."""
    y = _upcast(y)
    c = _c_wide(c, y)
    norm = _wide_norm(y)
    u = c.sqrt() * norm.clamp_min(torch.finfo(norm.dtype).tiny)
    # artanh(u) = arsinh(u/sqrt(1 - u²)) with 1 - u² = 1 - c‖y‖² from the float64 norm
    return y * (torch.asinh(u / _denominator(c, norm * norm).sqrt()) / u).to(y.dtype)


def mobius_add(x: Tensor, y: Tensor, c: CurvatureLike) -> Tensor:
    r"""Möbius addition

    .. math:: x \oplus_c y = \frac{(1 + 2c\langle x,y\rangle + c\|y\|^2)\,x + (1 - c\|x\|^2)\,y}
              {1 + 2c\langle x,y\rangle + c^2\|x\|^2\|y\|^2}.

    No additive epsilon in the denominator (it is ≥ (1 − c‖x‖‖y‖)² > 0 inside the ball), so
    ``0 ⊕ y = y`` exactly; the denominator is only clamped at the smallest normal number.
    """
    x, y = _upcast(x), _upcast(y)
    c = as_curvature(c, x.dtype, x.device)
    xy = (x * y).sum(dim=-1, keepdim=True)
    x2, y2 = _sq_norm(x), _sq_norm(y)
    num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
    den = (1 + 2 * c * xy + c * c * x2 * y2).clamp_min(torch.finfo(x.dtype).tiny)
    return num / den


def conformal_factor(x: Tensor, c: CurvatureLike, keepdim: bool = False) -> Tensor:
    r"""Conformal factor :math:`\lambda^c_x = 2 / (1 - c\|x\|^2)` (metric = λ² × Euclidean).

    :math:`1 - c\|x\|^2` is computed in float64 (then the result cast to x's dtype): in float32
    it loses digits near the boundary."""
    x = _upcast(x)
    xw = x.to(_wide_dtype(x))
    c = as_curvature(c, xw.dtype, x.device)
    den = (1.0 - c * _sq_norm(xw, keepdim=keepdim)).clamp_min(torch.finfo(x.dtype).tiny)
    return (2.0 / den).to(x.dtype)


def _asinh_dist(sq_diff: Tensor, x2: Tensor, y2: Tensor, c: Tensor) -> Tensor:
    tiny = torch.finfo(sq_diff.dtype).tiny
    a = (1 - c * x2).clamp_min(tiny)
    b = (1 - c * y2).clamp_min(tiny)
    return (2 / c.sqrt()) * torch.asinh(torch.sqrt(c * sq_diff / (a * b)))


def dist(x: Tensor, y: Tensor, c: CurvatureLike) -> Tensor:
    r"""Row-wise geodesic distance (broadcasting over leading dims)

    .. math:: d_c(x, y) = \frac{2}{\sqrt{c}} \operatorname{arsinh}\left(
              \frac{\sqrt{c}\,\|x - y\|}{\sqrt{(1 - c\|x\|^2)(1 - c\|y\|^2)}}\right),

    which equals the usual :math:`\frac{2}{\sqrt c}\operatorname{artanh}(\sqrt c\|{-x}\oplus y\|)`
    but needs no Möbius addition, is exact for close points (``‖x − y‖`` is formed directly) and
    has a zero (not NaN) gradient at ``x = y``.
    """
    x, y = _upcast(x), _upcast(y)
    out_dtype = torch.promote_types(x.dtype, y.dtype)
    c = _c_wide(c, x)
    diff_norm = _safe_norm(x - y, keepdim=False)
    # the conformal denominators in float64: 1 − c‖x‖² from a float32 ‖x‖² lost up to 7e-4
    # relative near the boundary (the fused pairwise_dist never did)
    a = _denominator(c, _wide_norm(x, keepdim=False) ** 2)
    b = _denominator(c, _wide_norm(y, keepdim=False) ** 2)
    arg = diff_norm.to(c.dtype) * (c.sqrt() / torch.sqrt(a * b))
    return ((2 / c.sqrt()) * torch.asinh(arg)).to(out_dtype)


def _triton_requested() -> bool:
    """CUDA tensors take the Triton kernels unless ``PML_HYPERBOLIC_TRITON=0`` (read at every call)."""
    return switched_on("PML_HYPERBOLIC_TRITON")


def pairwise_dist(x: Tensor, y: Tensor, c: CurvatureLike) -> Tensor:
    r"""All-pairs distance matrix: ``x`` (N×D), ``y`` (M×D) → N×M, with
    :math:`D_{ij} = d_c(x_i, y_j)` as in :func:`dist`.

    Never materialises N×M×D. The squared differences come from one matrix product; pairs for
    which that product cancels catastrophically (nearby points, the diagonal of ``(x, x)``) are
    detected and recomputed from explicit differences, so that the result is accurate for every
    pair and the gradient is finite (zero at ``x_i = y_j``). Backward is closed form: two matrix
    products, or one when ``x`` is ``y`` (PML's ``compute_mat(emb, emb)``); the gradient reaches a
    learnable ``c`` too. See :mod:`pml_hyperbolic.kernels.pairwise` for the algebra.

    Twice differentiable: a backward run with ``create_graph=True`` (a gradient penalty) takes a
    slower composite float64 path whose graph can be differentiated again. Points on or outside
    the boundary get :func:`dist`'s values (same denominator floor) and leave the other pairs
    untouched.

    On CUDA tensors the call goes to the fused Triton kernels
    (:func:`pml_hyperbolic.kernels.triton_pairwise.pairwise_poincare_dist_triton`) when Triton is
    installed; ``PML_HYPERBOLIC_TRITON=0`` keeps the torch path (design note: docs/design/gpu-kernel.md).
    """
    if isinstance(x, Tensor) and x.device.type == "cuda" and _triton_requested():
        from .kernels.triton_pairwise import pairwise_poincare_dist_triton, triton_available

        if triton_available(x.device):
            return pairwise_poincare_dist_triton(x, y, _c_wide(c, x))
    x, y = _upcast(x), _upcast(y)
    if x.dtype != y.dtype:
        x, y = x.double(), y.double()
    return poincare_pairwise_dist(x, y, _c_wide(c, x))


def dist0(x: Tensor, c: CurvatureLike) -> Tensor:
    r"""Distance to the origin: :math:`d_c(0, x) = \frac{2}{\sqrt{c}}\operatorname{artanh}
    (\sqrt{c}\|x\|)` (returns shape ``x.shape[:-1]``)."""
    x = _upcast(x)
    c = _c_wide(c, x)
    norm = _wide_norm(x, keepdim=False)
    # = dist(0, x): 2/√c · arsinh(√c‖x‖/sqrt(1 − c‖x‖²)), in float64, same clamping
    return ((2 / c.sqrt()) * torch.asinh(c.sqrt() * norm / _denominator(c, norm * norm).sqrt())).to(x.dtype)


def to_lorentz(x: Tensor, c: CurvatureLike) -> Tensor:
    r"""Isometric lift to the hyperboloid :math:`\{X : -X_0^2 + \|X_{1:}\|^2 = -1/c, X_0 > 0\}`:

    .. math:: X = \left(\frac{1 + c\|x\|^2}{\sqrt{c}\,(1 - c\|x\|^2)},\;
              \frac{2x}{1 - c\|x\|^2}\right).

    Computed in float64 and cast to x's dtype (:math:`1 - c\|x\|^2` in float32 loses digits near
    the boundary). :math:`1 - c\|x\|^2` is floored at ``DENOM_FLOOR`` as in :func:`dist` (it only
    acts on points on or outside the boundary, which have no lift: they get a large finite one).
    """
    x = _upcast(x)
    xw = x.to(_wide_dtype(x))
    c = as_curvature(c, xw.dtype, x.device)
    cx2 = c * _sq_norm(xw)
    den = (1 - cx2).clamp_min(DENOM_FLOOR)
    return torch.cat([(1 + cx2) / (c.sqrt() * den), 2 * xw / den], dim=-1).to(x.dtype)


def from_lorentz(X: Tensor, c: CurvatureLike) -> Tensor:
    r"""Inverse of :func:`to_lorentz`: :math:`x = X_{1:} / (1 + \sqrt{c} X_0)`."""
    X = _upcast(X)
    sqrt_c = as_curvature(c, X.dtype, X.device).sqrt()
    return X[..., 1:] / (1 + sqrt_c * X[..., :1])


def lorentz_inner(X: Tensor, Y: Tensor) -> Tensor:
    r"""Minkowski inner product :math:`\langle X, Y\rangle_L = -X_0Y_0 + \sum_{k\ge1} X_kY_k`
    (row-wise)."""
    prod = X * Y
    return prod[..., 1:].sum(-1) - prod[..., 0]


def lorentz_dist(X: Tensor, Y: Tensor, c: CurvatureLike) -> Tensor:
    r"""Hyperboloid distance :math:`d = \frac{1}{\sqrt c}\operatorname{arcosh}(-c\langle X,Y
    \rangle_L)`, the same value as :func:`dist` on the corresponding ball points.

    Evaluated in the stable ball form, not through arcosh (whose argument cancels catastrophically
    near 1: float32 ``lorentz_dist(X, X)`` was 0.35 at radius 0.999): with
    :math:`a = 1 - c\|x\|^2 = 2/(1 + \sqrt c X_0)` and :math:`x = X_{1:}\,a/2`,
    :math:`d = \frac{2}{\sqrt c}\operatorname{arsinh}\big(\sqrt c\|x - y\|/\sqrt{ab}\big)`,
    computed in float64. ``lorentz_dist(X, X)`` is exactly 0, and the result equals :func:`dist`
    on ``from_lorentz`` of the inputs up to the rounding of ``X`` itself."""
    out_dtype = torch.promote_types(_upcast(X).dtype, _upcast(Y).dtype)
    wide = _wide_dtype(X)
    X, Y = X.to(wide), Y.to(wide)
    c = _c_wide(c, X)
    sqrt_c = c.sqrt()
    # 1 + √c X0 = 2/a ≥ 2 on the upper sheet; clamped so that an off-sheet input cannot divide by 0
    ka = (1 + sqrt_c * X[..., :1]).clamp_min(2.0)
    kb = (1 + sqrt_c * Y[..., :1]).clamp_min(2.0)
    diff = _safe_norm(X[..., 1:] / ka - Y[..., 1:] / kb, keepdim=False)
    arg = sqrt_c * diff * torch.sqrt(ka[..., 0] * kb[..., 0] / 4)
    return ((2 / sqrt_c) * torch.asinh(arg)).to(out_dtype)
