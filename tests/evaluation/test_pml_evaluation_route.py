"""The PML evaluation trap: a PML user's AccuracyCalculator / tester must rank by the Poincaré
distance (through PML's own ``knn_func`` route), not by PML's default L2, and then agree with the
recipes' calculator."""
import numpy as np
import torch
from pytorch_metric_learning.testers import GlobalEmbeddingSpaceTester
from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

from pml_hyperbolic import HyperbolicEmbeddingHead, PoincareGeometry
from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import HyperbolicKNN, RecallAtKAccuracyCalculator


def _ball_points(n=300, classes=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    geometry = PoincareGeometry(c=0.1)
    torch.manual_seed(seed)
    head = HyperbolicEmbeddingHead(16, 8, c=geometry, radius="norm")
    protos = torch.randn(classes, 16, generator=g)
    labels = torch.arange(n) % classes
    x = protos[labels] + 0.8 * torch.randn(n, 16, generator=g)
    # radii spread from the origin to near the boundary: where L2 and Poincaré rankings differ
    emb = head(x).detach() * torch.rand(n, 1, generator=g).sqrt() * 1.6
    return geometry, pb.project(emb, geometry), labels


def _brute_force_p1(emb, labels, c):
    d = pb.pairwise_dist(emb.double(), emb.double(), c).fill_diagonal_(float("inf"))
    return float((labels[d.argmin(1)] == labels).double().mean()), d.argmin(1)


def test_pml_accuracy_calculator_with_hyperbolic_knn_gives_the_poincare_numbers():
    geometry, emb, labels = _ball_points()
    truth, nn_poincare = _brute_force_p1(emb, labels, 0.1)
    pml_user = AccuracyCalculator(include=("precision_at_1",), k=1, knn_func=HyperbolicKNN(c=geometry))
    got = pml_user.get_accuracy(emb, labels)["precision_at_1"]
    assert got == truth
    ours = RecallAtKAccuracyCalculator(k_values=(1,), c=geometry).get_accuracy(emb, labels)["recall_at_1"]
    assert ours == got  # the recipes' calculator and the PML user's script agree
    # the trap: PML's default (L2) ranks differently on these points
    l2 = torch.cdist(emb.double(), emb.double()).fill_diagonal_(float("inf")).argmin(1)
    assert bool((l2 != nn_poincare).any())


def test_pml_tester_with_hyperbolic_knn_and_no_normalisation(tmp_path):
    geometry, emb, labels = _ball_points(seed=1)
    truth, _ = _brute_force_p1(emb, labels, 0.1)

    class Points(torch.utils.data.Dataset):
        def __len__(self):
            return len(emb)

        def __getitem__(self, i):
            return emb[i], labels[i]

    calc = AccuracyCalculator(include=("precision_at_1",), k=1, knn_func=HyperbolicKNN(c=geometry))
    tester = GlobalEmbeddingSpaceTester(normalize_embeddings=False, accuracy_calculator=calc,
                                        dataloader_num_workers=0, batch_size=64)
    acc = tester.test({"val": Points()}, 0, torch.nn.Identity(), splits_to_eval=[("val", ["val"])])
    assert np.isclose(acc["val"]["precision_at_1_level0"], truth)
