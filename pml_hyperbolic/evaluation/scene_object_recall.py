r"""Does a scene find the objects it contains? The check of HCL's scene ⊃ object relation.

HCL (Ge et al., CVPR 2023) trains a scene embedding to lie near the embeddings of the objects it
contains, in a Poincaré ball. :func:`scene_object_recall` measures exactly that on held-out scenes:
for scene :math:`s` with contained objects :math:`O(s)` among all objects :math:`O` of the evaluation,

.. math::

    \text{R@1} = \frac{1}{|S|}\sum_{s \in S} \big[\operatorname*{arg\,min}_{o \in O} d_c(s, o) \in O(s)\big],
    \qquad
    \text{chance} = \frac{1}{|S|}\sum_{s \in S} \frac{|O(s)|}{|O|},

with :math:`d_c` the Poincaré distance, and the share of (scene, contained object) pairs whose scene
lies nearer the origin than the object (:math:`\|s\| < \|o\|`: the scene as the more general of the
two). Why a check of its own: HCL's recipes score the trunk by Recall@K of object classes, which the
scene branch does not train; this one reads what it trains. It is an evaluation function: no gradient.

Design note: docs/design/evaluation.md
"""
from __future__ import annotations

import torch

from .. import poincare_ball as pb

__all__ = ["scene_object_recall"]


def _matrix(t, name: str) -> torch.Tensor:
    pb.check_tensor(t, name)
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor (one embedding per row), got {tuple(t.shape)}")
    pb.check_finite(t, name)
    return t.detach()


@torch.no_grad()
def scene_object_recall(scene_embeddings: torch.Tensor, object_embeddings: torch.Tensor,
                        object_scene: torch.Tensor, c) -> dict:
    """How often each scene's nearest object (Poincaré distance) is one it contains.

    Args:
        scene_embeddings: (S, D) points of the ball (projected inside it first).
        object_embeddings: (O, D) points of the ball, every object of the evaluation.
        object_scene: (O,) integer tensor, the index of the scene that contains each object.
        c: the curvature: a number > 0, a tensor, or a :class:`~pml_hyperbolic.PoincareGeometry`.

    Returns:
        ``{"recall_at_1", "chance", "scene_nearer_origin", "scene_d0_median", "object_d0_median",
        "scenes", "objects"}``: the share of scenes whose nearest object is contained in them, that
        share for a random ranking, the share of (scene, contained object) pairs with the scene nearer
        the origin, the median (the lower middle value for an even count) distance to the origin d₀ of
        the scenes and of the objects (scenes at the ball's edge while the objects are not: the
        branch cannot rank objects by direction), and the counts.

    Raises:
        ValueError: an embedding matrix is empty, not 2-D or not finite; the two have different
            widths; ``object_scene`` does not give one scene index in [0, S) per object, or a scene
            contains no object.
        TypeError: an embedding matrix is not floating point, or ``object_scene`` not integer.
    """
    scenes = _matrix(scene_embeddings, "scene_embeddings")
    objects = _matrix(object_embeddings, "object_embeddings")
    if scenes.shape[1] != objects.shape[1]:
        raise ValueError(f"scene_embeddings has {scenes.shape[1]} dimensions, object_embeddings {objects.shape[1]}")
    if not isinstance(object_scene, torch.Tensor) or object_scene.ndim != 1:
        raise ValueError("object_scene must be a 1-D tensor with the scene index of each object")
    if object_scene.is_floating_point() or object_scene.dtype == torch.bool:
        raise TypeError(f"object_scene must be an integer tensor, got {object_scene.dtype}")
    if object_scene.shape[0] != objects.shape[0]:
        raise ValueError(f"object_scene has {object_scene.shape[0]} entries for {objects.shape[0]} objects")
    owner = object_scene.to(device=objects.device, dtype=torch.long)
    n_scenes = scenes.shape[0]
    if bool((owner < 0).any()) or bool((owner >= n_scenes).any()):
        raise ValueError(f"object_scene must hold scene indices in [0, {n_scenes})")
    counts = torch.bincount(owner, minlength=n_scenes)
    if bool((counts == 0).any()):
        empty = int(torch.nonzero(counts == 0)[0])
        raise ValueError(f"scene {empty} contains no object (every scene needs at least one)")
    cf = pb.as_curvature(c, torch.float64)
    s = pb.project(scenes.double(), cf)
    o = pb.project(objects.to(s.device).double(), cf)
    nearest = pb.pairwise_dist(s, o, cf).argmin(dim=1)
    hit = owner[nearest] == torch.arange(n_scenes, device=owner.device)
    nearer = s.norm(dim=1)[owner] < o.norm(dim=1)
    return {"recall_at_1": float(hit.double().mean()),
            "chance": float((counts.double() / objects.shape[0]).mean()),
            "scene_nearer_origin": float(nearer.double().mean()),
            "scene_d0_median": float(pb.dist0(s, cf).median()), "object_d0_median": float(pb.dist0(o, cf).median()),
            "scenes": int(n_scenes), "objects": int(objects.shape[0])}
