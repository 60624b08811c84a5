#!/usr/bin/env python
"""GPU cost of one training step of the recipes, paper setup, against PML's SupCon in the same run.

    python -m bench gpu_step                          # CUDA, every row, 20 timed steps after 5 warm-up
    python -m bench gpu_step --rows hyp_uml,hyp_vit   # some rows (their baselines are added)
    python -m bench gpu_step --json gpu_step.json     # the numbers as JSON too
    python -m bench gpu_step --rounds 3               # every row three times, interleaved; medians of the rounds
    python -m bench gpu_step --device cpu --batch-size 12 --image-size 32 --steps 2 --warmup 1   # smoke

Setup (the papers'): ViT-S/16 (``vit_small_patch16_224``, random init, nothing downloaded) at 224 px,
128-d head, AdamW (lr 3e-5, wd 0.01), gradient-norm clip 3, frozen patch embedding, AMP as
``resolve_amp`` resolves the recipes' ``--amp auto`` (fp16 + GradScaler on CUDA, off on CPU), the
paper batch: Hyp-UML on Cars196 294 = 98 classes x 3; Hyp-ViT and HypMix take their recipes' preset
for ``--vit-dataset`` (default cars196: 882 = 98 x 9). Batches are synthetic: random (B, 3, S, S)
images held on the device (``--batch-on-host``: on the CPU, so each step copies them over as a
real DataLoader batch would), class-balanced labels, a fresh class order each step.

Rows (``--rows``):

* ``baseline``      the same trunk, a plain ``torch.nn.Linear`` 128-d head and PML's ``SupConLoss``
                    (cosine, tau = 0.1), same optimiser, clip and AMP; one per batch size in use, and
                    every other row's ratios are to the baseline of its own batch size and settings;
* ``hyp_uml``       ``recipes/hyp_uml_cars.py`` as it runs by default: polar head, uncertainty-adaptive
                    contrastive loss + ``RadialCalibrationLoss`` (weight 1), and ``DegradedCopyTrainer``
                    (a degraded copy of a quarter of each batch: the trunk sees 1.25 B images);
* ``hyp_uml_paper`` the same recipe with ``--head-radius norm --radial-calibration 0 --degraded-copies 0``
                    (the paper's own step, to separate the cost of the two extra terms);
* ``hyp_vit``       ``recipes/hyp_vit.py``: Poincare head, pairwise cross-entropy (tau = 0.2);
* ``hyp_mix``       ``recipes/hyp_mix.py``: spherical head, HypMix's mixed cross-entropy;
* ``hier``          ``recipes/hier.py``: polar head, MultiSimilarity + miner + 1·HIER (512 proxies).

Every component comes from the recipes' own code: the recipe class is loaded from its script, its
arguments parsed by its own parser with its paper preset, then ``setup_model`` (backbone, geometry,
head), ``build_loss``, ``build_miner``, ``add_radius_terms``, ``build_optimizers``, ``trainer_class``
and ``resolve_amp``, wired as ``Recipe._run`` wires them (no data, no tester, no checkpoints). A
step is the trainer's own ``forward_and_backward`` (its ``get_batch``, autocast forward, float32
loss, scaled backward, unscale + clip, optimiser steps) plus reading the loss, as ``train()`` does;
each is timed between two ``torch.cuda.synchronize()``. Peak memory is
``torch.cuda.max_memory_allocated`` over the timed steps (reset before them), so it includes the
weights, optimiser state and the input batch; on CPU it is the process's peak resident set
(``VmHWM``, reset before the timed steps), indicative only.

Rounds (``--rounds N``): the whole plan (each baseline, then its rows) runs N times one after the
other, so that a slow spell of the machine falls on every row alike. A row's ``median_ms`` is then
the median of its rounds' medians and its ``time_ratio`` the median of its per-round ratios to the
baseline of the same round (``per_round_ms``, ``per_round_ratio``); min, max and peak memory over all
rounds; ``--profile`` runs in the last round only.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

ROW_NAMES = ("baseline", "hyp_uml", "hyp_uml_paper", "hyp_vit", "hyp_mix", "hier")
DEFAULT_ROWS = ROW_NAMES
VIT_DATASETS = ("cars196", "cub200", "sop", "inshop")

# (row, recipe script, class, dataset whose paper preset applies (None: --vit-dataset), extra flags)
RECIPE_ROWS = {
    "hyp_uml": ("hyp_uml_cars", "HypUML", "cars196", []),
    "hyp_uml_paper": ("hyp_uml_cars", "HypUML", "cars196",
                      ["--head-radius", "norm", "--radial-calibration", "0", "--degraded-copies", "0"]),
    "hyp_vit": ("hyp_vit", "HypViT", None, []),
    "hyp_mix": ("hyp_mix", "HypMix", None, []),
    "hier": ("hier", "HIER", None, []),
}
# Settings a baseline copies from the row it is compared with (everything its step depends on).
BASELINE_KEYS = ("backbone", "image_size", "batch_size", "samples_per_class", "embedding_dim", "lr", "head_lr",
                 "weight_decay", "grad_clip", "freeze_patch_embed", "freeze_trunk", "amp", "seed")


# ------------------------------------------------------------------------------------ recipes

def load_recipe_class(script: str, class_name: str):
    """The recipe class of ``recipes/<script>.py`` (recipe scripts are scripts, not a package)."""
    import importlib.util

    path = os.path.join(ROOT, "recipes", f"{script}.py")
    spec = importlib.util.spec_from_file_location(f"_gpu_step_recipe_{script}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name)


def on_paper_dataset(recipe_cls, dataset: str):
    """``recipe_cls`` whose presets are those of ``dataset`` although no data is present (the recipe's
    own ``presets``, e.g. Hyp-UML's triplet batch, still apply on top)."""

    class OnPaperDataset(recipe_cls):
        @classmethod
        def resolved_dataset(cls, args):
            return dataset

    OnPaperDataset.__name__ = OnPaperDataset.__qualname__ = recipe_cls.__name__
    return OnPaperDataset


def baseline_class():
    """PML's SupCon on a plain Linear head, as a recipe (so the runner's own builders make the rest)."""
    from pml_hyperbolic.training.cli import RecipeCommandLine

    class PMLSupConBaseline(RecipeCommandLine):
        name = "pml_supcon_baseline"
        hyperbolic = False  # no curvature flags, no geometry, no radius terms
        real_dataset = "cars196"
        @classmethod
        def presets(cls, args):
            return {}  # every setting comes from the compared row (BASELINE_KEYS)

        def build_head(self, in_features):
            import torch

            return torch.nn.Linear(in_features, self.args.embedding_dim)

        def build_loss(self):
            from pytorch_metric_learning.losses import SupConLoss

            return SupConLoss(temperature=0.1)  # CosineSimilarity by default

    return PMLSupConBaseline


def _flag(key: str, value) -> list:
    if value is None:
        return [f"--{key.replace('_', '-')}", "none"]
    if isinstance(value, bool):
        value = "true" if value else "false"
    return [f"--{key.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]


def common_argv(opts) -> list:
    """Flags every row gets: random init, the run's device, nothing written."""
    return ["--pretrained", "false", "--device", opts.device, "--quiet", "--no-plots", "--no-tensorboard",
            "--num-workers", "0", "--seed", str(opts.seed)]


def batch_override(opts, preset_spc: int, notes: list) -> list:
    """``--batch-size`` / ``--samples-per-class`` flags for an overridden batch. Without an explicit
    ``--samples-per-class`` the preset's is kept when it gives whole classes (>= 2), else the largest
    divisor of the batch below it that does (said in the row's notes)."""
    argv = []
    if opts.samples_per_class is not None:
        argv += ["--samples-per-class", str(opts.samples_per_class)]
    if opts.batch_size is None:
        return argv
    argv += ["--batch-size", str(opts.batch_size)]
    if opts.samples_per_class is None:
        b = opts.batch_size
        if b % preset_spc or b // preset_spc < 2:
            fits = [d for d in range(min(preset_spc, b // 2), 0, -1) if b % d == 0]
            if fits:
                argv += ["--samples-per-class", str(fits[0])]
                notes.append(f"samples/class {fits[0]} (the preset's {preset_spc} does not give >= 2 whole classes "
                             f"in {b})")
    return argv


def parse_row(name: str, opts):
    """(recipe class, parsed args, notes) of a recipe row."""
    script, class_name, dataset, extra = RECIPE_ROWS[name]
    dataset = dataset or opts.vit_dataset
    cls = on_paper_dataset(load_recipe_class(script, class_name), dataset)
    argv = common_argv(opts) + list(extra)
    if opts.image_size is not None:
        argv += ["--image-size", str(opts.image_size)]
    if opts.amp is not None:
        argv += ["--amp", opts.amp]
    notes = []
    preset_spc = cls.parse(argv).samples_per_class
    args = cls.parse(argv + batch_override(opts, preset_spc, notes))
    return cls, args, notes


def parse_baseline(row_args, opts):
    cls = baseline_class()
    argv = common_argv(opts)
    for key in BASELINE_KEYS:
        argv += _flag(key, getattr(row_args, key))
    return cls, cls.parse(argv)


def baseline_key(args) -> tuple:
    return tuple((key, getattr(args, key)) for key in BASELINE_KEYS)


# ------------------------------------------------------------------------------------ the step

def build_trainer(recipe_cls, args, device):
    """The recipe's trainer, built as ``Recipe._run`` builds it (``Recipe.build_training_parts``), minus data,
    tester and checkpoints."""
    import numpy as np

    from pml_hyperbolic.data.image_list import collate_skipping_unreadable
    from pml_hyperbolic.training.config import check_batch_settings
    from pml_hyperbolic.training.distributed import DistributedContext
    from pml_hyperbolic.training.runner import seed_everything
    from pml_hyperbolic.training.trainer import resolve_amp

    recipe = recipe_cls(args)
    recipe.device, recipe.ctx = device, DistributedContext()
    recipe.train_eval_set = None  # only read by --curvature auto, which the presets do not use
    per_rank_batch = check_batch_settings(args.batch_size, args.samples_per_class, 1)
    amp_dtype, use_scaler = resolve_amp(args.amp, device)
    seed_everything(args.seed)
    recipe.setup_model()
    loss_funcs, miner, optimizers, trainer_class, trainer_kwargs = recipe.build_training_parts()
    labels = np.repeat(np.arange(per_rank_batch // args.samples_per_class), args.samples_per_class)
    trainer = trainer_class(
        models={"trunk": recipe.trunk, "embedder": recipe.head}, optimizers=optimizers, batch_size=per_rank_batch,
        loss_funcs=loss_funcs, mining_funcs={"tuple_miner": miner} if miner is not None else {},
        dataset=_LabelsOnly(labels), sampler=None, iterations_per_epoch=None, collate_fn=collate_skipping_unreadable,
        data_device=device, dataloader_num_workers=0, label_hierarchy_level=recipe.label_hierarchy_level,
        freeze_these=("trunk",) if args.freeze_trunk else (), amp_dtype=amp_dtype, use_grad_scaler=use_scaler,
        grad_clip_norm=args.grad_clip, max_steps=None, show_progress=False, **trainer_kwargs)
    return recipe, trainer, amp_dtype, use_scaler


class _LabelsOnly:
    """What the trainer's constructor is given as a dataset (the batches are fed directly)."""

    def __init__(self, labels):
        self.labels = labels

    def __len__(self):
        return len(self.labels)


class SyntheticBatches:
    """The trainer's ``dataloader``: random images (made once, on ``device``) and class-balanced labels
    (CPU, as a DataLoader yields them) in a fresh class order at every step. Iterating yields
    ``steps`` batches; ``HyperbolicTrainer.get_batch`` starts a new pass when one is exhausted."""

    def __init__(self, batch: int, samples_per_class: int, image_size: int, device, seed: int, steps: int = 1000):
        import torch

        device = torch.device(device)
        self.images = torch.randn(batch, 3, image_size, image_size, device=device,
                                  generator=torch.Generator(device).manual_seed(seed))
        self.classes = batch // samples_per_class
        self.samples_per_class = samples_per_class
        self.generator = torch.Generator().manual_seed(seed)  # the class order (CPU labels)
        self.steps = steps

    def __len__(self):
        return self.steps

    def __iter__(self):
        import torch

        for _ in range(self.steps):
            order = torch.randperm(self.classes, generator=self.generator)
            yield self.images, order.repeat_interleave(self.samples_per_class)


def trunk_images_per_step(trainer, batch: int) -> int:
    fraction = getattr(trainer, "copy_fraction", None)
    return batch + (min(batch, max(1, math.ceil(fraction * batch))) if fraction else 0)


def _synchronize(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak_memory(device) -> bool:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as handle:  # Linux: resets VmHWM to the current RSS
            handle.write("5")
        return True
    except OSError:
        return False


def _peak_memory(device, reset_ok: bool):
    """(peak bytes allocated, peak bytes reserved) since the reset; on CPU (peak RSS, None)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    if not reset_ok:
        return None, None
    try:
        with open("/proc/self/status") as handle:
            found = re.search(r"VmHWM:\s+(\d+)\s+kB", handle.read())
    except OSError:
        return None, None
    return (int(found.group(1)) * 1024 if found else None), None


def measure_row(label: str, recipe_cls, args, opts, device, notes=()) -> dict:
    """Build the row's trainer, run warm-up and timed steps; the row's numbers. The row's model,
    optimiser state and batch are freed before the next row is built."""
    row = _run_row(label, recipe_cls, args, opts, device, notes)
    release(device)
    return row


def _run_row(label: str, recipe_cls, args, opts, device, notes) -> dict:
    import torch

    from pml_hyperbolic.training.trainer import _scalar

    recipe, trainer, amp_dtype, use_scaler = build_trainer(recipe_cls, args, device)
    batch = trainer.batch_size
    batches = SyntheticBatches(batch, args.samples_per_class, args.image_size,
                               torch.device("cpu") if opts.batch_on_host else device, seed=opts.seed)
    trainer.dataloader, trainer.dataloader_iter = batches, iter(batches)  # what get_batch draws from
    trainer.epoch, trainer.iteration = 1, 0
    trainer.set_to_train()

    def step():
        trainer.forward_and_backward()
        trainer.global_step += 1
        return _scalar(trainer.losses["total_loss"])  # as train() reads it after every step

    for _ in range(opts.warmup):
        step()
    _synchronize(device)
    gc.collect()
    reset_ok = _reset_peak_memory(device)
    times, losses = [], []
    for _ in range(opts.steps):
        _synchronize(device)
        started = time.perf_counter()
        losses.append(step())
        _synchronize(device)
        times.append(time.perf_counter() - started)
    peak, reserved = _peak_memory(device, reset_ok)
    median = statistics.median(times)
    profile = profile_steps(step, opts.profile, device) if opts.profile else None
    row = {
        "row": label, "recipe": recipe_cls.__name__, "trainer": type(trainer).__name__,
        "head": type(recipe.head).__name__,
        "losses": {k: _describe_loss(v) for k, v in trainer.loss_funcs.items()},
        "batch_size": batch, "samples_per_class": args.samples_per_class, "image_size": args.image_size,
        "trunk_images_per_step": trunk_images_per_step(trainer, batch),
        "amp": "off" if amp_dtype is None else str(amp_dtype).replace("torch.", "") + (" + GradScaler" if use_scaler
                                                                                        else ""),
        "median_ms": median * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
        "images_per_s": batch / median, "peak_memory_bytes": peak, "peak_reserved_bytes": reserved,
        "last_loss": losses[-1], "nonfinite_steps": int(trainer.nonfinite_steps),
        "grad_scale": float(trainer.scaler.get_scale()) if trainer.scaler is not None else None,
        "notes": list(notes),
    }
    if profile is not None:
        row["profile"] = profile
    return row


_SYNC_EVENTS = ("aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
                "cudaEventSynchronize")


def profile_steps(step, n_steps: int, device) -> dict:
    """``torch.profiler`` over ``n_steps`` more steps: per step, the wall time, the time the device
    spent in kernels, the host waits (reads of a device value, synchronisations), and the kernels
    taking the most device time. Printed and returned (``--profile``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _synchronize(device)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(n_steps):
            step()
        _synchronize(device)
    wall = (time.perf_counter() - started) / n_steps
    averages = prof.key_averages()
    sync_sites = synchronising_lines(step, device)

    def device_us(event):
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0

    from torch.autograd import DeviceType

    # device-side events only (the kernels and copies themselves; operator rows would count them twice)
    kernels = sorted((e for e in averages if getattr(e, "device_type", None) == DeviceType.CUDA and device_us(e) > 0),
                     key=device_us, reverse=True)
    busy = sum(device_us(e) for e in kernels) / n_steps / 1e3
    waits = {e.key: e.count / n_steps for e in averages if e.key in _SYNC_EVENTS}
    every = [{"kernel": e.key[:160], "ms_per_step": device_us(e) / n_steps / 1e3, "calls_per_step": e.count / n_steps}
             for e in kernels]
    top = every[:15]
    print(f"    profile over {n_steps} steps: {wall * 1e3:.1f} ms/step wall, {busy:.1f} ms/step in device kernels; "
          f"host waits per step: {waits or 'none'}", flush=True)
    for entry in top:
        print(f"      {entry['ms_per_step']:8.3f} ms  x{entry['calls_per_step']:<6g} {entry['kernel']}", flush=True)
    if sync_sites:
        print("    lines that synchronised the host with the device in one step: "
              + "; ".join(f"{site} x{n}" for site, n in sync_sites.items()), flush=True)
    return {"steps": n_steps, "wall_ms_per_step": wall * 1e3, "kernel_ms_per_step": busy,
            "host_waits_per_step": waits, "synchronising_lines": sync_sites, "kernels": every[:30],
            "other_kernels": {"count": len(every[30:]), "ms_per_step": sum(k["ms_per_step"] for k in every[30:])}}


def synchronising_lines(step, device) -> dict:
    """The Python lines that made the host wait for the device during one step (CUDA's sync debug
    mode), most frequent first; empty on other devices."""
    import collections
    import warnings

    import torch

    if device.type != "cuda":
        return {}
    sites = collections.Counter()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
            _synchronize(device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message):
            where = os.path.relpath(warning.filename, ROOT) if warning.filename.startswith(ROOT) else warning.filename
            sites[f"{where}:{warning.lineno}"] += 1
    return dict(sites.most_common())


def _describe_loss(loss) -> str:
    inner = getattr(loss, "losses", None)
    if inner is not None:  # PML's MultipleLosses
        weights = getattr(loss, "weights", None)
        parts = list(inner.values()) if isinstance(inner, dict) else list(inner)
        w = list(weights.values()) if isinstance(weights, dict) else list(weights or [1] * len(parts))
        return " + ".join(f"{w[i]:g}*{type(part).__name__}" for i, part in enumerate(parts))
    return type(loss).__name__


def release(device):
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def failed_row(label: str, args, err: BaseException) -> dict:
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return {"row": label, "batch_size": getattr(args, "batch_size", None), "error": f"{type(err).__name__}: "
            f"{message[:200]}"}


# ------------------------------------------------------------------------------------ report

def load_info(device) -> dict:
    info = {}
    try:
        info["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        info["loadavg"] = None
    info["cpus"] = os.cpu_count()
    if device.type == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info(device)
        info["gpu_free_bytes"], info["gpu_total_bytes"] = int(free), int(total)
        info["gpu_utilization_percent"] = _gpu_utilization(device)
    return info


def _gpu_utilization(device):
    """The GPU's busy percentage right now (other users), or None when it cannot be read."""
    import torch

    try:
        return int(torch.cuda.utilization(device))
    except Exception:  # noqa: BLE001, S110 - needs pynvml (or amdsmi); else nvidia-smi below
        pass
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=utilization.gpu",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10,
                             check=False)
        return int(out.stdout.strip().splitlines()[0]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / 2 ** 20:,.0f}"


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_table(rows, device) -> str:
    memory = "peak MiB" if device.type == "cuda" else "peak RSS MiB"
    header = (f"| {'row':<24} | {'batch':>9} | {'trunk img':>9} | {'median ms':>10} | {'img/s':>8} | "
              f"{memory:>12} | {'time ratio':>10} | {'mem ratio':>9} |")
    lines = [header, "|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|"]
    for row in rows:
        batch = f"{row.get('batch_size')}" + (f"={row['batch_size'] // row['samples_per_class']}x"
                                              f"{row['samples_per_class']}" if "samples_per_class" in row else "")
        if "error" in row:
            lines.append(f"| {row['row']:<24} | {batch:>9} | {row['error']}")
            continue
        peak = _mib(row["peak_memory_bytes"])
        lines.append(f"| {row['row']:<24} | {batch:>9} | {row['trunk_images_per_step']:>9} | "
                     f"{row['median_ms']:>10.1f} | {row['images_per_s']:>8.1f} | {peak:>12} | "
                     f"{_ratio(row.get('time_ratio')):>10} | {_ratio(row.get('memory_ratio')):>9} |")
    return "\n".join(lines)


def summary_line(rows) -> str:
    parts = []
    for row in rows:
        if row.get("is_baseline"):
            continue
        if "error" in row:
            parts.append(f"{row['row']} failed ({row['error'].split(':')[0]})")
        elif row.get("time_ratio") is None:
            parts.append(f"{row['row']} {row['median_ms']:.0f} ms (no baseline)")
        else:
            parts.append(f"{row['row']} {row['time_ratio']:.2f}x time, {_ratio(row.get('memory_ratio'))} memory")
    return "summary (vs PML SupCon at the same batch): " + ("; ".join(parts) if parts else "baselines only")


# ------------------------------------------------------------------------------------ main

def parse_arguments(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--device", default="cuda", help="'cuda', 'cuda:N', or 'cpu' for a smoke run")
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help=f"comma-separated rows among {', '.join(ROW_NAMES)} (a baseline is added for each batch)")
    parser.add_argument("--batch-size", type=int, default=None, help="override every row's (paper) batch size")
    parser.add_argument("--samples-per-class", type=int, default=None,
                        help="override the samples per class (default: each preset's, or the largest divisor of "
                             "--batch-size below it)")
    parser.add_argument("--image-size", type=int, default=None, help="override the image size (paper: 224)")
    parser.add_argument("--amp", default=None, choices=["auto", "off", "fp16", "bf16"],
                        help="override the recipes' --amp (their presets: auto = fp16 + GradScaler on CUDA, "
                             "off on CPU)")
    parser.add_argument("--vit-dataset", default="cars196", choices=VIT_DATASETS,
                        help="whose paper preset the Hyp-ViT and HypMix rows take (cars196: batch 882 = 98 x 9)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per row before the timed ones")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times, interleaved; report the medians of the rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-on-host", action="store_true",
                        help="keep the synthetic batch on the CPU: each step then copies it to the device")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU runs)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the numbers to PATH")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after timing, profile STEPS more steps per row: device time in kernels, host waits, "
                             "the costliest kernels")
    parser.add_argument("--pairwise", default=None, choices=["torch", "triton"],
                        help="pairwise_dist on CUDA: the torch path or the Triton kernels, through the library's own "
                             "switch PML_HYPERBOLIC_TRITON (default: as that variable says)")
    opts = parser.parse_args(argv)
    rows = [r.strip() for r in opts.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROW_NAMES]
    if unknown or not rows:
        parser.error(f"--rows: unknown {unknown} (choose among {', '.join(ROW_NAMES)})")
    opts.rows = rows
    if opts.steps < 1 or opts.warmup < 0 or opts.rounds < 1:
        parser.error("--steps and --rounds must be >= 1 and --warmup >= 0")
    for name in ("batch_size", "samples_per_class", "image_size", "threads"):
        value = getattr(opts, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    return opts


def resolve_device(name: str):
    """The device, or one clear ConfigError (CUDA requested but unavailable, an unknown name)."""
    import torch

    from pml_hyperbolic.training.config import ConfigError

    name = name.strip().lower()
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available (torch {torch.__version__}, "
                              f"torch.version.cuda = {torch.version.cuda}, torch.cuda.is_available() is False). "
                              "This benchmark measures the GPU step; use --device cpu only for a smoke run.")
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"--device must be 'cuda', 'cuda:N' or 'cpu', got {name!r}")


def check_dependencies() -> None:
    import importlib.util

    from pml_hyperbolic.training.config import ConfigError

    needed = (("pytorch-metric-learning", "pytorch_metric_learning"), ("hypll", "hypll"), ("timm", "timm"))
    missing = [name for name, module in needed if importlib.util.find_spec(module) is None]
    if missing:
        raise ConfigError(f"not installed: {', '.join(missing)} (pip install them first)")


def main(argv=None) -> dict:
    opts = parse_arguments(argv)
    import torch

    device = resolve_device(opts.device)
    opts.device = str(device)
    check_dependencies()
    if opts.pairwise is not None:
        os.environ["PML_HYPERBOLIC_TRITON"] = "1" if opts.pairwise == "triton" else "0"
    from pml_hyperbolic import poincare_ball

    opts.pairwise = "triton" if device.type == "cuda" and poincare_ball._triton_requested() else "torch"
    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    import pml_hyperbolic

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    info = load_info(device)
    print(f"device: {device} ({name}); torch {torch.__version__} (CUDA {torch.version.cuda}); "
          f"python {platform.python_version()}; pml_hyperbolic from {os.path.dirname(pml_hyperbolic.__file__)}")
    load = f"load: loadavg {info['loadavg']} on {info['cpus']} CPUs, torch threads {torch.get_num_threads()}"
    if device.type == "cuda":
        util = info["gpu_utilization_percent"]
        load += (f"; GPU {_mib(info['gpu_free_bytes'])} of {_mib(info['gpu_total_bytes'])} MiB free, "
                 f"utilisation {'n/a' if util is None else f'{util}%'} before the run")
    print(load)

    # rows, each after the baseline of its settings (one baseline per distinct batch / settings)
    plan, baselines = [], {}
    for name_ in [r for r in opts.rows if r != "baseline"]:
        cls, args, notes = parse_row(name_, opts)
        key = baseline_key(args)
        if key not in baselines:
            label = f"baseline {args.batch_size}={args.batch_size // args.samples_per_class}x{args.samples_per_class}"
            baselines[key] = label + (f" #{len(baselines) + 1}" if label in baselines.values() else "")
            plan.append((baselines[key], *parse_baseline(args, opts), [], key, True))
        plan.append((name_, cls, args, notes, key, False))
    if "baseline" in opts.rows and not baselines:  # baseline alone: the Hyp-UML paper settings
        cls, args, _ = parse_row("hyp_uml", opts)
        label = f"baseline {args.batch_size}={args.batch_size // args.samples_per_class}x{args.samples_per_class}"
        plan.append((label, *parse_baseline(args, opts), [], baseline_key(args), True))
    first = plan[0][2]
    print(f"setup: {first.backbone} (random init) at {first.image_size} px, {first.embedding_dim}-d head, "
          f"AdamW lr {first.lr:g} wd {first.weight_decay:g}, clip {first.grad_clip}, --amp {first.amp}; "
          f"{opts.warmup} warm-up + {opts.steps} timed steps per row; batch "
          f"{'on the host (copied every step)' if opts.batch_on_host else 'resident on the device'}"
          + ("" if device.type == "cuda" else f"; native tail: {_native_status()}"))
    sys.stdout.flush()

    rounds = []  # one list of rows per round, in plan order
    profile = opts.profile
    for number in range(opts.rounds):
        opts.profile = profile if number == opts.rounds - 1 else 0  # profiled in the last round only
        if opts.rounds > 1:
            print(f"round {number + 1} of {opts.rounds}", flush=True)
        rounds.append(run_plan(plan, opts, device))
    opts.profile = profile
    rows = rounds[0] if opts.rounds == 1 else combine_rounds(rounds)
    for row in rows:
        if row.get("is_baseline"):
            row["time_ratio"] = 1.0 if "error" not in row else None
            row["memory_ratio"] = 1.0 if "error" not in row and row["peak_memory_bytes"] else None

    print()
    print(format_table(rows, device))
    summary = summary_line(rows)
    print(summary)
    result = {"device": str(device), "device_name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
              "python": platform.python_version(), "load": info,
              "settings": {"rows": opts.rows, "steps": opts.steps, "warmup": opts.warmup, "rounds": opts.rounds,
                           "seed": opts.seed,
                           "batch_on_host": opts.batch_on_host, "vit_dataset": opts.vit_dataset,
                           "image_size": first.image_size, "backbone": first.backbone, "amp": first.amp,
                           "pairwise": opts.pairwise, "profile_steps": opts.profile},
              "rows": rows, "summary": summary}
    if opts.json:
        with open(opts.json, "w") as handle:
            json.dump(result, handle, indent=2)
        print(f"numbers written to {opts.json}")
    return result


def run_plan(plan, opts, device) -> list:
    """Every row of ``plan`` once, each after its baseline: the rows, with their ratios to it."""
    import torch

    rows, by_key = [], {}
    for label, cls, args, notes, key, is_baseline in plan:
        try:
            row = measure_row(label, cls, args, opts, device, notes)
        except torch.cuda.OutOfMemoryError as err:  # one row too big for this GPU: say so, go on
            row = failed_row(label, args, err)
        if "error" in row:
            release(device)  # after the except block: its traceback no longer holds the row's tensors
        row["is_baseline"] = is_baseline
        if is_baseline:
            by_key[key] = row
        else:
            base = by_key.get(key)
            if base is not None and "error" not in base and "error" not in row:
                row["baseline"] = base["row"]
                row["time_ratio"] = row["median_ms"] / base["median_ms"]
                if row["peak_memory_bytes"] and base["peak_memory_bytes"]:
                    row["memory_ratio"] = row["peak_memory_bytes"] / base["peak_memory_bytes"]
        rows.append(row)
        if "error" in row:
            print(f"  {label}: {row['error']}", flush=True)
        else:
            loss = "; ".join(f"{k}={v}" for k, v in row["losses"].items())
            print(f"  {label}: {row['median_ms']:.1f} ms/step (min {row['min_ms']:.1f}, max {row['max_ms']:.1f}), "
                  f"{row['trainer']}, head {row['head']}, loss {loss}, amp {row['amp']}, "
                  f"last loss {row['last_loss']:.4f}"
                  + (f"; {'; '.join(row['notes'])}" if row["notes"] else ""), flush=True)
    return rows


def combine_rounds(rounds: list) -> list:
    """One row per plan entry from several rounds (module docstring, Rounds): the last round's row
    (its profile, last loss, notes) with the medians over the rounds; a row that failed in any round
    keeps that round's error."""
    combined = []
    for runs in zip(*rounds):
        failed = [run for run in runs if "error" in run]
        if failed:
            combined.append(failed[0])
            continue
        row = dict(runs[-1])
        row["per_round_ms"] = [run["median_ms"] for run in runs]
        row["median_ms"] = statistics.median(row["per_round_ms"])
        row["min_ms"] = min(run["min_ms"] for run in runs)
        row["max_ms"] = max(run["max_ms"] for run in runs)
        row["images_per_s"] = row["batch_size"] / (row["median_ms"] / 1e3)
        peaks = [run["peak_memory_bytes"] for run in runs if run["peak_memory_bytes"]]
        row["peak_memory_bytes"] = max(peaks) if peaks else runs[-1]["peak_memory_bytes"]
        if all("time_ratio" in run for run in runs):
            row["per_round_ratio"] = [run["time_ratio"] for run in runs]
            row["time_ratio"] = statistics.median(row["per_round_ratio"])
        if all(run.get("memory_ratio") for run in runs):
            row["memory_ratio"] = max(run["memory_ratio"] for run in runs)
        combined.append(row)
    return combined


def _native_status() -> str:
    try:
        from pml_hyperbolic.kernels import native as _native

        return _native.status()
    except Exception as err:  # noqa: BLE001 - never fatal: the torch path is the fallback
        return f"unavailable ({type(err).__name__})"


if __name__ == "__main__":
    try:
        main()
    except Exception as err:
        from pml_hyperbolic.training.config import ConfigError

        if isinstance(err, ConfigError):
            print(f"error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        raise
