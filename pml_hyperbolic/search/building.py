"""Training, search parameters, GPUs and files of :class:`~pml_hyperbolic.evaluation.HyperbolicIndex`
(a mixin: the class holds the state; the faiss factory helpers are in :mod:`.approximate`, the file
format in :mod:`.persistence`).

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

from typing import Optional, Self

import numpy as np
import torch

from . import approximate as _approx
from . import persistence as _persist
from .lift import _conformal_terms, _lift32

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None


class FactoryMixin:
    """Building an index from a faiss factory string: training, the L2 reduction's augmented rows,
    search parameters, GPUs, save and load."""

    def train(self, x) -> Self:
        """Train the faiss index (IVF lists, PQ codebooks...) on sample points, before ``add``.

        A factory that needs no training (``"Flat"``, ``"HNSW32"``) ignores it; one that does is
        trained by the first ``add`` otherwise (on the added points).

        Args:
            x: (N × D) ball points, representative of the gallery (e.g. a random sample).

        Returns:
            ``self``.

        Raises:
            ValueError: bad points (the checks of ``add``), too few of them for the factory (e.g.
                fewer than nlist for IVF), or an index that already holds points.
        """
        return self._with_threads(self._train, x)

    def _train(self, x) -> Self:
        ref = self._prepare(x, "x")[0].cpu()
        if ref.shape[0] == 0:
            raise ValueError("x is empty: cannot train on 0 points")
        self._open(ref.shape[1], "x")
        if self._exact or self._index.is_trained:
            if self.ntotal and not self._exact:
                raise ValueError("train(): the index already holds points; train before add, or reset()")
            return self
        self._train_lifted(ref, *_conformal_terms(ref, self.c))
        return self

    def _open(self, dim: int, name: str) -> None:
        if self._dim is not None and dim != self._dim:
            raise ValueError(f"{name} has dimension {dim} but the index holds dimension {self._dim}")
        if self._index is None:
            self._dim = dim
            self._index = self._new_faiss_index(self._dim + 1)

    def _approx_rows(self, ref, cx2, den, start, stop):
        """float32 augmented rows (numpy) of ``ref[start:stop]`` for an approximate factory, and
        their float64 lifted norms."""
        Y32 = _lift32(ref[start:stop], cx2[start:stop], den[start:stop], self.c)[0]
        nrm = torch.linalg.vector_norm(Y32.double(), dim=1)
        if float(nrm.max()) > self._mips_m:
            raise ValueError("approximate index: these points lie much nearer the boundary than the "
                             "ones the index was first trained or filled with; rebuild it with all points")
        return _approx.augment(Y32.numpy(), nrm.numpy(), self._mips_m, self._pad), nrm

    def _set_mips_m(self, ref, cx2, den) -> None:
        if self._mips_m is None:  # from the largest lifted norm seen first (search/approximate.py)
            top = max(float(torch.linalg.vector_norm(
                _lift32(ref[a: a + 65536], cx2[a: a + 65536], den[a: a + 65536], self.c)[0].double(),
                dim=1).max()) for a in range(0, ref.shape[0], 65536))
            self._mips_m = _approx.mips_factor(self.factory) * top

    def _train_lifted(self, ref, cx2, den) -> None:
        self._set_mips_m(ref, cx2, den)
        rows = np.concatenate([self._approx_rows(ref, cx2, den, a, a + 65536)[0]
                               for a in range(0, ref.shape[0], 65536)])
        ivf = _approx.balanced_quantizer(self._index) if self.coarse == "directions" else None
        if ivf is not None and rows.shape[0] >= ivf.nlist:
            # balanced coarse lists: centroids from the unit directions (search/approximate.py)
            norm = torch.linalg.vector_norm(ref, dim=1)
            has_dir = norm > 0
            dirs = (ref[has_dir] / norm[has_dir, None]).to(torch.float32).numpy()
            centroids = _approx.direction_centroids(rows[has_dir.numpy()], dirs, ivf.nlist, ref.shape[1])
            if centroids is not None:
                ivf.quantizer.add(centroids)  # faiss's train() then leaves the quantizer as it is
        _approx.train(self._index, rows, self.factory)

    # ------------------------------------------------------------------ parameters, GPU, files
    def set_search_parameters(self, *, nprobe: Optional[int] = None,
                              ef_search: Optional[int] = None) -> Self:
        """Search-time parameters of an approximate factory (the next searches use them).

        Args:
            nprobe: inverted lists visited per query (factories with IVF); more = higher recall,
                slower.
            ef_search: HNSW search breadth (factories with HNSW), raised to at least the number of
                candidates.

        Returns:
            ``self``.

        Raises:
            ValueError: a value that is not an int in [1, 2^20], or a parameter the factory has not.
        """
        nprobe = _approx.check_param(nprobe, "nprobe")
        ef_search = _approx.check_param(ef_search, "ef_search")
        if nprobe is not None:
            if not _approx.has_ivf(self.factory):
                raise ValueError(f"nprobe applies to IVF factories, not to factory={self.factory!r}")
            self.nprobe = nprobe
        if ef_search is not None:
            if "HNSW" not in self.factory.upper():
                raise ValueError(f"ef_search applies to HNSW factories, not to factory={self.factory!r}")
            self.ef_search = ef_search
        return self

    def to_gpu(self, shard: bool = False) -> Self:
        """Move the faiss index to every GPU faiss sees (``faiss.index_cpu_to_all_gpus``).

        The exact re-ranking stays on the CPU; only the candidate search moves.

        Args:
            shard: ``False`` = each GPU holds a copy (replicas: more queries per second);
                ``True`` = the gallery is split across the GPUs (a gallery larger than one GPU).

        Returns:
            ``self``.

        Raises:
            RuntimeError: faiss has no GPU (faiss-cpu, or no device visible).
            ValueError: an empty index, a factory faiss cannot run on a GPU (HNSW), or
                ``keep_coordinates=False``.
        """
        if not (hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0):
            raise RuntimeError("to_gpu(): this faiss build sees no GPU (faiss-cpu, or no device); "
                               "install faiss-gpu on a machine with a CUDA device, or search on the CPU")
        if self._index is None:
            raise ValueError("to_gpu(): the index is empty; add (or train) first")
        if "HNSW" in self.factory.upper():
            raise ValueError(f"to_gpu(): faiss has no GPU version of factory={self.factory!r}; "
                             "use 'Flat' or an IVF factory on the GPU")
        if not self.keep_coordinates:
            raise ValueError("to_gpu(): an index with keep_coordinates=False re-ranks from the vectors "
                             "faiss stores, which a GPU index does not hand back with its results; "
                             "build it with keep_coordinates=True to search on the GPU")
        if not self._on_gpu:
            options = faiss.GpuMultipleClonerOptions()
            options.shard = bool(shard)
            self._index = faiss.index_cpu_to_all_gpus(self._index, co=options)
            self._on_gpu = True
        return self

    def save(self, path) -> None:
        """Write the index to one file: a JSON header (curvature, options, shapes, checksum), the
        reference coordinates and faiss's own serialisation (no pickle: loading runs no code).

        Args:
            path: file path (written atomically: a temporary file, then renamed).

        Raises:
            ValueError: the index is empty.
        """
        _persist.save(self, path)

    @classmethod
    def load(cls, path, c=None) -> Self:
        """Read an index written by :meth:`save`; searches give the same results as before.

        Args:
            path: file path.
            c: ``None``, or the curvature the caller expects (float, tensor or geometry): a
                different stored curvature raises instead of searching the wrong geometry.

        Returns:
            the index, on the CPU (:meth:`to_gpu` moves it).

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: not an index file, truncated or corrupt, written by a newer format, or a
                curvature other than ``c``.
        """
        return _persist.load(cls, path, c)
