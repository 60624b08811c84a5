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

Why the float32 scores are re-checked
-------------------------------------
Near the boundary :math:`X_0` is large and the float32 score cancels (the same happens to
Euclidean L2 search for close pairs). Every float32 score of query q, returned by faiss or not, is
within :math:`e_q = \gamma\,|Q_q|\max_j|Y_j|` of the true score (closed form, one number per
query). Two error models:

* ``error_model="typical"`` (default): :math:`\gamma = 2\sqrt{D + 3}\,u` (u = 2⁻²⁴), the
  random-walk size of float32 summation errors with a 2x margin. Not a worst-case guarantee; the
  tests and ``bench/knn.py`` check the results against a float64 brute force.
* ``error_model="rigorous"``: :math:`\gamma = (D + 3)\,u` (Higham's worst-case bound for a
  float32 dot product of length D+1, plus the rounding of Q and Y). A guarantee, ~10x pessimistic.

Fast path (flat index, one faiss call per batch, O(batch · k) vectorised work, no Python loop
over queries): faiss returns k' = k + margin candidates sorted by float32 score.

1. *Set*: the first k candidates have true score :math:`\ge \hat s_{k-1} - e_q`, so anything
   with :math:`\hat s < \hat s_{k-1} - 2e_q` (every non-candidate has
   :math:`\hat s \le \hat s_{k'}`) is beaten by all of them: the set is certified when
   :math:`\hat s_{k'} < \hat s_{k-1} - 2e_q`, and besides the first k only the "tail" of
   candidates with :math:`\hat s \ge \hat s_{k-1} - 2e_q` can enter it.
2. *Order and distances*, ``typical``: from the scores, :math:`d = \operatorname{arcosh}(-cX_0
   \hat s)/\sqrt c`. Clusters (runs of adjacent gaps :math:`\le 2e_q`) among the first k + tail
   are recomputed in float64 and sorted *within* the positions they occupy (all clusters by
   default; with ``exact_ranks`` only those that straddle a listed rank). Distances whose
   interval is wider than ``rtol`` form a prefix of each row (the interval shrinks relative to d
   as d grows), found by binary search, and are recomputed. A few % of the pairs on trained-like
   embeddings at k = 8; at k = 1000 most pairs sit in clusters, which is what ``exact_ranks``
   skips. ``rigorous``: the bound is too wide for that, so all k
   distances are recomputed from ball coordinates, in float32 differences when the inputs are
   float32 numbers (relative error :math:`\le (D/2+3)u`), and adjacent entries whose error bars
   touch are recomputed in float64.
3. Rows that fail the certification are searched again with k' doubled (``typical``: the same
   cluster method on the longer list; ``rigorous`` and HNSW: the general loop below). Beyond
   :math:`k' = \max(4(k+1), 256)` a row (a block of near-duplicates, whose ties go by index) is
   settled by a chunked float64 scan over all references instead. The general loop bounds each
   candidate's interval individually:

   a. candidates whose interval is wider than ``rtol`` (relative, in distance) are recomputed
      exactly (float64, from the ball coordinates);
   b. for each of the first k positions, any candidate whose interval reaches below that
      position's upper end (a possible misordering) is recomputed exactly, until no inexact
      interval overlaps another (a suffix-minimum test, so non-adjacent overlaps are found too);
   c. certification as in 1.

