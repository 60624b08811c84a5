"""Recall@K evaluation with PML's ``GlobalEmbeddingSpaceTester`` and an end-of-epoch hook.

PML's ``HookContainer.end_of_epoch_hook`` only runs the tester when a record-keeper is installed;
:class:`EpochEndEvaluator` is a plain callable that always runs it, logs the epoch, writes the
checkpoint and tracks the best Recall@1.

Design note: docs/design/evaluation.md
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import tqdm
from pytorch_metric_learning.testers import GlobalEmbeddingSpaceTester
from pytorch_metric_learning.utils import common_functions as c_f

from ..data.image_list import collate_skipping_unreadable

from .checkpoint import rng_state, set_rng_state, unwrap
from .trainer import (CPU_TRUNK_CHUNK_SIZE, checked_chunk_size, chunked_forward_applies, forward_in_chunks, is_frozen,
                      progress_enabled, retain_freed_memory)


def build_tester(c: Optional[float], k_values: Sequence[int] = (1, 2, 4, 8), batch_size: int = 128,
                 device: Optional[torch.device] = None, num_workers: int = 0, cache_frozen_trunk: bool = True,
                 trunk_chunk_size: Optional[int] = CPU_TRUNK_CHUNK_SIZE,
                 use_trunk_output: bool = False) -> GlobalEmbeddingSpaceTester:
    """The recipes' Recall@K tester.

    It scores the raw head output (``normalize_embeddings=False``: L2-normalising ball points would
    move them onto/outside the boundary) with the exact hyperbolic kNN when ``c`` is given, PML's
    default kNN otherwise (:class:`~pml_hyperbolic.evaluation.RecallAtKAccuracyCalculator`), and
    computes only Recall@K (PML's default metric set would also run k-means for NMI/AMI).

    Args:
        c: curvature of the embeddings' ball, or None for a Euclidean/cosine head.
        k_values: the K of Recall@K.
        batch_size: images per embedding batch.
        device: where the embeddings are computed (None: PML's default).
        num_workers: DataLoader workers.
        cache_frozen_trunk: see :class:`SkippingEmbeddingSpaceTester`.
        trunk_chunk_size: see :class:`SkippingEmbeddingSpaceTester`.
        use_trunk_output: score the trunk's features, not the head's output (methods whose head is a
            projection that only serves the loss, as MoCo's and HCL's MLP).

    Returns:
        A :class:`SkippingEmbeddingSpaceTester`.

    Design note: docs/design/evaluation.md
    """
    from ..evaluation import RecallAtKAccuracyCalculator

    # Only Recall@K: PML's default metric set would also run k-means for NMI/AMI on every test.
    # check_radius=False: the recipes' evaluation hook checks the radius itself (once per run)
    calculator = RecallAtKAccuracyCalculator(k_values=tuple(k_values), c=c, check_radius=False,
                                             include=tuple(f"recall_at_{k}" for k in k_values))
    return SkippingEmbeddingSpaceTester(
        normalize_embeddings=False, batch_size=batch_size, dataloader_num_workers=num_workers,
        data_device=device, accuracy_calculator=calculator, end_of_testing_hook=lambda tester: None,
        use_trunk_output=use_trunk_output, cache_frozen_trunk=cache_frozen_trunk, trunk_chunk_size=trunk_chunk_size)


# Transforms whose output depends on the input alone (no random draw); matched by class name so
# that torchvision's v1 and v2 classes and this package's ConvertToRGB and ToNormalizedTensor count.
DETERMINISTIC_TRANSFORMS = frozenset({
    "Compose", "ToTensor", "PILToTensor", "ToImage", "ToPILImage", "ConvertImageDtype", "ToDtype",
    "Normalize", "Resize", "CenterCrop", "Pad", "Grayscale", "ConvertToRGB", "ToNormalizedTensor",
})


def has_deterministic_transform(dataset: Any) -> bool:
    """True when the first ``transform`` found on ``dataset`` (through ``Subset.dataset`` and
    ``.base`` wrappers) is None or made only of :data:`DETERMINISTIC_TRANSFORMS`: then reading an
    item twice gives the same tensor. A dataset without a ``transform`` attribute is unknown: False."""
    seen = set()
    while dataset is not None and id(dataset) not in seen:
        seen.add(id(dataset))
        if hasattr(dataset, "transform"):
            return _transform_is_deterministic(dataset.transform)
        dataset = getattr(dataset, "dataset", None) or getattr(dataset, "base", None)
    return False


def _transform_is_deterministic(transform) -> bool:
    if transform is None:
        return True
    if type(transform).__name__ not in DETERMINISTIC_TRANSFORMS:
        return False
    return all(_transform_is_deterministic(t) for t in getattr(transform, "transforms", ()))


def parameter_fingerprint(model: torch.nn.Module) -> Tuple:
    """What changes whenever a parameter or buffer of ``model`` may have changed: per tensor its
    storage address, shape, dtype and version counter (bumped by every in-place write: optimiser
    steps, ``load_state_dict``), plus a float64 checksum (writes through ``.data`` bypass the version
    counter).

    Args:
        model: the module.

    Returns:
        One ``(address, shape, dtype, version, checksum)`` tuple per parameter and buffer.
    """
    with torch.no_grad():
        return tuple((t.data_ptr(), tuple(t.shape), t.dtype, t._version,
                      float(t.detach().double().sum()) if t.is_floating_point() else int(t.detach().sum()))
                     for t in (*model.parameters(), *model.buffers()))


class SkippingEmbeddingSpaceTester(GlobalEmbeddingSpaceTester):
    """``GlobalEmbeddingSpaceTester`` for this package's runs:

    * its embedding pass tolerates batches made smaller by
      :func:`~pml_hyperbolic.data.collate_skipping_unreadable`. PML's own pass allocates one row per
      dataset item and fills them in order, so skipped items would leave zero rows (points at the
      origin, labelled 0) at the end that take part in the evaluation; here only the rows that were
      computed are returned;
    * with ``cache_frozen_trunk`` (default) and a frozen trunk (no parameter requiring a gradient),
      the trunk's outputs on each split are kept in memory after the first test and later tests
      re-apply only the head to them. This is exact, so it is done only when the split's
      transform is deterministic (:func:`has_deterministic_transform`) and the trunk, its parameters
      (:func:`parameter_fingerprint`), the dataset, the batch size, device and dtype are all
      unchanged; otherwise the trunk runs again. The head sees the very same batches either way,
      so the embeddings are bit-identical. Memory: one float32 row of trunk features per image;
      ``clear_trunk_feature_cache()`` frees it;
    * on CPU, a frozen trunk runs in chunks of ``trunk_chunk_size`` images
      (:func:`~pml_hyperbolic.training.trainer.forward_in_chunks`: same outputs, far fewer cache
      misses than a batch of 256 small images); None = whole batches;
    * on a CPU device, freed activation memory stays in the process (``keep_freed_memory``:
      :func:`~pml_hyperbolic.training.trainer.retain_freed_memory`, process-wide): otherwise each
      batch page-faults its activations in anew;
    * progress bars for each split's embedding pass and for the kNN, on stderr (silent when
      ``TQDM_DISABLE`` is set, read at each test: tqdm itself reads it only when imported).

    Args:
        cache_frozen_trunk: keep a frozen trunk's features per split (True or False).
        trunk_chunk_size: CPU chunk size of a frozen trunk's forward; None = whole batches.
        keep_freed_memory: retain freed activation memory on a CPU device.
        *args: PML ``GlobalEmbeddingSpaceTester`` positional arguments.
        **kwargs: PML ``GlobalEmbeddingSpaceTester`` keyword arguments.

    Raises:
        ValueError: a non-bool ``cache_frozen_trunk`` or a bad ``trunk_chunk_size``.

    Design note: docs/design/evaluation.md
    """

    def __init__(self, *args: Any, cache_frozen_trunk: bool = True,
                 trunk_chunk_size: Optional[int] = CPU_TRUNK_CHUNK_SIZE, keep_freed_memory: bool = True,
                 **kwargs: Any):
        if not isinstance(cache_frozen_trunk, bool):
            raise ValueError(f"cache_frozen_trunk must be True or False, got {cache_frozen_trunk!r}")
        chunk_size = checked_chunk_size(trunk_chunk_size)
        super().__init__(*args, **kwargs)
        if keep_freed_memory and torch.device(self.data_device).type == "cpu":
            retain_freed_memory()
        self.cache_frozen_trunk = cache_frozen_trunk
        self.trunk_chunk_size = chunk_size
        self.trunk_feature_cache: Dict[str, Tuple[Tuple, List]] = {}
        self._split_name: Optional[str] = None
        self.cache_hits: List[str] = []  # splits whose last embedding pass used cached features

    def clear_trunk_feature_cache(self) -> None:
        self.trunk_feature_cache.clear()

    def get_all_embeddings_for_all_splits(self, dataset_dict: Dict, trunk_model: torch.nn.Module,
                                          embedder_model: torch.nn.Module,
                                          splits_to_compute_embeddings: Sequence[str], collate_fn: Any) -> Dict:
        # PML passes the dataset but not its split name down to compute_all_embeddings: the cache
        # is per split
        self.cache_hits = []
        embeddings_and_labels = {}
        for split_name in splits_to_compute_embeddings:
            self._split_name = split_name
            try:
                embeddings_and_labels[split_name] = self.get_all_embeddings(
                    dataset_dict[split_name], trunk_model, embedder_model, collate_fn)
            finally:
                self._split_name = None
        return embeddings_and_labels

    def _cache_key(self, dataloader, trunk_model) -> Optional[Tuple]:
        """Everything the trunk features depend on, or None when they must not be cached."""
        if (not self.cache_frozen_trunk or self._split_name is None or trunk_model.training
                or not is_frozen(trunk_model) or not has_deterministic_transform(dataloader.dataset)):
            return None
        dataset = dataloader.dataset
        # the objects themselves, not their id(): an id can be reused by a new object
        return (trunk_model, parameter_fingerprint(trunk_model), dataset, len(dataset), dataloader.batch_size,
                dataloader.collate_fn, str(self.data_device), self.dtype, self.use_trunk_output)

    def trunk_features(self, trunk_model: torch.nn.Module, images: Any) -> torch.Tensor:
        images = c_f.to_device(images, device=self.data_device, dtype=self.dtype)
        if chunked_forward_applies(trunk_model, images, self.trunk_chunk_size, require_frozen=False):
            return forward_in_chunks(trunk_model, images, self.trunk_chunk_size)
        return trunk_model(images)

    def head_output(self, embedder_model: torch.nn.Module, features: torch.Tensor) -> torch.Tensor:
        return features if self.use_trunk_output else embedder_model(features)

    def compute_all_embeddings(self, dataloader: Any, trunk_model: torch.nn.Module,
                               embedder_model: torch.nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
        split = self._split_name
        key = self._cache_key(dataloader, trunk_model)
        cached = self.trunk_feature_cache.get(split) if key is not None else None
        embeddings, labels = [], []
        with torch.no_grad():
            if cached is not None and cached[0] == key:
                self.cache_hits.append(split)
                for features, label in tqdm.tqdm(cached[1], desc=f"embedding {split} (cached trunk features)",
                                                 unit="batch", leave=False, dynamic_ncols=True,
                                                 disable=not progress_enabled()):
                    embeddings.append(self.head_output(embedder_model, features).to(self.data_device))
                    labels.append(label)
            else:
                self.trunk_feature_cache.pop(split, None)  # stale (or never valid): free it now
                record = [] if key is not None else None
                for data in tqdm.tqdm(dataloader, desc=f"embedding {split or 'split'}", unit="batch",
                                      leave=False, dynamic_ncols=True, disable=not progress_enabled()):
                    if data is None:  # every image of the batch was unreadable
                        continue
                    images, label = self.data_and_label_getter(data)
                    label = c_f.process_label(label, "all", self.label_mapper)
                    if label.dim() == 1:
                        label = label.unsqueeze(1)
                    label = label.to(self.data_device)
                    features = self.trunk_features(trunk_model, images)
                    if record is not None:
                        record.append((features, label))
                    embeddings.append(self.head_output(embedder_model, features).to(self.data_device))
                    labels.append(label)
                if record:
                    self.trunk_feature_cache[split] = (key, record)
        if not embeddings:
            raise RuntimeError("no readable image in the evaluation set")
        return torch.cat(embeddings), torch.cat(labels)

    def do_knn_and_accuracies(self, accuracies: Dict, embeddings_and_labels: Dict, query_split_name: str,
                              reference_split_names: Sequence[str]) -> Any:
        queries = len(embeddings_and_labels[query_split_name][0])
        references = sum(len(embeddings_and_labels[r][0]) for r in reference_split_names)
        with tqdm.tqdm(total=1, desc=f"kNN: {queries} {query_split_name} queries vs {references} references",
                       bar_format="{desc} {elapsed}", leave=False, dynamic_ncols=True,
                       disable=not progress_enabled()) as bar:
            out = super().do_knn_and_accuracies(accuracies, embeddings_and_labels, query_split_name,
                                                reference_split_names)
            bar.update(1)
        return out


def eval_protocol(dataset_name: str) -> List[Tuple[str, List[str]]]:
    """Query/reference splits: In-Shop, the bundled glyphs (held-out type style as queries), the
    bundled icons and the bundled Iconify sets (held-out themes or sets as queries) are
    query→gallery; CUB, Cars and SOP are test→test (leave-one-out)."""
    if dataset_name in ("inshop", "glyphs", "icons", "iconify"):
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
    """Runs the tester on the eval datasets and keeps the last embeddings for plots.

    Evaluation saves and restores every RNG state, so how often one evaluates never changes training.

    Args:
        tester: a tester from :func:`build_tester`.
        eval_sets: split name → dataset.
        splits_to_eval: ``[(query_split, [reference_splits])]`` (see :func:`eval_protocol`).
        k_values: the K of Recall@K.
        geometry: the ball of the scored embeddings, or None (not ball points). When given, each
            evaluation after training began (epoch >= 1) checks the query embeddings' radius
            (:func:`~pml_hyperbolic.evaluation.radius_collapse`, kept in ``radius_report``) and
            the first collapse found issues one ``RadiusCollapseWarning`` per evaluator. Epoch 0
            is skipped: the polar head starts every sample at one radius.
    """

    def __init__(self, tester: GlobalEmbeddingSpaceTester, eval_sets: Dict,
                 splits_to_eval: Sequence[Tuple[str, Sequence[str]]], k_values: Sequence[int],
                 geometry: Optional[Any] = None):
        self.tester = tester
        self.eval_sets = eval_sets
        self.splits_to_eval = splits_to_eval
        self.k_values = list(k_values)
        self.last_embeddings = None
        self.geometry = geometry
        self.radius_report = None  # the last evaluation's RadiusReport (None: healthy or unchecked)
        self._radius_warned = False

    def __call__(self, trunk: torch.nn.Module, embedder: torch.nn.Module, epoch: int) -> Dict[str, float]:
        """``{"recall_at_K": value}`` of the first query split; the modules' modes are restored."""
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
        self.check_radius(epoch)
        trunk.train(modes[0])
        embedder.train(modes[1])
        return recall_from_accuracies({query_split: accuracies[query_split]}, self.k_values)

    def check_radius(self, epoch: int) -> None:
        """Set ``radius_report`` from the captured query embeddings (see the class text)."""
        from ..evaluation.radius_health import check_radius, radius_collapse

        self.radius_report = None
        if self.geometry is None or epoch < 1 or self.last_embeddings is None:
            return
        if self._radius_warned:  # one warning per run, not one per epoch
            self.radius_report = radius_collapse(self.last_embeddings[0], self.geometry, what="test queries")
        else:
            self.radius_report = check_radius(self.last_embeddings[0], self.geometry, what="test queries",
                                              stacklevel=3)
            self._radius_warned = self.radius_report is not None

    def capture_hook(self, tester: GlobalEmbeddingSpaceTester) -> None:
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

    Calling it returns False to stop training when ``stop_after_epoch`` is reached (simulated
    interruption).

    Args:
        evaluator: the :class:`Evaluator`, or None for no evaluation.
        checkpoints: a :class:`~pml_hyperbolic.training.CheckpointManager`.
        run_logger: a :class:`~pml_hyperbolic.training.RunLogger`.
        ctx: the :class:`~pml_hyperbolic.training.DistributedContext`.
        k_values: the K of Recall@K (CSV columns).
        curvature_fn: returns the head's current curvature (logged), or None.
        stop_after_epoch: stop after this epoch (None: never).
        verbose: print one line per epoch.
        history: rows of earlier epochs (a resumed run).
        best: the best epoch so far (a resumed run).
        eval_every: evaluate every this many epochs (0: only at the end).
        num_epochs: the last epoch (always evaluated).
    """

    def __init__(self, evaluator: Optional[Evaluator], checkpoints: Any, run_logger: Any, ctx: Any,
                 k_values: Sequence[int], curvature_fn: Optional[Callable[[], float]] = None,
                 stop_after_epoch: Optional[int] = None, verbose: bool = True,
                 history: Optional[List[Dict]] = None, best: Optional[Dict] = None, eval_every: int = 1,
                 num_epochs: Optional[int] = None):
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

    def should_evaluate(self, trainer: Any) -> bool:
        """Every ``eval_every`` epochs (0: only at the end), and always after the last epoch."""
        epoch = trainer.epoch
        last = (self.num_epochs is not None and epoch >= self.num_epochs) or trainer.steps_exhausted() or (
            self.stop_after_epoch is not None and epoch >= self.stop_after_epoch)
        return last or (self.eval_every > 0 and epoch % self.eval_every == 0)

    def save_checkpoint(self, trainer: Any, epoch: int, is_best: bool) -> None:
        """``last.pt`` (and ``best.pt``) through the checkpoint manager; a failed write as one line.

        Args:
            trainer: the trainer.
            epoch: the epoch just completed.
            is_best: whether this epoch's Recall@1 is the best so far.

        Raises:
            RunWriteError: the checkpoint could not be written (an ``OSError``, or the
                ``RuntimeError`` torch's zip writer raises on a full disk, e.g. ``unexpected pos``);
                the file written before it stays in place, since checkpoints are written to a
                temporary file and then renamed.
        """
        from .config import ConfigError, RunWriteError, run_write_error

        try:
            self.checkpoints.save(trainer, epoch, self.best, self.history, is_best)
        except ConfigError as err:  # the manager's own message for an OSError
            raise RunWriteError(str(err)) from None
        except (OSError, RuntimeError) as err:
            paths = [getattr(self.checkpoints, "last_path", "last.pt")]
            if is_best:
                paths.append(getattr(self.checkpoints, "best_path", "best.pt"))
            raise run_write_error(" or ".join(paths), err, "checkpoint",
                                  advice="The previous checkpoint there is intact; free space or choose another "
                                         "--output-dir.") from None

    def __call__(self, trainer: Any) -> bool:
        from .distributed import barrier

        epoch = trainer.epoch
        if self.ctx.is_main:
            recall = {}
            if self.evaluator is not None and self.should_evaluate(trainer):
                recall = self.evaluator(trainer.models["trunk"], trainer.models["embedder"], epoch)
            # One learning-rate column per optimiser, named like --lr / --head-lr's targets
            # ("lr_trunk", "lr_embedder", "lr_metric_loss"), so the log matches config.json.
            lrs = {f"lr_{name[:-len('_optimizer')] if name.endswith('_optimizer') else name}": opt.param_groups[0]["lr"]
                   for name, opt in trainer.optimizers.items()}
            # Fixed columns (the CSV header is written once): Recall@K is empty on epochs without evaluation.
            row = {"epoch": epoch, "step": trainer.global_step,
                   "loss": getattr(trainer, "last_epoch_loss", float("nan")), **lrs,
                   "curvature": float(self.curvature_fn()) if self.curvature_fn else float("nan"),
                   **{f"recall_at_{k}": recall.get(f"recall_at_{k}", "") for k in self.k_values},
                   "epoch_seconds": round(time.time() - self.epoch_start, 2)}
            self.run_logger.log_epoch(row)
            self.history.append({k: v for k, v in row.items() if v != ""})  # no empty placeholders
            r1 = recall.get("recall_at_1")
            is_best = r1 is not None and r1 > self.best["recall_at_1"]
            if is_best:
                self.best = {"epoch": epoch, **recall}
            self.save_checkpoint(trainer, epoch, is_best)
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
