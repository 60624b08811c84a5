#!/usr/bin/env python
"""The unsupervised and hierarchical-margin components at their default constructors, against the features they start from.

    python -m bench unsupervised_defaults --threads 1                       # glyphs, icons, iconify; validation, seeds 0-2
    python -m bench unsupervised_defaults --split test --seeds 0,1,2        # the test-class report
    python -m bench unsupervised_defaults --datasets icons --rows raw,unsup --loss-kwargs "one_sided=False"

The common protocol of the target "no method below its starting point": the frozen MobileNetV2 bank
of ``bench/_quality_common.py`` (any name of ``BANK_DATASETS``; pooled 1280-d features, the whole
backbone frozen), a ``HyperbolicEmbeddingHead(1280)`` with its defaults trained alone, plain AdamW at
``--lr`` (default 1e-3) for ``--steps`` (default 200) class-balanced batches of ``--batch`` (default
256 = 64 classes × 4), no gradient clipping. Rows:

* ``raw``: the pooled features themselves, cosine kNN (the starting point every row is paired with);
* ``head``: the untrained head (Poincaré kNN), a random 1280 → 128 projection;
* ``head_whiten``: the untrained head after ``pml_hyperbolic.heads.whitening_head_init`` at scale
  ``WHITEN_SCALE`` (100, the trust region chosen for these components; the head's linear layer set to
  the PCA whitening of the training features; no label used): the warm start of the ``*_whiten`` rows;
* ``unsup``: ``HierarchicalPseudoLabeler()`` (its defaults) clusters the head's embeddings of the clean
  training views at step 0 and every ``--recluster-every`` steps; ``HierarchicalLogRatioLoss()`` (its
  defaults, ``--loss-kwargs`` adds keyword arguments) trains on all K columns; no label is used;
* ``unsup_whiten``: ``unsup`` from the ``head_whiten`` warm start;
* ``hier_margin``: ``HierarchicalMarginLoss(num_classes=…)`` with its defaults on the real labels;
* ``hier_margin_whiten``: ``hier_margin`` from the ``head_whiten`` warm start.

``--split val`` (default): 32 training classes are carved out per seed (``carve_validation`` with the
run's seed; the query side of the carve as in the test protocol) and the heads train on the rest;
``--split test``: the heads train on every training class and are scored on the held-out test classes.
Every figure is paired with ``raw`` on the same carve / seed. ``at clip`` is the share of query
embeddings within 1e-3 of the largest d₀ the head can reach (a collapsed radius). Cost (1 thread):
~10-40 s per trained row and seed (the exact average linkage of ~4,000 points dominates ``unsup``); the
first call builds and caches the banks (~2-4 min per dataset).
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench import _quality_common as qc

ROWS = ("raw", "head", "head_whiten", "unsup", "unsup_whiten", "hier_margin", "hier_margin_whiten")
C = 0.1  # the head's and the losses' default curvature


def _head():
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead

    return HyperbolicEmbeddingHead(1280)


def _max_d0(head):
    geo = head.geometry
    return float(geo.max_dist0()) if geo.clip_r is not None else float("inf")


WHITEN_SCALE = 100.0  # the *_whiten rows' scale (docs/design/pseudo-labels.md chose it for these components)


def warm_start(head, features, scale=WHITEN_SCALE):
    """The head's linear layer set by ``whitening_head_init`` (no label used) at ``scale``."""
    from pml_hyperbolic.heads import whitening_head_init

    whitening_head_init(head.linear, features, scale=scale)
    return head


