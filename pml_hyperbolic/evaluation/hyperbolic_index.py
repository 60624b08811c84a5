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

``kind="hnsw"`` (approximate, no certification): candidates from faiss ``IndexHNSWFlat``,
re-ranked by the exact distance.

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
from ..kernels.threads import uncontended_threads

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

_U32 = 2.0 ** -24
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


def _as_2d_float_tensor(x, name: str) -> Tensor:
    if isinstance(x, np.ndarray):
        x = torch.from_numpy(x)
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N x D), got shape {tuple(x.shape)}")
    if not torch.is_floating_point(x):
        x = x.float()
    pb.check_finite(x, name)
    return x.detach()


def _conformal_terms(x: Tensor, c: float):
    """float64 (:math:`c\\|x\\|^2`, :math:`1 - c\\|x\\|^2` clamped above 0) per row of float64 ``x``: the
    terms of the Lorentz lift and the conformal denominators of the distance (the values
    :func:`pb.to_lorentz` computes, bit for bit)."""
    cx2 = c * (x * x).sum(-1)
    return cx2, (1 - cx2).clamp_min(torch.finfo(torch.float64).tiny)


def _lift_parts(x: Tensor, cx2: Tensor, den: Tensor, c: float):
    """float64 (:math:`X_0`, :math:`X_{1:}`) of the Lorentz lift
    :math:`((1 + c\\|x\\|^2)/(\\sqrt c\\,(1 - c\\|x\\|^2)),\\ 2x/(1 - c\\|x\\|^2))` from the
    :func:`_conformal_terms`: the values of :func:`pb.to_lorentz`, bit for bit."""
    x0 = (1 + cx2) / (math.sqrt(c) * den)
    return x0, torch.div(x, (0.5 * den)[:, None])  # 2x / den in one pass (halving den is exact)


def _lift32(x: Tensor, cx2: Tensor, den: Tensor, c: float):
    """(float32 Lorentz lift, float64 :math:`X_0`, float64 :math:`X_{1:}`):
    ``pb.to_lorentz(x, c).to(torch.float32)`` bit for bit, without the float64 (N, D + 1)
    concatenation."""
    x0, tail = _lift_parts(x, cx2, den, c)
    out = torch.empty(x.shape[0], x.shape[1] + 1, dtype=torch.float32)
    out[:, 0] = x0
    out[:, 1:] = tail
    return out, x0, tail


def _dist_from_diff(diff: Tensor, bx: Tensor, by: Tensor, c: float) -> Tensor:
    r"""The module's one distance formula, that of :func:`pb.dist`:
    :math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\,\|y - x\| / \sqrt{b_x b_y})` from the
    explicit differences ``diff = y - x`` (norm over the last dim, in diff's dtype) and
    :math:`b = 1 - c\|\cdot\|^2` (float64, broadcast against the norms). Returns float64."""
    sqrt_c = math.sqrt(c)
    z = torch.linalg.vector_norm(diff, dim=-1).to(torch.float64)
    return torch.asinh_(z.mul_(sqrt_c).div_((bx * by).sqrt_())).mul_(2 / sqrt_c)


