import math

import pytest
import torch

from pml_hyperbolic import PoincareGeometry
from pml_hyperbolic.evaluation import scene_object_recall


def _layout():
    """Two scenes on the x axis; scene 0 contains objects 0 and 1, scene 1 contains object 2."""
    scenes = torch.tensor([[0.10, 0.0], [-0.10, 0.0]])
    objects = torch.tensor([[0.30, 0.0], [0.0, 0.50], [-0.35, 0.0]])
    return scenes, objects, torch.tensor([0, 0, 1])


def test_reference_values():
    scenes, objects, owner = _layout()
    out = scene_object_recall(scenes, objects, owner, c=1.0)
    # nearest object of scene 0 is object 0 (its own), of scene 1 object 2 (its own)
    assert out["recall_at_1"] == 1.0
    assert out["chance"] == pytest.approx((2 / 3 + 1 / 3) / 2)
    assert out["scene_nearer_origin"] == 1.0  # 0.1 < 0.3, 0.1 < 0.5, 0.1 < 0.35
    assert (out["scenes"], out["objects"]) == (2, 3)
    # d₀ = 2 artanh(‖x‖) at c = 1: both scenes at 0.1, the middle object at 0.35
    assert out["scene_d0_median"] == pytest.approx(2 * math.atanh(0.1), rel=1e-6)
    assert out["object_d0_median"] == pytest.approx(2 * math.atanh(0.35), rel=1e-6)


def test_a_scene_whose_nearest_object_is_foreign_misses():
    scenes, objects, owner = _layout()
    objects = objects.clone()
    objects[2] = torch.tensor([0.12, 0.0])  # scene 1's object now sits next to scene 0
    out = scene_object_recall(scenes, objects, owner, c=1.0)
    assert out["recall_at_1"] == 0.5  # scene 0 finds object 2 (foreign), scene 1 its own object 2
    assert out["scene_nearer_origin"] == pytest.approx(1.0)


def test_scene_farther_than_its_object_and_geometry_curvature():
    scenes = torch.tensor([[0.6, 0.0]])
    objects = torch.tensor([[0.5, 0.0], [0.0, 0.7]])
    out = scene_object_recall(scenes, objects, torch.tensor([0, 0]), c=PoincareGeometry(c=1.0))
    assert out["recall_at_1"] == 1.0 and out["chance"] == 1.0
    assert out["scene_nearer_origin"] == 0.5  # 0.6 > 0.5, 0.6 < 0.7


def test_uses_the_poincare_distance_not_the_euclidean_one():
    # near the boundary the ball stretches distances: from scene 0 at 0.9, object 1 at 0.99 is the
    # nearer in the plane (0.09 against 0.15) and the farther in the ball (2.35 against 0.99)
    scenes = torch.tensor([[0.9, 0.0], [-0.5, 0.0]])
    objects = torch.tensor([[0.75, 0.0], [0.99, 0.0]])
    owner = torch.tensor([0, 1])
    assert int(torch.cdist(scenes, objects)[0].argmin()) == 1
    out = scene_object_recall(scenes, objects, owner, c=1.0)
    assert out["recall_at_1"] == 0.5  # scene 0 finds its object 0; scene 1 finds object 0 too (foreign)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"scene_embeddings": torch.zeros(0, 2)}, ValueError, "scene_embeddings"),
    ({"object_embeddings": torch.zeros(3)}, ValueError, "object_embeddings"),
    ({"object_embeddings": torch.zeros(3, 2, dtype=torch.long)}, TypeError, "floating"),
    ({"object_embeddings": torch.full((3, 2), float("nan"))}, ValueError, "NaN"),
    ({"object_embeddings": torch.zeros(3, 4)}, ValueError, "dimensions"),
    ({"object_scene": torch.tensor([0.0, 0.0, 1.0])}, TypeError, "integer"),
    ({"object_scene": torch.tensor([0, 1])}, ValueError, "2 entries for 3 objects"),
    ({"object_scene": torch.tensor([0, 0, 2])}, ValueError, r"\[0, 2\)"),
    ({"object_scene": torch.tensor([0, 0, 0])}, ValueError, "scene 1 contains no object"),
    ({"c": -1.0}, ValueError, "curvature"),
])
def test_bad_inputs_raise_one_clear_error(kwargs, error, match):
    scenes, objects, owner = _layout()
    args = {"scene_embeddings": scenes, "object_embeddings": objects, "object_scene": owner, "c": 1.0, **kwargs}
    with pytest.raises(error, match=match):
        scene_object_recall(**args)
