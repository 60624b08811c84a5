"""ToPoincare / HyperbolicEmbeddingHead / SphericalEmbeddingHead."""
import math

import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead, ToPoincare


def test_to_poincare_smoke_and_formula():
    torch.manual_seed(0)
    x = torch.randn(10, 8, dtype=torch.float64) * 3
    head = ToPoincare(c=0.1, clip_r=2.3)
    out = head(x)
    assert out.shape == x.shape and out.dtype == torch.float64
    clipped = x * torch.clamp(2.3 / x.norm(dim=1, keepdim=True), max=1.0)
    torch.testing.assert_close(out, pb.project(pb.expmap0(clipped, 0.1), 0.1))


def test_clipping_bounds_the_tangent_norm():
    x = torch.randn(20, 5, dtype=torch.float64) * 100
    out = ToPoincare(c=1.0, clip_r=1.5)(x)
    # the tangent vector has norm exactly clip_r, so the ball norm is tanh(1.5)
    torch.testing.assert_close(out.norm(dim=1), torch.full((20,), math.tanh(1.5), dtype=torch.float64))
    small = torch.randn(3, 5, dtype=torch.float64) * 0.01  # below the radius: untouched
    torch.testing.assert_close(ToPoincare(c=1.0, clip_r=1.5)(small), pb.expmap0(small, 1.0))


def test_clip_r_none_disables_clipping():
    x = torch.randn(6, 4, dtype=torch.float64) * 0.5
    torch.testing.assert_close(ToPoincare(c=1.0, clip_r=None)(x), pb.project(pb.expmap0(x, 1.0), 1.0))


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, float("nan")])
def test_non_positive_clip_r_is_an_error(bad):
    with pytest.raises(ValueError, match="clip_r"):
        ToPoincare(clip_r=bad)
    with pytest.raises(ValueError, match="clip_r"):
        HyperbolicEmbeddingHead(4, 2, clip_r=bad)


@pytest.mark.parametrize("bad", [0.0, -0.1, float("inf")])
def test_bad_curvature(bad):
    with pytest.raises(ValueError, match=r"\bc\b"):
        ToPoincare(c=bad)


@pytest.mark.parametrize("c", [1e-3, 0.1, 1.0, 10.0])
def test_output_lands_inside_the_ball(c):
    x = torch.randn(50, 16) * 1e3
    for clip_r in (None, 2.3):
        out = ToPoincare(c=c, clip_r=clip_r)(x)
        assert torch.isfinite(out).all()
        assert torch.all(math.sqrt(c) * out.double().norm(dim=1) < 1)


def test_learnable_curvature_gets_gradients():
    head = ToPoincare(c=0.1, learnable_c=True)
    assert float(head.c.detach()) == pytest.approx(0.1)
    params = list(head.parameters())
    assert len(params) == 1
    x = torch.randn(8, 4, requires_grad=True)
    pb.pairwise_dist(head(x), head(x), head.c).sum().backward()
    assert torch.isfinite(params[0].grad) and params[0].grad != 0
    assert "learnable_c=True" in repr(head)


def test_fixed_curvature_has_no_parameters():
    assert [p for p in ToPoincare(c=0.1).parameters() if p.requires_grad] == []


def test_hyperbolic_head_init_and_shapes():
    torch.manual_seed(0)
    head = HyperbolicEmbeddingHead(32, 16, c=0.1)
    w = head.linear.weight
    assert w.shape == (16, 32)
    torch.testing.assert_close(w @ w.T, torch.eye(16), atol=1e-5, rtol=0)  # semi-orthogonal rows
    assert torch.all(head.linear.bias == 0)
    out = head(torch.randn(7, 32))
    assert out.shape == (7, 16) and isinstance(out, torch.Tensor) and type(out) is torch.Tensor
    assert torch.all(math.sqrt(0.1) * out.norm(dim=1) < 1)
    assert float(head.c) == pytest.approx(0.1)
    assert HyperbolicEmbeddingHead(8).linear.out_features == 128  # default out_features


def test_hyperbolic_head_learnable_c_and_backward():
    head = HyperbolicEmbeddingHead(12, 6, c=0.5, learnable_c=True)
    x = torch.randn(9, 12)
    emb = head(x)
    pb.pairwise_dist(emb, emb, head.c).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())
    assert head.geometry.c.value.grad != 0


