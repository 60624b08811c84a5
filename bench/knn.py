"""Exact hyperbolic kNN (HyperbolicKNN) vs faiss IndexFlatIP and PML CustomKNN(PoincareDistance).

    python -m bench knn                     # Cars 8,131 / k=8 and SOP 60,000 / k=1000 self-retrieval,
                                            # then In-Shop 14,218 queries x 12,612 gallery / k=30
    python -m bench knn --quick             # smaller, for a smoke run
    python -m bench knn --cases 8131x8,20000x100 --repeats 3
    python -m bench knn --cases 2000x8 --collapsed 6000x5000   # + a collapsed model (5,000 duplicates)
    python -m bench knn --scale [--quick]   # factories (HNSW, IVF) over the lift vs the cosine index,
                                            # 1M x 128 (--quick: 50,000); see bench/_knn_scale.py

Two modes of HyperbolicKNN are timed: ``exact_ranks`` = the benchmark's Recall@K list (1, 2, 4, 8
for the Cars size; 1, 10, 100, 1000 for SOP): neighbour sets exact at each listed K and at k,
distances within 1e-5 relative, near-ties between listed ranks in faiss's order (the 1.3x target
is checked on this mode); and the default exact order at every rank (float64 re-sort of every
near-tie cluster), reported beside it.

Float32 CPU, --threads (default 2) threads for torch and faiss. Ratios are against baselines
measured in the same run:
  * faiss IndexFlatIP.search over the same (Lorentz-lifted, float32) vectors, same k (+1 for self);
  * PML CustomKNN(PoincareDistance(c), batch_size) on the first --custom-queries queries (full
    reference; all queries when N <= --custom-queries, else extrapolated linearly in the number of
    queries and labelled "extrapolated");
  * for reference, PML CustomKNN with hypll's PoincareBall.dist (broadcast N×M×D, batch 16) on
    --hypll-queries queries, extrapolated.
HyperbolicIndex runs its own torch work with post_threads="auto" (the caller's count on an idle machine) and gives faiss the
caller's --threads, the same count as the faiss baseline.
Each timing is the best wall time at --threads, with the 1-thread CPU time of the same call beside
it (the figure a busy machine distorts least) and the load average.
Correctness: --check-queries random queries against a float64 brute force (same tie rule: by
index) -> identical neighbour sets at every listed K (exact_ranks mode), identical lists (full
order mode), and the max position-wise relative distance error of each.
Embeddings look like a trained head's output: Gaussian directions, norms clipped to 2.3, expmap0.
"""
import argparse
import resource
import time

import numpy as np
import torch

from bench._load import cpu_1thread, load_text  # noqa: E402

from pml_hyperbolic import poincare_ball as pb  # noqa: E402
from pml_hyperbolic.distances import PoincareDistance  # noqa: E402
from pml_hyperbolic.evaluation import HyperbolicIndex, HyperbolicKNN  # noqa: E402


