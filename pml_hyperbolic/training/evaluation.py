"""Recall@K evaluation with PML's ``GlobalEmbeddingSpaceTester`` and an end-of-epoch hook.

PML's ``HookContainer.end_of_epoch_hook`` only runs the tester when a record-keeper is installed;
:class:`EpochEndEvaluator` is a plain callable that always runs it, logs the epoch, writes the
checkpoint and tracks the best Recall@1.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from pytorch_metric_learning.testers import GlobalEmbeddingSpaceTester
from pytorch_metric_learning.utils import common_functions as c_f

from ..data.image_list import collate_skipping_unreadable

from .checkpoint import rng_state, set_rng_state, unwrap


def build_tester(c: Optional[float], k_values: Sequence[int] = (1, 2, 4, 8), batch_size: int = 128,
                 device=None, num_workers: int = 0) -> GlobalEmbeddingSpaceTester:
    """Tester over the raw head output (``normalize_embeddings=False``: L2-normalising ball points
    would move them onto/outside the boundary) with the exact hyperbolic kNN when ``c`` is given,
    cosine/Euclidean kNN otherwise (helper-D's :class:`RecallAtKAccuracyCalculator`)."""
    from ..evaluation import RecallAtKAccuracyCalculator

    # Only Recall@K: PML's default metric set would also run k-means for NMI/AMI on every test.
    calculator = RecallAtKAccuracyCalculator(k_values=tuple(k_values), c=c,
                                             include=tuple(f"recall_at_{k}" for k in k_values))
    return SkippingEmbeddingSpaceTester(
        normalize_embeddings=False, batch_size=batch_size, dataloader_num_workers=num_workers,
        data_device=device, accuracy_calculator=calculator, end_of_testing_hook=lambda tester: None)


class SkippingEmbeddingSpaceTester(GlobalEmbeddingSpaceTester):
    """``GlobalEmbeddingSpaceTester`` whose embedding pass tolerates batches made smaller by
    :func:`~pml_hyperbolic.data.collate_skipping_unreadable`. PML's own pass allocates one row per
    dataset item and fills them in order, so skipped items would leave zero rows (points at the
    origin, labelled 0) at the end that take part in the evaluation; here only the rows that were
    computed are returned."""

    def compute_all_embeddings(self, dataloader, trunk_model, embedder_model):
        embeddings, labels = [], []
        with torch.no_grad():
            for data in dataloader:
                if data is None:  # every image of the batch was unreadable
                    continue
                images, label = self.data_and_label_getter(data)
                label = c_f.process_label(label, "all", self.label_mapper)
                if label.dim() == 1:
                    label = label.unsqueeze(1)
                emb = self.get_embeddings_for_eval(trunk_model, embedder_model, images)
                embeddings.append(emb.to(self.data_device))
                labels.append(label.to(self.data_device))
        if not embeddings:
            raise RuntimeError("no readable image in the evaluation set")
        return torch.cat(embeddings), torch.cat(labels)


def eval_protocol(dataset_name: str) -> List[Tuple[str, List[str]]]:
    """Query/reference splits: In-Shop and the bundled glyphs (held-out type style as queries) are
    query→gallery; CUB, Cars and SOP are test→test (leave-one-out)."""
    if dataset_name in ("inshop", "glyphs"):
        return [("query", ["gallery"])]
    return [("test", ["test"])]


def recall_from_accuracies(accuracies: Dict, k_values: Sequence[int]) -> Dict[str, float]:
    """Flatten PML's ``{split: {"recall_at_1_level0": ...}}`` into ``{"recall_at_1": ...}``."""
    split = next(iter(accuracies))
    row = accuracies[split]
    out = {}
    for k in k_values:
        for key in (f"recall_at_{k}_level0", f"recall_at_{k}"):
            if key in row:
                out[f"recall_at_{k}"] = float(row[key])
                break
    return out


def format_recall(recall: Dict[str, float], k_values: Sequence[int]) -> str:
    return "  ".join(f"Recall@{k} {recall.get(f'recall_at_{k}', float('nan')):.4f}" for k in k_values)


class Evaluator:
    """Runs the tester on the eval datasets and keeps the last embeddings for plots."""

    def __init__(self, tester, eval_sets: Dict, splits_to_eval, k_values: Sequence[int]):
        self.tester = tester
        self.eval_sets = eval_sets
        self.splits_to_eval = splits_to_eval
        self.k_values = list(k_values)
        self.last_embeddings = None

    def __call__(self, trunk, embedder, epoch: int) -> Dict[str, float]:
        # Evaluation must not move the training RNG (its DataLoaders draw seeds from it): otherwise
        # how often one evaluates, or a stop/--resume at an evaluated epoch, would change training.
        saved = rng_state()
        try:
            return self._evaluate(trunk, embedder, epoch)
        finally:
            set_rng_state(saved)

    def _evaluate(self, trunk, embedder, epoch: int) -> Dict[str, float]:
        trunk, embedder = unwrap(trunk), unwrap(embedder)
        modes = (trunk.training, embedder.training)
        accuracies = self.tester.test(self.eval_sets, epoch, trunk, embedder,
                                      splits_to_eval=[(q, list(r)) for q, r in self.splits_to_eval],
                                      collate_fn=collate_skipping_unreadable)
        query_split = self.splits_to_eval[0][0]
        # The tester deletes its embeddings after testing; capture_hook (its end_of_testing_hook)
        # kept the query split's embeddings for the end-of-run plots.
        self.last_embeddings = getattr(self, "_captured", None)
        trunk.train(modes[0])
        embedder.train(modes[1])
        return recall_from_accuracies({query_split: accuracies[query_split]}, self.k_values)

    def capture_hook(self, tester) -> None:
        split, refs = self.splits_to_eval[0][0], list(self.splits_to_eval[0][1])
        emb, labels = tester.embeddings_and_labels[split]
        captured = [emb.detach().cpu(), labels[:, 0].detach().cpu()]
        # the reference splits too (query → gallery protocols), so the plots use the run's own retrieval
        others = [r for r in refs if r != split and r in tester.embeddings_and_labels]
        if others:
            ref = [tester.embeddings_and_labels[r] for r in others]
            captured += [torch.cat([e for e, _ in ref]).detach().cpu(), torch.cat([l[:, 0] for _, l in ref]).detach().cpu()]
        self._captured = tuple(captured)

    def install(self):
        self.tester.end_of_testing_hook = self.capture_hook
        return self


class EpochEndEvaluator:
    """End-of-epoch hook: evaluate (rank 0), log a CSV row, checkpoint, track the best Recall@1.

    Returns False to stop training when ``stop_after_epoch`` is reached (simulated interruption).
    """

    def __init__(self, evaluator: Optional[Evaluator], checkpoints, run_logger, ctx, k_values,
                 curvature_fn=None, stop_after_epoch: Optional[int] = None, verbose: bool = True,
                 history=None, best=None, eval_every: int = 1, num_epochs: Optional[int] = None):
        self.evaluator = evaluator
        self.checkpoints = checkpoints
        self.run_logger = run_logger
        self.ctx = ctx
        self.k_values = list(k_values)
        self.curvature_fn = curvature_fn
        self.stop_after_epoch = stop_after_epoch
        self.verbose = verbose
        self.history = list(history or [])
        self.best = dict(best or {"epoch": None, "recall_at_1": float("-inf")})
        self.epoch_start = time.time()
        self.eval_every = int(eval_every)
        self.num_epochs = num_epochs

    def should_evaluate(self, trainer) -> bool:
        """Every ``eval_every`` epochs (0: only at the end), and always after the last epoch."""
        epoch = trainer.epoch
        last = (self.num_epochs is not None and epoch >= self.num_epochs) or trainer.steps_exhausted() or (
            self.stop_after_epoch is not None and epoch >= self.stop_after_epoch)
        return last or (self.eval_every > 0 and epoch % self.eval_every == 0)

    def __call__(self, trainer) -> bool:
        from .distributed import barrier

        epoch = trainer.epoch
        if self.ctx.is_main:
            recall = {}
            if self.evaluator is not None and self.should_evaluate(trainer):
                recall = self.evaluator(trainer.models["trunk"], trainer.models["embedder"], epoch)
            lr = next(iter(trainer.optimizers.values())).param_groups[0]["lr"]
            # Fixed columns (the CSV header is written once): Recall@K is empty on epochs without evaluation.
            row = {"epoch": epoch, "step": trainer.global_step,
                   "loss": getattr(trainer, "last_epoch_loss", float("nan")), "lr": lr,
                   "curvature": float(self.curvature_fn()) if self.curvature_fn else float("nan"),
                   **{f"recall_at_{k}": recall.get(f"recall_at_{k}", "") for k in self.k_values},
                   "epoch_seconds": round(time.time() - self.epoch_start, 2)}
            self.run_logger.log_epoch(row)
            self.history.append({k: v for k, v in row.items() if v != ""})  # no empty placeholders
            r1 = recall.get("recall_at_1")
            is_best = r1 is not None and r1 > self.best["recall_at_1"]
            if is_best:
                self.best = {"epoch": epoch, **recall}
            self.checkpoints.save(trainer, epoch, self.best, self.history, is_best)
            if self.verbose:
                msg = f"epoch {epoch} step {trainer.global_step} loss {row['loss']:.4f}"
                if recall:
                    msg += "  " + format_recall(recall, self.k_values)
                print(msg, flush=True)
        barrier(self.ctx)
        self.epoch_start = time.time()
        if self.stop_after_epoch is not None and epoch >= self.stop_after_epoch:
            return False
        return True
