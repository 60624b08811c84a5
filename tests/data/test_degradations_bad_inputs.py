"""Property sweep of RandomDegradation and the blur helpers on bad input: one clear
ValueError/TypeError naming the argument, never a crash inside torch or a silent wrong image."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pml_hyperbolic.data.degradations import RandomDegradation, gaussian_blur, gaussian_blur_batch, gaussian_kernel1d

SWEEP = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
NAN, INF = float("nan"), float("inf")
BAD = [0, -1, NAN, INF, -INF, "0.5", True, None, 1e308, 1e-320, [0.1], (0.2, 0.1), (NAN, 0.1), (0.1, INF),
       (-0.1, 0.1), ("a", "b"), (True, True), (0.1, 0.2, 0.3)]


def assert_clear(fn, *names):
    with pytest.raises((ValueError, TypeError)) as err:
        fn()
    msg = str(err.value).lower()
    assert any(n.lower() in msg for n in names), f"{err.type.__name__}: {err.value} (expected one of {names})"


@SWEEP
@given(param=st.sampled_from(["blur_sigma", "noise_std", "occlusion_side"]), value=st.sampled_from(BAD))
def test_bad_ranges_are_clear_errors(param, value):
    if param == "noise_std" and value == (0.1, INF):
        pass  # an infinite noise std is rejected too: the images would be all Inf
    assert_clear(lambda: RandomDegradation(**{param: value}), param)


@SWEEP
@given(value=st.sampled_from([NAN, INF, -INF, "0", True, None, [0.0]]))
def test_bad_occlusion_value(value):
    assert_clear(lambda: RandomDegradation(occlusion_value=value), "occlusion_value")


@pytest.mark.parametrize("kinds", [[], ["blur", "snow"], "blur", [1], None, ["blur", "blur"]])
def test_bad_kinds(kinds):
    assert_clear(lambda: RandomDegradation(kinds=kinds), "kinds")


@pytest.mark.parametrize("what", ["3-D", "list", "int", "bool", "generator"])
def test_bad_call(what):
    images = torch.randn(4, 3, 8, 8)
    deg = RandomDegradation()
    if what == "generator":
        assert_clear(lambda: deg(images, generator=7), "generator")
        return
    bad = {"3-D": images[0], "list": images.tolist(), "int": (images * 10).long(), "bool": images > 0}[what]
    assert_clear(lambda: deg(bad), "(B, C, H, W)", "floating", "images")


def test_empty_batch_is_returned_unchanged():
    images = torch.randn(0, 3, 8, 8)
    assert RandomDegradation()(images).shape == (0, 3, 8, 8)


def test_tiny_sigma():
    assert_clear(lambda: gaussian_kernel1d(1e-320), "sigma")  # would round to 0 in float32: 0/0
    assert torch.equal(gaussian_kernel1d(1e-3), torch.tensor([0.0, 1.0, 0.0]))
    image = torch.randn(3, 8, 8)
    assert torch.equal(gaussian_blur(image, 1e-320), image)  # float64 taps: the identity


@SWEEP
@given(sigma=st.sampled_from([0, -1, NAN, INF, "1", True, None, 1e308, [1.0]]))
def test_bad_sigma(sigma):
    assert_clear(lambda: gaussian_kernel1d(sigma), "sigma")
    assert_clear(lambda: gaussian_blur(torch.randn(3, 8, 8), sigma), "sigma")


@pytest.mark.parametrize("what", ["NaN", "Inf", "zero", "wrong count", "2-D sigmas"])
def test_bad_batch_sigmas(what):
    images = torch.randn(2, 3, 8, 8)
    sig = {"NaN": torch.tensor([1.0, NAN]), "Inf": torch.tensor([1.0, INF]), "zero": torch.tensor([1.0, 0.0]),
           "wrong count": torch.tensor([1.0]), "2-D sigmas": torch.ones(2, 2)}[what]
    assert_clear(lambda: gaussian_blur_batch(images, sig), "sigmas")


@pytest.mark.parametrize("shape", [(3, 8, 8), (8, 8), (1, 1, 3, 8, 8)])
def test_blur_batch_needs_a_batch(shape):
    assert_clear(lambda: gaussian_blur_batch(torch.randn(shape), torch.ones(1)), "images", "(B, C, H, W)")


def test_blur_needs_an_image():
    assert_clear(lambda: gaussian_blur(torch.randn(8, 8), 1.0), "image", "(C, H, W)")