def make_embeddings(n, d, c, seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n, d, generator=g)
    # clustered like trained embeddings: class centres + noise, then clip 2.3 + expmap0
    centres = torch.randn(max(1, n // 40), d, generator=g)
    v = centres[torch.randint(0, len(centres), (n,), generator=g)] + 0.7 * v
    norm = v.norm(dim=1, keepdim=True)
    v = v * torch.clamp(2.3 / norm, max=1.0)
    return pb.project(pb.expmap0(v, c), c).float()


def lifted_for_faiss(query, reference, c):
    """float32 (reference, query) arrays whose inner products rank by Poincaré distance: the
    Lorentz lift Y of the references, and Q = (-1, X_1: / X_0) for the queries."""
    X = pb.to_lorentz(query.double(), c)
    Q = X / X[:, :1]
    Q[:, 0] = -1.0
    Y = pb.to_lorentz(reference.double(), c)
    return np.ascontiguousarray(Y.float().numpy()), np.ascontiguousarray(Q.float().numpy())


def brute_force(x, rows, k, c):
    """float64 exact neighbours of x[rows] among x (self excluded), ties by index."""
    x64 = x.double()
    q = x64[rows]
    D = pb.pairwise_dist(q, x64, c)
    # recompute exactly from explicit differences (pairwise_dist is already exact; keep it simple)
    D[torch.arange(len(rows)), rows] = float("inf")
    idx = np.broadcast_to(np.arange(x.shape[0]), D.shape)
    order = np.lexsort((idx, D.numpy()), axis=1)[:, :k]
    order = torch.from_numpy(order)
    return D.gather(1, order), order


class HypllPoincareDistance:
    """PML BaseDistance computing d_c with hypll (pairwise by broadcasting: N×M×D memory)."""

    def __new__(cls, c):
        from hypll.manifolds.poincare_ball import Curvature, PoincareBall
        from hypll.tensors import ManifoldTensor
        from pytorch_metric_learning.distances import BaseDistance

        class _D(BaseDistance):
            def __init__(self):
                super().__init__(is_inverted=False)
                self.ball = PoincareBall(c=Curvature(c, constraining_strategy=lambda v: v))

            def compute_mat(self, query_emb, ref_emb):
                x = ManifoldTensor(query_emb[:, None, :], manifold=self.ball)
                y = ManifoldTensor(ref_emb[None, :, :], manifold=self.ball)
                return self.ball.dist(x, y)

            def pairwise_distance(self, query_emb, ref_emb):
                x = ManifoldTensor(query_emb, manifold=self.ball)
                y = ManifoldTensor(ref_emb, manifold=self.ball)
                return self.ball.dist(x, y)

        return _D()


def timeit(fn, repeats=1):
    best = float("inf")
    out = None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def args_k_values(k):
    """The Recall@K list of the benchmark this size stands for: SOP (k = 1000) or CUB/Cars."""
    return (1, 10, 100, 1000) if k >= 100 else (1, 2, 4, 8)


def run_case(n, d, k, c, args):
    import faiss

    x = make_embeddings(n, d, c, seed=n)
    print(f"\n## N={n}, D={d}, k={k}, c={c} (self-retrieval, query = reference)")
    # faiss baseline on the same lifted vectors
    Y32, Q32 = lifted_for_faiss(x, x, c)

    def faiss_flat():
        index = faiss.IndexFlatIP(d + 1)
        index.add(Y32)
        return index.search(Q32, k + 1)

    ranks = tuple(kv for kv in args_k_values(k) if kv <= k)
    knn_sets = HyperbolicKNN(c=c, exact_ranks=ranks)
    knn_full = HyperbolicKNN(c=c)
    # interleaved repeats (best of each): the machine's load drifts between runs
    t_faiss = t_ours = t_full = float("inf")
    for _ in range(args.repeats):
        t_f, _ = timeit(faiss_flat)
        t_o, (dist, ind) = timeit(lambda: knn_sets(x, k, x, True))
        t_faiss, t_ours = min(t_faiss, t_f), min(t_ours, t_o)
        if not args.skip_full_order:
            t_x, (fdist, find) = timeit(lambda: knn_full(x, k, x, True))
            t_full = min(t_full, t_x)
    c_faiss, _ = cpu_1thread(faiss_flat, args.repeats)
    c_ours, _ = cpu_1thread(lambda: knn_sets(x, k, x, True), args.repeats)
    print(f"faiss IndexFlatIP (k+1)          : {t_faiss:8.2f} s wall; 1-thread CPU {c_faiss:8.2f} s")
    print(f"HyperbolicKNN exact_ranks={ranks}: {t_ours:8.2f} s wall; 1-thread CPU {c_ours:8.2f} s   "
          f"ratio to faiss = {t_ours / t_faiss:.2f}x wall, {c_ours / c_faiss:.2f}x 1-thread CPU"
          f"  (target <= 1.3x: {'MET' if t_ours <= 1.3 * t_faiss else 'NOT MET'} by wall)")
    if not args.skip_full_order:
        c_full, _ = cpu_1thread(lambda: knn_full(x, k, x, True), args.repeats)
        print(f"HyperbolicKNN exact order at every rank: {t_full:8.2f} s wall; 1-thread CPU {c_full:8.2f} s   "
              f"ratio to faiss = {t_full / t_faiss:.2f}x wall, {c_full / c_faiss:.2f}x 1-thread CPU")
    print(load_text())

    from pytorch_metric_learning.utils.inference import CustomKNN

    m = min(n, args.custom_queries)
    custom = CustomKNN(PoincareDistance(c=c), batch_size=args.custom_batch)
    t_c, (cd, ci) = timeit(lambda: custom(x[:m], k + 1, x, False))
    t_custom = t_c * n / m
    label = "measured, all queries" if m == n else f"extrapolated from {m} queries x {n} references"
    print(f"PML CustomKNN(PoincareDistance)  : {t_custom:8.2f} s ({label}); "
          f"speed-up = {t_custom / t_ours:.1f}x  (target >= 5x: {'MET' if t_custom >= 5 * t_ours else 'NOT MET'}; "
          f"this baseline already runs this package's fused kernel and is {t_custom / t_faiss:.1f}x faiss itself, "
          f"so >= 5x over it and <= 1.3x faiss cannot both hold unless it is >= 6.5x faiss)")
    if args.hypll_queries > 0:
        mh = min(n, args.hypll_queries)
        hknn = CustomKNN(HypllPoincareDistance(c), batch_size=16)
        t_h, _ = timeit(lambda: hknn(x[:mh], k + 1, x, False))
        t_hyp = t_h * n / mh
        print(f"PML CustomKNN(hypll dist)        : {t_hyp:8.2f} s (extrapolated from {mh} queries x {n} "
              f"references); speed-up = {t_hyp / t_ours:.1f}x")

    rows = torch.randperm(n, generator=torch.Generator().manual_seed(1))[: min(n, args.check_queries)]
    bd, bi = brute_force(x, rows, k, c)
    sets = all(torch.equal(ind[rows, :K].sort(1).values, bi[:, :K].sort(1).values) for K in ranks + (k,))
    rel = ((dist[rows].double() - bd).abs() / bd.clamp_min(1e-12)).max().item()
    print(f"vs float64 brute force on {len(rows)} queries, exact_ranks mode: identical neighbour sets at "
          f"K in {tuple(sorted(set(ranks + (k,))))} = {sets}, max position-wise relative distance error = {rel:.2e}")
    if not args.skip_full_order:
        same = torch.equal(find[rows], bi)
        rel = ((fdist[rows].double() - bd).abs() / bd.clamp_min(1e-12)).max().item()
        print(f"vs float64 brute force on {len(rows)} queries, full order: identical neighbour lists "
              f"(sets and order) = {same}, max relative distance error = {rel:.2e}")
    print(f"peak RSS so far: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")

    if args.hnsw:
        idx = HyperbolicIndex(c=c, kind="hnsw", ef_search=args.ef_search)
        t_h, _ = timeit(lambda: idx.add(x))
        t_s, (hd, hi) = timeit(lambda: idx.search(x[rows], k, query_ids=rows))
        recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(hi, bi)])
        print(f"approximate HNSW (M=32, efSearch={max(args.ef_search, k)}): build {t_h:.2f} s, "
              f"search {len(rows)} queries {t_s:.2f} s, recall@{k} vs exact = {recall:.4f}")


