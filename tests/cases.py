"""Generated COCO cases for the tests (not a test module): ground truth and detections,
and the pycocotools reference numbers to compare the project's evaluator with.

- ``make_coco_case``: a small hand-shaped case (5 non-contiguous classes ``CAT_IDS``,
  crowd boxes, small/medium/large objects, images without detections);
- ``pycocotools_stats``: the 12 numbers of ``COCOeval.summarize`` on a case;
- ``generate_results_case``: a case of any size (the results-file and IoU-metric tests);
  run as a script it writes a large case for timing file-mode scoring by hand:

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
import contextlib
import copy
import io
import json
from typing import Any, Dict, List, Tuple

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

CAT_IDS = (1, 3, 7, 8, 12)  # non-contiguous, like COCO's


def make_coco_case(num_images: int = 24, seed: int = 0) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """Ground truth with 5 classes, crowd boxes, small/medium/large objects and
    images without detections; detections near the objects plus false positives."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    for i in range(num_images):
        image_id = 100 + 3 * i
        w, h = int(rng.integers(320, 640)), int(rng.integers(240, 480))
        images.append({"id": image_id, "file_name": f"img_{image_id}.jpg", "width": w, "height": h})
        n = int(rng.integers(0, 7))
        for k in range(n):
            side = float([rng.uniform(8, 30), rng.uniform(35, 90), rng.uniform(100, 200)][k % 3])
            bw, bh = side * rng.uniform(0.7, 1.3), side * rng.uniform(0.7, 1.3)
            bw, bh = min(bw, w - 2), min(bh, h - 2)
            x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            crowd = int(rng.random() < 0.08)
            cat = int(rng.choice(CAT_IDS))
            anns.append(
                {"id": len(anns) + 1, "image_id": image_id, "category_id": cat, "bbox": [x, y, bw, bh],
                 "area": bw * bh, "iscrowd": crowd}
            )
            if i % 5 == 4:
                continue  # every fifth image: no detections at all
            for _ in range(int(rng.integers(0, 3))):
                jit = rng.normal(0, 0.08, 4) * [bw, bh, bw, bh]
                c = cat if rng.random() < 0.85 else int(rng.choice(CAT_IDS))
                dets.append({"image_id": image_id, "category_id": c,
                             "bbox": [x + jit[0], y + jit[1], max(1.0, bw + jit[2]), max(1.0, bh + jit[3])],
                             "score": float(np.round(rng.random(), 3))})
        if i % 5 != 4:
            for _ in range(int(rng.integers(0, 4))):  # false positives
                bw, bh = rng.uniform(10, 150), rng.uniform(10, 150)
                dets.append({"image_id": image_id, "category_id": int(rng.choice(CAT_IDS)),
                             "bbox": [rng.uniform(0, w - bw), rng.uniform(0, h - bh), bw, bh],
                             "score": float(rng.random())})
    cats = [{"id": c, "name": f"class_{c}"} for c in CAT_IDS]
    return {"images": images, "annotations": anns, "categories": cats}, dets


def pycocotools_stats(gt: Dict[str, Any], dets: List[Dict[str, Any]]) -> np.ndarray:
    """The 12 numbers of ``COCOeval(gt, dets, "bbox").summarize()``, pycocotools called
    directly (the reference the project's evaluator is compared with); inputs unchanged."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = copy.deepcopy(gt)
        coco_gt.createIndex()
        ev = COCOeval(coco_gt, coco_gt.loadRes(copy.deepcopy(dets)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.asarray(ev.stats)[:12]


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
