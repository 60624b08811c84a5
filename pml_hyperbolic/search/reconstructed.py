r"""Distances from the lifted vectors faiss stores: the re-rank of ``keep_coordinates=False``.

An approximate factory that stores its vectors unchanged (``IVF…,Flat``, ``HNSW…``) already holds
every reference's float32 hyperboloid lift :math:`\hat Y = (\hat Y_0, \hat Y_{1:})` (:mod:`.lift`).
The ball point and its conformal term come back from it without cancellation:

.. math:: t = \sqrt c\,\hat Y_0 + 1 = \frac{2}{1 - c\|y\|^2},\qquad
          \hat y = \hat Y_{1:} / t,\qquad \hat b_y = 2 / t,

and the distance is the module's one formula (:func:`.lift._dist_from_diff`) on :math:`\hat y`.
Each stored coordinate carries one float32 rounding (:math:`u = 2^{-24}`) and the division at most
three more, so :math:`\|\hat y - y\| \le 4u\|y\|` and :math:`\hat b_y` is within :math:`u`
relative; the differences :math:`\hat y - q` and their norm add a relative error
:math:`\kappa \le 2(\sqrt D + 3)u` when they are taken in float32 (float32 queries, ``rtol`` above
:math:`\kappa + u`), none to speak of in float64. With :math:`b = 1 - c\|\cdot\|^2`, every
returned distance satisfies

.. math:: |\hat d - d_c(q, y)| \le 2^{-20}\,\frac{\|y\|}{\sqrt{b_y b_q}} + \text{rtol}\cdot d_c(q, y),

the float32 resolution of :math:`y` in the ball's own units (a 2x margin over the
first-order bound), plus the index's ``rtol``. Why: the index then needs no copy of the coordinates (half the memory of an
IVF index kept beside them); the price is that distances and the order of near-ties (within the bound)
are those of the stored float32 lift rather than of the float32 inputs.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .lift import _dist_from_diff

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

# bytes of the gathered float32 rows of one batch: large enough that faiss's coarse assignment and
# the Python work are amortised, small enough to stay a bounded working set
_BATCH_BYTES = 1 << 26


def stores_vectors_unchanged(index) -> bool:
    """True when the faiss ``index`` (e.g. :func:`.approximate.check_factory`'s) keeps each added
    (augmented) vector as it was given, so that ``reconstruct`` returns it bit for bit: a flat
    inverted file, an HNSW graph over flat storage, or a flat index. False for compressed codes (PQ,
    SQ, LSH) and transforms (PCA, OPQ)."""
    index = faiss.downcast_index(index)
    return isinstance(index, (faiss.IndexIVFFlat, faiss.IndexHNSWFlat, faiss.IndexFlat))


class StoredRows:
    """Zero-copy float32 views of the rows faiss stores, gathered by id in one indexing operation.

    A flat store (``HNSW…``'s storage, ``IndexFlat``) is one contiguous array. An inverted file
    keeps one buffer per list; their addresses are read once (:meth:`build`) and every row is
    addressed as an offset from the lowest one, through a strided view whose row i starts at float i
    (so rows of different lists come back in one gather). Valid until the index changes: the owner
    drops it at every ``add``. Why: faiss's ``search_and_reconstruct`` copies row by row through a
    temporary buffer, several times the cost of the search's own scan of the list.
    """

    def __init__(self, rows: np.ndarray, offsets: np.ndarray | None):
        self.rows = rows  # (n, W) rows by id, or the strided view addressed by ``offsets``
        self.offsets = offsets  # int64 (n,): float offset of each id's row, or None (rows by id)

    @classmethod
    def build(cls, index, ntotal: int) -> "StoredRows | None":
        """The views for ``index`` holding ids 0..ntotal-1, or None when its storage is not one of
        these layouts. The strided view spans the address range from the lowest list to the end of
        the highest (only virtual: nothing is read but the rows asked for)."""
        index = faiss.downcast_index(index)
        if isinstance(index, (faiss.IndexHNSWFlat, faiss.IndexFlat)):
            flat = faiss.downcast_index(index.storage) if isinstance(index, faiss.IndexHNSWFlat) else index
            rows = faiss.rev_swig_ptr(flat.get_xb(), ntotal * flat.d).reshape(ntotal, flat.d)
            out = cls(rows, None)
            probe = np.unique(np.array([0, ntotal // 2, ntotal - 1]))
            same = all(np.array_equal(index.reconstruct(int(i)), out.gather(np.array([i]))[0]) for i in probe)
            return out if same else None
        if not isinstance(index, faiss.IndexIVFFlat):
            return None
        lists = faiss.downcast_InvertedLists(index.invlists)
        if not isinstance(lists, faiss.ArrayInvertedLists) or index.code_size % 4:
            return None
        width, code = index.code_size // 4, index.code_size
        starts, sizes = [], []
        for no in range(index.nlist):
            size = lists.list_size(no)
            if size:
                starts.append((no, int(lists.get_codes(no)), size))
                sizes.append(size)
        if not starts:
            return None
        base = min(a for _, a, _ in starts)
        end = max(a + n * code for _, a, n in starts)
        if base % 4:
            return None
        flat = faiss.rev_swig_ptr(faiss.cast_integer_to_float_ptr(base), (end - base) // 4)
        rows = np.lib.stride_tricks.as_strided(flat, shape=(flat.shape[0] - width + 1, width),
                                               strides=(4, 4), writeable=False)
        offsets = np.full(ntotal, -1, dtype=np.int64)
        for no, addr, n in starts:
            ids = faiss.rev_swig_ptr(lists.get_ids(no), n)
            offsets[ids] = (addr - base) // 4 + width * np.arange(n, dtype=np.int64)
        if (offsets < 0).any():
            return None
        out = cls(rows, offsets)
        # the layout checked against faiss's own copy of a few rows (first and last of some lists)
        buf = np.empty(width, dtype=np.float32)
        for no, _, n in starts[:: max(1, len(starts) // 4)]:
            ids = faiss.rev_swig_ptr(lists.get_ids(no), n)
            for off in (0, n - 1):
                index.reconstruct_from_offset(no, off, faiss.swig_ptr(buf))
                if not np.array_equal(buf, out.gather(np.array([ids[off]]))[0]):
                    return None
        return out

    def gather(self, ids: np.ndarray) -> np.ndarray:
        """float32 (*ids.shape, W) copies of the stored rows of ``ids`` (any value for ids < 0)."""
        flat = np.maximum(ids.reshape(-1), 0)
        if self.offsets is None:
            out = np.take(self.rows, flat, axis=0)
        else:  # (indexing, not take: take would first copy the overlapping view into one array)
            out = self.rows[self.offsets[flat]]
        return out.reshape(*ids.shape, self.rows.shape[1])


def rows_per_batch(kk: int, dim: int) -> int:
    """Queries per batch so that the float32 (rows, kk, dim + 2) gathered rows stay near
    ``_BATCH_BYTES``."""
    return max(1, _BATCH_BYTES // (4 * max(1, kk) * (dim + 2)))


def distances(q: Tensor, bq: Tensor, stored: np.ndarray, valid: Tensor, c: float,
              q32: Tensor | None = None) -> Tensor:
    r"""float64 (B, kk) distances from query rows to the references faiss reconstructed.

    Args:
        q: float64 (B, D) queries (ball coordinates).
        bq: float64 (B,) :math:`1 - c\|q\|^2` of the queries.
        stored: float32 (B, kk, W) rows as faiss stores them (W ≥ D + 1: the lift first, then the
            augmentation); rows of missing candidates may hold anything.
        valid: bool (B, kk), False where faiss found no candidate.
        c: curvature magnitude.
        q32: the queries as float32 numbers when they are exactly that (float32 input), for
            float32 differences (relative error of the norm about :math:`2(\sqrt D + 3)u`, the
            caller's to allow); ``None`` = float64 throughout.

    Returns:
        float64 (B, kk): :math:`\hat d` (module docstring), ``inf`` where ``valid`` is False.
    """
    D = q.shape[1]
    lift = torch.from_numpy(stored)[:, :, :D + 1]
    t = lift[:, :, 0].to(torch.float64).mul_(math.sqrt(c)).add_(1.0)  # 2 / (1 - c|y|^2), no cancellation
    t = torch.where(valid, t, torch.ones((), dtype=t.dtype))
    if q32 is not None:  # y = Y_{1:} * (1/t) and the difference in float32: two more roundings of y
        # (numpy's broadcasting loops over the strided rows at about twice torch's speed here)
        buf = np.multiply(stored[:, :, 1:D + 1], (1.0 / t).to(torch.float32).numpy()[:, :, None])
        diff = torch.from_numpy(np.subtract(buf, q32.numpy()[:, None, :], out=buf))
    else:
        diff = lift[:, :, 1:].to(torch.float64).div_(t[:, :, None]).sub_(q[:, None, :])
    d = _dist_from_diff(diff, bq[:, None], 2.0 / t, c)
    return d.masked_fill_(~valid, math.inf)
