r"""faiss ``index_factory`` indexes over the hyperboloid lift: building, training, search parameters.

The maximum inner product :math:`\langle Q, Y\rangle` (:mod:`.lift`) becomes a nearest-neighbour
(L2) search with one extra database coordinate: with :math:`M \ge \max_j\|Y_j\|`,
:math:`Y' = (Y, \sqrt{M^2 - \|Y\|^2})` and :math:`Q' = (Q, 0)` give
:math:`\|Q' - Y'\|^2 = \|Q\|^2 + M^2 - 2\langle Q, Y\rangle`, the same order for one query. faiss's
graph and inverted-file indexes are built for L2 neighbourhoods; searched with the raw inner product
(unnormalised vectors) their recall is far lower (docs/design/knn-index.md). Each query is scaled to
:math:`\|Q'\| = M`, onto the sphere that holds the database: the order of one query's results does not
change, but an inverted file then ranks its lists by closeness on that sphere rather than by the
lists' spread. :math:`M` is 1.1 × the largest lifted norm of the points that trained (or first filled)
the index for inverted files and other codes (a tight sphere keeps the lists apart), 2 × for a graph
(``HNSW``), whose links are built between database points and prefer the flatter cap. Factories whose codes need
the dimension to be a multiple of something (``PQ16``...) get zero columns appended.

Coarse quantizer of an inverted file (``coarse="directions"``, the default): faiss's k-means on the
augmented rows :math:`Y'` splits the gallery by radius as well as by direction (the radial coordinates
:math:`Y_0` and :math:`\sqrt{M^2 - \|Y\|^2}` carry most of each row's norm), so a few lists hold most
points. Instead the centroids are trained by spherical k-means on the unit directions
:math:`x/\|x\|` and placed at :math:`C_j = (a,\ s\,u_j,\ b,\ 0)`, with :math:`a, b, s` the means
of :math:`Y_0`, of the extra coordinate and of :math:`\|Y_{1:}\|` (shared by every list). Then
:math:`\|Y' - C_j\|^2 = \text{const} - 2s\|Y_{1:}\|\,u_j\cdot x/\|x\|` and the same for a query:
faiss's own L2 assignment picks the list of the nearest direction, for database points and queries
alike, and the lists are as balanced as a cosine index's. Ranking inside the lists is unchanged
(the full augmented rows), so the exact re-rank is as before; residual codes (PQ, SQ) encode each
point relative to a centroid at the training points' mean radial coordinates.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

import numpy as np

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

# zero columns tried after the lift (PQ and similar codes need a dimension divisible by their
# number of sub-quantizers; 64 covers every power of two up to 64)
_MAX_PAD = 64
_MAX_PARAM = 1 << 20


def normalise_factory(factory) -> str:
    """The factory string, stripped; ``"Flat"`` for any spelling of flat. ValueError if not a string."""
    if not isinstance(factory, str) or not factory.strip():
        raise ValueError(f"factory must be a faiss index_factory string such as 'Flat', 'HNSW32' or "
                         f"'IVF4096,Flat', got {factory!r}")
    factory = factory.strip()
    return "Flat" if factory.lower() == "flat" else factory


def new_index(factory: str, dim: int):
    """(faiss index for ``dim``-dimensional lifted vectors + 1 extra coordinate + padding, padding):
    the smallest padding (< 64 zero columns) that the factory accepts. ValueError naming
    ``factory`` with faiss's message when none does."""
    first_error = None
    for pad in range(_MAX_PAD):
        try:
            return faiss.index_factory(dim + 1 + pad, factory, faiss.METRIC_L2), pad
        except RuntimeError as err:  # faiss reports parse and shape errors this way
            if first_error is None:
                first_error = str(err).strip().splitlines()[-1]
            if "parse" in str(err):
                break
    raise ValueError(f"factory {factory!r} is not a faiss index_factory string faiss accepts for "
                     f"{dim + 1}-dimensional vectors: {first_error}")


def check_factory(factory: str):
    """The faiss index ``factory`` builds at a typical size (for inspecting its kind); ValueError now
    (not at the first add) for a factory faiss cannot build."""
    return new_index(factory, 129)[0]


def mips_factor(factory: str) -> float:
    """M over the largest lifted norm: 2 for a graph factory, 1.1 for the others (module docstring)."""
    return 2.0 if factory.upper().startswith("HNSW") else 1.1


def has_ivf(factory: str) -> bool:
    return "IVF" in factory.upper()


def _ivf(index):
    try:
        return faiss.extract_index_ivf(index)
    except RuntimeError:
        return None


def _hnsw(index):
    index = faiss.downcast_index(index)
    return index if hasattr(index, "hnsw") else None


