#!/usr/bin/env python
"""Choose a method's settings on a validation split of the training classes, in ``bench/quality.py``'s
protocol (same bank, budget and recipes), never on its test classes.

Each variant is a ``bench/quality.py`` row plus extra recipe flags. Every variant trains on the
training characters minus 32 validation characters (``--val-classes``; ``_quality_common.carve_validation``,
carve seed 0, or several carves with ``--carve-seeds``, each run with every seed, and then the paired
R@1 difference to the first variant with its standard error; display-font queries against serif/sans
gallery, like the test protocol) and is scored on them:
validation R@1, R@2, R@4, R@8 and parent R@1 (the top-1 shares the query's radical), per run and as mean ± std,
and for a hyperbolic head the failure AUROC of the uncertainty −d₀, the median d₀ and the share of
queries at the clip radius (``bench/radius.py``'s columns).
``--report-test`` then runs the variants once more on the real split (the 160 held-out characters)
so that a choice made on validation can be checked, not made, there.

    python -m bench row_validation --variants "ms;hier_ms;hier_ms:--hier-weight 0.1;hier_ms:--hier-weight 1"
    python -m bench row_validation --variants "ms;hier_ms:--hier-weight 0.1" --seeds 0,1,2,3,4 --report-test
    python -m bench row_validation --variants "ms;hier_ms" --carve-seeds 0,1,2   # three carves, paired difference
    python -m bench row_validation --variants "ms;hms" --trainable head --steps 600   # the held-out benchmark's shape
    python -m bench row_validation --protocol heldout --datasets icons,glyphs --val-classes 48 --seeds 0 \
        --variants "hms;hms:--ms-scale 2.3;hms:--radial-calibration 0.1"   # a default chosen across domains

``--datasets`` runs every variant on each development domain's own validation carve (the carve's
queries are the domain's query side: display fonts for the glyphs, the query themes for the icons)
and then prints a table across domains: each variant's paired validation R@1 difference to the first
variant per domain, its mean over the domains and its worst domain (a default must be best on
average and not worse on any), and the largest share of queries at the clip radius.
``--protocol heldout`` trains in ``bench/quality.py``'s default protocol (frozen EfficientNet-Lite0
features, head only, batch 256 = 64 × 4, AdamW 1e-3, 600 steps).

A variant is ``row`` or ``row:flags`` (flags as on the recipe's command line); variants are separated
by ``;``. About 15-20 s per variant and seed on 2 cores (one thread) in the tail protocol; 60-100 s in the
held-out protocol (600 steps of batch 256) on a loaded machine.
"""
from __future__ import annotations

import argparse
import os
import shlex
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402
from bench import quality  # noqa: E402
from bench.hcl_validation import validation_bank  # noqa: E402


def parse_variants(text: str) -> list[tuple[str, quality.Row]]:
    """``"ms;hier_ms:--hier-weight 0.1"`` -> [(name, Row with the extra flags)]; one clear error for an
    unknown row or an empty list."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        key, _, flags = item.partition(":")
        key = key.strip()
        if key not in quality.ROWS:
            raise ValueError(f"unknown row {key!r} in --variants (rows: {', '.join(quality.ROWS)})")
        base = quality.ROWS[key]
        if base.kind == "hcl":
            raise ValueError("hcl needs its scene bank: use bench/hcl_validation.py")
        row = quality.Row(base.key, base.label, base.recipe, base.argv + shlex.split(flags), kind=base.kind)
        out.append((item, row))
    if not out:
        raise ValueError("--variants is empty")
    return out


def parent_labels(bank, split_labels: torch.Tensor) -> torch.Tensor:
    """Radical of each validation sample: the training split's class -> parent map."""
    from pml_hyperbolic.losses import class_parents

    return class_parents(bank.train.labels, bank.train.super_labels)[split_labels.cpu()]


COLUMNS = (("R@1", "recall_at_1", 100, 1), ("R@2", "recall_at_2", 100, 1), ("R@4", "recall_at_4", 100, 1),
           ("R@8", "recall_at_8", 100, 1), ("parent R@1", "parent_r1", 100, 1), ("Spearman", "spearman", 1, 3),
           ("AUROC fail", "auroc_fail", 1, 3),
           ("d₀ median", "d0_med", 1, 2), ("% at clip", "at_clip", 100, 1))


