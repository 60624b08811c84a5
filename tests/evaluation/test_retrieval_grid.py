import numpy as np
import pytest
import torch

from pml_hyperbolic import poincare_ball as pb
from pml_hyperbolic.evaluation import plot_retrieval_grid, plot_retrieval_grid_from_embeddings
from pml_hyperbolic.evaluation.retrieval_grid import (
    CORRECT_COLOUR,
    QUERY_COLOUR,
    WRONG_COLOUR,
    nearest_neighbours,
    select_queries,
    to_display_image,
)
from pml_hyperbolic.geometry import PoincareGeometry

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def read_png(path):
    import matplotlib.image as mpimg

    return mpimg.imread(path)[:, :, :3]


def near(pixels, rgb, tol=0.08):
    return (np.abs(pixels - np.asarray(rgb)).max(axis=-1) < tol)


def frame_band(image, box, width=2):
    """Pixels on the four edges of a cell box (± width px), corners left out."""
    top, left, bottom, right = box
    pad = 6
    return np.concatenate([
        image[top - width:top + width + 1, left + pad:right - pad].reshape(-1, 3),
        image[bottom - width:bottom + width + 1, left + pad:right - pad].reshape(-1, 3),
        image[top + pad:bottom - pad, left - width:left + width + 1].reshape(-1, 3),
        image[top + pad:bottom - pad, right - width:right + width + 1].reshape(-1, 3),
    ])


def solid_images(n, seed=0):
    """n plain 3 x 12 x 16 images (non-square) in bluish-grey tints that match no frame colour."""
    g = torch.Generator().manual_seed(seed)
    tint = 0.35 + 0.3 * torch.rand(n, 1, 1, 1, generator=g)
    base = torch.tensor([0.8, 0.85, 1.0]).view(1, 3, 1, 1)
    return (tint * base).expand(n, 3, 12, 16).clone()


