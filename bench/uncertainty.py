#!/usr/bin/env python
"""Which per-query score predicts a wrong top-1 best: the radius, the kNN's own confidence, or both?

    python -m bench uncertainty                 # 3 seeds, 600 steps, validation (seed 0) and test
    python -m bench uncertainty --quick         # 1 seed, 100 steps, test split only
    python -m bench uncertainty --datasets glyphs,icons --seeds 0,1,2 --models ball_ms,sphere_supcon
    python -m bench uncertainty --dump-dir D    # also store every model's embeddings in D ...
    python -m bench uncertainty --rescore D     # ... and score them again without training

Protocol (the held-out benchmark's public defaults, at a CPU budget): frozen ImageNet
EfficientNet-Lite0 features (``--backbone tf_efficientnet_lite0``, 64 px, pooled 1280-d; only the
128-d head trains), batch 256 = 64 classes × 4, AdamW lr 1e-3 (wd 0.01, grad clip 3), 600 steps.
``--datasets`` takes any name of ``bench/_quality_common.py``'s ``BANK_DATASETS`` (default: the three
development domains, glyphs, icons and Iconify sets). Models:

* ``ball_ms``: MultiSimilarity + miner on ``PoincareSimilarity`` (c = 0.1, clip 2.3, T = 2·clip_r),
  the polar head (``HyperbolicEmbeddingHead(radius="learned")``), as ``bench/quality.py``'s ``hms`` row;
* ``ball_ms_cal``: the same + 0.03·``RadialCalibrationLoss`` (the recipes' calibration weight);
* ``sphere_supcon``: PML ``SupConLoss`` (τ 0.1) on an L2-normalised head (cosine);
* ``sphere_ms``: PML ``MultiSimilarityLoss`` (2, 50, 0.5) + ``MultiSimilarityMiner`` (ε 0.1), cosine.

Per test query (query → gallery, exact Poincaré distance in the ball, 1 − cos on the sphere), every
score is "larger = more uncertain":

* the single scores: ``radius`` (``hyperbolic_uncertainty``, gallery-free, ball only), ``top1_dist``
  (distance to the top-1 neighbour), ``gap`` (−(d₂ − d₁), the top-1/top-2 gap), ``agree@10``
  (1 − the share of the top 10 labels equal to the top-1 label);
* the candidates the public score was chosen from: ``ratio`` = d₁ / d_rival (d_rival: the first of
  the top k whose label differs from the top-1 label, d_k when none does), ``margin`` = d₁ − d_rival,
  ``vote@k,p`` (1 − the top-1 label's share of the top-k weights (d₁/d_i)^p), ``proto_rho`` (the
  top-1 label's class-prototype distance over its sum with the nearest other prototype's), and sums
  of these with each other and with the radius;
* ``retrieval_uncertainty``: the package's public score
  (:func:`pml_hyperbolic.evaluation.retrieval_uncertainty`: ``vote@20,p8`` + 4·``proto_rho``, over 5),
  computed by the package.

Reported per domain, model and score (mean ± std over seeds): AUROC for "top-1 wrong", AURC (the area
under the risk–coverage curve, lower is better) and E-AURC (AURC minus the AURC of a perfect
ordering at the same error rate), and the AUROC of "degraded" over each clean test query and its
blurred (Gaussian σ 1.5 px), noised (σ 0.5 of the normalised intensity) and occluded (24 px square)
copy, scored against the same clean gallery; degraded queries go through the frozen backbone once
per domain (cached like the bank). Every development domain has them: the Iconify sets' greyscale
drawings go through the same ``"glyph"`` transforms as the bank (three channels out), so blur, noise
and occlusion act on them as on the glyphs.

Choice on validation, check on test: every model is also trained on the training classes minus a
validation carve (``qc.carve_validation``: 32 training classes, queried as the test split is;
``--val-seeds``, default seed 0); the validation table ranks the candidate forms and constants (the
public function's form and constants were chosen there), the test table checks them. Nothing is
chosen on test classes. Targets (printed as met / NOT met per domain and split): (a) ``radius`` on
a ball model reaches the best sphere model's ``top1_dist`` failure AUROC; (b)
``retrieval_uncertainty`` beats every single score (of every model) by ≥ 0.02 failure AUROC.
Cost on 2 shared cores, banks cached: about 1–2 min per 600-step ball model, under 1 min per sphere
model; the full run of two domains (4 models, 3 test seeds + 1 validation seed) about 40 min; ``--quick``
about 150 s of CPU (284 s wall at load 6–10 on 2 shared cores). The first build of a domain's bank
and degraded copies adds a few minutes.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from bench import _quality_common as qc

MODELS = ("ball_ms", "ball_ms_cal", "sphere_supcon", "sphere_ms")
SINGLE = ("radius", "top1_dist", "gap", "agree@10")
CALIBRATION_WEIGHT = 0.03
DEGRADATIONS = ("blur", "noise", "occlude")
K_MAX = 20  # neighbours kept per query (every candidate reads its scores from these)
PUBLIC = "retrieval_uncertainty"


# ----------------------------------------------------------------------------------------- models

class _MSOnBall(torch.nn.Module):
    """MultiSimilarity + miner on one similarity object, plus ``w``·radial calibration (w = 0: none)."""

    def __init__(self, geometry, calibration):
        super().__init__()
        from pytorch_metric_learning.losses import MultiSimilarityLoss
        from pytorch_metric_learning.miners import MultiSimilarityMiner

        from pml_hyperbolic.distances import PoincareSimilarity
        from pml_hyperbolic.losses import RadialCalibrationLoss

        similarity = PoincareSimilarity(c=geometry)
        self.loss = MultiSimilarityLoss(alpha=2, beta=50, base=0.5, distance=similarity)
        self.miner = MultiSimilarityMiner(epsilon=0.1, distance=similarity)
        self.calibration = calibration
        self.cal = RadialCalibrationLoss(c=geometry) if calibration else None

    def forward(self, emb, labels, indices_tuple=None):
        out = self.loss(emb, labels, self.miner(emb, labels))
        return out + self.calibration * self.cal(emb, labels) if self.cal is not None else out


def build_model(name: str, feature_dim: int, embedding_dim: int = 128):
    """(head, loss, geometry or None) of one model (``MODELS``)."""
    from pml_hyperbolic.geometry import PoincareGeometry
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead

    if name in ("ball_ms", "ball_ms_cal"):
        geometry = PoincareGeometry(c=0.1, clip="hard", clip_r=2.3)
        head = HyperbolicEmbeddingHead(feature_dim, embedding_dim, c=geometry, radius="learned")
        return head, _MSOnBall(geometry, CALIBRATION_WEIGHT if name == "ball_ms_cal" else 0.0), geometry
    if name == "sphere_supcon":
        from pytorch_metric_learning.losses import SupConLoss

        return SphericalEmbeddingHead(feature_dim, embedding_dim), SupConLoss(temperature=0.1), None
    if name == "sphere_ms":
        from bench.radius import _multi_similarity

        return SphericalEmbeddingHead(feature_dim, embedding_dim), _multi_similarity(), None
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


# ------------------------------------------------------------------------------- degraded queries

def _image_split(dataset: str, split: str, fashion_root=None):
    """(PIL dataset, clean transform) of one split of a bank dataset, or None when unknown here."""
    from pml_hyperbolic.data import build_transforms

    if dataset in qc.DEVELOPMENT_DOMAINS:  # glyphs, icons, Iconify sets (greyscale "L" images: 3 channels out)
        return qc.image_dataset(dataset, split), build_transforms("glyph", train=False, image_size=64)
    if dataset == "fashion-mnist":
        root = qc.find_fashion_mnist(fashion_root)
        if root is None:
            return None
        return qc.FashionMNISTRetrieval(root, "test", 300), qc.fashion_transforms(64, False)
    return None


def degraded_query_features(cfg, dataset: str, max_classes=None, use_cache=True, log=print):
    """Pooled frozen features of every test query under each degradation: {kind: (N, F)}, cached
    on disk (None when this bench cannot read the domain's images)."""
    from bench.radius import backbone_features_degraded

    tag = f"degraded|query|all|{','.join(DEGRADATIONS)}" + ("" if max_classes is None else f"|first{max_classes}")
    path = qc._cache_path(cfg, dataset, tag)
    if use_cache and os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=False)
    found = _image_split(dataset, "query")
    if found is None:
        log(f"[degraded] {dataset}: images not readable by this bench; no degraded queries")
        return None
    data, clean = found
    if cfg.image_size != 64:
        raise SystemExit("the degraded queries are built at 64 px (the bank's default image size)")
    if max_classes is not None:
        data = qc._ClassSubset(data, max_classes)
    log(f"[degraded] {dataset}: {len(data)} queries x {len(DEGRADATIONS)} degradations through the frozen backbone")
    images = torch.stack([clean(data[i][0]) for i in range(len(data))])
    return backbone_features_degraded(cfg, images, DEGRADATIONS, path if use_cache else None)


