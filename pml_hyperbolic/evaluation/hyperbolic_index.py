r"""Exact k-nearest-neighbour search under the Poincaré distance, on faiss.

Why an inner-product search is exact
------------------------------------
Lift ball points to the hyperboloid, :math:`X = \text{to\_lorentz}(x, c)`. Then

.. math:: d_c(x, y) = \tfrac{1}{\sqrt c}\operatorname{arcosh}(A),\qquad
          A = -c\,\langle X, Y\rangle_L = c\,(X_0Y_0 - X_{1:}\cdot Y_{1:}) \ge 1,

and arcosh is increasing, so for a fixed query the nearest references are those that
*maximise* :math:`\langle X, Y\rangle_L = \langle Q, Y\rangle` with :math:`Q = (-X_0, X_{1:})`, a
plain (Euclidean) inner product that faiss ``IndexFlatIP`` computes with BLAS. We divide Q by
:math:`X_0 > 0` (this does not change the ranking of one query) so that :math:`|Q| \le \sqrt 2`.
(The ball-coordinate form :math:`\|x-y\|^2/(1-c\|y\|^2)` is an inner product too; its float32
error is about the same at the radii trained heads produce, so the lift was kept.)

Why the float32 scores are re-checked
-------------------------------------
Near the boundary :math:`X_0` is large and the float32 score cancels. Every float32 score of
query q, returned by faiss or not, is within :math:`e_q = \gamma\,|Q_q|\max_j|Y_j|` of the true
score (one number per query):

* ``error_model="typical"`` (default): :math:`\gamma = 2\sqrt{D + 3}\,u` (u = 2⁻²⁴), the
  random-walk size of float32 summation errors with a 2x margin. Not a worst-case guarantee; the
  tests and ``bench/knn.py`` check the results against a float64 brute force.
* ``error_model="rigorous"``: :math:`\gamma = (D + 3)\,u` (Higham's worst-case bound for a
  float32 dot product of length D+1, plus the rounding of Q and Y). A guarantee, pessimistic
  (docs/design/knn-index.md): the same algorithm, with more candidates recomputed.

The algorithm (one faiss call per batch of queries, O(batch · k') vectorised work): faiss returns
k' = k + margin candidates sorted by float32 score :math:`\hat s`.

1. *Set*: the first k candidates have true score :math:`\ge \hat s_{k-1} - e_q`, so anything
   with :math:`\hat s < \hat s_{k-1} - 2e_q` (every non-candidate has
   :math:`\hat s \le \hat s_{k'}`) is beaten by all of them: the set is certified when
   :math:`\hat s_{k'} < \hat s_{k-1} - 2e_q`, and besides the first k only the "tail" of
   candidates with :math:`\hat s \ge \hat s_{k-1} - 2e_q` can enter it.
2. *Order and distances*: from the scores, :math:`d = \operatorname{arcosh}(-cX_0
   \hat s)/\sqrt c`. Two candidates can be misordered only inside a *cluster* (a run of adjacent
   gaps :math:`\le 2e_q`). Cluster members among the first k + tail are recomputed exactly and
   sorted *within* the positions they occupy (every cluster by default; with ``exact_ranks``
   only those that straddle a listed rank). Distances whose interval is wider than ``rtol``
   (a prefix of each row: the interval shrinks relative to d as d grows, found by binary search)
   are recomputed too.
3. Rows that fail the certification are searched again with k' doubled. Beyond
   :math:`k' = \max(4(k+1), 256)` a row (a block of near-duplicates, whose ties go by index) is
   settled by a chunked float64 scan over all references instead.

Exact distances come from one formula, that of :func:`~pml_hyperbolic.poincare_ball.dist`:
:math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\|x-y\|/\sqrt{(1-c\|x\|^2)(1-c\|y\|^2)})`
from explicit differences (:func:`_dist_from_diff`), in float64. Where only the accuracy of a
distance is at stake (the wide prefix of step 2) and the inputs are float32 numbers, the
differences are taken in float32 (relative error ``_kappa()`` < ``rtol``) and any neighbours
this leaves out of order are recomputed in float64.

Inputs are projected with the boundary margin of their own dtype (``pb.project(x, c)``, as
:class:`~pml_hyperbolic.distances.PoincareDistance` does) and computed in float64; distances come
back in the input's dtype (float64 for float64 input), each exact or within ``rtol`` relative.
The result equals a float64 brute force (same tie rule) as a set and in order. Ties are broken by
the smaller reference index (the result is sorted by ``(distance, index)``); exact ties only
occur between exactly recomputed candidates, so the rule is applied to exact float64 values.

Approximate indexes (any faiss ``index_factory`` string other than ``"Flat"``, e.g. ``"HNSW32"``
(``kind="hnsw"``), ``"IVF4096,Flat"``, ``"IVF256,PQ16"``; no certification, recall < 1 is
possible): faiss returns k' candidates of the lifted vectors (:mod:`pml_hyperbolic.search.approximate`),
whose distances are then recomputed exactly (the formula above, float64) and sorted by
``(distance, index)``: every returned distance is the true distance of the returned point. With
``keep_coordinates=False`` they come from the lifted vectors faiss stores instead, within a stated
bound (:mod:`pml_hyperbolic.search.reconstructed`), and the index holds no copy of the coordinates.
Training, persistence (:mod:`pml_hyperbolic.search.persistence`) and GPUs: the class docstring.

Memory: queries are processed in batches of ``batch_size``; per batch O(batch_size · k') numbers,
never O(N²).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from .. import poincare_ball as pb
from ..geometry import DEFAULT_CURVATURE
from ..search import approximate as _approx
from ..search import reconstructed as _reconstructed
from ..search.building import FactoryMixin
from ..search.faiss_batches import FaissBatchMixin
from ..search.certified import (CertifiedSearchMixin, _all_cluster_members,  # noqa: F401
                                _boundary_cluster_members, _drop_self, _expand_ranges, _gather_rows,
                                _sort_by_dist_index)
from ..search.lift import (_as_2d_float_tensor, _conformal_terms, _dist_from_diff,  # noqa: F401
                           _lift32, _lift_parts, _max_lifted_norm, check_inside_ball)

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

# The float64 lift of one added tensor of at most this many rows is kept for the self-retrieval
# search that usually follows (16 MB at D = 128; the Cars, CUB and In-Shop galleries fit)
_KEPT_LIFT_ROWS = 16384


# Upper bounds of the HNSW parameters (far above useful values; they keep a typo from asking faiss
# for gigabytes of links or an endless search)
_MAX_HNSW_M = 512
_MAX_HNSW_EF = 1 << 20


def _integer(value, name: str, minimum: int, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integer (not a bool) in [minimum, maximum], else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum or (
            maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bound}, got {value!r}")
    return int(value)



class HyperbolicIndex(CertifiedSearchMixin, FactoryMixin, FaissBatchMixin):
    r"""k-NN index for points of the Poincaré ball: exact and certified (``"Flat"``), or any faiss
    ``index_factory`` string with exactly recomputed distances.

    ``train(x)`` (factories that need it: IVF, PQ; else done by the first ``add``), ``add(x)``,
    ``search(q, k) -> (distances, indices)``, ``set_search_parameters(nprobe=, ef_search=)``,
    ``save(path)`` / ``HyperbolicIndex.load(path)``, ``to_gpu()``. The distance is
    :math:`d_c(x, y) = \tfrac{1}{\sqrt c}\operatorname{arcosh}(-c\langle X, Y\rangle_L)` on the
    hyperboloid lift (module docstring).

    Design note: docs/design/knn-index.md

    Args:
        c: curvature magnitude (ball radius 1/√c): a float, tensor, hypll object or
            :class:`~pml_hyperbolic.geometry.PoincareGeometry`. A geometry or tensor is read again
            at every ``add``/``search``: if its curvature changed, they raise instead of searching
            with the old one.
        kind: ``"flat"`` (exact, faiss ``IndexFlatIP`` on the Lorentz lift, certified as described
            in the module docstring) or ``"hnsw"`` (the factory ``f"HNSW{hnsw_m}"``).
        rtol: relative accuracy of returned distances that are not recomputed exactly (a tiny
            value, e.g. 1e-15, recomputes every returned distance in float64).
        batch_size: at most this many queries per faiss search call; ``None`` (default) = as
            many as keep each of a batch's (queries × k') arrays at ~16 MB (memory O(k') per
            query, never O(N²)).
        margin: extra candidates fetched beyond k on the first try (default ``max(4, k // 32)``,
            and ``max(1, k // 32)`` for approximate factories that store their vectors unchanged,
            ``IVF…,Flat`` and ``HNSW…``, whose own order only differs from the exact one by float32
            rounding); for an approximate factory, the candidates re-ranked exactly.
        use_gpu: ``None`` or ``True`` = the flat index runs on the GPU(s) whenever faiss sees one
            (faiss-gpu installed); ``False`` = always CPU. Other factories move with :meth:`to_gpu`.
        error_model: ``"typical"`` or ``"rigorous"`` float32 score error bound (module docstring).
        hnsw_m: HNSW links per node (``kind="hnsw"``), an int in [2, 512] (faiss needs at least 2).
        ef_search: HNSW search breadth (any factory with HNSW), an int >= 1, raised to at least
            the number of candidates.
        project: project inputs onto the ball first, with the margin of their dtype
            (:func:`pb.project`; points on/outside the ball have no distance).
        post_threads: torch intra-op threads for the work around the faiss calls (lift, exact
            distances, sorting): ``"auto"`` (default) = torch's count on an idle machine, fewer,
            down to 1, when other processes hold the cores
            (:func:`~pml_hyperbolic.kernels.threads.uncontended_threads`, read at each call); an int = that
            many; ``None`` keeps torch's setting. Why: that work is small memory-bound passes, where
            threads whose cores are taken by other processes wait at barriers (timings: the design
            note). The results do not depend on it. faiss itself runs with the thread count that
            was set before the call, or fewer when other processes hold the cores (the same rule).
        exact_ranks: ``None`` (default) = the order is exact at every rank. A tuple of ranks K
            (e.g. the Recall@K list) = the *set* of the first K neighbours is exact for each K
            given and for k itself, and every returned distance is within ``rtol``; between those
            ranks, neighbours whose float32 scores lie within the error bound of each other (true
            distances within ~1e-6 relative) keep faiss's order instead of being re-sorted in
            float64. Recall@K for the listed K is then exactly the brute-force value, with most of
            the float64 work of a large k skipped. Applies to ``kind="flat"``.
        ef_construction: HNSW build parameter (faiss's ``efConstruction``, default 40, faiss's own
            default), any factory with HNSW.
        factory: a faiss ``index_factory`` string: ``"Flat"`` (the same as ``kind="flat"``, exact
            and certified), ``"HNSW32"``, ``"IVF4096,Flat"``, ``"IVF256,PQ16"``...; ``None`` = from
            ``kind``. Approximate: candidates from faiss, distances recomputed exactly.
        nprobe: inverted lists visited per query (factories with IVF); ``None`` = faiss's default
            (1). Also :meth:`set_search_parameters`.
        coarse: how an IVF factory's coarse centroids are trained: ``"directions"`` (default) =
            spherical k-means on the points' unit directions, placed so that faiss's assignment
            picks the nearest direction (lists as balanced as a cosine index's; the ranking inside
            the lists is the lift's, so the re-rank stays exact); ``"lift"`` = faiss's own k-means
            on the lifted vectors, which splits the gallery by radius too and leaves a few lists
            much longer than the rest. Why: the time of an IVF search grows with the length of the
            lists it visits (:mod:`pml_hyperbolic.search.approximate`). Factories with a transform
            before the IVF (``"OPQ16,IVF..."``, ``"PCA64,IVF..."``) or another quantizer (``IMI``)
            are trained by faiss either way.
        keep_coordinates: ``True`` (default) = the index keeps the reference coordinates and every
            returned distance is exact; ``False`` = an approximate factory that stores its vectors
            unchanged (``IVF…,Flat``, ``HNSW…``) re-ranks from faiss's own float32 lift, so the
            index holds no second copy of the gallery (about half the memory); distances are then
            within :math:`2^{-20}\|y\|/\sqrt{b_y b_q} + \text{rtol}\cdot d` of exact
            (:mod:`pml_hyperbolic.search.reconstructed`). Not for ``"Flat"`` (its certificate
            needs the coordinates) nor for compressed codes (PQ, SQ), whose stored vectors are not
            the lift.

    Raises:
        ValueError: any bad argument, naming it (checked here, before faiss sees a value).
        ImportError: faiss is not installed.

    Example:
        >>> index = HyperbolicIndex(c=0.1)
        >>> index.add(reference)
        >>> distances, indices = index.search(query, k=10)
    """

    def __init__(
        self,
        c: float | Tensor | object = DEFAULT_CURVATURE,
        kind: str = "flat",
        rtol: float = 1e-5,
        batch_size: Optional[int] = None,
        margin: Optional[int] = None,
        use_gpu: Optional[bool] = None,
        error_model: str = "typical",
        hnsw_m: int = 32,
        ef_search: int = 128,
        project: bool = True,
        post_threads: int | str | None = "auto",
        exact_ranks: Optional[Sequence[int]] = None,
        ef_construction: int = 40,
        factory: Optional[str] = None,
        nprobe: Optional[int] = None,
        coarse: str = "directions",
        keep_coordinates: bool = True,
    ):
        # a geometry or tensor is read again at each add/search (its curvature may be trained)
        self._c_source = None if isinstance(c, (int, float)) else c
        try:
            self.c = float(pb.as_curvature(c, torch.float64).detach())
        except (TypeError, ValueError) as err:
            message = str(err)
            raise ValueError(message if message.startswith("c") else f"c: {message}") from None
        if exact_ranks is not None:
            try:
                ranks = tuple(sorted({_integer(r, "exact_ranks", 1) for r in exact_ranks}))
            except (TypeError, ValueError):
                ranks = ()
            if not ranks:
                raise ValueError(f"exact_ranks must be None or positive ranks, got {exact_ranks!r}")
            exact_ranks = ranks
        self.exact_ranks = exact_ranks
        if not (isinstance(kind, str) and kind in ("flat", "hnsw")):
            raise ValueError(f"kind must be 'flat' or 'hnsw', got {kind!r}")
        if factory is not None:
            factory = _approx.normalise_factory(factory)
            if kind == "hnsw":
                raise ValueError(f"give kind='hnsw' or factory={factory!r}, not both "
                                 f"(kind='hnsw' is factory='HNSW{{hnsw_m}}')")
        if not (isinstance(rtol, (int, float, np.floating, np.integer)) and not isinstance(rtol, bool)
                and rtol > 0 and math.isfinite(rtol)):
            raise ValueError(f"rtol must be a number > 0, got {rtol!r}")
        if batch_size is not None:
            _integer(batch_size, "batch_size", 1)
        if margin is not None:
            _integer(margin, "margin", 0)
        if use_gpu is not None and not isinstance(use_gpu, bool):
            raise ValueError(f"use_gpu must be None, True or False, got {use_gpu!r}")
        # faiss's HNSW needs M >= 2 (M = 0 aborts the process, 1 crashes it, < 0 never returns); M
        # above a few hundred only costs memory (links per node grow as 2M)
        _integer(hnsw_m, "hnsw_m", 2, _MAX_HNSW_M)
        _integer(ef_search, "ef_search", 1, _MAX_HNSW_EF)
        _integer(ef_construction, "ef_construction", 1, _MAX_HNSW_EF)
        if not isinstance(project, bool):
            raise ValueError(f"project must be True or False, got {project!r}")
        if faiss is None:  # pragma: no cover
            raise ImportError("HyperbolicIndex needs faiss (pip install faiss-cpu)")
        if not (isinstance(error_model, str) and error_model in ("typical", "rigorous")):
            raise ValueError(f"error_model must be 'typical' or 'rigorous', got {error_model!r}")
        if not (post_threads is None or (isinstance(post_threads, str) and post_threads == "auto")
                or (isinstance(post_threads, (int, np.integer)) and not isinstance(post_threads, bool)
                    and post_threads >= 1)):
            raise ValueError(f"post_threads must be 'auto', None or an int >= 1, got {post_threads!r}")
        if factory is None:
            factory = "Flat" if kind == "flat" else f"HNSW{int(hnsw_m)}"
        self.factory = factory
        self._exact = factory == "Flat"
        probe = None if self._exact else _approx.check_factory(factory)
        self.nprobe = _approx.check_param(nprobe, "nprobe")
        if self.nprobe is not None and not _approx.has_ivf(factory):
            raise ValueError(f"nprobe applies to IVF factories, not to factory={factory!r}")
        if not (isinstance(coarse, str) and coarse in ("directions", "lift")):
            raise ValueError(f"coarse must be 'directions' or 'lift', got {coarse!r}")
        self.coarse = coarse
        if not isinstance(keep_coordinates, bool):
            raise ValueError(f"keep_coordinates must be True or False, got {keep_coordinates!r}")
        # vectors stored unchanged: faiss's own order is the lift's, up to float32 rounding
        self._stores_lift = probe is not None and _reconstructed.stores_vectors_unchanged(probe)
        if not keep_coordinates and not self._stores_lift:
            raise ValueError(f"keep_coordinates=False re-ranks from the vectors faiss stores, so it needs "
                             f"an approximate factory that keeps them unchanged ('IVF4096,Flat', "
                             f"'HNSW32'), not factory={factory!r}")
        self.keep_coordinates = keep_coordinates
        self.kind = "flat" if self._exact else ("hnsw" if kind == "hnsw" else "factory")
        self.error_model = error_model
        self.rtol = float(rtol)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.margin = margin
        self.use_gpu = use_gpu
        self.hnsw_m = int(hnsw_m)
        self.ef_search = int(ef_search)
        self.ef_construction = int(ef_construction)
        self.project = project
        self.post_threads = post_threads if post_threads in (None, "auto") else int(post_threads)
        self.reset()

    # ------------------------------------------------------------------ building
    def reset(self) -> None:
        """Empty the index."""
        self._ball = None  # float64 (N, D) reference ball coordinates (exact recomputation)
        self._dtype = None  # dtype of the distances returned for float32 queries (promoted)
        self._norms = None  # float64 |Y_j| of the float32 lifted vectors: all (hnsw) or each add's largest (flat)
        self._bball = None  # float64 (N,) 1 - c|y_j|^2
        self._cx2 = None  # float64 (N,) c|y_j|^2
        self._query_cache = None  # (query block, its conformal terms): the last block searched
        self._pending_self_lift = None  # float64 (X_0, X_{1:}) of the one added tensor, until the next search
        self._ball32 = None  # float32 copy of _ball when that is exact (float32 inputs)
        self._added_src = None
        self._index = None
        self._dim = None
        self._count = 0  # references added
        self._stored = None  # zero-copy view of faiss's rows (keep_coordinates=False), False: none
        self._mips_m = None  # M of the L2 reduction (approximate factories)
        self._pad = 0  # zero columns after the extra coordinate (approximate factories)
        self._on_gpu = False

    @property
    def ntotal(self) -> int:
        return self._count

    def _prepare(self, x, name: str):
        """(float64 points, dtype of the distances they ask for, the float32 points or None):
        projected with the margin of their own dtype, as :class:`PoincareDistance` does. The third is
        the projected input itself when it is float32 (its float64 copy is then exact: no check
        needed for the float32 shortcuts of :meth:`_exact_pairs`)."""
        x = _as_2d_float_tensor(x, name)
        self._check_curvature()
        check_inside_ball(x, self.c, name)
        dtype = pb.compute_dtype(x.dtype)
        if self.project:
            x = pb.project(x, self.c)
        x32 = x.cpu() if x.dtype == torch.float32 else None
        return x.to(torch.float64), dtype, x32

    def _check_curvature(self) -> None:
        """ValueError when the geometry or tensor given as ``c`` no longer has the curvature the
        index was built with."""
        if self._c_source is None:
            return
        now = float(pb.as_curvature(self._c_source, torch.float64).detach())
        if not math.isclose(now, self.c, rel_tol=1e-6):
            raise ValueError(f"c: the geometry's curvature is now {now:g} but this index was built with "
                             f"c={self.c:g}; build a new index (or pass c as a float to freeze it)")

    def add(self, reference) -> "HyperbolicIndex":
        """Add reference points (N × D ball coordinates), in batches.

        Args:
            reference: (N × D) ball points (tensor or numpy array, float32 or float64).

        Returns:
            ``self``.

        Raises:
            ValueError: empty, NaN/Inf, a row outside the ball, a dimension other than the index's,
                too few points to train an untrained factory, or a changed curvature.
        """
        return self._with_threads(self._add, reference)

    def _add(self, reference) -> "HyperbolicIndex":
        ref, dtype, ref32 = self._prepare(reference, "reference")
        # remember the (only) added tensor so that search(query=the same tensor) skips _prepare
        self._added_src = reference if self._count == 0 and self.keep_coordinates else None
        self._added_version = getattr(reference, "_version", None)  # detects in-place edits
        if ref.shape[0] == 0:
            raise ValueError("reference is empty: cannot add 0 points")
        self._open(ref.shape[1], "reference")
        ref = ref.cpu()
        cx2, den = _conformal_terms(ref, self.c)
        norms = []
        self._pending_self_lift = None
        if not self._exact:
            self._set_mips_m(ref, cx2, den)
            if not self._index.is_trained:
                self._train_lifted(ref, cx2, den)
        for start in range(0, ref.shape[0], 65536):
            chunk = slice(start, start + 65536)
            if not self._exact:
                rows, nrm = self._approx_rows(ref, cx2, den, start, start + 65536)
                self._index.add(rows)
                norms.append(nrm)
                continue
            Y32, y0, tail = _lift32(ref[chunk], cx2[chunk], den[chunk], self.c)
            if self._count == 0 and ref.shape[0] <= _KEPT_LIFT_ROWS:
                # self-retrieval usually follows: its queries' Q_{1:} = X_{1:} / X_0 starts from this
                self._pending_self_lift = (y0, tail)
            del tail
            # only max_j |Y_j| enters the error bound
            norms.append(_max_lifted_norm(Y32, y0, cx2[chunk], den[chunk], self.c))
            self._index.add(np.ascontiguousarray(Y32.numpy()))
        norms = torch.cat(norms)
        self._count += ref.shape[0]
        self._stored = None  # faiss may have moved its buffers
        self._dtype = dtype if self._dtype is None else torch.promote_types(self._dtype, dtype)
        self._query_cache = None
        if not self._exact:
            norms = norms.max().reshape(1)  # only the maximum is kept
        self._norms = norms if self._norms is None else torch.cat([self._norms, norms])
        if not self.keep_coordinates:  # distances come from faiss's stored lift (search/reconstructed.py)
            return self
        if not self._exact:
            # the coordinates for the exact distances: the float32 input itself where it is exact
            if ref32 is not None and (self._ball is None or self._ball.dtype == torch.float32):
                ref = ref32.contiguous()
            elif self._ball is not None:
                self._ball = self._ball.double()
        self._ball = ref if self._ball is None else torch.cat([self._ball, ref])
        self._cx2 = cx2 if self._cx2 is None else torch.cat([self._cx2, cx2])
        self._bball = den if self._bball is None else torch.cat([self._bball, den])
        # float32 copy: the input itself when one float32 tensor was added, else made on first use
        self._ball32 = ref32 if (ref32 is not None and self._ball is ref) else None
        return self

    # ------------------------------------------------------------------ search
    def search(self, query, k: int, query_ids: Optional[Tensor] = None):
        """k nearest references of every query, ascending Poincaré distance.

        Args:
            query: (M × D) ball points.
            k: number of neighbours (1 ≤ k ≤ number of eligible references).
            query_ids: optional (M,) reference index of each query to exclude from its own result
                (self-retrieval); ``-1`` for "exclude nothing".

        Returns:
            ``(distances, indices)``: (M × k) distances (float64 if the query or the reference is
            float64, else float32) and int64 indices, on the query's device.
        """
        return self._with_threads(self._search, query, k, query_ids)

    def _search(self, query, k: int, query_ids: Optional[Tensor] = None):
        if self._count == 0:
            raise ValueError("the index is empty: call add(reference) before search (an untrained "
                             "factory is trained by the first add, or by train(x))")
        self._check_curvature()
        device = query.device if isinstance(query, Tensor) else torch.device("cpu")
        if (self._added_src is not None and query is self._added_src
                and getattr(query, "_version", None) == self._added_version):
            q, q_dtype, q32_input = self._ball, self._dtype, None  # self-retrieval: prepared by add() already
        else:
            q, q_dtype, q32_input = self._prepare(query, "query")
            q = q.cpu()
        if q.shape[1] != self._dim:
            raise ValueError(
                f"query has dimension {q.shape[1]} but the reference has dimension {self._dim}"
            )
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
            raise ValueError(f"k must be a positive integer, got {k!r}")
        k = int(k)
        n = self.ntotal
        excl = query_ids is not None
        if excl:
            query_ids = torch.as_tensor(query_ids, dtype=torch.int64).cpu().reshape(-1)
            if query_ids.shape[0] != q.shape[0]:
                raise ValueError("query_ids must have one entry per query")
        if k + int(excl) > n:
            raise ValueError(
                f"k={k} is larger than the number of references available "
                f"({n - int(excl)}{' after excluding the query itself' if excl else ''})"
            )
        m = q.shape[0]
        out_dtype = torch.promote_types(q_dtype, self._dtype)
        out_d = torch.empty((m, k), dtype=out_dtype)
        out_i = torch.empty((m, k), dtype=torch.int64)
        # float32 copy of the queries when they are float32 numbers (the float32 difference
        # shortcut is exact-input only); checked once here rather than per batch
        q32 = None
        if not self.keep_coordinates:
            q32 = q32_input
        elif self._get_ball32() is not None:
            if q is self._ball:
                q32 = self._get_ball32()
            elif q32_input is not None:
                q32 = q32_input
            else:
                q32 = q.to(torch.float32)
                q32 = q32 if torch.equal(q32.double(), q) else None
        self._run_batches(q, k, query_ids if excl else None, q32, out_dtype, out_d, out_i)
        self._query_cache = None  # (do not keep the last query block alive)
        return out_d.to(device), out_i.to(device)
