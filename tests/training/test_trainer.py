"""HyperbolicTrainer: unscale-before-clip under a GradScaler, float32 losses, step budget."""
import pytest
import torch
from pytorch_metric_learning.losses import ContrastiveLoss

from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.heads import HyperbolicEmbeddingHead
from pml_hyperbolic.training.runner import check_batch_settings, freeze_patch_embedding, select_device
from pml_hyperbolic.training.config import ConfigError
from pml_hyperbolic.training.trainer import HyperbolicTrainer, resolve_amp


class Blobs(torch.utils.data.Dataset):
    def __init__(self, n=64, d=8, classes=8):
        g = torch.Generator().manual_seed(0)
        self.labels = torch.arange(n) % classes
        self.x = torch.randn(classes, d, generator=g)[self.labels] * 3 + torch.randn(n, d, generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.x[i], self.labels[i]


def make_trainer(**kwargs):
    torch.manual_seed(0)
    trunk = torch.nn.Linear(8, 16)
    head = HyperbolicEmbeddingHead(16, 4, c=0.1)
    opts = {"trunk_optimizer": torch.optim.SGD(trunk.parameters(), lr=0.1),
            "embedder_optimizer": torch.optim.SGD(head.parameters(), lr=0.1)}
    return HyperbolicTrainer(models={"trunk": trunk, "embedder": head}, optimizers=opts, batch_size=16,
                             loss_funcs={"metric_loss": ContrastiveLoss(distance=PoincareDistance(c=0.1))},
                             dataset=Blobs(), data_device=torch.device("cpu"), dataloader_num_workers=0,
                             show_progress=False, **kwargs)


def test_clipping_sees_unscaled_gradients():
    trainer = make_trainer(use_grad_scaler=True, grad_clip_norm=1e-3, max_steps=1)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    seen = {}
    original = trainer.clip_gradients

    def spy():
        original()
        params = list(trainer.trainable_parameters())
        seen["norm"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    trainer.clip_gradients = spy
    trainer.train(1, 1)
    # Clipping scaled gradients would leave a norm of up to 65536 × 1e-3 after unscaling; the
    # correct order gives at most the threshold.
    assert seen["norm"] <= 1e-3 * 1.001
    assert trainer.global_step == 1


def test_max_steps_spans_epochs():
    trainer = make_trainer(max_steps=5, iterations_per_epoch=2)
    trainer.train(1, 10)
    assert trainer.global_step == 5


def test_loss_is_float32_under_bf16_autocast():
    trainer = make_trainer(amp_dtype=torch.bfloat16, max_steps=2)
    seen = {"trunk": [], "loss_in": [], "loss_out": [], "autocast_in_loss": [], "total": []}
    trainer.models["trunk"].register_forward_hook(lambda m, i, o: seen["trunk"].append(o.dtype))
    loss_fn = trainer.loss_funcs["metric_loss"]

    def loss_hook(module, inputs, output):
        seen["loss_in"].append((inputs[0].detach().clone(), inputs[1].clone()))
        seen["loss_out"].append(output)
        seen["autocast_in_loss"].append(torch.is_autocast_enabled("cpu"))

    handle = loss_fn.register_forward_hook(loss_hook)
    original_backward = trainer.backward

    def spy_backward():
        seen["total"].append(trainer.losses["total_loss"])
        original_backward()

    trainer.backward = spy_backward
    trainer.train(1, 1)
    handle.remove()
    assert trainer.global_step == 2
    # the models really ran under bf16 autocast (otherwise this test would prove nothing) ...
    assert seen["trunk"] == [torch.bfloat16, torch.bfloat16]
    # ... while the loss saw float32 embeddings, outside autocast, and returned a float32 loss
    assert seen["autocast_in_loss"] == [False, False]
    assert len(seen["loss_out"]) == 2 and len(seen["total"]) == 2
    for (emb, labels), out, total in zip(seen["loss_in"], seen["loss_out"], seen["total"]):
        assert emb.dtype == torch.float32
        assert torch.is_tensor(out) and out.dtype == torch.float32 and out.ndim == 0
        assert bool(torch.isfinite(out)) and out.requires_grad
        assert torch.is_tensor(total) and total.dtype == torch.float32 and bool(torch.isfinite(total))
        assert total.item() == pytest.approx(out.item())  # loss weight 1: total = metric loss
        # the same loss recomputed in plain float32 from the embeddings it was given
        assert out.item() == pytest.approx(loss_fn(emb, labels).item(), rel=1e-6, abs=1e-7)
    emb = trainer.compute_embeddings(torch.randn(4, 8))
    assert emb.dtype == torch.float32


def test_resolve_amp():
    assert resolve_amp("auto", torch.device("cpu")) == (None, False)
    assert resolve_amp("bf16", torch.device("cpu")) == (torch.bfloat16, False)
    assert resolve_amp("fp16", torch.device("cuda")) == (torch.float16, True)
    from pml_hyperbolic.training.config import ConfigError

    with pytest.raises(ConfigError, match="fp16 needs a CUDA device"):  # not a silent bf16 run
        resolve_amp("fp16", torch.device("cpu"))
    with pytest.raises(ValueError, match="amp"):
        resolve_amp("fp8", torch.device("cpu"))


def test_batch_settings_errors_say_what_to_do():
    assert check_batch_settings(294, 3) == 294
    assert check_batch_settings(120, 4, world_size=2) == 60
    with pytest.raises(ConfigError, match="not divisible by --samples-per-class 3.*--batch-size 291"):
        check_batch_settings(293, 3)
    with pytest.raises(ConfigError, match="number of processes"):
        check_batch_settings(9, 3, world_size=2)
    with pytest.raises(ConfigError, match="fewer than 2 classes"):
        check_batch_settings(4, 4)


def test_device_selection():
    assert select_device("cpu").type == "cpu"
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available.*--device cpu"):
            select_device("cuda")
    with pytest.raises(ConfigError, match="--device"):
        select_device("tpu")


def test_freeze_patch_embedding():
    import timm

    vit = timm.create_model("test_vit", pretrained=False, num_classes=0, img_size=32)
    assert freeze_patch_embedding(vit) > 0
    frozen = [n for n, p in vit.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("patch_embed") for n in frozen)
