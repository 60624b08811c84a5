#!/usr/bin/env python
"""HCL on the bundled glyphs: choose its trunk learning rate, hyperbolic weight and object views on validation.

    python -m bench hcl_validation --threads 1                          # 3 × 3 grid, seed 0, then the best 2 on seeds 0,1,2
    python -m bench hcl_validation --lrs 3e-4 --weights 0.1 --seeds 0   # one setting
    python -m bench hcl_validation --lrs 3e-5 --weights 0.1 --views crop,font --carve-seeds 0,1,2,3 --seeds 0,1,2

The target "no method below its starting point": with the paper's setting, ``bench/quality.py``'s
``hcl`` row scored below the untrained features it starts from. This script picks the row's setting
without looking at the test characters. 32 of the 160 training characters are carved out as
**validation** (``_quality_common.carve_validation``; ``--carve-seeds`` picks which, several carves
repeat every run on each; display-font queries vs serif/sans gallery, the test protocol); HCL trains on
scenes composed from the other 128 characters only (same number of scenes as the bench,
``ComposedGlyphScenes`` seed 0), through exactly the ``hcl`` row of ``bench/quality.py`` (the recipe
``recipes/hcl.py`` on the activation bank, same budget, steps and queue) with the candidate's ``--lr``
(trunk: last block + conv_head), ``--hyperbolic-weight`` and ``--view-augmentation`` appended. Each run
is scored on validation like the recipe (cosine kNN of the trunk's representation) and against the
untrained features' validation R@1 on the same carve; the table gives the mean of those paired
differences with its standard error.

Stage 1: every (lr, weight, views) of the grid with the first seed(s) on every carve; stage 2: the
``--top`` best of stage 1 with every seed of ``--confirm-seeds``. The chosen setting has the largest
mean paired gain over its runs. Test classes are never loaded by this script's training or scoring
(only the bank that holds them is read from the cache).

Cost (1 thread): one run is ~35 CPU-s since the MoCo branch runs as the pairwise CE (225-280 CPU-s with
PML's NTXentLoss); the first call also builds the glyph bank (~2 min) and one scene bank per carve
and view augmentation (~20 s each). The glyph default (``pml_hyperbolic.training.presets``,
``HCL_GLYPH_*``) was chosen with four calls of 4 carves × 3 seeds (the figures are in ``docs/design/records.md``,
section "HCL validation").
"""
from __future__ import annotations

import argparse
import os
import resource
import shlex
import sys
import time

import numpy as np
import torch

from bench import _quality_common as qc  # noqa: E402
from bench import quality  # noqa: E402

from pml_hyperbolic.training.presets import (GLYPH_VIEW_AUGMENTATIONS, HCL_GLYPH_HYPERBOLIC_WEIGHT,  # noqa: E402
                                             HCL_GLYPH_TRUNK_LR, HCL_GLYPH_VIEW_AUGMENTATION,
                                             HCL_PAPER_HYPERBOLIC_WEIGHT as PAPER_WEIGHT)

TRUNK_LRS = (3e-4, 1e-4, 3e-5)
HYPERBOLIC_WEIGHTS = (0.1, 0.3, 1.0)


class GlyphClasses(torch.utils.data.Dataset):
    """The images of some classes of a glyph dataset (labels kept), for ``ComposedGlyphScenes``."""

    def __init__(self, glyphs, classes):
        labels = np.asarray(glyphs.labels)
        self.glyphs = glyphs
        self.index = np.flatnonzero(np.isin(labels, np.asarray(list(classes))))
        if len(self.index) == 0:
            raise ValueError(f"none of the classes {sorted(classes)[:5]}... is in the glyph dataset")
        self.labels = labels[self.index]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        return self.glyphs[int(self.index[i])]


def validation_bank(bank, num_val_classes=32, seed=0):
    """(bank whose train split is the training characters minus validation and whose query/gallery
    are the validation characters, the original labels of the remaining training characters)."""
    train, val_query, val_gallery = qc.carve_validation(bank, num_val_classes=num_val_classes, seed=seed)
    val_classes = set(val_query.labels.tolist()) | set(val_gallery.labels.tolist())
    train_classes = sorted(set(bank.train.labels.tolist()) - val_classes)
    val_bank = qc.Bank(dataset=bank.dataset, train=train, query=val_query, gallery=val_gallery, tail=bank.tail,
                       feature_dim=bank.feature_dim,
                       note=f"validation: {num_val_classes} of the training characters (carve seed {seed})")
    return val_bank, train_classes