The exact float64 distance is :math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\|x-y\|/
\sqrt{(1-c\|x\|^2)(1-c\|y\|^2)})` from explicit differences (exact for close pairs).

Why the Lorentz lift and not the ball-coordinate form: for a fixed query the ranking by d is also
the ranking by :math:`\|x-y\|^2/(1-c\|y\|^2) = [\|x\|^2, -2x, 1]\cdot[1/b_y, y/b_y,
\|y\|^2/b_y]`, an inner product over D+2 dims. Its float32 error relative to
:math:`\delta = \|x-y\|^2` is about :math:`\gamma(\|x\|+\|y\|)^2/\delta`, the Lorentz
score's about :math:`\gamma(1+c\|x\|^2)(1+c\|y\|^2)/(c\,\delta)`; for :math:`c\|x\|^2 =
\tanh^2(0.73) \approx 0.39` (the default clip radius 2.3 at c = 0.1) the two differ by ~20%, so
the lift was kept (not measured further; the ball form wins clearly only near the origin).

Under the error model, the result equals a float64 brute force (same tie rule) as a set and in
order, with distances to ``rtol`` relative (those recomputed in float64 to float64 rounding).

Ties are broken by the smaller reference index (the result is sorted by ``(distance, index)``).
Exact ties are only possible between exactly recomputed candidates (an inexact interval that
touches another is recomputed), so the rule is applied to exact float64 values.

Memory: queries are processed in batches of ``batch_size``; per batch O(batch_size · k') numbers,
never O(N²).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .. import poincare_ball as pb

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None

_U32 = 2.0 ** -24


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


def _lift(x64: Tensor, c: float):
    """float64 hyperboloid lift: returns (X0 (N,), X (N, D+1))."""
    X = pb.to_lorentz(x64, c)
    return X[:, 0], X


class HyperbolicIndex:
    r"""Standalone exact (or approximate) k-NN index for points of the Poincaré ball.

    Args:
        c: curvature magnitude (ball radius 1/√c).
        kind: ``"flat"`` (exact, faiss ``IndexFlatIP`` on the Lorentz lift, certified as described
            in the module docstring) or ``"hnsw"`` (approximate candidates from faiss
            ``IndexHNSWFlat``; the candidates are then re-ranked by the exact distance; no
            certification, so recall < 1 is possible).
        rtol: relative accuracy of returned distances that are not recomputed exactly.
        batch_size: at most this many queries per faiss search call; ``None`` (default) = as
            many as keep each of a batch's (queries × k') arrays at ~16 MB (memory O(k') per
            query, never O(N²)).
        margin: extra candidates fetched beyond k on the first try (default ``max(4, k // 32)``).
        use_gpu: ``None`` or ``True`` = the flat index runs on the GPU(s) whenever faiss sees one
            (faiss-gpu installed); ``False`` = always CPU. HNSW always runs on the CPU (faiss has
            no GPU HNSW).
        hnsw_m, ef_search: HNSW parameters (``kind="hnsw"``); ``ef_search`` is raised to at least
            the number of candidates.
        project: project inputs onto the ball first (points on/outside the ball have no distance).
        post_threads: torch intra-op threads for the work around the faiss calls (lift, exact
            distances of the k candidates, sorting); ``None`` keeps torch's setting. That work is
            small memory-bound element-wise passes; measured on a loaded 2-core machine, 2 threads
            made it ~3x slower than 1 (barrier waits), so the default is 1. faiss itself runs
            with the thread count that was set before the call.
        exact_ranks: ``None`` (default) = the order is exact at every rank. A tuple of ranks K
            (e.g. the Recall@K list) = the *set* of the first K neighbours is exact for each K
            given and for k itself, and every returned distance is within ``rtol``; between those
            ranks, neighbours whose float32 scores lie within the error bound of each other (true
            distances within ~1e-6 relative) keep faiss's order instead of being re-sorted in
            float64. Recall@K for the listed K is then exactly the brute-force value; at k = 1000
            on 60,000 points this skips most of the float64 work (see ``bench/knn.py``).
            Applies to ``kind="flat"`` with ``error_model="typical"``.

    Example:
        >>> index = HyperbolicIndex(c=0.1)
        >>> index.add(reference)
        >>> distances, indices = index.search(query, k=10)
    """

    def __init__(
        self,
        c: float = 0.1,
        kind: str = "flat",
        rtol: float = 1e-5,
        batch_size: Optional[int] = None,
        margin: Optional[int] = None,
        use_gpu: Optional[bool] = None,
        error_model: str = "typical",
        hnsw_m: int = 32,
        ef_search: int = 128,
        project: bool = True,
        post_threads: Optional[int] = 1,
        exact_ranks=None,
    ):
        self.c = float(pb.as_curvature(c, torch.float64))
        if exact_ranks is not None:
            ranks = tuple(sorted({int(r) for r in exact_ranks}))
            if not ranks or ranks[0] < 1:
                raise ValueError(f"exact_ranks must be None or positive ranks, got {exact_ranks!r}")
            exact_ranks = ranks
        self.exact_ranks = exact_ranks
        if kind not in ("flat", "hnsw"):
            raise ValueError(f"kind must be 'flat' or 'hnsw', got {kind!r}")
        if not (rtol > 0 and math.isfinite(rtol)):
            raise ValueError(f"rtol must be > 0, got {rtol}")
        if batch_size is not None and int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if margin is not None and int(margin) < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if faiss is None:  # pragma: no cover
            raise ImportError("HyperbolicIndex needs faiss (pip install faiss-cpu)")
        self.kind = kind
        if error_model not in ("typical", "rigorous"):
            raise ValueError(f"error_model must be 'typical' or 'rigorous', got {error_model!r}")
        self.error_model = error_model
        self.rtol = float(rtol)
        self.batch_size = None if batch_size is None else int(batch_size)
        self.margin = margin
        self.use_gpu = use_gpu
        self.hnsw_m = int(hnsw_m)
        self.ef_search = int(ef_search)
        self.project = project
        if post_threads is not None and int(post_threads) < 1:
            raise ValueError(f"post_threads must be None or >= 1, got {post_threads}")
        self.post_threads = None if post_threads is None else int(post_threads)
        self.reset()

    # ------------------------------------------------------------------ building
    def reset(self) -> None:
        """Empty the index."""
        self._ball = None  # float64 (N, D) reference ball coordinates (exact recomputation)
        self._norms = None  # float64 (N,) |Y_j| of the float32 lifted vectors
        self._bball = None  # float64 (N,) 1 - c|y_j|^2
        self._ball32 = None  # float32 copy of _ball when that is exact (float32 inputs)
        self._added_src = None
        self._index = None
        self._dim = None
        self._mips_m = None

    @property
    def ntotal(self) -> int:
        return 0 if self._ball is None else int(self._ball.shape[0])

    def _prepare(self, x: Tensor, name: str) -> Tensor:
        x = _as_2d_float_tensor(x, name).to(torch.float64)
        if self.project:
            x = pb.project(x, self.c, eps=pb.boundary_eps(torch.float32))
        return x

    def _new_faiss_index(self, dim: int):
        if self.kind == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            # maximum inner product -> nearest neighbour (L2) with one extra coordinate
            # sqrt(M^2 - |Y|^2), so that |Q' - Y'|^2 = |Q|^2 + M^2 - 2 Q.Y; HNSW graphs work far
            # better for L2 than for raw inner products.
            index = faiss.IndexHNSWFlat(dim + 1, self.hnsw_m)
        if self._want_gpu():
            index = faiss.index_cpu_to_all_gpus(index)
        return index

    def _want_gpu(self) -> bool:
        # faiss has no GPU HNSW: only the flat index moves; use_gpu=False keeps it on the CPU
        has = hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0
        return has and self.kind == "flat" and self.use_gpu is not False

    def add(self, reference) -> "HyperbolicIndex":
        """Add reference points (N × D ball coordinates), in batches."""
        faiss_threads = faiss.omp_get_max_threads()
        torch_threads = torch.get_num_threads()
        self._faiss_threads = faiss_threads
        try:
            if self.post_threads is not None:
                torch.set_num_threads(self.post_threads)
            return self._add(reference)
        finally:
            torch.set_num_threads(torch_threads)
            faiss.omp_set_num_threads(faiss_threads)

    def _add(self, reference) -> "HyperbolicIndex":
        ref = self._prepare(reference, "reference")
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
        norms = []
        for start in range(0, ref.shape[0], 65536):
            _, Y = _lift(ref[start : start + 65536], self.c)
            Y32 = Y.to(torch.float32)
            nrm = torch.linalg.vector_norm(Y32.double(), dim=1)
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
        # 1 - c|y|^2 of every reference, for the exact distances of the candidates
        self._bball = (1 - self.c * (self._ball * self._ball).sum(1)).clamp_min(
            torch.finfo(torch.float64).tiny)
        self._ball32 = None  # float32 copy, made on first use (_get_ball32)
        self._norms = norms if self._norms is None else torch.cat([self._norms, norms])
        return self

    # ------------------------------------------------------------------ search
    def search(self, query, k: int, query_ids: Optional[Tensor] = None):
        faiss_threads = faiss.omp_get_max_threads()
        torch_threads = torch.get_num_threads()
        self._faiss_threads = faiss_threads
        try:
            if self.post_threads is not None:
                torch.set_num_threads(self.post_threads)
            return self._search(query, k, query_ids)
        finally:
            torch.set_num_threads(torch_threads)
            faiss.omp_set_num_threads(faiss_threads)

    def _search(self, query, k: int, query_ids: Optional[Tensor] = None):
        """k nearest references of every query, ascending Poincaré distance.

        Args:
            query: (M × D) ball points.
            k: number of neighbours (1 ≤ k ≤ number of eligible references).
            query_ids: optional (M,) reference index of each query to exclude from its own result
                (self-retrieval); ``-1`` for "exclude nothing".

        Returns:
            ``(distances, indices)``: float32 (M × k) and int64 (M × k) tensors on the query's device.
        """
        if self._ball is None:
            raise ValueError("the index is empty: call add(reference) before search")
        device = query.device if isinstance(query, Tensor) else torch.device("cpu")
        if (self._added_src is not None and query is self._added_src
                and getattr(query, "_version", None) == self._added_version):
            q = self._ball  # self-retrieval: the query was prepared by add() already
        else:
            q = self._prepare(query, "query").cpu()
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
        out_d = torch.empty((m, k), dtype=torch.float32)
        out_i = torch.empty((m, k), dtype=torch.int64)
        # float32 copy of the queries when they are float32 numbers (the float32 distance shortcut
        # is exact-input only); checked once here rather than per batch
        q32 = None
        if self._get_ball32() is not None:
            if q is self._ball:
                q32 = self._get_ball32()
            else:
                q32 = q.to(torch.float32)
                q32 = q32 if torch.equal(q32.double(), q) else None
        rows = self._rows_per_batch(k)
        for start in range(0, m, rows):
            stop = min(m, start + rows)
            ids = query_ids[start:stop] if excl else None
            d, i = self._search_batch(q[start:stop], k, ids, None if q32 is None else q32[start:stop])
            out_d[start:stop] = d
            out_i[start:stop] = i
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

    def _faiss_search(self, Q32: np.ndarray, kk: int):
        # torch and faiss share the OpenMP runtime: give faiss back the caller's thread count
        post = torch.get_num_threads()
        faiss.omp_set_num_threads(getattr(self, "_faiss_threads", faiss.omp_get_max_threads()))
        try:
            return self._faiss_search_inner(Q32, kk)
        finally:
            torch.set_num_threads(post)

    def _faiss_search_inner(self, Q32: np.ndarray, kk: int):
        if self.kind == "hnsw":
            self._index.hnsw.efSearch = max(self.ef_search, kk)
            Qa = np.concatenate([Q32, np.zeros((Q32.shape[0], 1), np.float32)], axis=1)
            l2, i = self._index.search(np.ascontiguousarray(Qa), kk)
            qn2 = (Q32.astype(np.float64) ** 2).sum(1, keepdims=True)
            s = (qn2 + self._mips_m ** 2 - l2) / 2  # back to the inner product
            return torch.from_numpy(s.astype(np.float32)), torch.from_numpy(i)
        s, i = self._index.search(Q32, kk)
        return torch.from_numpy(s), torch.from_numpy(i)

    def _search_batch(self, q: Tensor, k: int, ids: Optional[Tensor], q32: Optional[Tensor] = None):
        n = self.ntotal
        kk_needed = k + (1 if ids is not None else 0)
        kk = min(n, kk_needed + self._margin(k))
        X0, X = _lift(q, self.c)
        Q = X / X0[:, None]
        Q[:, 0] = -1.0
        Q32 = Q.to(torch.float32)
        qnorm = torch.linalg.vector_norm(Q32.double(), dim=1)
        B = q.shape[0]
        res_d = torch.empty((B, k), dtype=torch.float64)
        res_i = torch.empty((B, k), dtype=torch.int64)
        todo = torch.arange(B)
        if self.kind == "flat":
            # fast path: one faiss call, O(B·k') vectorised work; rows it cannot certify (rare)
            # go to the general loop below with more candidates
            s, idx = self._faiss_search(np.ascontiguousarray(Q32.numpy()), kk)
            d, i, ok = self._fast_refine(q, X0, qnorm, s, idx, k, ids, complete=(kk >= n), q32=q32)
            if bool(ok.all()):  # the common case: no copy through boolean masks
                return d.to(torch.float32), i
            res_d[ok] = d[ok].to(res_d.dtype)
            res_i[ok] = i[ok]
            todo = todo[~ok]
            kk = min(n, 2 * kk)
        # beyond this many candidates a row is settled by a chunked exact scan instead: a block of
        # (near-)duplicates, whose ties go by index, would otherwise double k' up to N (O(B·N))
        kk_cap = max(4 * kk_needed, 256)
        while todo.numel() > 0:
            if kk > kk_cap:
                d, i = self._exact_scan(q[todo], k, None if ids is None else ids[todo])
                res_d[todo], res_i[todo] = d, i
                break
            s, idx = self._faiss_search(np.ascontiguousarray(Q32[todo].numpy()), kk)
            sub_ids = None if ids is None else ids[todo]
            if self.kind == "flat" and self.error_model == "typical":
                # the cluster method of the fast path works for any k' (one vectorised pass)
                d, i, ok = self._fast_refine(q[todo], X0[todo], qnorm[todo], s, idx, k, sub_ids,
                                             complete=(kk >= n), q32=None if q32 is None else q32[todo])
            else:
                d, i, ok = self._refine(q[todo], X0[todo], qnorm[todo], s, idx, k, sub_ids,
                                        complete=(kk >= n))
            res_d[todo[ok]] = d[ok].to(res_d.dtype)
            res_i[todo[ok]] = i[ok]
            todo = todo[~ok]
            kk = min(n, 2 * kk)
        return res_d.to(torch.float32), res_i

    def _fast_refine(self, q, X0, qnorm, s32, idx, k, ids, complete, q32=None):
        r"""Certified exact top-k from one faiss result (flat index), O(B·k) vectorised work.

        *Set.* Every float32 score of query q (returned by faiss or not) is within the
        closed-form per-query bound :math:`e_q = \gamma\,|Q_q|\max_j|Y_j|` of the true score.
        The first k candidates all have true score :math:`\ge \hat s_{k-1} - e_q`; a candidate
        (or a non-candidate, whose float32 score is :math:`\le \hat s_{last}`) with
        :math:`\hat s < \hat s_{k-1} - 2e_q` is beaten by all of them. So the set is certified
        when :math:`\hat s_{last} < \hat s_{k-1} - 2e_q`, and only the first k candidates plus
        the few later ones ("tail") with :math:`\hat s \ge \hat s_{k-1} - 2e_q` can be in it.

        *Distances and order.* The lifted float32 score gives distances only to ~1e-5 relative
        (it cancels near the boundary), so the first k candidates get their distance from the ball
        coordinates, :math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\|x-y\|/\sqrt{b_xb_y})`:
        in float32 differences and norms when the (projected) inputs are float32 numbers (relative
        error :math:`\le \kappa` = ``_kappa()``: each difference is rounded once, the sum of D
        squares at most D times), else in float64. Tail candidates are computed in float64. Rows
        are sorted by (distance, index); adjacent entries closer than their error bars
        (:math:`\kappa d` each; the bars' ends increase with d, so adjacent tests find every
        overlap) are recomputed in float64 and their rows re-sorted.

        Returns (distances (B×k) float64, indices (B×k), ok (B,)).
        """
        s_last = s32[:, -1]
        if ids is not None:
            s32, idx = _drop_self(s32, idx, ids)
        B, kk = idx.shape
        e = self._gamma() * qnorm * float(self._norms.max())
        bar = s32[:, k - 1].double() - 2.0 * e
        if self.error_model == "typical":
            return self._score_refine(q, X0, s32, idx, k, e, bar, s_last, complete, q32)
        s = s32.double()
        fast32 = self._get_ball32() is not None and self._kappa() < self.rtol
        fast32 = fast32 and q32 is not None
        d = torch.full((B, kk), math.inf, dtype=torch.float64)
        d[:, :k] = self._dist_rows32(q32, q, idx[:, :k]) if fast32 else self._exact_rows(q, idx[:, :k])
        tail = s[:, k:] >= bar[:, None]  # later candidates that may still enter the top k
        if tail.any():
            r, p = tail.nonzero(as_tuple=True)
            p = p + k
            d[r, p] = self._exact_pairs(q, r, idx[r, p])
        width = k + (int(tail.sum(1).max()) if tail.any() else 0)  # tail is contiguous from k
        width = min(width + 1, kk)  # one more, for the (k-1, k) comparison
        d, idx = d[:, :width], idx[:, :width]
        # faiss returns candidates in (almost) the right order: sort only rows that need it
        # (exact ties go by index: argsort by index, then stable by distance)
        perm = torch.arange(width).expand(B, width)
        unsorted = ~(d[:, 1:] > d[:, :-1]).all(dim=1)
        if unsorted.any():
            perm = perm.clone()
            rr = unsorted.nonzero(as_tuple=True)[0]
            perm[rr] = _sort_by_dist_index(d[rr], idx[rr])
        d, idx = d.gather(1, perm), idx.gather(1, perm)
        if fast32:
            # adjacent pairs (within the first k + 1) whose error bars touch: recompute exactly
            kap = self._kappa()
            lim = min(k + 1, width)
            close = (d[:, 1:lim] * (1 - kap)) <= (d[:, : lim - 1] * (1 + kap))
            if close.any():
                mark = torch.zeros((B, width), dtype=torch.bool)
                mark[:, : lim - 1] |= close
                mark[:, 1:lim] |= close
                r, p = mark.nonzero(as_tuple=True)
                d[r, p] = self._exact_pairs(q, r, idx[r, p])
                rr = mark.any(dim=1).nonzero(as_tuple=True)[0]
                pr = _sort_by_dist_index(d[rr], idx[rr])
                d[rr], idx[rr] = d[rr].gather(1, pr), idx[rr].gather(1, pr)
        out_d, out_i = d[:, :k].contiguous(), idx[:, :k].contiguous()
        if complete:
            return out_d, out_i, torch.ones(B, dtype=torch.bool)
        ok = (s_last.double() < bar) & ~tail[:, -1] if kk > k else s_last.double() < bar
        return out_d, out_i, ok

    def _score_refine(self, q, X0, s32, idx, k, e, bar, s_last, complete, q32=None):
        r"""``error_model="typical"``: order and distances from the float32 scores themselves,
        float64 recomputation only where they cannot decide (a few % of the pairs).

        Scores are sorted, so two candidates can be misordered only inside a *cluster*: a run of
        adjacent positions with gaps :math:`\le 2e_q` (a closer non-adjacent pair implies a
        close adjacent one). Members of the clusters that matter (every multi-member cluster in
        full-order mode; with ``exact_ranks``, the clusters that straddle a listed rank K, i.e.
        contain positions K-1 and K) among the first k (+ the tail, which always lies in the
        cluster of position k-1) are recomputed in float64 and sorted by (distance, index)
        *within their cluster*: a member's true value stays on its side of every gap
        :math:`> 2e_q`, so the positions a cluster occupies do not change and no row is re-sorted.
        Elsewhere the distance is :math:`\operatorname{arcosh}(-cX_0\hat s)/\sqrt c`; those whose
        interval is wider than ``rtol`` relative (a prefix of each row: the interval shrinks
        relative to d as d grows) are recomputed too.

        Work per batch: one float64 pass chain for the k distances, O(B) gathers for the rank
        boundaries and the wide prefixes, and O(marked) for the rest.
        """
        c = self.c
        sqrt_c = math.sqrt(c)
        B, kk = idx.shape
        two_e = 2.0 * e
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
        # distances from the scores (float64 chain, float32 result)
        t = s32[:, :k].double()
        t.mul_((-c * X0)[:, None]).clamp_min_(1.0).acosh_().div_(sqrt_c)
        out_d = t.to(torch.float32)
        del t
        out_i = torch.empty((B, k), dtype=idx.dtype)
        out_i.copy_(idx[:, :k])
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
            out_d[rk, pk] = dex[order][keep].to(torch.float32)
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
                # only accuracy is at stake here: the float32 ball formula (relative error
                # _kappa() < rtol) is enough when the inputs are float32 numbers
                ball32 = self._get_ball32() if self._kappa() < self.rtol and q32 is not None else None
                out_d[wr, wp] = self._exact_pairs(q, wr, out_i[wr, wp], ball=ball32,
                                                  q32=q32).to(torch.float32)
                self._restore_order(q, out_d, out_i, torch.unique(wr), int(wp.max()) + 2)
        if complete:
            return out_d, out_i, torch.ones(B, dtype=torch.bool)
        ok = (s_last.double() < bar) & (region_end < kk) if kk > k else s_last.double() < bar
        return out_d, out_i, ok

    def _wide_prefix(self, s32, X0, e, k):
        """Per row, the number of leading positions (< k) whose score-derived distance may be off
        by more than ``rtol`` relative (binary search on the monotone test)."""
        c = self.c
        sqrt_c = math.sqrt(c)
        B = s32.shape[0]
        cx0 = c * X0
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
        """After recomputing some distances in float32 (error ~_kappa()), neighbours may be out of
        order by that error: recompute such adjacent pairs in float64 (then they are ordered,
        except inside near-tie clusters left in faiss's order by ``exact_ranks``) and sort the
        rows that still are not."""
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
        out_d[rr, pp] = self._exact_pairs(q, rr, out_i[rr, pp]).to(torch.float32)
        still = torch.unique(rr)
        still = still[(out_d[still, 1:] < out_d[still, :-1]).any(dim=1)]
        if still.numel():
            perm = _sort_by_dist_index(out_d[still], out_i[still])
            out_d[still] = out_d[still].gather(1, perm)
            out_i[still] = out_i[still].gather(1, perm)

    def _get_ball32(self):
        """float32 copy of the references if it is exact (float32 inputs), else None; cached."""
        if self._ball32 is None:
            ball32 = self._ball.to(torch.float32)
            self._ball32 = ball32 if torch.equal(ball32.double(), self._ball) else False
        return self._ball32 if self._ball32 is not False else None

    def _kappa(self) -> float:
        """Relative error bound of the float32 ball-coordinate distance (see _fast_refine)."""
        D = self._dim
        if self.error_model == "rigorous":  # D roundings in the sum of squares (halved by sqrt)
            return (D / 2 + 3) * _U32 * 1.01 + 1e-12
        return 2.0 * (math.sqrt(D) + 3) * _U32 + 1e-12

    def _dist_rows32(self, q32: Tensor, q: Tensor, idx: Tensor) -> Tensor:
        """Distances of a (B × k) index matrix: float32 differences/norms, float64 rest."""
        c = self.c
        B, kk = idx.shape
        D = q.shape[1]
        bq = (1 - c * (q * q).sum(1)).clamp_min(torch.finfo(torch.float64).tiny)
        out = torch.empty((B, kk), dtype=torch.float64)
        step = max(1, (1 << 23) // max(1, kk * D))
        for a in range(0, B, step):
            ii = idx[a : a + step]
            diff = self._get_ball32().index_select(0, ii.reshape(-1)).view(ii.shape[0], kk, D)
            diff.sub_(q32[a : a + step, None, :])
            n = torch.linalg.vector_norm(diff, dim=2).double()
            out[a : a + step] = n / torch.sqrt(bq[a : a + step, None] * self._bball[ii])
        return torch.asinh_(out.mul_(math.sqrt(c))).mul_(2 / math.sqrt(c))

    def _exact_pairs(self, q: Tensor, rows: Tensor, cols: Tensor, ball=None, q32=None) -> Tensor:
        """Distances of (query row, reference index) pairs, same formula as :meth:`_exact_rows`;
        float64 unless ``ball`` = the float32 copy is given (relative error ``_kappa()``; ``q32``
        = the float32 queries, when they are exact). In chunks of 2^15 pairs (a few MB gathered at
        a time, whatever the number of pairs)."""
        c = self.c
        out = torch.empty(rows.shape[0], dtype=torch.float64)
        # float64 result from float32 inputs: gathering the float32 copy and subtracting in float64
        # is bit-identical to gathering the float64 rows, with half the memory traffic
        source = ball if ball is not None else self._get_ball32()
        if source is None:
            source = self._ball
        bq_all = (1 - c * (q * q).sum(1)).clamp_min(torch.finfo(torch.float64).tiny)
        step = 1 << 15
        for a in range(0, rows.shape[0], step):
            r, cc = rows[a: a + step], cols[a: a + step]
            diff = source.index_select(0, cc)
            if ball is not None:  # float32 arithmetic
                diff.sub_(q32.index_select(0, r) if q32 is not None else q.index_select(0, r).to(ball.dtype))
            else:
                diff = diff.double() if diff.dtype != torch.float64 else diff
                diff.sub_(q.index_select(0, r))
            n = torch.linalg.vector_norm(diff, dim=1).double()
            bq = bq_all.index_select(0, r).mul_(self._bball.index_select(0, cc))
            z = n.mul_(math.sqrt(c)).div_(bq.sqrt_())
            out[a: a + step] = torch.asinh_(z).mul_(2 / math.sqrt(c))
        return out

    def _exact_scan(self, q: Tensor, k: int, ids: Optional[Tensor]):
        """Exact top-k of each row by a float64 scan over every reference, sorted by
        (distance, index): the fallback for rows that the candidate lists cannot certify.
        Memory O(rows·k + block): query rows in blocks, references in chunks, running top-k."""
        c = self.c
        n, D = self._ball.shape
        B = q.shape[0]
        out_d = torch.empty((B, k), dtype=torch.float64)
        out_i = torch.empty((B, k), dtype=torch.int64)
        rows_per_block = 16
        # ~16 MB temporaries: the allocator reuses them (larger ones are fresh pages every time)
        chunk = max(k, (1 << 21) // max(1, rows_per_block * D))
        bq_all = (1 - c * (q * q).sum(1)).clamp_min(torch.finfo(torch.float64).tiny)
        for a in range(0, B, rows_per_block):
            x = q[a: a + rows_per_block]
            bq = bq_all[a: a + rows_per_block]
            best_d = torch.full((x.shape[0], 0), math.inf, dtype=torch.float64)
            best_i = torch.empty((x.shape[0], 0), dtype=torch.int64)
            for lo in range(0, n, chunk):
                y = self._ball[lo: lo + chunk]
                z = torch.linalg.vector_norm(y[None, :, :] - x[:, None, :], dim=2)
                z.mul_(math.sqrt(c)).div_(torch.sqrt(bq[:, None] * self._bball[None, lo: lo + chunk]))
                d = torch.asinh_(z).mul_(2 / math.sqrt(c))
                cols = torch.arange(lo, lo + y.shape[0]).expand(x.shape[0], -1)
                if ids is not None:
                    d = d.masked_fill(cols == ids[a: a + rows_per_block, None], math.inf)
                cat_d, cat_i = torch.cat([best_d, d], 1), torch.cat([best_i, cols], 1)
                keep = _sort_by_dist_index(cat_d, cat_i)[:, :k]
                best_d, best_i = cat_d.gather(1, keep), cat_i.gather(1, keep)
            out_d[a: a + rows_per_block], out_i[a: a + rows_per_block] = best_d, best_i
        return out_d, out_i

    def _exact_rows(self, q: Tensor, idx: Tensor) -> Tensor:
        r"""float64 :math:`d_c(q_b, y_{idx[b, j]})` for a (B × k') index matrix, as in
        :func:`pml_hyperbolic.poincare_ball.dist`:
        :math:`\frac{2}{\sqrt c}\operatorname{arsinh}(\sqrt c\,\|x-y\| / \sqrt{b_x b_y})`,
        :math:`b = 1 - c\|\cdot\|^2`, from explicit differences (exact for close pairs), in
        chunks of queries so that the gathered block stays ~32 MB."""
        c = self.c
        B, kk = idx.shape
        D = q.shape[1]
        bq = (1 - c * (q * q).sum(1)).clamp_min(torch.finfo(torch.float64).tiny)
        out = torch.empty((B, kk), dtype=torch.float64)
        step = max(1, (1 << 22) // max(1, kk * D))
        for a in range(0, B, step):
            ii = idx[a : a + step]
            # index_select on the flat index + in-place difference: ~2x faster than y[ii] - x
            diff = self._ball.index_select(0, ii.reshape(-1)).view(ii.shape[0], kk, D)
            diff.sub_(q[a : a + step, None, :])
            n2 = torch.linalg.vector_norm(diff, dim=2)
            out[a : a + step] = n2 / torch.sqrt(bq[a : a + step, None] * self._bball[ii])
        return torch.asinh_(out.mul_(math.sqrt(c))).mul_(2 / math.sqrt(c))

    def _gamma(self) -> float:
        d1 = self._dim + 1
        if self.error_model == "rigorous":  # worst-case float32 dot product (Higham's γ_n)
            return (d1 + 2) * _U32 * 1.01
        # typical: rounding errors of a length-n float32 sum grow like sqrt(n) u (random-walk model)
        return 2.0 * math.sqrt(d1 + 2) * _U32

    def _refine(self, q, X0, qnorm, s32, idx, k, ids, complete):
        """Turn faiss candidates into the certified exact top-k (see module docstring).

        Returns (distances (B×k) float64, indices (B×k), ok (B,)): rows with ``ok`` False could not
        be certified with these candidates and must be searched again with more.
        """
        c = self.c
        sqrt_c = math.sqrt(c)
        s_last = s32[:, -1].double()  # every non-candidate scores <= this
        if ids is not None:
            s32, idx = _drop_self(s32, idx, ids)
        B, kk = idx.shape
        inf = math.inf
        valid = idx >= 0  # HNSW may pad with -1
        idx_safe = idx.clamp_min(0)
        s = s32.double()
        gamma = self._gamma()
        err_s = gamma * qnorm[:, None] * self._norms[idx_safe]
        cx0 = c * X0[:, None]
        # A = -c X0 s is decreasing in s: interval that surely holds every candidate's true A
        A_mid = (-cx0 * s).clamp_min(1.0)
        lo = torch.where(valid, (-cx0 * (s + err_s)).clamp_min(1.0), inf)
        hi = torch.where(valid, (-cx0 * (s - err_s)).clamp_min(1.0), inf)
        d_mid = torch.acosh(A_mid) / sqrt_c
        if self.kind == "hnsw":  # approximate: always re-rank by the true distance
            exact = valid.clone()
        else:
            width = (torch.acosh(hi.clamp_max(1e300)) - torch.acosh(lo.clamp_max(1e300))) / sqrt_c
            exact = (width > self.rtol * d_mid) & valid
        done = torch.zeros_like(exact)
        exact_d = torch.zeros_like(A_mid)
        lim = min(k, kk)
        pos = torch.arange(kk)
        for _ in range(kk + 1):
            new = exact & ~done
            if new.any():
                rows, cols = new.nonzero(as_tuple=True)
                dd = self._exact_pairs(q, rows, idx_safe[rows, cols])
                exact_d[rows, cols] = dd
                a_ex = torch.cosh(sqrt_c * dd)
                lo[rows, cols] = a_ex
                hi[rows, cols] = a_ex
                done |= new
            # For each of the first k positions p, compare with every later position j: an
            # inexact interval that reaches below p's upper end may be misordered -> recompute.
            suf_all = _suffix_min(lo)[0]
            suf_ne, arg_ne = _suffix_min(torch.where(done, inf, lo))
            hi_w = hi[:, :lim]
            flag_p = ~done[:, :lim] & (hi_w >= suf_all[:, 1 : lim + 1])
            flag_j = (hi_w >= suf_ne[:, 1 : lim + 1]) & torch.isfinite(suf_ne[:, 1 : lim + 1])
            flag_p &= torch.isfinite(hi_w)
            if not (flag_p.any() or flag_j.any()):
                break
            exact[:, :lim] |= flag_p
            r, p = flag_j.nonzero(as_tuple=True)
            exact[r, arg_ne[r, p + 1]] = True
            exact &= valid
        # sort keys in distance units: exact values for recomputed candidates (cosh of equal
        # distances is not always equal in float64: torch's vectorised and scalar cosh differ in
        # the last bit, which would split exact ties), the score's estimate for the others
        dist_all = torch.where(done, exact_d, d_mid)
        key = torch.where(valid, dist_all, inf)
        # Rows already in (distance, index) order in the first k, with nothing later at or below
        # the k-th key, keep faiss' order; the others are sorted by (distance, index).
        kw = key[:, :lim]
        ordered = (kw[:, 1:] > kw[:, :-1]) | ((kw[:, 1:] == kw[:, :-1]) & (idx[:, 1:lim] > idx[:, : lim - 1]))
        later_min = _suffix_min(key)[0][:, lim]
        need_sort = ~ordered.all(dim=1) | (later_min <= kw[:, -1])
        final = pos[:lim].expand(B, lim).clone()
        if need_sort.any():
            rr = need_sort.nonzero(as_tuple=True)[0]
            by_idx = torch.argsort(torch.where(valid[rr], idx[rr], 1 << 62), dim=1)
            order = torch.argsort(key[rr].gather(1, by_idx), dim=1, stable=True)
            final[rr] = by_idx.gather(1, order)[:, :lim]
        out_d = dist_all.gather(1, final)
        out_i = idx.gather(1, final)
        finite = torch.isfinite(out_d).all(dim=1) & (out_i >= 0).all(dim=1)
        if complete or self.kind == "hnsw":
            return out_d, out_i, torch.ones(B, dtype=torch.bool)
        # certification: every non-candidate has true A >= A_floor > the k-th candidate's A
        err_far = gamma * qnorm * float(self._norms.max())
        a_floor = (-c * X0 * (s_last + err_far)).clamp_min(1.0)
        kth_hi = hi.gather(1, final[:, -1:]).squeeze(1)
        ok = (kth_hi < a_floor) & finite
        return out_d, out_i, ok



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


def _suffix_min(x: Tensor):
    """Row-wise suffix minimum with a trailing +inf column: out[:, p] = min(x[:, p:]) and the
    position of that minimum (the last one among equals)."""
    B, n = x.shape
    flipped = torch.flip(x, dims=[1])
    vals, args = torch.cummin(flipped, dim=1)
    vals = torch.flip(vals, dims=[1])
    args = (n - 1) - torch.flip(args, dims=[1])
    vals = torch.cat([vals, torch.full((B, 1), math.inf, dtype=x.dtype)], dim=1)
    args = torch.cat([args, torch.full((B, 1), n - 1, dtype=args.dtype)], dim=1)
    return vals, args


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


def _sort_by_dist_then_index(d: Tensor, idx: Tensor) -> Tensor:
    """Like :func:`_sort_by_dist_index` with one stable sort in the common case: rows with exactly
    equal distances (duplicates) are redone with the index tie rule."""
    perm = torch.argsort(d, dim=1, stable=True)
    ds = d.gather(1, perm)
    tie = ((ds[:, 1:] == ds[:, :-1]) & torch.isfinite(ds[:, 1:])).any(dim=1)
    if tie.any():
        rr = tie.nonzero(as_tuple=True)[0]
        perm[rr] = _sort_by_dist_index(d[rr], idx[rr])
    return perm