class HyperbolicIndex:
    r"""Standalone exact (or approximate) k-NN index for points of the Poincaré ball.

    Design note: docs/design/knn-index.md

    Args:
        c: curvature magnitude (ball radius 1/√c).
        kind: ``"flat"`` (exact, faiss ``IndexFlatIP`` on the Lorentz lift, certified as described
            in the module docstring) or ``"hnsw"`` (approximate candidates from faiss
            ``IndexHNSWFlat``; the candidates are then re-ranked by the exact distance; no
            certification, so recall < 1 is possible).
        rtol: relative accuracy of returned distances that are not recomputed exactly (a tiny
            value, e.g. 1e-15, recomputes every returned distance in float64).
        batch_size: at most this many queries per faiss search call; ``None`` (default) = as
            many as keep each of a batch's (queries × k') arrays at ~16 MB (memory O(k') per
            query, never O(N²)).
        margin: extra candidates fetched beyond k on the first try (default ``max(4, k // 32)``).
        use_gpu: ``None`` or ``True`` = the flat index runs on the GPU(s) whenever faiss sees one
            (faiss-gpu installed); ``False`` = always CPU. HNSW always runs on the CPU (faiss has
            no GPU HNSW).
        error_model: ``"typical"`` or ``"rigorous"`` float32 score error bound (module docstring).
        hnsw_m: HNSW links per node (``kind="hnsw"``), an int in [2, 512] (faiss needs at least 2).
        ef_search: HNSW search breadth (``kind="hnsw"``), an int >= 1, raised to at least the
            number of candidates.
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
            default), ``kind="hnsw"``.

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
        c: float | Tensor | object = 0.1,
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
    ):
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
        self.kind = kind
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
        self._mips_m = None

    @property
    def ntotal(self) -> int:
        return 0 if self._ball is None else int(self._ball.shape[0])

    def _prepare(self, x, name: str):
        """(float64 points, dtype of the distances they ask for, the float32 points or None):
        projected with the margin of their own dtype, as :class:`PoincareDistance` does. The third is
        the projected input itself when it is float32 (its float64 copy is then exact: no check
        needed for the float32 shortcuts of :meth:`_exact_pairs`)."""
        x = _as_2d_float_tensor(x, name)
        dtype = pb.compute_dtype(x.dtype)
        if self.project:
            x = pb.project(x, self.c)
        x32 = x.cpu() if x.dtype == torch.float32 else None
        return x.to(torch.float64), dtype, x32

    def _new_faiss_index(self, dim: int):
        if self.kind == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            # maximum inner product -> nearest neighbour (L2) with one extra coordinate
            # sqrt(M^2 - |Y|^2), so that |Q' - Y'|^2 = |Q|^2 + M^2 - 2 Q.Y; HNSW graphs work far
            # better for L2 than for raw inner products.
            index = faiss.IndexHNSWFlat(dim + 1, self.hnsw_m)
            index.hnsw.efConstruction = self.ef_construction
        # faiss has no GPU HNSW: only the flat index moves; use_gpu=False keeps it on the CPU
        has_gpu = hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0
        if has_gpu and self.kind == "flat" and self.use_gpu is not False:
            index = faiss.index_cpu_to_all_gpus(index)
        return index

    def _with_threads(self, fn, *args):
        # torch and faiss share the OpenMP runtime: the post-processing runs with post_threads,
        # faiss with the caller's count (restored around each faiss call, and at the end)
        faiss_threads = faiss.omp_get_max_threads()
        torch_threads = torch.get_num_threads()
        # faiss's search is one big call per batch, but on a machine whose cores are taken its
        # barriers still wait for descheduled threads: there it gets 1 thread
        self._faiss_threads = uncontended_threads(faiss_threads) if faiss_threads > 1 else 1
        try:
            if self.post_threads == "auto":
                torch.set_num_threads(uncontended_threads(torch_threads) if torch_threads > 1 else 1)
            elif self.post_threads is not None:
                torch.set_num_threads(self.post_threads)
            return fn(*args)
        finally:
            torch.set_num_threads(torch_threads)
            faiss.omp_set_num_threads(faiss_threads)

    def add(self, reference) -> "HyperbolicIndex":
        """Add reference points (N × D ball coordinates), in batches."""
        return self._with_threads(self._add, reference)

    def _add(self, reference) -> "HyperbolicIndex":
        ref, dtype, ref32 = self._prepare(reference, "reference")
        # remember the (only) added tensor so that search(query=the same tensor) skips _prepare
        self._added_src = reference if self._ball is None else None
        self._added_version = getattr(reference, "_version", None)  # detects in-place edits
        if ref.shape[0] == 0:
            raise ValueError("reference is empty: cannot add 0 points")
        if self._dim is not None and ref.shape[1] != self._dim:
            raise ValueError(
                f"reference has dimension {ref.shape[1]} but the index holds dimension {self._dim}"
            )
        if self._index is None:
            self._dim = ref.shape[1]
            self._index = self._new_faiss_index(self._dim + 1)
        ref = ref.cpu()
        cx2, den = _conformal_terms(ref, self.c)
        norms = []
        self._pending_self_lift = None
        for start in range(0, ref.shape[0], 65536):
            chunk = slice(start, start + 65536)
            Y32, y0, tail = _lift32(ref[chunk], cx2[chunk], den[chunk], self.c)
            if self._ball is None and ref.shape[0] <= _KEPT_LIFT_ROWS:
                # self-retrieval usually follows: its queries' Q_{1:} = X_{1:} / X_0 starts from this
                self._pending_self_lift = (y0, tail)
            del tail
            if self.kind == "hnsw":  # every |Y_j| (the extra coordinate)
                nrm = torch.linalg.vector_norm(Y32.double(), dim=1)
            else:  # only max_j |Y_j| enters the error bound
                nrm = _max_lifted_norm(Y32, y0, cx2[chunk], den[chunk], self.c)
            norms.append(nrm)
            if self.kind == "hnsw":
                if self._mips_m is None:
                    self._mips_m = 2.0 * float(nrm.max())
                if float(nrm.max()) > self._mips_m:
                    raise ValueError("hnsw index: a later add() holds points much nearer the boundary "
                                     "than the first; rebuild the index with all points")
                extra = (self._mips_m ** 2 - nrm ** 2).clamp_min(0).sqrt().to(torch.float32)
                Y32 = torch.cat([Y32, extra[:, None]], dim=1)
            self._index.add(np.ascontiguousarray(Y32.numpy()))
        norms = torch.cat(norms)
        self._ball = ref if self._ball is None else torch.cat([self._ball, ref])
        self._dtype = dtype if self._dtype is None else torch.promote_types(self._dtype, dtype)
        self._cx2 = cx2 if self._cx2 is None else torch.cat([self._cx2, cx2])
        self._bball = den if self._bball is None else torch.cat([self._bball, den])
        self._query_cache = None
        # float32 copy: the input itself when one float32 tensor was added, else made on first use
        self._ball32 = ref32 if (ref32 is not None and self._ball is ref) else None
        self._norms = norms if self._norms is None else torch.cat([self._norms, norms])
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
        if self._ball is None:
            raise ValueError("the index is empty: call add(reference) before search")
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
        if self._get_ball32() is not None:
            if q is self._ball:
                q32 = self._get_ball32()
            elif q32_input is not None:
                q32 = q32_input
            else:
                q32 = q.to(torch.float32)
                q32 = q32 if torch.equal(q32.double(), q) else None
        rows = self._rows_per_batch(k)
        for start in range(0, m, rows):
            stop = min(m, start + rows)
            ids = query_ids[start:stop] if excl else None
            block = q if (start == 0 and stop == m) else q[start:stop]  # the whole set: its cached terms
            d, i = self._search_batch(block, k, ids, None if q32 is None else q32[start:stop], out_dtype)
            out_d[start:stop] = d
            out_i[start:stop] = i
        self._query_cache = None  # (do not keep the last query block alive)
        return out_d.to(device), out_i.to(device)

    def _margin(self, k: int) -> int:
        # a few candidates past k are enough for the gap test of the certification to succeed
        return self.margin if self.margin is not None else max(4, k // 32)

    def _rows_per_batch(self, k: int) -> int:
        # at most batch_size, and few enough that each (rows x k') int64 / float64 array of a batch
        # stays at 16 MB: the allocator then reuses its memory from batch to batch, while larger
        # blocks (glibc maps anything over 32 MB afresh) are new pages every time
        rows = max(1, (1 << 21) // (k + 1 + self._margin(k)))
        return rows if self.batch_size is None else max(1, min(self.batch_size, rows))

    def _faiss_search(self, Q32: Tensor, kk: int):
        # torch and faiss share the OpenMP runtime: give faiss back the caller's thread count
        post = torch.get_num_threads()
        faiss.omp_set_num_threads(getattr(self, "_faiss_threads", faiss.omp_get_max_threads()))
        try:
            Q32 = np.ascontiguousarray(Q32.numpy())
            if self.kind == "flat":
                s, i = self._index.search(Q32, kk)
                return torch.from_numpy(s), torch.from_numpy(i)
            self._index.hnsw.efSearch = max(self.ef_search, kk)
            Qa = np.concatenate([Q32, np.zeros((Q32.shape[0], 1), np.float32)], axis=1)
            l2, i = self._index.search(np.ascontiguousarray(Qa), kk)
            qn2 = (Q32.astype(np.float64) ** 2).sum(1, keepdims=True)
            s = (qn2 + self._mips_m ** 2 - l2) / 2  # back to the inner product
            return torch.from_numpy(s.astype(np.float32)), torch.from_numpy(i)
        finally:
            torch.set_num_threads(post)

    def _search_batch(self, q: Tensor, k: int, ids: Optional[Tensor], q32: Optional[Tensor],
                      out_dtype: torch.dtype):
        n = self.ntotal
        kk_needed = k + (1 if ids is not None else 0)
        kk = min(n, kk_needed + self._margin(k))
        pending, self._pending_self_lift = self._pending_self_lift, None
        if q is self._ball and pending is not None:  # the lift add() computed for these points
            X0, tail = pending
        else:
            X0, tail = _lift_parts(q, *self._query_terms(q), self.c)
        # Q = X / X_0 with Q_0 = -1, rounded to float32 (the division, then the rounding: bit for bit
        # what dividing pb.to_lorentz's output gives)
        Q32 = torch.empty(q.shape[0], q.shape[1] + 1, dtype=torch.float32)
        Q32[:, 0] = -1.0
        Q32[:, 1:] = tail.div_(X0[:, None])
        qnorm = torch.linalg.vector_norm(Q32.double(), dim=1)
        s, idx = self._faiss_search(Q32, kk)
        if self.kind == "hnsw":
            return self._rerank(q, s, idx, k, ids, out_dtype)
        # one faiss call and O(B·k') vectorised work; rows it cannot certify (rare) are searched
        # again with more candidates
        out_d, out_i, ok = self._refine(q, X0, qnorm, s, idx, k, ids, kk >= n, q32, out_dtype)
        todo = (~ok).nonzero(as_tuple=True)[0]
        # beyond this many candidates a row is settled by a chunked exact scan instead: a block of
        # (near-)duplicates, whose ties go by index, would otherwise double k' up to N (O(B·N))
        kk_cap = max(4 * kk_needed, 256)
        while todo.numel() > 0:
            kk = min(n, 2 * kk)
            sub_ids = None if ids is None else ids[todo]
            if kk > kk_cap:
                d, i = self._exact_scan(q[todo], k, sub_ids)
                out_d[todo], out_i[todo] = d.to(out_dtype), i
                break
            s, idx = self._faiss_search(Q32[todo], kk)
            d, i, ok = self._refine(q[todo], X0[todo], qnorm[todo], s, idx, k, sub_ids, kk >= n,
                                    None if q32 is None else q32[todo], out_dtype)
            out_d[todo[ok]], out_i[todo[ok]] = d[ok], i[ok]
            todo = todo[~ok]
        return out_d, out_i

    def _refine(self, q, X0, qnorm, s32, idx, k, ids, complete, q32, out_dtype):
        r"""Certified top-k from one faiss result of the flat index (module docstring, steps 1-2).

        Scores are sorted, so two candidates can be misordered only inside a *cluster*: a run of
        adjacent positions with gaps :math:`\le 2e_q` (a closer non-adjacent pair implies a
        close adjacent one). Members of the clusters that matter (every multi-member cluster in
        full-order mode; with ``exact_ranks``, the clusters that straddle a listed rank K, i.e.
        contain positions K-1 and K) among the first k (+ the tail, which always lies in the
        cluster of position k-1) are recomputed in float64 and sorted by (distance, index)
        *within their cluster*: a member's true value stays on its side of every gap
        :math:`> 2e_q`, so the positions a cluster occupies do not change and no row is re-sorted.
        Elsewhere the distance is :math:`\operatorname{arcosh}(-cX_0\hat s)/\sqrt c`; those whose
        interval is wider than ``rtol`` relative are recomputed too.

        Returns (distances (B×k) ``out_dtype``, indices (B×k), ok (B,)): rows with ``ok`` False
        could not be certified with these candidates and must be searched again with more.
        """
        c = self.c
        s_last = s32[:, -1].double()  # every non-candidate scores <= this
        if ids is not None:
            s32, idx = _drop_self(s32, idx, ids)
        B, kk = idx.shape
        e = self._gamma() * qnorm * float(self._norms.max())
        two_e = 2.0 * e
        bar = s32[:, k - 1].double() - two_e
        if kk > k:
            ntail = (s32[:, k:].double() >= bar[:, None]).sum(1)
        else:
            ntail = torch.zeros(B, dtype=torch.int64)
        region_end = k + ntail  # positions < region_end may belong to the top k
        width = min(kk, k + int(ntail.max()) + 1)
        if self.exact_ranks is None:
            r, p = _all_cluster_members(s32[:, :width], two_e, region_end)
        else:
            ranks = sorted({K for K in self.exact_ranks if K < k} | {k})
            r, p = _boundary_cluster_members(s32, two_e, [K for K in ranks if K < width],
                                             region_end)
        # distances from the scores (float64 chain)
        t = s32[:, :k].double()
        out_d = t.mul_((-c * X0)[:, None]).clamp_min_(1.0).acosh_().div_(math.sqrt(c)).to(out_dtype)
        del t
        out_i = idx[:, :k].clone()
        marked_key = None
        if r.numel():
            cols = idx[r, p]
            dex = self._exact_pairs(q, r, cols)
            # cluster id: a new cluster starts where the row changes, a position is skipped, or
            # the gap to the previous member is not close
            sp = s32[r, p].double()
            joined = (r[1:] == r[:-1]) & (p[1:] == p[:-1] + 1) & ((sp[:-1] - sp[1:]) <= two_e[r[1:]])
            cid = torch.cumsum(torch.cat([torch.ones(1, dtype=torch.int64), (~joined).long()]), 0)
            order = torch.argsort(cols, stable=True)
            order = order[torch.argsort(dex[order], stable=True)]
            order = order[torch.argsort(cid[order], stable=True)]
            keep = p < k
            rk, pk = r[keep], p[keep]
            out_d[rk, pk] = dex[order][keep].to(out_dtype)
            out_i[rk, pk] = cols[order][keep]
            marked_key = r * kk + p
        # accuracy of the distances taken from scores: arcosh(hi) - arcosh(lo) <= (hi - lo) /
        # sqrt(lo^2 - 1) (arcosh' is decreasing), a sufficient test; narrow for every position
        # from the first narrow one on (s is sorted), so a binary search finds the wide prefix
        wide_len = self._wide_prefix(s32, X0, e, k)
        if bool((wide_len > 0).any()):
            rows = (wide_len > 0).nonzero(as_tuple=True)[0]
            wr, wp = _expand_ranges(rows, torch.zeros_like(rows), wide_len[rows])
            if marked_key is not None:
                free = ~torch.isin(wr * kk + wp, marked_key)
                wr, wp = wr[free], wp[free]
            if wr.numel():
                # only accuracy is at stake here: float32 differences (relative error
                # _kappa() < rtol) are enough when the inputs are float32 numbers
                fast = q32 if self._kappa() < self.rtol else None
                out_d[wr, wp] = self._exact_pairs(q, wr, out_i[wr, wp], q32=fast).to(out_dtype)
                self._restore_order(q, out_d, out_i, torch.unique(wr), int(wp.max()) + 2)
        if complete:
            return out_d, out_i, torch.ones(B, dtype=torch.bool)
        ok = (s_last < bar) & (region_end < kk) if kk > k else s_last < bar
        return out_d, out_i, ok

    def _wide_prefix(self, s32, X0, e, k):
        """Per row, the number of leading positions (< k) whose score-derived distance may be off
        by more than ``rtol`` relative (binary search on the monotone test)."""
        sqrt_c = math.sqrt(self.c)
        B = s32.shape[0]
        cx0 = self.c * X0
        span = 2.0 * cx0 * e
        lo_pos = torch.zeros(B, dtype=torch.int64)
        hi_pos = torch.full((B,), k, dtype=torch.int64)
        rows = torch.arange(B)
        while True:
            active = lo_pos < hi_pos
            if not bool(active.any()):
                return lo_pos
            mid = torch.where(active, (lo_pos + hi_pos) // 2, lo_pos.clamp_max(k - 1))
            sm = s32[rows, mid].double()
            a_mid = (-cx0 * sm).clamp_min(1.0)
            a_lo = (-cx0 * (sm + e)).clamp_min(1.0)
            d_est = torch.acosh(a_mid) / sqrt_c
            narrow = span <= (self.rtol * sqrt_c) * d_est * torch.sqrt(a_lo * a_lo - 1.0)
            hi_pos = torch.where(active & narrow, mid, hi_pos)
            lo_pos = torch.where(active & ~narrow, mid + 1, lo_pos)

    def _restore_order(self, q, out_d, out_i, rows, window):
        """After recomputing some distances (in float32 differences, or exactly next to
        score-derived ones), neighbours may be out of order by their error: recompute such
        adjacent pairs in float64 (then they are ordered, except inside near-tie clusters left in
        faiss's order by ``exact_ranks``) and sort the rows that still are not."""
        if rows.numel() == 0:
            return
        w = min(window, out_d.shape[1])
        if w < 2:
            return
        seg = out_d[rows, :w]
        bad = seg[:, 1:] < seg[:, :-1]
        if not bool(bad.any()):
            return
        br, bp = bad.nonzero(as_tuple=True)
        rr = torch.cat([rows[br], rows[br]])
        pp = torch.cat([bp, bp + 1])
        key = torch.unique(rr * out_d.shape[1] + pp)
        rr, pp = key // out_d.shape[1], key % out_d.shape[1]
        out_d[rr, pp] = self._exact_pairs(q, rr, out_i[rr, pp]).to(out_d.dtype)
        still = torch.unique(rr)
        still = still[(out_d[still, 1:] < out_d[still, :-1]).any(dim=1)]
        if still.numel():
            perm = _sort_by_dist_index(out_d[still], out_i[still])
            out_d[still] = out_d[still].gather(1, perm)
            out_i[still] = out_i[still].gather(1, perm)

    def _rerank(self, q, s32, idx, k, ids, out_dtype):
        """``kind="hnsw"``: exact distances of every candidate, sorted by (distance, index)."""
        if ids is not None:
            s32, idx = _drop_self(s32, idx, ids)
        valid = idx >= 0  # HNSW may pad with -1
        r, p = valid.nonzero(as_tuple=True)
        d = torch.full(idx.shape, math.inf, dtype=torch.float64)
        d[r, p] = self._exact_pairs(q, r, idx[r, p])
        perm = _sort_by_dist_index(d, torch.where(valid, idx, idx.shape[1] + self.ntotal))[:, :k]
        return d.gather(1, perm).to(out_dtype), idx.gather(1, perm)

    def _get_ball32(self):
        """float32 copy of the references if it is exact (float32 inputs), else None; cached."""
        if self._ball32 is None:
            ball32 = self._ball.to(torch.float32)
            self._ball32 = ball32 if torch.equal(ball32.double(), self._ball) else False
        return self._ball32 if self._ball32 is not False else None

    def _gamma(self) -> float:
        d1 = self._dim + 1
        if self.error_model == "rigorous":  # worst-case float32 dot product (Higham's γ_n)
            return (d1 + 2) * _U32 * 1.01
        # typical: rounding errors of a length-n float32 sum grow like sqrt(n) u (random-walk model)
        return 2.0 * math.sqrt(d1 + 2) * _U32

    def _kappa(self) -> float:
        """Relative error bound of a distance from float32 differences: each difference is
        rounded once, the sum of D squares at most D times (halved by the sqrt)."""
        D = self._dim
        if self.error_model == "rigorous":
            return (D / 2 + 3) * _U32 * 1.01 + 1e-12
        return 2.0 * (math.sqrt(D) + 3) * _U32 + 1e-12

    def _query_terms(self, q: Tensor):
        """(c|q|², 1 - c|q|²) per row of the query block ``q``: the references' own when ``q`` is the
        reference set (self-retrieval), else computed once per block and kept for its later calls."""
        if q is self._ball:
            return self._cx2, self._bball
        cached = self._query_cache
        if cached is None or cached[0] is not q:
            cached = self._query_cache = (q, *_conformal_terms(q, self.c))
        return cached[1], cached[2]

    def _exact_pairs(self, q: Tensor, rows: Tensor, cols: Tensor, q32=None) -> Tensor:
        """float64 distances of (query row, reference index) pairs by :func:`_dist_from_diff`, in
        chunks of 2^15 pairs (a few MB gathered at a time). With ``q32`` (the float32 queries,
        exact) and float32 references the differences are taken in float32 (error ``_kappa()``)."""
        ball32 = self._get_ball32()
        fast = q32 is not None and ball32 is not None
        # float64 differences from float32 inputs: gathering the float32 copy and subtracting in
        # float64 is bit-identical to gathering the float64 rows, with half the memory traffic
        source = ball32 if ball32 is not None else self._ball
        bq = self._query_terms(q)[1]
        out = torch.empty(rows.shape[0], dtype=torch.float64)
        step = 1 << 15
        for a in range(0, rows.shape[0], step):
            r, cc = rows[a: a + step], cols[a: a + step]
            diff = _gather_rows(source, cc)
            if fast:
                diff.sub_(_gather_rows(q32, r))
            else:
                diff = diff.to(torch.float64).sub_(_gather_rows(q, r))
            out[a: a + step] = _dist_from_diff(diff, bq.index_select(0, r),
                                               self._bball.index_select(0, cc), self.c)
        return out

    def _exact_scan(self, q: Tensor, k: int, ids: Optional[Tensor]):
        """Exact top-k of each row by a float64 scan over every reference, sorted by
        (distance, index): the fallback for rows that the candidate lists cannot certify.
        Memory O(rows·k + block): query rows in blocks, references in chunks, running top-k."""
        n, D = self._ball.shape
        B = q.shape[0]
        out_d = torch.empty((B, k), dtype=torch.float64)
        out_i = torch.empty((B, k), dtype=torch.int64)
        rows_per_block = 16
        # ~16 MB temporaries: the allocator reuses them (larger ones are fresh pages every time)
        chunk = max(k, (1 << 21) // max(1, rows_per_block * D))
        bq_all = self._query_terms(q)[1]
        for a in range(0, B, rows_per_block):
            x = q[a: a + rows_per_block]
            best_d = torch.full((x.shape[0], 0), math.inf, dtype=torch.float64)
            best_i = torch.empty((x.shape[0], 0), dtype=torch.int64)
            for lo in range(0, n, chunk):
                y = self._ball[lo: lo + chunk]
                d = _dist_from_diff(y[None, :, :] - x[:, None, :], bq_all[a: a + rows_per_block, None],
                                    self._bball[None, lo: lo + chunk], self.c)
                cols = torch.arange(lo, lo + y.shape[0]).expand(x.shape[0], -1)
                if ids is not None:
                    d = d.masked_fill(cols == ids[a: a + rows_per_block, None], math.inf)
                cat_d, cat_i = torch.cat([best_d, d], 1), torch.cat([best_i, cols], 1)
                keep = _sort_by_dist_index(cat_d, cat_i)[:, :k]
                best_d, best_i = cat_d.gather(1, keep), cat_i.gather(1, keep)
            out_d[a: a + rows_per_block], out_i[a: a + rows_per_block] = best_d, best_i
        return out_d, out_i


def _gather_rows(x: Tensor, index: Tensor) -> Tensor:
    """``x.index_select(0, index)`` (a copy of the rows): on CPU by numpy's ``take``, whose output
    comes from numpy's allocator, where aten's gather faulted in a fresh output of several MB per
    call."""
    if x.device.type == "cpu" and index.device.type == "cpu" and x.dim() == 2:
        return torch.from_numpy(np.take(x.numpy(), index.numpy(), axis=0))
    return x.index_select(0, index)


def _max_lifted_norm(Y32: Tensor, y0: Tensor, cx2: Tensor, den: Tensor, c: float) -> Tensor:
    """(1,) float64: :math:`\\max_j \\|Y_j\\|` over the float32 lifted rows, the value
    ``vector_norm(Y32.double(), dim=1).max()`` gives, from the few rows that can hold it: a float32
    row's norm is within 2⁻²⁴ (relative) of the exact :math:`\\|Y_j\\|^2 = Y_0^2 + 4\\|x\\|^2/(1 - c\\|x\\|^2)^2`
    (known in float64 from the lift's terms), so a row whose exact norm is below the largest by more
    than 2⁻²⁰ cannot be the largest once rounded."""
    exact = (y0 * y0 + (4.0 / c) * cx2 / (den * den)).sqrt_()
    close = (exact >= exact.max() * (1.0 - 2.0 ** -20)).nonzero().squeeze(1)
    return torch.linalg.vector_norm(Y32.index_select(0, close).double(), dim=1).max().reshape(1)


def _expand_ranges(rows: Tensor, starts: Tensor, lengths: Tensor):
    """(row, position) pairs, row-major, of the positions ``starts[i] .. starts[i] + lengths[i] - 1``
    of each ``rows[i]``."""
    rr = torch.repeat_interleave(rows, lengths)
    offsets = torch.cumsum(lengths, 0) - lengths
    pp = torch.repeat_interleave(starts - offsets, lengths) + torch.arange(int(lengths.sum()))
    return rr, pp


def _all_cluster_members(s32: Tensor, two_e: Tensor, region_end: Tensor):
    """(rows, positions), row-major, of every member of a multi-member cluster (adjacent float32
    scores within ``two_e`` of each other) before ``region_end``. The float32 differences are
    compared with a threshold rounded up, so a close gap is never missed."""
    B, w = s32.shape
    if w < 2:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    thr = (two_e * (1.0 + 2.0 ** -20)).to(torch.float32)
    close = (s32[:, :-1] - s32[:, 1:]) <= thr[:, None]
    mark = torch.zeros((B, w), dtype=torch.bool)
    mark[:, :-1] |= close
    mark[:, 1:] |= close
    mark &= torch.arange(w)[None, :] < region_end[:, None]
    return mark.nonzero(as_tuple=True)


def _boundary_cluster_members(s32: Tensor, two_e: Tensor, ranks, region_end: Tensor):
    """(rows, positions), row-major and unique, of the clusters that contain both position K-1
    and K for some K in ``ranks`` (each K < number of columns), cut at ``region_end``. Each
    cluster's extent is found in a window around K that grows until both ends are seen."""
    B, w = s32.shape
    keys = []
    for K in ranks:
        gap = s32[:, K - 1].double() - s32[:, K].double()
        rows = (gap <= two_e).nonzero(as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        te = two_e[rows]
        pos = K - 1
        half = 8
        left = torch.full((rows.numel(),), -1, dtype=torch.int64)
        right = torch.full((rows.numel(),), -1, dtype=torch.int64)
        todo = torch.arange(rows.numel())
        while todo.numel():
            a, b = max(0, pos - half), min(w, pos + half + 2)
            seg = s32[rows[todo], a:b].double()
            close = (seg[:, :-1] - seg[:, 1:]) <= te[todo, None]  # gap j joins a+j, a+j+1
            n_left = pos - a  # gaps a .. pos-1 lie left of position pos
            j = torch.arange(close.shape[1])
            brk_left = torch.where(~close[:, :n_left], j[:n_left], -1).amax(1) if n_left else \
                torch.full((todo.numel(),), -1, dtype=torch.int64)
            brk_right = torch.where(~close[:, n_left:], j[n_left:], close.shape[1]).amin(1)
            l_ok = (brk_left >= 0) | (a == 0)
            r_ok = (brk_right < close.shape[1]) | (b == w)
            done = l_ok & r_ok
            left[todo[done]] = a + brk_left[done] + 1
            right[todo[done]] = torch.clamp(a + brk_right[done], max=w - 1)
            todo = todo[~done]
            half *= 4
        right = torch.minimum(right, region_end[rows] - 1)
        rr, pp = _expand_ranges(rows, left, (right - left + 1).clamp_min(0))
        keys.append(rr * w + pp)
    if not keys:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)
    key = torch.unique(torch.cat(keys))
    return key // w, key % w


def _drop_self(s: Tensor, idx: Tensor, ids: Tensor):
    """Remove each row's own index (present at most once); rows without it lose their last
    column instead, so that every row keeps kk - 1 candidates in score order."""
    B, kk = idx.shape
    if kk > 1 and torch.equal(idx[:, 0], ids):  # self-retrieval: each point is its own nearest
        return s[:, 1:], idx[:, 1:]
    is_self = idx == ids[:, None]
    # position of the self entry, kk - 1 where absent; keep columns j < pos and j + 1 >= pos
    pos = torch.where(is_self.any(dim=1), is_self.to(torch.uint8).argmax(dim=1), kk - 1)
    cols = torch.arange(kk - 1).expand(B, kk - 1)
    cols = cols + (cols >= pos[:, None]).to(cols.dtype)
    return s.gather(1, cols), idx.gather(1, cols)


def _sort_by_dist_index(d: Tensor, idx: Tensor) -> Tensor:
    """Row-wise permutation sorting by (distance, index)."""
    by_idx = torch.argsort(idx, dim=1)
    order = torch.argsort(d.gather(1, by_idx), dim=1, stable=True)
    return by_idx.gather(1, order)