def build_scene_bank(cfg, train_classes, tag, log=print, view_augmentation="crop"):
    """Prefix activations of ``cfg.hcl_scenes`` scenes composed from ``train_classes`` only (the
    validation characters never appear in a scene): ``quality.build_hcl_bank`` on those glyphs."""
    from pml_hyperbolic.data import GlyphDataset

    log(f"[bank] HCL validation: scenes of {len(train_classes)} training characters only, "
        f"{view_augmentation} views")
    glyphs = GlyphClasses(GlyphDataset("train"), train_classes)
    return quality.build_hcl_bank(cfg, cfg.hcl_scenes, log=log, glyphs=glyphs, tag=tag,
                                  view_augmentation=view_augmentation)


def hcl_row(lr, weight, views=HCL_GLYPH_VIEW_AUGMENTATION, extra=()):
    """``bench/quality.py``'s hcl row with the candidate's trunk lr, hyperbolic weight and view
    augmentation, then ``extra`` recipe flags (appended last, so they override the bench budget's
    ``--lr`` and the row's own)."""
    base = quality.ROWS["hcl"]
    label = f"HCL, trunk lr {lr:g}, hyperbolic weight {weight:g}, {views} views" + (f", {' '.join(extra)}" if extra else "")
    return quality.Row(base.key, label, base.recipe,
                       base.argv + ["--lr", f"{lr:g}", "--hyperbolic-weight", f"{weight:g}",
                                    "--view-augmentation", views] + list(extra), kind="hcl")


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def score(cfg, val_bank, scenes, lr, weight, views, seed, extra=()):
    """Validation R@1 of one HCL run (and its CPU seconds)."""
    t0 = cpu_seconds()
    metrics, _ = quality.run_row(hcl_row(lr, weight, views, extra), cfg, val_bank, seed, hcl_bank=scenes)
    return metrics["recall_at_1"], cpu_seconds() - t0


def sweep(cfg, bank, lrs=TRUNK_LRS, weights=HYPERBOLIC_WEIGHTS, seeds=(0,), confirm_seeds=(0, 1, 2), top=2,
          num_val_classes=32, log=print, views=(HCL_GLYPH_VIEW_AUGMENTATION,), carves=(0,), extra=()):
    """Stage 1 (grid, ``seeds``) then stage 2 (the ``top`` best, ``confirm_seeds``), each seed on every
    carve of ``carves``; returns a dict with the per-carve references, every run's validation R@1
    (keyed by (carve, seed)) and the chosen (lr, weight, views). A setting's score is its mean over its
    runs of (R@1 − the untrained features' R@1 on the same carve)."""
    splits = {}  # carve -> (validation bank, {views: scene bank}, reference R@1)
    for carve in carves:
        val_bank, train_classes = validation_bank(bank, num_val_classes, seed=carve)
        scene_banks = {}
        for kind in views:
            scenes = build_scene_bank(cfg, train_classes, f"val{num_val_classes}seed{carve}", log=log,
                                      view_augmentation=kind)
            if cfg.trainable == "head":
                _, tail, _ = qc.split_backbone(cfg.backbone)
                scenes = {k: qc._through(tail, v) for k, v in scenes.items()}
            scene_banks[kind] = scenes
        reference = qc.evaluate(bank.tail, None, val_bank.query, val_bank.gallery, c=None,
                                keys=("recall_at_1",))["recall_at_1"]
        log(f"  carve {carve}: untrained features (reference) val R@1 {100 * reference:.1f}")
        splits[carve] = (val_bank, scene_banks, reference)
    runs = {}  # (lr, weight, views) -> {(carve, seed): val R@1}
    cpu = {}

    def run(lr, weight, kind, seed):
        for carve in carves:
            if (carve, seed) in runs.setdefault((lr, weight, kind), {}):
                continue
            val_bank, scene_banks, _ = splits[carve]
            r1, seconds = score(cfg, val_bank, scene_banks[kind], lr, weight, kind, seed, extra)
            runs[(lr, weight, kind)][(carve, seed)] = r1
            cpu.setdefault((lr, weight, kind), []).append(seconds)
            log(f"  lr {lr:g} weight {weight:g} {kind} views carve {carve} seed {seed}: val R@1 {100 * r1:.1f} "
                f"({seconds:.0f} CPU-s, load avg {os.getloadavg()[0]:.1f})")

    def gain(key, only_seeds=None):
        return np.mean([r1 - splits[carve][2] for (carve, seed), r1 in runs[key].items()
                        if only_seeds is None or seed in only_seeds])

    for lr in lrs:
        for weight in weights:
            for kind in views:
                for seed in seeds:
                    run(lr, weight, kind, seed)
    ranked = sorted(runs, key=lambda k: -gain(k, seeds))
    finalists = ranked[:max(1, top)]
    for key in finalists:
        for seed in confirm_seeds:
            run(*key, seed)
    chosen = max(finalists, key=gain)
    references = {carve: split[2] for carve, split in splits.items()}
    return {"reference": float(np.mean(list(references.values()))), "references": references, "runs": runs,
            "cpu": cpu, "finalists": finalists, "chosen": chosen, "gain": {k: float(gain(k)) for k in runs},
            "beats_reference": bool(gain(chosen) >= 0), "extra": list(extra)}


