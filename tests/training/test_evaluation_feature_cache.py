"""The tester's frozen-trunk feature cache, the CPU trunk chunking and the evaluation progress lines."""
import pytest
import torch

from pml_hyperbolic.training.evaluation import (
    SkippingEmbeddingSpaceTester, build_tester, has_deterministic_transform, parameter_fingerprint)
from pml_hyperbolic.training.trainer import (
    HyperbolicTrainer, chunked_forward_applies, forward_in_chunks, progress_enabled)


class CountingTrunk(torch.nn.Module):
    """A small CNN in eval mode that counts the images it sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                       torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
        self.images_seen = 0
        self.batch_sizes = []

    def forward(self, x):
        self.images_seen += x.shape[0]
        self.batch_sizes.append(x.shape[0])
        return self.net(x)


class ImageTensors(torch.utils.data.Dataset):
    """Fixed images; ``transform`` is applied to each like a real dataset's."""

    def __init__(self, n, transform=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.rand(n, 3, 8, 8, generator=g)
        self.labels = torch.arange(n) % 5
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        image = self.images[i]
        return (self.transform(image) if self.transform else image), int(self.labels[i])


class AddNoise:
    """A random transform (its name is not one of the deterministic ones)."""

    def __call__(self, x):
        return x + 0.01 * torch.randn_like(x)


def frozen_trunk_and_head():
    trunk = CountingTrunk().requires_grad_(False).eval()
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 4)
    return trunk, head


