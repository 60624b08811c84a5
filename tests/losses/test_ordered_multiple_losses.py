"""OrderedMultipleLosses: PML's MultipleLosses (value, gradients, state-dict keys) in a chosen order."""
import pytest
import torch
from pytorch_metric_learning.losses import ContrastiveLoss, MultipleLosses, MultiSimilarityLoss, TripletMarginLoss
from pytorch_metric_learning.miners import MultiSimilarityMiner

from pml_hyperbolic.losses import HIERLoss, OrderedMultipleLosses


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.2 * torch.randn(24, 8, generator=g, dtype=torch.float64), torch.arange(6).repeat_interleave(4)


class _Recording(torch.nn.Module):
    """A loss that records when it was called."""

    def __init__(self, inner, name, log):
        super().__init__()
        self.inner, self.name, self.log = inner, name, log

    def forward(self, embeddings, labels, indices_tuple=None):
        self.log.append(self.name)
        return self.inner(embeddings, labels, indices_tuple)


@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_two_terms_equal_pml_in_any_order(order):
    """The value bit for bit, the gradients to rounding (autograd sums a tensor's gradients in the
    order of the graph). HIER without its noise: PML's losses draw from torch's generator too, so the
    order of the terms changes which draws HIER's noise gets."""
    emb, y = _batch()
    results = []
    for cls, kw in ((MultipleLosses, {}), (OrderedMultipleLosses, {"compute_order": order})):
        torch.manual_seed(3)
        hier = HIERLoss(embedding_size=8, num_proxies=12, c=0.1, stochastic_lca=False).double()
        loss = cls([MultiSimilarityLoss(), hier], miners=[MultiSimilarityMiner(epsilon=0.1), None],
                   weights=[1.0, 0.5], **kw)
        e = emb.clone().requires_grad_()
        value = loss(e, y)
        results.append((value.detach(), *torch.autograd.grad(value, [e, hier.proxies])))
        keys = list(loss.state_dict())
    assert torch.equal(results[0][0], results[1][0])
    for pml, ours in zip(*results):
        torch.testing.assert_close(ours, pml, rtol=1e-12, atol=1e-15)
    assert keys == ["losses.1.proxies"]


def test_the_terms_are_computed_in_compute_order():
    emb, y = _batch(1)
    log = []
    terms = {"a": _Recording(ContrastiveLoss(), "a", log), "b": _Recording(TripletMarginLoss(), "b", log),
             "c": _Recording(MultiSimilarityLoss(), "c", log)}
    weights = {"a": 1.0, "b": 2.0, "c": 0.5}
    loss = OrderedMultipleLosses(terms, weights=weights, compute_order=["c", "a", "b"])
    value = loss(emb, y)
    assert log == ["c", "a", "b"]
    expected = sum(weights[k] * terms[k].inner(emb, y) for k in "abc")
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)
    log.clear()
    OrderedMultipleLosses(list(terms.values()))(emb, y)
    assert log == ["a", "b", "c"]  # None: as given


@pytest.mark.parametrize("order, why", [
    ([0], "once"), ([0, 0], "once"), ([0, 2], "once"), ([True, 0], "once"), ("10", "list"), (3, "list"),
])
def test_bad_compute_order_is_one_clear_error(order, why):
    with pytest.raises(ValueError, match=f"compute_order.*{why}"):
        OrderedMultipleLosses([ContrastiveLoss(), TripletMarginLoss()], compute_order=order)
    with pytest.raises(ValueError, match="compute_order"):
        OrderedMultipleLosses({"a": ContrastiveLoss()}, compute_order=[0])


def test_indices_tuple_with_miners_is_refused():
    emb, y = _batch(2)
    loss = OrderedMultipleLosses([ContrastiveLoss()], miners=[MultiSimilarityMiner()])
    with pytest.raises(ValueError, match="indices_tuple must be None"):
        loss(emb, y, (torch.tensor([0]), torch.tensor([1]), torch.tensor([4])))
