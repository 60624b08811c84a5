"""Retrieval grid: a few queries (one row each) with their top-k gallery images, framed green when
the neighbour shares the query's class and red when it does not (matplotlib, Agg backend).

A Recall@1 says how often the top neighbour is right; the grid shows what the errors look like
(near-duplicates of another class, a confusing pose, a mislabelled image).

Design note: docs/design/plots.md
"""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch

from .. import poincare_ball as pb
from ..poincare_ball import CurvatureLike

#: Arrays the functions accept: a tensor, a numpy array or a nested sequence of numbers.
ArrayLike = Union[torch.Tensor, np.ndarray, Sequence]

#: Frame colours (RGB in [0, 1]): a correct neighbour, a wrong one, the query itself.
CORRECT_COLOUR = (0.13, 0.65, 0.20)
WRONG_COLOUR = (0.85, 0.10, 0.10)
QUERY_COLOUR = (0.45, 0.45, 0.45)


# ---- images ----------------------------------------------------------------------------------

def _is_image_like(value) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor)) or hasattr(value, "convert")  # PIL has convert


def fetch_item(images: Sequence, index: int) -> tuple:
    """One item of an image collection.

    Args:
        images: an N-array / tensor of images, a sequence of images (arrays, tensors or PIL
            images), or a dataset returning ``(image, label)``.
        index: which item.

    Returns:
        ``(image, label)``, the label ``None`` when ``images`` holds bare images.
    """
    item = images[int(index)]
    if isinstance(item, (tuple, list)) and len(item) >= 2 and _is_image_like(item[0]):
        return item[0], item[1]
    return item, None


def to_display_image(image: object, mean: Optional[Sequence[float]] = None,
                     std: Optional[Sequence[float]] = None) -> np.ndarray:
    r"""One image as an (H × W × 3) float array in [0, 1] for ``imshow``.

    ``uint8`` values are divided by 255; with ``mean`` and ``std`` the normalisation is undone,
    :math:`x \cdot \sigma + \mu`.

    Args:
        image: a PIL image, or an array / tensor laid out H × W, C × H × W (C = 1 or 3, the
            torchvision layout) or H × W × C (C = 1, 3 or 4; alpha dropped).
        mean: per-channel mean given to ``Normalize`` (with ``std``).
        std: per-channel standard deviation given to ``Normalize`` (with ``mean``).

    Returns:
        (H, W, 3) float64 array in [0, 1] (grey images repeated over three channels).

    Raises:
        ValueError: a non-numeric or wrongly shaped image, only one of ``mean`` / ``std``, a
            wrong number of channel statistics, NaN/Inf values, or values outside [0, 1] beyond
            rounding (a normalised image whose ``mean``/``std`` were not given).
    """
    if hasattr(image, "convert") and not isinstance(image, (np.ndarray, torch.Tensor)):
        array = np.asarray(image.convert("RGB"), dtype=np.float64) / 255.0
    else:
        raw = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
        if raw.dtype == np.uint8:
            array = raw.astype(np.float64) / 255.0
        elif np.issubdtype(raw.dtype, np.number) or raw.dtype == np.bool_:
            array = raw.astype(np.float64)
        else:
            raise ValueError(f"an image must hold numbers, got dtype {raw.dtype}")
        if array.ndim == 2:
            array = array[:, :, None]
        elif array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[2] not in (1, 3, 4):
            array = array.transpose(1, 2, 0)  # C x H x W -> H x W x C
        if array.ndim != 3 or array.shape[2] not in (1, 3, 4):
            raise ValueError(f"an image must be H x W, C x H x W or H x W x C with C in (1, 3), got shape "
                             f"{tuple(raw.shape)}")
        array = array[:, :, :3]
    if (mean is None) != (std is None):
        raise ValueError("mean and std undo a normalisation together: give both or neither")
    if mean is not None:
        mean_a, std_a = np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
        if mean_a.ndim != 1 or std_a.ndim != 1 or len(mean_a) not in (1, array.shape[2]) or len(std_a) != len(mean_a):
            raise ValueError(f"mean and std must have one value per channel ({array.shape[2]}) or one in all, "
                             f"got {len(np.atleast_1d(mean_a))} and {len(np.atleast_1d(std_a))}")
        array = array * std_a + mean_a
    if not np.isfinite(array).all():
        raise ValueError("an image contains NaN/Inf values")
    low, high = float(array.min()), float(array.max())
    if low < -0.02 or high > 1.02:
        raise ValueError(f"image values span [{low:.2f}, {high:.2f}], outside [0, 1]: for normalised images "
                         "pass the mean= and std= of the Normalize transform so the grid can undo it")
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    return np.clip(array, 0.0, 1.0)