def score(row, cfg, bank, seed, parents) -> dict:
    metrics, _ = quality.run_row(row, cfg, bank, seed, parents=parents)
    return {key: metrics.get(key, float("nan")) for _, key, _, _ in COLUMNS}


def cell(values, scale=100, digits=1) -> str:
    values = scale * np.asarray(values, float)
    if np.isnan(values).all():
        return "—"
    return f"{values.mean():.{digits}f} ± {values.std():.{digits}f}" if len(values) > 1 else f"{values[0]:.{digits}f}"


def cells(runs) -> str:
    return " | ".join(cell([r[key] for r in runs], scale, digits) for _, key, scale, digits in COLUMNS)


def across_domains(runs, names, domains) -> list[dict]:
    """Per variant: its paired validation R@1 difference to the first variant on every domain (same
    carves and seeds), their mean over the domains and the worst domain's, and the largest clip share.
    ``runs[(variant, domain)]`` is the list of score dicts of one variant on one domain."""
    out = []
    for name in names:
        item = {"variant": name}
        diffs = []
        for domain in domains:
            r1 = 100 * np.array([v["recall_at_1"] for v in runs[(name, domain)]])
            first = 100 * np.array([v["recall_at_1"] for v in runs[(names[0], domain)]])
            diff = float((r1 - first).mean())
            diffs.append(diff)
            item[f"{domain} val R@1"] = round(float(r1.mean()), 2)
            item[f"{domain} Δ"] = round(diff, 2)
            parent = np.array([v["parent_r1"] for v in runs[(name, domain)]], float)
            if not np.isnan(parent).all():
                item[f"{domain} parent R@1"] = round(100 * float(np.nanmean(parent)), 2)
        clip = np.array([v["at_clip"] for d in domains for v in runs[(name, d)]], float)
        item["mean Δ"] = round(float(np.mean(diffs)), 2)
        item["worst Δ"] = round(float(np.min(diffs)), 2)
        item["max % at clip"] = None if np.isnan(clip).all() else round(100 * float(np.nanmax(clip)), 1)
        out.append(item)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", required=True, help="row[:recipe flags];... (see above)")
    p.add_argument("--datasets", default="glyphs",
                   help=f"comma-separated development domains, of {', '.join(qc.BANK_DATASETS)} (each with its own "
                        "validation carve of its training classes); with several, a table across domains follows")
    p.add_argument("--protocol", choices=quality.PROTOCOLS, default="tail",
                   help="tail (default): BenchConfig's budget; heldout: bench/quality.py's default protocol (frozen "
                        "tf_efficientnet_lite0, head only, batch 256 = 64 x 4, AdamW 1e-3, 600 steps). "
                        "--trainable / --steps / --backbone override it")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-test", action="store_true", help="also run every variant on the test split")
    p.add_argument("--carve-seeds", default="0",
                   help="validation carves (which classes are held out), e.g. 0,1,2: every variant runs on each "
                        "carve with every seed, and the table adds its paired R@1 difference to the first variant")
    p.add_argument("--val-classes", type=int, default=32, help="validation classes per carve")
    p.add_argument("--trainable", choices=("tail", "head"), default=None,
                   help="'head': only the embedding head trains on frozen pooled features (the protocol of "
                        "the held-out benchmark; give it --steps 600 as bench/radius.py does)")
    p.add_argument("--steps", type=int, default=None, help=f"training steps (default {qc.BenchConfig.steps})")
    p.add_argument("--backbone", default=None, help="mobilenetv2_100 (default) or tf_efficientnet_lite0")
    a = p.parse_args(argv)
    try:
        variants = parse_variants(a.variants)
        seeds = [int(s) for s in a.seeds.split(",")]
        carves = [int(s) for s in a.carve_seeds.split(",")]
    except ValueError as err:
        p.error(str(err))
    domains = [d.strip() for d in a.datasets.split(",") if d.strip()]
    unknown = [d for d in domains if d not in qc.BANK_DATASETS]
    if unknown or not domains:
        p.error(f"--datasets must name some of {', '.join(qc.BANK_DATASETS)}, got {a.datasets!r}")
    qc.set_threads(a.threads)
    if a.steps is not None and a.steps < 1:
        p.error(f"--steps must be >= 1, got {a.steps}")
    cfg = qc.BenchConfig()
    if a.protocol == "heldout":
        for attr, value in quality.HELDOUT_PROTOCOL.items():
            setattr(cfg, attr, value)
    cfg.seeds = tuple(seeds)
    for attr in ("trainable", "steps", "backbone"):
        if getattr(a, attr) is not None:
            setattr(cfg, attr, getattr(a, attr))
    t0 = time.perf_counter()
    print(f"# {qc.machine_line()}\n# {cfg.describe()}\n# validation: {a.val_classes} of the training classes "
          f"of each domain, carve seeds {carves}; seeds {seeds}")
    runs, records = {}, []
    for domain in domains:
        bank = qc.build_bank(cfg, domain)
        if cfg.trainable == "head":
            bank = qc.pooled_bank(bank, cfg)  # as bench/quality.py --trainable head
        n_train = len(np.unique(bank.train.labels.numpy()))
        if not 2 <= a.val_classes <= n_train // 2:
            p.error(f"--val-classes must be in [2, {n_train // 2}] (half of the {n_train} training classes of "
                    f"{domain} at most), got {a.val_classes}")
        splits = []
        for carve in carves:
            val_bank, _ = validation_bank(bank, a.val_classes, carve)
            has_parents = bank.train.super_labels is not None and val_bank.gallery is not None
            splits.append((val_bank, (parent_labels(bank, val_bank.query.labels),
                                      parent_labels(bank, val_bank.gallery.labels)) if has_parents else None))
        test_parents = quality.dataset_parents(bank) if a.report_test else None
        paired = len(carves) * len(seeds) > 1
        header = (f"\n**{domain}**\n\n| variant | " + " | ".join(f"val {name}" for name, _, _, _ in COLUMNS)
                  + (" | val R@1 − first variant (paired, ± s.e.)" if paired else "") + " | per run (val R@1) |"
                  + ("".join(f" test {name} |" for name, _, _, _ in COLUMNS) if a.report_test else ""))
        print(header + "\n|" + "---|" * (header.split("\n")[-1].count("|") - 1), flush=True)
        first = None
        for name, row in variants:
            val = [score(row, cfg, val_bank, s, parents) for val_bank, parents in splits for s in seeds]
            runs[(name, domain)] = val
            r1 = 100 * np.array([v["recall_at_1"] for v in val])
            first = r1 if first is None else first
            line = f"| {name} | {cells(val)} | "
            if paired:
                line += f"{quality.paired_cell(r1, first)} | "
            line += " ".join(f"{v:.1f}" for v in r1) + " |"
            record = {"dataset": domain, "variant": name, "val R@1": round(float(r1.mean()), 2),
                      **{f"val R@{k}": round(100 * float(np.mean([v[f"recall_at_{k}"] for v in val])), 2)
                         for k in (2, 4, 8)},
                      "val R@1 − first": round(float((r1 - first).mean()), 2), "per_run_val_r1": r1.round(2).tolist()}
            if a.report_test:
                test = [score(row, cfg, bank, s, test_parents) for s in seeds]
                line += f" {cells(test)} |"
                record["test R@1"] = round(100 * float(np.mean([t["recall_at_1"] for t in test])), 2)
            records.append(record)
            print(line, flush=True)
    if len(domains) > 1:
        summary = across_domains(runs, [name for name, _ in variants], domains)
        cols = ["mean Δ", "worst Δ"] + [f"{d} {k}" for d in domains for k in ("val R@1", "Δ")] + ["max % at clip"]
        print("\n**across domains** (Δ: paired validation R@1 difference to the first variant)\n\n| variant | "
              + " | ".join(cols) + " |\n|---|" + "---:|" * len(cols))
        for item in summary:
            print(f"| {item['variant']} | " + " | ".join("—" if item.get(c) is None else f"{item[c]:g}" for c in cols)
                  + " |", flush=True)
        records += [{"dataset": "across domains", **item} for item in summary]
    print(f"# {time.perf_counter() - t0:.0f} s wall, load average {os.getloadavg()[0]:.2f}")
    return records


if __name__ == "__main__":
    main()
