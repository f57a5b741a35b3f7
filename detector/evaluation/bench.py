"""Timing of the COCO evaluator against pycocotools called directly (for
``tools/benchmark.py --task eval`` and docs/performance.md; not a test).

    python -m detector.evaluation.bench --images 5000 --boxes 30

generates a COCO-like set (``--images`` images, about ``--boxes`` objects and as many
detections per image, 80 classes, all sizes, 1% crowd) and times, in one process,
the same work each way: building the ground-truth index, loading the results,
``evaluate``, ``accumulate``, ``summarize``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import json
import platform
import time
from typing import Any, Dict, List, Tuple

import numpy as np

from .coco import COCO_METRIC_NAMES, coco_evaluate


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
    """The documented pycocotools sequence, nothing else."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

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


def run_benchmark(num_images: int = 5000, boxes_per_image: int = 30, repeats: int = 1, seed: int = 0) -> Dict[str, Any]:
    """Seconds (best of ``repeats``, wall clock and process CPU time) for pycocotools
    direct and our evaluator with each backend, their ratios (also the median of the
    ratios of adjacent runs, robust to load drift), and whether the 12 numbers agree."""
    gt, dets = generate_case(num_images, boxes_per_image, seed=seed)

    runs = {
        "ref": pycocotools_direct,
        "ours": lambda g, d: coco_evaluate(g, d, backend="pycocotools"),
        "fast": lambda g, d: coco_evaluate(g, d, backend="faster"),
    }
    times: Dict[str, List[float]] = {k: [] for k in runs}
    cpu: Dict[str, List[float]] = {k: [] for k in runs}
    outputs: Dict[str, Any] = {}
    for _ in range(repeats):  # interleaved, so drift in machine load hits all three alike
        for name, fn in runs.items():
            # Fresh copies outside the timed region: pycocotools mutates its inputs.
            g, d = copy.deepcopy(gt), copy.deepcopy(dets)
            gc.collect()
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[name] = fn(g, d)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            del g, d
    t_ref, t_ours, t_fast = (min(times[k]) for k in ("ref", "ours", "fast"))
    c_ref, c_ours, c_fast = (min(cpu[k]) for k in ("ref", "ours", "fast"))
    pair_ratios = [o / r for o, r in zip(times["ours"], times["ref"])]
    ref, ours, fast = outputs["ref"], outputs["ours"], outputs["fast"]
    ours_v = np.array([ours.metrics[k] for k in COCO_METRIC_NAMES])
    fast_v = np.array([fast.metrics[k] for k in COCO_METRIC_NAMES])
    return {
        "images": num_images,
        "gt_boxes": len(gt["annotations"]),
        "detections": len(dets),
        "repeats": repeats,
        "pycocotools_direct_s": round(t_ref, 3),
        "ours_pycocotools_s": round(t_ours, 3),
        "ours_faster_s": round(t_fast, 3),
        "ratio_ours_pycocotools": round(t_ours / t_ref, 3),
        "ratio_ours_pycocotools_median_of_pairs": round(float(np.median(pair_ratios)), 3),
        "speedup_faster": round(t_ref / t_fast, 2),
        "cpu_pycocotools_direct_s": round(c_ref, 3),
        "cpu_ours_pycocotools_s": round(c_ours, 3),
        "cpu_ours_faster_s": round(c_fast, 3),
        "cpu_ratio_ours_pycocotools": round(c_ours / c_ref, 3),
        "cpu_speedup_faster": round(c_ref / c_fast, 2),
        "all_wall_s": {k: [round(v, 2) for v in vs] for k, vs in times.items()},
        "max_abs_diff_pycocotools": float(np.max(np.abs(ours_v - ref))),
        "max_abs_diff_faster": float(np.max(np.abs(fast_v - ref))),
        "AP": float(ref[0]),
        "machine": platform.processor() or platform.machine(),
    }


def main(argv: List[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--boxes", type=int, default=30)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    print(json.dumps(run_benchmark(args.images, args.boxes, args.repeats, args.seed), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
