#!/usr/bin/env python
"""Ω / ε of ``HierarchicalLogRatioLoss`` (and the N×K ``HierarchicalMarginLoss``) chosen on a validation split.

    OMP_NUM_THREADS=1 python -m bench log_ratio_omega           # Ω grid, ε=1e-6, seeds 0-4, 300 steps (~4 min)
    OMP_NUM_THREADS=1 python -m bench log_ratio_omega --margin  # + HierarchicalMarginLoss flat vs (N, 2) (+~2 min)
    OMP_NUM_THREADS=1 python -m bench log_ratio_omega --eps 1e-6,0.1,1 --radius norm   # ε grid, the papers' head
    OMP_NUM_THREADS=1 python -m bench log_ratio_omega --omegas 10,1.2 --seeds 0 --steps 100   # smoke, ~20 s

Protocol: the bundled glyph dataset (hard protocol), the frozen MobileNetV2 bank of
``bench/_quality_common.py`` (64 px, 1 clean + 3 augmented views per training image) with only the
128-d ``HyperbolicEmbeddingHead`` (c = 0.1; its default radius mode unless ``--radius``) trained on
the pooled 1280-d features. 32 of the 160 training characters are carved out as **validation**
(``carve_validation``, seed 0; display-font queries vs serif/sans gallery); heads train on the
other 128 with the **true two-level labels** (N × 2: character, radical super-label) and are
scored on validation and on the 160 test characters. A setting is *chosen* on validation R@1
only; test R@1 is printed for every row but selects nothing. Baselines (no training): the pooled
1280-d features with cosine (``bench/quality.py``'s "Pretrained features, no training" row) and a
fresh, untrained ``HyperbolicEmbeddingHead`` (Poincaré kNN at c = 0.1; one per seed).

Diagnostics per row (end of training, on 2,000 random training-character clean views): mean
Poincaré distance of pairs at similarity level s = 1 (same character), 2 (same radical only),
3 (neither) — the loss asks for 1 : Ω : Ω²; the mean pairwise cosine of the embedding directions
(1 = every point on one ray); the mean ‖z‖√c (1 = ball boundary; 0.62 = the clip radius 2.3);
the fraction of 200,000 random dense triplets (s_ij < s_il) whose log-ratio is still *short* of
its target log Ω^{s_il − s_ij} (and their mean residual).

Batch 128 = 32 characters × 4, AdamW lr 3e-3, wd 0.01, clip 3. The tables of the recorded runs and
the choices made from them: docs/design/losses.md (HierarchicalLogRatioLoss, HierarchicalMarginLoss).
"""
from __future__ import annotations

import argparse
import copy
import math
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402

C = 0.1
R1 = ("recall_at_1",)
OMEGAS = (10.0, 4.0, 2.0, 1.5, 1.4, 1.3, 1.25, 1.2, 1.15, 1.1)
EPSS = (1e-6,)


def levels_of(split):
    if split.super_labels is None:
        raise ValueError("the training split has no super_labels (radicals)")
    return torch.stack([split.labels, torch.as_tensor(split.super_labels, dtype=torch.long)], 1)


HEAD_KWARGS = {}  # --radius norm: {"radius": "norm"} (the papers' clipped head)


def make_head(bank, cfg):
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead

    return HyperbolicEmbeddingHead(bank.feature_dim, cfg.embedding_dim, c=C, **HEAD_KWARGS)


def train_head(cfg, bank, train, loss, seed, steps, levels):
    torch.manual_seed(seed)
    tail = qc.fresh_tail(bank)
    head = make_head(bank, cfg)
    cfg = copy.copy(cfg)
    cfg.recluster_every = steps  # `relabel` only hands the (N, 2) labels to the loss, once
    return qc.train_with_labels(cfg, train, tail, head, loss, seed=seed, steps=steps,
                                relabel=lambda t, h: (train.labels, levels))