def set_construction(index, ef_construction: int) -> None:
    """efConstruction of an HNSW index (no-op for others)."""
    h = _hnsw(index)
    if h is not None:
        h.hnsw.efConstruction = ef_construction


def set_search(index, nprobe, ef_search: int) -> None:
    """nprobe of an inverted-file index (when given) and efSearch of an HNSW index."""
    if nprobe is not None:
        ivf = _ivf(index)
        if ivf is not None:
            ivf.nprobe = nprobe
    h = _hnsw(index)
    if h is not None:
        h.hnsw.efSearch = ef_search


def augment(Y32: np.ndarray, norms: np.ndarray, mips_m: float, pad: int) -> np.ndarray:
    """float32 (n, D + 2 + pad): the lifted rows, :math:`\\sqrt{M^2 - \\|Y\\|^2}`, zeros."""
    out = np.zeros((Y32.shape[0], Y32.shape[1] + 1 + pad), dtype=np.float32)
    out[:, :Y32.shape[1]] = Y32
    out[:, Y32.shape[1]] = np.sqrt(np.clip(mips_m ** 2 - norms ** 2, 0.0, None))
    return out


def augment_query(Q32: np.ndarray, pad: int) -> np.ndarray:
    """float32 (n, D + 2 + pad): the query rows, then zeros."""
    out = np.zeros((Q32.shape[0], Q32.shape[1] + 1 + pad), dtype=np.float32)
    out[:, :Q32.shape[1]] = Q32
    return out


def train(index, xa: np.ndarray, factory: str) -> None:
    """Train ``index`` on the augmented rows ``xa``; one ValueError (naming the factory and the
    number of points needed where faiss says it) when they are too few."""
    n = xa.shape[0]
    ivf = _ivf(index)
    if ivf is not None and n < ivf.nlist:
        raise ValueError(f"factory {factory!r} needs at least {ivf.nlist} points to train (one per "
                         f"inverted list; faiss advises 39 per list), got {n}: call train() with "
                         f"more points, or use fewer lists (e.g. 'IVF{max(1, n // 39)},Flat')")
    try:
        index.train(np.ascontiguousarray(xa))
    except RuntimeError as err:
        raise ValueError(f"training factory {factory!r} on {n} points failed: "
                         f"{str(err).strip().splitlines()[-1]}; train() with more points") from None


def balanced_quantizer(index):
    """The IVF of ``index`` when its coarse quantizer can take direction centroids (the IVF is the
    index itself, not behind a transform, with a flat or HNSW quantizer that is still empty), else
    None (faiss then trains it alone)."""
    ivf = faiss.downcast_index(index)
    if not isinstance(ivf, faiss.IndexIVF):
        return None
    quantizer = faiss.downcast_index(ivf.quantizer)
    if not isinstance(quantizer, (faiss.IndexFlat, faiss.IndexHNSWFlat)) or quantizer.ntotal:
        return None
    return ivf


def direction_centroids(xa: np.ndarray, directions: np.ndarray, nlist: int, dim: int,
                        seed: int = 1234) -> np.ndarray | None:
    """float32 (nlist, xa's width) centroids :math:`(a, s u_j, b, 0)` (module docstring) from
    spherical k-means on the unit ``directions`` (rows of the training points with a direction);
    None when fewer than ``nlist`` points have a direction. ``dim`` is D, the ball dimension."""
    if directions.shape[0] < nlist:
        return None
    km = faiss.Kmeans(dim, nlist, niter=20, spherical=True, seed=seed)
    km.train(np.ascontiguousarray(directions, dtype=np.float32))
    u = km.centroids / np.linalg.norm(km.centroids, axis=1, keepdims=True).clip(1e-30)
    out = np.zeros((nlist, xa.shape[1]), dtype=np.float32)
    xa64 = xa.astype(np.float64)
    out[:, 0] = xa64[:, 0].mean()
    out[:, 1:dim + 1] = np.linalg.norm(xa64[:, 1:dim + 1], axis=1).mean() * u
    out[:, dim + 1] = xa64[:, dim + 1].mean()
    return out


def imbalance(index) -> float:
    """faiss's imbalance factor of an inverted file (1 = equal lists; N·Σn_i²/(Σn_i)² in general),
    nan for an index without one."""
    ivf = _ivf(index)
    return float("nan") if ivf is None else float(ivf.invlists.imbalance_factor())


def check_param(value, name: str):
    """None or an int in [1, 2^20], else ValueError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= value <= _MAX_PARAM:
        raise ValueError(f"{name} must be None or an int in [1, {_MAX_PARAM}], got {value!r}")
    return int(value)
