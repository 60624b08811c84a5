"""PoincareDistance inside PML losses, miners and CrossBatchMemory."""
import itertools
import math

import pytest
import torch
from pytorch_metric_learning import losses, miners

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.distances import PoincareDistance
from pml_hyperbolic.heads import HyperbolicEmbeddingHead

C = 0.1


def batch(n=16, dim=8, n_classes=4, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, dim, generator=g, dtype=dtype)
    emb = pb.expmap0(feats, C).requires_grad_()
    labels = torch.arange(n) % n_classes
    return emb, labels


LOSSES = {
    "ContrastiveLoss": lambda d: losses.ContrastiveLoss(pos_margin=0.0, neg_margin=3.0, distance=d),
    "TripletMarginLoss": lambda d: losses.TripletMarginLoss(margin=0.5, distance=d),
    "SupConLoss": lambda d: losses.SupConLoss(temperature=0.2, distance=d),
    "NTXentLoss": lambda d: losses.NTXentLoss(temperature=0.2, distance=d),
    "MarginLoss": lambda d: losses.MarginLoss(margin=0.2, beta=1.0, distance=d),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_losses_give_finite_loss_and_gradients(name, dtype):
    emb, labels = batch(dtype=dtype)
    loss = LOSSES[name](PoincareDistance(c=C))(emb, labels)
    assert loss.ndim == 0 and torch.isfinite(loss) and loss > 0
    loss.backward()
    assert torch.isfinite(emb.grad).all() and emb.grad.abs().sum() > 0


def test_end_to_end_head_loss_and_learnable_curvature():
    torch.manual_seed(0)
    head = HyperbolicEmbeddingHead(12, 6, c=C, learnable_c=True)
    loss_fn = losses.TripletMarginLoss(margin=0.2, distance=PoincareDistance(c=head.geometry))
    # distance c must follow the head's learnable c: pass the tensor each step
    x, labels = torch.randn(16, 12), torch.arange(16) % 4
    loss_fn.distance = PoincareDistance(c=head.c)
    loss = loss_fn(head(x), labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in head.parameters())
    assert head.geometry.c.value.grad != 0


def test_contrastive_loss_matches_hand_computation():
    emb, labels = batch(n=8, dim=4, n_classes=3, seed=1)
    pos_margin, neg_margin = 0.5, 3.0
    loss = losses.ContrastiveLoss(pos_margin=pos_margin, neg_margin=neg_margin,
                                  distance=PoincareDistance(c=C))(emb, labels)
    pos, neg = [], []
    for i, j in itertools.permutations(range(8), 2):
        d = pb.dist(emb[i], emb[j], C)
        if labels[i] == labels[j]:
            pos.append(torch.relu(d - pos_margin))
        else:
            neg.append(torch.relu(neg_margin - d))
    pos, neg = torch.stack(pos), torch.stack(neg)
    # PML's default AvgNonZeroReducer: mean over the non-zero terms of each part, then summed.
    expected = pos[pos > 0].mean() + neg[neg > 0].mean()
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=1e-12)


def test_triplet_margin_loss_matches_hand_computation():
    emb, labels = batch(n=9, dim=4, n_classes=3, seed=2)
    margin = 0.3
    loss = losses.TripletMarginLoss(margin=margin, distance=PoincareDistance(c=C))(emb, labels)
    terms = []
    for a, p, n in itertools.permutations(range(9), 3):
        if labels[a] == labels[p] and labels[a] != labels[n]:
            terms.append(torch.relu(pb.dist(emb[a], emb[p], C) - pb.dist(emb[a], emb[n], C) + margin))
    terms = torch.stack(terms)
    torch.testing.assert_close(loss, terms[terms > 0].mean(), rtol=1e-10, atol=1e-12)


def test_circle_loss_refuses_a_non_cosine_distance_with_a_clear_message():
    # CircleLoss's formula needs similarities in [-1, 1]; PML checks the distance type at construction
    # (c_f.assert_distance_type), so a PoincareDistance fails loudly instead of training on nonsense.
    with pytest.raises(AssertionError, match="CircleLoss requires the distance metric to be CosineSimilarity"):
        losses.CircleLoss(distance=PoincareDistance(c=C))


MINERS = {
    "TripletMarginMiner": lambda d: miners.TripletMarginMiner(margin=0.5, type_of_triplets="all", distance=d),
    "BatchHardMiner": lambda d: miners.BatchHardMiner(distance=d),
    "PairMarginMiner": lambda d: miners.PairMarginMiner(pos_margin=0.5, neg_margin=8.0, distance=d),
}


@pytest.mark.parametrize("name", sorted(MINERS))
def test_miners_with_poincare_distance(name):
    emb, labels = batch(n=16, seed=3)
    miner = MINERS[name](PoincareDistance(c=C))
    tuples = miner(emb, labels)
    assert all(len(t) > 0 for t in tuples)
    loss_fn = (losses.TripletMarginLoss(margin=0.5, distance=PoincareDistance(c=C)) if len(tuples) == 3
               else losses.ContrastiveLoss(neg_margin=8.0, distance=PoincareDistance(c=C)))
    loss = loss_fn(emb, labels, tuples)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(emb.grad).all()


def test_miners_use_the_hyperbolic_ordering():
    """BatchHardMiner must pick the hardest positive by *hyperbolic* distance (non-inverted: largest)."""
    emb, labels = batch(n=12, seed=4)
    a, p, n = miners.BatchHardMiner(distance=PoincareDistance(c=C))(emb, labels)
    mat = pb.pairwise_dist(emb.detach(), emb.detach(), C)
    same = labels[:, None] == labels[None]
    for anchor, pos, neg in zip(a.tolist(), p.tolist(), n.tolist()):
        pos_d = mat[anchor][same[anchor] & (torch.arange(12) != anchor)]
        neg_d = mat[anchor][~same[anchor]]
        assert mat[anchor, pos] == pos_d.max()
        assert mat[anchor, neg] == neg_d.min()


def test_triplet_margin_miner_keeps_only_margin_violations():
    emb, labels = batch(n=12, seed=5)
    margin = 0.3
    a, p, n = miners.TripletMarginMiner(margin=margin, type_of_triplets="all", distance=PoincareDistance(c=C))(emb, labels)
    mat = pb.pairwise_dist(emb.detach(), emb.detach(), C)
    assert len(a) > 0
    assert torch.all(mat[a, n] - mat[a, p] <= margin + 1e-12)


def test_cross_batch_memory():
    loss_fn = losses.CrossBatchMemory(
        losses.ContrastiveLoss(neg_margin=3.0, distance=PoincareDistance(c=C)), embedding_size=8, memory_size=40,
        miner=miners.PairMarginMiner(pos_margin=0.0, neg_margin=3.0, distance=PoincareDistance(c=C)))
    for step in range(3):
        emb, labels = batch(n=16, seed=10 + step, dtype=torch.float32)
        loss = loss_fn(emb, labels)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(emb.grad).all()
    assert loss_fn.has_been_filled and loss_fn.queue_idx == 48 % 40  # 3 batches of 16 wrapped a 40-slot queue


def test_nan_embeddings_fail_loudly_in_a_loss():
    emb, labels = batch()
    bad = emb.detach().clone()
    bad[0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN/Inf"):
        losses.TripletMarginLoss(distance=PoincareDistance(c=C))(bad, labels)