def test_spherical_head():
    head = SphericalEmbeddingHead(20, 10)
    w = head.linear.weight
    torch.testing.assert_close(w @ w.T, torch.eye(10), atol=1e-5, rtol=0)
    assert torch.all(head.linear.bias == 0)
    out = head(torch.randn(5, 20))
    assert out.shape == (5, 10)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(5))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_and_autocast_inputs(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 12)
    hyp, sph = HyperbolicEmbeddingHead(12, 4), SphericalEmbeddingHead(12, 4)
    out = ToPoincare(c=0.1)(x.to(dtype) * 50)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    with torch.autocast("cpu", dtype=dtype):
        for head in (hyp, sph):
            emb = head(x)
            assert emb.dtype == torch.float32 and torch.isfinite(emb).all()
    with torch.autocast("cpu", dtype=dtype):
        loss = pb.pairwise_dist(hyp(x), hyp(x), 0.1).sum()
    loss.backward()
    assert torch.isfinite(hyp.linear.weight.grad).all()


def test_gradcheck_to_poincare():
    x = (torch.randn(5, 3, dtype=torch.float64) * 2).requires_grad_()
    head = ToPoincare(c=0.7, clip_r=1.5)
    assert torch.autograd.gradcheck(head, (x,))


def test_gradients_finite_at_zero_features():
    x = torch.zeros(3, 4, requires_grad=True)
    ToPoincare(c=0.1)(x).sum().backward()
    assert torch.isfinite(x.grad).all()


# ---- readable signatures ---------------------------------------------------------------------
def _help_text(obj) -> str:
    import io
    import pydoc

    out = io.StringIO()
    pydoc.Helper(output=out).help(obj)
    return out.getvalue()


@pytest.mark.parametrize("cls", [ToPoincare, HyperbolicEmbeddingHead])
def test_help_shows_the_unset_default_readably(cls):
    text = _help_text(cls)
    assert "object at 0x" not in text
    assert "clip_r: 'float | None | _Unset' = <unset>" in text


def test_unset_sentinel_is_one_picklable_object():
    import copy
    import pickle

    from pml_hyperbolic.heads.to_poincare import _UNSET, _Unset

    assert repr(_UNSET) == "<unset>"
    assert _Unset() is _UNSET
    assert pickle.loads(pickle.dumps(_UNSET)) is _UNSET
    assert copy.copy(_UNSET) is _UNSET and copy.deepcopy(_UNSET) is _UNSET
    # a head built with every default still resolves the unset arguments to the package defaults
    head = ToPoincare()
    assert head.clip_r == pytest.approx(2.3) and head.geometry.clip == "hard"
    assert not head.geometry.learnable_c


# ---- argument and input validation ----

@pytest.mark.parametrize("clip_r, error", [("abc", TypeError), ("2.3", TypeError), (True, TypeError),
                                           (0.0, ValueError), (-1.0, ValueError), (math.nan, ValueError),
                                           (math.inf, ValueError)])
def test_to_poincare_clip_r_must_be_a_positive_finite_number(clip_r, error):
    with pytest.raises(error, match="clip_r"):
        ToPoincare(clip_r=clip_r)


@pytest.mark.parametrize("kwargs, error, name", [
    (dict(in_features=0), ValueError, "in_features"),
    (dict(in_features=8, out_features=0), ValueError, "out_features"),
    (dict(in_features=-3), ValueError, "in_features"),
    (dict(in_features=8.0), TypeError, "in_features"),
    (dict(in_features=True), TypeError, "in_features"),
    (dict(in_features=8, out_features="4"), TypeError, "out_features"),
    (dict(in_features=8, radial_hidden=0), ValueError, "radial_hidden"),
    (dict(in_features=8, radial_init_logit=math.nan), ValueError, "radial_init_logit"),
    (dict(in_features=8, radial_init_logit=math.inf), ValueError, "radial_init_logit"),
    (dict(in_features=8, radial_init_logit="0"), TypeError, "radial_init_logit"),
])
def test_head_arguments_are_validated_naming_them(kwargs, error, name):
    with pytest.raises(error, match=name):
        HyperbolicEmbeddingHead(**kwargs)
    if "radial" not in name:
        with pytest.raises(error, match=name):
            SphericalEmbeddingHead(**{k: v for k, v in kwargs.items() if not k.startswith("radial")})


@pytest.mark.parametrize("head_cls", [HyperbolicEmbeddingHead, SphericalEmbeddingHead])
def test_head_input_errors_name_the_expected_and_given_shape_and_dtype(head_cls):
    head = head_cls(8, 4)
    with pytest.raises(ValueError, match=r"expects input of shape \(\.\.\., 8\).*got \(2, 7\)"):
        head(torch.zeros(2, 7))
    with pytest.raises(TypeError, match="dtype torch.float32, got input of dtype torch.float64"):
        head(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int64"):
        head(torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        head([[0.0] * 8])
    with pytest.raises(ValueError, match="meta device"):
        head(torch.zeros(2, 8, device="meta"))


def test_head_under_autocast_still_takes_the_autocast_dtype():
    head = HyperbolicEmbeddingHead(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(torch.randn(3, 8).bfloat16())
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