def table(result):
    references = result["references"]

    def cell(values):
        m, s = qc.mean_std([100 * v for v in values])
        per = f" ({', '.join(f'{100 * v:.1f}' for v in values)})" if len(values) > 1 else ""
        return (f"{m:.1f} ± {s:.1f}" if len(values) > 1 else f"{m:.1f}") + per

    def gain_cell(key):
        diff = np.asarray([100 * (r1 - references[carve]) for (carve, _), r1 in sorted(result["runs"][key].items())])
        if diff.size < 2:
            return f"{diff.mean():+.1f}"
        return f"{diff.mean():+.1f} ± {diff.std(ddof=1) / np.sqrt(diff.size):.1f}"

    lines = ["| trunk lr | hyperbolic weight | views | val R@1 (runs) [carve:seed] | − features (paired, ± s.e.) "
             "| CPU-s/run | |", "|---:|---:|---|---|---|---:|---|"]
    per_carve = ", ".join(f"carve {c}: {100 * r:.1f}" for c, r in sorted(references.items()))
    lines.append(f"| untrained features | — | — | {100 * result['reference']:.1f} ({per_carve}) | 0 | — | reference |")
    order = sorted(result["runs"], key=lambda k: -result["gain"][k])
    for key in order:
        done = sorted(result["runs"][key])
        note = []
        if key == result["chosen"]:
            note.append("**chosen**")
        if key[1] == PAPER_WEIGHT and key[0] == qc.BenchConfig.lr_tail and key[2] == "crop" and not result.get("extra"):
            note.append("paper weight, bench lr, crop views (old default)")
        if key == (HCL_GLYPH_TRUNK_LR, HCL_GLYPH_HYPERBOLIC_WEIGHT, HCL_GLYPH_VIEW_AUGMENTATION) and not result.get("extra"):
            note.append("recipes/hcl.py glyph default")
        lines.append(f"| {key[0]:g} | {key[1]:g} | {key[2]} | {cell([result['runs'][key][r] for r in done])} "
                     f"[{','.join(f'{c}:{s}' for c, s in done)}] | {gain_cell(key)} | "
                     f"{np.mean(result['cpu'][key]):.0f} | {'; '.join(note)} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in TRUNK_LRS), help="trunk (tail) learning rates")
    p.add_argument("--weights", default=",".join(f"{x:g}" for x in HYPERBOLIC_WEIGHTS), help="hyperbolic weights")
    p.add_argument("--views", default=HCL_GLYPH_VIEW_AUGMENTATION,
                   help=f"object-view augmentations to compare, comma-separated (of {', '.join(GLYPH_VIEW_AUGMENTATIONS)})")
    p.add_argument("--carve-seeds", default="0",
                   help="validation carves (which training characters are held out), e.g. 0,1,2,3: every run "
                        "repeats on each carve, scored against the untrained features on the same carve")
    p.add_argument("--val-classes", type=int, default=32,
                   help="validation characters per carve (of the 160 training characters; HCL trains on the rest)")
    p.add_argument("--recipe-flags", default="",
                   help="more recipes/hcl.py flags for every run, e.g. \"--temperature 0.5\" (not for --lr, "
                        "--hyperbolic-weight or --view-augmentation: those are the grid)")
    p.add_argument("--seeds", default="0", help="stage 1 seeds (every grid cell)")
    p.add_argument("--confirm-seeds", default="0,1,2", help="stage 2 seeds (the --top best of stage 1)")
    p.add_argument("--top", type=int, default=2, help="how many stage-1 settings stage 2 re-runs")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="recompute the glyph bank (not stored)")
    return p.parse_args(argv)


