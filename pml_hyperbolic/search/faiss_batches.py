r"""The faiss side of one search of :class:`~pml_hyperbolic.evaluation.HyperbolicIndex`, batch by
batch: the faiss index it builds, the candidate count k' = k + margin, the rows of one batch, the
faiss call (with the caller's thread count), and the loop that certifies each batch's rows or
widens their candidates (a mixin: the class holds the state; the certification itself is in
:mod:`.certified`, the lift in :mod:`.lift`).

Why: for a query q, the float32 inner product with the lifted references orders the candidates of
:math:`d_c(q, y) = \frac{1}{\sqrt{c}} \operatorname{arcosh}(-\langle X, Y \rangle_L)`; faiss
returns k' of them, and :meth:`CertifiedSearchMixin._refine` keeps the rows whose gap test proves
the top k exact.

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from ..kernels.threads import uncontended_threads
from . import approximate as _approx
from . import reconstructed as _reconstructed
from .lift import _lift_parts

try:  # faiss-cpu or faiss-gpu
    import faiss
except ModuleNotFoundError:  # pragma: no cover - faiss is a dependency
    faiss = None


# queries per thread below which an approximate search stays in one thread
_MIN_ROWS_PER_WORKER = 256


class FaissBatchMixin:
    """Building the faiss index and running one batch of queries through it, exact rows certified."""

    def _with_threads(self, fn, *args):
        # torch and faiss share the OpenMP runtime: the post-processing runs with post_threads,
        # faiss with the caller's count (restored around each faiss call, and at the end)
        faiss_threads = faiss.omp_get_max_threads()
        torch_threads = torch.get_num_threads()
        # faiss's search is one big call per batch, but on a machine whose cores are taken its
        # barriers still wait for descheduled threads: there it gets 1 thread
        self._faiss_threads = uncontended_threads(faiss_threads) if faiss_threads > 1 else 1
        self._requested_faiss_threads = faiss_threads
        try:
            if self.post_threads == "auto":
                torch.set_num_threads(uncontended_threads(torch_threads) if torch_threads > 1 else 1)
            elif self.post_threads is not None:
                torch.set_num_threads(self.post_threads)
            return fn(*args)
        finally:
            torch.set_num_threads(torch_threads)
            faiss.omp_set_num_threads(faiss_threads)

    def _new_faiss_index(self, dim: int):
        if not self._exact:
            index, self._pad = _approx.new_index(self.factory, dim)
            _approx.set_construction(index, self.ef_construction)
            return index
        index = faiss.IndexFlatIP(dim)
        # only the flat index moves automatically; use_gpu=False keeps it on the CPU
        has_gpu = hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0
        if has_gpu and self.use_gpu is not False:
            index = faiss.index_cpu_to_all_gpus(index)
            self._on_gpu = True
        return index

    def _run_batches(self, q, k, query_ids, q32, out_dtype, out_d, out_i):
        """Every batch of the queries into ``out_d`` / ``out_i``. An approximate factory with
        several faiss threads splits the queries into that many contiguous parts, each searched by
        its own thread with a one-thread faiss call: the re-rank after each faiss call then runs
        in parallel too (faiss, numpy's gathers and torch's kernels release the GIL), where one
        multi-threaded faiss call would leave it to one core. The parts share no barrier, so their
        number is the caller's faiss thread count even while other processes keep cores busy (where
        a multi-threaded call would wait for a descheduled thread, a part only finishes later)."""
        m = q.shape[0]
        # (not on a GPU: a faiss GPU index takes one search at a time)
        workers = (1 if self._exact or self._on_gpu
                   else min(self._requested_faiss_threads, m // _MIN_ROWS_PER_WORKER))

        def run(lo, hi, threads):
            rows = self._rows_per_batch(k)
            for start in range(lo, hi, rows):
                stop = min(hi, start + rows)
                block = q if (start == 0 and stop == m) else q[start:stop]  # the whole set: its cached terms
                d, i = self._search_batch(block, k, None if query_ids is None else query_ids[start:stop],
                                          None if q32 is None else q32[start:stop], out_dtype, threads)
                out_d[start:stop] = d
                out_i[start:stop] = i

        if workers <= 1:
            return run(0, m, None)
        if not self.keep_coordinates:
            self._stored_rows()  # built once, before the threads read it
        self._pending_self_lift = None
        bounds = [m * j // workers for j in range(workers + 1)]
        post = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(workers) as pool:
                for job in [pool.submit(run, bounds[j], bounds[j + 1], 1) for j in range(workers)]:
                    job.result()
        finally:
            torch.set_num_threads(post)

    def _stored_rows(self):
        """The zero-copy view of faiss's stored rows (``keep_coordinates=False``), built at the first
        search after a change; None if faiss's layout is not readable that way."""
        if self._stored is None:
            view = _reconstructed.StoredRows.build(self._index, self.ntotal)
            self._stored = False if view is None else view
        return self._stored or None

    def _margin(self, k: int) -> int:
        # a few candidates past k are enough for the gap test of the certification to succeed; an
        # approximate index that stores the lift only needs a guard against float32 near-ties at rank k
        if self.margin is not None:
            return self.margin
        return max(1 if self._stores_lift else 4, k // 32)

    def _rows_per_batch(self, k: int) -> int:
        # at most batch_size, and few enough that each (rows x k') int64 / float64 array of a batch
        # stays at 16 MB: the allocator then reuses its memory from batch to batch, while larger
        # blocks (glibc maps anything over 32 MB afresh) are new pages every time
        rows = max(1, (1 << 21) // (k + 1 + self._margin(k)))
        if not self.keep_coordinates:  # each candidate brings its stored row
            rows = min(rows, _reconstructed.rows_per_batch(k + 1 + self._margin(k), self._dim))
        return rows if self.batch_size is None else max(1, min(self.batch_size, rows))

    def _faiss_search(self, Q32: Tensor, kk: int, reconstruct: bool = False, threads=None):
        """(scores, ids[, stored rows][, order]) of faiss's kk candidates per query row. An
        approximate inverted file (not ``reconstruct``) also returns ``order``: the rows come back
        sorted by their first inverted list (row j of the result is query ``order[j]``), so that
        queries that visit the same list run one after another and find it in the cache; None
        where the rows keep their order. ``threads``: faiss's thread count for this call (default:
        the caller's, as set by :meth:`_with_threads`)."""
        # torch and faiss share the OpenMP runtime: give faiss back the caller's thread count
        post = torch.get_num_threads()
        faiss.omp_set_num_threads(threads or getattr(self, "_faiss_threads", faiss.omp_get_max_threads()))
        try:
            Q32 = np.ascontiguousarray(Q32.numpy())
            if self._exact:
                s, i = self._index.search(Q32, kk)
                return torch.from_numpy(s), torch.from_numpy(i)
            _approx.set_search(self._index, self.nprobe, max(self.ef_search, kk))
            # each query scaled onto the database's sphere |Y'| = M (same order for that query)
            scale = self._mips_m / np.linalg.norm(Q32.astype(np.float64), axis=1, keepdims=True)
            Qa = _approx.augment_query((Q32 * scale).astype(np.float32), self._pad)
            order = None
            ivf = faiss.downcast_index(self._index)
            if reconstruct:  # the candidates' stored rows come back with them
                l2, i, stored = self._index.search_and_reconstruct(Qa, kk)
            elif isinstance(ivf, faiss.IndexIVF) and Qa.shape[0] > 1:
                # faiss's own two steps (coarse assignment, then the lists), rows grouped by list
                Dq, Iq = ivf.quantizer.search(Qa, ivf.nprobe)
                order = np.argsort(Iq[:, 0], kind="stable")
                Qa, scale = Qa[order], scale[order]
                l2, i = ivf.search_preassigned(Qa, kk, Iq[order], Dq[order])
                order = torch.from_numpy(order)
            else:
                l2, i = self._index.search(Qa, kk)
            s = (2.0 * self._mips_m ** 2 - l2) / (2.0 * scale)  # back to the inner product
            out = torch.from_numpy(s.astype(np.float32)), torch.from_numpy(i)
            return (*out, stored) if reconstruct else (*out, order)
        finally:
            torch.set_num_threads(post)

    def _approximate_batch(self, q, Q32, kk, k, ids, q32, out_dtype, threads=None):
        """An approximate factory's batch: faiss's candidates, re-ranked from the coordinates or
        from the rows faiss stores, in faiss's row order (grouped by list), then put back."""
        view = None if self.keep_coordinates else self._stored_rows()
        if not self.keep_coordinates and view is None:  # a layout StoredRows cannot read
            s, idx, stored = self._faiss_search(Q32, kk, reconstruct=True, threads=threads)
            return self._rerank_stored(q, s, idx, stored, k, ids, out_dtype, q32)
        s, idx, order = self._faiss_search(Q32, kk, threads=threads)
        if order is not None:
            q = q[order]
            ids = None if ids is None else ids[order]
            q32 = None if q32 is None else q32[order]
        if view is not None:
            d, i = self._rerank_stored(q, s, idx, view.gather(idx.numpy()), k, ids, out_dtype, q32)
        else:
            d, i = self._rerank(q, s, idx, k, ids, out_dtype, q32)
        if order is not None:
            d[order], i[order] = d.clone(), i.clone()
        return d, i

    def _search_batch(self, q: Tensor, k: int, ids: Optional[Tensor], q32: Optional[Tensor],
                      out_dtype: torch.dtype, threads=None):
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
        if not self._exact:
            return self._approximate_batch(q, Q32, kk, k, ids, q32, out_dtype, threads)
        s, idx = self._faiss_search(Q32, kk)
        qnorm = torch.linalg.vector_norm(Q32.double(), dim=1)
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