def test_forward_in_chunks_splits_near_equally_and_matches():
    trunk, _ = frozen_trunk_and_head()
    x = torch.rand(120, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    whole = trunk(x)
    trunk.batch_sizes.clear()
    chunked = forward_in_chunks(trunk, x, 64)
    assert trunk.batch_sizes == [60, 60]  # ceil(120 / 64) = 2 near-equal chunks, not 64 + 56
    assert torch.allclose(chunked, whole, rtol=0, atol=1e-6)
    trunk.batch_sizes.clear()
    forward_in_chunks(trunk, x[:50], 64)
    assert trunk.batch_sizes == [50]


def test_forward_in_chunks_rejects_a_bad_chunk_size():
    trunk, _ = frozen_trunk_and_head()
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        forward_in_chunks(trunk, torch.rand(4, 3, 8, 8), 0)


def test_chunking_applies_only_to_an_eval_mode_frozen_model_on_cpu_batches_above_a_chunk():
    trunk, head = frozen_trunk_and_head()
    x = torch.rand(100, 3, 8, 8)
    assert chunked_forward_applies(trunk, x, 64)
    assert not chunked_forward_applies(trunk, x[:64], 64)
    assert not chunked_forward_applies(trunk, x, None)
    trunk.train()  # batch statistics: rows depend on the whole batch
    assert not chunked_forward_applies(trunk, x, 64)
    trunk.eval()
    trunk.net[0].weight.requires_grad_(True)
    assert not chunked_forward_applies(trunk, x, 64)
    assert chunked_forward_applies(trunk, x, 64, require_frozen=False)


def test_deterministic_transform_detection():
    from pml_hyperbolic.data import build_transforms

    assert has_deterministic_transform(ImageTensors(3, transform=build_transforms("glyph", train=False, image_size=16)))
    assert has_deterministic_transform(ImageTensors(3, transform=build_transforms("imagenet", train=False)))
    assert not has_deterministic_transform(ImageTensors(3, transform=build_transforms("glyph", train=True)))
    assert not has_deterministic_transform(ImageTensors(3, transform=AddNoise()))
    assert has_deterministic_transform(ImageTensors(3))  # transform None: the stored images as they are
    wrapped = torch.utils.data.Subset(ImageTensors(3, transform=AddNoise()), [0, 1])
    assert not has_deterministic_transform(wrapped)  # found through the Subset
    assert not has_deterministic_transform(torch.utils.data.TensorDataset(torch.rand(3, 2)))  # unknown


def test_parameter_fingerprint_sees_every_kind_of_write():
    trunk, _ = frozen_trunk_and_head()
    before = parameter_fingerprint(trunk)
    assert parameter_fingerprint(trunk) == before
    with torch.no_grad():
        trunk.net[0].bias.add_(1.0)  # in place: version counter
    after_inplace = parameter_fingerprint(trunk)
    assert after_inplace != before
    trunk.net[0].bias.data[0] += 1.0  # through .data: only the checksum sees it
    assert parameter_fingerprint(trunk) != after_inplace
    state = {k: v.clone() for k, v in trunk.state_dict().items()}
    state["net.1.running_mean"] += 0.5
    current = parameter_fingerprint(trunk)
    trunk.load_state_dict(state)
    assert parameter_fingerprint(trunk) != current


def run_test(tester, trunk, head, dataset):
    def keep(t):  # the tester deletes its embeddings after testing
        t.kept = {k: v[0].clone() for k, v in t.embeddings_and_labels.items()}

    tester.end_of_testing_hook = keep
    accuracies = tester.test({"query": dataset}, 0, trunk, head, splits_to_eval=[("query", ["query"])])
    return tester.kept["query"], accuracies["query"]


def test_second_evaluation_reuses_trunk_features_bit_identically():
    trunk, head = frozen_trunk_and_head()
    dataset = ImageTensors(90)
    cached = build_tester(c=None, k_values=(1, 2), batch_size=32, device=torch.device("cpu"), trunk_chunk_size=16)
    plain = build_tester(c=None, k_values=(1, 2), batch_size=32, device=torch.device("cpu"),
                         cache_frozen_trunk=False, trunk_chunk_size=16)
    first, acc_first = run_test(cached, trunk, head, dataset)
    assert trunk.images_seen == 90 and cached.cache_hits == []
    with torch.no_grad():  # training changes the head, never the frozen trunk
        head.weight.mul_(-0.5)
    second, acc_second = run_test(cached, trunk, head, dataset)
    assert trunk.images_seen == 90 and cached.cache_hits == ["query"]  # the trunk did not run again
    reference, acc_reference = run_test(plain, trunk, head, dataset)
    assert trunk.images_seen == 180
    assert torch.equal(second, reference)
    assert not torch.equal(first, second)
    assert acc_second == acc_reference
    features, labels = cached.trunk_feature_cache["query"][1][0]
    assert features.dtype == torch.float32 and features.shape == (32, 8) and labels.shape == (32, 1)
    cached.clear_trunk_feature_cache()
    run_test(cached, trunk, head, dataset)
    assert trunk.images_seen == 270


def test_cache_is_invalidated_by_a_trunk_change_and_skipped_when_inexact():
    trunk, head = frozen_trunk_and_head()
    dataset = ImageTensors(40)
    tester = build_tester(c=None, k_values=(1,), batch_size=16, device=torch.device("cpu"))
    run_test(tester, trunk, head, dataset)
    with torch.no_grad():
        trunk.net[0].weight.mul_(2.0)
    changed, _ = run_test(tester, trunk, head, dataset)
    assert trunk.images_seen == 80 and tester.cache_hits == []  # ran again on the changed weights
    plain = build_tester(c=None, k_values=(1,), batch_size=16, device=torch.device("cpu"), cache_frozen_trunk=False)
    assert torch.equal(changed, run_test(plain, trunk, head, dataset)[0])

    trainable, head = frozen_trunk_and_head()
    trainable.net[0].weight.requires_grad_(True)  # not frozen: training may change it
    run_test(tester, trainable, head, dataset)
    run_test(tester, trainable, head, dataset)
    assert trainable.images_seen == 80

    trunk, head = frozen_trunk_and_head()
    noisy = ImageTensors(40, transform=AddNoise())  # a random eval transform: features differ per pass
    run_test(tester, trunk, head, noisy)
    run_test(tester, trunk, head, noisy)
    assert trunk.images_seen == 80 and "query" not in tester.trunk_feature_cache


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="cache_frozen_trunk must be True or False"):
        build_tester(c=None, cache_frozen_trunk="yes")
    with pytest.raises(ValueError, match="trunk_chunk_size must be a positive number"):
        build_tester(c=None, trunk_chunk_size=0)
    with pytest.raises(ValueError, match="trunk_chunk_size must be a positive number"):
        SkippingEmbeddingSpaceTester(trunk_chunk_size=-3)
    with pytest.raises(ValueError, match="trunk_chunk_size must be a positive number"):
        build_tester(c=None, trunk_chunk_size="64")
    with pytest.raises(ValueError, match="trunk_chunk_size must be a positive number"):
        HyperbolicTrainer(models={}, optimizers={}, batch_size=2, loss_funcs={}, dataset=None, trunk_chunk_size=0)


