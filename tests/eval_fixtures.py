"""Generated COCO ground truth and detections for the evaluation tests (not a test module)."""

from __future__ import annotations

import contextlib
import copy
import io
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