def floats(text, flag):
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise SystemExit(f"{flag} takes comma-separated numbers, got {text!r}")
    if not values or any(v <= 0 for v in values):
        raise SystemExit(f"{flag} needs positive numbers, got {text!r}")
    return values


def recipe_flags(text):
    """The ``--recipe-flags`` string as argv items; the grid's own flags are refused (one clear error)."""
    extra = shlex.split(text)
    gridded = {"--lr", "--hyperbolic-weight", "--view-augmentation"} & {f.split("=")[0] for f in extra}
    if gridded:
        raise SystemExit(f"--recipe-flags must not set {', '.join(sorted(gridded))}: use --lrs / --weights / --views")
    return extra


def main(argv=None):
    a = parse_args(argv)
    lrs, weights = floats(a.lrs, "--lrs"), floats(a.weights, "--weights")
    views = tuple(v.strip() for v in a.views.split(",") if v.strip())
    if not views or any(v not in GLYPH_VIEW_AUGMENTATIONS for v in views):
        raise SystemExit(f"--views takes a comma-separated list of {', '.join(GLYPH_VIEW_AUGMENTATIONS)}, got {a.views!r}")
    if not 2 <= a.val_classes <= 128:
        raise SystemExit(f"--val-classes must be in 2..128 (of 160 training characters), got {a.val_classes}")
    extra = recipe_flags(a.recipe_flags)
    seeds = tuple(int(s) for s in a.seeds.split(","))
    confirm = tuple(int(s) for s in a.confirm_seeds.split(","))
    carves = tuple(int(s) for s in a.carve_seeds.split(","))
    cfg = qc.BenchConfig(threads=a.threads)
    qc.set_threads(cfg.threads)
    t0 = time.perf_counter()
    print("# " + shlex.join(["python", "-m", "bench", "hcl_validation"] + list(sys.argv[1:] if argv is None else argv)))
    print(f"budget: {cfg.describe()}; HCL row flags: {' '.join(quality.ROWS['hcl'].argv)} "
          f"--queue-size {cfg.hcl_queue}, {cfg.hcl_scenes} scenes")
    print(f"machine: {qc.machine_line()}")
    bank = qc.build_bank(cfg, "glyphs", use_cache=not a.no_cache)
    result = sweep(cfg, bank, lrs, weights, seeds, confirm, a.top, views=views, carves=carves,
                   num_val_classes=a.val_classes, extra=tuple(extra))
    print(f"\nValidation R@1 (%), {160 - a.val_classes} train / {a.val_classes} validation characters (carve seeds {', '.join(map(str, carves))}), "
          "mean ± std over runs (per run in parentheses), and the paired difference to the untrained features "
          "on the same carve:\n")
    print(table(result))
    lr, weight, kind = result["chosen"]
    verdict = ("reaches" if result["beats_reference"] else "does NOT reach")
    print(f"\nchosen: trunk lr {lr:g}, hyperbolic weight {weight:g}, {kind} views: {verdict} the untrained features on validation.")
    print(f"Total wall time {time.perf_counter() - t0:.0f} s, CPU {cpu_seconds():.0f} s; {qc.machine_line()}.")
    return result


if __name__ == "__main__":
    main()
