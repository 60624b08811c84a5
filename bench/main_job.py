#!/usr/bin/env python
"""CPU seconds per phase of the main job (``recipes/hyp_uml_cars.py`` on the bundled glyphs).

    python -m bench main_job                 # 1 thread (the default), run folder in a temp dir
    python -m bench main_job --threads 2     # what the recipe would use on the 2-core machine
    python -m bench main_job --as-before     # without the feature cache, chunking, kept memory,
                                             # greyscale glyph pipeline, cached glyph archive, gc.freeze,
                                             # channels-last trunk (--memory-format contiguous)
    python -m bench main_job -- --epochs 1   # extra arguments after -- go to the recipe

The recipe runs in this process; its phases are timed by wrapping methods of the classes it uses
(no edit to the recipe or the runner): ``Recipe.setup_data`` (data), ``Recipe.setup_model``
(model setup: backbone weights), the trunk's and the head's ``forward`` (trunk / head), the
trainer's batch fetching (data), loss and backward/step (head+loss), the ``Evaluator`` call
(evaluation, split into its trunk, head, data+loop and kNN parts), ``CheckpointManager.save``
(checkpoints) and ``Recipe.plots`` and ``Recipe.retrieval_grid`` (plots).
Each CPU second goes to the innermost phase running (exclusive time), so the rows add up to the
total. CPU time is the whole process's (``time.process_time``: every thread), plus DataLoader
worker processes (``RUSAGE_CHILDREN``) in the total. Wall time and the load average are printed
beside it: on a shared machine only the CPU seconds compare between runs.

The Recall@K and epoch-loss lines it prints are the job's own (``results.json``, full precision):
they must not change when the job gets faster (compare with ``--as-before`` in the same checkout).
"""
from __future__ import annotations

import time

_CPU0, _WALL0 = time.process_time(), time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import runpy  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RECIPE = os.path.join(HERE, "..", "recipes", "hyp_uml_cars.py")


class PhaseClock:
    """Exclusive CPU seconds per phase: a stack of open phases; time goes to the top one."""

    def __init__(self, start_phase: str):
        self.totals = {}
        self.stack = [start_phase]
        self.mark = time.process_time()

    def _flush(self) -> None:
        now = time.process_time()
        self.totals[self.stack[-1]] = self.totals.get(self.stack[-1], 0.0) + now - self.mark
        self.mark = now

    @contextlib.contextmanager
    def phase(self, name: str):
        self._flush()
        # inside evaluation a phase is named as its part: the trunk there is "evaluation/trunk"; in
        # training the head's forward is part of "head+loss"
        inside_evaluation = self.stack[-1].startswith("evaluation")
        if inside_evaluation:
            full = f"evaluation/{name}"
        else:
            full = "head+loss" if name == "head" else name
        self.stack.append(full)
        try:
            yield
        finally:
            self._flush()
            self.stack.pop()

    def switch(self, name: str) -> None:
        """Close the base phase and open another (imports → other)."""
        self._flush()
        self.stack[0] = name


def wrap_method(owner, attribute: str, clock: PhaseClock, phase: str) -> None:
    original = getattr(owner, attribute)

    @functools.wraps(original)
    def timed(*args, **kwargs):
        with clock.phase(phase):
            return original(*args, **kwargs)

    setattr(owner, attribute, timed)


def force_keywords(cls, **forced) -> None:
    """Make ``cls(...)`` always receive ``forced`` keyword values (whatever its caller passes)."""
    original = cls.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **{**kwargs, **forced})

    cls.__init__ = init


