#!/usr/bin/env python
"""Temperature × curvature study (HypMix Fig. 2 on our data): Recall@1 of Sph- and Hyp- embeddings.

    python -m bench tau_sweep --out-png tau_sweep.png            # 300 steps, seed 0
    python -m bench tau_sweep --seeds 0,1,2 --out-png tau_sweep.png   # README's table: 4 min wall measured (2026-11-23, 2 cores)
    python -m bench tau_sweep --quick --out-png tau_sweep.png    # 40 steps (231 CPU-s measured)

Grid: τ ∈ {0.05, 0.1, 0.2, 0.5, 1} × c ∈ {0 (sphere: L2-normalised head, cosine similarity / τ),
0.01, 0.1, 0.3, 1, c_δ} with c_δ = (0.144 / δ_rel)² suggested by the δ-hyperbolicity of the
pretrained backbone's pooled features on the training images (``suggest_curvature`` of the
evaluation package when available, else this bench's own estimate; the source is printed).
Every cell trains the same model with the pairwise cross-entropy of Hyp-ViT
(``PairwiseCrossEntropyLoss``; cosine similarity for c = 0, ``PoincareDistance(c)`` otherwise).

Protocol: the bundled glyph dataset. 32 of the 160 training characters are held out as a
**validation** split (hard protocol too: display-font queries vs serif/sans gallery); models train
on the other 128 and are scored on validation and on the 160 **test** characters. The τ (and c)
"a user would pick" is the validation argmax; test numbers are reported for every cell (the study)
but nothing is selected on them. Hyperbolic cells are evaluated with the exact Poincaré kNN at
their c, the sphere with cosine.

Budget (printed): same backbone/bank as ``bench/quality.py`` (MobileNetV2, offline ImageNet weights,
64 px, frozen-prefix bank with 1 clean + 3 augmented views per image — 2 views with ``--quick``);
by default only the 128-d embedding head trains, on the frozen backbone's pooled features (the
study is about the head's geometry and temperature; ``--trainable tail`` also trains the last
block + conv_head, ~10× slower). Batch 128 (32 classes × 4), AdamW lr 3e-3, wd 0.01, clip 3.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402

TAUS = (0.05, 0.1, 0.2, 0.5, 1.0)
CURVATURES = (0.0, 0.01, 0.1, 0.3, 1.0)
R1 = ("recall_at_1",)


def train_cell(cfg, bank, train, c, tau, seed, steps):
    """Train one (c, τ) cell; return (tail, head)."""
    from pytorch_metric_learning.distances import CosineSimilarity

    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead, SphericalEmbeddingHead
    from pml_hyperbolic.losses import PairwiseCrossEntropyLoss

    torch.manual_seed(seed)
    tail = qc.fresh_tail(bank)
    if c == 0:
        head = SphericalEmbeddingHead(bank.feature_dim, cfg.embedding_dim)
        loss = PairwiseCrossEntropyLoss(temperature=tau, distance=CosineSimilarity())
    else:
        head = HyperbolicEmbeddingHead(bank.feature_dim, cfg.embedding_dim, c=c)
        loss = PairwiseCrossEntropyLoss(temperature=tau, distance=PoincareDistance(c=c))
    return qc.train_with_labels(cfg, train, tail, head, loss, seed=seed, steps=steps)


def run_sweep(cfg, bank, taus=TAUS, curvatures=CURVATURES, add_delta_c=True, num_val_classes=32, log=print,
              delta_points=2000, delta_draws=5):
    """Returns dict with the grid, val/test R@1 arrays (rows = c, cols = τ) and c_δ."""
    train, val_q, val_g = qc.carve_validation(bank, num_val_classes=num_val_classes, seed=0)
    cs = [float(c) for c in curvatures]
    c_delta, c_source = None, None
    if add_delta_c:
        feats = bank.train.acts[:, 0] if bank.train.acts.dim() == 3 else qc._through(bank.tail, bank.train.acts[:, 0])
        c_delta, c_source = qc.suggest_curvature_from_features(feats, n_points=delta_points, draws=delta_draws)
        log(f"[delta] suggested c = {c_delta:.4g} ({c_source})")
        cs.append(float(c_delta))
    val = np.full((len(cs), len(taus)), np.nan)
    test = np.full((len(cs), len(taus)), np.nan)
    for i, c in enumerate(cs):
        for j, tau in enumerate(taus):
            t0 = time.perf_counter()
            vals, tests = [], []
            for seed in cfg.seeds:
                tail, head = train_cell(cfg, bank, train, c, tau, seed, cfg.steps)
                ec = None if c == 0 else c
                vals.append(qc.evaluate(tail, head, val_q, val_g, c=ec, keys=R1)["recall_at_1"])
                tests.append(qc.evaluate(tail, head, bank.query, bank.gallery, c=ec, keys=R1)["recall_at_1"])
            val[i, j], test[i, j] = np.mean(vals), np.mean(tests)
            log(f"  c={c:<8.4g} tau={tau:<5g} val R@1 {100 * val[i, j]:5.1f}  test R@1 {100 * test[i, j]:5.1f}  "
                f"({time.perf_counter() - t0:.0f} s)")
    return {"taus": list(taus), "curvatures": cs, "c_delta": c_delta, "c_delta_source": c_source,
            "val_r1": val.tolist(), "test_r1": test.tolist()}


def c_label(c, c_delta=None, last=False):
    if c == 0:
        return "sphere"
    if last and c_delta is not None:
        return f"c_δ={c:.3g}"
    return f"c={c:g}"


def summarize(res):
    """Markdown table of test R@1 (val R@1) and the Sph-vs-Hyp comparison at validation-chosen τ."""
    taus, cs = res["taus"], res["curvatures"]
    val, test = np.asarray(res["val_r1"]), np.asarray(res["test_r1"])
    n = len(cs)
    lines = ["| geometry | " + " | ".join(f"τ={t:g}" for t in taus) + " | τ picked on val → test R@1 |",
             "|---|" + "---:|" * (len(taus) + 1)]
    for i, c in enumerate(cs):
        j = int(np.nanargmax(val[i]))
        cells = [f"{100 * test[i, k]:.1f} ({100 * val[i, k]:.1f})" for k in range(len(taus))]
        lines.append(f"| {c_label(c, res['c_delta'], i == n - 1 and res['c_delta'] is not None)} | "
                     + " | ".join(cells) + f" | τ={taus[j]:g} → {100 * test[i, j]:.1f} |")
    sph = [i for i, c in enumerate(cs) if c == 0]
    hyp = [i for i, c in enumerate(cs) if c > 0]
    verdict = ""
    if sph and hyp:
        si = sph[0]
        sj = int(np.nanargmax(val[si]))
        hv = val[hyp]
        hi, hj = np.unravel_index(int(np.nanargmax(hv)), hv.shape)
        hi = hyp[hi]
        verdict = (f"Validation-tuned sphere (τ={taus[sj]:g}): test R@1 {100 * test[si, sj]:.1f}; validation-tuned "
                   f"hyperbolic ({c_label(round(cs[hi], 3))}, τ={taus[hj]:g}): test R@1 {100 * test[hi, hj]:.1f}; "
                   f"difference {100 * (test[hi, hj] - test[si, sj]):+.1f} points.")
        if 0.2 in taus and 0.1 in cs:
            verdict += (f" At the papers' fixed τ=0.2: sphere {100 * test[si, taus.index(0.2)]:.1f} vs c=0.1 "
                        f"{100 * test[cs.index(0.1), taus.index(0.2)]:.1f}.")
    return "\n".join(lines), verdict


def plot(res, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    taus, cs = res["taus"], res["curvatures"]
    n = len(cs)
    labels = [c_label(c, res["c_delta"], i == n - 1 and res["c_delta"] is not None) for i, c in enumerate(cs)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.55 * n + 2.2), constrained_layout=True)
    val = 100 * np.asarray(res["val_r1"])
    for ax, name in zip(axes, ("test_r1", "val_r1")):
        data = 100 * np.asarray(res[name])
        im = ax.imshow(data, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus])
        ax.set_yticks(range(n), labels)
        ax.set_xlabel("temperature τ")
        for i in range(n):
            for j in range(len(taus)):
                ax.text(j, i, f"{data[i, j]:.1f}", ha="center", va="center",
                        color="white" if data[i, j] < np.nanmean(data) else "black", fontsize=9)
            j = int(np.nanargmax(val[i]))  # the τ a user would pick on validation, marked on both panels
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", lw=2))
        fig.colorbar(im, ax=ax, label="Recall@1 (%)")
        ax.set_title("test (160 held-out characters)" if name == "test_r1" else "validation (32 train characters)")
    fig.suptitle(title + "\nred box: τ with the best validation R@1 in each row", fontsize=10)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="40 steps, 2-view bank (~5 min)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--seeds", default=None, help="comma-separated (default 0)")
    p.add_argument("--taus", default=None, help="comma-separated τ values")
    p.add_argument("--curvatures", default=None, help="comma-separated c values (0 = sphere)")
    p.add_argument("--no-delta-c", action="store_true", help="skip the δ-suggested curvature row")
    p.add_argument("--trainable", choices=("head", "tail"), default="head")
    p.add_argument("--views", type=int, default=None)
    p.add_argument("--image-size", type=int, default=None)
    p.add_argument("--backbone", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--no-cache", action="store_true")
    p.add_argument("--out-png", default=None, help="heat-map PNG path")
    p.add_argument("--out", default=None, help="JSON results path")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    cfg = qc.BenchConfig(steps=300, seeds=(0,), trainable=a.trainable)
    if a.quick:
        cfg.steps, cfg.views = 40, 2
    for name in ("steps", "views", "image_size", "backbone", "threads", "cache_dir"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    if a.seeds:
        cfg.seeds = tuple(int(s) for s in a.seeds.split(","))
    taus = tuple(float(t) for t in a.taus.split(",")) if a.taus else TAUS
    cs = tuple(float(c) for c in a.curvatures.split(",")) if a.curvatures else CURVATURES
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print(f"# bench/tau_sweep.py {'--quick ' if a.quick else ''}(pml-hyperbolic method comparison)")
    print(f"budget: {cfg.describe()}; loss: Hyp-ViT pairwise CE; 128 train / 32 validation characters")
    print(f"machine: {qc.machine_line()}")
    bank = qc.build_bank(cfg, "glyphs", use_cache=not a.no_cache)
    if cfg.trainable == "head":
        bank = qc.pooled_bank(bank, cfg, use_cache=not a.no_cache)
    print(f"[bank] {'loaded from cache' if bank.from_cache else 'built'} (build took {bank.build_seconds:.0f} s). "
          f"{bank.note}")
    res = run_sweep(cfg, bank, taus=taus, curvatures=cs, add_delta_c=not a.no_delta_c)
    wall = time.perf_counter() - t0
    res.update({"config": qc.config_dict(cfg), "wall_seconds": wall})
    table, verdict = summarize(res)
    print("\nRecall@1 (%) on the 160 test characters (validation R@1 in parentheses), "
          f"mean over seeds {list(cfg.seeds)}:\n")
    print(table)
    if verdict:
        print("\n" + verdict)
    print(f"\nTotal wall time {wall:.0f} s; {qc.machine_line()}.")
    if a.out_png:
        plot(res, a.out_png, f"Recall@1 vs τ and c — glyphs hard protocol, {cfg.backbone} {cfg.image_size}px, "
                             f"{cfg.trainable} trained {cfg.steps} steps")
        print(f"heat map written to {a.out_png}")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"results written to {a.out}")
    return res


if __name__ == "__main__":
    main()
