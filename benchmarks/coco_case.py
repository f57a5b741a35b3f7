"""A generated COCO-like scoring case and pycocotools called directly: the reference
``--task eval`` times the project's evaluator against."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Dict, List, Tuple

import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def generate_case(
    num_images: int = 5000, boxes_per_image: int = 30, num_classes: int = 80, seed: int = 0
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """COCO-format ground truth and results with about ``boxes_per_image`` objects and
    detections per image (Poisson counts), box sides log-uniform in 4..400 px."""
    rng = np.random.default_rng(seed)
    images, anns, dets = [], [], []
    cats = [{"id": c, "name": f"class_{c}"} for c in range(1, num_classes + 1)]
    for i in range(num_images):
        image_id = i + 1
        w, h = 640, 480
        images.append({"id": image_id, "file_name": f"{image_id:012d}.jpg", "width": w, "height": h})
        n = int(rng.poisson(boxes_per_image))
        sides = np.exp(rng.uniform(np.log(4), np.log(400), size=(n, 2)))
        sides = np.minimum(sides, [w - 1, h - 1])
        xy = rng.uniform(0, 1, size=(n, 2)) * ([w, h] - sides)
        labels = rng.integers(1, num_classes + 1, size=n)
        crowd = rng.random(n) < 0.01
        for k in range(n):
            x, y = float(xy[k, 0]), float(xy[k, 1])
            bw, bh = float(sides[k, 0]), float(sides[k, 1])
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": int(labels[k]),
                         "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": int(crowd[k])})
        # Detections: jittered copies of ~80% of the objects (some with a wrong class), plus noise.
        m = int(rng.poisson(boxes_per_image))
        for k in range(m):
            if n and rng.random() < 0.8:
                j = int(rng.integers(0, n))
                jit = rng.normal(0, 0.1, 4) * np.r_[sides[j], sides[j]]
                box = [float(xy[j, 0] + jit[0]), float(xy[j, 1] + jit[1]),
                       float(max(1.0, sides[j, 0] + jit[2])), float(max(1.0, sides[j, 1] + jit[3]))]
                cat = int(labels[j]) if rng.random() < 0.9 else int(rng.integers(1, num_classes + 1))
            else:
                bw, bh = (float(v) for v in np.exp(rng.uniform(np.log(4), np.log(300), 2)))
                box = [float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh)), bw, bh]
                cat = int(rng.integers(1, num_classes + 1))
            dets.append({"image_id": image_id, "category_id": cat, "bbox": box, "score": float(rng.random())})
    return {"images": images, "annotations": anns, "categories": cats}, dets


def pycocotools_direct(gt: Dict[str, Any], dets: List[Dict[str, Any]]) -> np.ndarray:
    """The documented pycocotools sequence, nothing else. Returns the 12 numbers of
    ``COCOeval.summarize``."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = gt
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(dets)
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.asarray(ev.stats)[:12]