def run_query_gallery_case(nq, ng, k, d, c, args):
    """In-Shop shape: separate query and gallery sets (no self-exclusion), Recall@1/10/20/30 ranks."""
    import faiss

    x = make_embeddings(nq + ng, d, c, seed=nq + ng)
    query, gallery = x[:nq], x[nq:]
    print(f"\n## query {nq} x gallery {ng}, D={d}, k={k}, c={c} (In-Shop shape, query != gallery)")
    Y32, Q32 = lifted_for_faiss(query, gallery, c)

    def faiss_flat():
        index = faiss.IndexFlatIP(d + 1)
        index.add(Y32)
        return index.search(Q32, k)

    ranks = tuple(r for r in (1, 10, 20, 30) if r <= k)
    knn_sets = HyperbolicKNN(c=c, exact_ranks=ranks)
    t_faiss = t_ours = float("inf")
    for _ in range(args.repeats):
        t_f, _ = timeit(faiss_flat)
        t_o, (dist, ind) = timeit(lambda: knn_sets(query, k, gallery, False))
        t_faiss, t_ours = min(t_faiss, t_f), min(t_ours, t_o)
    c_faiss, _ = cpu_1thread(faiss_flat, args.repeats)
    c_ours, _ = cpu_1thread(lambda: knn_sets(query, k, gallery, False), args.repeats)
    print(f"faiss IndexFlatIP                : {t_faiss:8.2f} s wall; 1-thread CPU {c_faiss:8.2f} s")
    print(f"HyperbolicKNN exact_ranks={ranks}: {t_ours:8.2f} s wall; 1-thread CPU {c_ours:8.2f} s   "
          f"ratio to faiss = {t_ours / t_faiss:.2f}x wall, {c_ours / c_faiss:.2f}x 1-thread CPU")
    print(load_text())
    rows = torch.randperm(nq, generator=torch.Generator().manual_seed(1))[: min(nq, args.check_queries)]
    D = pb.pairwise_dist(query.double()[rows], gallery.double(), c)
    idx = np.broadcast_to(np.arange(ng), D.shape)
    order = torch.from_numpy(np.lexsort((idx, D.numpy()), axis=1)[:, :k])
    bd = D.gather(1, order)
    sets = all(torch.equal(ind[rows, :K].sort(1).values, order[:, :K].sort(1).values) for K in ranks + (k,))
    rel = ((dist[rows].double() - bd).abs() / bd.clamp_min(1e-12)).max().item()
    print(f"vs float64 brute force on {len(rows)} queries: identical neighbour sets at K in "
          f"{tuple(sorted(set(ranks + (k,))))} = {sets}, max position-wise relative distance error = {rel:.2e}")