# ----------------------------------------------------------------------------------------- scores

def neighbours(q, g, c, k=K_MAX, leave_one_out=False):
    """(M, k) ascending distances (float64) and indices: exact Poincaré distance for c, 1 − cos else."""
    from bench.radius import pair_distances

    d = pair_distances(q, g, c)
    if leave_one_out:
        d.fill_diagonal_(float("inf"))
    k = min(k, d.shape[1] - int(leave_one_out))
    dist, idx = torch.topk(d, k, dim=1, largest=False, sorted=True)
    return dist, idx


def candidate_scores(dist, labels, radius=None):
    """Every score of the bench from a neighbour table ((M, k) distances, (M, k) labels) and the
    radius uncertainty (M,) or None: {name: (M,) numpy}, larger = more uncertain."""
    d = dist.double().clamp_min(0)
    y = labels
    same = y == y[:, :1]
    k = d.shape[1]
    d1 = d[:, 0]
    out = {"top1_dist": d1, "gap": -(d[:, 1] - d1) if k > 1 else torch.zeros_like(d1)}
    for kk in (5, 10, 20):
        if kk <= k:
            out[f"agree@{kk}"] = 1 - same[:, :kk].double().mean(1)
    tiny = torch.finfo(torch.float64).tiny
    for kk in (10, 20):
        if kk > k:
            continue
        rival_pos = torch.where(~same[:, :kk], torch.arange(kk).expand(len(d), kk), torch.full_like(y[:, :kk], kk - 1))
        d_rival = d.gather(1, rival_pos.min(1, keepdim=True).values)[:, 0]
        ratio = d1 / d_rival.clamp_min(tiny)
        suffix = "" if kk == 10 else f"@{kk}"
        out["ratio" + suffix] = ratio
        out["margin" + suffix] = d1 - d_rival
        out["ratio×d1" + suffix] = ratio * d1
        out["ratio×√d1" + suffix] = ratio * d1.sqrt()
        out[f"ratio+agree@{kk}"] = ratio + 1 - same[:, :kk].double().mean(1)
        if radius is not None:
            for beta in (0.5, 1.0, 2.0):
                out[f"ratio+{beta:g}·radius" + suffix] = torch.log(ratio.clamp_min(tiny)) + beta * radius.double()
    for kk in (10, 20):
        if kk > k:
            continue
        for p in (1, 4, 8, 16):
            w = (d1[:, None].clamp_min(tiny) / d[:, :kk].clamp_min(tiny)) ** p
            out[f"vote@{kk},p{p}"] = 1 - (w * same[:, :kk]).sum(1) / w.sum(1)
    if "ratio" in out:  # sums of the vote (labels) with the ratio (distances) and the radius (gallery-free)
        for p in (1, 4):
            vote = out.get(f"vote@10,p{p}")
            if vote is None:
                continue
            out[f"vote@10,p{p}+ratio"] = vote + out["ratio"]
            if radius is not None:
                for beta in (0.25, 0.5, 1.0):
                    out[f"vote@10,p{p}+{beta:g}·radius"] = vote + beta * radius.double()
                    out[f"vote@10,p{p}+ratio+{beta:g}·radius"] = vote + out["ratio"] + beta * radius.double()
    if radius is not None:
        out["radius"] = radius.double()
    return {name: v.numpy() for name, v in out.items()}