def train_row(row, train, cfg, seed, loss_kwargs, recluster_every, log=print, whiten_scale=WHITEN_SCALE,
              margin_kwargs=None):
    """One trained head (``unsup`` or ``hier_margin``) on ``train`` (a bank ``Split``); ``loss_kwargs`` go to
    ``HierarchicalLogRatioLoss``, ``margin_kwargs`` to ``HierarchicalMarginLoss``."""
    from pml_hyperbolic.losses import HierarchicalLogRatioLoss, HierarchicalMarginLoss
    from pml_hyperbolic.miners import HierarchicalPseudoLabeler

    torch.manual_seed(seed)
    np.random.seed(seed)
    head = _head()
    clean = train.acts[:, 0]
    if row.endswith("_whiten"):
        warm_start(head, clean, whiten_scale)
    if row in ("unsup", "unsup_whiten"):
        loss = HierarchicalLogRatioLoss(**loss_kwargs)
        labeler = HierarchicalPseudoLabeler(seed=seed)

        def relabel(tail, h):
            levels = labeler.fit_predict(qc.embed(tail, h, clean))
            return levels[:, 0], levels
    elif row in ("hier_margin", "hier_margin_whiten"):
        loss = HierarchicalMarginLoss(num_classes=int(train.labels.max()) + 1, **(margin_kwargs or {}))
        relabel = None
    else:
        raise ValueError(f"row must be one of {ROWS[3:]}, got {row!r}")
    cfg = qc.BenchConfig(**{**qc.config_dict(cfg), "seeds": tuple(cfg.seeds), "recluster_every": recluster_every})
    qc.train_with_labels(cfg, train, torch.nn.Identity(), head, loss, seed=seed, relabel=relabel)
    return head


def score(head, query, gallery):
    """Metrics of ``head`` (None: the raw features, cosine) and the share of queries at the clip."""
    if head is None:
        q, g = query.acts, None if gallery is None else gallery.acts
        c, at_clip = None, float("nan")
    else:
        q = qc.embed(torch.nn.Identity(), head, query.acts)
        g = None if gallery is None else qc.embed(torch.nn.Identity(), head, gallery.acts)
        from pml_hyperbolic import poincare_ball as pb

        d0 = pb.dist0(q.double(), C)
        at_clip = float((d0 >= _max_d0(head) - 1e-3).double().mean())
        c = C
    m = qc.retrieval_metrics(q, query.labels, g, None if gallery is None else gallery.labels, c=c)
    m["at_clip"] = at_clip
    return m


def run_dataset(name, cfg, rows, seeds, split, loss_kwargs, recluster_every, use_cache=True, log=print,
                whiten_scale=WHITEN_SCALE, margin_kwargs=None):
    bank = qc.pooled_bank(qc.build_bank(cfg, name, use_cache=use_cache, log=log), cfg, use_cache=use_cache)
    out = []
    for seed in seeds:
        if split == "val":
            train, query, gallery = qc.carve_validation(bank, seed=seed)
            from bench._quality_common import Split

            train = Split(train.acts, train.labels, train.super_labels, None)
        else:
            train, query, gallery = bank.train, bank.query, bank.gallery
        for row in rows:
            t0 = time.perf_counter()
            if row == "raw":
                m = score(None, query, gallery)
            elif row in ("head", "head_whiten"):
                torch.manual_seed(seed)
                h = _head() if row == "head" else warm_start(_head(), train.acts[:, 0], whiten_scale)
                m = score(h, query, gallery)
            else:
                m = score(train_row(row, train, cfg, seed, loss_kwargs, recluster_every, log, whiten_scale,
                                    margin_kwargs), query, gallery)
            m.update(dataset=name, split=split, row=row, seed=seed, seconds=time.perf_counter() - t0)
            log(f"{name} {split} seed {seed} {row:12s} R@1 {100 * m['recall_at_1']:.1f}  R@2 "
                f"{100 * m['recall_at_2']:.1f}  R@4 {100 * m['recall_at_4']:.1f}  R@8 {100 * m['recall_at_8']:.1f}  "
                f"at clip {100 * m['at_clip']:.0f}%  ({m['seconds']:.0f} s)")
            out.append(m)
    return out