@torch.no_grad()
def diagnostics(tail, head, train, levels, n=2000, seed=0, omega=None, n_triplets=200_000):
    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.miners.hierarchy import pairwise_first_shared_level

    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(train.labels), generator=g)[:n]
    z = qc.embed(tail, head, train.acts[idx, 0])
    D = PoincareDistance(c=C)(z, z).double()
    s = pairwise_first_shared_level(levels[idx])
    off = ~torch.eye(len(idx), dtype=torch.bool)
    means = [float(D[(s == k) & off].mean()) if bool(((s == k) & off).any()) else float("nan") for k in (1, 2, 3)]
    u = torch.nn.functional.normalize(z.double(), dim=1)
    cos = float((u @ u.T)[off].mean())
    norm = float(z.norm(dim=1).mean() * math.sqrt(C))  # fraction of the ball radius 1/√c
    out = {"d_levels": means, "mean_cos": cos, "norm": norm}
    if omega is not None:  # random dense triplets (i, j, l), s_ij < s_il: residual of the log-ratio loss
        i, j, l = (torch.randint(len(idx), (n_triplets,), generator=g) for _ in range(3))
        keep = (s[i, j] < s[i, l]) & (i != j) & (i != l)
        i, j, l = i[keep], j[keep], l[keep]
        logd = torch.log(D + 1e-6)
        r = (logd[i, l] - logd[i, j]) - (s[i, l] - s[i, j]).double() * math.log(omega)
        out["too_close"] = float((r < 0).double().mean())  # the farther sample is short of its target
        out["mean_resid"] = float(r.mean())
    return out


def run(cfg, bank, settings, seeds, steps, log=print):
    train, val_q, val_g = qc.carve_validation(bank, num_val_classes=32, seed=0)
    levels = levels_of(train)
    rows = []
    # baselines
    v = qc.evaluate(bank.tail, None, val_q, val_g, c=None, keys=R1)["recall_at_1"]
    t = qc.evaluate(bank.tail, None, bank.query, bank.gallery, c=None, keys=R1)["recall_at_1"]
    rows.append({"name": "pooled 1280-d features, cosine (no training)", "val": [v], "test": [t]})
    log(f"  {rows[-1]['name']}: val {100 * v:.1f} test {100 * t:.1f}")
    vals, tests, diags = [], [], []
    for seed in seeds:
        torch.manual_seed(seed)
        head = make_head(bank, cfg)
        vals.append(qc.evaluate(bank.tail, head, val_q, val_g, c=C, keys=R1)["recall_at_1"])
        tests.append(qc.evaluate(bank.tail, head, bank.query, bank.gallery, c=C, keys=R1)["recall_at_1"])
        diags.append(diagnostics(bank.tail, head, train, levels))
    rows.append({"name": "untrained HyperbolicEmbeddingHead (c=0.1)", "val": vals, "test": tests, "diag": diags})
    log(f"  {rows[-1]['name']}: val {100 * np.mean(vals):.1f} test {100 * np.mean(tests):.1f}")
    for name, make_loss, lv in settings:
        t0 = time.perf_counter()
        vals, tests, diags = [], [], []
        for seed in seeds:
            loss = make_loss(train)
            tail, head = train_head(cfg, bank, train, loss, seed, steps, lv(levels))
            vals.append(qc.evaluate(tail, head, val_q, val_g, c=C, keys=R1)["recall_at_1"])
            tests.append(qc.evaluate(tail, head, bank.query, bank.gallery, c=C, keys=R1)["recall_at_1"])
            diags.append(diagnostics(tail, head, train, levels, omega=getattr(loss, "omega", None)))
        rows.append({"name": name, "val": vals, "test": tests, "diag": diags})
        log(f"  {name}: val {100 * np.mean(vals):.1f} test {100 * np.mean(tests):.1f} "
            f"{fmt_diag(diags)} ({time.perf_counter() - t0:.0f} s)")
    return rows


def fmt_diag(diags):
    if not diags:
        return ""
    d = np.mean([x["d_levels"] for x in diags], axis=0)
    cos = np.mean([x["mean_cos"] for x in diags])
    norm = np.mean([x["norm"] for x in diags])
    msg = (f"D s1:s2:s3 = {d[0]:.2f} : {d[1]:.2f} : {d[2]:.2f} (×{d[1] / d[0]:.2f}, ×{d[2] / d[0]:.2f}), "
           f"cos {cos:.3f}, |z|√c {norm:.2f}")
    if "too_close" in diags[0]:
        msg += (f", triplets short of target {100 * np.mean([x['too_close'] for x in diags]):.0f}%"
                f" (mean residual {np.mean([x['mean_resid'] for x in diags]):+.2f})")
    return msg


