"""The certified exact path of :class:`~pml_hyperbolic.evaluation.HyperbolicIndex`: re-ranking of
faiss's float32 candidates into the exact Poincaré-distance order (the algorithm is described in
the module docstring of :mod:`pml_hyperbolic.evaluation.hyperbolic_index`).

Design note: docs/design/knn-index.md
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import reconstructed as _reconstructed
from .lift import _conformal_terms, _dist_from_diff

_U32 = 2.0 ** -24


class CertifiedSearchMixin:
    """The float64 work around the faiss calls: certification of a flat result (:meth:`_refine`),
    exact re-ranking of approximate candidates (:meth:`_rerank`), exact pair distances and the
    exact fallback scan. Mixed into :class:`HyperbolicIndex`, whose state it reads."""

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

    def _rerank(self, q, s32, idx, k, ids, out_dtype, q32=None):
        """Approximate factories: exact distances of every candidate, sorted by (distance, index).

        With float32 inputs (``q32`` and the references exact in float32) the differences are taken
        in float32 (relative error ``_kappa()`` < ``rtol``); rows where two of the first k + 1
        distances lie within that error of each other are recomputed in float64, so the order is
        the exact one. faiss pads missing candidates with -1: distance inf, index -1."""
        if ids is not None:
            s32, idx = _drop_self(s32, idx, ids)
        valid = idx >= 0
        safe = torch.where(valid, idx, torch.zeros((), dtype=idx.dtype))
        fast = q32 is not None and self._get_ball32() is not None and self._kappa() < self.rtol
        d = self._grid_dist(q, q32 if fast else None, safe).masked_fill_(~valid, math.inf)
        if fast and idx.shape[1] > 1:
            top = d.sort(dim=1).values[:, :k + 1]
            close = (top[:, 1:] - top[:, :-1]) <= (2.5 * self._kappa()) * top[:, 1:]
            rows = close.any(dim=1).nonzero(as_tuple=True)[0]
            if rows.numel():
                d[rows] = self._grid_dist(q[rows], None, safe[rows]).masked_fill_(~valid[rows], math.inf)
        return self._first_k(d, idx, valid, k, out_dtype)

    def _rerank_stored(self, q, s32, idx, stored, k, ids, out_dtype, q32=None):
        """``keep_coordinates=False``: distances of every candidate from the row faiss stores for
        it (:func:`.reconstructed.distances`; float32 differences with the exact float32 queries
        ``q32`` when ``_kappa() + u < rtol``), sorted by (distance, index); -1 pads as in
        :meth:`_rerank`."""
        if ids is not None:
            s32, idx, stored = _drop_self(s32, idx, ids, stored)
        valid = idx >= 0
        fast = q32 if q32 is not None and self._kappa() + _U32 < self.rtol else None
        d = _reconstructed.distances(q, self._query_terms(q)[1], stored, valid, self.c, fast)
        return self._first_k(d, idx, valid, k, out_dtype)

    def _first_k(self, d, idx, valid, k, out_dtype):
        """The k candidates of each row with the smallest (distance, index); missing candidates
        (faiss's -1, distance inf) sort last."""
        perm = _sort_by_dist_index(d, torch.where(valid, idx, idx.shape[1] + self.ntotal))[:, :k]
        return d.gather(1, perm).to(out_dtype), idx.gather(1, perm)

    def _grid_dist(self, q: Tensor, q32: Optional[Tensor], cols: Tensor) -> Tensor:
        """float64 (B, kk) distances of query row i to references ``cols[i, :]`` by
        :func:`_dist_from_diff`: float32 differences with ``q32``, else float64; in blocks of rows
        (a few tens of MB gathered at a time)."""
        B, kk = cols.shape
        ball32 = self._get_ball32()
        source = ball32 if ball32 is not None else self._ball
        bq = _conformal_terms(q, self.c)[1]
        out = torch.empty((B, kk), dtype=torch.float64)
        step = max(1, (1 << 18) // max(1, kk))
        for a in range(0, B, step):
            cc = cols[a: a + step]
            y = _gather_rows(source, cc.reshape(-1)).view(cc.shape[0], kk, -1)
            if q32 is not None:
                diff = y.sub_(q32[a: a + step, None, :])
            else:
                diff = y.to(torch.float64).sub_(q[a: a + step, None, :])
            out[a: a + step] = _dist_from_diff(diff, bq[a: a + step, None], self._bball[cc], self.c)
        return out

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


def _drop_self(s: Tensor, idx: Tensor, ids: Tensor, stored: Optional[np.ndarray] = None):
    """Remove each row's own index (present at most once); rows without it lose their last
    column instead, so that every row keeps kk - 1 candidates in score order. ``stored`` (B, kk,
    W), when given, loses the same columns and is returned third."""
    B, kk = idx.shape
    if kk > 1 and torch.equal(idx[:, 0], ids):  # self-retrieval: each point is its own nearest
        return (s[:, 1:], idx[:, 1:]) + (() if stored is None else (stored[:, 1:],))
    is_self = idx == ids[:, None]
    # position of the self entry, kk - 1 where absent; keep columns j < pos and j + 1 >= pos
    pos = torch.where(is_self.any(dim=1), is_self.to(torch.uint8).argmax(dim=1), kk - 1)
    cols = torch.arange(kk - 1).expand(B, kk - 1)
    cols = cols + (cols >= pos[:, None]).to(cols.dtype)
    if stored is None:
        return s.gather(1, cols), idx.gather(1, cols)
    return s.gather(1, cols), idx.gather(1, cols), np.take_along_axis(stored, cols.numpy()[:, :, None], axis=1)


def _sort_by_dist_index(d: Tensor, idx: Tensor) -> Tensor:
    """Row-wise permutation sorting by (distance, index)."""
    by_idx = torch.argsort(idx, dim=1)
    order = torch.argsort(d.gather(1, by_idx), dim=1, stable=True)
    return by_idx.gather(1, order)
