"""Hyperbolic retrieval at scale (``python -m bench knn --scale``): faiss factories over the
hyperboloid lift (HyperbolicIndex) beside the same factories on the cosine of the same directions.

Gallery: N ball points in D = 128 with clustered directions (N / 100 Gaussian centres, per-point
noise 0.25 per coordinate, normalised) and distances from the origin d0 in [1.5, 3.2] at c = 0.1
(a cluster mean drawn uniformly, per-point spread 0.3, clipped); queries drawn the same way from the
same clusters. The cosine side indexes the normalised directions (faiss METRIC_INNER_PRODUCT), what a
sphere user runs on the same data.

Per factory: build seconds (train + add), bytes (faiss.serialize_index; for HyperbolicIndex also the
coordinates it keeps for the exact distances), and per search setting: queries/s over all queries
(k = 10), recall@10 against the exact index of the same side (HyperbolicIndex "Flat", certified;
faiss IndexFlatIP for the cosine), ratios to the exact index and to the cosine index at the same
setting (the best of ``--repeats`` alternating runs of each). Hyperbolic and cosine searches alternate; the
load average is stored in every row.
IVF rows also carry the coarse training (``--coarse``: ``directions``, the default, and/or ``lift``,
faiss's k-means on the stored vectors) and faiss's imbalance factor of the lists, beside the cosine
index's (1 = equal lists).
``--keep-coordinates true,false`` runs every IVF-Flat and HNSW factory both ways: re-ranked from the
coordinates the index keeps (exact distances), and from the vectors faiss stores (no coordinates kept,
distances within the bound of ``pml_hyperbolic.search.reconstructed``); rows carry ``keep_coordinates``.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from pml_hyperbolic.kernels.threads import uncontended_threads


def make_gallery(n, d, c, seed, centres=None):
    """(float32 ball points, float32 unit directions, centres) as the module docstring says."""
    g = np.random.default_rng(seed)
    if centres is None:
        ncl = max(1, n // 100)
        centres = (g.standard_normal((ncl, d)).astype(np.float32), g.uniform(1.5, 3.2, ncl))
    dirs_c, d0_c = centres
    lab = g.integers(0, len(d0_c), n)
    v = dirs_c[lab] + 0.25 * g.standard_normal((n, d)).astype(np.float32)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    d0 = np.clip(d0_c[lab] + 0.3 * g.standard_normal(n), 1.5, 3.2)
    r = np.tanh(math.sqrt(c) * d0 / 2) / math.sqrt(c)
    return (v * r[:, None]).astype(np.float32), v, centres


def _recall(found, truth, k):
    found, truth = np.asarray(found)[:, :k], np.asarray(truth)[:, :k]
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(found, truth)]))


def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def _faiss_threads(threads):
    import faiss

    faiss.omp_set_num_threads(uncontended_threads(threads) if threads > 1 else 1)


def run_scale(args):
    import faiss

    from pml_hyperbolic.evaluation import HyperbolicIndex
    from pml_hyperbolic.search import approximate as _approx

    n, nq, d, c, k = args.n, args.queries, args.dim, args.c, 10
    x, dirs, centres = make_gallery(n, d, c, seed=1)
    q, qdirs, _ = make_gallery(nq, d, c, seed=2, centres=centres)
    x_t, q_t = torch.from_numpy(x), torch.from_numpy(q)
    rng = np.random.default_rng(3)
    sample = np.sort(rng.choice(n, size=min(n, args.train_sample), replace=False))
    rows = []

    def log(row):
        row["load_1min"] = round(os.getloadavg()[0], 2)
        rows.append(row)
        print("  " + ", ".join(f"{key}={val:.4g}" if isinstance(val, float) else f"{key}={val}"
                                for key, val in row.items()), flush=True)

    print(f"\n## scale: gallery {n} x {d}, {nq} queries, k={k}, c={c}, train sample {len(sample)}", flush=True)
    # exact references (and the exact index's own speed)
    exact = HyperbolicIndex(c=c)
    t_build, _ = _timed(lambda: exact.add(x_t))
    t_h = t_c = float("inf")
    for _ in range(max(1, args.repeats)):
        t, (_, truth_h) = _timed(lambda: exact.search(q_t, k))
        t_h = min(t_h, t)
    exact_bytes = len(faiss.serialize_index(exact._index)) + exact._ball.numel() * exact._ball.element_size()
    del exact
    _faiss_threads(args.threads)
    flat_cos = faiss.IndexFlatIP(d)
    t_cb, _ = _timed(lambda: flat_cos.add(dirs))
    for _ in range(max(1, args.repeats)):
        t, (_, truth_c) = _timed(lambda: flat_cos.search(qdirs, k))
        t_c = min(t_c, t)
    cos_flat_bytes = len(faiss.serialize_index(flat_cos))
    del flat_cos
    qps_exact_h, qps_exact_c = nq / t_h, nq / t_c
    log(dict(factory="Flat", setting="exact", build_s=t_build, qps=qps_exact_h, recall10=1.0,
             bytes=exact_bytes, cos_build_s=t_cb, cos_qps=qps_exact_c, cos_recall10=1.0,
             cos_bytes=cos_flat_bytes, speedup_vs_exact=1.0, qps_ratio_to_cosine=qps_exact_h / qps_exact_c))

    plans = [(f"HNSW{args.hnsw_m}", "ef_search", [int(v) for v in args.ef.split(",") if v])]
    plans.append((f"IVF{args.nlist},Flat", "nprobe", [int(v) for v in args.nprobe.split(",") if v]))
    if args.pq:
        plans.append((f"IVF{args.nlist},PQ{args.pq}", "nprobe", [int(v) for v in args.nprobe.split(",") if v]))
    keep_list = [{"true": True, "false": False}.get(v.strip().lower()) for v in args.keep_coordinates.split(",")]
    if not keep_list or None in keep_list:
        raise ValueError(f"--keep-coordinates must list true and/or false, got {args.keep_coordinates!r}")
    coarse_list = [v for v in args.coarse.split(",") if v]
    if not coarse_list or set(coarse_list) - {"directions", "lift"}:
        raise ValueError(f"--coarse must list 'directions' and/or 'lift', got {args.coarse!r}")
    for factory, param, values in plans:
        if not values:  # e.g. --ef "" skips HNSW
            continue
        _faiss_threads(args.threads)
        cos = faiss.index_factory(d, factory, faiss.METRIC_INNER_PRODUCT)
        if factory.startswith("HNSW"):
            faiss.downcast_index(cos).hnsw.efConstruction = 40  # faiss's default, HyperbolicIndex's too

        def build_c():
            if "IVF" in factory:
                cos.train(dirs[sample])
            cos.add(dirs)

        t_bc, _ = _timed(build_c)
        c_bytes = len(faiss.serialize_index(cos))
        cos_imb = _approx.imbalance(cos)
        keeps = keep_list if "PQ" not in factory else [True]  # compressed codes keep the coordinates
        for coarse, keep in [(a, b) for a in (coarse_list if "IVF" in factory else [None]) for b in keeps]:
            print(f"### {factory}" + (f" (coarse={coarse})" if coarse else "") + f" keep_coordinates={keep}",
                  flush=True)
            hyp = HyperbolicIndex(c=c, factory=factory, keep_coordinates=keep,
                                  **({"coarse": coarse} if coarse else {}))

            def build_h():
                if "IVF" in factory:
                    hyp.train(x_t[torch.from_numpy(sample)])
                hyp.add(x_t)

            t_bh, _ = _timed(build_h)
            h_faiss = len(faiss.serialize_index(hyp._index))
            h_coords = 0 if hyp._ball is None else hyp._ball.numel() * hyp._ball.element_size()
            extra = {"keep_coordinates": keep}
            if coarse is not None:
                extra.update(coarse=coarse, imbalance=_approx.imbalance(hyp._index), cos_imbalance=cos_imb)
            ps = faiss.ParameterSpace()
            for value in values:
                hyp.set_search_parameters(**{param: value})
                ps.set_index_parameter(cos, "efSearch" if param == "ef_search" else "nprobe", value)
                t_s = t_sc = float("inf")
                for _ in range(max(1, args.repeats)):  # alternating, best of --repeats each
                    t, (_, found_h) = _timed(lambda: hyp.search(q_t, k))
                    t_s = min(t_s, t)
                    _faiss_threads(args.threads)
                    t, (_, found_c) = _timed(lambda: cos.search(qdirs, k))
                    t_sc = min(t_sc, t)
                qps_h, qps_c = nq / t_s, nq / t_sc
                log(dict(factory=factory, setting=f"{param}={value}", **extra, build_s=t_bh, qps=qps_h,
                         recall10=_recall(found_h.numpy(), truth_h.numpy(), k), bytes=h_faiss + h_coords,
                         faiss_bytes=h_faiss, coordinate_bytes=h_coords, cos_build_s=t_bc, cos_qps=qps_c,
                         cos_recall10=_recall(found_c, truth_c, k), cos_bytes=c_bytes,
                         speedup_vs_exact=qps_h / qps_exact_h, qps_ratio_to_cosine=qps_h / qps_c,
                         faiss_bytes_ratio_to_cosine=h_faiss / c_bytes,
                         bytes_ratio_to_cosine=(h_faiss + h_coords) / c_bytes))
            del hyp
        del cos
    _summary(rows)
    return rows


def _summary(rows):
    """Targets: recall@10 >= 0.95 at >= 20x the exact index's queries/s; queries/s within 1.2x of
    the cosine index at equal recall (the fastest cosine setting of the same factory whose recall is
    at least the hyperbolic one); memory within 1.2x. One line per ``keep_coordinates`` value."""
    for keep in (True, False):
        _summary_of([r for r in rows if r["setting"] != "exact" and r.get("keep_coordinates", True) == keep],
                    keep)


def _cosine_qps_at_recall(rows, r):
    """The fastest cosine setting of ``r``'s factory whose recall is at least ``r``'s (nan: none)."""
    return max((o["cos_qps"] for o in rows if o["factory"] == r["factory"] and o["cos_recall10"] >= r["recall10"]),
               default=float("nan"))


def _summary_of(rows, keep):
    if not rows:
        return
    best = None
    for r in rows:
        if r["recall10"] >= 0.95 and (best is None or r["qps"] > best["qps"]):
            best = r
    if best is None:
        print(f"\nkeep_coordinates={keep}: no approximate setting reached recall@10 >= 0.95")
        return
    cos_qps = _cosine_qps_at_recall(rows, best)
    memory = ("with the coordinates kept for exact distances" if keep else
              "re-ranking from faiss's stored vectors (no coordinates kept)")
    print(f"\nkeep_coordinates={keep}: fastest setting at recall@10 >= 0.95: {best['factory']} {best['setting']}: "
          f"recall {best['recall10']:.3f}, "
          f"{best['speedup_vs_exact']:.1f}x the exact index's queries/s (target >= 20x: "
          f"{'MET' if best['speedup_vs_exact'] >= 20 else 'NOT MET'}); cosine {best['factory']} at recall >= "
          f"{best['recall10']:.3f}: {cos_qps:.0f} q/s, ratio {cos_qps / best['qps']:.2f}x (target <= 1.2x: "
          f"{'MET' if cos_qps / best['qps'] <= 1.2 else 'NOT MET'}); memory {best['bytes_ratio_to_cosine']:.2f}x "
          f"the cosine index {memory} (target <= 1.2x: "
          f"{'MET' if best['bytes_ratio_to_cosine'] <= 1.2 else 'NOT MET'}), "
          f"{best['faiss_bytes_ratio_to_cosine']:.2f}x for the faiss part alone")
    best["summary"] = True

    def meets_all(r):
        return (r["recall10"] >= 0.95 and r["speedup_vs_exact"] >= 20
                and _cosine_qps_at_recall(rows, r) / r["qps"] <= 1.2 and r["bytes_ratio_to_cosine"] <= 1.2)

    every = [f"{r['factory']} {r['setting']}" for r in rows if meets_all(r)]
    print(f"keep_coordinates={keep}: settings that meet every target at once: {', '.join(every) or 'none'}")