def table(rows):
    lines = ["| setting | val R@1 | test R@1 | mean D at s=1 : 2 : 3 | mean cos | ‖z‖√c "
             "| triplets short of target |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        def per(xs):
            each = f" ({', '.join(f'{100 * x:.1f}' for x in xs)})" if len(xs) > 1 else ""
            return f"{100 * np.mean(xs):.1f}{each}"
        if r.get("diag"):
            d = np.mean([x["d_levels"] for x in r["diag"]], axis=0)
            cos = np.mean([x["mean_cos"] for x in r["diag"]])
            norm = np.mean([x["norm"] for x in r["diag"]])
            extra = f"{d[0]:.2f} : {d[1]:.2f} : {d[2]:.2f} | {cos:.3f} | {norm:.2f}"
            short = [x["too_close"] for x in r["diag"] if "too_close" in x]
            extra += f" | {100 * np.mean(short):.0f}%" if short else " | —"
        else:
            extra = "— | — | — | —"
        lines.append(f"| {r['name']} | {per(r['val'])} | {per(r['test'])} | {extra} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--omegas", default=",".join(f"{o:g}" for o in OMEGAS))
    p.add_argument("--eps", default=",".join(f"{e:g}" for e in EPSS), help="comma-separated ε values")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--margin", action="store_true", help="also HierarchicalMarginLoss flat vs (N, 2)")
    p.add_argument("--margin-only", action="store_true", help="only the HierarchicalMarginLoss rows")
    p.add_argument("--level-gammas", default="0.1,0.5,1",
                   help="δ values of the (N, 2) margin rows ('default': the loss's own default δ)")
    p.add_argument("--gammas", default="0.1",
                   help="γ values of the margin rows ('default': the loss's own default γ)")
    p.add_argument("--margin-kwargs", default="",
                   help="extra HierarchicalMarginLoss keyword arguments, Python syntax, e.g. \"negative_margin='paper'\"")
    p.add_argument("--radius", choices=("default", "learned", "norm"), default="default",
                   help="HyperbolicEmbeddingHead radius mode (default: the head's own default)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.losses import HierarchicalLogRatioLoss, HierarchicalMarginLoss

    seeds = tuple(int(s) for s in a.seeds.split(","))
    HEAD_KWARGS.clear()
    if a.radius != "default":
        HEAD_KWARGS["radius"] = a.radius
    cfg = qc.BenchConfig(trainable="head", threads=a.threads, steps=a.steps, seeds=seeds)
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print(f"# bench/log_ratio_omega.py: {cfg.describe()}; 128 train / 32 validation characters, "
          "labels (character, radical)")
    head = make_head(argparse.Namespace(feature_dim=1280), cfg)
    print(f"head: HyperbolicEmbeddingHead(c={C}{''.join(f', {k}={v!r}' for k, v in HEAD_KWARGS.items())}): "
          f"{head.extra_repr() or type(head).__name__}")
    print(f"machine: {qc.machine_line()}")
    bank = qc.pooled_bank(qc.build_bank(cfg, "glyphs", use_cache=not a.no_cache), cfg, use_cache=not a.no_cache)
    settings = []
    flat = lambda lv: lv[:, 0]  # noqa: E731
    both = lambda lv: lv  # noqa: E731
    if not a.margin_only:
        for eps in (float(e) for e in a.eps.split(",")):
            for om in (float(o) for o in a.omegas.split(",")):
                settings.append((f"log-ratio Ω={om:g}, ε={eps:g}",
                                 lambda tr, om=om, eps=eps: HierarchicalLogRatioLoss(
                                     omega=om, eps=eps, distance=PoincareDistance(c=C)), both))
    if a.margin or a.margin_only:
        extra = eval(f"dict({a.margin_kwargs})")  # noqa: S307 (a command-line option of a bench script)
        tag = f", {a.margin_kwargs}" if a.margin_kwargs else ""

        def mk(tr, g, lg=None):
            kw = dict(extra)
            if g != "default":
                kw["gamma"] = float(g)
            if lg is not None and lg != "default":
                kw["level_gamma"] = float(lg)
            return HierarchicalMarginLoss(num_classes=int(tr.labels.max()) + 1, distance=PoincareDistance(c=C), **kw)

        for g in a.gammas.split(","):
            gname = "default γ" if g == "default" else f"γ={float(g):g}"
            settings.append((f"margin, 1-D labels ({gname}{tag})", lambda tr, g=g: mk(tr, g), flat))
            for lg in a.level_gammas.split(","):
                lname = "default δ" if lg == "default" else f"δ={float(lg):g}"
                settings.append((f"margin, (character, radical), {gname}, {lname}{tag}",
                                 lambda tr, g=g, lg=lg: mk(tr, g, lg), both))
    rows = run(cfg, bank, settings, seeds, a.steps)
    print(f"\nRecall@1 (%), mean over seeds {list(seeds)} (per seed in parentheses); diagnostics on 2,000 "
          "training-character clean views:\n")
    print(table(rows))
    print(f"\nTotal wall time {time.perf_counter() - t0:.0f} s; {qc.machine_line()}.")
    return rows


if __name__ == "__main__":
    main()
