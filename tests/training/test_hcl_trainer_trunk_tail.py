"""``train_only_the_tail`` (HCL's glyph preset, ``--trunk-train tail``): only the last block and
conv_head keep gradients, BatchNorm uses its running statistics in training mode too, and a trunk
that is not an EfficientNet-family model gets one clear error."""
import pytest
import torch

from pml_hyperbolic.backbones import build_backbone
from pml_hyperbolic.training.hcl_trainer import train_only_the_tail


def test_only_the_last_block_and_conv_head_train():
    trunk, _ = build_backbone("efficientnet_lite0", pretrained=False)
    n = train_only_the_tail(trunk)
    trainable = {name.split(".")[0] + ("." + name.split(".")[1] if name.startswith("blocks.") else "")
                 for name, p in trunk.named_parameters() if p.requires_grad}
    assert trainable == {f"blocks.{len(trunk.blocks) - 1}", "conv_head"}
    assert n == sum(p.numel() for p in trunk.parameters() if p.requires_grad) > 0
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in trunk.modules())


def test_batchnorm_uses_running_statistics_in_training_mode():
    torch.manual_seed(0)
    trunk, _ = build_backbone("efficientnet_lite0", pretrained=False)
    train_only_the_tail(trunk)
    x = torch.randn(4, 3, 48, 48)
    trunk.eval()
    with torch.no_grad():
        want = trunk(x)
    trunk.train()
    out = trunk(x)
    assert torch.allclose(out, want, atol=1e-5)  # no batch statistics, no running-stat update
    out.sum().backward()
    assert trunk.conv_head.weight.grad is not None and trunk.conv_stem.weight.grad is None


def test_not_an_efficientnet_is_refused():
    with pytest.raises(ValueError, match="EfficientNet"):
        train_only_the_tail(torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3)))