def auroc(positive, score):
    """Area under the ROC curve of ``score`` for ``positive`` (Mann–Whitney, ties counted half);
    NaN when one class is empty. The same value as scikit-learn's, without its per-call overhead."""
    from scipy.stats import rankdata

    positive = np.asarray(positive, bool)
    n_pos = int(positive.sum())
    n_neg = len(positive) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = rankdata(np.asarray(score, np.float64))
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def aurc(wrong, score):
    """(AURC, E-AURC): mean selective risk over coverages 1/n..1 (most confident first), and minus
    the optimum at the same error rate (a perfect ordering)."""
    wrong = np.asarray(wrong, float)
    order = np.argsort(score, kind="stable")
    n = len(wrong)
    risk = np.cumsum(wrong[order]) / np.arange(1, n + 1)
    value = float(risk.mean())
    optimal = float((np.cumsum(np.sort(wrong)) / np.arange(1, n + 1)).mean())
    return value, value - optimal


def embed_model(head, geometry, query_feats, query_labels, gallery_feats, gallery_labels, degraded=None):
    """The embeddings one trained model gives the queries, the gallery (None: leave-one-out) and the
    degraded queries: everything :func:`score_embeddings` needs (and what ``--dump-dir`` stores)."""
    from bench.radius import embed

    return {"q": embed(head, query_feats), "ql": query_labels,
            "g": None if gallery_feats is None else embed(head, gallery_feats), "gl": gallery_labels,
            "degraded": None if degraded is None else {kind: embed(head, f) for kind, f in degraded.items()},
            "c": None if geometry is None else float(geometry.curvature()),
            "clip_r": None if geometry is None else float(geometry.clip_r)}