def letterbox(array: np.ndarray) -> np.ndarray:
    """Pad an image with white to a square, centred, so every cell shows it unstretched.

    Args:
        array: (H, W, 3) image in [0, 1].

    Returns:
        (S, S, 3) image, S = max(H, W).
    """
    height, width = array.shape[:2]
    side = max(height, width)
    out = np.ones((side, side, 3), dtype=array.dtype)
    top, left = (side - height) // 2, (side - width) // 2
    out[top:top + height, left:left + width] = array
    return out


# ---- choosing the queries --------------------------------------------------------------------

def _as_label_vector(labels, name: str) -> np.ndarray:
    array = labels.detach().cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
    if array.ndim == 2:
        array = array[:, 0]  # hierarchical labels: correctness is judged on the finest level
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"{name} must be a non-empty (N,) or (N, K) array, got shape {array.shape}")
    return array


def select_queries(top1_correct: ArrayLike, n_queries: int, seed: int = 0) -> np.ndarray:
    """Queries to show, mixing a correct and a wrong top-1.

    Half of them (rounded down) have a wrong top-1, the rest a correct one, topped up from the
    other kind when one runs short; drawn with a seeded generator (same inputs, same seed: same
    queries).

    Args:
        top1_correct: (Q,) booleans, whether each query's top-1 neighbour is right.
        n_queries: how many to pick (at most Q).
        seed: the generator's seed.

    Returns:
        int64 indices into the Q queries, the correct ones first.
    """
    correct = np.asarray(top1_correct, dtype=bool).reshape(-1)
    n = min(int(n_queries), len(correct))
    rng = np.random.default_rng(seed)
    right, wrong = rng.permutation(np.flatnonzero(correct)), rng.permutation(np.flatnonzero(~correct))
    n_wrong = min(len(wrong), max(n // 2, n - len(right)))
    n_right = n - n_wrong
    return np.concatenate([right[:n_right], wrong[:n_wrong]]).astype(np.int64)


# ---- the grid --------------------------------------------------------------------------------

def plot_retrieval_grid(
    query_images: Sequence,
    gallery_images: Sequence,
    neighbour_indices: ArrayLike,
    query_labels: ArrayLike,
    gallery_labels: ArrayLike,
    path: Union[str, os.PathLike],
    n_queries: int = 6,
    k: int = 5,
    query_indices: Optional[ArrayLike] = None,
    distances: Optional[ArrayLike] = None,
    seed: int = 0,
    mean: Optional[Sequence[float]] = None,
    std: Optional[Sequence[float]] = None,
    cell_inches: float = 1.3,
    dpi: int = 100,
    title: Optional[str] = None,
) -> dict:
    """Write a PNG of ``n_queries`` queries, one row each: the query (grey frame), then its top-``k``
    gallery images in order, framed green when the neighbour's label equals the query's, red otherwise.

    Args:
        query_images: an N × … array or tensor of images, a sequence of images, or a dataset whose
            items are ``(image, label)`` (only the shown items are read). Images as in
            :func:`to_display_image`; the dataset's label must then equal the given label (a check
            that embeddings and images are in the same order).
        gallery_images: the same for the gallery.
        neighbour_indices: (Q × ≥k) gallery indices of each query's neighbours, nearest first (self
            already excluded for self-retrieval, as :class:`~pml_hyperbolic.evaluation.HyperbolicKNN`
            returns them).
        query_labels: (Q,) labels ((Q, K) hierarchical: the finest level).
        gallery_labels: (G,) labels ((G, K) hierarchical: the finest level).
        path: where to write the PNG.
        n_queries: how many query rows (when ``query_indices`` is None).
        k: neighbours per row.
        query_indices: the rows to show (default: :func:`select_queries` with ``seed``, mixing
            correct and wrong top-1).
        distances: optional (Q × ≥k) distances, printed under each neighbour.
        seed: seed of :func:`select_queries`.
        mean: per-channel mean to undo before display (e.g. the ImageNet statistics; with ``std``).
        std: per-channel standard deviation to undo (with ``mean``).
        cell_inches: side of one image cell.
        dpi: pixels per inch of the PNG.
        title: replaces the default title; ``""`` = none.

    Returns:
        dict with ``query_indices`` (n,), ``neighbour_indices`` (n × k), ``hits`` (n × k bool) and
        ``cell_boxes`` (n × (k + 1) × 4: top, left, bottom, right of each cell in PNG pixels;
        column 0 is the query).

    Raises:
        ValueError: a non-positive ``n_queries`` / ``k`` / ``dpi`` / ``cell_inches``, neighbour
            indices of the wrong shape, type or range, fewer than ``k`` neighbours, image and label
            counts that differ, malformed ``distances`` or ``query_indices``, or a dataset label
            that differs from the given one.

    Design note: docs/design/plots.md
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    for name, value in (("n_queries", n_queries), ("k", k), ("dpi", dpi)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(cell_inches, (int, float)) and cell_inches > 0):
        raise ValueError(f"cell_inches must be a number > 0, got {cell_inches!r}")
    q_labels = _as_label_vector(query_labels, "query_labels")
    g_labels = _as_label_vector(gallery_labels, "gallery_labels")
    neighbours = neighbour_indices.detach().cpu().numpy() if isinstance(neighbour_indices, torch.Tensor) \
        else np.asarray(neighbour_indices)
    if neighbours.ndim != 2 or neighbours.shape[0] != len(q_labels):
        raise ValueError(f"neighbour_indices must be Q x k with Q = {len(q_labels)} (one row per query label), "
                         f"got shape {neighbours.shape}")
    if neighbours.shape[1] < k:
        raise ValueError(f"neighbour_indices has {neighbours.shape[1]} neighbour(s) per query but k = {k}: "
                         "compute more neighbours or lower k")
    if not np.issubdtype(neighbours.dtype, np.integer):
        raise ValueError(f"neighbour_indices must hold integer gallery indices, got dtype {neighbours.dtype}")
    neighbours = neighbours[:, :k].astype(np.int64)
    if neighbours.min() < 0 or neighbours.max() >= len(g_labels):
        raise ValueError(f"neighbour_indices must lie in [0, {len(g_labels)}) (one gallery label per index), "
                         f"got values in [{neighbours.min()}, {neighbours.max()}]")
    for name, images, n in (("query_images", query_images, len(q_labels)),
                            ("gallery_images", gallery_images, len(g_labels))):
        if len(images) != n:
            raise ValueError(f"{name} has {len(images)} item(s) but there are {n} labels for it")
    dist = None
    if distances is not None:
        dist = distances.detach().cpu().numpy() if isinstance(distances, torch.Tensor) else np.asarray(distances)
        if dist.shape[0] != len(q_labels) or dist.ndim != 2 or dist.shape[1] < k:
            raise ValueError(f"distances must be Q x >=k like neighbour_indices, got shape {dist.shape}")
    hits_all = g_labels[neighbours] == q_labels[:, None]
    if query_indices is None:
        rows = select_queries(hits_all[:, 0], n_queries, seed)
    else:
        rows = np.asarray(query_indices, dtype=np.int64).reshape(-1)
        if len(rows) == 0 or rows.min() < 0 or rows.max() >= len(q_labels):
            raise ValueError(f"query_indices must be a non-empty list of query rows in [0, {len(q_labels)})")
    hits = hits_all[rows]

    def shown(images, index, labels, name):
        image, label = fetch_item(images, index)
        if label is not None:
            found = np.asarray(label.detach().cpu() if isinstance(label, torch.Tensor) else label).reshape(-1)
            if found.size and found[0] != labels[index]:
                raise ValueError(f"{name}[{index}] carries label {found[0]} but its given label is "
                                 f"{labels[index]}: the images and the labels/embeddings are not in the same order")
        return letterbox(to_display_image(image, mean, std))

    n_rows, n_cols = len(rows), k + 1
    gap, text_h, header_h, margin = 0.3 * cell_inches, 0.32, 0.75 if title != "" else 0.35, 0.12
    width = margin * 2 + n_cols * cell_inches + gap
    height = header_h + n_rows * (cell_inches + text_h) + margin
    fig = plt.figure(figsize=(width, height), dpi=dpi)
    # One axes over the whole figure, in figure-fraction coordinates, holds every cell: an axes per
    # cell (36 for 6 queries x top-5) made building and drawing them most of the grid's time
    canvas = fig.add_axes((0.0, 0.0, 1.0, 1.0))
    canvas.set_xlim(0.0, 1.0)
    canvas.set_ylim(0.0, 1.0)
    canvas.set_autoscale_on(False)
    canvas.set_axis_off()
    boxes = np.zeros((n_rows, n_cols, 4), dtype=np.int64)
    frame_width = max(2.5, 3.5 * cell_inches / 1.3)
    for r, q in enumerate(rows):
        top_in = header_h + r * (cell_inches + text_h)
        for col in range(n_cols):
            left_in = margin + col * cell_inches + (gap if col > 0 else 0.0)
            inset = 0.06 * cell_inches  # room for the frame between neighbouring cells
            x0, y0 = (left_in + inset) / width, 1.0 - (top_in + cell_inches - inset) / height
            side_w, side_h = (cell_inches - 2 * inset) / width, (cell_inches - 2 * inset) / height
            if col == 0:
                picture, colour = shown(query_images, q, q_labels, "query_images"), QUERY_COLOUR
                caption = f"query #{q}\nclass {q_labels[q]}"
            else:
                g = neighbours[q, col - 1]
                picture = shown(gallery_images, g, g_labels, "gallery_images")
                colour = CORRECT_COLOUR if hits[r, col - 1] else WRONG_COLOUR
                caption = f"class {g_labels[g]}" + (f"\nd = {dist[q, col - 1]:.3g}" if dist is not None else "")
            canvas.imshow(picture, extent=(x0, x0 + side_w, y0, y0 + side_h), aspect="auto",
                          interpolation="bilinear")
            # the frame: centred on the cell's edge, as an axes spine would be
            canvas.add_patch(Rectangle((x0, y0), side_w, side_h, fill=False, edgecolor=colour,
                                       linewidth=frame_width, zorder=3))
            canvas.text(x0 + side_w / 2, y0 - 0.06 * side_h, caption, ha="center", va="top", fontsize=7,
                        color="black" if col == 0 else colour)
            boxes[r, col] = (round((1.0 - y0 - side_h) * height * dpi), round(x0 * width * dpi),
                             round((1.0 - y0) * height * dpi), round((x0 + side_w) * width * dpi))
    # column headers
    header_y = 1.0 - (header_h - 0.08) / height
    fig.text((margin + cell_inches / 2) / width, header_y, "query", ha="center", va="bottom", fontsize=9)
    for col in range(1, n_cols):
        centre = margin + col * cell_inches + gap + cell_inches / 2
        fig.text(centre / width, header_y, f"top-{col}", ha="center", va="bottom", fontsize=9)
    if title != "":
        n_right = int(hits[:, 0].sum())
        fig.text(0.5, 1.0 - 0.08 / height,
                 title or (f"top-{k} retrieval of {n_rows} queries ({n_right} with a correct top-1)\n"
                           "green: same class as the query   red: another class"),
                 ha="center", va="top", fontsize=9)
    fig.savefig(path, dpi=dpi)  # no tight bbox: the cell boxes stay where they were placed
    plt.close(fig)
    return {"query_indices": rows, "neighbour_indices": neighbours[rows], "hits": hits, "cell_boxes": boxes}


# ---- from embeddings -------------------------------------------------------------------------

def nearest_neighbours(query: ArrayLike, gallery: ArrayLike, k: int, c: Optional[CurvatureLike] = None,
                       exclude: Optional[ArrayLike] = None, metric: str = "cosine",
                       batch_size: int = 1024) -> Tuple[torch.Tensor, torch.Tensor]:
    r"""Each query's k nearest gallery embeddings.

    With ``c``: the exact Poincaré distance :math:`d_c`
    (:class:`~pml_hyperbolic.evaluation.HyperbolicIndex`, the index behind
    :class:`~pml_hyperbolic.evaluation.HyperbolicKNN`). Without: the cosine distance
    :math:`1 - \langle q, g\rangle / (\lVert q\rVert \lVert g\rVert)` or the Euclidean
    :math:`\lVert q - g\rVert` (PML's default kNN on unnormalised embeddings).

    Args:
        query: (Q, D) query embeddings.
        gallery: (G, D) gallery embeddings.
        k: neighbours per query, in [1, G] (G − 1 when a query is excluded).
        c: curvature (float, tensor or :class:`~pml_hyperbolic.geometry.PoincareGeometry`), or
            None for ``metric``.
        exclude: (Q,) a gallery index never to return for each query (its own, for
            self-retrieval; -1 = none).
        metric: ``"cosine"`` or ``"euclidean"`` (used when ``c`` is None).
        batch_size: queries per block of the brute-force search.

    Returns:
        ``(distances, indices)``, both (Q, k), nearest first; distances float32.

    Raises:
        ValueError: an unknown ``metric``, empty or non-2-D embeddings, differing dimensions,
            NaN/Inf values, or ``k`` out of range.
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean' (used when c is None), got {metric!r}")
    q = torch.as_tensor(query).detach().cpu()
    g = torch.as_tensor(gallery).detach().cpu()
    if q.dim() != 2 or g.dim() != 2 or q.shape[0] == 0 or g.shape[0] == 0:
        raise ValueError(f"query and gallery embeddings must be non-empty 2-D arrays, got shapes "
                         f"{tuple(q.shape)} and {tuple(g.shape)}")
    if q.shape[1] != g.shape[1]:
        raise ValueError(f"query embeddings have dimension {q.shape[1]} but gallery embeddings {g.shape[1]}")
    if not (torch.isfinite(q).all() and torch.isfinite(g).all()):
        raise ValueError("embeddings contain NaN/Inf values")
    excluded = torch.full((q.shape[0],), -1, dtype=torch.long) if exclude is None \
        else torch.as_tensor(exclude, dtype=torch.long).reshape(-1)
    available = g.shape[0] - int(bool((excluded >= 0).any()))
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= available:
        raise ValueError(f"k must be an integer in [1, {available}] (the gallery size"
                         f"{' less the query itself' if available < g.shape[0] else ''}), got {k!r}")
    if c is not None:
        from .hyperbolic_index import HyperbolicIndex

        index = HyperbolicIndex(c=float(pb.as_curvature(c, torch.float64).detach()))
        index.add(g.float())
        return index.search(q.float(), int(k), query_ids=excluded if exclude is not None else None)
    cosine = metric == "cosine"
    qn = torch.nn.functional.normalize(q.double(), dim=1) if cosine else q.double()
    gn = torch.nn.functional.normalize(g.double(), dim=1) if cosine else g.double()
    out_d, out_i = [], []
    for start in range(0, q.shape[0], batch_size):
        # similarity: the cosine, or minus the Euclidean distance (larger = nearer in both)
        sim = qn[start:start + batch_size] @ gn.T if cosine else -torch.cdist(qn[start:start + batch_size], gn)
        ids = excluded[start:start + batch_size]
        own = ids >= 0
        sim[torch.nonzero(own).reshape(-1), ids[own]] = -math.inf
        top, idx = sim.topk(int(k), dim=1)  # ties: torch's order; the hyperbolic path breaks them by index
        out_d.append(1.0 - top if cosine else -top)
        out_i.append(idx)
    return torch.cat(out_d).float(), torch.cat(out_i)


def plot_retrieval_grid_from_embeddings(
    query_embeddings: ArrayLike,
    gallery_embeddings: Optional[ArrayLike],
    query_labels: ArrayLike,
    gallery_labels: Optional[ArrayLike],
    query_images: Sequence,
    gallery_images: Optional[Sequence],
    path: Union[str, os.PathLike],
    c: Optional[CurvatureLike] = None,
    n_queries: int = 6,
    k: int = 5,
    seed: int = 0,
    max_candidates: int = 2000,
    metric: str = "cosine",
    **grid_kwargs,
) -> dict:
    """:func:`plot_retrieval_grid` from embeddings: one call for a training run.

    The neighbours come from :func:`nearest_neighbours`. Only the top-1 of a seeded sample of
    ``max_candidates`` queries is searched (to pick a mix of correct and wrong queries), then the
    top-``k`` of the shown ones, so the cost stays bounded on large test sets.

    Args:
        query_embeddings: (Q, D) query embeddings.
        gallery_embeddings: (G, D) gallery embeddings, or None for self-retrieval among the
            queries, each query excluded from its own neighbours (the leave-one-out protocol of
            CUB, Cars and SOP).
        query_labels: (Q,) query labels.
        gallery_labels: (G,) gallery labels (None for self-retrieval).
        query_images: the query images, as in :func:`plot_retrieval_grid`.
        gallery_images: the gallery images (None for self-retrieval).
        path: where to write the PNG.
        c: curvature or the run's geometry for the Poincaré distance; None for ``metric``.
        n_queries: query rows.
        k: neighbours per row.
        seed: seed of the candidate sample and of :func:`select_queries`.
        max_candidates: queries whose top-1 is searched to pick the shown ones.
        metric: ``"cosine"`` or ``"euclidean"`` (PML's default kNN) when ``c`` is None.
        **grid_kwargs: passed to :func:`plot_retrieval_grid` (``mean``, ``std``, ``title``, ...).

    Returns:
        the dict of :func:`plot_retrieval_grid`.

    Raises:
        ValueError: gallery arguments given in part, label counts that differ from the
            embeddings, a non-positive ``max_candidates``, or as :func:`nearest_neighbours` /
            :func:`plot_retrieval_grid`.
    """
    q = torch.as_tensor(query_embeddings).detach().cpu()
    self_retrieval = gallery_embeddings is None
    if self_retrieval:
        if gallery_labels is not None or gallery_images is not None:
            raise ValueError("gallery_labels / gallery_images given without gallery_embeddings: give all three "
                             "(query vs gallery) or none (self-retrieval among the queries)")
        g, gallery_labels, gallery_images = q, query_labels, query_images
    else:
        if gallery_labels is None or gallery_images is None:
            raise ValueError("gallery_embeddings needs gallery_labels and gallery_images as well")
        g = torch.as_tensor(gallery_embeddings).detach().cpu()
    q_labels = _as_label_vector(query_labels, "query_labels")
    g_labels = _as_label_vector(gallery_labels, "gallery_labels")
    if len(q_labels) != q.shape[0] or len(g_labels) != g.shape[0]:
        raise ValueError(f"labels must have one entry per embedding: {len(q_labels)} query labels for "
                         f"{q.shape[0]} queries, {len(g_labels)} gallery labels for {g.shape[0]} gallery items")
    if isinstance(max_candidates, bool) or not isinstance(max_candidates, (int, np.integer)) or max_candidates < 1:
        raise ValueError(f"max_candidates must be a positive integer, got {max_candidates!r}")
    own = torch.arange(q.shape[0]) if self_retrieval else None
    # the top-1 of a seeded sample of queries is enough to pick a mix: the cost stays bounded on SOP-sized sets
    candidates = np.sort(np.random.default_rng(seed).permutation(q.shape[0])[:max_candidates])
    _, top1 = nearest_neighbours(q[candidates], g, 1, c=c, metric=metric,
                                 exclude=own[candidates] if own is not None else None)
    rows = candidates[select_queries(g_labels[top1[:, 0].numpy()] == q_labels[candidates], n_queries, seed)]
    distances, neighbours = nearest_neighbours(q[rows], g, k, c=c, metric=metric,
                                               exclude=own[rows] if own is not None else None)
    full_neighbours = np.zeros((q.shape[0], k), dtype=np.int64)
    full_distances = np.full((q.shape[0], k), np.nan)
    full_neighbours[rows], full_distances[rows] = neighbours.numpy(), distances.double().numpy()
    return plot_retrieval_grid(query_images, gallery_images, full_neighbours, q_labels, g_labels, path,
                               n_queries=len(rows), k=k, query_indices=rows, distances=full_distances,
                               **grid_kwargs)
