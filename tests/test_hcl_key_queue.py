"""HCL's key queue: which losses it wraps, and that the wrapped loss sees the queued keys."""
import pytest
import torch
from pytorch_metric_learning.losses import ArcFaceLoss, NTXentLoss

from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.losses import HypMixLoss, PairwiseCrossEntropyLoss
from pml_hyperbolic.training.hcl_trainer import KeyQueue


def test_accepts_pml_losses_and_the_reference_set_losses_only():
    KeyQueue(NTXentLoss(), 4, memory_size=8)  # PML's own list
    KeyQueue(PairwiseCrossEntropyLoss(), 4, memory_size=8)  # this package, takes ref_emb
    with pytest.raises(Exception, match="not supported"):
        KeyQueue(ArcFaceLoss(num_classes=3, embedding_size=4), 4, memory_size=8)
    with pytest.raises(Exception, match="not supported"):
        KeyQueue(HypMixLoss(), 4, memory_size=8)  # mixes two geometries of one output: no ref set


def test_queued_keys_are_the_negatives_of_later_queries():
    # step 1 enqueues keys; at step 2 the loss against the queue equals the loss computed by hand
    # with the reference set = the queue (the query's own key + the older keys as negatives)
    g = torch.Generator().manual_seed(0)
    loss = PairwiseCrossEntropyLoss(temperature=0.2, distance=PoincareDistance(c=0.05))
    queue = KeyQueue(loss, 3, memory_size=8)
    mask = torch.tensor([False] * 2 + [True] * 2)

    def ball(n):
        return 0.3 * torch.nn.functional.normalize(torch.randn(n, 3, generator=g), dim=1)

    first = ball(4)
    queue(first, torch.tensor([0, 1, 0, 1]), enqueue_mask=mask)
    assert queue.queue_idx == 2 and torch.equal(queue.embedding_memory[:2], first[2:])
    second = ball(4)
    got = queue(second, torch.tensor([2, 3, 2, 3]), enqueue_mask=mask)
    keys = torch.cat([first[2:], second[2:]])
    want = loss(second[:2], torch.tensor([2, 3]), ref_emb=keys, ref_labels=torch.tensor([0, 1, 2, 3]))
    torch.testing.assert_close(got, want)