def score_embeddings(e):
    """Every score's failure AUROC, AURC, E-AURC and clean-vs-degraded AUROC from one model's embeddings."""
    from pml_hyperbolic.evaluation import retrieval_uncertainty
    from pml_hyperbolic.geometry import PoincareGeometry
    from pml_hyperbolic.uncertainty import hyperbolic_uncertainty

    c = e["c"]
    geometry = None if c is None else PoincareGeometry(c=c, clip="hard", clip_r=e["clip_r"])
    q, ql = e["q"], e["ql"]
    loo = e["g"] is None
    g, gl = (q, ql) if loo else (e["g"], e["gl"])

    def scores_of(points, self_excluded):
        dist, idx = neighbours(points, g, c, leave_one_out=self_excluded)
        radius = None if geometry is None else hyperbolic_uncertainty(points, c=geometry)
        s = candidate_scores(dist, gl[idx], radius)
        if not self_excluded:  # (leave-one-out: the public function has no self-exclusion; not scored)
            s["proto_rho"] = prototype_ratio(points, g, gl, idx[:, 0], c)
            s[PUBLIC] = retrieval_uncertainty(points, g, gl, c=geometry).double().numpy()
        return s, gl[idx[:, 0]]

    s, top1_label = scores_of(q, loo)
    wrong = (top1_label != ql).numpy()
    res = {"r1": float(1 - wrong.mean()), "scores": {}}
    for name, v in s.items():
        a, ea = aurc(wrong, v)
        res["scores"][name] = {"auroc_fail": auroc(wrong, v), "aurc": a, "e_aurc": ea}
    degraded = e.get("degraded")
    if degraded and not loo:
        for kind, points in degraded.items():
            sd, _ = scores_of(points, False)
            is_deg = np.r_[np.zeros(len(wrong), bool), np.ones(len(points), bool)]
            for name in s:
                res["scores"][name][f"auroc_{kind}"] = auroc(is_deg, np.r_[s[name], sd[name]])
        for name in s:
            res["scores"][name]["auroc_degraded"] = float(np.mean([res["scores"][name][f"auroc_{k}"] for k in degraded]))
    return res