def pre_issue_16_glyph_data(runner) -> None:
    """Make ``Recipe.setup_data`` build the glyph data as before the speed-up of 2026-11-25: torchvision's ToTensor +
    Normalize after an RGB conversion at the start (GlyphDataset then converts every image to RGB
    itself), and the ``.npz`` archive decompressed for every split. Installed on the first call, so
    torchvision's import stays in the data phase as in the job."""
    setup_data = runner.Recipe.setup_data

    def setup_data_as_before(self):
        import pml_hyperbolic.data as data
        from pml_hyperbolic.data import glyphs, transforms
        from torchvision import transforms as T

        build_transforms, read_archive = transforms.build_transforms, glyphs.read_glyph_archive

        def build_transforms_as_before(*args, **kwargs):
            pipeline = build_transforms(*args, **kwargs)
            if not getattr(pipeline, "accepts_greyscale", False):
                return pipeline
            steps = []
            for step in pipeline.transforms:
                if isinstance(step, transforms.ConvertToRGB):
                    steps.append(transforms.ConvertToRGB())
                elif isinstance(step, transforms.ToNormalizedTensor):
                    steps += [T.ToTensor(), T.Normalize(step.mean, step.std)]
                else:
                    steps.append(step)
            return T.Compose(steps)  # no accepts_greyscale: GlyphDataset hands it RGB images

        def read_archive_as_before(path):
            glyphs._archive_cache.clear()
            return read_archive(path)

        transforms.build_transforms = data.build_transforms = build_transforms_as_before
        glyphs.read_glyph_archive = read_archive_as_before
        runner.Recipe.setup_data = setup_data
        return setup_data(self)

    runner.Recipe.setup_data = setup_data_as_before


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (1: CPU time = work done)")
    parser.add_argument("--as-before", action="store_true",
                        help="turn off what the speed-up of 2026-11-25 added (the tester's frozen-trunk feature cache, the CPU "
                             "trunk chunking and the kept freed memory, in tester and trainer; the greyscale glyph "
                             "pipeline, the cached glyph archive, the frozen long-lived objects and the "
                             "channels-last trunk): the same "
                             "code's 'before', in the same checkout (the one-axes retrieval grid and the single "
                             "checkpoint serialisation stay)")
    parser.add_argument("recipe_args", nargs="*", help="extra recipe arguments (after --)")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")

    clock = PhaseClock("imports")
    clock.mark = _CPU0  # interpreter start-up up to here counts as imports too
    import torch

    torch.set_num_threads(args.threads)
    import pytorch_metric_learning.testers  # noqa: F401
    from pml_hyperbolic.training import checkpoint, evaluation, runner, trainer

    recipe = runpy.run_path(RECIPE, run_name="hyp_uml_bench")["HypUML"]
    clock.switch("other")
    if args.as_before:
        force_keywords(evaluation.SkippingEmbeddingSpaceTester, cache_frozen_trunk=False, trunk_chunk_size=None,
                       keep_freed_memory=False)
        force_keywords(trainer.HyperbolicTrainer, trunk_chunk_size=None, keep_freed_memory=False)
        pre_issue_16_glyph_data(runner)
        runner.freeze_long_lived_objects = lambda: None  # the collector scans every object, as before

    wrap_method(runner.Recipe, "setup_data", clock, "data")
    wrap_method(runner.Recipe, "plots", clock, "plots")
    wrap_method(runner.Recipe, "retrieval_grid", clock, "plots")
    wrap_method(checkpoint.CheckpointManager, "save", clock, "checkpoints")
    wrap_method(trainer.HyperbolicTrainer, "get_batch", clock, "data")
    wrap_method(trainer.HyperbolicTrainer, "calculate_loss", clock, "head+loss")
    wrap_method(trainer.HyperbolicTrainer, "backward", clock, "head+loss")
    wrap_method(trainer.HyperbolicTrainer, "step_optimizers", clock, "head+loss")
    wrap_method(evaluation.Evaluator, "__call__", clock, "evaluation")
    wrap_method(evaluation.SkippingEmbeddingSpaceTester, "compute_all_embeddings", clock, "data+loop")
    wrap_method(evaluation.SkippingEmbeddingSpaceTester, "do_knn_and_accuracies", clock, "kNN")

    setup_model = runner.Recipe.setup_model

    def timed_setup_model(self):
        with clock.phase("model setup"):
            setup_model(self)
        # instance-level wraps: the same modules run in training ("trunk") and evaluation
        # ("evaluation/trunk"); the phase names follow the caller
        wrap_method(self.trunk, "forward", clock, "trunk")
        wrap_method(self.head, "forward", clock, "head")

    runner.Recipe.setup_model = timed_setup_model

    before_args = ["--memory-format", "contiguous"] if args.as_before else []
    with tempfile.TemporaryDirectory() as tmp:
        results = recipe.main(["--output-dir", os.path.join(tmp, "run"), "--no-tensorboard", *before_args,
                               *args.recipe_args])
    clock.switch("other")
    cpu = time.process_time() - _CPU0
    wall = time.perf_counter() - _WALL0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    child_cpu = children.ru_utime + children.ru_stime

    variant = ", as before" if args.as_before else ""
    print(f"\nmain job (bench/main_job.py, threads {args.threads}{variant}, load average "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f", {os.cpu_count()} CPUs)")
    order = ["imports", "data", "model setup", "trunk", "head", "head+loss", "evaluation", "checkpoints", "plots",
             "other"]
    names = sorted(clock.totals, key=lambda n: (order.index(n.split("/")[0]) if n.split("/")[0] in order
                                                else len(order), n))
    for name in names:
        seconds = clock.totals[name]
        print(f"  {name:<28s} {seconds:8.2f} CPU s  {100 * seconds / cpu:5.1f}%")
    eval_total = sum(v for k, v in clock.totals.items() if k.split("/")[0] == "evaluation")
    print(f"  {'evaluation (all parts)':<28s} {eval_total:8.2f} CPU s  {100 * eval_total / cpu:5.1f}%")
    print(f"  {'total':<28s} {cpu + child_cpu:8.2f} CPU s  (this process {cpu:.2f}, DataLoader workers "
          f"{child_cpu:.2f});  wall {wall:.1f} s")
    for when in ("before", "after"):
        recall = (results or {}).get(when) or {}
        print(f"  recall {when:<7s} " + "  ".join(f"{k} {v!r}" for k, v in sorted(recall.items())))
    losses = [row.get("loss") for row in (results or {}).get("history") or []]
    print("  epoch losses   " + "  ".join(repr(x) for x in losses))
    sys.stdout.flush()
    return {"phases": dict(clock.totals), "cpu": cpu + child_cpu, "wall": wall, "results": results}


if __name__ == "__main__":
    main()
