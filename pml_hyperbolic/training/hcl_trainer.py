r"""HCL's training step (Ge et al., CVPR'23, as its authors implemented it) on PML's trainer.

.. math::
    \mathcal{L} = \underbrace{\mathrm{InfoNCE}\big(\hat q_o, \hat k_o, \text{queue}_E\big)}_{\text{MoCo, Euclidean}}
      + 0.1\cdot \underbrace{\mathrm{CE}\big(-d_c(h(s), h(k_o))/T,\ -d_c(h(s), \text{queue}_H)/T\big)}_{\text{scene → object, hyperbolic}}

with :math:`q_o` the query encoder on one object view, :math:`k_o` the momentum encoder on the
other view of the same object, :math:`s` the query encoder on the scene that contains it,
:math:`\hat x = x/\|x\|` and :math:`h = \mathrm{expmap}_0^c` (c = 0.05, no feature clipping,
T = 0.2). Both queues hold momentum-encoder object keys. Queues are PML ``CrossBatchMemory`` with
``enqueue_mask`` (queries are never enqueued); every (query, key) pair gets a label no other
sample ever gets, so the queue holds only negatives for a query.

Design note: docs/design/training.md
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from pytorch_metric_learning.losses import CrossBatchMemory

from ..geometry import map_to_ball
from ..losses import HyperbolicCrossBatchMemory
from ..losses._common import REFERENCE_SET_LOSSES
from .checkpoint import unwrap
from .trainer import HyperbolicTrainer


TRUNK_TRAIN_MODES = ("all", "tail")


def train_only_the_tail(trunk: torch.nn.Module) -> int:
    """Freeze a timm EfficientNet / MobileNet trunk except its last block and ``conv_head``, and every
    BatchNorm at its running statistics (timm's frozen BatchNorm: no statistic or affine update).

    Why: on a small self-supervised budget, fine-tuning the whole trunk (BatchNorm in training mode
    on batches of composed scenes) moves the pretrained representation away faster than the MoCo and
    scene→object losses can shape it; the last block is the part those losses can move usefully.

    Args:
        trunk: a timm EfficientNet-family model (``blocks``, ``conv_head``); modified in place.

    Returns:
        The number of parameters left trainable.

    Raises:
        ValueError: ``trunk`` has no ``blocks`` / ``conv_head`` (not an EfficientNet-family model).

    Design note: docs/design/training.md
    """
    from timm.layers import freeze_batch_norm_2d

    blocks = getattr(trunk, "blocks", None)
    if blocks is None or not hasattr(trunk, "conv_head") or len(blocks) == 0:
        raise ValueError(f"train_only_the_tail needs a timm EfficientNet/MobileNet trunk (blocks, conv_head), got "
                         f"{type(trunk).__name__}; use --trunk-train all for other backbones")
    for name, child in list(trunk.named_children()):
        frozen = freeze_batch_norm_2d(child)
        if frozen is not child:
            setattr(trunk, name, frozen)
    trunk.requires_grad_(False)
    for part in (trunk.blocks[-1], trunk.conv_head):
        for p in part.parameters(recurse=True):
            p.requires_grad_(True)
    for m in trunk.modules():  # frozen BatchNorm buffers only: nothing to train there
        if "FrozenBatchNorm" in type(m).__name__:
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
    return sum(p.numel() for p in trunk.parameters() if p.requires_grad)


class KeyQueue(HyperbolicCrossBatchMemory):
    """The package's one cross-batch memory (:class:`~pml_hyperbolic.losses.HyperbolicCrossBatchMemory`)
    used as HCL's key queue: it adds the queue position to the checkpoint, and does not accept
    ``HypMixLoss`` (its queue holds ball keys, while HypMix maps one Euclidean output to both geometries)."""

    @staticmethod
    def supported_losses():
        return CrossBatchMemory.supported_losses() + list(REFERENCE_SET_LOSSES)

    def queue_state(self) -> dict:
        return {"queue_idx": int(self.queue_idx), "has_been_filled": bool(self.has_been_filled)}

    def load_queue_state(self, state: dict) -> None:
        self.queue_idx = int(state["queue_idx"])
        self.has_been_filled = bool(state["has_been_filled"])


class HCLTrainer(HyperbolicTrainer):
    """Models: ``trunk`` + ``embedder`` (query encoder). The momentum (key) encoder is a copy
    updated as θ_k ← m·θ_k + (1 − m)·θ_q after each optimiser step. Loss funcs: ``metric_loss``
    (MoCo queue) and ``hyperbolic_loss`` (scene→object queue), weighted 1 and ``hyperbolic_weight``.

    Args:
        momentum: m in [0, 1).
        curvature: c of the ball the scene/object embeddings are mapped to.
        hyperbolic_weight: weight of ``hyperbolic_loss`` (unless ``loss_weights`` is given).
        *args: :class:`~pml_hyperbolic.training.HyperbolicTrainer` positional arguments.
        **kwargs: :class:`~pml_hyperbolic.training.HyperbolicTrainer` keyword arguments.

    Raises:
        ValueError: ``momentum`` outside [0, 1).
    """

    def __init__(self, *args: Any, momentum: float = 0.999, curvature: float = 0.05, hyperbolic_weight: float = 0.1,
                 **kwargs: Any):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.momentum = momentum
        self.curvature = curvature
        kwargs.setdefault("loss_weights", {"metric_loss": 1.0, "hyperbolic_loss": hyperbolic_weight})
        super().__init__(*args, **kwargs)
        self.key_trunk = copy.deepcopy(unwrap(self.models["trunk"])).requires_grad_(False)
        self.key_embedder = copy.deepcopy(unwrap(self.models["embedder"])).requires_grad_(False)

    def modify_schema(self):
        self.schema["loss_funcs"].keys = ["metric_loss", "hyperbolic_loss"]

    def get_batch(self):
        from pytorch_metric_learning.utils import common_functions as c_f

        self.dataloader_iter, batch = c_f.try_next_on_generator(self.dataloader_iter, self.dataloader)
        return batch

    @torch.no_grad()
    def key_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """The momentum encoder's float32 embeddings of ``images`` (no gradient)."""
        self.key_trunk.train(self.models["trunk"].training)
        self.key_embedder.train(self.models["embedder"].training)
        with self.autocast():
            out = self.key_embedder(self.key_trunk(images.to(self.data_device)))
        return out.float()

    def calculate_loss(self, curr_batch: Any) -> None:
        scene, view_q, view_k, _ = curr_batch
        b = view_q.shape[0]
        q = self.compute_embeddings(view_q)
        s = self.compute_embeddings(scene)
        k = self.key_embeddings(view_k)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # A label unique to this (query, key) pair across steps and ranks: the queue then only
        # holds negatives for every query.
        ids = torch.arange(b, device=q.device) + (self.global_step * world + rank) * b
        labels = torch.cat([ids, ids])
        mask = torch.cat([torch.zeros(b, dtype=torch.bool), torch.ones(b, dtype=torch.bool)]).to(q.device)
        euclid = torch.nn.functional.normalize(torch.cat([q, k]), dim=1)
        self.losses["metric_loss"] = self.loss_funcs["metric_loss"](euclid, labels, enqueue_mask=mask)
        c = torch.as_tensor(self.curvature, dtype=torch.float32, device=q.device)
        ball = map_to_ball(torch.cat([s, k]), c)  # no feature clipping (HCL)
        self.losses["hyperbolic_loss"] = self.loss_funcs["hyperbolic_loss"](ball, labels, enqueue_mask=mask)

    @torch.no_grad()
    def momentum_update(self):
        for key_mod, q_mod in ((self.key_trunk, self.models["trunk"]), (self.key_embedder, self.models["embedder"])):
            for pk, pq in zip(key_mod.parameters(), unwrap(q_mod).parameters()):
                pk.mul_(self.momentum).add_(pq.detach(), alpha=1.0 - self.momentum)
            for bk, bq in zip(key_mod.buffers(), unwrap(q_mod).buffers()):
                bk.copy_(bq)

    def step_optimizers(self):
        super().step_optimizers()
        self.momentum_update()

    def extra_state_dict(self) -> dict:
        return {"key_trunk": self.key_trunk.state_dict(), "key_embedder": self.key_embedder.state_dict(),
                "queues": {k: unwrap(v).queue_state() for k, v in self.loss_funcs.items()
                           if hasattr(unwrap(v), "queue_state")}}

    def load_extra_state_dict(self, state: dict) -> None:
        if "key_trunk" in state:
            self.key_trunk.load_state_dict(state["key_trunk"])
            self.key_embedder.load_state_dict(state["key_embedder"])
        for k, v in state.get("queues", {}).items():
            unwrap(self.loss_funcs[k]).load_queue_state(v)