def prototype_ratio(q, g, gl, top1, c):
    """ρ of :func:`retrieval_uncertainty` alone: the top-1 label's prototype distance over its sum with
    the nearest other prototype's."""
    from pml_hyperbolic.evaluation.retrieval_confidence import _distances, _prototypes

    classes, inverse = torch.unique(gl, return_inverse=True)
    dp = _distances(q.double(), _prototypes(g.double(), inverse, len(classes), c), c)
    pos = inverse[top1][:, None]
    own, rival = dp.gather(1, pos)[:, 0], dp.scatter(1, pos, float("inf")).min(1).values
    return (own / (own + rival)).numpy()


# -------------------------------------------------------------------------------------- running

def train_model(cfg, name, train, feature_dim, seed, steps):
    torch.manual_seed(seed)
    np.random.seed(seed)
    head, loss, geometry = build_model(name, feature_dim, cfg.embedding_dim)
    qc.train_with_labels(cfg, train, torch.nn.Identity(), head, loss, seed=seed, steps=steps)
    return head, geometry


def run_domain(cfg, dataset, models, seeds, steps, num_val_classes=32, max_classes=None, use_cache=True, log=print,
               val_seeds=None, splits=("val", "test"), dump_dir=None):
    """Validation and test results of every (model, seed) on one domain."""
    bank = qc.pooled_bank(qc.build_bank(cfg, dataset, use_cache=use_cache, log=log, max_classes=max_classes), cfg,
                          use_cache=use_cache)
    n_train_classes = int(bank.train.labels.unique().numel())
    n_val = min(num_val_classes, max(1, n_train_classes // 4))
    train_v, val_q, val_g = qc.carve_validation(bank, num_val_classes=n_val, seed=0)
    degraded = (degraded_query_features(cfg, dataset, max_classes=max_classes, use_cache=use_cache, log=log)
                if "test" in splits else None)
    out = {"note": bank.note, "val_classes": n_val, "runs": []}
    for name in models:
        for seed in seeds:
            t0 = time.perf_counter()
            val = None
            if "val" in splits and (val_seeds is None or seed in val_seeds):
                head, geometry = train_model(cfg, name, train_v, bank.feature_dim, seed, steps)
                emb = embed_model(head, geometry, val_q.acts, val_q.labels, None if val_g is None else val_g.acts,
                                  None if val_g is None else val_g.labels)
                _dump(dump_dir, dataset, "val", name, seed, emb)
                val = score_embeddings(emb)
            test = None
            if "test" in splits:
                head, geometry = train_model(cfg, name, bank.train, bank.feature_dim, seed, steps)
                emb = embed_model(head, geometry, bank.query.acts, bank.query.labels,
                                  None if bank.gallery is None else bank.gallery.acts,
                                  None if bank.gallery is None else bank.gallery.labels, degraded)
                _dump(dump_dir, dataset, "test", name, seed, emb)
                test = score_embeddings(emb)
            out["runs"].append({"model": name, "seed": seed, "val": val, "test": test,
                                "seconds": time.perf_counter() - t0})
            parts = []
            for split, res in (("val", val), ("test", test)):
                if res is not None:
                    sc = res["scores"]
                    parts.append(f"{split} R@1 {100 * res['r1']:.1f}, failure AUROC radius "
                                 f"{sc.get('radius', {}).get('auroc_fail', float('nan')):.3f} / top1_dist "
                                 f"{sc['top1_dist']['auroc_fail']:.3f} / {PUBLIC} {sc[PUBLIC]['auroc_fail']:.3f}")
            log(f"[{dataset}] {name} seed {seed}: " + "; ".join(parts) + f" ({time.perf_counter() - t0:.0f} s)")
    return out


def _dump(dump_dir, dataset, split, model, seed, emb):
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        torch.save(dict(emb, dataset=dataset, split=split, model=model, seed=seed),
                   os.path.join(dump_dir, f"{dataset}__{split}__{model}__{seed}.pt"))


def rescore(dump_dir, datasets, models, log=print):
    """The domains' results from the embeddings a previous run stored with ``--dump-dir``: every
    score recomputed (the public function as the package computes it now), nothing retrained."""
    import glob

    domains = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.pt"))):
        e = torch.load(path, map_location="cpu", weights_only=False)
        if e["dataset"] not in datasets or e["model"] not in models:
            continue
        dom = domains.setdefault(e["dataset"], {"note": f"embeddings from {dump_dir}", "val_classes": None, "runs": []})
        run = next((r for r in dom["runs"] if r["model"] == e["model"] and r["seed"] == e["seed"]), None)
        if run is None:
            run = {"model": e["model"], "seed": e["seed"], "val": None, "test": None, "seconds": None}
            dom["runs"].append(run)
        run[e["split"]] = score_embeddings(e)
    for dom in domains.values():
        dom["runs"].sort(key=lambda r: (models.index(r["model"]), r["seed"]))
    return domains


# ------------------------------------------------------------------------------------- reporting

def _values(runs, model, split, score, metric):
    return [r[split]["scores"][score].get(metric, np.nan) for r in runs
            if r["model"] == model and r[split] is not None and score in r[split]["scores"]]


def _cell(values, digits=3):
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
    if len(v) == 0:
        return "—"
    return f"{v.mean():.{digits}f}" if len(v) == 1 else f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}"


def _best(items):
    """The largest finite (value, ...) tuple, or (nan, None) when there is none."""
    items = [t for t in items if np.isfinite(t[0])]
    return max(items) if items else (float("nan"), None)


def _mean(values):
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], float)
    return float(v.mean()) if len(v) else float("nan")