def test_progress_lines_for_embedding_and_knn_and_silent_with_tqdm_disable(capsys, monkeypatch):
    trunk, head = frozen_trunk_and_head()
    dataset = ImageTensors(40)
    tester = build_tester(c=None, k_values=(1,), batch_size=16, device=torch.device("cpu"))
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    assert progress_enabled()
    run_test(tester, trunk, head, dataset)
    run_test(tester, trunk, head, dataset)
    err = capsys.readouterr().err
    assert "embedding query" in err and "(cached trunk features)" in err
    assert "kNN: 40 query queries vs 40 references" in err
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert not progress_enabled() and not progress_enabled(True)
    run_test(tester, trunk, head, dataset)
    assert capsys.readouterr().err == ""


def test_trainer_runs_a_frozen_cpu_trunk_in_chunks_with_the_same_output():
    trunk, head = frozen_trunk_and_head()
    x = torch.rand(100, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    dataset = torch.utils.data.TensorDataset(x, torch.arange(100) % 5)
    kwargs = dict(models={"trunk": trunk, "embedder": head}, optimizers={}, batch_size=100,
                  loss_funcs={}, dataset=dataset, data_device=torch.device("cpu"), freeze_these=("trunk",))
    chunked = HyperbolicTrainer(trunk_chunk_size=32, **kwargs)
    whole = HyperbolicTrainer(trunk_chunk_size=None, **kwargs)
    trunk.batch_sizes.clear()
    out = chunked.get_trunk_output(x)
    assert trunk.batch_sizes == [25, 25, 25, 25]
    assert torch.allclose(out, whole.get_trunk_output(x), rtol=0, atol=1e-6)
    trunk.train()  # a trunk with batch statistics always sees the whole batch
    trunk.batch_sizes.clear()
    chunked.get_trunk_output(x)
    assert trunk.batch_sizes == [100]


def test_main_job_trunk_gives_the_same_bits_cached_chunked_and_as_before():
    """The main job's trunk (frozen EfficientNet-Lite0, 48 px glyphs): embeddings of the old path
    (batches of 256, one trunk call each, no cache) equal the new one's (chunks of 64) and the
    cached pass's, bit for bit, so the printed Recall@K cannot change."""
    from pml_hyperbolic.backbones import build_backbone, offline_weights_available
    from pml_hyperbolic.data import build_dataset, build_transforms

    if not offline_weights_available("efficientnet_lite0"):
        pytest.skip("optional extra 'pretrained' not installed")
    trunk, dim = build_backbone("efficientnet_lite0", pretrained="offline")
    trunk.requires_grad_(False)
    torch.manual_seed(0)
    head = torch.nn.Linear(dim, 16)
    glyphs = build_dataset("glyphs", "query", transform=build_transforms("glyph", train=False, image_size=48))
    dataset = torch.utils.data.Subset(glyphs, list(range(300)))
    cpu = torch.device("cpu")
    before = build_tester(c=None, k_values=(1,), batch_size=256, device=cpu, cache_frozen_trunk=False,
                          trunk_chunk_size=None)
    now = build_tester(c=None, k_values=(1,), batch_size=256, device=cpu)
    old, old_acc = run_test(before, trunk, head, dataset)
    new, new_acc = run_test(now, trunk, head, dataset)
    again, again_acc = run_test(now, trunk, head, dataset)
    assert now.cache_hits == ["query"]
    assert torch.equal(old, new) and torch.equal(new, again)
    assert old_acc == new_acc == again_acc


def test_freed_memory_stays_in_the_process_on_linux_glibc():
    import sys

    from pml_hyperbolic.training.trainer import retain_freed_memory

    applied = retain_freed_memory()
    if not sys.platform.startswith("linux"):
        assert applied is False
        return
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt's thresholds are glibc's")
    assert applied is True and retain_freed_memory() is True  # once, then a no-op
    import resource

    # 64 MiB freed and allocated again: served from the kept heap, not faulted in again
    block = torch.empty(16 << 20)  # 16 Mi float32 = 64 MiB (above the 32 MiB ceiling: mmapped)
    del block
    small = [torch.ones(2 << 20) for _ in range(4)]  # 4 x 8 MiB from the heap
    del small
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = [torch.ones(2 << 20) for _ in range(4)]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 1000, faults  # a fresh 32 MiB would be ~8,000 faults of 4 KiB pages
    del again