class PairDataset(torch.utils.data.Dataset):
    """Items (normalised image tensor, label), as the package's datasets return them."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return (self.images[i] - torch.tensor(MEAN).view(3, 1, 1)) / torch.tensor(STD).view(3, 1, 1), int(self.labels[i])


def test_frames_are_green_red_and_grey_where_expected(tmp_path):
    q_labels = torch.tensor([0, 1, 2])
    g_labels = torch.tensor([0, 0, 1, 2, 3, 1])
    neighbours = torch.tensor([[0, 2, 1], [4, 5, 2], [3, 0, 4]])  # hits: TFT / FTT / TFF
    q_images, g_images = solid_images(3, 0), solid_images(6, 1)
    path = tmp_path / "grid.png"
    out = plot_retrieval_grid(q_images, g_images, neighbours, q_labels, g_labels, path, k=3,
                              query_indices=[0, 1, 2], dpi=100)
    expected = np.array([[True, False, True], [False, True, True], [True, False, False]])
    np.testing.assert_array_equal(out["hits"], expected)
    np.testing.assert_array_equal(out["neighbour_indices"], neighbours.numpy())
    assert out["cell_boxes"].shape == (3, 4, 4)
    image = read_png(path)
    assert out["cell_boxes"][..., 2].max() < image.shape[0] and out["cell_boxes"][..., 3].max() < image.shape[1]
    for r in range(3):
        band = frame_band(image, out["cell_boxes"][r, 0])
        assert near(band, QUERY_COLOUR).mean() > 0.8  # the query: a neutral grey frame
        assert not near(band, CORRECT_COLOUR).any() and not near(band, WRONG_COLOUR).any()
        for col in range(3):
            band = frame_band(image, out["cell_boxes"][r, col + 1])
            right, wrong = near(band, CORRECT_COLOUR).mean(), near(band, WRONG_COLOUR).mean()
            if expected[r, col]:
                assert right > 0.8 and wrong == 0
            else:
                assert wrong > 0.8 and right == 0
    # the cells show the images themselves (no stretch colour change), query 1 in row 1
    top, left, bottom, right = out["cell_boxes"][1, 0]
    centre = image[(top + bottom) // 2 - 3:(top + bottom) // 2 + 3, (left + right) // 2 - 3:(left + right) // 2 + 3]
    np.testing.assert_allclose(centre.reshape(-1, 3).mean(0), q_images[1, :, 0, 0].numpy(), atol=0.02)


def test_dataset_input_undoes_the_normalisation_and_checks_the_order(tmp_path):
    q_labels, g_labels = torch.tensor([0, 1]), torch.tensor([1, 0, 1])
    q_images, g_images = solid_images(2, 2), solid_images(3, 3)
    queries, gallery = PairDataset(q_images, q_labels), PairDataset(g_images, g_labels)
    neighbours = np.array([[1, 0], [0, 2]])
    path = tmp_path / "grid.png"
    out = plot_retrieval_grid(queries, gallery, neighbours, q_labels, g_labels, path, k=2, mean=MEAN, std=STD)
    image = read_png(path)
    top, left, bottom, right = out["cell_boxes"][0, 1]
    g = out["neighbour_indices"][0, 0]
    centre = image[(top + bottom) // 2 - 3:(top + bottom) // 2 + 3, (left + right) // 2 - 3:(left + right) // 2 + 3]
    np.testing.assert_allclose(centre.reshape(-1, 3).mean(0), g_images[g, :, 0, 0].numpy(), atol=0.02)
    with pytest.raises(ValueError, match="mean= and std="):  # normalised images shown raw
        plot_retrieval_grid(queries, gallery, neighbours, q_labels, g_labels, path, k=2)
    with pytest.raises(ValueError, match="same order"):  # labels out of step with the dataset
        plot_retrieval_grid(queries, gallery, neighbours, q_labels.flip(0), g_labels, path, k=2, mean=MEAN, std=STD)


def test_select_queries_is_seeded_and_mixes_correct_and_wrong():
    correct = np.arange(40) % 3 == 0
    first = select_queries(correct, 6, seed=5)
    np.testing.assert_array_equal(first, select_queries(correct, 6, seed=5))
    assert len(set(first)) == 6 and correct[first].sum() == 3 and list(correct[first]) == [True] * 3 + [False] * 3
    assert not np.array_equal(first, select_queries(correct, 6, seed=6))
    assert len(set(select_queries(np.ones(10, bool), 4))) == 4  # all correct: no wrong to show
    assert len(set(select_queries(np.zeros(10, bool), 4))) == 4  # all wrong
    assert (~correct[select_queries(correct, 5)]).sum() == 2  # odd count: the extra one is correct
    only_two_right = np.array([True, True] + [False] * 8)
    assert only_two_right[select_queries(only_two_right, 6)].sum() == 2  # topped up with wrong ones
    assert len(select_queries(correct[:3], 6)) == 3


def test_nearest_neighbours_match_brute_force():
    g = torch.Generator().manual_seed(0)
    x = pb.expmap0(torch.randn(30, 5, generator=g, dtype=torch.float64), 0.5)
    ref = pb.expmap0(torch.randn(50, 5, generator=g, dtype=torch.float64), 0.5)
    d, i = nearest_neighbours(x, ref, 4, c=0.5)
    brute = pb.pairwise_dist(x, ref, 0.5)
    np.testing.assert_array_equal(i.numpy(), brute.argsort(1)[:, :4].numpy())
    torch.testing.assert_close(d.double(), brute.sort(1).values[:, :4], rtol=1e-4, atol=1e-5)
    d, i = nearest_neighbours(x, ref, 3, c=None)  # cosine
    cos = torch.nn.functional.normalize(x, dim=1) @ torch.nn.functional.normalize(ref, dim=1).T
    np.testing.assert_array_equal(i.numpy(), (-cos).argsort(1)[:, :3].numpy())
    torch.testing.assert_close(d.double(), 1 - cos.sort(1, descending=True).values[:, :3], rtol=0, atol=1e-6)
    d, i = nearest_neighbours(x, ref, 3, metric="euclidean")
    brute = torch.cdist(x, ref)
    np.testing.assert_array_equal(i.numpy(), brute.argsort(1)[:, :3].numpy())
    torch.testing.assert_close(d.double(), brute.sort(1).values[:, :3], rtol=1e-5, atol=1e-6)
    for c in (0.5, None):  # self-retrieval: a query never finds itself
        _, i = nearest_neighbours(x, x, 2, c=c, exclude=torch.arange(30))
        assert (i != torch.arange(30)[:, None]).all()


def test_from_embeddings_query_vs_gallery_and_self_retrieval(tmp_path):
    geometry = PoincareGeometry(c=0.1, clip_r=2.3)
    g = torch.Generator().manual_seed(1)
    centres = torch.randn(8, 6, generator=g) * 2
    q_labels, g_labels = torch.arange(40) % 8, torch.arange(64) % 8
    q_emb = geometry.to_ball(centres[q_labels] + 1.5 * torch.randn(40, 6, generator=g))
    g_emb = geometry.to_ball(centres[g_labels] + 1.5 * torch.randn(64, 6, generator=g))
    q_images, g_images = solid_images(40), solid_images(64, 1)
    path = tmp_path / "grid.png"
    out = plot_retrieval_grid_from_embeddings(q_emb, g_emb, q_labels, g_labels, q_images, g_images, path,
                                              c=geometry, n_queries=4, k=3)
    assert path.stat().st_size > 1000
    assert out["query_indices"].shape == (4,) and out["neighbour_indices"].shape == (4, 3) and out["hits"].shape == (4, 3)
    brute = pb.pairwise_dist(q_emb.double(), g_emb.double(), 0.1).argsort(1)[:, :3]
    np.testing.assert_array_equal(out["neighbour_indices"], brute[out["query_indices"]].numpy())
    assert out["hits"][:, 0].any() and not out["hits"][:, 0].all()  # a mix of correct and wrong top-1
    again = plot_retrieval_grid_from_embeddings(q_emb, g_emb, q_labels, g_labels, q_images, g_images,
                                                tmp_path / "again.png", c=geometry, n_queries=4, k=3)
    np.testing.assert_array_equal(again["query_indices"], out["query_indices"])  # deterministic
    own = plot_retrieval_grid_from_embeddings(q_emb, None, q_labels, None, q_images, None, tmp_path / "self.png",
                                              c=None, n_queries=5, k=2)
    assert (own["neighbour_indices"] != own["query_indices"][:, None]).all()  # leave-one-out


def test_bad_arguments(tmp_path):
    q_labels, g_labels = torch.tensor([0, 1]), torch.tensor([1, 0, 1])
    q_images, g_images = solid_images(2), solid_images(3)
    nb = np.array([[1, 0], [0, 2]])
    path = tmp_path / "x.png"
    with pytest.raises(ValueError, match="k = 3"):
        plot_retrieval_grid(q_images, g_images, nb, q_labels, g_labels, path, k=3)
    with pytest.raises(ValueError, match="n_queries"):
        plot_retrieval_grid(q_images, g_images, nb, q_labels, g_labels, path, k=2, n_queries=0)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        plot_retrieval_grid(q_images, g_images, nb + 5, q_labels, g_labels, path, k=2)
    with pytest.raises(ValueError, match="Q x k"):
        plot_retrieval_grid(q_images, g_images, nb[:1], q_labels, g_labels, path, k=2)
    with pytest.raises(ValueError, match="gallery_images has 2"):
        plot_retrieval_grid(q_images, g_images[:2], nb, q_labels, g_labels, path, k=2)
    with pytest.raises(ValueError, match="integer"):
        plot_retrieval_grid(q_images, g_images, nb.astype(float), q_labels, g_labels, path, k=2)
    with pytest.raises(ValueError, match="both or neither"):
        to_display_image(q_images[0], mean=MEAN)
    with pytest.raises(ValueError, match="shape"):
        to_display_image(torch.rand(5, 4, 4, 4))
    with pytest.raises(ValueError, match="one value per channel"):
        to_display_image(q_images[0], mean=(0.5, 0.5), std=(0.2, 0.2))
    emb = pb.expmap0(torch.randn(3, 4), 0.1)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, 2\]"):  # self-retrieval: 2 others
        plot_retrieval_grid_from_embeddings(emb, None, g_labels, None, g_images, None, path, c=0.1, k=3)
    with pytest.raises(ValueError, match="gallery_labels"):
        plot_retrieval_grid_from_embeddings(emb, None, g_labels, g_labels, g_images, None, path)
    with pytest.raises(ValueError, match="max_candidates"):
        plot_retrieval_grid_from_embeddings(emb, None, g_labels, None, g_images, None, path, k=1, max_candidates=0)
    with pytest.raises(ValueError, match="one entry per embedding"):
        plot_retrieval_grid_from_embeddings(emb, emb, q_labels, g_labels, q_images, g_images, path, k=1)
    with pytest.raises(ValueError, match="dimension"):
        nearest_neighbours(emb, torch.randn(3, 5), 1)
    with pytest.raises(ValueError, match="NaN"):
        nearest_neighbours(emb * float("nan"), emb, 1)
    with pytest.raises(ValueError, match="metric"):
        nearest_neighbours(emb, emb, 1, metric="manhattan")


def test_display_image_layouts():
    chw = torch.rand(3, 5, 7)
    hwc = chw.permute(1, 2, 0).numpy()
    np.testing.assert_allclose(to_display_image(chw), hwc, atol=1e-6)
    np.testing.assert_allclose(to_display_image(hwc), hwc, atol=1e-6)
    np.testing.assert_allclose(to_display_image((hwc * 255).astype(np.uint8)), hwc, atol=1 / 255)
    grey = to_display_image(torch.rand(1, 6, 6))
    assert grey.shape == (6, 6, 3) and np.allclose(grey[..., 0], grey[..., 2])
    from PIL import Image

    assert to_display_image(Image.new("L", (4, 3), 255)).shape == (3, 4, 3)