def summarise(dataset, dom, models):
    """Printed tables and the summary dict (targets) of one domain."""
    runs = dom["runs"]
    names = []
    for r in runs:
        for split in ("val", "test"):
            for n in (r[split] or {"scores": {}})["scores"]:
                if n not in names:
                    names.append(n)
    lines = [f"\n## {dataset}: {dom['note']}",
             f"validation: {dom['val_classes']} training classes carved out; failure AUROC on validation "
             "(the choice) | on test (the check)"]
    head = "| score | " + " | ".join(f"{m} val | {m} test" for m in models) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        cells = []
        for m in models:
            cells += [_cell(_values(runs, m, "val", n, "auroc_fail")), _cell(_values(runs, m, "test", n, "auroc_fail"))]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", "test: AURC (lower is better) / E-AURC / AUROC clean vs degraded (mean of blur, noise, occlusion)"]
    head = "| score | " + " | ".join(f"{m} AURC | {m} E-AURC | {m} degraded" for m in models) + " |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        cells = []
        for m in models:
            cells += [_cell(_values(runs, m, "test", n, "aurc")), _cell(_values(runs, m, "test", n, "e_aurc")),
                      _cell(_values(runs, m, "test", n, "auroc_degraded"))]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    r1 = {m: _mean([r["test"]["r1"] for r in runs if r["model"] == m and r["test"] is not None]) for m in models}
    lines.append("test R@1: " + ", ".join(f"{m} {100 * v:.1f}" for m, v in r1.items()))
    # targets
    ball = [m for m in models if m.startswith("ball")]
    sphere = [m for m in models if m.startswith("sphere")]
    summary = {"r1": r1}
    for split in ("val", "test"):
        mean = {(m, n): _mean(_values(runs, m, split, n, "auroc_fail")) for m in models for n in names}
        best_radius = _best((mean[(m, "radius")], m) for m in ball)
        best_sphere_d1 = _best((mean[(m, "top1_dist")], m) for m in sphere)
        best_single = _best((mean[(m, n)], m, n) for m in models for n in SINGLE if (m, n) in mean)
        best_public = _best((mean[(m, PUBLIC)], m) for m in models)
        per_model = {m: mean[(m, PUBLIC)] - _best((mean[(m, n)],) for n in SINGLE if (m, n) in mean)[0]
                     for m in models}
        known_a = np.isfinite(best_radius[0]) and np.isfinite(best_sphere_d1[0])
        known_b = np.isfinite(best_public[0]) and np.isfinite(best_single[0])
        summary[split] = {
            "best_radius": best_radius, "best_sphere_top1_dist": best_sphere_d1, "best_single": best_single,
            "best_public": best_public, "public_minus_best_single_same_model": per_model,
            "target_a": bool(best_radius[0] >= best_sphere_d1[0]) if known_a else None,
            "target_b": bool(best_public[0] - best_single[0] >= 0.02) if known_b else None,
            "target_b_every_model": bool(all(v >= 0.02 for v in per_model.values())) if known_b else None,
            "auroc_fail": {f"{m}/{n}": v for (m, n), v in mean.items()},
        }
        s = summary[split]
        verdict = {True: "met", False: "NOT met", None: "not measurable"}
        lines.append(
            f"{split}: (a) best ball radius {best_radius[0]:.3f} ({best_radius[1]}) vs best sphere top-1 distance "
            f"{best_sphere_d1[0]:.3f} ({best_sphere_d1[1]}): {verdict[s['target_a']]}; "
            f"(b) best {PUBLIC} {best_public[0]:.3f} ({best_public[1]}) vs best single score {best_single[0]:.3f} "
            f"({' '.join(map(str, best_single[1:]))}): {best_public[0] - best_single[0]:+.3f} "
            f"({verdict[s['target_b']]}); same model, {PUBLIC} minus its best single score: "
            + ", ".join(f"{m} {v:+.3f}" for m, v in per_model.items()))
    val_rank = [(_mean([_mean(_values(runs, m, "val", n, "auroc_fail")) for m in models]), n) for n in names]
    val_rank = sorted(((v, n) for v, n in val_rank if np.isfinite(v)), reverse=True)
    if val_rank:
        lines.append("validation ranking (failure AUROC, mean over models): "
                     + ", ".join(f"{n} {v:.3f}" for v, n in val_rank[:8]))
    summary["val_ranking"] = [(n, v) for v, n in val_rank]
    return "\n".join(lines), summary


