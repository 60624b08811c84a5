"""A training step's head, losses and backward never make the host wait for an accelerator.

On CUDA (skipped elsewhere) ``torch.cuda.set_sync_debug_mode("error")`` turns each read back into an
error. On every machine the accelerator's code path, run on CPU, is checked to dispatch none of the
operators that read a device back (a data-dependent size or a value on the host)."""
import collections
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# operators whose result needs the device's values on the host
_READ_BACK = {"nonzero", "_local_scalar_dense", "is_nonzero", "masked_select", "_unique2", "unique_dim",
              "unique_consecutive", "equal"}
# reads of CPU tensors that the accelerator path does not make: a CPU curvature's validation (on an
# accelerator it is checked by an asynchronous assertion) and the noise key drawn from torch's CPU generator
_CPU_ONLY_READS = ("in as_curvature", "in _noise_source")


class _ReadBackRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        boolean_index = name == "index" and any(getattr(t, "dtype", None) == torch.bool for t in args[1] if t is not None)
        unsized = name == "repeat_interleave" and (kwargs or {}).get("output_size") is None
        if name in _READ_BACK or boolean_index or unsized:
            stack = "".join(traceback.format_stack(limit=16))
            if not any(where in stack for where in _CPU_ONLY_READS):
                self.reads[(name, stack[-400:])] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def accelerator_path(monkeypatch):
    """The code paths taken on an accelerator, on CPU tensors."""
    from pml_hyperbolic.kernels import build, lca
    from pml_hyperbolic.losses import hier_loss
    from pml_hyperbolic import poincare_ball

    off = lambda x: False  # noqa: E731
    monkeypatch.setenv("PML_HYPERBOLIC_NATIVE", "0")  # the torch implementations, as off the CPU
    monkeypatch.setattr(hier_loss, "_fixed_size_triplets", lambda device: True)
    for module in (build, lca, poincare_ball):
        monkeypatch.setattr(module, "values_checked", off)


def _head(device="cpu"):
    from pml_hyperbolic.geometry import PoincareGeometry
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead

    return HyperbolicEmbeddingHead(384, 128, c=PoincareGeometry(c=0.1, clip="hard", clip_r=2.3)).to(device)


def _reads_of_one_step(loss_fn):
    torch.manual_seed(0)
    head = _head()
    features, labels = torch.randn(90, 384), torch.arange(10).repeat_interleave(9)
    with _ReadBackRecorder() as recorder:
        loss_fn(head(features), labels).backward()
    return recorder.reads


@pytest.mark.parametrize("positives", ["labels", "labels+mutual_nn"])
@pytest.mark.parametrize("budget", [200, 10 ** 7])
def test_hier_accelerator_path_dispatches_no_read_back(accelerator_path, positives, budget):
    from pml_hyperbolic.losses import HIERLoss

    loss_fn = HIERLoss(embedding_size=128, num_proxies=64, c=0.1, positives=positives, max_triplets=budget,
                       max_proxy_triplets=budget)
    assert not _reads_of_one_step(loss_fn)


def test_recorder_sees_the_listing_path_reads():
    """The check has teeth: the CPU listing path (sizes from the data) is seen reading back."""
    from pml_hyperbolic.losses import HIERLoss

    assert _reads_of_one_step(HIERLoss(embedding_size=128, num_proxies=64, c=0.1))


@pytest.mark.parametrize("distance", ["poincare", "cosine"])
def test_pairwise_cross_entropy_accelerator_path_dispatches_no_read_back(accelerator_path, distance):
    """With the default reducer the mean over positive pairs is taken in the loss: no pair list.
    Another reducer gets the list, whose size is read back (the check's teeth)."""
    from pytorch_metric_learning.distances import CosineSimilarity
    from pytorch_metric_learning.reducers import MeanReducer

    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

    measure = PoincareDistance(c=0.1) if distance == "poincare" else CosineSimilarity()
    assert not _reads_of_one_step(PairwiseCrossEntropyLoss(temperature=0.2, distance=measure))

    class ListedMean(MeanReducer):  # a subclass: the loss lists every pair for it
        pass

    assert _reads_of_one_step(PairwiseCrossEntropyLoss(temperature=0.2, distance=measure, reducer=ListedMean()))


def _step(head, loss_fn, features, labels):
    """Forward and backward of one head + loss step with every device read an error, under AMP."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.float16):
            emb = head(features)
        value = loss_fn(emb.float(), labels)
        value.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return value.detach()


def _batch(n_classes=30, per_class=9, width=384, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    labels = torch.arange(n_classes, device="cuda").repeat_interleave(per_class)
    return torch.randn(labels.numel(), width, device="cuda", generator=g), labels


@cuda_only
@pytest.mark.parametrize("positives", ["labels", "labels+mutual_nn"])
@pytest.mark.parametrize("budget", [8192, 10 ** 7])  # drawn; every triplet listed at a fixed size
def test_hier_step_reads_nothing_back(positives, budget):
    from pml_hyperbolic.losses import HIERLoss

    head = _head("cuda")
    loss_fn = HIERLoss(embedding_size=128, c=head.geometry, positives=positives, max_triplets=budget).cuda()
    features, labels = _batch(n_classes=10 if budget > 8192 else 30)
    value = _step(head, loss_fn, features, labels)
    assert torch.isfinite(value) and float(value) > 0
    assert loss_fn.proxies.grad is not None and torch.isfinite(loss_fn.proxies.grad).all()


@cuda_only
def test_hier_fixed_size_path_matches_the_listing_on_cpu():
    """The device's fixed-size path gives the CPU listing's value (no noise, all triplets listed)."""
    from pml_hyperbolic.losses import HIERLoss

    torch.manual_seed(0)
    loss_fn = HIERLoss(embedding_size=16, num_proxies=32, c=0.1, stochastic_lca=False, max_triplets=10 ** 6).double()
    emb = torch.randn(40, 16, dtype=torch.float64) * 0.1
    labels = torch.arange(8).repeat_interleave(5)
    on_cpu = loss_fn(emb, labels)
    on_gpu = loss_fn.cuda()(emb.cuda(), labels.cuda())
    torch.testing.assert_close(on_gpu.cpu(), on_cpu, rtol=1e-9, atol=1e-12)


@cuda_only
def test_pairwise_cross_entropy_step_reads_nothing_back():
    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

    head = _head("cuda")
    loss_fn = PairwiseCrossEntropyLoss(temperature=0.2, distance=PoincareDistance(c=head.geometry))
    features, labels = _batch()
    value = _step(head, loss_fn, features, labels)
    assert torch.isfinite(value) and float(value) > 0
