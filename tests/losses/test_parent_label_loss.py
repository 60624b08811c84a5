"""ParentLabelLoss and class_parents: a PML loss (and miner) on the parent labels of the classes."""
import pytest
import torch
from pytorch_metric_learning.losses import ContrastiveLoss, MultiSimilarityLoss
from pytorch_metric_learning.miners import MultiSimilarityMiner

from pml_hyperbolic import PoincareGeometry
from pml_hyperbolic.distances import PoincareSimilarity
from pml_hyperbolic.losses import ParentLabelLoss, class_parents


def _batch(seed=0, n_classes=6, per_class=4, dim=8):
    g = torch.Generator().manual_seed(seed)
    return (0.2 * torch.randn(n_classes * per_class, dim, generator=g, dtype=torch.float64),
            torch.arange(n_classes).repeat_interleave(per_class))


PARENTS = torch.tensor([0, 0, 1, 1, 1, 2])  # six classes under three parents


def test_class_parents_reads_the_tree_off_the_samples():
    labels = torch.tensor([3, 0, 3, 1, 4, 0])
    parents = torch.tensor([7, 2, 7, 2, 5, 2])
    assert class_parents(labels, parents).tolist() == [2, 2, -1, 7, 5]  # class 2 has no sample
    assert class_parents([0, 1, 1], (4, 0, 0)).tolist() == [4, 0]  # plain sequences too


@pytest.mark.parametrize("labels, parents, message", [
    ([0, 0, 1], [1, 2, 2], "class 0 has samples under more than one parent"),
    ([0, 1], [0], "of one length"),
    ([], [], "non-empty"),
    ([0, -1], [0, 0], ">= 0"),
    ([0, 1], [0, -3], ">= 0"),
    ([0.0, 1.0], [0, 0], "labels must be a 1-D integer sequence"),
    ([[0, 1]], [[0, 0]], "labels must be a 1-D integer sequence"),
])
def test_class_parents_bad_input(labels, parents, message):
    with pytest.raises(ValueError, match=message):
        class_parents(labels, parents)


def test_equals_the_loss_and_miner_on_the_parent_labels():
    """The value and the gradient are those of the wrapped loss and miner called on π(y), and the
    loss differs from the class-level one (siblings are positives)."""
    emb, y = _batch()
    similarity = PoincareSimilarity(c=PoincareGeometry(c=0.5, clip_r=2.0))
    loss = ParentLabelLoss(MultiSimilarityLoss(distance=similarity), PARENTS,
                           miner=MultiSimilarityMiner(epsilon=0.1, distance=similarity))
    e1, e2 = emb.clone().requires_grad_(), emb.clone().requires_grad_()
    ours = loss(e1, y)
    mined = MultiSimilarityMiner(epsilon=0.1, distance=similarity)(e2, PARENTS[y])
    reference = MultiSimilarityLoss(distance=similarity)(e2, PARENTS[y], mined)
    assert torch.equal(ours, reference)
    torch.testing.assert_close(torch.autograd.grad(ours, e1)[0], torch.autograd.grad(reference, e2)[0],
                               rtol=0, atol=0)
    class_level = MultiSimilarityLoss(distance=similarity)(emb, y)
    assert not torch.isclose(ours.detach(), class_level)


def test_reference_embeddings_and_given_tuples():
    emb, y = _batch(1)
    ref, ref_y = _batch(2)
    loss = ParentLabelLoss(ContrastiveLoss(), PARENTS)
    expected = ContrastiveLoss()(emb, PARENTS[y], None, ref, PARENTS[ref_y])
    assert torch.equal(loss(emb, y, ref_emb=ref, ref_labels=ref_y), expected)
    pairs = (torch.tensor([0, 4]), torch.tensor([5, 9]), torch.tensor([1]), torch.tensor([23]))
    assert torch.equal(loss(emb, y, pairs), ContrastiveLoss()(emb, PARENTS[y], pairs))


def test_gradcheck():
    emb, y = _batch(3, n_classes=3, per_class=2, dim=3)
    loss = ParentLabelLoss(ContrastiveLoss(pos_margin=0.0, neg_margin=2.0), [0, 0, 1])
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (emb.requires_grad_(),))


def test_buffer_moves_with_the_module_and_stays_out_of_the_state_dict():
    loss = ParentLabelLoss(ContrastiveLoss(), PARENTS)
    assert loss.parents.dtype == torch.int64 and "parents" not in loss.state_dict()
    assert torch.equal(loss.parents, PARENTS)


@pytest.mark.parametrize("labels, message", [
    (torch.tensor([0, 1, 6, 2]), r"labels must lie in \[0, 6\)"),
    (torch.tensor([0, 1, -1, 2]), r"labels must lie in \[0, 6\)"),
    (torch.tensor([0.0, 1.0, 2.0, 3.0]), "labels must be a 1-D integer sequence"),
])
def test_bad_labels(labels, message):
    loss = ParentLabelLoss(ContrastiveLoss(), PARENTS)
    with pytest.raises(ValueError, match=message):
        loss(torch.zeros(4, 3), labels)


def test_bad_construction_and_calls():
    with pytest.raises(TypeError, match="loss must be a torch.nn.Module"):
        ParentLabelLoss(lambda e, y: e.sum(), PARENTS)
    with pytest.raises(TypeError, match="miner must be a torch.nn.Module"):
        ParentLabelLoss(ContrastiveLoss(), PARENTS, miner="ms")
    with pytest.raises(ValueError, match="parents must hold"):
        ParentLabelLoss(ContrastiveLoss(), [])
    with pytest.raises(ValueError, match="parents must be a 1-D integer sequence"):
        ParentLabelLoss(ContrastiveLoss(), [0.5, 1.0])
    with_orphan = ParentLabelLoss(ContrastiveLoss(), class_parents([0, 2], [1, 1]))  # class 1: no parent
    with pytest.raises(ValueError, match="class without a parent"):
        with_orphan(torch.zeros(2, 3), torch.tensor([0, 1]))
    mined = ParentLabelLoss(ContrastiveLoss(), PARENTS, miner=MultiSimilarityMiner())
    emb, y = _batch()
    with pytest.raises(ValueError, match="indices_tuple must be None"):
        mined(emb, y, (torch.tensor([0]), torch.tensor([1]), torch.tensor([0]), torch.tensor([5])))
    with pytest.raises(ValueError, match="embeddings must have shape"):
        mined(emb[0], y)