ROW_SCORES = ("radius", "top1_dist", "gap", "agree@10", "ratio", "vote@20,p8", "proto_rho", PUBLIC)


def flat_rows(results):
    """The JSON record's rows: one row of targets per domain and split first, then one per domain,
    split, model and reported score (means over seeds, with the per-seed failure AUROCs)."""
    rows, targets = [], []
    for dataset, dom in results["domains"].items():
        for split in ("val", "test"):
            summary = results["summary"].get(dataset, {}).get(split)
            if summary and np.isfinite(summary["best_public"][0]):
                targets.append({"dataset": dataset, "split": split, "model": "targets",
                                "score": "(a) radius reaches the best sphere top-1 distance; (b) public score "
                                         "+0.02 over every single score",
                                "target_a": summary["target_a"], "target_b": summary["target_b"],
                                "target_b_every_model": summary["target_b_every_model"],
                                "best_radius": summary["best_radius"][0],
                                "best_sphere_top1_dist": summary["best_sphere_top1_dist"][0],
                                "best_public": summary["best_public"][0], "best_single": summary["best_single"][0]})
            for model in results["models"]:
                runs = [r for r in dom["runs"] if r["model"] == model and r[split] is not None]
                if not runs:
                    continue
                for name in ROW_SCORES:
                    if name not in runs[0][split]["scores"]:
                        continue
                    row = {"dataset": dataset, "split": split, "model": model, "score": name, "seeds": len(runs),
                           "r1": _mean([r[split]["r1"] for r in runs]),
                           "auroc_fail_per_seed": [r[split]["scores"][name]["auroc_fail"] for r in runs]}
                    for metric in ("auroc_fail", "aurc", "e_aurc", "auroc_blur", "auroc_noise", "auroc_occlude",
                                   "auroc_degraded"):
                        values = [r[split]["scores"][name].get(metric) for r in runs]
                        if any(v is not None for v in values):
                            row[metric] = _mean([np.nan if v is None else v for v in values])
                    rows.append(row)
    return targets + rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 seed, 100 steps, test split only (no validation training; banks cached: about 150 s of CPU)")
    p.add_argument("--datasets", default=",".join(qc.DEVELOPMENT_DOMAINS),
                   help=f"comma-separated, any of {qc.BANK_DATASETS} (default {','.join(qc.DEVELOPMENT_DOMAINS)})")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {MODELS}")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default 0,1,2; --quick 0)")
    p.add_argument("--val-seeds", default="0",
                   help="seeds that also train on the validation carve ('all': every seed; default 0)")
    p.add_argument("--steps", type=int, default=None, help="training steps per model (default 600; --quick 100)")
    p.add_argument("--backbone", default="tf_efficientnet_lite0")
    p.add_argument("--max-classes", type=int, default=None, help="first classes of every split only (smoke runs)")
    p.add_argument("--splits", default=None,
                   help="val: train on the carve, score the validation classes; test: train on all training "
                        "classes, score the test classes (default val,test; --quick: test)")
    p.add_argument("--val-classes", type=int, default=32, help="training classes carved out for validation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--dump-dir", default=None, help="also store every model's embeddings here (for --rescore)")
    p.add_argument("--rescore", default=None, metavar="DIR",
                   help="train nothing: score the embeddings a run stored with --dump-dir DIR")
    p.add_argument("--no-cache", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    """The suite's entry point: run, print, and return the record's rows (:func:`flat_rows`)."""
    results, a = run_bench(argv)
    rows = flat_rows(results)
    rows.append({"dataset": "all", "split": "config", "model": ",".join(results["models"]), "score": "",
                 "budget": results["budget"], "datasets": ",".join(results["domains"]),
                 "rescored_from": a.rescore or "", "wall_seconds": results["wall_seconds"]})
    return rows


def run_bench(argv=None):
    """Parse ``argv``, train and score (or rescore), print the tables; (results dict, parsed args)."""
    a = parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    datasets = [d.strip() for d in a.datasets.split(",") if d.strip()]
    bad = [m for m in models if m not in MODELS] + [d for d in datasets if d not in qc.BANK_DATASETS]
    if bad:
        raise SystemExit(f"unknown model(s) or dataset(s) {bad}; models: {MODELS}, datasets: {qc.BANK_DATASETS}")
    seeds = (0,) if a.quick and a.seeds is None else tuple(int(s) for s in (a.seeds or "0,1,2").split(","))
    steps = a.steps if a.steps is not None else (100 if a.quick else 600)
    splits = tuple(x.strip() for x in (a.splits or ("test" if a.quick else "val,test")).split(",") if x.strip())
    if not splits or set(splits) - {"val", "test"}:
        raise SystemExit(f"--splits must name val and/or test, got {a.splits!r}")
    val_seeds = None if a.val_seeds == "all" else tuple(int(s) for s in a.val_seeds.split(","))
    cfg = qc.BenchConfig(backbone=a.backbone, trainable="head", steps=steps, batch_size=256, samples_per_class=4,
                         lr_head=1e-3, seeds=seeds, threads=a.threads)
    if a.cache_dir:
        cfg.cache_dir = a.cache_dir
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print(f"# bench/uncertainty.py {'--quick ' if a.quick else ''}(failure prediction and degraded inputs)")
    print(f"budget: {cfg.describe()}")
    print(f"machine: {qc.machine_line()}")
    results = {"config": qc.config_dict(cfg), "budget": cfg.describe(), "models": models, "domains": {},
               "summary": {}}
    stored = rescore(a.rescore, datasets, models) if a.rescore else None
    for dataset in datasets:
        if stored is not None:
            if dataset not in stored:
                print(f"[{dataset}] no stored embeddings in {a.rescore}")
                continue
            text, summary = summarise(dataset, stored[dataset], models)
            print(text, flush=True)
            results["domains"][dataset], results["summary"][dataset] = stored[dataset], summary
            continue
        try:
            dom = run_domain(cfg, dataset, models, seeds, steps, num_val_classes=a.val_classes,
                             max_classes=a.max_classes, use_cache=not a.no_cache, val_seeds=val_seeds,
                             splits=splits, dump_dir=a.dump_dir)
        except FileNotFoundError as err:
            print(f"[{dataset}] skipped: {err}")
            continue
        text, summary = summarise(dataset, dom, models)
        print(text, flush=True)
        results["domains"][dataset] = dom
        results["summary"][dataset] = summary
    results["wall_seconds"] = time.perf_counter() - t0
    print(f"\n# {results['wall_seconds']:.0f} s wall; {qc.machine_line()}")
    return results, a


if __name__ == "__main__":
    main()
