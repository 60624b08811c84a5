#!/usr/bin/env python
"""Pseudo-labels of the unsupervised hyperbolic method (Yan et al., CVPR'21) chosen on a validation split.

    OMP_NUM_THREADS=1 python -m bench unsupervised_pseudo_labels                  # full grid, seeds 0-4 (~6 min)
    OMP_NUM_THREADS=1 python -m bench unsupervised_pseudo_labels --seeds 0 --settings paper,default   # ~30 s
    OMP_NUM_THREADS=1 python -m bench unsupervised_pseudo_labels --protocol recipe --seeds 0,1,2 \
        --settings r_previous_default,r_default             # the recipe as bench/quality.py trains it (~1.5 min)

Protocol (``--protocol head``, the default): as ``bench/log_ratio_omega.py`` — bundled glyphs
(hard protocol), frozen MobileNetV2 bank of ``bench/_quality_common.py``, only the 128-d ``HyperbolicEmbeddingHead`` (c = 0.1) trains on the
pooled 1280-d features, ``HierarchicalLogRatioLoss`` with its default Ω, 120 steps (the
``bench/quality.py`` budget), pseudo-labels refreshed every 60 steps (``recluster_every``) by
:class:`pml_hyperbolic.training.pseudo_labels.UnsupervisedPseudoLabels` from the clean view of every
training image. **No label is used for training.** 32 of the 160 training characters are carved
out as validation (``carve_validation``, seed 0); the heads train on the other 128 characters'
images (3,712). A setting is chosen on validation R@1 only; test R@1 (160 held-out characters) is
printed only for the baselines, the paper's setting, the previous default and the chosen setting.

**``--protocol recipe``**: each
setting is a list of flags of ``recipes/unsupervised_hyperbolic.py`` (``RECIPE_SETTINGS``), trained
through the recipe exactly as ``bench/quality.py``'s ``unsup_logratio`` row (``_recipe_rows``: last
block + conv_head + head trainable, lr 3e-4 / 3e-3, 120 steps, one labelling) on the same 128 / 32
split; val R@1 is printed before training (``--eval-before``: the head as initialised) and after.
``--report-test SETTINGS`` trains on all 160 training characters and prints test R@1 before / after
(a report, never a choice). The tables of the recorded runs, their commands and the choices made from them:
docs/design/pseudo-labels.md.

Pseudo-label diagnostics per setting (first labelling, against the true characters of the
training images, used only for this report): clusters per level, largest cluster's share, pair
precision (fraction of same-finest-cluster pairs that share a character; chance 0.8 %) and NMI.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402

C = 0.1
R1 = ("recall_at_1",)
PAPER_LEVELS = (100, 70, 40, 10)

# name -> UnsupervisedPseudoLabels kwargs
SETTINGS = {
    # "paper" = UnsupervisedPseudoLabels.paper()
    "paper": dict(levels=PAPER_LEVELS, linkage="average", source="features_then_embeddings", whiten=None),
    "previous": dict(levels=PAPER_LEVELS, linkage="average", source="embeddings", min_cluster_size=1,
                     whiten=None),
    "ward_paper_levels": dict(levels=PAPER_LEVELS, linkage="ward", source="features", whiten=None),
    "ward_paper_levels_recl": dict(levels=PAPER_LEVELS, linkage="ward", source="features_then_embeddings",
                                   whiten=None),
    "ward_128_32": dict(levels=(128, 32), linkage="ward", source="features", whiten=None),
    "ward_32": dict(levels=(32,), linkage="ward", source="features", whiten=None),
    "ward_32_recl": dict(levels=(32,), linkage="ward", source="features_then_embeddings", whiten=None),
    "ward_128": dict(levels=(128,), linkage="ward", source="features", whiten=None),
    "ward_128_recl": dict(levels=(128,), linkage="ward", source="features_then_embeddings", whiten=None),
    "white128_32": dict(levels=(32,), linkage="ward", source="features", whiten=128),
    "white128_32_recl": dict(levels=(32,), linkage="ward", source="features_then_embeddings", whiten=128),
    "white128_128": dict(levels=(128,), linkage="ward", source="features", whiten=128),
    "white128_128_recl": dict(levels=(128,), linkage="ward", source="features_then_embeddings", whiten=128),
    "white128_64": dict(levels=(64,), linkage="ward", source="features", whiten=128),
    "white256_128": dict(levels=(128,), linkage="ward", source="features", whiten=256),
    "white256_256": dict(levels=(256,), linkage="ward", source="features", whiten=256),
    "white256_512": dict(levels=(512,), linkage="ward", source="features", whiten=256),
    "default": dict(),
}
ALWAYS_TEST = ("paper", "previous", "default")

# --protocol recipe: name -> flags of recipes/unsupervised_hyperbolic.py on top of bench/quality.py's budget
W = ["--head-init", "whiten", "--head-init-scale"]
RECIPE_SETTINGS = {
    "r_default": [],                                                       # the recipe's defaults
    "r_previous_default": ["--head-init", "random", "--levels", "128"],    # defaults before the warm start
    "r_paper": ["--paper-pseudo-labels", "--omega", "10", "--head-init", "random"],
    "r_random_512": ["--head-init", "random", "--levels", "512"],
    "r_whiten_s1": W + ["1", "--levels", "128"],
    "r_whiten_s3": W + ["3", "--levels", "128"],
    "r_whiten_s10": W + ["10", "--levels", "128"],
    "r_whiten_s30": W + ["30", "--levels", "128"],
    "r_whiten_s10_256": W + ["10", "--levels", "256"],
    "r_whiten_s10_512_128": W + ["10", "--levels", "512", "128"],
    "r_whiten_s10_512_omega1.1": W + ["10", "--levels", "512", "--omega", "1.1"],
    "r_whiten_s10_512_omega1.4": W + ["10", "--levels", "512", "--omega", "1.4"],
    "r_whiten_s1_512": W + ["1", "--levels", "512"],
    "r_whiten_s3_512": W + ["3", "--levels", "512"],
    "r_whiten_s10_512": W + ["10", "--levels", "512"],
    "r_whiten_s30_512": W + ["30", "--levels", "512"],
    "r_whiten_s10_1024": W + ["10", "--levels", "1024"],
}


def label_stats(levels, y):
    from sklearn.metrics import normalized_mutual_info_score

    fine = levels[:, 0].numpy()
    same = tot = 0
    for c in np.unique(fine):
        m = fine == c
        n = int(m.sum())
        tot += n * (n - 1)
        same += int(sum(v * (v - 1) for v in np.bincount(y[m])))
    sizes = [int(levels[:, k].max()) + 1 for k in range(levels.shape[1])]
    return {"sizes": sizes, "largest": float(np.bincount(fine).max() / len(fine)),
            "pair_precision": same / max(tot, 1), "nmi": float(normalized_mutual_info_score(y, fine))}


def run(cfg, bank, names, seeds, log=print):
    from pml_hyperbolic.distances import PoincareDistance
    from pml_hyperbolic.heads import HyperbolicEmbeddingHead
    from pml_hyperbolic.losses import HierarchicalLogRatioLoss
    from pml_hyperbolic.training.pseudo_labels import UnsupervisedPseudoLabels

    train, val_q, val_g = qc.carve_validation(bank, num_val_classes=32, seed=0)
    y = train.labels.numpy()
    rows = []
    v = qc.evaluate(bank.tail, None, val_q, val_g, c=None, keys=R1)["recall_at_1"]
    t = qc.evaluate(bank.tail, None, bank.query, bank.gallery, c=None, keys=R1)["recall_at_1"]
    rows.append({"name": "pooled 1280-d features, cosine (no training)", "val": [v], "test": [t]})
    log(f"  {rows[-1]['name']}: val {100 * v:.1f} test {100 * t:.1f}")
    vals, tests = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        head = HyperbolicEmbeddingHead(bank.feature_dim, cfg.embedding_dim, c=C)
        vals.append(qc.evaluate(bank.tail, head, val_q, val_g, c=C, keys=R1)["recall_at_1"])
        tests.append(qc.evaluate(bank.tail, head, bank.query, bank.gallery, c=C, keys=R1)["recall_at_1"])
    rows.append({"name": "untrained HyperbolicEmbeddingHead (c=0.1)", "val": vals, "test": tests})
    log(f"  {rows[-1]['name']}: val {100 * np.mean(vals):.1f} test {100 * np.mean(tests):.1f}")
    for name in names:
        t0 = time.perf_counter()
        vals, heads, stats = [], [], None
        for seed in seeds:
            torch.manual_seed(seed)
            tail = qc.fresh_tail(bank)
            head = HyperbolicEmbeddingHead(bank.feature_dim, cfg.embedding_dim, c=C)
            policy = UnsupervisedPseudoLabels(c=C, seed=seed, **SETTINGS[name])
            relabel = qc.pseudo_label_relabel(train, policy)
            if stats is None:  # diagnostics of the first labelling (true labels: report only)
                stats = label_stats(qc.pseudo_label_relabel(train, UnsupervisedPseudoLabels(c=C, seed=seed, **SETTINGS[name]))(
                    tail, head)[1], y)
            loss = HierarchicalLogRatioLoss(distance=PoincareDistance(c=C))
            qc.train_with_labels(cfg, train, tail, head, loss, seed=seed, relabel=relabel)
            vals.append(qc.evaluate(tail, head, val_q, val_g, c=C, keys=R1)["recall_at_1"])
            heads.append((tail, head))
        rows.append({"name": name, "kwargs": SETTINGS[name], "val": vals, "test": None, "stats": stats,
                     "heads": heads})
        log(f"  {name}: val {100 * np.mean(vals):.1f} ({', '.join(f'{100 * x:.1f}' for x in vals)}) "
            f"levels {stats['sizes']} largest {100 * stats['largest']:.0f}% pair precision "
            f"{100 * stats['pair_precision']:.1f}% NMI {stats['nmi']:.3f} ({time.perf_counter() - t0:.0f} s)")
    trained = [r for r in rows if "heads" in r]
    best = max(trained, key=lambda r: np.mean(r["val"])) if trained else None
    for r in trained:
        r["chosen"] = r is best
        if r is best or r["name"] in ALWAYS_TEST:
            r["test"] = [qc.evaluate(t, h, bank.query, bank.gallery, c=C, keys=R1)["recall_at_1"]
                         for t, h in r["heads"]]
        del r["heads"]
    return rows


def validation_bank(bank, num_val_classes=32, seed=0):
    """``bank`` with its training characters split (``carve_validation``): train on 128, query /
    gallery = the 32 validation characters under the hard protocol (test characters untouched)."""
    train, val_q, val_g = qc.carve_validation(bank, num_val_classes=num_val_classes, seed=seed)
    return qc.Bank(dataset=bank.dataset, train=train, query=val_q, gallery=val_g, tail=bank.tail,
                   feature_dim=bank.feature_dim, note=f"validation: {num_val_classes} training characters carved out")


def run_recipe(cfg, bank, names, seeds, log=print, split="val"):
    """--protocol recipe: every setting trains through ``recipes/unsupervised_hyperbolic.py`` exactly
    as ``bench/quality.py``'s ``unsup_logratio`` row does (``_recipe_rows``; trainable tail unless
    ``--trainable head``), on the 128 training characters; val R@1 before training (``--eval-before``:
    the head as initialised, warm start included) and after. ``split="test"`` (``--report-test``, a
    report, never a choice): trains on all 160 training characters, R@1 on the 160 test characters,
    as ``bench/quality.py``."""
    import contextlib
    import io
    import shutil

    from bench import _recipe_rows as rr

    cls = rr.load_recipe_class("unsupervised_hyperbolic", "UnsupervisedHyperbolic")
    vbank = validation_bank(bank) if split == "val" else bank
    raw = qc.evaluate(vbank.tail, None, vbank.query, vbank.gallery, c=None, keys=R1)["recall_at_1"]
    rows = [{"name": "pretrained features, cosine (no training)", "val": [raw], "before": None}]
    log(f"  {rows[-1]['name']}: {split} {100 * raw:.1f}")
    for name in names:
        t0 = time.perf_counter()
        vals, befores = [], []
        for seed in seeds:
            torch.manual_seed(seed)
            np.random.seed(seed)
            recipe = rr.recipe_on_bank(cls, vbank, cfg, seed, RECIPE_SETTINGS[name] + ["--eval-before", "true"])
            out = io.StringIO()
            try:
                with contextlib.redirect_stdout(out):
                    results = recipe.run()
            except BaseException:
                print(out.getvalue())
                raise
            finally:
                shutil.rmtree(recipe.args.output_dir, ignore_errors=True)
            q, ql, g, gl = recipe.evaluator.last_embeddings[:4]
            vals.append(qc.retrieval_metrics(q, ql, g, gl, c=recipe.eval_curvature(), keys=R1)["recall_at_1"])
            befores.append(float(results["before"]["recall_at_1"]))
        rows.append({"name": name, "flags": RECIPE_SETTINGS[name], "val": vals, "before": befores})
        each = ", ".join(f"{100 * x:.1f}" for x in vals)
        log(f"  {name}: {split} {100 * np.mean(vals):.1f} ({each}); before training "
            f"{100 * np.mean(befores):.1f} ({time.perf_counter() - t0:.0f} s)")
    return rows


def per(xs):
    """Mean R@1 in %, with the per-seed values when there are several ("—" for None)."""
    if xs is None:
        return "—"
    each = f" ({', '.join(f'{100 * x:.1f}' for x in xs)})" if len(xs) > 1 else ""
    return f"{100 * np.mean(xs):.1f}{each}"


def recipe_table(rows, split="val"):
    lines = [f"| setting | recipe flags | {split} R@1 before training | {split} R@1 after |", "|---|---|---:|---:|"]
    for r in rows:
        flags = " ".join(r.get("flags", [])) or ("recipe defaults" if "flags" in r else "—")
        lines.append(f"| {r['name']} | {flags} | {per(r['before'])} | {per(r['val'])} |")
    return "\n".join(lines)


def table(rows):
    lines = ["| setting | pseudo-labels | levels (1st labelling) | largest | pair prec. | NMI | val R@1 | test R@1 |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = f"**{r['name']}** (best val)" if r.get("chosen") else r["name"]
        if "stats" in r:
            kw = ", ".join(f"{k}={v}" for k, v in r["kwargs"].items()) or "package defaults"
            s = r["stats"]
            lines.append(f"| {name} | {kw} | {s['sizes']} | {100 * s['largest']:.0f}% | "
                         f"{100 * s['pair_precision']:.1f}% | {s['nmi']:.3f} | {per(r['val'])} | {per(r['test'])} |")
        else:
            lines.append(f"| {name} | — | — | — | — | — | {per(r['val'])} | {per(r['test'])} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=("head", "recipe"), default="head",
                   help="head: the policy grid, head-only training loop of _quality_common (default); recipe: "
                        "recipes/unsupervised_hyperbolic.py as bench/quality.py runs it (RECIPE_SETTINGS)")
    p.add_argument("--settings", default=None,
                   help=f"comma-separated, of {list(SETTINGS)} (--protocol head, default all) or "
                        f"{list(RECIPE_SETTINGS)} (--protocol recipe, default all)")
    p.add_argument("--report-test", default=None, metavar="SETTINGS",
                   help="--protocol recipe: after the validation table, train these comma-separated settings on all "
                        "160 training characters and print test R@1 before / after training (a report: the choice "
                        "is made on validation)")
    p.add_argument("--trainable", choices=("tail", "head"), default="tail",
                   help="--protocol recipe: what trains (bench/quality.py's default: tail)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache", action="store_true")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    known = RECIPE_SETTINGS if a.protocol == "recipe" else SETTINGS
    names = [s for s in (",".join(known) if a.settings is None else a.settings).split(",") if s]
    test_names = [s for s in (a.report_test or "").split(",") if s]
    if test_names and a.protocol != "recipe":
        raise SystemExit("--report-test needs --protocol recipe")
    unknown = [s for s in names + test_names if s not in known]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; choose from {list(known)}")
    seeds = tuple(int(s) for s in a.seeds.split(","))
    if a.protocol == "recipe":
        cfg = qc.BenchConfig(trainable=a.trainable, threads=a.threads, steps=a.steps, seeds=seeds)
        qc.set_threads(cfg.threads)
        t0 = time.perf_counter()
        print(f"# bench/unsupervised_pseudo_labels.py --protocol recipe: {cfg.describe()}; "
              "recipes/unsupervised_hyperbolic.py as bench/quality.py's unsup_logratio row runs it; "
              "128 train / 32 validation characters; no label used for training")
        print(f"machine: {qc.machine_line()}")
        bank = qc.build_bank(cfg, "glyphs", use_cache=not a.no_cache)
        if cfg.trainable == "head":
            bank = qc.pooled_bank(bank, cfg, use_cache=not a.no_cache)
        rows = run_recipe(cfg, bank, names, seeds) if names else []
        if rows:
            print(f"\nValidation Recall@1 (%), mean over seeds {list(seeds)} (per seed in parentheses):\n")
            print(recipe_table(rows))
        if test_names:
            test_rows = run_recipe(cfg, bank, test_names, seeds, split="test")
            print(f"\nTest Recall@1 (%, 160 held-out characters; report only), mean over seeds {list(seeds)}:\n")
            print(recipe_table(test_rows, "test"))
            rows = rows + test_rows
        print(f"\nTotal wall time {time.perf_counter() - t0:.0f} s; {qc.machine_line()}.")
        return rows
    cfg = qc.BenchConfig(trainable="head", threads=a.threads, steps=a.steps, seeds=seeds)
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print(f"# bench/unsupervised_pseudo_labels.py: {cfg.describe()}; pseudo-labels refreshed every "
          f"{cfg.recluster_every} steps; 128 train / 32 validation characters; no label used for training")
    print(f"machine: {qc.machine_line()}")
    bank = qc.pooled_bank(qc.build_bank(cfg, "glyphs", use_cache=not a.no_cache), cfg, use_cache=not a.no_cache)
    rows = run(cfg, bank, names, seeds)
    print(f"\nRecall@1 (%), mean over seeds {list(seeds)} (per seed in parentheses); test only for the baselines, "
          f"{', '.join(ALWAYS_TEST)} and the best-validation setting:\n")
    print(table(rows))
    print(f"\nTotal wall time {time.perf_counter() - t0:.0f} s; {qc.machine_line()}.")
    return rows


if __name__ == "__main__":
    main()
