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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_moco_branch_equals_pml_ntxent_on_the_queue(dtype):
    # HCL's MoCo branch (recipes/hcl.py): pairwise CE on the cosine instead of PML's NTXentLoss. With one
    # positive per query (its own key) both are -log(e^{s_qk/T} / (e^{s_qk/T} + sum_queue e^{s_qn/T})):
    # same loss, same gradients, while the queue fills and after it wraps around.
    from pytorch_metric_learning.distances import CosineSimilarity

    g = torch.Generator().manual_seed(1)
    b, d, memory = 8, 5, 40
    pml = KeyQueue(NTXentLoss(temperature=0.2), d, memory_size=memory)
    ours = KeyQueue(PairwiseCrossEntropyLoss(temperature=0.2, distance=CosineSimilarity()), d, memory_size=memory)
    mask = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)])
    for step in range(7):  # 7 x 8 keys > 40: the queue wraps
        q = torch.randn(b, d, generator=g, dtype=dtype, requires_grad=True)
        k = torch.randn(b, d, generator=g, dtype=dtype)
        ids = torch.arange(b) + step * b
        labels = torch.cat([ids, ids])
        loss_pml = pml(torch.nn.functional.normalize(torch.cat([q, k]), dim=1), labels, enqueue_mask=mask)
        grad_pml, = torch.autograd.grad(loss_pml, q)
        loss_ours = ours(torch.nn.functional.normalize(torch.cat([q, k]), dim=1), labels, enqueue_mask=mask)
        grad_ours, = torch.autograd.grad(loss_ours, q)
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(loss_ours, loss_pml, rtol=tol, atol=tol)
        torch.testing.assert_close(grad_ours, grad_pml, rtol=tol, atol=tol)
        assert torch.equal(ours.embedding_memory, pml.embedding_memory)
    assert ours.has_been_filled and pml.has_been_filled


def test_recipe_moco_branch_is_the_pairwise_ce_on_the_cosine(tmp_path):
    from pytorch_metric_learning.distances import CosineSimilarity
    from tests.recipes.test_recipe_end_to_end import load_recipe

    HCL = load_recipe("hcl").HCL
    recipe = HCL(HCL.parse(["--output-dir", str(tmp_path)]))
    losses = recipe.build_loss()
    moco = losses["metric_loss"].loss
    assert isinstance(moco, PairwiseCrossEntropyLoss) and isinstance(moco.distance, CosineSimilarity)
    assert isinstance(losses["hyperbolic_loss"].loss.distance, PoincareDistance)


def test_pairwise_ce_on_the_queue_skips_the_pair_list_with_the_same_result():
    # Without a miner the pair list PML builds names every (query, key) pair: the pairwise CE's own
    # label-equality masks are the same, so the queue passes no list (B x queue index tensors saved)
    # and the loss and gradients stay bit for bit what they were with it.
    from pytorch_metric_learning.losses import CrossBatchMemory

    class WithPairList(KeyQueue):
        create_indices_tuple = CrossBatchMemory.create_indices_tuple

    g = torch.Generator().manual_seed(2)
    b, d = 6, 4
    fast = KeyQueue(PairwiseCrossEntropyLoss(temperature=0.2, distance=PoincareDistance(c=0.05)), d, memory_size=20)
    listed = WithPairList(PairwiseCrossEntropyLoss(temperature=0.2, distance=PoincareDistance(c=0.05)), d,
                          memory_size=20)
    mask = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)])
    for step in range(5):  # the queue fills and wraps
        x = 0.3 * torch.nn.functional.normalize(torch.randn(2 * b, d, generator=g), dim=1)
        ids = torch.arange(b) + step * b
        labels = torch.cat([ids, ids])
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = fast(x1, labels, enqueue_mask=mask), listed(x2, labels, enqueue_mask=mask)
        got.backward()
        want.backward()
        assert torch.equal(got, want) and torch.equal(x1.grad, x2.grad)
    e, y = torch.zeros(3, d), torch.arange(3)
    assert fast.create_indices_tuple(e, y, e, y, None, False) is None
    assert fast.create_indices_tuple(e, y, e, y, None, True) is not None  # self-comparisons to remove
    from pml_hyperbolic.losses import HyperbolicCrossBatchMemory  # the shortcut lives in the shared memory

    xbm = HyperbolicCrossBatchMemory(PairwiseCrossEntropyLoss(), d, memory_size=8)
    assert xbm.create_indices_tuple(e, y, e, y, None, False) is None
    ntxent = KeyQueue(NTXentLoss(), d, memory_size=8)
    assert ntxent.create_indices_tuple(e, y, e, y, None, False) is not None  # other losses: PML's list
