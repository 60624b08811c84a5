"""Scene/object crops for HCL (Ge et al., CVPR'23): a scene crop and a contained object crop.

Each item is ``(scene, object_view_1, object_view_2, object_label)``:

* ``scene``: the crop of the union box of 2–5 object boxes of one image (the hyperbolic query);
* ``object_view_1/2``: two augmentations of a slightly enlarged box of ONE of those objects (the
  MoCo pair; view 2 is also the hyperbolic positive key, an object contained in the scene).

:class:`ComposedGlyphScenes` builds such images from the bundled glyphs (several glyph "objects"
pasted without overlap on one canvas, so every object box lies inside its scene box);
:class:`CocoSceneObjects` reads a COCO-style annotation file (``images``/``annotations`` with
``bbox = [x, y, w, h]``).

Design note: docs/design/training.md
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

Box = Tuple[float, float, float, float]  # x0, y0, x1, y1

#: held-out scenes of the HCL recipe's scene → object check (:func:`scene_object_report`)
SCENE_CHECK_SCENES = 256


def union_box(boxes: Sequence[Box]) -> Box:
    """The smallest box containing every box of ``boxes``."""
    b = np.asarray(boxes, dtype=np.float64)
    return float(b[:, 0].min()), float(b[:, 1].min()), float(b[:, 2].max()), float(b[:, 3].max())


def crop(image: Image.Image, box: Box) -> Image.Image:
    """``image`` cropped to ``box``, its corners rounded to whole pixels."""
    return image.crop(tuple(int(round(v)) for v in box))


def enlarge_box(box: Box, factor: float, width: float, height: float) -> Box:
    """Scale a box about its centre, clipped to the image."""
    x0, y0, x1, y1 = box
    cx, cy, w, h = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) * factor, (y1 - y0) * factor
    return max(0.0, cx - w / 2), max(0.0, cy - h / 2), min(width, cx + w / 2), min(height, cy + h / 2)


def default_view_transform(image_size: int, kind: str = "glyph", glyph_augmentation: str = "crop") -> Callable:
    """The augmentation of an object crop: for photos MoCo v2's (random resized crop, flip, colour
    jitter, greyscale); for glyphs :func:`~pml_hyperbolic.data.transforms.glyph_view_transform` with
    ``glyph_augmentation`` (``"crop"``: the random resized crop alone; ``"font"``: typeface-like changes)."""
    from torchvision import transforms as T

    from ..data.transforms import glyph_view_transform

    if kind == "glyph":
        return glyph_view_transform(image_size, augmentation=glyph_augmentation)
    return T.Compose([T.RandomResizedCrop(image_size, scale=(0.5, 1.0), antialias=True), T.RandomHorizontalFlip(),
                      T.RandomApply([T.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8), T.RandomGrayscale(p=0.2),
                      T.ToTensor(), T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


def default_scene_transform(image_size: int) -> Callable:
    """Resize the scene crop to ``image_size`` square, then ImageNet normalisation."""
    from torchvision import transforms as T

    return T.Compose([T.Resize((image_size, image_size), antialias=True), T.ToTensor(),
                      T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])


class _SceneObjectBase(torch.utils.data.Dataset):
    def __init__(self, image_size: int, view_transform=None, scene_transform=None, enlarge: float = 1.2,
                 kind: str = "glyph", glyph_augmentation: str = "crop"):
        self.image_size = image_size
        self.view_transform = view_transform or default_view_transform(image_size, kind, glyph_augmentation)
        self.scene_transform = scene_transform or default_scene_transform(image_size)
        self.enlarge = enlarge

    def object_box(self, boxes: List[Box], chosen: int, width: float, height: float) -> Box:
        """The crop of object ``chosen``: its box enlarged by ``enlarge``, clipped to the scene box
        (so that the object crop stays contained in the scene, the property HCL's hyperbolic branch
        relies on)."""
        scene_box = union_box(boxes)
        obj_box = enlarge_box(boxes[chosen], self.enlarge, width, height)
        return (max(obj_box[0], scene_box[0]), max(obj_box[1], scene_box[1]),
                min(obj_box[2], scene_box[2]), min(obj_box[3], scene_box[3]))

    def make_item(self, image: Image.Image, boxes: List[Box], chosen: int, label: int):
        scene = crop(image, union_box(boxes))
        obj = crop(image, self.object_box(boxes, chosen, image.width, image.height))
        return (self.scene_transform(scene), self.view_transform(obj), self.view_transform(obj),
                torch.tensor(label, dtype=torch.int64))


class ComposedGlyphScenes(_SceneObjectBase):
    """Scenes of 2–``max_objects`` glyphs pasted without overlap on a white canvas.

    Item ``i`` is the same composition for a given ``seed`` (the layout is seeded by (seed, i));
    the augmentations of the views use the global torch RNG like any transform. Each glyph image is
    the chosen object of one scene per ``len(glyphs)`` items; with fewer scenes than glyph images
    (a check set) the chosen objects are a seeded sample of all of them, not the first images of a
    dataset ordered by class (which would give runs of scenes around one character).

    Args:
        glyphs: a :class:`~pml_hyperbolic.data.GlyphDataset` built with ``transform=None`` (PIL images).
        num_scenes: dataset length (default: one per glyph image).
        canvas_size: side of the square canvas in pixels.
        min_objects: fewest objects per scene (at least 2).
        max_objects: most objects per scene (HCL: up to 5).
        image_size: side of the scene and object tensors.
        seed: seed of the layouts.
        **kwargs: ``view_transform``, ``scene_transform``, ``enlarge`` (object box scale, default 1.2)
            and ``glyph_augmentation``: how the two object views are augmented when no
            ``view_transform`` is given, ``"crop"`` (default; random resized crop only) or ``"font"``
            (typeface-like changes), see :func:`~pml_hyperbolic.data.transforms.glyph_view_transform`.

    Raises:
        ValueError: unless 2 ≤ ``min_objects`` ≤ ``max_objects``.
    """

    def __init__(self, glyphs: Any, num_scenes: Optional[int] = None, canvas_size: int = 112, min_objects: int = 2,
                 max_objects: int = 4, image_size: int = 64, seed: int = 0, **kwargs: Any):
        super().__init__(image_size=image_size, kind="glyph", **kwargs)
        if not 2 <= min_objects <= max_objects:
            raise ValueError(f"need 2 <= min_objects <= max_objects, got {min_objects}, {max_objects}")
        self.glyphs = glyphs
        self.num_scenes = num_scenes or len(glyphs)
        self.canvas_size = canvas_size
        self.min_objects, self.max_objects = min_objects, max_objects
        self.seed = seed
        self.glyph_labels = np.asarray(glyphs.labels)
        self._labels = None
        n = len(glyphs)  # each scene's chosen glyph image: in order, or a seeded sample for fewer scenes
        self._order = np.arange(n) if self.num_scenes >= n else np.random.default_rng([seed, n]).permutation(n)

    def __len__(self) -> int:
        return self.num_scenes

    def layout(self, index: int):
        """(glyph indices, boxes, chosen object) of scene ``index``: cells of a grid, jittered."""
        rng = np.random.default_rng([self.seed, index])
        k = int(rng.integers(self.min_objects, self.max_objects + 1))
        first = self._first_member(index)
        others = rng.choice(len(self.glyphs), size=k - 1, replace=False)
        members = [first] + [int(o) for o in others]
        g = self.glyphs[first][0]
        size = g.width
        grid = max(1, self.canvas_size // size)
        cells = rng.choice(grid * grid, size=k, replace=False)
        slack = self.canvas_size - grid * size
        boxes = []
        for cell in cells:
            cx, cy = int(cell % grid), int(cell // grid)
            jx, jy = (int(rng.integers(0, slack + 1)) if slack else 0), (int(rng.integers(0, slack + 1)) if slack else 0)
            x0, y0 = cx * size + (jx if cx == grid - 1 else 0), cy * size + (jy if cy == grid - 1 else 0)
            boxes.append((float(x0), float(y0), float(x0 + size), float(y0 + size)))
        return members, boxes, 0

    def _first_member(self, index: int) -> int:
        """The glyph image chosen as scene ``index``'s object: in order when the scenes cover every
        glyph image, else from a permutation seeded by ``seed``."""
        return int(self._order[index % len(self._order)])

    @property
    def labels(self) -> np.ndarray:
        """Class of the chosen object of each scene (only for samplers/diagnostics; HCL ignores it)."""
        if self._labels is None:
            self._labels = self.glyph_labels[[self._first_member(i) for i in range(self.num_scenes)]]
        return self._labels

    def canvas(self, index: int):
        """(the composed image of scene ``index``, its object boxes, the chosen object, the glyph indices)."""
        members, boxes, chosen = self.layout(index)
        canvas = Image.new("RGB", (self.canvas_size, self.canvas_size), (255, 255, 255))
        for m, box in zip(members, boxes):
            canvas.paste(self.glyphs[m][0].convert("RGB"), (int(box[0]), int(box[1])))
        return canvas, boxes, chosen, members

    def __getitem__(self, index: int):
        canvas, boxes, chosen, members = self.canvas(index)
        return self.make_item(canvas, boxes, chosen, int(self.glyph_labels[members[chosen]]))

    def scene_and_objects(self, index: int) -> Tuple[torch.Tensor, List[torch.Tensor]]:
        """Scene ``index`` and EVERY object it contains, without augmentation: the scene crop and the
        object crops (as in training, unaugmented) through ``scene_transform``, for
        :func:`scene_object_report`."""
        canvas, boxes, _, _ = self.canvas(index)
        scene = self.scene_transform(crop(canvas, union_box(boxes)))
        objects = [self.scene_transform(crop(canvas, self.object_box(boxes, k, canvas.width, canvas.height)))
                   for k in range(len(boxes))]
        return scene, objects


class CocoSceneObjects(_SceneObjectBase):
    """Scene/object crops from a COCO-style annotation file.

    Images with at least ``min_objects`` boxes (area ≥ ``min_area`` pixels, not ``iscrowd``) are
    kept; item ``i`` picks 2–``max_objects`` of its boxes (seeded by (seed, i)) as the scene and one
    of them as the object. Labels are COCO category ids (unused by the loss).

    Args:
        annotation_file: the COCO-style JSON file.
        image_dir: folder of the images it names.
        min_objects: fewest kept boxes for an image to be used (and per scene).
        max_objects: most boxes per scene.
        min_area: smallest box area in pixels.
        image_size: side of the scene and object tensors.
        seed: seed of each item's choice of boxes.
        **kwargs: ``view_transform``, ``scene_transform``, ``enlarge``, ``glyph_augmentation``.

    Raises:
        FileNotFoundError: a missing file or folder.
        ValueError: not COCO-style, or no image with enough boxes.
    """

    def __init__(self, annotation_file: str, image_dir: str, min_objects: int = 2, max_objects: int = 5,
                 min_area: float = 32 * 32, image_size: int = 224, seed: int = 0, **kwargs: Any):
        super().__init__(image_size=image_size, kind="photo", **kwargs)
        if not os.path.isfile(annotation_file):
            raise FileNotFoundError(f"annotation file not found: {annotation_file}")
        if not os.path.isdir(image_dir):
            raise FileNotFoundError(f"image folder not found: {image_dir}")
        with open(annotation_file) as handle:
            coco = json.load(handle)
        if not isinstance(coco, dict) or "images" not in coco or "annotations" not in coco:
            raise ValueError(f"{annotation_file} is not COCO-style: it needs top-level 'images' and 'annotations'")
        files = {img["id"]: img["file_name"] for img in coco["images"]}
        per_image = {}
        for ann in coco["annotations"]:
            x, y, w, h = ann["bbox"]
            if ann.get("iscrowd", 0) or w * h < min_area:
                continue
            per_image.setdefault(ann["image_id"], []).append(((x, y, x + w, y + h), int(ann.get("category_id", 0))))
        self.items = [(files[i], anns) for i, anns in sorted(per_image.items())
                      if len(anns) >= min_objects and i in files]
        if not self.items:
            raise ValueError(f"{annotation_file}: no image has >= {min_objects} boxes of area >= {min_area}")
        self.image_dir = image_dir
        self.max_objects = max_objects
        self.min_objects = min_objects
        self.seed = seed
        self.labels = np.asarray([anns[0][1] for _, anns in self.items])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        rng = np.random.default_rng([self.seed, index])
        file_name, anns = self.items[index]
        k = int(rng.integers(self.min_objects, min(self.max_objects, len(anns)) + 1))
        picked = rng.choice(len(anns), size=k, replace=False)
        boxes = [anns[p][0] for p in picked]
        chosen = int(rng.integers(k))
        image = Image.open(os.path.join(self.image_dir, file_name)).convert("RGB")
        return self.make_item(image, boxes, chosen, anns[picked[chosen]][1])


def hcl_scene_data(args: Any, say: Callable[[str], None]) -> dict:
    """The data of the HCL recipe: scene/object training items, from ``--annotations`` (COCO-style,
    :class:`CocoSceneObjects`) or composed from the bundled glyphs (:class:`ComposedGlyphScenes`,
    with a line through ``say`` saying so); Recall@K runs on the glyph query/gallery splits
    (at most ``--max-eval-samples`` each) whichever data trains; on the bundled data the scene →
    object check (:func:`scene_object_report`) runs on scenes composed from the query split.

    Why here: the recipe file stays configuration, and this choice of data is reachable by a test.

    Args:
        args: the recipe's parsed arguments (``annotations``, ``images_dir``, ``image_size``,
            ``resize_size``, ``max_objects``, ``canvas_size``, ``max_train_samples``,
            ``max_eval_samples``, ``view_augmentation``, ``seed``).
        say: prints a line on the main process.

    Returns:
        ``{"train_set", "dataset_name", "scene_check_set", "train_eval_set", "data_root", "splits_to_eval",
        "eval_sets"}``, the recipe's attributes of the same names (``scene_check_set`` None with
        ``--annotations``).

    Raises:
        ConfigError: ``--annotations`` without ``--images-dir``, or a file that is not COCO-style.

    Design note: docs/design/training.md
    """
    from ..data import GlyphDataset, build_transforms
    from .config import ConfigError
    from .evaluation import eval_protocol
    from .recipe_data import seeded_subset

    a = args
    if a.annotations:
        if not a.images_dir:
            raise ConfigError("--annotations needs --images-dir (the folder its file_name entries are in)")
        try:
            train_set = CocoSceneObjects(a.annotations, a.images_dir, image_size=a.image_size,
                                         max_objects=max(2, a.max_objects), seed=a.seed)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"{err}. Give a COCO-style file (images, annotations with bbox [x, y, w, h]).")
        dataset_name = "coco"
    else:
        say("[pml-hyperbolic] no --annotations: training on scenes composed from the bundled glyph "
            "dataset. Use --annotations FILE --images-dir DIR for COCO-style data.")
        train_set = ComposedGlyphScenes(GlyphDataset("train"), num_scenes=a.max_train_samples,
                                        canvas_size=a.canvas_size,
                                        max_objects=a.max_objects, image_size=a.image_size, seed=a.seed,
                                        glyph_augmentation=a.view_augmentation)
        dataset_name = "glyphs"
    eval_tf = build_transforms("glyph", train=False, image_size=a.image_size, resize_size=a.resize_size)
    # the scene → object check: scenes composed from the query split's (unseen) characters
    scene_check_set = None if a.annotations else ComposedGlyphScenes(
        GlyphDataset("query"), num_scenes=SCENE_CHECK_SCENES, canvas_size=a.canvas_size, max_objects=a.max_objects,
        image_size=a.image_size, seed=a.seed)
    return {"train_set": train_set, "dataset_name": dataset_name, "scene_check_set": scene_check_set,
            "train_eval_set": GlyphDataset("train", transform=eval_tf), "data_root": None,
            "splits_to_eval": eval_protocol("glyphs"),
            "eval_sets": {s: seeded_subset(GlyphDataset(s, transform=eval_tf), a.max_eval_samples, a.seed)
                          for s in ("query", "gallery")}}


@torch.no_grad()
def scene_object_report(trunk: torch.nn.Module, embedder: torch.nn.Module, scenes: ComposedGlyphScenes,
                        curvature: float, device: Any, batch_size: int = 256,
                        object_encoder: Optional[Tuple[torch.nn.Module, torch.nn.Module]] = None) -> dict:
    """:func:`~pml_hyperbolic.evaluation.scene_object_recall` of a model on ``scenes``: every scene
    through ``embedder(trunk(·))``, every object it contains through ``object_encoder`` (HCL's momentum
    encoder, which makes the loss's object keys; default the same models), both into the ball as HCL's
    hyperbolic branch maps them (:func:`~pml_hyperbolic.geometry.map_to_ball`, no clipping), the
    models in eval mode for the call (their mode restored after).

    Args:
        trunk: the backbone.
        embedder: the projection head.
        scenes: the held-out scenes.
        curvature: c of HCL's ball.
        device: where the models run.
        batch_size: images per forward pass.
        object_encoder: ``(trunk, embedder)`` of the objects; None: ``trunk`` and ``embedder``.

    Returns:
        The dict of :func:`~pml_hyperbolic.evaluation.scene_object_recall`, with ``name``, ``value``
        (its R@1) and ``line`` (the recipe's printed line) added.
    """
    from ..evaluation.scene_object_recall import scene_object_recall
    from ..geometry import map_to_ball

    scene_images, object_images, owner = [], [], []
    for i in range(len(scenes)):
        scene, objects = scenes.scene_and_objects(i)
        scene_images.append(scene)
        object_images.extend(objects)
        owner.extend([i] * len(objects))
    c = torch.tensor(float(curvature), dtype=torch.float32)

    def embed(images, models):
        modes = [m.training for m in models]
        for m in models:
            m.eval()
        try:
            out = [models[1](models[0](torch.stack(images[k:k + batch_size]).to(device))).float().cpu()
                   for k in range(0, len(images), batch_size)]
        finally:
            for m, mode in zip(models, modes):
                m.train(mode)
        return map_to_ball(torch.cat(out), c)

    report = scene_object_recall(embed(scene_images, (trunk, embedder)),
                                 embed(object_images, object_encoder or (trunk, embedder)), torch.tensor(owner), c)
    report.update(name="scene→object R@1", value=report["recall_at_1"],
                  line=(f"scene→object R@1 {report['recall_at_1']:.4f} (chance {report['chance']:.4f}, "
                        f"{report['scenes']} held-out scenes), scenes nearer the origin than their objects "
                        f"{report['scene_nearer_origin']:.2f}, median d₀ scenes {report['scene_d0_median']:.2f} / "
                        f"objects {report['object_d0_median']:.2f}"))
    return report
