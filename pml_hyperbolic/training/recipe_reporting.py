"""The reporting part of :class:`~.runner.Recipe`: printing, the plots of the final embeddings,
``results.json`` and the end-of-run summary.

Why a module of its own: the recipe driver composes one mixin per responsibility (data, model and
geometry, optimisation, reporting), each readable alone.

Design note: docs/design/training.md
"""
from __future__ import annotations

import os
import time
from typing import Any, Dict, Optional, Sequence

import torch

from .command_line import discard_previous_run
from .config import run_write_error
from .evaluation import format_recall


PHASE_ORDER = ("data", "model", "eval before", "training", "eval after", "plots")


def format_summary(results: Dict, k_values: Sequence[int], results_path: Optional[str],
                   checkpoint_paths: Sequence[str], uncertainty_bins: bool = False) -> str:
    """The end-of-run summary (~8 lines): Recall@K before/after for each K, the time of each phase,
    and where the results, checkpoints and plots are; one more line for a recipe's own check
    (``results["method_check"]``) and one when the test embeddings' radius collapsed
    (``results["radius_collapse"]``).

    Args:
        results: the run's ``results.json`` payload.
        k_values: the K of Recall@K (columns).
        results_path: where ``results.json`` was written, or None.
        checkpoint_paths: the checkpoint files written.
        uncertainty_bins: add the uncertainty bins and AUROC lines (Hyp-UML).

    Returns:
        The summary, lines joined by newlines.
    """
    ks = list(k_values)
    epochs = results.get("epochs_completed", 0)
    head = (f"[pml-hyperbolic] summary: {results.get('recipe')} on {results.get('dataset')}, {epochs} epoch"
            f"{'s' if epochs != 1 else ''}, {results.get('global_step', 0)} steps, {results.get('wall_seconds', 0):.0f} s")
    width = max(7, *(len(f"R@{k}") + 2 for k in ks))
    lines = [head, "          " + "".join(f"{'R@' + str(k):>{width}}" for k in ks)]
    for label in ("before", "after"):
        recall = results.get(label)
        if recall:
            lines.append(f"  {label:<8}" + "".join(f"{recall.get(f'recall_at_{k}', float('nan')):>{width}.3f}"
                                                 for k in ks))
    table = results.get("uncertainty_vs_recall")
    if uncertainty_bins and table and len(table) > 1:
        lines.append("  uncertainty bins, most certain first: R@1 "
                     + " ".join(f"{row['recall_at_1']:.2f}" for row in table) + f" (n = {table[0]['count']} per bin)")
    auroc = results.get("uncertainty_failure_auroc")
    if uncertainty_bins and auroc is not None and auroc == auroc:
        lines.append(f"  uncertainty AUROC for a wrong top-1: {auroc:.3f} (0.5 = no information)")
    checks = results.get("method_check") or {}
    if checks.get("after"):
        first = (results.get("before") or {}).get("method_check")
        start = f"{first['value']:.3f} -> " if first else ""
        lines.append(f"  {checks['after']['name']}: {start}{checks['after']['value']:.3f}")
    collapse = results.get("radius_collapse")
    if collapse:  # see pml_hyperbolic.evaluation.radius_health
        lines.append(f"  {collapse['summary']}")
    phases = results.get("phase_seconds") or {}
    if phases:
        lines.append("  time    " + " | ".join(f"{name} {phases[name]:.1f} s" for name in PHASE_ORDER
                                               if name in phases))
    if results_path:
        lines.append(f"  results     {results_path}")
    if checkpoint_paths:
        lines.append(f"  checkpoints {', '.join(checkpoint_paths)}")
    plots = results.get("plots") or {}
    if plots:  # recipes that draw none (or --no-plots) get no line, rather than a claim
        lines.append(f"  plots       {', '.join(plots.values())}")
    return "\n".join(lines)