def run_collapsed_case(n, n_duplicates, k, d, c, args):
    """A collapsed model: n_duplicates identical points among n (ties go by index). The candidate
    lists cannot certify such rows, which fall back to the chunked exact scan; time and exactness."""
    g = torch.Generator().manual_seed(0)
    x = make_embeddings(n, d, c, seed=n)
    x[:n_duplicates] = x[0]
    print(f"\n## collapsed: N={n}, {n_duplicates} identical points, D={d}, k={k}, c={c}")
    t, (dist, ind) = timeit(lambda: HyperbolicKNN(c=c)(x, k, x, True))
    c1, _ = cpu_1thread(lambda: HyperbolicKNN(c=c)(x, k, x, True))
    rows = torch.randperm(n, generator=g)[: min(n, args.check_queries)]
    bd, bi = brute_force(x, rows, k, c)
    same = torch.equal(ind[rows], bi)
    rel = ((dist[rows].double() - bd).abs() / bd.clamp_min(1e-12)).max().item()
    print(f"HyperbolicKNN (exact order): {t:.2f} s wall, 1-thread CPU {c1:.2f} s ({load_text()}); vs float64 brute force on {len(rows)} queries: identical "
          f"lists = {same}, max relative distance error = {rel:.2e}; "
          f"peak RSS so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--c", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=1, help="best of this many timings (--scale: of each search)")
    p.add_argument("--custom-queries", type=int, default=10000)
    p.add_argument("--hypll-queries", type=int, default=200)
    p.add_argument("--custom-batch", type=int, default=256)
    p.add_argument("--check-queries", type=int, default=300)
    p.add_argument("--hnsw", action="store_true")
    p.add_argument("--skip-full-order", action="store_true", help="do not time the exact-order-everywhere mode")
    p.add_argument("--ef-search", type=int, default=128)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--collapsed", default="", help="e.g. 6000x5000: N points of which 5000 identical (k=8)")
    p.add_argument("--cases", default="", help="e.g. 8131x8,20000x100 (N x k)")
    p.add_argument("--scale", action="store_true",
                   help="retrieval at scale instead: faiss factories over the lift beside the cosine "
                        "index (bench/_knn_scale.py); 1,000,000 x 128 and 10,000 queries, with --quick "
                        "50,000 and 1,000 (the full size takes about half an hour on 2 cores)")
    p.add_argument("--n", type=int, default=None, help="--scale: gallery size")
    p.add_argument("--queries", type=int, default=None, help="--scale: number of queries")
    p.add_argument("--nlist", type=int, default=None, help="--scale: IVF lists (4096; --quick 256)")
    p.add_argument("--nprobe", default="1,4,16", help="--scale: IVF nprobe values")
    p.add_argument("--ef", default="16,32,64", help="--scale: HNSW efSearch values")
    p.add_argument("--hnsw-m", type=int, default=32, help="--scale: HNSW links per node")
    p.add_argument("--pq", type=int, default=0, help="--scale: also IVF<nlist>,PQ<pq> (0: no)")
    p.add_argument("--coarse", default="directions",
                   help="--scale: IVF coarse training(s) of HyperbolicIndex, comma-separated: directions, lift")
    p.add_argument("--keep-coordinates", default="true",
                   help="--scale: HyperbolicIndex keep_coordinates value(s), comma-separated: true (exact "
                        "re-rank from the kept coordinates), false (re-rank from faiss's stored vectors)")
    p.add_argument("--train-sample", type=int, default=200000, help="--scale: IVF training points")
    args = p.parse_args(argv)
    import faiss

    torch.set_num_threads(args.threads)
    faiss.omp_set_num_threads(args.threads)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    print(f"# bench/knn.py  threads={args.threads}  torch {torch.__version__}  faiss {faiss.__version__}  "
          f"{load_text()}")
    if args.scale:
        from bench._knn_scale import run_scale

        args.n = args.n or (50_000 if args.quick else 1_000_000)
        args.queries = args.queries or (1_000 if args.quick else 10_000)
        args.nlist = args.nlist or (256 if args.quick else 4096)
        return run_scale(args)
    p_cases = [(8131, 8), (60000, 1000)] if not args.quick else [(2000, 8), (6000, 100)]
    cases = [tuple(int(v) for v in cs.split("x")) for cs in args.cases.split(",")] if args.cases else p_cases
    for n, k in cases:
        run_case(n, args.dim, k, args.c, args)
    if not args.cases and not args.quick:
        run_query_gallery_case(14218, 12612, 30, args.dim, args.c, args)
    if args.collapsed:
        n, dup = (int(v) for v in args.collapsed.split("x"))
        run_collapsed_case(n, dup, 8, args.dim, args.c, args)


if __name__ == "__main__":
    main()