def table(results):
    """Markdown: per dataset and row, mean R@1/R@8 and the paired difference against ``raw``."""
    lines = ["| domain | row | R@1 | Δ R@1 vs raw (min over seeds) | R@8 | Δ R@8 vs raw | at clip |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name in dict.fromkeys(r["dataset"] for r in results):
        raw = {r["seed"]: r for r in results if r["dataset"] == name and r["row"] == "raw"}
        for row in dict.fromkeys(r["row"] for r in results if r["dataset"] == name):
            rs = [r for r in results if r["dataset"] == name and r["row"] == row]

            def cell(key):
                v = 100 * np.array([r[key] for r in rs])
                return f"{v.mean():.1f} ± {v.std(ddof=1) if len(v) > 1 else 0:.1f}"

            def delta(key):
                if not raw or row == "raw":
                    return "—"
                d = 100 * np.array([r[key] - raw[r["seed"]][key] for r in rs if r["seed"] in raw])
                return f"{d.mean():+.1f} ({d.min():+.1f})"

            clip = [r["at_clip"] for r in rs if r["at_clip"] == r["at_clip"]]
            lines.append(f"| {name} | {row} | {cell('recall_at_1')} | {delta('recall_at_1')} | "
                         f"{cell('recall_at_8')} | {delta('recall_at_8')} | "
                         f"{f'{100 * np.mean(clip):.0f}%' if clip else '—'} |")
    return "\n".join(lines)


def keyword_literals(text: str) -> dict:
    """``"a=1, b='x'"`` → ``{"a": 1, "b": "x"}``: keyword arguments whose values are Python literals (no code runs)."""
    import ast

    if not text.strip():
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if call.args:
            raise ValueError("positional argument")
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (SyntaxError, ValueError) as err:
        raise SystemExit(f"error: keyword arguments must read name=literal, ... ({err}): {text!r}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="glyphs,icons,iconify", help=f"comma-separated, from {qc.BANK_DATASETS}")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, from {ROWS}")
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--recluster-every", type=int, default=50)
    p.add_argument("--loss-kwargs", default="",
                   help="extra HierarchicalLogRatioLoss keyword arguments, Python syntax, e.g. \"omega=2.0\"")
    p.add_argument("--margin-kwargs", default="",
                   help="extra HierarchicalMarginLoss keyword arguments, Python literals, e.g. \"gamma=0.2\"")
    p.add_argument("--whiten-scale", type=float, default=WHITEN_SCALE,
                   help=f"scale of whitening_head_init for the *_whiten rows (default: {WHITEN_SCALE:g})")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache", action="store_true")
    a = p.parse_args(argv)
    for name in a.datasets.split(","):
        if name not in qc.BANK_DATASETS:
            p.error(f"--datasets: {name!r} is not one of {qc.BANK_DATASETS}")
    if not (0 < a.whiten_scale < float("inf")):
        p.error(f"--whiten-scale must be a finite number > 0, got {a.whiten_scale}")
    for row in a.rows.split(","):
        if row not in ROWS:
            p.error(f"--rows: {row!r} is not one of {ROWS}")
    return a


def main(argv=None):
    a = parse_args(argv)
    seeds = tuple(int(s) for s in a.seeds.split(","))
    loss_kwargs, margin_kwargs = keyword_literals(a.loss_kwargs), keyword_literals(a.margin_kwargs)
    cfg = qc.BenchConfig(trainable="head", threads=a.threads, steps=a.steps, seeds=seeds, lr_head=a.lr,
                         batch_size=a.batch, samples_per_class=4, grad_clip=0.0)
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print(f"# bench/unsupervised_defaults.py: {cfg.describe()}; split {a.split}; re-clustering every "
          f"{a.recluster_every} steps; log-ratio kwargs {loss_kwargs or 'none (defaults)'}; margin kwargs "
          f"{margin_kwargs or 'none (defaults)'}; whitening scale "
          f"{a.whiten_scale:g}")
    print(f"machine: {qc.machine_line()}")
    results = []
    for name in a.datasets.split(","):
        results += run_dataset(name, cfg, a.rows.split(","), seeds, a.split, loss_kwargs, a.recluster_every,
                               use_cache=not a.no_cache, whiten_scale=a.whiten_scale, margin_kwargs=margin_kwargs)
    print("\nR@1 / R@8 (%), mean ± sd over seeds; Δ = paired difference against raw, mean (worst seed):\n")
    print(table(results))
    print(f"\nTotal wall time {time.perf_counter() - t0:.0f} s; {qc.machine_line()}.")
    return results


if __name__ == "__main__":
    main()
