"""Generated COCO cases for the tests: ground truth and a results list of any size.

``generate_results_case`` makes the cases of the results-file and IoU-metric tests; run
as a script it writes a large case for timing file-mode scoring by hand:

    python tests/cases.py --images 5000 --objects 7.3 --dets 400 --out /tmp/c2m
    python tools/eval.py --predictions /tmp/c2m_dets.json --annotations /tmp/c2m_gt.json eval.backend=faster

writes ``<out>_gt.json`` (``--images`` 640x480 images, Poisson(``--objects``) objects
each, 80 classes, 1% crowd; COCO val2017 has 5000 images and 7.3 objects per image) and
``<out>_dets.json`` (``--dets`` detections per image: 30% jittered copies of an object
of the image, 90% of them with its class, the rest random boxes; scores rounded to 4
decimals, so there are ties). Generation is vectorised: 2M detections in ~1 minute.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List, Tuple

import numpy as np


def generate_results_case(num_images: int, objects_per_image: float, dets_per_image: int,
                          num_classes: int = 80, seed: int = 0) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """COCO-format ground truth and a results list (see the module docstring)."""
    rng = np.random.default_rng(seed)
    width, height = 640, 480
    images = [{"id": i + 1, "file_name": f"{i + 1:012d}.jpg", "width": width, "height": height} for i in range(num_images)]
    n = rng.poisson(objects_per_image, num_images)
    img = np.repeat(np.arange(1, num_images + 1), n)
    g = len(img)
    sides = np.minimum(np.exp(rng.uniform(np.log(4), np.log(400), (g, 2))), [width - 1, height - 1])
    xy = rng.uniform(0, 1, (g, 2)) * ([width, height] - sides)
    labels = rng.integers(1, num_classes + 1, g)
    crowd = rng.random(g) < 0.01
    anns = [{"id": k + 1, "image_id": int(img[k]), "category_id": int(labels[k]),
             "bbox": [float(xy[k, 0]), float(xy[k, 1]), float(sides[k, 0]), float(sides[k, 1])],
             "area": float(sides[k, 0] * sides[k, 1]), "iscrowd": int(crowd[k])} for k in range(g)]
    d = num_images * dets_per_image
    det_img = np.repeat(np.arange(1, num_images + 1), dets_per_image)
    starts = np.concatenate([[0], np.cumsum(n)[:-1]])
    count = n[det_img - 1]
    pick = np.minimum(starts[det_img - 1] + (rng.random(d) * np.maximum(count, 1)).astype(np.int64), max(g - 1, 0))
    copy = (count > 0) & (rng.random(d) < 0.3)
    s = sides[pick] if g else np.ones((d, 2))
    jitter = rng.normal(0, 0.1, (d, 4)) * np.c_[s, s]
    box = np.empty((d, 4))
    box[:, :2] = np.where(copy[:, None], (xy[pick] if g else 0) + jitter[:, :2],
                          rng.uniform(0, 1, (d, 2)) * [width - 50, height - 50])
    box[:, 2:] = np.where(copy[:, None], np.maximum(1.0, s + jitter[:, 2:]), np.exp(rng.uniform(np.log(4), np.log(300), (d, 2))))
    cat = rng.integers(1, num_classes + 1, d)
    if g:
        cat = np.where(copy & (rng.random(d) < 0.9), labels[pick], cat)
    score = np.round(rng.random(d), 4)
    box = np.round(box, 2)
    dets = [{"image_id": a, "category_id": c, "bbox": b, "score": sc}
            for a, c, b, sc in zip(det_img.tolist(), cat.tolist(), box.tolist(), score.tolist())]
    cats = [{"id": c, "name": f"class_{c}"} for c in range(1, num_classes + 1)]
    return {"images": images, "annotations": anns, "categories": cats}, dets


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--objects", type=float, default=7.3, help="mean objects per image")
    p.add_argument("--dets", type=int, default=400, help="detections per image")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="prefix: writes <out>_gt.json and <out>_dets.json")
    args = p.parse_args(argv)
    gt, dets = generate_results_case(args.images, args.objects, args.dets, seed=args.seed)
    with open(f"{args.out}_gt.json", "w") as f:
        json.dump(gt, f)
    with open(f"{args.out}_dets.json", "w") as f:
        json.dump(dets, f)
    print(f"{len(gt['annotations'])} objects, {len(dets)} detections: {args.out}_gt.json, {args.out}_dets.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