class RecipeReportingMixin:
    """Output of a recipe run: ``say`` / ``status`` lines, the Poincaré-disk, uncertainty and
    retrieval-grid plots, and the results of a finished run.

    Design note: docs/design/training.md
    """

    def say(self, *parts: Any) -> None:
        """Print on the main process only."""
        if self.ctx.is_main:
            print(*parts, flush=True)

    def status(self, message: str) -> None:
        """A progress line for a phase that can take seconds (silenced by --quiet)."""
        if not self.args.quiet:
            self.say(f"[pml-hyperbolic] {message}")

    def plots(self, embeddings: torch.Tensor, labels: torch.Tensor, reference_embeddings: Optional[torch.Tensor] = None,
              reference_labels: Optional[torch.Tensor] = None) -> Dict[str, str]:
        """Poincaré disk + uncertainty-vs-recall of the final test embeddings; ``{name: png path}``."""
        if not self.hyperbolic or embeddings is None:
            return {}
        from ..evaluation import plot_poincare_disk, plot_uncertainty_vs_recall

        out = {}
        disk = os.path.join(self.run_dir, "poincare_disk.png")
        plot_poincare_disk(embeddings, labels, disk, c=self.geometry, radius_histogram=True)
        out["poincare_disk"] = disk
        unc = os.path.join(self.run_dir, "uncertainty_vs_recall.png")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # said once, plainly, below
            protocol = ("queries vs gallery, as the run's Recall@1" if reference_embeddings is not None
                        else "self-retrieval among the test embeddings")
            table = plot_uncertainty_vs_recall(embeddings, labels, unc, c=self.geometry,
                                               reference_embeddings=reference_embeddings,
                                               reference_labels=reference_labels,
                                               title=f"Recall@1 per uncertainty bin\n({protocol})",
                                               n_bins=5)  # quintiles: enough queries per bin to read its recall
        # The plot is drawn for every hyperbolic recipe; only Hyp-UML (whose loss uses the uncertainty)
        # explains a degenerate one. Its bins are printed in the end-of-run summary.
        radius_said = getattr(getattr(self, "evaluator", None), "radius_report", None) is not None  # in the summary
        if self.reports_uncertainty and len(table) == 1 and not radius_said:
            self.say("[pml-hyperbolic] every test embedding sits at the clip radius, so the Hyp-UML uncertainty "
                     "is the same for all of them: the uncertainty-vs-recall plot has one bin (and an "
                     "uncertainty-adaptive loss acts as its fixed-temperature/margin form).")
        out["uncertainty_vs_recall"] = unc
        self.uncertainty_table = table
        from ..evaluation import uncertainty_failure_auroc

        self.uncertainty_auroc = uncertainty_failure_auroc(
            embeddings, labels, c=self.geometry, reference_embeddings=reference_embeddings,
            reference_labels=reference_labels)  # U's clip radius: the geometry's
        return out

    def retrieval_grid(self, embeddings: torch.Tensor, labels: torch.Tensor,
                       reference_embeddings: Optional[torch.Tensor] = None,
                       reference_labels: Optional[torch.Tensor] = None) -> Dict[str, str]:
        """Top-5 neighbours of six seeded queries on the run's own protocol (every recipe): correct
        neighbours framed green, wrong ones red."""
        from ..data.transforms import IMAGENET_MEAN, IMAGENET_STD
        from ..evaluation import plot_retrieval_grid_from_embeddings

        query_split, reference_splits = self.splits_to_eval[0]
        gallery_set = None
        if reference_embeddings is not None:  # the splits and order of Evaluator.capture_hook
            others = [self.eval_sets[s] for s in reference_splits if s != query_split]
            gallery_set = others[0] if len(others) == 1 else torch.utils.data.ConcatDataset(others)
        path = os.path.join(self.run_dir, "retrieval_grid.png")
        plot_retrieval_grid_from_embeddings(
            embeddings, reference_embeddings, labels, reference_labels, self.eval_sets[query_split], gallery_set,
            path, c=self.geometry if self.eval_curvature() is not None else None,
            metric="euclidean",  # the tester's kNN on unnormalised outputs when there is no curvature
            n_queries=6, k=5, seed=self.args.seed, mean=IMAGENET_MEAN, std=IMAGENET_STD)
        return {"retrieval_grid": path}

    # ---- setup ----
    def method_check(self) -> Optional[Dict]:
        """A recipe's own check of what its method trains, printed beside Recall@K before and after
        training and kept in ``results.json``: None (no check), or a dict with ``name`` (a short label),
        ``value`` (its headline figure), ``line`` (the printed line) and any details. Overridden by a
        recipe whose method Recall@K does not see (HCL's scene → object branch)."""
        return None

    def _load_before(self):
        import json

        path = os.path.join(self.run_dir, "before.json")
        if os.path.isfile(path):
            with open(path) as handle:
                return json.load(handle)
        return None

    def finish_run(self, t0: float, before: Optional[Dict], start_epoch: int, hook, evaluator, trainer, checkpoints,
                   run_logger) -> Dict:
        """After training, on the main process: Recall@K after training (the last epoch's, else evaluated
        now), the plots, ``results.json``, the summary, and the previous run's backup deleted when the
        run completed. Other ranks return ``{}``.

        Args:
            t0: the run's start time (``time.time()``).
            before: Recall@K before training, or None.
            start_epoch: the first epoch this process trained.
            hook: the end-of-epoch evaluator (history, best).
            evaluator: the evaluator (last embeddings, radius report).
            trainer: the trainer (global step).
            checkpoints: the checkpoint manager (paths).
            run_logger: where ``results.json`` goes.

        Returns:
            The ``results.json`` payload.

        Raises:
            RunWriteError: a plot could not be written.
        """
        a = self.args
        results = {}
        if self.ctx.is_main:
            ran_epochs = hook.history and hook.history[-1]["epoch"] >= start_epoch
            started = time.time()
            if ran_epochs and "recall_at_1" in hook.history[-1]:
                after = {k: v for k, v in hook.history[-1].items() if k.startswith("recall_at_")}
            else:
                self.status("evaluating after training ...")
                self.pick_threads()
                after = evaluator(self.trunk, self.head, trainer.global_step)
                self._timed("eval after", started)
            self.say(f"after training   {format_recall(after, a.k_values)}")
            method_after = self.method_check()
            if method_after is not None:
                self.say(f"after training   {method_after['line']}")
            emb = evaluator.last_embeddings
            plots = {}
            if not a.no_plots and emb is not None:
                started = time.time()
                self.status("drawing plots ...")
                try:
                    plots = self.plots(*emb)
                except (ImportError, ValueError) as err:  # e.g. too few points for the bins
                    self.say(f"[pml-hyperbolic] plots skipped: {err}")
                except OSError as err:
                    raise run_write_error(err.filename or self.run_dir, err, "plot") from None
                try:
                    plots.update(self.retrieval_grid(*emb))
                except (ImportError, ValueError) as err:
                    self.say(f"[pml-hyperbolic] retrieval grid skipped: {err}")
                except OSError as err:
                    raise run_write_error(err.filename or self.run_dir, err, "plot") from None
                if plots:
                    self._timed("plots", started)
            results = {
                "recipe": self.name, "dataset": self.dataset_name, "curvature": self.c,
                "before": before, "after": after, "best": hook.best,
                "epochs_completed": hook.history[-1]["epoch"] if hook.history else 0,
                "global_step": trainer.global_step, "history": hook.history, "plots": plots,
                "wall_seconds": round(time.time() - t0, 1), "device": str(self.device),
                "world_size": self.ctx.world_size, "run_dir": self.run_dir,
                "uncertainty_vs_recall": getattr(self, "uncertainty_table", None),
                "uncertainty_failure_auroc": getattr(self, "uncertainty_auroc", None),
                "radius_collapse": evaluator.radius_report.as_dict() if evaluator.radius_report else None,
                "method_check": {"after": method_after} if method_after is not None else None,
                "phase_seconds": {k: round(v, 2) for k, v in self.phase_seconds.items()},
                "tensorboard_logging": run_logger.tensorboard_active,
            }
            unreadable = self.count_unreadable()
            if unreadable:
                self.say(f"[pml-hyperbolic] {unreadable} unreadable image(s) were skipped (see the warnings above; "
                         "dataset.check_images() lists them)")
            results["unreadable_images_skipped"] = unreadable
            results_path = run_logger.write_json("results.json", results)
            checkpoint_paths = [p for p in (checkpoints.last_path, checkpoints.best_path) if os.path.isfile(p)]
            self.say(format_summary(results, a.k_values, results_path, checkpoint_paths,
                                    uncertainty_bins=self.reports_uncertainty))
            stopped_early = (a.stop_after_epoch is not None and results["epochs_completed"] < a.epochs
                             and not trainer.steps_exhausted())
            if not stopped_early:  # complete: the run --overwrite replaced is no longer needed
                try:
                    discard_previous_run(self.run_dir)
                except OSError as err:
                    self.say(f"[pml-hyperbolic] could not delete the previous run's backup ({err.strerror or err}); "
                             "delete it yourself")
        return results
