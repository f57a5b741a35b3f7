"""COCO box metrics through pycocotools (or faster-coco-eval, same numbers).

Input is plain data:

- ground truth: a COCO-format dict (``images``, ``annotations``, ``categories``) in
  original image coordinates, as ``dataset.coco_gt()`` returns or a COCO JSON file holds;
- detections: a list of results ``{"image_id", "category_id", "bbox": [x, y, w, h],
  "score"}`` with the ground truth's image and category ids.

``coco_evaluate`` returns the twelve numbers of ``COCOeval.summarize()`` under their
usual names, the per-class AP, and the precision array for curves. The third-party
libraries print progress to stdout; that output is captured and sent to the debug log,
so a run's console shows our table only.

Semantics follow pycocotools exactly: ``-1`` means "no ground truth in that range"
(e.g. APs when no object is small), crowd boxes (``iscrowd: 1``) are ignored regions,
the ``ignore`` field of an annotation is overridden by ``iscrowd``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

logger = logging.getLogger(__name__)

COCO_METRIC_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
BACKENDS = ("pycocotools", "faster")


class UnknownImageError(ValueError):
    """A detection names an image id that the ground truth does not have."""


@dataclass
class CocoEvalResult:
    """Output of :func:`coco_evaluate`.

    Attributes:
        metrics: the 12 summary numbers, keys ``COCO_METRIC_NAMES``.
        per_class_ap: category id -> AP@[.5:.95] (all areas, 100 dets); ``-1`` when the
            class has no ground truth.
        per_class_ap50: category id -> AP@0.5.
        precision: ``COCOeval.eval["precision"]``, shape [T=10, R=101, K, A=4, M=3]
            (IoU thresholds x recall thresholds x classes x areas x max dets), ``-1`` where
            undefined; None when there was nothing to evaluate.
        cat_ids: the category ids in the order of the K axis.
        rec_thrs: the 101 recall thresholds (0, 0.01, ..., 1).
    """

    metrics: Dict[str, float]
    per_class_ap: Dict[int, float] = field(default_factory=dict)
    per_class_ap50: Dict[int, float] = field(default_factory=dict)
    precision: Optional[np.ndarray] = None
    cat_ids: List[int] = field(default_factory=list)
    rec_thrs: Optional[np.ndarray] = None


def _backend_classes(backend: str):
    if backend == "pycocotools":
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval

        return COCO, COCOeval
    if backend == "faster":
        try:
            from faster_coco_eval import COCO, COCOeval_faster
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "eval.backend=faster needs the 'faster-coco-eval' package (pip install faster-coco-eval)"
            ) from exc
        return COCO, COCOeval_faster
    raise ValueError(f"eval.backend must be one of {BACKENDS}; got {backend!r}")


def check_ground_truth(gt: Dict[str, Any], source: str = "ground truth") -> None:
    """Raise ValueError naming the first missing section or field of a COCO gt dict."""
    if not isinstance(gt, dict):
        raise ValueError(f"{source}: expected a COCO dict with 'images', 'annotations', 'categories'; got {type(gt).__name__}")
    for key in ("images", "annotations", "categories"):
        if key not in gt:
            raise ValueError(f"{source}: missing the '{key}' section")
    image_ids = {img["id"] for img in gt["images"]}
    cat_ids = {cat["id"] for cat in gt["categories"]}
    for i, ann in enumerate(gt["annotations"]):
        for key in ("image_id", "category_id", "bbox"):
            if key not in ann:
                raise ValueError(f"{source}: annotations[{i}] has no '{key}'")
        if len(ann["bbox"]) != 4:
            raise ValueError(f"{source}: annotations[{i}].bbox must be [x, y, w, h]; got {ann['bbox']!r}")
        if ann["image_id"] not in image_ids:
            raise ValueError(f"{source}: annotations[{i}] has image_id {ann['image_id']!r}, which is not in 'images'")
        if ann["category_id"] not in cat_ids:
            raise ValueError(f"{source}: annotations[{i}] has category_id {ann['category_id']!r}, which is not in 'categories'")


def check_results(results: Sequence[Dict[str, Any]], gt: Dict[str, Any], source: str = "detections") -> None:
    """Check that every result is well formed and names a ground-truth image and class.

    Raises:
        UnknownImageError: a result's ``image_id`` is not among the gt images (named).
        ValueError: a missing field, a bad bbox, or an unknown ``category_id`` (named).
    """
    image_ids = {img["id"] for img in gt["images"]}
    cat_ids = {cat["id"] for cat in gt["categories"]}
    for i, res in enumerate(results):
        if not isinstance(res, dict):
            raise ValueError(f"{source}: result {i} is not an object: {res!r}")
        for key in ("image_id", "category_id", "bbox", "score"):
            if key not in res:
                raise ValueError(f"{source}: result {i} has no '{key}'")
        if res["image_id"] not in image_ids:
            raise UnknownImageError(
                f"{source}: result {i} has image_id {res['image_id']!r}, which is not in the ground truth "
                f"({len(image_ids)} images)"
            )
        if res["category_id"] not in cat_ids:
            raise ValueError(
                f"{source}: result {i} has category_id {res['category_id']!r}, which is not in the ground-truth "
                f"categories {sorted(cat_ids)}"
            )
        bbox = res["bbox"]
        if len(bbox) != 4 or not all(math.isfinite(v) for v in bbox):
            raise ValueError(f"{source}: result {i} has a bad bbox {bbox!r} (need 4 finite numbers [x, y, w, h])")


def _gt_copy(gt: Dict[str, Any]) -> Dict[str, Any]:
    """A copy the COCO libraries may mutate (they write ``ignore`` into annotations),
    with ``area``, ``iscrowd`` and ``id`` filled where missing."""
    anns = []
    for i, ann in enumerate(gt["annotations"]):
        a = dict(ann)
        if "area" not in a:
            a["area"] = float(a["bbox"][2]) * float(a["bbox"][3])
        a.setdefault("iscrowd", 0)
        a.setdefault("id", i + 1)
        anns.append(a)
    out = {k: v for k, v in gt.items() if k != "annotations"}
    out["annotations"] = anns
    return out


def build_coco(gt: Dict[str, Any], backend: str = "pycocotools"):
    """A ``COCO`` object of the chosen backend from a gt dict (not mutated)."""
    COCO, _ = _backend_classes(backend)
    coco = COCO()
    coco.dataset = _gt_copy(gt)
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _empty_results(coco_gt, backend: str):
    """A results object with no detections (pycocotools' ``loadRes([])`` crashes)."""
    COCO, _ = _backend_classes(backend)
    dt = COCO()
    dt.dataset = {
        "images": list(coco_gt.dataset["images"]),
        "categories": list(coco_gt.dataset["categories"]),
        "annotations": [],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        dt.createIndex()
    return dt


def _mean_valid(values: np.ndarray) -> float:
    valid = values[values > -1]
    return float(np.mean(valid)) if valid.size else -1.0


def coco_evaluate(
    gt: Dict[str, Any],
    results: Sequence[Dict[str, Any]],
    backend: str = "pycocotools",
    check: bool = True,
) -> CocoEvalResult:
    """Run ``COCOeval`` on boxes and return the 12 numbers and per-class AP.

    Args:
        gt: COCO-format ground-truth dict (not mutated).
        results: COCO results list, bbox ``[x, y, w, h]`` in original pixels (not mutated).
        backend: ``"pycocotools"`` or ``"faster"`` (faster-coco-eval).
        check: validate ``results`` against ``gt`` first (see :func:`check_results`).

    Returns:
        CocoEvalResult. Empty ``results`` give AP/AR 0 (or -1 where there is no ground
        truth) instead of pycocotools' crash.
    """
    _, COCOeval = _backend_classes(backend)
    check_ground_truth(gt)
    if check:
        check_results(results, gt)
    coco_gt = build_coco(gt, backend)
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        if len(results) == 0:
            coco_dt = _empty_results(coco_gt, backend)
        else:
            # Shallow copies: loadRes adds 'area', 'id', 'segmentation' to each result.
            coco_dt = coco_gt.loadRes([dict(r) for r in results])
        if backend == "faster":
            evaluator = COCOeval(coco_gt, coco_dt, "bbox", print_function=logger.debug)
        else:
            evaluator = COCOeval(coco_gt, coco_dt, "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    if log.getvalue():
        logger.debug("%s output:\n%s", backend, log.getvalue().rstrip())

    stats = [float(v) for v in np.asarray(evaluator.stats)[: len(COCO_METRIC_NAMES)]]
    metrics = dict(zip(COCO_METRIC_NAMES, stats))
    precision = np.asarray(evaluator.eval["precision"])
    cat_ids = [int(c) for c in evaluator.params.catIds]
    iou_thrs = np.asarray(evaluator.params.iouThrs)
    i50 = int(np.argmin(np.abs(iou_thrs - 0.5)))
    per_class_ap = {}
    per_class_ap50 = {}
    for k, cat in enumerate(cat_ids):
        # all areas (index 0), the largest max-dets setting (index -1): summarize()'s AP.
        per_class_ap[cat] = _mean_valid(precision[:, :, k, 0, -1])
        per_class_ap50[cat] = _mean_valid(precision[i50, :, k, 0, -1])
    return CocoEvalResult(
        metrics=metrics,
        per_class_ap=per_class_ap,
        per_class_ap50=per_class_ap50,
        precision=precision,
        cat_ids=cat_ids,
        rec_thrs=np.asarray(evaluator.params.recThrs),
    )


def boxes_to_results(
    image_id: int,
    boxes: np.ndarray,
    scores: np.ndarray,
    category_ids: Sequence[int],
) -> List[Dict[str, Any]]:
    """Detections of one image in COCO results format.

    Args:
        boxes: [M, 4] xyxy, original-image pixels.
        scores: [M].
        category_ids: [M] original category ids.
    """
    out = []
    for (x1, y1, x2, y2), s, c in zip(np.asarray(boxes, dtype=np.float64).tolist(), np.asarray(scores).tolist(), category_ids):
        out.append(
            {
                "image_id": int(image_id),
                "category_id": int(c),
                "bbox": [x1, y1, x2 - x1, y2 - y1],
                "score": float(s),
            }
        )
    return out
